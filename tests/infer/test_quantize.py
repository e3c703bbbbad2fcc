"""Weight-only quantization for inference (`meshlm/infer/quantize.py`, `--quantize int8|int4`).

Each quantized linear is checked against a float reference that dequantizes the same codes, computed here from
the formulas (int8: per-channel max/127; int4: per-group min/max over 15 steps), so the tolerance is the
kernel's arithmetic (1e-5 relative), not the quantization error. The whole model is checked against fp32 at
the tolerance measured on the tiny model; a LoRA adapter served over a quantized base against the merged
float reference; `meshlm serve --quantize int8` end to end against the same quantized model run here; bad
values as one-line errors with exit code 2."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from meshlm.cli import main
from meshlm.infer.quantize import (
    COMPILED_DEQUANTIZE_ROWS,
    DEQUANTIZE_ROWS,
    NATIVE_BF16,
    Int4Linear,
    Int8Linear,
    own_kernel,
    pack_int4,
    quantize_model,
    unpack_int4,
    weight_bytes,
)
from meshlm.models import native
from tests.conftest import tiny_config
from tests.infer.server_helpers import GPT_MODEL, ServeProcess, http, save_bert_checkpoint, save_gpt_checkpoint


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.detach().double() - ref.detach()).abs().max() / ref.detach().abs().max())


# The codes in float32 arithmetic, as the formulas are specified (in float64 a weight near a rounding tie can
# land on the other code); the dequantized weights in float64.
# (the scales, and zero points, as the kernel holds them: in its compute dtype)
def int8_reference(w: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    s = w.detach().float().abs().amax(dim=1, keepdim=True) / 127
    return torch.round(w.detach().float() / s).clamp(-127, 127).double() * s.to(dtype).double()


def int4_reference(w: torch.Tensor, g: int, dtype=torch.float32, parts: bool = False):
    n, k = w.shape
    groups = w.detach().float().reshape(n, k // g, g)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    s = (high - low) / 15
    q = torch.round((groups - low) / s).clamp(0, 15).double()
    zero = (low + 8 * s).to(dtype).double()
    scale = s.to(dtype).double()
    if parts:  # (q·s, z - 8s), each (N, K): the two terms meshlm's kernel sums separately
        return (q * scale).reshape(n, k), (zero - 8 * scale).expand(n, k // g, g).reshape(n, k)
    return ((q - 8) * scale + zero).reshape(n, k)  # the kernel's (q - 8)·s + z


def rows8(x: torch.Tensor) -> torch.Tensor:
    """x as meshlm's kernel multiplies it (float64): per block of 32 inputs d = max |x| / 127 and x ≈ d · round(x ·
    (1/d)), in fp32 arithmetic as the kernel computes it."""
    blocks = x.detach().float().reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse).double() * d.double()).reshape(x.shape)


def own_int4_reference(x: torch.Tensor, w: torch.Tensor, g: int, dtype) -> torch.Tensor:
    """meshlm's int4 rows: the codes' part against x in 8-bit blocks, each group's offset against x itself."""
    codes, shift = int4_reference(w, g, dtype, parts=True)
    return rows8(x) @ codes.T + x.double() @ shift.T


# float32: the kernel's arithmetic alone; bfloat16 (the default for a float32 model): the input rounded to
# bfloat16 in the reference too, and the output's rounding to bfloat16 (2^-9 of each value) on top.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
COMPUTE = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# Each layer's kernel: PyTorch's packed kernels, and meshlm's own (`models/kernels/quant_rows.cpp`, x in 8-bit blocks
# (`rows8`), fp32 sums; on a CPU with AVX2 and FMA, the default where the CPU lacks native bf16).
NO_OWN = native.quant_rows() is None
KERNEL = pytest.mark.parametrize("own", [False, pytest.param(True, marks=pytest.mark.skipif(
    NO_OWN, reason=f"meshlm's int8/int4 kernel: {native.unavailable('quant_rows')}"))], ids=["aten", "own"])


