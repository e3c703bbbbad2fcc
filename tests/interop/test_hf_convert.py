"""`meshlm convert --from-hf` and `--to-hf` on small Hugging Face models of every class meshlm converts,
built offline from configs and saved with `save_pretrained`.

Every parameter is perturbed (`perturbed`), so a dropped, swapped or mis-stacked tensor shows far above the
1e-5 tolerance (`test_every_bert_tensor_moves_the_outputs` checks the comparison is that sensitive). Each
model is imported as a user does (the CLI), compared with `transformers` on a padded two-segment batch,
exported again and loaded by `from_pretrained` into the same class with no missing or unexpected keys,
to the very tensors it started from.
"""

from __future__ import annotations

import pytest
import torch
from interop_helpers import assert_same_state, load_whole, ok, perturbed
from safetensors.torch import load_file

from meshlm.data.tokenizers import get_tokenizer
from meshlm.interop.hf_files import bpe_merges
from meshlm.models.bert import pack_inputs
from tests.checkpoint_helpers import load_run

transformers = pytest.importorskip("transformers")
TOL = 1e-5
SEQ = 16
GPT2_VOCAB, BERT_VOCAB = 50257, 30522  # the bundled tokenizers' sizes: the imports record gpt2 / bert


def _save(model, path):
    model.save_pretrained(str(path))
    return path


def _import(hf_dir, run):
    ok(["convert", "--from-hf", str(hf_dir), "--out", str(run)])
    model, _, cfg = load_run(str(run))
    return model, cfg


def _export(run, out):
    ok(["convert", "--checkpoint", str(run), "--to-hf", str(out)])
    return out


# ---- GPT-2 and Llama ----------------------------------------------------------------------------------------
def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=GPT2_VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return perturbed(transformers.GPT2LMHeadModel(cfg))


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=GPT2_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False, rope_theta=500.0)
    return perturbed(transformers.LlamaForCausalLM(cfg))


