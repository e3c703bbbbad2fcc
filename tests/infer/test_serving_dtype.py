"""`--dtype bf16|fp16` for serving and generating (core.precision.cast_parameters), and `meshlm generate` /
`meshlm chat` on the serving engine's paged path (infer/local.py).

bf16 cannot equal fp32 token for token, so the bf16 engine is checked against a bf16 reference of its own, the
plain model recomputing the whole sequence at every step (no cache): the engine's greedy choice is the
reference's argmax or within bf16's rounding of it (a near tie), and its log-probabilities match the
reference's within a stated tolerance: ten times bf16's arithmetic on this tiny model (measured: at most
0.002), far below what a wrong cache (a missing position, a key in the wrong slot, an fp32 pool read
as bf16) does to a log-probability (of order 1)."""

from __future__ import annotations

import copy

import pytest
import torch

from meshlm.cli import main
from meshlm.core.config import ModelConfig
from meshlm.core.precision import cast_parameters
from meshlm.infer.engine import Engine, SamplingParams
from meshlm.infer.local import local_engine, stream
from meshlm.models.gpt import GPT
from meshlm.models.paged import MASKED_ROWS, masked_attention
from tests.infer.server_helpers import save_gpt_checkpoint
from tests.infer.test_engine import CharTokenizer

