"""The serving engine's compiled step (infer/runner.py, `CacheOptions.compile`): the same greedy tokens as the
eager step and as one request at a time, through decoding, chunked prefill (a chunk that selects no logits
still writes every layer's keys), prefix sharing and speculation; the whole step one graph (attention an opaque
operator inside it, no graph break)."""

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from meshlm.core.config import ModelConfig
from meshlm.infer.engine import CacheOptions, Engine, SamplingParams
from meshlm.infer.runner import Runner
from meshlm.models.generate import generate
from meshlm.models.gpt import GPT

CONFIG = ModelConfig(n_layers=2, hidden_size=32, n_heads=4, n_kv_heads=2, seq_len=64, vocab_size=97,
                     position="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False)


class Ids:
    eod_id = None

    def decode(self, ids):
        return " ".join(map(str, ids))


def alone(model, prompt, n):
    return generate(model, torch.tensor([prompt]), n, temperature=0)[0, len(prompt):].tolist()


# the one test that compiles exactly as `meshlm serve --compile` does, its matrix products autotuned
SERVED_CONFIG = {"test_compiled_and_eager_steps_give_the_single_request_tokens"}


@pytest.fixture(autouse=True)
def untuned(request, monkeypatch):
    """`COMPILE_CONFIG`'s autotuning times Inductor's matrix-product kernels against ATen's (7-16 s a compiled
    engine on a 2-core CPU): it decides which kernel multiplies, not which graphs there are nor what they
    compute, so every test but SERVED_CONFIG's compiles without it."""
    from meshlm.infer import runner as runner_module

    if request.node.originalname not in SERVED_CONFIG:
        monkeypatch.setattr(runner_module, "COMPILE_CONFIG", {k: v for k, v in runner_module.COMPILE_CONFIG.items()
                                                              if not k.startswith("max_autotune")})


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(CONFIG).eval()


@pytest.mark.parametrize("compile", [False, True])
def test_compiled_and_eager_steps_give_the_single_request_tokens(model, compile):
    g = torch.Generator().manual_seed(1)
    system = torch.randint(1, 97, (20,), generator=g).tolist()  # a shared prefix: cascade decoding rows
    prompts = [system + torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 9, 1)]
    prompts += [torch.randint(1, 97, (n,), generator=g).tolist() for n in (30, 2)]  # 30: chunked (max 16)
    options = CacheOptions(block_size=4, max_batched_tokens=16, compile=compile)
    breaks = sum(counters["graph_break"].values())
    engine = Engine(model, Ids(), max_seqs=4, options=options)
    assert (engine.runner.compile_s > 0) == compile  # compiled (and warmed) at start, or not at all
    assert sum(counters["graph_break"].values()) == breaks  # one graph per step: attention inside it
    graphs = counters["stats"]["unique_graphs"]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert counters["stats"]["unique_graphs"] == graphs  # no step compiled anything after start
    assert engine.stats["split_steps"] == 0  # every step one forward, none run again request by request
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == alone(model, prompt, 10)


@pytest.mark.parametrize("kv_heads, in_place", [(2, False), (4, False), (2, True)],
                         ids=["2-cascade", "4-cascade", "2-in-place"])
