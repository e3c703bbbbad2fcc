"""What `meshlm convert --from-hf/--to-hf` and `meshlm embed` refuse: one line `error: ...` naming the
field or file and the fix, exit code 2, and nothing written (no run directory, no output file, no
temporary left beside them)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from interop_helpers import ok, one_error_line, perturbed

from tests.conftest import run_cli

transformers = pytest.importorskip("transformers")
SEQ = 16


def _bert_dir(path, **overrides):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=SEQ, **overrides)
    perturbed(transformers.BertModel(cfg)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    ok(["convert", "--from-hf", str(_bert_dir(root / "hf")), "--out", str(root / "run")])
    return root / "run"


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt")
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=SEQ, n_embd=32, n_layer=1, n_head=4)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(root / "hf"))
    ok(["convert", "--from-hf", str(root / "hf"), "--out", str(root / "run")])
    return root / "run"


def _nothing_written(folder, *keep):
    assert sorted(p.name for p in folder.iterdir()) == sorted(keep), "no output and no temporary left"


# ---- convert --from-hf --------------------------------------------------------------------------------------
def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, words", [
    ({"architectures": ["BertForMultipleChoice"]}, ["architectures", "BertForMultipleChoice", "BertForMaskedLM"]),
    ({"hidden_act": "relu"}, ["hidden_act='relu'", "gelu"]),
    ({"position_embedding_type": "relative_key"}, ["position_embedding_type", "absolute"]),
    ({"model_type": "t5"}, ["model_type='t5'", "'bert'"]),
    ({"num_hidden_layers": 2}, ["missing", "encoder.layer.1"]),
    ({"architectures": ["BertModel", "BertForMaskedLM"]}, ["several"]),
])
def test_unconvertible_bert_directories(tmp_path, changes, words):
    hf = _bert_dir(tmp_path / "hf")
    _edit_config(hf, **changes)
    one_error_line(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")], *words)
    _nothing_written(tmp_path, "hf")


def test_tanh_gelu_converts_without_an_mlm_head_only(tmp_path):
    hf = _bert_dir(tmp_path / "hf", hidden_act="gelu_new")
    ok(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")])
    _edit_config(hf, architectures=["BertForMaskedLM"])
    one_error_line(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "mlm")], "hidden_act='gelu_new'", "MLM")


def test_missing_files(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    one_error_line(["convert", "--from-hf", str(empty), "--out", str(tmp_path / "run")], "config.json", "missing")
    one_error_line(["convert", "--from-hf", str(tmp_path / "nope"), "--out", str(tmp_path / "run")],
                   "not a directory")
    hf = _bert_dir(tmp_path / "hf")
    (hf / "model.safetensors").unlink()
    one_error_line(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")], "model.safetensors",
                   "pytorch_model.bin")
    (hf / "model.safetensors").write_bytes(b"not safetensors")
    one_error_line(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")], "cannot be read")
    (hf / "config.json").write_text("{broken")
    one_error_line(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")], "config.json", "JSON")
    _nothing_written(tmp_path, "empty", "hf")


@pytest.mark.parametrize("modules, pooling, words", [
    (["Transformer", "Pooling", "Dense", "Normalize"], {"pooling_mode_mean_tokens": True}, ["Dense"]),
    (["Transformer", "Pooling"], {"pooling_mode_max_tokens": True}, ["pooling", "max_tokens"]),
    (["Transformer", "Pooling"], {"pooling_mode": ["mean", "cls"]}, ["pooling"]),
])
def test_unsupported_sentence_transformers_modules(tmp_path, modules, pooling, words):
    hf = _bert_dir(tmp_path / "hf")
    entries = [{"idx": i, "name": str(i), "path": "" if i == 0 else f"{i}_{m}",
                "type": f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]
    (hf / "modules.json").write_text(json.dumps(entries))
    (hf / "1_Pooling").mkdir()
    (hf / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    one_error_line(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")], *words)
    _nothing_written(tmp_path, "hf")


def test_sentence_transformers_cls_pooling_is_read(tmp_path):
    hf = _bert_dir(tmp_path / "hf")
    (hf / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (hf / "1_Pooling").mkdir()
    (hf / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    ok(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")])
    config = json.loads((tmp_path / "run" / "checkpoints" / "step_0000000" / "config.json").read_text())
    assert (config["model"]["pooling"], config["model"]["normalize_embeddings"]) == ("cls", False)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=SEQ, n_embd=32, n_layer=1, n_head=4)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(tmp_path / "hf"))
    one_error_line(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")],
                   "50257 tokens", "vocab_size=97", "--tokenizer")
    _nothing_written(tmp_path, "hf")


def test_targets_must_be_new_and_modes_single(tmp_path, bert_run):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    hf = _bert_dir(tmp_path / "hf")
    one_error_line(["convert", "--from-hf", str(hf), "--out", str(full)], "--out", "not empty")
    one_error_line(["convert", "--checkpoint", str(bert_run), "--to-hf", str(full)], "--to-hf", "not empty")
    assert (full / "keep.txt").read_text() == "mine"
    one_error_line(["convert"], "one of --to-single, --to-hf, --from-hf")
    one_error_line(["convert", "--checkpoint", str(bert_run), "--to-hf", str(tmp_path / "a"), "--from-hf", str(hf)],
                   "--to-hf, --from-hf")
    one_error_line(["convert", "--from-hf", str(hf)], "--out")
    one_error_line(["convert", "--checkpoint", str(bert_run), "--to-hf", str(tmp_path / "b"), "--out", "x"],
                   "--checkpoint")
    one_error_line(["convert", "--checkpoint", str(tmp_path / "nope"), "--to-hf", str(tmp_path / "c")],
                   "no checkpoint")
    _nothing_written(tmp_path, "full", "hf")


# ---- embed --------------------------------------------------------------------------------------------------
def test_embed_refuses_a_gpt_checkpoint(tmp_path, gpt_run):
    (tmp_path / "t.txt").write_text("hello\n")
    one_error_line(["embed", "--checkpoint", str(gpt_run), "--input", str(tmp_path / "t.txt"), "--output",
                    str(tmp_path / "v.npy")], "BERT checkpoint", "model.family='gpt'")
    _nothing_written(tmp_path, "t.txt")


def test_embed_text_longer_than_the_model(tmp_path, bert_run):
    texts = tmp_path / "t.txt"
    texts.write_text("short one\n" + "many words " * 20 + "\nshort two\n")
    argv = ["embed", "--checkpoint", str(bert_run), "--input", str(texts), "--output", str(tmp_path / "v.npy")]
    one_error_line(argv, "line 2", f"model.seq_len={SEQ}", "--truncate")
    _nothing_written(tmp_path, "t.txt")
    ok([*argv, "--truncate"])
    vectors = np.load(tmp_path / "v.npy")
    assert vectors.shape == (3, 32) and np.isfinite(vectors).all()
    (tmp_path / "v.npy").unlink()
    ok([*argv[:-2], "--output", str(tmp_path / "cut.npy"), "--truncate", "--max-length", "5"])
    ok([*argv[:-2], "--output", str(tmp_path / "full.npy"), "--truncate"])
    cut, full = np.load(tmp_path / "cut.npy"), np.load(tmp_path / "full.npy")
    assert np.allclose(cut[[0, 2]], full[[0, 2]], atol=1e-6), "texts within 5 tokens are not cut"
    assert not np.allclose(cut[1], full[1], atol=1e-3), "--max-length cuts the long text shorter"


@pytest.mark.parametrize("content, name, words", [
    ("", "t.txt", ["holds no text"]),
    ('{"text": "a"}\n{"txt": "b"}\n', "t.jsonl", ["line 2", "'text'"]),
    ('{"text": "a"}\nnot json\n', "t.jsonl", ["line 2", "not JSON"]),
    (None, "missing.txt", ["does not exist"]),
    (b"\xff\xfe bytes", "t.txt", ["not UTF-8"]),
])
def test_embed_bad_input_files(tmp_path, bert_run, content, name, words):
    if isinstance(content, bytes):
        (tmp_path / name).write_bytes(content)
    elif content is not None:
        (tmp_path / name).write_text(content)
    one_error_line(["embed", "--checkpoint", str(bert_run), "--input", str(tmp_path / name), "--output",
                    str(tmp_path / "v.npy")], *words)
    assert not (tmp_path / "v.npy").exists()


@pytest.mark.parametrize("extra, words", [
    (["--output", "{dir}/v.csv"], [".npy", ".jsonl"]),
    (["--output", "{dir}/no/such/v.npy"], ["does not exist"]),
    (["--output", "{dir}/v.npy", "--max-length", "99"], ["--max-length 99", f"3..{SEQ}"]),
    (["--output", "{dir}/v.npy", "--batch-size", "0"], ["--batch-size"]),
])
def test_embed_bad_arguments(tmp_path, bert_run, extra, words):
    (tmp_path / "t.txt").write_text("hello\n")
    extra = [a.format(dir=tmp_path) for a in extra]
    one_error_line(["embed", "--checkpoint", str(bert_run), "--input", str(tmp_path / "t.txt"), *extra], *words)
    _nothing_written(tmp_path, "t.txt")


def test_embed_errors_as_a_user_sees_them(tmp_path, gpt_run):
    """The console script: one line on stderr, exit 2, no traceback."""
    (tmp_path / "t.txt").write_text("hello\n")
    proc = run_cli("embed", "--checkpoint", str(gpt_run), "--input", str(tmp_path / "t.txt"), "--output",
                   str(tmp_path / "v.jsonl"), timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    _nothing_written(tmp_path, "t.txt")


def test_files_in_the_working_directory_are_not_taken_for_carried_ones(tmp_path, monkeypatch):
    """A checkpoint on the bundled `bert` tokenizer, outside a run's checkpoints/, reads no
    sentence_bert_config.json / config.json from wherever the command runs."""
    from meshlm.interop.hf_files import carried_labels, checkpoint_files, max_seq_length

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 7}))
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"0": "a", "1": "b"}}))
    assert checkpoint_files(tmp_path / "step", "bert") is None
    assert max_seq_length(None) is None and carried_labels(None, 2) is None
    assert checkpoint_files(tmp_path / "step", str(tmp_path / "config.json")) == tmp_path
    assert max_seq_length(tmp_path) == 7 and carried_labels(tmp_path, 2)["id2label"] == {"0": "a", "1": "b"}