@pytest.mark.parametrize("make, cls", [(_gpt2, "GPT2LMHeadModel"), (_llama, "LlamaForCausalLM")])
def test_causal_lm_converts_both_ways(make, cls, tmp_path):
    hf = make()
    model, cfg = _import(_save(hf, tmp_path / "hf"), tmp_path / "run")
    assert cfg.model.family == "gpt" and cfg.data.tokenizer == "gpt2"
    ids = torch.randint(0, GPT2_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        assert float((model(ids) - want).abs().max()) <= TOL
        back = load_whole(getattr(transformers, cls), _export(tmp_path / "run", tmp_path / "out"))
        assert_same_state(back.state_dict(), hf.state_dict())
        assert torch.equal(back(ids).logits, want)


def test_exported_gpt2_tokenizer_equals_meshlm_gpt2(tmp_path):
    """The bundled tiktoken ranks, written as vocab.json + merges.txt + tokenizer.json, tokenize as meshlm does
    (but for the text `<|endoftext|>`, which `transformers` reads as the special token, meshlm as text)."""
    _import(_save(_gpt2(), tmp_path / "hf"), tmp_path / "run")
    out = _export(tmp_path / "run", tmp_path / "out")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = get_tokenizer("gpt2")
    texts = ["ROMEO.\nBut soft, what light through yonder window breaks?", "  spaces\t\ttabs\n\n\nnewlines  ",
             "naïve café 日本語 🙂 1234567 don't <|endoftext", ""]
    for text in texts:
        assert hf_tok(text)["input_ids"] == ours.encode(text), text
    assert hf_tok.eos_token_id == ours.eod_id == 50256
    assert get_tokenizer(str(out / "tokenizer.json")).encode(texts[2]) == ours.encode(texts[2])


def test_bpe_merges_are_recovered_from_ranks():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"abc": 4, b"bc": 5, b"bcbc": 6}
    assert bpe_merges(ranks) == [(b"a", b"b"), (b"ab", b"c"), (b"b", b"c"), (b"bc", b"bc")]
    with pytest.raises(ValueError, match="cannot be built"):
        bpe_merges({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


# ---- BERT, every head ---------------------------------------------------------------------------------------
BERT_CLASSES = {"BertModel": "encoder", "BertForMaskedLM": "mlm", "BertForPreTraining": "pretrain",
                "BertForSequenceClassification": "classify", "BertForTokenClassification": "tokens",
                "BertForQuestionAnswering": "span"}


def _bert(cls: str, **overrides):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=BERT_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12,
                                  num_labels={"BertForSequenceClassification": 3,
                                              "BertForTokenClassification": 5}.get(cls, 2), **overrides)
    if cls == "BertForSequenceClassification":  # named classes: the export keeps the names
        cfg.id2label, cfg.label2id = {0: "neg", 1: "neutral", 2: "pos"}, {"neg": 0, "neutral": 1, "pos": 2}
    return perturbed(getattr(transformers, cls)(cfg))


def _batch():
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1000, BERT_VOCAB, (3, SEQ), generator=gen)
    lengths = torch.tensor([SEQ, 9, 4])
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    types = ((torch.arange(SEQ)[None] >= (lengths[:, None] // 2)) & mask.bool()).long()  # two segments
    return {"input_ids": ids * mask, "token_type_ids": types, "attention_mask": mask}


def _hf_outputs(hf, batch) -> list[torch.Tensor]:
    out = hf(**batch)
    name = type(hf).__name__
    if name == "BertModel":
        return [out.last_hidden_state]
    if name == "BertForPreTraining":
        return [out.prediction_logits, out.seq_relationship_logits]
    if name == "BertForQuestionAnswering":
        return [torch.stack([out.start_logits, out.end_logits], dim=-1)]
    return [out.logits]


def _ours(model, batch) -> list[torch.Tensor]:
    out = model(pack_inputs(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]))
    return list(out) if isinstance(out, tuple) else [out]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor], mask: torch.Tensor) -> float:
    """Max |a - b| over per-sequence outputs and the real tokens of per-token ones (a padded position's
    output is meaningless)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        d = (x - y).abs()
        worst = max(worst, float((d[mask.bool()] if d.dim() >= 3 else d).max()))
    return worst


@pytest.mark.parametrize("cls", sorted(BERT_CLASSES))
def test_bert_converts_both_ways(cls, tmp_path):
    hf = _bert(cls)
    model, cfg = _import(_save(hf, tmp_path / "hf"), tmp_path / "run")
    assert (cfg.model.family, cfg.model.bert_head, cfg.data.tokenizer) == ("bert", BERT_CLASSES[cls], "bert")
    batch = _batch()
    with torch.no_grad():
        want = _hf_outputs(hf, batch)
        assert _max_diff(_ours(model, batch), want, batch["attention_mask"]) <= TOL
        out = _export(tmp_path / "run", tmp_path / "out")
        back = load_whole(getattr(transformers, cls), out)
        assert_same_state(back.state_dict(), hf.state_dict())
        assert all(torch.equal(x, y) for x, y in zip(_hf_outputs(back, batch), want))
        auto = transformers.AutoConfig.from_pretrained(str(out))
        assert auto.architectures == [cls] and auto.id2label == hf.config.id2label


def test_untied_mlm_head_converts_both_ways(tmp_path):
    hf = _bert("BertForMaskedLM", tie_word_embeddings=False)
    assert not torch.equal(hf.cls.predictions.decoder.weight, hf.bert.embeddings.word_embeddings.weight)
    model, cfg = _import(_save(hf, tmp_path / "hf"), tmp_path / "run")
    assert not cfg.model.tie_embeddings
    batch = _batch()
    with torch.no_grad():
        assert _max_diff(_ours(model, batch), _hf_outputs(hf, batch), batch["attention_mask"]) <= TOL
        back = load_whole(transformers.BertForMaskedLM, _export(tmp_path / "run", tmp_path / "out"))
        assert torch.equal(_hf_outputs(back, batch)[0], _hf_outputs(hf, batch)[0])
    # Untied, HF's decoder adds its own `decoder.bias`; `cls.predictions.bias` is then unused, and written equal.
    live = "cls.predictions.decoder.bias"
    assert torch.equal(back.state_dict()["cls.predictions.bias"], hf.state_dict()[live])
    assert_same_state({k: v for k, v in back.state_dict().items() if k != "cls.predictions.bias"},
                      {k: v for k, v in hf.state_dict().items() if k != "cls.predictions.bias"})


def test_pytorch_bin_and_old_layer_norm_names_read_like_safetensors(tmp_path):
    """A pytorch_model.bin with `LayerNorm.gamma`/`beta` and the buffers older BERT checkpoints carry."""
    hf = _bert("BertForSequenceClassification")
    _save(hf, tmp_path / "hf")
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in load_file(str(tmp_path / "hf" / "model.safetensors")).items()}
    state["bert.embeddings.position_ids"] = torch.arange(SEQ)[None]
    torch.save(state, old / "pytorch_model.bin")
    a, _ = _import(tmp_path / "hf", tmp_path / "run_a")
    b, _ = _import(old, tmp_path / "run_b")
    assert_same_state(b.state_dict(), a.state_dict())


@torch.no_grad()
def test_every_bert_tensor_moves_the_outputs(tmp_path):
    """A mis-mapped value in any tensor would fail the equivalence tests: each one changes the outputs."""
    hf = _bert("BertForPreTraining")
    model, _ = _import(_save(hf, tmp_path / "hf"), tmp_path / "run")
    batch = _batch()
    want = _hf_outputs(hf, batch)
    for name, param in model.named_parameters():
        saved = param.clone()
        param.add_(0.05 * torch.randn_like(param))
        moved = _max_diff(_ours(model, batch), want, batch["attention_mask"])
        param.copy_(saved)
        assert moved > 1e3 * TOL, name
    assert _max_diff(_ours(model, batch), want, batch["attention_mask"]) <= TOL


def test_exported_shakespeare_bpe_tokenizer_equals_meshlm_s(tmp_path):
    """The default run's tokenizer (`shakespeare-bpe:4096`, trained into the cache) goes with an export: it was
    once left out ("not there any more"), so `vllm serve` and `AutoTokenizer` could not load the directory."""
    from meshlm.interop.hf_files import write_tokenizer_files

    names = write_tokenizer_files("shakespeare-bpe:4096", tmp_path, 256)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(names)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = get_tokenizer("shakespeare-bpe:4096")
    for text in ("ROMEO.\nBut soft, what light through yonder window breaks?", "naïve café 🙂 1234 don't"):
        assert hf_tok(text)["input_ids"] == ours.encode(text), text