def test_a_step_of_cascade_rows_only_runs_as_one_forward(kv_heads, in_place, monkeypatch):
    """Decoding rows that all share a prompt's first blocks are one cascade group where the kernel cannot read
    them in place, and the attention operator returns that group's output as the layer's: with one query head
    per KV head (4 of 4) the cascade's result was a view, whose strides the compiled graph's check refused, so
    each such step failed and ran again one request at a time (the same tokens, slowly; counted in
    `split_steps`). The operator's result is contiguous. Where every layer reads the pool in place
    (`models/native.py`) there is no cascade: each row's whole table (the shared blocks, then its own) goes to the
    kernel. One forward a step either way, the same tokens (in place with GQA only: the view's strides were the
    cascade's)."""
    from meshlm.models import native, paged

    calls = {"cascade": 0, "kernel": 0}
    cascade, decode = paged.PagedCache.cascade, native.decode
    monkeypatch.setattr(paged.PagedCache, "cascade",
                        lambda self, *a, **k: calls.__setitem__("cascade", calls["cascade"] + 1) or cascade(self, *a, **k))
    if in_place:
        assert native.paged_decode() is not None, native.unavailable()
        monkeypatch.setattr(native, "decode",
                            lambda *a, **k: calls.__setitem__("kernel", calls["kernel"] + 1) or decode(*a, **k))
    else:
        monkeypatch.setattr(native, "supports", lambda q, pool: False)
        monkeypatch.setattr(native, "takes_pool", lambda pool, n_heads: False)
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, n_kv_heads=kv_heads)).eval()
    g = torch.Generator().manual_seed(2)
    system = torch.randint(1, 97, (20,), generator=g).tolist()
    prompts = [system + torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 5, 2)]
    engine = Engine(model, Ids(), max_seqs=4, options=CacheOptions(block_size=4, compile=True))
    engine.generate([system + [1]], SamplingParams(max_tokens=1, temperature=0))  # the prefix's blocks, cached
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    # the rows attended as a cascade, or in place and never as one
    assert (calls["cascade"] > 0, calls["kernel"] > 0) == ((False, True) if in_place else (True, False))
    assert engine.stats["split_steps"] == 0
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == alone(model, prompt, 8)


@pytest.mark.parametrize("dtype, tokens", [(torch.float32, 64), (torch.bfloat16, 16)])
def test_the_several_token_graph_is_tuned_at_its_dtypes_size(dtype, tokens, monkeypatch):
    """`warm` compiles the several-token graph at `warm_rows` tokens, where Inductor times (and keeps) its matrix
    products: 64 for fp32 weights, 16 otherwise (`WARM_ROWS`); as rows of at most 16 positions, so a model
    shorter than the step (learned positions, 16 of them here) warms inside its length."""
    torch.manual_seed(0)
    short = GPT(dataclasses.replace(CONFIG, seq_len=16, position="learned")).eval().to(dtype)
    runner = Runner(short, num_blocks=8, block_size=4, vocab_size=97)  # eager: `warm` makes the same calls
    plans = []
    monkeypatch.setattr(runner, "forward", plans.append)
    runner.warm()
    several = [plan for plan in plans if len(plan.ids) > 1]
    assert runner.warm_rows == tokens and {len(plan.ids) for plan in several} == {tokens}
    assert {len(plan.select) for plan in several} == {1, tokens}  # selecting the last token, and every one
    assert all(max(positions) < 16 for plan in several for positions, _ in plan.rows)
    # the same warm-up through the model: one row of 64 positions raised IndexError in the position embedding
    Runner(short, num_blocks=8, block_size=4, vocab_size=97).warm()


