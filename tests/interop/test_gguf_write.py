"""`meshlm convert --to-gguf`: a Llama-style meshlm checkpoint as a GGUF file that transformers loads
(`from_pretrained(dir, gguf_file=...)`, which undoes llama.cpp's layout: the independent reader here) with the
same logits and the same tokenizer; bad inputs refused in one line with nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from interop_helpers import ok, one_error_line

from meshlm.checkpoint.load import load_model, open_checkpoint
from meshlm.data.assets import shakespeare_files
from meshlm.data.chat import template_for
from meshlm.data.tokenizers import get_tokenizer
from meshlm.families.registry import get_spec
from meshlm.interop.gguf_write import rotate_half_to_interleaved
from meshlm.models.layers import apply_rope, rope_tables
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

TOKENIZER = "shakespeare-bpe:512"
# Trained until its next-token choices are clear (a 2-step model's logits differ by less than q8_0's rounding)
STEPS, LR = 40, 1e-2
LLAMA = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "n_layers": 2,
         "hidden_size": 64, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "seq_len": 32}


def _train(run: Path, tied: bool) -> Path:
    cfg = tiny_config(run, model={**LLAMA, "tie_embeddings": tied}, data={"tokenizer": TOKENIZER},
                      train={"max_steps": STEPS, "eval_iters": 1}, optim={"lr": LR})
    Trainer(cfg).run()
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[bool, Path]:
    """Two tiny Llama-style runs (GQA: 4 heads, 2 KV heads), trained 2 steps: tied and untied head."""
    root = tmp_path_factory.mktemp("gguf_runs")
    return {tied: _train(root / f"tied_{tied}", tied) for tied in (True, False)}


def _held_out_ids(n: int = 1024) -> list[int]:
    """n tokens of a work the tokenizer and the default split never trained on."""
    return get_tokenizer(TOKENIZER).encode(shakespeare_files()[-1].read_text(encoding="utf-8")[5000:20000])[:n]


def _logits(run: Path, gguf_file: Path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(meshlm's, transformers' from the GGUF) logits over `ids` in windows of the context length."""
    checkpoint = open_checkpoint(run, log=None)
    ours = load_model(checkpoint, get_spec(checkpoint.config.model.family))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    seq = checkpoint.config.model.seq_len
    batch = torch.tensor(ids[:len(ids) // seq * seq]).view(-1, seq)
    with torch.no_grad():
        return ours(batch), theirs.eval()(batch).logits


def _to_gguf(run: Path, out: Path, outtype: str | None) -> Path:
    ok(["convert", "--checkpoint", str(run), "--to-gguf", str(out)] + (["--outtype", outtype] if outtype else []))
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_f32_gguf_runs_in_transformers_with_meshlm_logits(runs, tied, tmp_path):
    ids = _held_out_ids(256)
    out = _to_gguf(runs[tied], tmp_path / "model.gguf", "f32")
    ours, theirs = _logits(runs[tied], out, ids)
    assert (ours - theirs).abs().max().item() <= 1e-4
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert ("output.weight" in names) is not tied  # a tied head is llama.cpp's token_embd, written once
    assert {"blk.1.attn_q.weight", "blk.1.ffn_gate.weight", "output_norm.weight"} <= names


@pytest.mark.parametrize("outtype, bound", [
    (None, 1e-2),  # the default, f16 (measured: 3e-3)
    ("bf16", 5e-2),  # 8 bits of mantissa (measured: 2e-2)
])
def test_half_precision_logits_within_bound(runs, outtype, bound, tmp_path):
    ids = _held_out_ids(256)
    out = _to_gguf(runs[False], tmp_path / "model.gguf", outtype)
    ours, theirs = _logits(runs[False], out, ids)
    assert (ours - theirs).abs().max().item() <= bound
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    want = "BF16" if outtype == "bf16" else "F16"
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == types["output.weight"] == want
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"  # norms stay F32


@pytest.mark.parametrize("outtype, tied, agreement", [
    ("q8_0", True, 0.99), ("q8_0", False, 0.99),  # the bound (measured: 99.9% and 100%)
    ("q4_0", False, 0.95),  # 4-bit weights (measured: 98.7%)
])
def test_quantized_gguf_agrees_on_next_tokens(runs, outtype, tied, agreement, tmp_path):
    """Top-1 next token on 1,024 held-out tokens, transformers on the GGUF against meshlm."""
    out = _to_gguf(runs[tied], tmp_path / "model.gguf", outtype)
    ours, theirs = _logits(runs[tied], out, _held_out_ids())
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= agreement
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.ffn_down.weight"] == types["blk.1.attn_k.weight"] == outtype.upper()
    # the output layer (the embedding when tied) is Q8_0 in q4_0 too, as llama-quantize keeps it above 4 bits
    assert types["token_embd.weight" if tied else "output.weight"] == "Q8_0"
    assert types["blk.0.ffn_norm.weight"] == "F32"


def test_rows_that_do_not_fill_blocks_fall_back_to_f16():
    """hidden_size 48: rows of 48 weights do not fill whole 32-weight Q8_0 blocks, so those tensors are F16
    (as llama.cpp's converter falls back); ffn_down's rows (ffn_size 128) are Q8_0; norms F32."""
    from meshlm.core.config import ModelConfig
    from meshlm.interop.gguf_write import gguf_plan

    cfg = ModelConfig(**{**LLAMA, "hidden_size": 48, "n_heads": 2, "n_kv_heads": 1})
    fallbacks: list[str] = []
    types = {t.name: t.qtype.name for t in gguf_plan(cfg, "q8_0", fallbacks)}
    assert cfg.ffn_size % 32 == 0 and types["blk.0.ffn_down.weight"] == "Q8_0"
    wide = [name for name in types if name.endswith(("attn_q.weight", "ffn_up.weight", "attn_output.weight"))]
    assert all(types[name] == "F16" for name in wide) and set(wide) <= set(fallbacks)
    assert types["blk.0.attn_norm.weight"] == "F32" and "output.weight" not in types  # tied by default


@pytest.mark.parametrize("scaling", ["llama3", "yarn"])
def test_rope_scaling_is_written_as_llama_cpp_reads_it(scaling, tmp_path):
    """Llama 3 scaling as llama.cpp's `rope_freqs` tensor (it divides each frequency θ^(-2i/d) by its entry,
    which must give meshlm's scaled frequencies), YaRN as the rope.scaling keys. transformers' GGUF loader
    reads neither, so this checks the file against the formulas, not a run."""
    from meshlm.core.config import ModelConfig
    from meshlm.interop.gguf_vocab import gguf_vocab
    from meshlm.interop.gguf_write import write_gguf
    from meshlm.models.gpt import GPT

    cfg = ModelConfig(**LLAMA, rope_scaling=scaling, rope_factor=4.0, rope_original_len=16, rope_theta=500000.0)
    state = GPT(cfg).state_dict()
    write_gguf(state.__getitem__, cfg, gguf_vocab(TOKENIZER, cfg.vocab_size), tmp_path / "m.gguf", "scaled", "f32")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: t for t in reader.tensors}
    if scaling == "llama3":
        d = cfg.head_dim
        base = 500000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        factors = torch.from_numpy(tensors["rope_freqs.weight"].data.copy()).double()
        wavelength = 2 * torch.pi / base  # Llama 3.1: kept below 16/4, divided by 4 above 16/1, blended between
        assert torch.allclose(factors[wavelength < 4], torch.ones(1, dtype=torch.float64))
        assert torch.allclose(factors[wavelength > 16], torch.full((1,), 4.0, dtype=torch.float64))
        assert "llama.rope.scaling.type" not in reader.fields
    else:
        assert "rope_freqs.weight" not in tensors
        fields = {k: reader.fields[f"llama.rope.scaling.{k}"].contents()
                  for k in ("type", "factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow")}
        assert fields == {"type": "yarn", "factor": 4.0, "original_context_length": 16, "yarn_beta_fast": 32.0,
                          "yarn_beta_slow": 1.0}


def test_gguf_tokenizer_encodes_like_meshlm(runs, tmp_path):
    out = _to_gguf(runs[True], tmp_path / "model.gguf", "f32")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=out.name)
    ours = get_tokenizer(TOKENIZER)
    text = shakespeare_files()[-1].read_text(encoding="utf-8")[:20000]
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert theirs.eos_token_id == ours.eod_id
    reader = gguf.GGUFReader(out)
    assert reader.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    # the chat template meshlm serves (its builtin one here), without transformers' generation marks
    want = template_for(TOKENIZER).text.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert reader.fields["tokenizer.chat_template"].contents() == want


