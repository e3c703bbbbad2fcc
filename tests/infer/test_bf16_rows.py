"""meshlm's bf16 rows (`meshlm::bf16_rows`, models/kernels/bf16_rows.cpp) and the linears that call it
(infer/rows.py): the kernel against an fp32 product of the same bf16 values, the module against F.linear, the graphs
a compiled step traces, and the runner that turns a bf16 model's linears.

The kernel sums in fp32 in another order than an fp32 matrix product and rounds the sum to bf16 once, so each
output is within bf16's rounding of the fp32 product (half a unit in the last place, 2⁻⁹ relative) plus fp32's
rounding of K terms (below 1e-4 here); `TOL` allows twice that. A wrong lane, a dropped tail or a row mixed with
another moves an output by the size of a whole term (of order 1). Skipped where the kernel cannot be built (no
AVX512-BF16: `native.unavailable("bf16_rows")` says why), except the checks that hold on any CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshlm.infer import rows as rows_module
from meshlm.infer.rows import ROWS, Bf16RowsLinear, use_bf16_rows
from meshlm.models import native

BUILT = native.bf16_rows() is not None
needs_kernel = pytest.mark.skipif(not BUILT, reason=f"meshlm's bf16 rows: {native.unavailable('bf16_rows')}")
TOL = {"rtol": 2 ** -8, "atol": 2e-4}


def _operands(R: int, K: int, N: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(R, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16())


@needs_kernel
@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("K, N", [(576, 100), (64, 7), (40, 4), (33, 13), (1, 3)])
def test_the_kernel_equals_an_fp32_product_within_bf16_rounding(R, K, N):
    """Every row count (1-4 sharing a weight load, more in fours), K with and without a tail below 32, N with and
    without a last partial tile of channels."""
    x, w = _operands(R, K, N)
    y = torch.ops.meshlm.bf16_rows.default(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (R, N)
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), **TOL)


@needs_kernel
def test_the_kernel_reads_rows_with_a_stride_and_rounds_to_nearest_even():
    x, w = _operands(3, 96, 8)
    wide = torch.zeros(3, 160, dtype=torch.bfloat16)
    wide[:, :96] = x
    view = wide[:, :96]  # rows 160 apart
    assert view.stride() == (160, 1)
    torch.testing.assert_close(torch.ops.meshlm.bf16_rows.default(view, w), torch.ops.meshlm.bf16_rows.default(x, w),
                               rtol=0, atol=0)
    # 1 + 2⁻⁸ lies halfway between two bf16 values (1 and 1 + 2⁻⁷): to nearest even is 1; 1 + 3·2⁻⁸ rounds up
    one = torch.ones(1, 2, dtype=torch.bfloat16)
    halves = torch.tensor([[1.0, 2 ** -8], [1.0, 3 * 2 ** -8]], dtype=torch.bfloat16)
    assert torch.ops.meshlm.bf16_rows.default(one, halves).float().tolist() == [[1.0, 1.0 + 2 ** -6]]


@needs_kernel
def test_bad_operands_are_refused_with_the_shape_and_dtype():
    x, w = _operands(2, 64, 8)
    with pytest.raises(RuntimeError, match="x must be a non-empty .rows, K. bfloat16"):
        torch.ops.meshlm.bf16_rows.default(x.float(), w)
    with pytest.raises(RuntimeError, match=r"w must be a contiguous \(N, 64\) bfloat16"):
        torch.ops.meshlm.bf16_rows.default(x, w.t().contiguous().t())
    with pytest.raises(RuntimeError, match=r"w must be a contiguous \(N, 64\)"):
        torch.ops.meshlm.bf16_rows.default(x, w[:, :32].contiguous())


def _linear(K=64, N=48, bias=True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(K, N, bias=bias).bfloat16()


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 1, 64), (ROWS, 64), (ROWS + 1, 64), (2, 5, 64)])
@torch.no_grad()
def test_the_linear_calls_the_kernel_for_few_rows_and_f_linear_for_more(shape, monkeypatch):
    calls = []
    op = torch.ops.meshlm.bf16_rows.default
    monkeypatch.setattr(rows_module.torch.ops.meshlm.bf16_rows, "default", lambda *a: calls.append(1) or op(*a))
    module = _linear()
    reference = F.linear
    x = torch.randn(*shape).bfloat16()
    expected = reference(x, module.weight, module.bias)
    assert use_bf16_rows(module, force=True) == 1 and type(module) is Bf16RowsLinear
    y = module(x)
    n_rows = x.numel() // 64
    assert calls == ([1] if n_rows <= ROWS else [])
    assert y.shape == expected.shape and y.dtype == torch.bfloat16
    # F.linear rounds x Wᵀ to bf16 before the bias and the kernel's product is rounded too: two roundings apart
    torch.testing.assert_close(y.float(), expected.float(), rtol=2 ** -7, atol=4e-3)


@needs_kernel
def test_a_product_autograd_records_stays_f_linear_so_gradients_flow(monkeypatch):
    """A turned model that is also trained (online RL's policy generates through the engine): one row with
    gradients on goes through F.linear (the operator has no derivative), and its gradients are F.linear's; the
    same row without gradients goes through the kernel."""
    calls = []
    op = torch.ops.meshlm.bf16_rows.default
    monkeypatch.setattr(rows_module.torch.ops.meshlm.bf16_rows, "default", lambda *a: calls.append(1) or op(*a))
    module, plain = _linear(), _linear()
    use_bf16_rows(module, force=True)
    x = torch.randn(1, 64).bfloat16()
    for m in (module, plain):
        m(x.detach().requires_grad_()).float().square().sum().backward()
    assert calls == []
    assert torch.equal(module.weight.grad, plain.weight.grad) and torch.equal(module.bias.grad, plain.bias.grad)
    with torch.no_grad():
        module(x)
    assert calls == [1]


def test_only_plain_bf16_cpu_linears_turn_and_a_tied_head_stays_tied():
    """`use_bf16_rows` changes the class of plain nn.Linear modules with a bf16 weight, nothing else: an fp32
    linear, a subclass, a non-linear module keep theirs; a head tied to the embedding keeps the same Parameter."""

    class Sub(nn.Linear):
        pass

    torch.manual_seed(0)
    model = nn.ModuleDict({"embed": nn.Embedding(10, 32), "head": nn.Linear(32, 10, bias=False),
                           "fp32": nn.Linear(32, 32), "sub": Sub(32, 32), "norm": nn.LayerNorm(32)})
    model.head.weight = model.embed.weight
    model = model.bfloat16()
    model.fp32.float()
    turned = use_bf16_rows(model, force=True)
    if not BUILT:  # force needs the kernel: nothing turns without it
        assert turned == 0 and type(model.head) is nn.Linear
        return
    assert turned == 1
    assert type(model.head) is Bf16RowsLinear and model.head.weight is model.embed.weight
    assert type(model.fp32) is nn.Linear and type(model.sub) is Sub and type(model.norm) is nn.LayerNorm


def test_wanted_only_on_avx512_bf16_without_amx(monkeypatch):
    """The rule (infer/rows.py): bf16 weights on the CPU, native bf16 from AVX512-BF16 alone, the kernel built."""
    model = _linear()
    for support, expected in [("AVX512-BF16", BUILT), ("AMX-BF16", False), (None, False)]:
        monkeypatch.setattr(rows_module, "cpu_bf16_support", lambda support=support: support)
        assert rows_module.wanted(model) is expected, support
        assert rows_module.wanted(_linear().float()) is False
    monkeypatch.setattr(rows_module, "cpu_bf16_support", lambda: "AVX512-BF16")
    monkeypatch.setattr(native, "bf16_rows", lambda: None)
    assert rows_module.wanted(model) is False and use_bf16_rows(model) == 0 and type(model) is nn.Linear


@needs_kernel
def test_a_compiled_graph_calls_the_kernel_at_one_row_and_never_branches_on_a_dynamic_count():
    """Traced with dynamic sizes, as the runner's step is: the one-row graph holds the operator; the graph of
    several rows (2 and on: sizes 0 and 1 are specialized) holds F.linear's product and no guard on the count,
    so 3 and 9 rows reuse it."""
    module = _linear()
    use_bf16_rows(module, force=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda x: module(x), backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (1, 2, 3, 9):
            x = torch.randn(n, 1, 64).bfloat16()
            torch.testing.assert_close(fn(x).float(), module(x).float(), rtol=2 ** -7, atol=4e-3)
    torch._dynamo.reset()
    assert len(graphs) == 2, graphs
    assert "meshlm.bf16_rows.default" in graphs[0] and not any("linear" in t for t in graphs[0])
    assert "meshlm.bf16_rows.default" not in graphs[1] and any("linear" in t for t in graphs[1])


def test_the_kernel_loads_wherever_the_cpu_has_avx512_bf16(monkeypatch):
    """Built with its operator (`kernels/bf16_ops.cpp`, PyTorch's headers) under its own name and loaded into the
    dispatcher wherever the CPU flags name AVX512-BF16 (a failed build there would silently leave a served bf16
    model on oneDNN's slower one-row products); elsewhere refused with the reason. `MESHLM_BF16_KERNEL=0` refuses
    it with its own."""
    if "avx512_bf16" in native._cpu_flags().split():
        assert BUILT, native.unavailable("bf16_rows")
        assert native.bf16_rows().rsplit("/", 1)[-1].startswith("bf16_ops-")
        cpu = [line for line in torch._C._dispatch_dump("meshlm::bf16_rows").splitlines() if line.startswith("CPU:")]
        assert len(cpu) == 1 and "bf16_ops.cpp" in cpu[0], cpu
    elif native.compiler() is not None:
        assert not BUILT and native.unavailable("bf16_rows") == "this CPU lacks AVX512-BF16"
    monkeypatch.setenv("MESHLM_BF16_KERNEL", "0")
    assert native._open("MESHLM_BF16_KERNEL", native.BF16_SOURCE) == (None, "MESHLM_BF16_KERNEL=0")


@needs_kernel
@torch.no_grad()
def test_a_compiled_bf16_engine_decodes_through_the_kernel_as_the_model_recomputing_everything(monkeypatch):
    """The runner turns a bf16 model's linears on this CPU (where `wanted`), and its compiled one-token graph (one
    request decoding) calls the operator from Inductor's code: each greedy choice is the bf16 model's argmax over
    the whole sequence recomputed (F.linear's products, no cache), or within bf16's rounding of it, and its
    log-probability matches that reference's within test_serving_dtype's tolerance. The products are autotuned
    out (as tests/infer/test_compiled_step.py's): they decide which kernel multiplies, not what the graph is."""
    from meshlm.core.config import ModelConfig
    from meshlm.infer import runner as runner_module
    from meshlm.infer.engine import CacheOptions, Engine, SamplingParams
    from meshlm.models.gpt import GPT
    from tests.infer.test_compiled_step import Ids
    from tests.infer.test_serving_dtype import LOGPROB_TOL, TIE_TOL

    monkeypatch.setattr(runner_module, "COMPILE_CONFIG", {k: v for k, v in runner_module.COMPILE_CONFIG.items()
                                                          if not k.startswith("max_autotune")})
    monkeypatch.setattr(rows_module, "cpu_bf16_support", lambda: "AVX512-BF16")  # `wanted` on any CPU that builds it
    cfg = ModelConfig(n_layers=1, hidden_size=64, n_heads=4, n_kv_heads=2, seq_len=64, vocab_size=97,
                      position="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=True)
    torch.manual_seed(0)
    model = GPT(cfg).eval().bfloat16()
    reference = GPT(cfg).eval().bfloat16()
    reference.load_state_dict(model.state_dict())
    engine = Engine(model, Ids(), max_seqs=2, options=CacheOptions(block_size=4, compile=True))
    assert engine.runner.compile_s > 0
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is Bf16RowsLinear for m in linears)  # the blocks' and the tied head
    prompt = torch.randint(1, 97, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (req,) = engine.generate([prompt], params)
    assert "meshlm::bf16_rows" in {e.key for e in prof.key_averages()}
    seq, worst = list(prompt), 0.0
    for info in req.output:
        ref = torch.log_softmax(reference(torch.tensor([seq]))[0, -1].float(), -1)
        assert float(ref.max() - ref[info.id]) <= TIE_TOL, (seq, info.id, int(ref.argmax()))
        worst = max(worst, abs(info.logprob - float(ref[info.id])))
        seq.append(info.id)
    assert len(req.output) == 8 and worst <= LOGPROB_TOL, worst