LLAMA = ModelConfig(n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, seq_len=64, vocab_size=97,
                    position="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False)
MLA = ModelConfig(n_layers=2, hidden_size=64, n_heads=4, seq_len=64, vocab_size=97, position="rope", norm="rmsnorm",
                  activation="swiglu", bias=False, tie_embeddings=False, attention="mla", q_lora_rank=24,
                  kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
LOGPROB_TOL = 0.02  # bf16 engine against bf16 full recompute (module docstring)
TIE_TOL = 0.02  # a greedy choice that is not the reference's argmax must be this close to it (a near tie)


def models(cfg=LLAMA):
    torch.manual_seed(0)
    fp32 = GPT(cfg).eval()
    return fp32, cast_parameters(copy.deepcopy(fp32), "bf16")


def test_cast_parameters_keeps_the_rope_tables_in_fp32():
    fp32, bf16 = models()
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.rope_cos.dtype == torch.float32 and bf16.rope_sin.dtype == torch.float32
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(fp32.parameters(), bf16.parameters()))


@pytest.mark.parametrize("rows, kernel, in_place", [(3, False, False), (MASKED_ROWS, False, False), (3, True, False),
                                                    (MASKED_ROWS, True, False), (3, False, True),
                                                    (MASKED_ROWS, False, True)],
                         ids=["3-fp32-copies", f"{MASKED_ROWS}-masked", "3-kernel", f"{MASKED_ROWS}-kernel",
                              "3-in-place", f"{MASKED_ROWS}-in-place"])
@pytest.mark.parametrize("cfg", [LLAMA, MLA], ids=["gqa", "mla"])
@torch.no_grad()
def test_bf16_engine_decodes_as_the_bf16_model_recomputing_everything(cfg, rows, kernel, in_place, monkeypatch):
    """16-bit decoding rows read the pool in place (meshlm's kernel, `models/native.py`), or, with it off, attend
    through PyTorch's kernel on fp32 copies (3 rows) or `masked_attention` (MASKED_ROWS rows and more:
    models/paged.py), or, where the CPU has AMX (`KERNEL_TAKES_BF16`, set here either way: each path runs on any
    CPU), through PyTorch's kernel on bf16 as they are. An MLA model reads its latent cache, which the in-place
    kernel does not: it takes the other paths."""
    from meshlm.models import native, paged

    calls, kernel_calls, native_calls = [], [], []
    monkeypatch.setattr(paged, "masked_attention", lambda *a: calls.append(1) or masked_attention(*a))
    monkeypatch.setattr(paged, "KERNEL_TAKES_BF16", kernel)
    if in_place:
        assert native.paged_decode() is not None, native.unavailable()
        decode = native.decode
        monkeypatch.setattr(native, "decode", lambda q, *a, **k: native_calls.append(q.dtype) or decode(q, *a, **k))
    else:
        monkeypatch.setattr(native, "supports", lambda q, pool: False)
    sdpa, attend_16bit, inside = torch.nn.functional.scaled_dot_product_attention, paged.PagedCache.attend_16bit, []

    def counted(q, *a, **kw):  # the kernel's input dtype, when the decoding rows' path calls it
        if inside:
            kernel_calls.append(q.dtype)
        return sdpa(q, *a, **kw)

    def within(self, *a):
        inside.append(1)
        try:
            return attend_16bit(self, *a)
        finally:
            inside.pop()

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    monkeypatch.setattr(paged.PagedCache, "attend_16bit", within)
    fp32, bf16 = models(cfg)
    engine = Engine(bf16, CharTokenizer(), max_seqs=rows, max_len=64)
    assert engine.runner.cache_bytes_per_token() * 2 == Engine(fp32, CharTokenizer(), 1, 64).runner.cache_bytes_per_token()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (5, 17, 9, 12, 6, 20, 8, 11)[:rows]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    worst = 0.0
    for prompt, req in zip(prompts, engine.generate(prompts, params)):  # the rows decoded together
        assert len(req.output_ids) == 12
        seq = list(prompt)
        for info in req.output:
            ref = torch.log_softmax(bf16(torch.tensor([seq]))[0, -1].float(), -1)
            assert float(ref.max() - ref[info.id]) <= TIE_TOL, (seq, info.id, int(ref.argmax()))
            worst = max(worst, abs(info.logprob - float(ref[info.id])))
            seq.append(info.id)
    assert worst <= LOGPROB_TOL, worst
    reads_in_place = in_place and cfg is LLAMA
    assert set(native_calls) == ({torch.bfloat16} if reads_in_place else set())
    assert bool(calls) == (rows >= MASKED_ROWS and not kernel and not reads_in_place)
    if reads_in_place:
        assert not kernel_calls  # no decoding row went to PyTorch's kernel
    elif kernel:
        assert set(kernel_calls) == {torch.bfloat16}
    else:  # fp32 copies (a group of 8 rows may split by length into smaller ones, which take them too)
        assert (set(kernel_calls) == {torch.float32}) if rows < MASKED_ROWS else (torch.bfloat16 not in kernel_calls)
    # and bf16 is bf16 of this model, not another one: its first choice's log-probability is near fp32's
    first = torch.log_softmax(fp32(torch.tensor([prompts[0]]))[0, -1], -1)
    reqs = engine.generate([prompts[0]], params)
    assert abs(reqs[0].output[0].logprob - float(first[reqs[0].output[0].id])) <= 0.1


@pytest.mark.parametrize("aten_only", [True, False], ids=["avx512-bf16", "other-cpus"])
def test_compiled_bf16_products_come_from_aten_alone_on_an_avx512_bf16_cpu(aten_only, monkeypatch):
    """`runner.compile_config`: a bf16 model's compiled step on a CPU whose native bf16 is AVX512-BF16 alone takes
    ATen's products (oneDNN's bf16 kernels), not Inductor's C++ ones; fp32 weights, a model quantized to int8 (its
    products are the int8 layers'), untuned settings and every other CPU keep `COMPILE_CONFIG`, whose other
    settings are kept."""
    from meshlm.infer import runner
    from meshlm.infer.quantize import QuantizeOptions

    monkeypatch.setattr(runner, "BF16_ATEN_ONLY", aten_only)
    fp32, bf16 = models()
    quantized = copy.deepcopy(bf16)
    QuantizeOptions("int8").apply(quantized)
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    tuned = runner.COMPILE_CONFIG
    assert runner.compile_config(fp32) == tuned and runner.compile_config(quantized) == tuned
    assert runner.compile_config(bf16) == ({**tuned, "max_autotune_gemm_backends": "ATEN"} if aten_only else tuned)
    assert tuned["max_autotune_gemm_backends"] == "CPP,ATEN"  # the default itself left as it was
    on_meta = copy.deepcopy(bf16).to("meta")  # a bf16 model off the CPU (a GPU's) keeps the default
    assert runner.compile_config(on_meta) == tuned
    untuned = {"freezing": True}  # the compiled-step tests' own settings (test_compiled_step.py's `untuned`)
    monkeypatch.setattr(runner, "COMPILE_CONFIG", untuned)
    assert runner.compile_config(bf16) == untuned


@pytest.mark.parametrize("T", [1, 3])
def test_masked_attention_equals_the_kernel_in_float64(T):
    """`models.paged.masked_attention` (the bf16 decode path) is softmax attention: equal to PyTorch's kernel in
    float64 with GQA (6 query heads over 2), per-row masks, several queries per row, a value width of its own."""
    g = torch.Generator().manual_seed(0)
    R, L = 3, 20
    q, k = torch.randn(R, 6, T, 8, generator=g, dtype=torch.float64), torch.randn(R, 2, L, 8, generator=g, dtype=torch.float64)
    v = torch.randn(R, 2, L, 5, generator=g, dtype=torch.float64)
    ends = torch.tensor([7, 20, 13])
    mask = (torch.arange(L)[None, None, :] < (ends[:, None] - T + 1 + torch.arange(T)[None, :])[:, :, None])[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3)
    assert torch.allclose(masked_attention(q, k, v, mask, 0.3), ref, atol=1e-12, rtol=0)


@torch.no_grad()
def test_local_engine_stream_equals_the_engine_and_yields_the_stop_id():
    fp32, _ = models()
    prompt = [5, 9, 14, 3]
    reference = Engine(fp32, CharTokenizer(), 2, 64).generate([prompt], SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True))[0].output_ids
    engine = local_engine(fp32, CharTokenizer(), 64)
    got = list(stream(engine, prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)))
    assert got == reference
    stop = reference[3]  # a stop id: the stream ends on it, the id included (the caller cuts)
    again = list(stream(engine, prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop,))))
    assert again == reference[:reference.index(stop) + 1]
    # leaving early frees the row: the one-row engine takes the next request
    for _ in zip(range(2), stream(engine, prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))):
        pass
    assert engine.running == 0
    assert list(stream(engine, prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))) == reference