def test_rope_permutation_keeps_attention_scores():
    """q·k after meshlm's rotate-half RoPE equals q·k after the interleaved RoPE (adjacent pairs rotated, as
    llama.cpp's `llama` does) on the permuted projections: the same attention."""
    gen = torch.Generator().manual_seed(0)
    heads, d, t, hidden = 2, 8, 5, 16
    wq, wk, x = (torch.randn(heads * d, hidden, generator=gen), torch.randn(heads * d, hidden, generator=gen),
                 torch.randn(t, hidden, generator=gen))
    cos, sin = rope_tables(d, t, 10000.0)

    def heads_of(w):  # (nh, T, d)
        return (x @ w.t()).view(t, heads, d).transpose(0, 1)

    q, k = apply_rope(heads_of(wq)[None], cos, sin)[0], apply_rope(heads_of(wk)[None], cos, sin)[0]
    angles = torch.outer(torch.arange(t, dtype=torch.float32), 1.0 / 10000.0 ** (torch.arange(0, d, 2) / d))

    def interleaved(w):  # rotate (2j, 2j + 1) by angle j as complex numbers
        pairs = torch.view_as_complex(heads_of(rotate_half_to_interleaved(w, heads)).reshape(heads, t, d // 2, 2))
        return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).reshape(heads, t, d)

    torch.testing.assert_close(interleaved(wq) @ interleaved(wk).transpose(1, 2), q @ k.transpose(1, 2))


# ---- bad input: one line, exit 2, nothing written ---------------------------------------------------------
def _hf_import(tmp_path: Path, hf_config, tokenizer: str | None = None) -> Path:
    model = transformers.AutoModel.from_config(hf_config) if hf_config.model_type == "bert" else \
        transformers.AutoModelForCausalLM.from_config(hf_config)
    model.save_pretrained(tmp_path / "hf")
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]
       + (["--tokenizer", tokenizer] if tokenizer else []))
    return tmp_path / "run"


