"""The paged KV cache (models/paged.py, infer/blocks.py) and the scheduler built on it (infer/engine.py): greedy
outputs equal the plain model's whatever the block size, prefix caching, chunked prefill, batching and
preemption; the pool stays bounded under a load that overflows it."""

import dataclasses

import pytest
import torch

from meshlm.infer.blocks import BlockPool, block_hashes
from meshlm.infer.engine import CacheOptions, Engine, InvalidRequest, SamplingParams
from meshlm.models.gpt import GPT
from meshlm.models.paged import Batch, PagedKV
from tests.infer.test_engine import CONFIGS, CharTokenizer, alone, model_of, prompts_of


def engine_of(model, max_seqs=4, **options):
    return Engine(model, CharTokenizer(), max_seqs=max_seqs, options=CacheOptions(**options))


@pytest.mark.parametrize("name", CONFIGS)
def test_a_paged_step_of_mixed_rows_equals_the_plain_forward(name):
    """Decoding rows, prefill chunks and grouped short runs of several sequences in one step, their blocks
    scattered over the pool: each token's logits equal the plain forward's at its position (float64, 1e-10)."""
    model = model_of(name).double()
    bs, kv = 4, PagedKV(model, 32, 4)
    seqs = prompts_of([9, 6, 13], seed=3)
    tables = [[5, 1, 30], [7, 2, 12], [0, 9, 3, 11]]  # not in order, not contiguous
    # step 1: the first 5 tokens of seq 0, all of seq 1, the first 3 of seq 2 (three runs)
    cut = [5, 6, 3]
    ids = [t for s, c in zip(seqs, cut) for t in s[:c]]
    rows = [(list(range(c)), t) for c, t in zip(cut, tables)]
    run(model, kv, Batch(rows, bs, "cpu"), ids)
    # step 2: seq 1 decodes one token (a row), seq 0's rest and seq 2's rest are runs after an offset
    rows = [([6], tables[1]), (list(range(5, 9)), tables[0]), (list(range(3, 13)), tables[2])]
    extra = 41
    ids = [extra] + seqs[0][5:] + seqs[2][3:]
    logits = run(model, kv, Batch(rows, bs, "cpu"), ids)
    full = [seqs[1] + [extra], seqs[0], seqs[2]]
    refs = [model(torch.tensor([s]))[0] for s in full]
    torch.testing.assert_close(logits[0], refs[0][6], rtol=0, atol=1e-10)
    torch.testing.assert_close(logits[1:5], refs[1][5:9], rtol=0, atol=1e-10)
    torch.testing.assert_close(logits[5:], refs[2][3:13], rtol=0, atol=1e-10)
    # step 3: two sequences of three tokens each (as a token and two drafts), one grouped attention call
    more = [[7, 8, 9], [10, 11, 12]]
    rows = [(list(range(9, 12)), tables[0]), (list(range(7, 10)), tables[1])]
    batch = Batch(rows, bs, "cpu")
    assert [(g.rows, g.T) for g in batch.groups] == [(2, 3)]
    logits = run(model, kv, batch, more[0] + more[1])
    torch.testing.assert_close(logits[:3], model(torch.tensor([seqs[0] + more[0]]))[0, 9:12], rtol=0, atol=1e-10)
    torch.testing.assert_close(logits[3:], model(torch.tensor([full[0] + more[1]]))[0, 7:10], rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", CONFIGS)
def test_decoding_rows_sharing_prefix_blocks_attend_as_a_cascade_equal_to_the_plain_forward(name):
    """Three decoding rows whose first two blocks are the same blocks (a prompt prefix shared by prefix
    caching) and a fourth that shares nothing: the shared keys are read once (cascade attention, merged by
    log-sum-exp) and every row's logits equal the plain forward's (float64, 1e-10)."""
    model = model_of(name).double()
    bs, kv = 4, PagedKV(model, 32, 4)
    prefix = prompts_of([8], seed=8)[0]
    tails = prompts_of([3, 6, 1], seed=9)
    run(model, kv, Batch([(list(range(8)), [3, 4])], bs, "cpu"), prefix)  # the shared blocks 3 and 4
    own = [[10, 11], [12, 13, 14], [15]]
    for tail, blocks in zip(tails, own):  # each row's own tokens after the prefix, in its own blocks
        run(model, kv, Batch([(list(range(8, 8 + len(tail))), [3, 4, *blocks])], bs, "cpu"), tail)
    lone = prompts_of([5], seed=10)[0]
    run(model, kv, Batch([(list(range(5)), [20, 21])], bs, "cpu"), lone)
    nxt = [7, 8, 9, 10]
    rows = [([8 + len(t)], [3, 4, *b]) for t, b in zip(tails, own)]
    batch = Batch(rows, bs, "cpu")
    assert [g.shared.tolist() for g in batch.groups] == [[3, 4]]  # one cascade group of the three rows
    logits = run(model, kv, batch, nxt[:3])
    for i, tail in enumerate(tails):
        ref = model(torch.tensor([prefix + tail + [nxt[i]]]))[0, -1]
        torch.testing.assert_close(logits[i], ref, rtol=0, atol=1e-10)
    mixed = Batch([*rows[:2], ([5], [20, 21])], bs, "cpu")  # the lone row shares nothing: no cascade
    assert all(g.shared is None for g in mixed.groups)


@torch.no_grad()
def run(model, kv, batch, ids):
    x = model.embed(torch.tensor(ids)[:, None], batch.positions)
    x = model.run_layers(x, None, kv.caches(batch), batch.positions, model.rope(int(batch.positions.max()) + 1))
    return model.head(x)[:, 0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["slot-index", "in-place"])
@pytest.mark.parametrize("name", CONFIGS)
def test_a_one_token_step_through_the_slot_index_equals_the_plain_forward(name, dtype):
    """`RowCache`, the attention of a compiled one-token step (its key and value written into the pool, the
    positions it sees read through the slot index, the layer's core over them; or, for an fp32 pool, read in
    place by `row_decode`, meshlm's kernel), run eagerly: the plain forward's logits (float64 within 1e-10, fp32
    within 1e-5), with grouped KV heads (llama) and the core's own scale (`attn_scale_dim`: 1/√24)."""
    from meshlm.models import native

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIGS[name], attn_scale_dim=24)).eval().to(dtype)
    bs, kv = 4, PagedKV(model, 16, 4)
    seq, table = prompts_of([9], seed=5)[0], [6, 2, 9]
    assert kv.rows_in_graph
    assert kv.rows_in_place == (dtype == torch.float32), native.unavailable()
    run(model, kv, Batch([(list(range(8)), table)], bs, "cpu"), seq[:8])  # the prompt's keys into the pool
    batch = Batch([([8], table)], bs, "cpu")
    x = model.embed(torch.tensor(seq[8:])[:, None], batch.positions)
    caches = kv.row_caches(batch)
    assert all((c.in_place is not None) == kv.rows_in_place for c in caches)
    x = model.run_layers(x, None, caches, batch.positions, model.rope(9))
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(model.head(x)[0, 0], model(torch.tensor([seq]))[0, 8], rtol=0, atol=tol)