def test_int8_steps_on_both_sides_of_a_compiled_crossing_compile_nothing_after_start(monkeypatch):
    """On a CPU without native bf16 a compiled int8 step changes branch at `DEQUANTIZE_ROWS` tokens
    (`quantize.compiled_crossing`), so `warm` compiles the several-token graph on both sides; set here to 8 on any
    host. Steps of 3 and 12 tokens, the latter selecting 12 logits or 2 (its int8 head then below the crossing),
    then run without compiling (a graph missing at start is an error once the runner skips guards), each as the
    eager runner computes it (the kernel's bf16 arithmetic apart)."""
    from meshlm.infer import quantize
    from meshlm.infer.scheduler import ForwardPlan

    monkeypatch.setattr(quantize, "COMPILED_DEQUANTIZE_ROWS", 8)
    torch.manual_seed(0)
    m = GPT(CONFIG).eval()
    quantize.quantize_model(m, "int8")
    assert quantize.compiled_crossing(m) == 8 and quantize.compiled_crossing(GPT(CONFIG)) is None
    plans = []
    warmed = Runner(m, num_blocks=16, block_size=4, vocab_size=97)
    monkeypatch.setattr(warmed, "forward", plans.append)
    warmed.warm()
    assert sorted({len(plan.ids) for plan in plans}) == [1, 7, 64]  # one token; below the crossing; above it
    # 64 tokens whose int8 head multiplies 1, 7 (below the crossing) or all 64 of them
    assert sorted(len(plan.select) for plan in plans if len(plan.ids) == 64) == [1, 7, 64]
    compiled = Runner(m, num_blocks=16, block_size=4, vocab_size=97, compile=True)
    eager = Runner(m, num_blocks=16, block_size=4, vocab_size=97)
    graphs = counters["stats"]["unique_graphs"]
    for n, select in ((3, range(3)), (12, range(12)), (12, range(10, 12))):  # blocks and head each side
        plan = ForwardPlan(ids=tuple(range(1, n + 1)), rows=((range(n), tuple(range(1, 5))),), select=tuple(select))
        with torch.no_grad():
            got, want = compiled.forward(plan), eager.forward(plan)
        assert got.shape == (len(select), 97) and torch.allclose(got, want, atol=3e-2, rtol=0), (n, select)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_second_compiled_runner_keeps_each_models_tokens(model):
    """The first compiled runner of a process checks only the guards that tell its graphs apart; a second one's
    graphs share dynamo's cache (one code object), so from then on both check every guard, and neither may run
    the other's graphs (frozen weights): each model's tokens stay its own."""
    before = Runner.compiled_runners
    options = CacheOptions(block_size=4, max_batched_tokens=16, compile=True)
    first = Engine(model, Ids(), max_seqs=2, options=options)
    assert first.runner.guards_skipped or before > 0  # the process's first compiled runner skips
    torch.manual_seed(1)
    other = GPT(CONFIG).eval()
    second = Engine(other, Ids(), max_seqs=2, options=options)
    assert not first.runner.guards_skipped and not second.runner.guards_skipped
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(1, 20))]  # decoding rows and a chunked prompt
    for engine, m in ((second, other), (first, model), (second, other)):
        for prompt, out in zip(prompts, engine.generate(prompts, params)):
            assert out.output_ids == alone(m, prompt, 8)