@KERNEL
@COMPUTE
@pytest.mark.parametrize("rows", [5, DEQUANTIZE_ROWS], ids=["kernel", "dequantized"])
def test_int8_linear_equals_its_dequantized_weights(dtype, rows, own):
    """Both paths: the packed kernel (fewer than DEQUANTIZE_ROWS rows; PyTorch's or meshlm's) and the dequantized
    weight (a prefill chunk): each the same q·s within the kernel's arithmetic. The dequantized product is in the
    layer's `dequantize_dtype`: bf16 compute on a CPU without native bf16 dequantizes in fp32 (x unrounded);
    meshlm's kernel rounds x to 8-bit blocks whatever the compute dtype and sums in fp32."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 80)
    x = torch.randn(2, rows, 96)
    layer = Int8Linear(linear, dtype, own=own)
    out = layer(x)
    # the dtype x and y are rounded to
    product = (torch.float32 if own else dtype) if rows < DEQUANTIZE_ROWS else layer.dequantize_dtype
    assert layer.dequantize_dtype == (torch.float32 if dtype == torch.bfloat16 and not NATIVE_BF16 else dtype)
    given = rows8(x) if own and rows < DEQUANTIZE_ROWS else x.to(product).double()
    ref = given @ int8_reference(linear.weight, dtype).T + linear.bias.double()
    assert out.shape == (2, rows, 80) and out.dtype == torch.float32
    assert relative_error(out, ref) < TOLERANCE[product]
    assert relative_error(out, linear(x).double()) > 1e-4  # the codes really are 8-bit: not the float weight


@KERNEL
@pytest.mark.parametrize("rows", [1, 2, 5, DEQUANTIZE_ROWS])
def test_a_compiled_step_of_two_rows_or_more_multiplies_by_the_dequantized_int8_weight(rows, own):
    """Inside torch.compile (`meshlm serve --compile`) the crossing is COMPILED_DEQUANTIZE_ROWS: one row keeps the
    packed kernel, two and more the dequantized weight (on a CPU with AMX every size keeps the kernel, which
    Inductor lowers to its AMX template; on one without native bf16 the crossing is the eager one,
    DEQUANTIZE_ROWS, and the dequantized product is fp32), the same q·s either way. A layer that takes meshlm's
    kernel in eager steps takes PyTorch's inside a graph."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 80)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(rows, 96)
    layer = Int8Linear(linear, torch.bfloat16, own=own)
    out = torch.compile(layer, backend=capture, dynamic=False)(x)
    targets = [str(node.target) for g in graphs for node in g.graph.nodes]
    kernel = any("_weight_int8pack_mm" in t for t in targets)
    assert graphs and kernel == (rows < COMPILED_DEQUANTIZE_ROWS) and not any("int8_rows" in t for t in targets)
    assert COMPILED_DEQUANTIZE_ROWS == (2 if NATIVE_BF16 else DEQUANTIZE_ROWS) or torch.cpu._is_amx_tile_supported()
    product = torch.bfloat16 if kernel else layer.dequantize_dtype
    ref = x.to(product).double() @ int8_reference(linear.weight, torch.bfloat16).T + linear.bias.double()
    assert relative_error(out, ref) < TOLERANCE[product]


def test_a_compiled_int8_layer_computes_its_dequantized_weights_product():
    """Through Inductor as `meshlm serve --compile` compiles (`COMPILE_CONFIG`: autotuned products), 16 rows: the
    host's branch (the dequantized weight; the kernel on a CPU without native bf16, where the crossing is
    DEQUANTIZE_ROWS, PyTorch's even where eager steps take meshlm's; on a CPU with AMX Inductor's own int8 template)
    gives x (q·s)ᵀ + b within bf16's rounding."""
    from torch._inductor import config as inductor_config

    from meshlm.infer.runner import COMPILE_CONFIG

    torch.manual_seed(0)
    linear = nn.Linear(96, 80)
    layer = Int8Linear(linear, torch.bfloat16).eval()
    x = torch.randn(16, 96)
    torch._dynamo.reset()
    with torch.no_grad(), inductor_config.patch(COMPILE_CONFIG):
        out = torch.compile(layer, dynamic=False)(x)
    assert layer.own == own_kernel()
    ref = x.to(torch.bfloat16).double() @ int8_reference(linear.weight, torch.bfloat16).T + linear.bias.double()
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]


