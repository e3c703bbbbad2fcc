"""The serving engine's cache memory (issue 46, item 5): MLA caches its latent and RoPE key, sliding-window layers
give back the blocks that fall out of their window, and the pool's bytes per token are `core/kv_cache.py`'s
formula, which the serving planner uses too. Every output is checked against the plain model's whole-sequence
forward (teacher-forced argmax, no cache) or its logits; every pool count against a hand computation."""

import itertools

import pytest
import torch

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.core.kv_cache import cache_bytes_per_token, sequence_cache_bytes, window_blocks
from meshlm.infer.engine import CacheOptions, Engine, SamplingParams
from meshlm.models.gpt import GPT
from meshlm.models.paged import Batch, PagedKV
from tests.infer.test_paged import run

LLAMA = {"vocab_size": 97, "n_layers": 2, "hidden_size": 32, "n_heads": 4, "n_kv_heads": 2, "seq_len": 128,
         "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False}
MLA = dict(LLAMA, n_kv_heads=None, attention="mla", q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=6)
W, BS = 6, 4  # the window and the block size of the window tests


class Ids:
    eod_id = None

    def decode(self, ids):
        return " ".join(map(str, ids))


def model_of(seed=0, **cfg) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(**cfg)).eval()


def prompt_of(n: int, seed: int = 3) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_greedy(model, prompt, output):
    """`output` is the whole-sequence forward's argmax at every generated position (teacher forcing)."""
    tokens = torch.tensor([prompt + output])
    with torch.no_grad():
        want = model(tokens[:, :-1]).argmax(-1)[0, len(prompt) - 1:]
    assert output == want.tolist()


