"""Every `$ meshlm ...` command in docs/data.md, run as a user would in a fresh directory.

prepare and tokenizer commands run in a fresh process, in order (one process for all: tests/cli_batch.py);
the first train command too (a few steps of a tiny model); later train commands resolve their config and build
their datasets in-process, which is the part of training those examples are about."""

from __future__ import annotations

import json
import shlex
import tomllib

from meshlm.core.config import load_config
from meshlm.data import build_datasets
from meshlm.data.assets import shakespeare_files
from meshlm.data.build import parse_paths
from meshlm.data.gpt_dataset import BlendedDataset
from meshlm.data.indexed import IndexedDataset
from meshlm.data.prepare import prepare
from tests.cli_batch import run_meshlm_batch
from tests.conftest import ROOT

DOC = ROOT / "docs" / "data.md"
TINY = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32", "--train.micro_batch_size=2",
        "--train.global_batch_size=4", "--train.eval_iters=2", "--train.peak_tflops=1", "--train.max_steps=2",
        "--train.sample_tokens=0", "--train.progress=false"]


def documented_commands() -> list[list[str]]:
    return [shlex.split(line[2:]) for line in DOC.read_text().splitlines() if line.startswith("$ meshlm ")]


def write_corpus(path, n_docs=300):
    plays = sorted(shakespeare_files(), key=lambda f: f.stat().st_size)[:4]
    speeches = [s.strip() for p in plays for s in p.read_text().split("\n\n") if len(s.strip()) > 40]
    with open(path, "w") as fh:
        fh.writelines(json.dumps({"id": i, "text": s}) + "\n" for i, s in enumerate(speeches[:n_docs]))


def test_every_documented_command_works(tmp_path, monkeypatch):
    commands = documented_commands()
    assert [c[1] for c in commands] == ["prepare", "train", "tokenizer", "prepare", "train", "train", "prepare"]
    write_corpus(tmp_path / "my_corpus.jsonl")
    prepare([str(shakespeare_files()[0])], "gpt2", str(tmp_path / "data" / "my_corpus_2"), append_eod=True,
            progress=False)
    first_train = next(i for i, argv in enumerate(commands) if argv[1] == "train")
    run = [i for i, argv in enumerate(commands) if argv[1] != "train" or i == first_train]
    # The commands run in their order in one process (tests/cli_batch.py); the later train commands only read
    # what they wrote, so they are checked after.
    results = run_meshlm_batch([[*commands[i][1:], *(TINY + [f"--train.out_dir={tmp_path / 'run'}"]
                                                   if i == first_train else [])] for i in run], cwd=tmp_path)
    for i, result in zip(run, results):
        assert result.returncode == 0, f"{shlex.join(commands[i])}\n{result.stderr}"
    assert "val loss" in results[run.index(first_train)].stdout
    monkeypatch.chdir(tmp_path)
    for argv in commands[first_train + 1:]:
        args = argv[1:]
        if args[0] == "train":
            overrides = [a for a in args if a.startswith("--") and "." in a.split("=")[0]]
            cfg = load_config(args[args.index("--config") + 1], overrides + TINY)
            tok, train, _ = build_datasets(cfg, progress=False)
            assert cfg.model.vocab_size >= tok.vocab_size and len(train) >= 8
    assert isinstance(train, BlendedDataset) and train.weights == [0.7, 0.3]
    sentences = IndexedDataset(tmp_path / "data" / "my_corpus_bert")  # the BERT example: a sequence per sentence
    assert sentences.n_documents == 300 and sentences.n_sequences > 300


def test_documented_toml_blend_parses():
    block = DOC.read_text().split("```toml\n")[1].split("```")[0]
    paths = load_config_paths(block)
    assert parse_paths(paths) == [(0.7, "data/web"), (0.3, "data/books")]


def load_config_paths(toml_text: str) -> list[str]:
    from meshlm.core.config import build

    return build({"data": tomllib.loads(toml_text)["data"]}).data.paths
