"""The one door to a checkpoint: each command resolves and verifies its `--checkpoint` once, so a fallback
past a corrupt newest step is said once, and the step it falls back to is verified once."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

import meshlm.checkpoint.files
import meshlm.checkpoint.single
from meshlm.checkpoint.files import step_name
from meshlm.checkpoint.single import save_checkpoint
from meshlm.cli import main
from meshlm.models.gpt import GPT
from tests.tune.tune_helpers import QUIET, base_config, repeat_rows, run, save_base, write_jsonl


def add_corrupt_step(out: Path, step: int) -> Path:
    """A newer checkpoint of run `out` whose model.pt was truncated after publishing (as tests/reliability do)."""
    cfg = base_config(out)
    gpt = GPT(cfg.model)
    path = save_checkpoint(out, step, {"model": gpt.state_dict(), "optim": {}, "state": {"step": step}}, cfg.to_dict())
    data = (path / "model.pt").read_bytes()
    (path / "model.pt").unlink()  # replaced, never modified in place
    (path / "model.pt").write_bytes(data[:len(data) // 2])
    return path


@pytest.fixture
def verified(monkeypatch):
    """Counts of `files.verify` calls by checkpoint directory name (every caller: files.py looks it up in its
    module, single.py in its own)."""
    counts: collections.Counter = collections.Counter()
    real = meshlm.checkpoint.files.verify

    def counting(path, *args, **kwargs):
        counts[Path(path).name] += 1
        return real(path, *args, **kwargs)

    monkeypatch.setattr(meshlm.checkpoint.files, "verify", counting)
    monkeypatch.setattr(meshlm.checkpoint.single, "verify", counting)
    return counts


@pytest.fixture
def fallen_back(tmp_path):
    """A run whose newest step (2) is corrupt and step 0 is whole."""
    run_dir = save_base(tmp_path / "run")
    add_corrupt_step(run_dir, 2)
    return run_dir


def fallback_notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("note:") and step_name(2) in line]


def test_generate_says_the_fallback_once_and_verifies_once(fallen_back, verified, capsys):
    assert main(["generate", "--checkpoint", str(fallen_back), "--prompt", "say", "--max-new-tokens", "2",
                 "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert len(fallback_notes(err)) == 1, err
    assert verified[step_name(0)] == 1 and verified[step_name(2)] == 1, verified


def test_eval_says_the_fallback_once_and_verifies_once(fallen_back, verified, capsys, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("say gold: gold. say red: red. " * 8)
    assert main(["eval", "--checkpoint", str(fallen_back), "--task", "perplexity", "--data", str(text)]) == 0
    err = capsys.readouterr().err
    assert len(fallback_notes(err)) == 1, err
    assert verified[step_name(0)] == 1 and verified[step_name(2)] == 1, verified


def test_serve_with_an_adapter_opens_the_base_once(tmp_path, monkeypatch, capsys):
    from meshlm.infer.server import build_server

    base = save_base(tmp_path / "base")
    train = write_jsonl(tmp_path / "train.jsonl", repeat_rows(8, 1))
    code, _, err = run("tune", "--checkpoint", str(base), "--method", "lora", "--train", str(train), "--valid",
                       str(train), "--out", str(tmp_path / "lora"), "--max-length", "16", *QUIET,
                       "--train.max_steps=1")
    assert code == 0, err
    add_corrupt_step(base, 2)  # the base now falls back to step 0, the step the adapter was tuned on
    counts: collections.Counter = collections.Counter()
    real = meshlm.checkpoint.files.verify
    monkeypatch.setattr(meshlm.checkpoint.files, "verify",
                        lambda path, *a, **k: counts.update([Path(path).name]) or real(path, *a, **k))
    monkeypatch.setattr(meshlm.checkpoint.single, "verify", meshlm.checkpoint.files.verify)
    capsys.readouterr()
    server = build_server(str(base), max_seqs=2, adapters=[f"tuned={tmp_path / 'lora'}"])
    assert server is not None
    err = capsys.readouterr().err
    assert len(fallback_notes(err)) == 1, err
    assert counts[step_name(0)] == 1 and counts[step_name(2)] == 1, counts
