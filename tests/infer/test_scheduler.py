"""The engine's scheduler (meshlm/infer/scheduler.py) driven without a model: fake requests, a block pool, and a
stand-in for the engine that advances each request by the tokens its step computed. Every expectation is a hand
computation of admission order, the token budget, block tables, preemption and prefix reuse."""

import dataclasses

import pytest

from meshlm.infer.blocks import BlockPool
from meshlm.infer.request import Request
from meshlm.infer.sampling import SamplingParams
from meshlm.infer.scheduler import Scheduler, StepPlan


def scheduler(num_blocks=16, block_size=4, max_seqs=4, max_batched_tokens=None, prefix_caching=False):
    return Scheduler(BlockPool(num_blocks, block_size, prefix_caching), max_seqs, max_batched_tokens)


def queue(s: Scheduler, *prompts, **params) -> list[Request]:
    reqs = [Request(list(p), SamplingParams(max_tokens=8, **params), id=i) for i, p in enumerate(prompts)]
    s.waiting.extend(reqs)
    return reqs


def run(s: Scheduler, next_token: int = 1) -> StepPlan:
    """One step as the engine runs it: schedule, plan, then each request advanced by its tokens; one whose
    tokens are all computed takes `next_token` as its output (no model: the token's value does not matter)."""
    scheduled = s.schedule()
    plan = s.plan(scheduled.work)
    for seq in plan.seqs:
        req = seq.request
        req.computed += seq.tokens
        if req.computed == req.length:
            req.output_ids.append(next_token)
        s.register(req)
    return plan


def test_requests_join_in_arrival_order_while_rows_are_free():
    s = scheduler(max_seqs=2)
    a, b, c = queue(s, [5, 6, 7], [8, 9], [10])
    plan = run(s)
    assert [seq.request for seq in plan.seqs] == [b, a]  # fewest tokens first (the forward's layout)
    assert s.active == [a, b] and list(s.waiting) == [c]
    f = plan.forward
    assert f.ids == (8, 9, 5, 6, 7) and f.select == (1, 4)  # each prompt's last token gives the next one
    assert [list(pos) for pos, _ in f.rows] == [[0, 1], [0, 1, 2]]
    assert [blocks for _, blocks in f.rows] == [tuple(b.blocks), tuple(a.blocks)] and len(a.blocks) == 1
    assert f.adapters is None and f.virtual == ()
    plan = run(s)  # both decode; c waits for a row
    assert plan.forward.ids == (1, 1) and [list(pos) for pos, _ in plan.forward.rows] == [[2], [3]]
    assert list(s.waiting) == [c]
    a.finish_reason = "length"
    s.retire()
    assert s.active == [b] and s.pool.used == 1
    run(s)
    assert s.active == [b, c]


def test_the_token_budget_chunks_prompts_and_decoding_rows_go_first():
    s = scheduler(max_batched_tokens=10)
    a, b = queue(s, list(range(1, 9)), list(range(11, 19)))  # 8 + 8 prompt tokens, 10 a step
    plan = run(s)
    assert [(seq.request, seq.tokens, seq.logits) for seq in plan.seqs] == [(b, 2, 0), (a, 8, 1)]
    assert plan.n_tokens == 10 and b.computed == 2 and not b.output_ids
    plan = run(s)  # a decodes first (1 token), then b's next chunk: the rest of its prompt
    assert [(seq.request, seq.start, seq.tokens) for seq in plan.seqs] == [(a, 8, 1), (b, 2, 6)]
    assert list(plan.forward.rows[1][0]) == list(range(2, 8)) and plan.forward.select == (0, 6)
    s2 = scheduler(max_batched_tokens=4)
    (c,) = queue(s2, list(range(1, 11)))
    assert [run(s2).n_tokens for _ in range(3)] == [4, 4, 2] and c.output_ids == [1]