@pytest.mark.parametrize("specialize", [True, False], ids=["committed", "unspecialized"])
def test_the_compiled_step_takes_its_norms_eps_as_constants(model, specialize, monkeypatch):
    """The runner compiles with dynamo's floats and ints specialized (`runner.SPECIALIZE`): a norm's eps or a
    cache's block size is a constant of the graph, not an input converted to a tensor before every call (61 of
    them made up most of the 0.3 ms of Python before SmolLM2's compiled one-token graph). The same check fails
    without it, so it sees the conversion where there is one."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from meshlm.infer import runner as runner_module

    if not specialize:
        monkeypatch.setattr(runner_module, "SPECIALIZE", {})
    torch._dynamo.reset()  # this case's graphs alone
    Engine(model, Ids(), max_seqs=2, options=CacheOptions(block_size=4, max_batched_tokens=16, compile=True))
    entries = _debug_get_cache_entry_list(Runner._dense.__code__)
    assert len(entries) >= 3  # one token at 0, one past it, several
    converted = ["_as_tensor_fullprec" in e.code.co_names for e in entries]
    assert not any(converted) if specialize else all(converted)


@pytest.mark.parametrize("in_place", [False, True], ids=["slot-index", "in-place"])
def test_a_single_row_attends_inside_the_graph(model, in_place, monkeypatch):
    """A step of one token past the first attends inside the compiled graph (`RowCache`: the pool written by the
    graph, read by its own kernels through the slot index, or in place by meshlm's kernel as the operator
    `row_decode`, whose CPU kernel is C++ where `native.row_ops()` builds, else a Python function calling
    `native.decode`): the eager attention operator runs for the prompt's chunk only, every layer of every one-token
    step calls `row_decode` (counted by the profiler, which sees the dispatcher's calls), and every token is still
    the single request's."""
    from meshlm.models import native, paged

    calls, placed = [], []
    inner, decode = paged.PagedCache.update_and_attend, native.decode
    monkeypatch.setattr(paged.PagedCache, "update_and_attend", lambda self, *a, **k: calls.append(1) or inner(self, *a, **k))
    monkeypatch.setattr(native, "decode", lambda *a, **k: placed.append(1) or decode(*a, **k))
    if not in_place:
        monkeypatch.setattr(native, "takes_pool", lambda pool, n_heads: False)
    engine = Engine(model, Ids(), max_seqs=2, options=CacheOptions(block_size=4, compile=True))
    assert engine.runner.kv.rows_in_graph and engine.runner.kv.rows_in_place == in_place, native.unavailable()
    calls.clear()
    placed.clear()
    prompt = [3, 1, 4, 1, 5, 9]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.output_ids == alone(model, prompt, 12)
    assert len(calls) == CONFIG.n_layers  # the prompt's one chunk; none of the eleven one-token steps
    rows = sum(e.name == "meshlm::row_decode" for e in prof.events())
    assert rows == (11 * CONFIG.n_layers if in_place else 0)
    cpp = in_place and native.row_ops() is not None  # loaded by the compiled runner: no Python in the call
    assert len(placed) == (11 * CONFIG.n_layers if in_place and not cpp else 0)


GC_SCRIPT = textwrap.dedent("""
    import gc, sys, torch
    from meshlm.core.config import ModelConfig
    from meshlm.infer import runner
    from meshlm.infer.engine import CacheOptions, Engine, SamplingParams
    from meshlm.models.gpt import GPT
    runner.COMPILE_CONFIG = {"freezing": True}  # untuned, as in the other tests (`untuned`)
    class Ids:
        eod_id = None
        def decode(self, ids):
            return " ".join(map(str, ids))
    torch.manual_seed(0)
    engine = Engine(GPT(ModelConfig(**CONFIG)).eval(), Ids(), max_seqs=2, options=CacheOptions(block_size=4, compile=True))
    errors, collections = [], []
    sys.unraisablehook = lambda u: errors.append(repr(u.exc_value)[:100])
    gc.callbacks.append(lambda phase, info: collections.append(phase))  # a Python frame at every collection
    gc.set_threshold(1)  # a collection at (nearly) every allocation, inside the compiled call's frame too
    outs = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    print(engine.runner.guards_skipped, len(collections) > 0, gc.isenabled(), [len(o.output_ids) for o in outs], errors)
""")


def test_no_collection_runs_inside_the_unguarded_compiled_call():
    """Under the stance that skips guards dynamo refuses every frame it has not compiled, so a garbage collection
    inside the compiled call would fail its finalizers (in a server: another thread's; the asyncio task set's
    WeakSet entries). A fresh interpreter, so that this runner is the process's only compiled one; collections at
    every allocation, each running a Python callback: none fails, and collection runs again between steps.
    Without the collector paused around the call: one refused callback a step."""
    root = Path(__file__).resolve().parents[2]
    config = {k: getattr(CONFIG, k) for k in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "seq_len",
                                              "vocab_size", "position", "norm", "activation", "bias",
                                              "tie_embeddings")}
    out = subprocess.run([sys.executable, "-c", f"CONFIG = {config!r}\n" + GC_SCRIPT], capture_output=True,
                         text=True, cwd=root, check=True, timeout=300)
    assert out.stdout.split("\n")[-2] == "True True True [12, 12] []", out.stdout + out.stderr[-2000:]


def test_serve_compile_flag_reaches_the_cache_options():
    from meshlm.cli import build_parser
    from meshlm.commands.serve import cache_options

    parse = build_parser().parse_args
    assert cache_options(parse(["serve", "--checkpoint", "x", "--compile"])).compile is True
    assert cache_options(parse(["serve", "--checkpoint", "x"])).compile is False  # eager by default


def test_serve_compile_with_adapters_is_one_error_line_before_loading(capsys):
    from meshlm.cli import main

    assert main(["serve", "--checkpoint", "nowhere", "--compile", "--adapter", "a"]) == 2  # nothing opened
    err = capsys.readouterr().err.strip()
    assert "--compile" in err and "--adapter" in err and len(err.splitlines()) == 1