@pytest.mark.parametrize("name", CONFIGS)
def test_decoding_rows_read_in_place_attend_in_one_call_whatever_their_lengths(name):
    """Decoding rows of lengths far apart (at positions 3, 4 and 21) beside a prefill chunk: a gathered layout splits
    them (every row of a group is padded to its longest), one read in place (`in_place`, the runner's where the
    kernel takes the pool) keeps them one group, a kernel call a layer, and each row's logits equal the plain
    forward's (fp32, 1e-5)."""
    from meshlm.models import native

    torch.manual_seed(0)
    model = model_of(name).float()
    bs, kv = 4, PagedKV(model, 32, 4)
    assert kv.rows_in_place, native.unavailable()
    seqs = prompts_of([4, 5, 22, 6], seed=11)
    tables = [[1, 2], [3, 4], [5, 6, 7, 8, 9, 10], [11, 12]]
    for seq, table in zip(seqs[:3], tables):  # each row's keys but its last token's into the pool
        run(model, kv, Batch([(list(range(len(seq) - 1)), table)], bs, "cpu"), seq[:-1])
    rows = [([len(seq) - 1], table) for seq, table in zip(seqs[:3], tables)]
    rows.append((list(range(6)), tables[3]))  # a prompt's first chunk: a group of its own either way
    assert [(g.rows, g.T) for g in Batch(rows, bs, "cpu").groups] == [(2, 1), (1, 1), (1, 6)]
    batch = Batch(rows, bs, "cpu", in_place=True)
    assert [(g.rows, g.T) for g in batch.groups] == [(3, 1), (1, 6)]
    calls = []
    decode = native.decode
    try:
        native.decode = lambda *a, **k: calls.append(a[0].shape[0]) or decode(*a, **k)
        logits = run(model, kv, batch, [seq[-1] for seq in seqs[:3]] + seqs[3])
    finally:
        native.decode = decode
    assert calls == [3] * len(model.layers)  # one call a layer, all three rows
    for i, seq in enumerate(seqs[:3]):
        torch.testing.assert_close(logits[i], model(torch.tensor([seq]))[0, -1], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[3:], model(torch.tensor([seqs[3]]))[0], rtol=0, atol=1e-5)