@KERNEL
@COMPUTE
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_equals_its_dequantized_weights(group_size, dtype, own):
    """7 rows through the kernel (PyTorch's, x in the compute dtype; meshlm's, x in 8-bit blocks for the codes' part)
    and, for meshlm's, a prefill of DEQUANTIZE_ROWS rows through the weight dequantized from its own packing, in
    `dequantize_dtype`."""
    torch.manual_seed(1)
    linear = nn.Linear(256, 48, bias=False)
    layer = Int4Linear(linear, group_size, dtype, own=own)
    for rows in (7, DEQUANTIZE_ROWS) if own else (7,):
        x = torch.randn(rows, 256)
        product = (torch.float32 if own else dtype) if rows < DEQUANTIZE_ROWS else layer.dequantize_dtype
        ref = x.to(product).double() @ int4_reference(linear.weight, group_size, dtype).T
        if own and rows < DEQUANTIZE_ROWS:
            ref = own_int4_reference(x, linear.weight, group_size, dtype)
        out = layer(x)
        assert out.shape == (rows, 48) and relative_error(out, ref) < TOLERANCE[product]


@pytest.mark.skipif(NO_OWN, reason=f"meshlm's int8/int4 kernel: {native.unavailable('quant_rows')}")
@pytest.mark.parametrize("rows", [3, DEQUANTIZE_ROWS])
def test_a_compiled_int4_layer_of_meshlms_kernel_is_one_operator_below_the_crossing(rows):
    """Compiled through Inductor as `meshlm serve --compile` compiles, an int4 layer in meshlm's layout calls the kernel
    as one opaque operator below COMPILED_DEQUANTIZE_ROWS rows (on a CPU without native bf16: the eager crossing)
    and multiplies by its dequantized weight from there on: each within its product's rounding of its reference."""
    from torch._inductor import config as inductor_config

    from meshlm.infer.runner import COMPILE_CONFIG

    torch.manual_seed(3)
    linear = nn.Linear(128, 48)
    layer = Int4Linear(linear, 32, torch.bfloat16, own=True).eval()
    x = torch.randn(rows, 128)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(layer, backend=capture, dynamic=False)(x)
    kernel = any("int4_rows" in str(node.target) for g in graphs for node in g.graph.nodes)
    assert kernel == (rows < COMPILED_DEQUANTIZE_ROWS)
    torch._dynamo.reset()
    with torch.no_grad(), inductor_config.patch(COMPILE_CONFIG):
        out = torch.compile(layer, dynamic=False)(x)
    product = torch.float32 if kernel else layer.dequantize_dtype  # bf16 where the CPU computes it natively
    if kernel:
        ref = own_int4_reference(x, linear.weight, 32, torch.bfloat16)
    else:
        ref = x.to(product).double() @ int4_reference(linear.weight, 32, torch.bfloat16).T
    assert relative_error(out, ref + linear.bias.double()) < TOLERANCE[product]