def _refused(argv: list[str], folder: Path, *words: str) -> None:
    before = sorted(p.name for p in folder.iterdir())
    one_error_line(argv, *words)
    assert sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_non_llama_checkpoint_is_refused(kind, tmp_path):
    small = {"vocab_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 16,
             "intermediate_size": 32, "max_position_embeddings": 32}
    config = transformers.GPT2Config(vocab_size=50257, n_layer=1, n_head=2, n_embd=16, n_positions=32) \
        if kind == "gpt2" else transformers.BertConfig(**{**small, "vocab_size": 30522})
    run = _hf_import(tmp_path, config)
    _refused(["convert", "--checkpoint", str(run), "--to-gguf", str(tmp_path / "m.gguf")], tmp_path,
             "--to-gguf", "Llama-style")


def test_wordpiece_tokenizer_is_refused(tmp_path):
    config = transformers.LlamaConfig(vocab_size=30522, num_hidden_layers=1, num_attention_heads=2, hidden_size=32,
                                      intermediate_size=64, max_position_embeddings=32)
    run = _hf_import(tmp_path, config, tokenizer="bert")
    _refused(["convert", "--checkpoint", str(run), "--to-gguf", str(tmp_path / "m.gguf")], tmp_path,
             "WordPiece", "byte-level BPE")


def test_existing_out_and_unknown_outtype_are_refused(runs, tmp_path):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"keep me")
    _refused(["convert", "--checkpoint", str(runs[True]), "--to-gguf", str(out)], tmp_path, "exists")
    assert out.read_bytes() == b"keep me"
    _refused(["convert", "--checkpoint", str(runs[True]), "--to-gguf", str(tmp_path / "new.gguf"), "--outtype",
              "q5_k"], tmp_path, "--outtype", "q5_k", "q8_0")


def test_tune_run_is_refused_not_written_without_its_adapter(runs, tmp_path):
    """A `meshlm tune` run's tensors are its frozen base's: written alone they would drop the adapter."""
    from dataclasses import replace

    from meshlm.core.config import ConfigError, TuneConfig
    from meshlm.interop.gguf_write import export_gguf

    checkpoint = open_checkpoint(runs[True], log=None)
    tuned = replace(checkpoint, config=replace(checkpoint.config, tune=TuneConfig(method="lora", base="base-run")))
    with pytest.raises(ConfigError, match="tune run"):
        export_gguf(tuned, tmp_path / "m.gguf")
    assert not any(tmp_path.iterdir())