def test_the_pool_shares_prefixes_counts_references_and_evicts_oldest_first():
    pool = BlockPool(4, 2)
    a = [1, 2, 3, 4, 5]
    ha = block_hashes(a, 2)
    assert len(ha) == 2 and block_hashes(a, 2, salt=1) != ha  # full blocks only; an adapter salts the chain
    assert block_hashes([9, 9, 3, 4], 2)[1] != ha[1]  # a block's hash depends on the blocks before it
    blocks = pool.allocate(3)
    for j in range(2):
        pool.register(blocks[j], ha[j], a[2 * j:2 * j + 2])
    assert pool.match(a, ha, 4) == blocks[:2] and pool.refs[blocks[0]] == 2
    assert pool.match([1, 2, 9, 9], block_hashes([1, 2, 9, 9], 2), 4) == blocks[:1]  # the shared first block
    assert pool.available == 1
    pool.release(blocks[:1])
    pool.release(blocks[:2])
    pool.release(blocks)
    assert pool.available == 4 and pool.used == 0
    assert pool.allocate(5) is None and pool.available == 4  # all or nothing
    got = pool.allocate(3)  # the unregistered blocks first, then the least recently used registered one:
    assert got[2] == blocks[1] and pool.stats["evictions"] == 1  # a sequence's later block goes before its first
    assert pool.match(a, ha, 4) == blocks[:1]  # the first block is still shared


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("options", [
    {"block_size": 4},
    {"block_size": 3, "max_batched_tokens": 5},  # chunked prefill: prompts over several steps
    {"block_size": 4, "prefix_caching": False, "max_batched_tokens": None},
    {"block_size": 2, "num_blocks": 24, "max_batched_tokens": 7},  # a small pool: preemption
], ids=["paged", "chunked", "no-prefix-cache", "preempting"])
def test_greedy_outputs_equal_the_plain_model_batched_and_alone(name, options):
    model = model_of(name)
    shared = prompts_of([10], seed=7)[0]
    prompts = prompts_of([3, 11, 1, 7, 17], seed=1) + [shared + p for p in prompts_of([2, 5, 1], seed=2)]
    lengths = [12, 5, 18, 9, 3, 14, 7, 10]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    engine = engine_of(model, **options)
    reqs = engine.generate(prompts, params)
    for p, n, r in zip(prompts, lengths, reqs):
        assert r.output_ids == alone(model, p, n)
    solo = engine_of(model, max_seqs=1, **options).generate([prompts[-1]], params[-1])[0]
    assert solo.output_ids == reqs[-1].output_ids
    assert engine.pool.used == 0  # every block given back
    if options.get("prefix_caching", True):
        assert engine.stats["prefix_hit_tokens"] > 0  # the shared 10-token prefix was reused
    if "num_blocks" in options:
        assert engine.stats["preemptions"] > 0


def test_a_load_that_overflows_the_pool_completes_and_stays_bounded():
    """Twenty requests whose tokens need four times the pool: requests wait or are preempted and recomputed,
    every one completes with the plain model's output, and the pool never grows."""
    model = model_of("llama")
    engine = engine_of(model, max_seqs=8, block_size=4, num_blocks=12, max_batched_tokens=16)
    prompts = prompts_of([5, 9, 14, 3] * 5, seed=11)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    peak = 0
    reqs = [engine.submit(p, sp) for p in prompts]
    while not all(r.finished for r in reqs):
        engine.step()
        peak = max(peak, engine.pool.used)
    assert peak <= 12 and engine.stats["preemptions"] > 0
    assert all(r.finish_reason == "length" and r.output_ids == alone(model, p, 20) for r, p in zip(reqs, prompts))
    with pytest.raises(InvalidRequest, match="--num-blocks") as err:  # more than the whole pool: refused now
        engine.submit([1] * 40, SamplingParams(max_tokens=10))
    assert err.value.param == "max_tokens"


def test_echo_prompt_logprobs_over_chunks_equal_one_forward():
    model = model_of("gpt2")
    prompt = prompts_of([23], seed=5)[0]
    sp = SamplingParams(max_tokens=1, temperature=0, echo=True, logprobs=2)
    whole = engine_of(model, max_batched_tokens=None).generate([prompt], sp)[0]
    chunked = engine_of(model, block_size=4, max_batched_tokens=5).generate([prompt, prompt], sp)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt]))[0, :-1].float(), -1)
    expected = [float(logp[i, t]) for i, t in enumerate(prompt[1:])]
    for r in [whole, *chunked]:
        assert [t.id for t in r.prompt_tokens] == prompt and r.prompt_tokens[0].logprob is None
        assert [t.logprob for t in r.prompt_tokens[1:]] == pytest.approx(expected, abs=1e-5)