@pytest.mark.skipif(NO_OWN, reason=f"meshlm's int8/int4 kernel: {native.unavailable('quant_rows')}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-scales", "bf16-scales"])
def test_own_kernel_takes_every_row_block_and_channel_tile(dtype):
    """meshlm's kernel quantizes up to 4 rows in each thread and more once for all, splits rows into blocks of up to
    4 and output channels into tiles of 4 (one row) or 2: 1-9 rows of 37 channels, K = 96 (int8; int4 in groups
    of 32: an odd number of blocks), 128 (int4 in one group), a block of zeros among them, each row within fp32
    rounding of its reference; against the unrounded x the 8-bit blocks cost about 0.5% of the largest output.
    The int4 packing is undone exactly; an input width that is not a multiple of 32 keeps PyTorch's kernel."""
    torch.manual_seed(2)
    int8 = Int8Linear(nn.Linear(96, 37, bias=False), dtype, own=True)
    linears = {g: nn.Linear(k, 37, bias=False) for g, k in ((32, 96), (128, 128))}
    int4 = {g: Int4Linear(linear, g, dtype, own=True) for g, linear in linears.items()}
    codes = torch.randint(0, 16, (37, 96))
    assert torch.equal(unpack_int4(pack_int4(codes)).long(), codes) and int4[32].packed.shape == (37, 48)
    assert int8.own and not Int8Linear(nn.Linear(100, 37), dtype, own=True).own
    w8 = int8.qweight.double() * int8.scales.double()[:, None]
    for rows in range(1, 10):
        x = torch.randn(rows, 128)
        x[0, 32:64] = 0  # a block whose scale is 0
        out = int8(x[:, :96])
        assert relative_error(out, rows8(x[:, :96]) @ w8.T) < 1e-5, rows
        assert 1e-4 < relative_error(out, x[:, :96].double() @ w8.T) < 2e-2, rows
        for g, linear in linears.items():
            k = linear.in_features
            assert relative_error(int4[g](x[:, :k]), own_int4_reference(x[:, :k], linear.weight, g, dtype)) < 1e-5


def test_own_kernel_is_the_default_where_bf16_is_not_native(monkeypatch):
    """The default kernel (`own_kernel`): meshlm's where the CPU lacks native bf16 and the kernel builds, PyTorch's
    elsewhere; MESHLM_QUANT_KERNEL=0 refuses the build with its reason; an fp16 layer keeps PyTorch's kernel."""
    assert own_kernel() == (not NATIVE_BF16 and not NO_OWN)
    assert Int8Linear(nn.Linear(64, 16), torch.bfloat16).own == own_kernel()
    assert not Int8Linear(nn.Linear(64, 16), torch.float16, own=True).own
    monkeypatch.setenv("MESHLM_QUANT_KERNEL", "0")
    assert native._load_quant() == (None, "MESHLM_QUANT_KERNEL=0")


def tiny_model(**model):
    from meshlm.models.gpt import GPT

    cfg = tiny_config("/unused", model={**GPT_MODEL, **model})
    torch.manual_seed(0)
    return GPT(cfg.model).eval(), cfg


@pytest.mark.parametrize("mode, tolerance", [("int8", 0.02), ("int4", 0.15)])
def test_quantized_model_logits_are_close_to_fp32(mode, tolerance):
    """Measured on this model (the largest logit error over the largest logit), with the default bfloat16
    activations: int8 0.0066, int4 0.067 (float32 activations: 0.0050, 0.067)."""
    model, _ = tiny_model()
    idx = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(idx).double()
    linears = [m for m in model.layers.modules() if type(m) is nn.Linear]
    quantized = copy.deepcopy(model)
    report = quantize_model(quantized, mode, head=False)
    with torch.no_grad():
        out = quantized(idx)
    assert report.layers == len(linears) == 4 * GPT_MODEL["n_layers"]
    err = relative_error(out, ref)
    assert 1e-4 < err < tolerance, err
    # Weight bytes by hand: each float matrix (N·K·4) becomes its codes plus scales (and zero points)
    saved, scale_bytes = 0, 2  # scales (and zero points) in bfloat16, the kernels' dtype for a float32 model
    assert report.compute_dtype == torch.bfloat16
    for m in linears:
        n, k = m.weight.shape
        packed = n * k + scale_bytes * n if mode == "int8" else n * k // 2 + (k // 32) * n * 2 * scale_bytes
        saved += 4 * n * k - packed
    assert report.bytes_before == weight_bytes(model) and report.bytes_before - report.bytes_after == saved


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_int8_output_head_is_quantized_and_the_embedding_is_not(mode):
    model, _ = tiny_model()
    embedding, head = model.tok_emb.weight.detach().clone(), model.lm_head.weight.detach().clone()
    report = quantize_model(model, mode, head=True, compute_dtype=torch.float32)
    assert isinstance(model.lm_head, Int8Linear) and report.layers == 4 * GPT_MODEL["n_layers"] + 1
    # the start-up line says where the decoding rows' activations are rounded to 8 bits (meshlm's kernel)
    assert report.own == (report.layers if model.lm_head.own else 0)
    assert ("8-bit blocks in meshlm's kernel" in report.line()) == bool(model.lm_head.own)
    assert isinstance(model.layers[0].mlp.fc, Int8Linear if mode == "int8" else Int4Linear)
    assert torch.equal(model.tok_emb.weight, embedding)  # the embedding keeps its float weights
    x = torch.randn(3, GPT_MODEL["hidden_size"])
    given = rows8(x) if model.lm_head.own else x.double()  # meshlm's kernel: x in 8-bit blocks
    assert relative_error(model.lm_head(x), given @ int8_reference(head).T) < 1e-5