@pytest.mark.parametrize("cfg, per_layer", [
    (LLAMA, 2 * 2 * 8),  # a key and a value per KV head: 2 heads of 8
    (MLA, 8 + 4),  # kv_lora_rank + qk_rope_head_dim, not 2 · 4 heads · max(8 + 4, 6)
    ({**LLAMA, "sliding_window": W}, 2 * 2 * 8),
    ({**LLAMA, "n_layers": 4, "sliding_window": W, "window_pattern": 2}, 2 * 2 * 8),
])
def test_pool_bytes_per_token_equal_the_formula(cfg, per_layer):
    """The pool's allocated bytes per position (fp32) equal `cache_bytes_per_token` and the hand count; with mixed
    local and global layers the local ones hold a pool of their own, smaller, at the same bytes per position."""
    model, m = model_of(**cfg), ModelConfig(**cfg)
    assert cache_bytes_per_token(m, 4) == m.n_layers * per_layer * 4
    kv = PagedKV(model, 10, BS)
    assert kv.bytes_per_token() == cache_bytes_per_token(m, 4) and kv.nbytes() == 10 * BS * kv.bytes_per_token()
    if cfg.get("window_pattern"):
        engine = Engine(model, Ids(), max_seqs=2, options=CacheOptions(block_size=BS, max_batched_tokens=3))
        local = engine.runner.local_blocks
        assert local == 2 * (-(-(3 + W - 1) // BS) + 1)  # two rows of a 3-token step and the window before it
        assert engine.runner.cache_bytes() == (2 * engine.pool.num_blocks + 2 * local) * BS * per_layer * 4
        assert engine.runner.cache_bytes_per_token() == cache_bytes_per_token(m, 4)


def test_mla_paged_steps_equal_the_plain_forward():
    """MLA through the latent cache (absorbed form): prefill chunks, decoding rows of different lengths and two
    decoding rows sharing their first blocks (the cascade, at MLA's own softmax scale) give the plain forward's
    logits (float64, 1e-10)."""
    model = model_of(**MLA).double()
    kv = PagedKV(model, 24, BS)
    a, b = prompt_of(13, seed=1), prompt_of(6, seed=2)
    shared = a[:8] + [5, 9, 11]  # its first two blocks are a's (as prefix caching hands them out)
    ta, tb, ts = [3, 7, 1, 20], [9, 4], [3, 7, 15]
    run(model, kv, Batch([(range(9), ta), (range(6), tb)], BS, "cpu"), a[:9] + b)
    run(model, kv, Batch([(range(9, 13), ta), (range(8, 11), ts)], BS, "cpu"), a[9:] + shared[8:])
    batch = Batch([(range(11, 12), ts), (range(13, 14), ta + [21])], BS, "cpu")
    assert [g.shared is not None for g in batch.groups] == [True]  # a and shared decode as a cascade
    logits = run(model, kv, batch, [40, 41])
    logits = torch.cat([logits, run(model, kv, Batch([(range(6, 7), tb)], BS, "cpu"), [42])])
    refs = [shared + [40], a + [41], b + [42]]
    for row, seq in zip(logits, refs):
        torch.testing.assert_close(row, model(torch.tensor([seq]))[0, -1], rtol=0, atol=1e-10)


def test_mla_engine_greedy_equals_the_plain_forward():
    """The engine over an MLA model (chunked prefill, batching, a prompt sharing cached blocks) answers the
    plain forward's greedy tokens, holding (kv_lora_rank + qk_rope_head_dim) · 4 bytes per layer and position."""
    model = model_of(**MLA)
    engine = Engine(model, Ids(), max_seqs=3, options=CacheOptions(block_size=BS, max_batched_tokens=5))
    prompts = [prompt_of(9, 1), prompt_of(13, 2), prompt_of(4, 3)]
    prompts.append(prompts[1][:8] + [3, 4])
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine.generate([prompts[1]], sp)
    for prompt, req in zip(prompts, engine.generate(prompts, sp)):
        assert_greedy(model, prompt, req.output_ids)
    assert engine.stats["prefix_hit_tokens"] > 0
    assert engine.runner.cache_bytes() == engine.pool.num_blocks * BS * 2 * (8 + 4) * 4


def test_freed_blocks_overwritten_by_others_change_nothing():
    """A windowed model (float64): two sequences of 20 and 17 tokens, then their blocks before the window are
    overwritten with noise (as when the pool hands them to other requests); a step of decoding rows and a
    3-token run gives the whole forward's logits (1e-10), whether the layout skips those blocks (`window`: it
    reads about W positions a row, not the whole sequence) or gathers and masks them."""
    model = model_of(**{**LLAMA, "sliding_window": W}).double()
    kv = PagedKV(model, 16, BS)
    a, b = prompt_of(20, seed=1), prompt_of(17, seed=2)
    ta, tb = [3, 7, 1, 12, 5, 9], [2, 8, 0, 4, 10]
    run(model, kv, Batch([(range(20), ta), (range(17), tb)], BS, "cpu"), a + b)
    for k, v, _, _ in kv.layers:  # blocks 3, 7, 1 (a's positions 0..11) and 2, 8 (b's 0..7): out of the window
        for block in (3, 7, 1, 2, 8):
            k[:, block * BS:(block + 1) * BS] = torch.randn(k.shape[0], BS, k.shape[2], dtype=k.dtype) * 1e3
            v[:, block * BS:(block + 1) * BS] = torch.randn(v.shape[0], BS, v.shape[2], dtype=v.dtype) * 1e3
    rows = [(range(20, 21), ta), (range(17, 20), tb)]
    refs = [model(torch.tensor([a + [40]]))[0, -1:], model(torch.tensor([b + [41, 42, 43]]))[0, -3:]]
    for window in (W, 0):
        batch = Batch(rows, BS, "cpu", window=window)
        if window:
            assert max(g.keys for g in batch.groups) <= (window_blocks(W, BS) + 1) * BS < 20
        logits = run(model, kv, batch, [40, 41, 42, 43])
        torch.testing.assert_close(logits, torch.cat(refs), rtol=0, atol=1e-10)


def test_an_unmerged_lora_on_mla_kv_up_is_refused_not_ignored():
    """The absorbed form reads kv_up's weight, not its output: an unmerged LoRA there (`tune/lora.py`'s hook on
    the output) would be skipped, so the request fails naming the fix instead of answering without it. (The
    server refuses such an adapter before it loads: tests/tune/test_tune_mla_lora.py.)"""
    from meshlm.tune.lora import Block, attach_lora

    model = model_of(**MLA)
    kv_up = model.layers[0].attn.kv_up
    attach_lora(kv_up, [Block("kv_up", 0, kv_up.weight.shape[0])], rank=2, alpha=4, dropout=0.0,
                prefix="layers.0.attn.kv_up", seed=0)
    engine = Engine(model, Ids(), max_seqs=1, options=CacheOptions(block_size=BS))
    req = engine.generate([prompt_of(5)], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert req.finish_reason == "error" and "merge that adapter" in req.error


def decode_tracking(engine, reqs, each=None):
    """Step `engine` until `reqs` finish (calling `each(computed before the step, by id)` after every step); per step (computed before, computed
    after) of each request and the pools' used blocks, checking on the way that every live block's reference
    count is the number of live tables holding it (freeing never takes a block another request holds)."""
    trace = []
    while not all(r.finished for r in reqs):
        before = [r.computed for r in reqs]
        engine.step()
        if each is not None:
            each({id(r): c for r, c in zip(reqs, before)})
        for g in engine.scheduler.groups:
            holders: dict[int, int] = {}
            for r in engine.active:
                for b in getattr(r, g.table)[getattr(r, g.freed):]:
                    holders[b] = holders.get(b, 0) + 1
            assert all(g.pool.refs[b] == n for b, n in holders.items())
        local = engine.local_pool.used if engine.local_pool is not None else None
        trace.append((before, [r.computed for r in reqs], engine.pool.used, local, len(engine.pool.free)))
    return trace


def held(c0: int, c1: int, window: int) -> int:
    """Blocks a request holds after a step computing positions c0..c1-1: up to its last position's, from the
    first still in the window of position c0 (hand formula)."""
    return -(-c1 // BS) - max(0, c0 - window + 1) // BS


def test_a_long_context_frees_the_blocks_every_layer_left_behind():
    """Every layer local (Mistral), window 6, blocks of 4, a pool of 4 blocks and a sequence of 51 positions (13
    blocks): the engine admits it (it holds at most the step's and the window's blocks), the pool's free count
    rises as the sequence passes the window, each step holds exactly the hand count, the most it holds is
    `window_blocks` (the planner's count), and the greedy output is the plain forward's."""
    cfg = {**LLAMA, "sliding_window": W}
    model = model_of(**cfg)
    engine = Engine(model, Ids(), max_seqs=1, options=CacheOptions(block_size=BS, max_batched_tokens=3,
                                                                   num_blocks=4, prefix_caching=False))
    prompt = prompt_of(11)
    req = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    trace = decode_tracking(engine, [req])
    assert_greedy(model, prompt, req.output_ids)
    for (c0,), (c1,), used, _, _ in trace[:-1]:
        assert used == held(c0, c1, W)
    free = [f for *_, f in trace]
    assert any(later > earlier for earlier, later in itertools.pairwise(free))  # blocks came back mid-sequence
    decoding = [used for (c0,), _, used, _, _ in trace[:-1] if c0 >= len(prompt)]
    assert max(decoding) == window_blocks(W, BS) == 3
    m = ModelConfig(**cfg)
    assert sequence_cache_bytes(m, 51, 4, BS) == max(decoding) * BS * engine.runner.cache_bytes_per_token()
    assert engine.stats["window_freed_blocks"] == max(max(0, c0 - W + 1) // BS for (c0,), *_ in trace)
    assert engine.pool.used == 0


def test_freeing_respects_blocks_shared_by_prefix():
    """Two requests share their first 8 prompt tokens (prefix caching hands the second the first's registered
    blocks) and run past the window together: each frees its own references only (reference counts checked
    every step), and both answer the plain forward's greedy tokens."""
    model = model_of(**{**LLAMA, "sliding_window": W})
    engine = Engine(model, Ids(), max_seqs=2, options=CacheOptions(block_size=BS, max_batched_tokens=4,
                                                                   num_blocks=12))
    a = prompt_of(10)
    b = a[:8] + [5, 6, 7]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.generate([a], sp)  # registers a's blocks
    reqs = [engine.submit(p, sp) for p in (a, b)]
    decode_tracking(engine, reqs)
    assert engine.stats["prefix_hit_tokens"] >= 16
    for prompt, req in zip((a, b), reqs):
        assert_greedy(model, prompt, req.output_ids)


def test_mixed_local_and_global_layers_free_only_the_local_blocks():
    """Local and global layers alternating (gpt-oss: window_pattern 2, with sinks): the local layers' own pool
    holds at most the step's and the window's blocks per request while the global layers keep every block; two
    requests sharing a prefix answer the plain forward's greedy tokens."""
    model = model_of(**{**LLAMA, "n_layers": 4, "sliding_window": W, "window_pattern": 2, "attention_sinks": True})
    engine = Engine(model, Ids(), max_seqs=2, options=CacheOptions(block_size=BS, max_batched_tokens=3,
                                                                   num_blocks=30))
    a = prompt_of(11)
    b = a[:8] + [5, 6, 7]
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.generate([a], sp)
    reqs = [engine.submit(p, sp) for p in (a, b)]
    def only_local_blocks_go(before):
        for r in engine.active:
            assert r.freed == 0 and len(r.blocks) == -(-r.computed // BS)  # the global layers' table: whole
            assert len(r.local_blocks) - r.local_freed == held(before[id(r)], r.computed, W)

    trace = decode_tracking(engine, reqs, only_local_blocks_go)
    for prompt, req in zip((a, b), reqs):
        assert_greedy(model, prompt, req.output_ids)
    assert max(local for *_, local, _ in trace) <= 2 * window_blocks(W, BS) < max(used for _, _, used, *_ in trace)
    assert engine.local_pool.used == engine.pool.used == 0


@pytest.mark.parametrize("extra", [{}, {"n_layers": 4, "window_pattern": 2}], ids=["all-local", "mixed"])
def test_speculative_drafts_under_windows_equal_the_plain_forward(extra):
    """n-gram drafts (blocks reserved in every group, rejected ones overwritten) with blocks freed on the way:
    the greedy tokens are still the plain forward's."""
    from meshlm.infer.speculative import Speculator

    model = model_of(**{**LLAMA, "sliding_window": W, **extra})
    options = CacheOptions(block_size=BS, max_batched_tokens=8, speculative="ngram", num_draft_tokens=3)
    engine = Engine(model, Ids(), max_seqs=2, options=options, speculator=Speculator("ngram"))
    prompts = [[5, 6, 7] * 3 + [5, 6], [1, 2, 3] * 2 + [1, 2]]
    for prompt, req in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0,
                                                                            ignore_eos=True))):
        assert_greedy(model, prompt, req.output_ids)
    assert engine.stats["accepted_tokens"] > 0 and engine.stats["window_freed_blocks"] > 0


def test_a_window_bounds_what_a_request_needs_of_the_pool():
    """A request of 51 positions needs 13 blocks of 4; under a window of 6 with steps of at most 3 tokens it holds
    at most 3: a pool of 4 admits it, and refuses it without the window (naming --num-blocks)."""
    from meshlm.infer.sampling import InvalidRequest

    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    options = CacheOptions(block_size=BS, max_batched_tokens=3, num_blocks=4)
    windowed = Engine(model_of(**{**LLAMA, "sliding_window": W}), Ids(), max_seqs=1, options=options)
    windowed.check(prompt_of(11), sp)
    assert windowed.scheduler.blocks_needed(51, W) == -(-(3 + W - 1) // BS) + 1 == 3
    with pytest.raises(InvalidRequest, match="--num-blocks"):
        Engine(model_of(**LLAMA), Ids(), max_seqs=1, options=options).check(prompt_of(11), sp)
    from meshlm.infer.server import check_pool

    check_pool(options, 128, window=W)  # the server's start-up check counts the same need
    with pytest.raises(ConfigError, match="raise --num-blocks to at least 32"):
        check_pool(options, 128)


def test_metrics_report_bytes_per_token_and_freed_blocks():
    from tests.infer.server_helpers import http
    from tests.infer.test_server_load import serve_in_thread

    model = model_of(**{**LLAMA, "n_layers": 4, "sliding_window": W, "window_pattern": 2})
    engine = Engine(model, Ids(), max_seqs=1, options=CacheOptions(block_size=BS, max_batched_tokens=3))
    engine.generate([prompt_of(11)], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    with serve_in_thread(engine) as url:
        text = http("GET", url + "/metrics")[2]
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert int(values["meshlm_kv_cache_bytes_per_token"]) == 4 * 2 * 2 * 8 * 4
    assert int(values["meshlm_kv_cache_window_freed_blocks_total"]) == engine.stats["window_freed_blocks"] > 0
    assert int(values["meshlm_kv_cache_local_blocks"]) == engine.runner.local_blocks


def test_the_serving_planner_counts_the_engine_bytes():
    """`plan/inference.py` sizes a request's cache by the engine's formula: MLA's latent whole on every tp rank;
    a Mistral-style window at most `window_blocks` blocks of 16 positions, at 16 bits."""
    from meshlm.plan.catalog import get_gpu
    from meshlm.plan.inference import serving_estimate

    gpu = get_gpu("a100-80gb")
    for cfg, per_request in (
            (MLA, 2 * 608 * (8 + 4) * 2),  # 2 layers, 600 positions in 38 blocks of 16, r + d_r, 2 bytes
            ({**LLAMA, "seq_len": 1024, "sliding_window": 100}, 2 * window_blocks(100, 16) * 16 * 2 * 2 * 8 * 2)):
        m = ModelConfig(**{**cfg, "seq_len": 1024})
        est = serving_estimate(m, gpu, 1, 1, 500, 100, 8)
        assert est.kv_per_request_bytes == per_request == sequence_cache_bytes(m, 600, 2, 16)
        one, four = (serving_estimate(m, gpu, 2, batch, 500, 100, 8) for batch in (1, 4))
        split = 1 if m.attention == "mla" else 2  # tp 2: MLA's latent whole on each rank, 2 KV heads split
        activations = 3 * 500 * (2 * 32 + 2 * m.ffn_size / 2 + 97 / 2) * 2  # three more prompts' prefill
        assert four.memory_bytes - one.memory_bytes == pytest.approx(3 * per_request / split + activations)


@pytest.mark.slow
@pytest.mark.parametrize("model", [
    {k: v for k, v in MLA.items() if k not in ("vocab_size", "n_layers", "hidden_size", "n_heads", "seq_len")},
    {k: v for k, v in LLAMA.items() if k not in ("vocab_size", "n_layers", "hidden_size", "n_heads", "seq_len")}
    | {"sliding_window": W},
    {k: v for k, v in LLAMA.items() if k not in ("vocab_size", "hidden_size", "n_heads", "seq_len")}
    | {"n_layers": 4, "sliding_window": W, "window_pattern": 2, "attention_sinks": True}], ids=["mla", "window", "mixed"])
def test_tp2_server_greedy_equals_one_process(model, tmp_path):
    """`meshlm serve --parallel.tp=2` (gloo): MLA's absorbed form on each rank's heads (its latent whole on both),
    an all-local window freeing blocks (the leader's scheduler) and mixed local and global layers (the local
    layers' own pool on both ranks) answer the one-process engine's greedy text."""
    import json
    import sys

    from tests.checkpoint_helpers import load_run
    from tests.infer.server_helpers import ServeProcess, http, save_gpt_checkpoint

    ckpt = save_gpt_checkpoint(tmp_path / "ckpt", seed=3, **model)
    loaded, tokenizer, _ = load_run(str(ckpt))
    prompt = "ROMEO. But soft, what light through yonder window breaks"
    options = CacheOptions(block_size=4, max_batched_tokens=8)
    want = Engine(loaded, tokenizer, max_seqs=2, options=options).generate(
        [tokenizer.encode(prompt)], SamplingParams(max_tokens=24, temperature=0))[0]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "meshlm"]
    server = ServeProcess("--checkpoint", str(ckpt), "--parallel.tp=2", "--max-seqs", "2", "--block-size", "4",
                          "--max-batched-tokens", "8", prefix=launcher)
    try:
        status, _, body = http("POST", server.url + "/v1/completions",
                               {"prompt": prompt, "max_tokens": 24, "temperature": 0})
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"] == want.text
        if "sliding_window" in model:
            metrics = http("GET", server.url + "/metrics")[2]
            assert "meshlm_kv_cache_window_freed_blocks_total 0" not in metrics
            assert ("meshlm_kv_cache_local_blocks " in metrics) == ("window_pattern" in model)
    finally:
        server.stop(timeout=60)