def test_metrics_show_the_pool_and_the_prefix_cache():
    from tests.infer.server_helpers import http
    from tests.infer.test_server_load import serve_in_thread, tiny_engine, wait_until

    engine = tiny_engine(max_seqs=2, max_queue=4)
    prompt = "a shared system prompt, long enough to fill several blocks of sixteen positions; " * 2
    with serve_in_thread(engine) as url:
        for tail in ("one", "two"):
            assert http("POST", url + "/v1/completions", {"prompt": prompt + tail, "max_tokens": 2})[0] == 200
        wait_until(lambda: engine.running == 0)  # the engine frees a finished request's blocks after answering
        text = http("GET", url + "/metrics")[2]
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert int(values["meshlm_kv_cache_blocks"]) == engine.pool.num_blocks == 2 * 64 // 16
    assert int(values["meshlm_kv_cache_blocks_used"]) == 0  # both finished: every block given back
    hits = int(values["meshlm_prefix_cache_hit_tokens_total"])
    assert hits >= 16 and hits % 16 == 0 and hits == engine.stats["prefix_hit_tokens"]  # whole blocks reused
    assert 0 < float(values["meshlm_prefix_cache_hit_rate"]) < 1


def speculators(name):
    from meshlm.infer.speculative import DraftModel, Speculator

    draft = model_of(name, seed=1)  # another model: its guesses are often wrong
    return {"ngram": lambda: Speculator("ngram"),
            "draft": lambda: Speculator("draft", DraftModel(draft, 8, 64)),
            "same-model draft": lambda: Speculator("draft", DraftModel(model_of(name), 8, 64))}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("method", ["ngram", "draft", "same-model draft"])
def test_speculative_greedy_outputs_equal_the_plain_model(name, method):
    model = model_of(name)
    prompts = prompts_of([3, 11, 1, 7], seed=1) + [[5, 6, 7, 5, 6, 7, 5, 6]]
    lengths = [12, 5, 18, 9, 14]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    engine = Engine(model, CharTokenizer(), max_seqs=4, options=CacheOptions(block_size=4, num_draft_tokens=3),
                    speculator=speculators(name)[method]())
    reqs = engine.generate(prompts, params)
    for p, n, r in zip(prompts, lengths, reqs):
        assert r.output_ids == alone(model, p, n)
    s = engine.stats
    assert s["draft_tokens"] > 0 and 0 < s["accepted_tokens"] <= s["draft_tokens"]
    if method == "same-model draft":  # the target's own guesses: every one accepted
        assert s["accepted_tokens"] == s["draft_tokens"]
    assert engine.pool.used == 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_sampling_with_a_seed_repeats(method):
    model = model_of("llama")
    prompts = prompts_of([4, 9, 2], seed=3)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    runs = []
    for _ in range(2):
        engine = Engine(model, CharTokenizer(), max_seqs=4, options=CacheOptions(block_size=4),
                        speculator=speculators("llama")[method]())
        runs.append([r.output_ids for r in engine.generate(prompts, params)])
        assert engine.stats["draft_tokens"] > 0
    assert runs[0] == runs[1] and len({tuple(r) for r in runs[0]}) == 3


def test_a_server_under_a_load_that_overflows_the_pool_answers_every_request():
    """Twenty concurrent clients against a pool of 12 blocks and a queue of 6: every request completes (200,
    its full length) or is refused with a clear 429; requests are preempted; the pool never grows."""
    import json
    import threading

    from tests.infer.server_helpers import http
    from tests.infer.test_server_load import serve_in_thread, wait_until

    torch.manual_seed(0)
    engine = Engine(model_of("gpt2"), CharTokenizer(), max_seqs=6, max_queue=6,
                    options=CacheOptions(block_size=4, num_blocks=12, max_batched_tokens=16))
    engine.tokenizer.encode = lambda text: [1 + ord(c) % 90 for c in text]
    results = [None] * 20
    with serve_in_thread(engine) as url:
        def ask(i):
            results[i] = http("POST", url + "/v1/completions", {"prompt": "abcdefghij"[: 3 + i % 7], "max_tokens": 24,
                                                                "temperature": 0, "ignore_eos": True}, timeout=120)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        wait_until(lambda: engine.running == 0)
    done = [json.loads(r[2]) for r in results if r[0] == 200]
    refused = [json.loads(r[2])["error"] for r in results if r[0] != 200]
    # At least the 3 requests one client may hold waiting (half the queue: all 20 come from 127.0.0.1) are always
    # served; how many more are admitted before the rest arrive depends on how busy the machine is.
    assert len(done) + len(refused) == 20 and len(done) >= 3
    assert all(d["usage"]["completion_tokens"] == 24 for d in done)
    assert all(e["code"] == "queue_full" for e in refused) and all(r[0] in (200, 429) for r in results)
    assert engine.pool.used == 0 and engine.pool.num_blocks == 12 and engine.stats["preemptions"] > 0