def test_a_request_that_finds_no_block_preempts_the_newest_running_one():
    s = scheduler(num_blocks=4, block_size=4, max_seqs=4)
    a, b = queue(s, [1] * 6, [2] * 6)
    run(s)  # 6 prompt positions + the first output: 2 blocks each, the pool is full
    assert len(a.blocks) == 2 and len(b.blocks) == 2 and s.pool.available == 0
    run(s)
    run(s)  # positions 6 and 7: still in the second blocks
    assert a.length == b.length == 9 and s.stats["preemptions"] == 0
    run(s)  # position 8 needs a third block: a (the older) takes one of b's
    assert s.stats["preemptions"] == 1 and s.active == [a] and list(s.waiting) == [b]
    assert b.blocks == [] and b.computed == 0 and len(a.blocks) == 3 and s.pool.used == 3
    plan = run(s)  # b (9 positions: 3 blocks) cannot come back yet: a runs alone, b holds nothing
    assert [seq.request for seq in plan.seqs] == [a] and b.blocks == [] and list(s.waiting) == [b]
    a.finish_reason = "stop"
    s.retire()
    plan = run(s)  # b is recomputed from its tokens: prompt and output so far
    assert [(seq.request, seq.start, seq.tokens) for seq in plan.seqs] == [(b, 0, 9)]
    assert plan.forward.ids == (2,) * 6 + (1,) * 3


def test_a_prompt_takes_the_blocks_another_request_computed():
    s = scheduler(num_blocks=16, block_size=4, prefix_caching=True)
    shared = [3, 1, 4, 1, 5, 9, 2, 6]  # two full blocks
    (a,) = queue(s, shared + [7, 7])
    run(s)
    assert a.registered == 2  # its two full blocks are registered (the third is not full)
    b = Request(shared + [8], SamplingParams(max_tokens=4), id=7)
    s.waiting.append(b)
    plan = run(s)
    assert b.blocks[:2] == a.blocks[:2] and b.blocks[2] not in a.blocks
    seq = next(seq for seq in plan.seqs if seq.request is b)
    assert (seq.start, seq.tokens) == (8, 1)  # only its last token is computed
    assert s.stats["prefix_hit_tokens"] == 8 and s.stats["prefix_queried_tokens"] == (10 - 1) + (9 - 1)
    c = Request(shared, SamplingParams(max_tokens=4), id=8)  # a whole prompt cached: its last block is computed
    s.waiting.append(c)
    run(s)
    assert c.blocks[:1] == a.blocks[:1] and c.computed == len(shared) and c.output_ids == [1]


def test_prompt_logprobs_want_every_token_and_skip_the_prefix_cache():
    s = scheduler(prefix_caching=True)
    (a,) = queue(s, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    run(s)
    (b,) = queue(s, [1, 2, 3, 4, 5, 6, 7, 8, 9], echo=True, logprobs=0)
    plan = run(s)
    seq = next(seq for seq in plan.seqs if seq.request is b)
    assert (seq.start, seq.tokens, seq.logits) == (0, 9, 9) and b.blocks[0] not in a.blocks


def test_drafts_are_planned_after_the_fed_token_and_every_row_is_selected():
    s = scheduler()
    (a,) = queue(s, [1, 2, 3])
    run(s)
    assert s.reserve(a, a.length + 2)
    a.drafts = [7, 8]
    plan = s.plan(s.schedule().work)
    assert plan.forward.ids == (1, 7, 8) and list(plan.forward.rows[0][0]) == [3, 4, 5]
    assert plan.forward.select == (0, 1, 2) and plan.seqs[0].logits == 3 and plan.seqs[0].drafts == (7, 8)


def test_a_cancelled_waiting_request_leaves_the_queue_as_aborted_and_plans_are_frozen():
    s = scheduler()
    a, b = queue(s, [1, 2], [3, 4])
    a.cancelled = True
    scheduled = s.schedule()
    assert scheduled.aborted == (a,) and [r for r, _ in scheduled.work] == [b] and not s.waiting
    plan = s.plan(scheduled.work)
    assert plan.forward["ids"] == plan.forward.ids == (3, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.forward.ids = ()