def lora_adapter(model, cfg):
    """A LoRA adapter on q, v and down with random (non-zero) A and B, as `meshlm tune` would export it."""
    from dataclasses import replace

    from meshlm.families.registry import get_spec
    from meshlm.tune.adapters import apply_lora
    from meshlm.tune.export import Adapter

    tune = replace(cfg.tune, method="lora", base="unused", lora_rank=4, lora_alpha=8.0, lora_targets=["q", "v", "down"])
    scratch = copy.deepcopy(model)
    apply_lora(scratch, get_spec(cfg.model.family), replace(cfg, tune=tune), SimpleNamespace(pp_rank=0, tp_rank=0, tp=1),
               None)
    gen = torch.Generator().manual_seed(5)
    tensors = {n: torch.randn(p.shape, generator=gen) * 0.3 for n, p in scratch.named_parameters()
               if getattr(p, "adapter", False)}
    return Adapter(tune, tensors, [], "test-lora")


def test_lora_adapter_adds_to_the_quantized_base_product():
    """Rows of the adapter: the quantized base plus (α/r) B A x; rows of the base: the quantized base alone.
    The reference is a float model whose weights are the dequantized codes, the LoRA merged into them."""
    from meshlm.infer.adapters import AdapterSet
    from meshlm.tune.export import apply_adapter

    model, cfg = tiny_model()
    adapter = lora_adapter(model, cfg)
    dequantized = copy.deepcopy(model)
    for m in dequantized.layers.modules():
        if type(m) is nn.Linear:
            m.weight.data = int8_reference(m.weight).float()
    merged = apply_adapter(copy.deepcopy(dequantized), cfg, adapter)  # merged into the dequantized weights
    served = AdapterSet(model, cfg, [("a", adapter)])
    # PyTorch's kernel in float32: the reference's arithmetic (meshlm's would round x to 8-bit blocks)
    quantize_model(model, "int8", head=False, compute_dtype=torch.float32, own=False)
    idx = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), served.batch([1, 0]):
        out = model(idx)
    with torch.no_grad():
        with_adapter, base = merged(idx[:1]).double(), dequantized(idx[1:]).double()
        assert relative_error(dequantized(idx[:1]), with_adapter) > 1e-3  # the adapter changes the output
    assert relative_error(out[:1], with_adapter) < 1e-4 and relative_error(out[1:], base) < 1e-4


def greedy(model, ids: list[int], n: int, eod: int) -> list[int]:
    new: list[int] = []
    with torch.no_grad():
        while len(new) < n:
            nxt = int(model(torch.tensor([ids + new]))[0, -1].argmax())
            if nxt == eod:
                break
            new.append(nxt)
    return new