def test_generate_command_bf16_and_bad_dtype(tmp_path, capsys):
    ckpt = save_gpt_checkpoint(tmp_path / "tiny-gpt")
    outs = {}
    for dtype in ("fp32", "bf16"):
        code = main(["generate", "--checkpoint", str(ckpt), "--prompt", "Hello", "--max-new-tokens", "6",
                     "--temperature", "0", "--ignore-eos", "--dtype", dtype])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        outs[dtype] = captured.out
    assert outs["bf16"].startswith("Hello") and len(outs["bf16"]) > len("Hello\n")
    # --no-cache recomputes every step (no engine) and gives the engine's greedy text
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "Hello", "--max-new-tokens", "6",
                 "--temperature", "0", "--ignore-eos", "--no-cache"]) == 0
    assert capsys.readouterr().out == outs["fp32"]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--checkpoint", str(ckpt), "--dtype", "fp8"])
    assert exit_info.value.code == 2 and "--dtype" in capsys.readouterr().err


def test_serve_with_runtime_lora_in_bf16_is_refused_before_loading(tmp_path):
    from meshlm.core.config import ConfigError
    from meshlm.infer.server import build_server

    ckpt = save_gpt_checkpoint(tmp_path / "tiny-gpt")
    with pytest.raises(ConfigError, match="--allow-runtime-lora .* --dtype bf16"):
        build_server(str(ckpt), runtime_lora=True, dtype="bf16")
    for layout in ({"tp": 2}, {"pp": 2}):  # refused before torchrun's world is looked for
        with pytest.raises(ConfigError, match="--dtype bf16 serves in one process.*--dtype fp32"):
            build_server(str(ckpt), dtype="bf16", **layout)
    server = build_server(str(ckpt), max_seqs=2, dtype="bf16")
    assert {p.dtype for p in server.engine.model.parameters()} == {torch.bfloat16}
    fp32 = build_server(str(ckpt), max_seqs=2)
    assert server.engine.runner.cache_bytes_per_token() * 2 == fp32.engine.runner.cache_bytes_per_token()