def test_serve_quantize_int8_answers_as_the_quantized_model(tmp_path):
    from tests.checkpoint_helpers import load_run

    ckpt = save_gpt_checkpoint(tmp_path / "gpt")
    model, tok, _ = load_run(str(ckpt))
    quantize_model(model, "int8")
    prompt = "To be, or not"
    expected = tok.decode(greedy(model, tok.encode(prompt), 8, tok.eod_id))
    server = ServeProcess("--checkpoint", str(ckpt), "--quantize", "int8", "--max-seqs", "2")
    try:
        status, _, body = http("POST", server.url + "/v1/completions",
                               {"model": "gpt", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    finally:
        assert server.stop() == 0
    assert status == 200, body
    text = json.loads(body)["choices"][0]["text"]
    assert text and text == expected
    log = "".join(server.stderr)
    assert "weights quantized to int8 (per channel): 8 block linears and the output head (int8)" in log and "MiB ->" in log


def test_eval_quantize_scores_the_quantized_model(tmp_path, capsys):
    """`meshlm eval --task perplexity --quantize int8`: the summed negative log-likelihood of the text (one
    window: shorter than model.seq_len) under the model quantized here, computed by hand; fp32's differs."""
    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.data.tokenizers import get_tokenizer

    cfg = tiny_config(tmp_path / "gpt", model=GPT_MODEL)
    model, _ = tiny_model()
    save_checkpoint(tmp_path / "gpt", 1, {"model": model.state_dict()}, cfg.to_dict())
    text = "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him."
    (tmp_path / "text.txt").write_text(text)
    results = {}
    for name, extra in (("fp32", []), ("int8", ["--quantize", "int8"])):
        assert main(["eval", "--checkpoint", str(tmp_path / "gpt"), "--task", "perplexity", "--data",
                     str(tmp_path / "text.txt"), *extra]) == 0
        results[name] = json.loads(capsys.readouterr().out)
    tok = get_tokenizer(cfg.data.tokenizer)
    ids = tok.encode(text)
    assert len(ids) < GPT_MODEL["seq_len"]
    quantized = results["int8"]["quantized"]
    before = weight_bytes(model)
    quantize_model(model, "int8")
    assert (quantized["weight_bytes_before"], quantized["weight_bytes_after"]) == (before, weight_bytes(model))
    with torch.no_grad():  # the stream is [end of document] + the text: each token predicted from those before
        logits = model(torch.tensor([[tok.eod_id, *ids[:-1]]]))[0]
    nll = float(torch.nn.functional.cross_entropy(logits.double(), torch.tensor(ids), reduction="sum"))
    assert quantized["mode"] == "int8" and quantized["layers"] == 8 + 1 and quantized["head"]
    assert abs(results["int8"]["nll"] / nll - 1) < 1e-5 and abs(results["fp32"]["nll"] / nll - 1) > 1e-5


def test_bad_quantize_values_are_one_line(tmp_path, capsys):
    gpt = str(save_gpt_checkpoint(tmp_path / "gpt"))
    bert = str(save_bert_checkpoint(tmp_path / "bert"))
    cases = [
        (["serve", "--checkpoint", gpt, "--quantize", "int3"], "choose int8 or int4"),
        (["generate", "--checkpoint", gpt, "--quantize", "int3"], "choose int8 or int4"),
        (["eval", "--checkpoint", gpt, "--task", "shakespeare-cloze", "--quantize", "int3"], "choose int8 or int4"),
        (["serve", "--checkpoint", bert, "--quantize", "int8"], "encoder (BERT) checkpoint"),
        (["serve", "--checkpoint", gpt, "--quantize", "int8", "--parallel.tp=2"], "drop --parallel.tp=2"),
        (["generate", "--checkpoint", gpt, "--quantize", "int4", "--quantize-group-size", "48"], "choose 32, 64"),
        (["generate", "--checkpoint", gpt, "--quantize-float-head"], "go with --quantize"),
        (["generate", "--checkpoint", gpt, "--max-new-tokens", "4", "--quantize", "int4", "--quantize-group-size",
          "128"],
         "groups of 128 do not divide layers.0.attn.qkv's 64 inputs; use --quantize-group-size 32 or 64"),
    ]
    for argv, message in cases:
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out, (argv, err)
