"""Speculative decoding's building blocks (meshlm/infer/speculative.py): the target's distribution, n-gram
drafting, rejection sampling (exact: checked with chi-square tests that a wrong sampler fails), and the draft
model's per-row cache (greedy speculative decoding equals greedy decoding)."""

import pytest
import torch

from meshlm.infer.sampling import SamplingParams
from meshlm.infer.speculative import (
    DraftModel,
    SpeculativeStats,
    ngram_propose,
    target_probs,
    verify,
    verify_rows,
)
from meshlm.models.generate import generate, sample_next
from meshlm.models.gpt import GPT
from tests.infer.test_engine import CONFIGS  # the tiny GPT-2 and Llama (GQA) shapes

GREEDY = SamplingParams(temperature=0, max_tokens=64)


def model_of(name, seed=0):
    torch.manual_seed(seed)
    return GPT(CONFIGS[name]).eval()


# ---- target_probs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (0.8, 0, 0.6), (0.5, 7, 0.9),
                                                     (1e-30, 0, 1.0)])
def test_target_probs_is_the_distribution_sample_next_draws_from(temperature, top_k, top_p):
    """Bitwise the same probabilities: a multinomial draw from them with the same generator state picks
    what sample_next picks, seed after seed."""
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = target_probs(logits, params)
    assert probs.shape == (4, 40) and torch.allclose(probs.sum(-1), torch.ones(4))
    for row in range(4):
        assert torch.equal(target_probs(logits[row], params), probs[row])  # (V,) in, (V,) out
        for seed in range(25):
            ours = torch.multinomial(probs[row:row + 1], 1, generator=torch.Generator().manual_seed(seed))
            theirs = sample_next(logits[row:row + 1], temperature, top_k, top_p, torch.Generator().manual_seed(seed))
            assert int(ours) == int(theirs)
    if top_k:
        assert int((probs > 0).sum(-1).max()) <= top_k


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=1)])
def test_target_probs_of_greedy_params_is_a_one_hot_of_the_argmax(params):
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(1))
    probs = target_probs(logits, params)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 11).float())


# ---- n-gram drafting ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,k,kwargs,expected", [
    ([1, 2, 3, 4, 1, 2], 3, {}, [3, 4, 1]),  # the suffix [1, 2] occurred at 0: what followed it
    ([7, 1, 2, 9, 5, 2, 8, 1, 2], 2, {}, [9, 5]),  # the longest suffix wins over a more recent shorter one
    ([1, 2, 3, 1, 2, 4, 1, 2], 3, {}, [4, 1, 2]),  # of two occurrences, the most recent
    ([1, 2, 3, 1, 2, 4, 1, 2], 2, {"n_max": 1}, [4, 1]),  # n_max 1: the last [2] before the end
    ([7, 1, 2, 9, 5, 2, 8, 1, 2], 2, {"n_min": 3}, []),  # no suffix of 3 tokens occurs earlier
    ([1, 2, 3], 2, {}, []),  # nothing repeats
    ([5, 6, 7, 5, 6, 7, 5, 6, 7], 5, {}, [5, 6, 7, 5, 6]),  # a period shorter than k fills all k
    ([1, 1, 1, 1], 3, {}, [1, 1, 1]),
    ([1, 2, 3, 9, 1, 2], 1, {}, [3]),
    ([4, 4], 0, {}, []),
    ([4], 3, {}, []),
])
def test_ngram_propose_by_hand(tokens, k, kwargs, expected):
    assert ngram_propose(tokens, k, **kwargs) == expected


# ---- rejection sampling: greedy ------------------------------------------------------------------------------
def one_hot_targets(k=3, vocab=10, seed=0):
    logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(seed))
    return target_probs(logits, GREEDY), logits.argmax(-1).tolist()


@pytest.mark.parametrize("case", ["all accepted", "first rejected", "mid rejected"])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_verify_is_exactly_the_greedy_continuation(case, with_draft_probs):
    target, best = one_hot_targets()
    drafts = {"all accepted": best[:3], "first rejected": [(best[0] + 1) % 10, *best[1:3]],
              "mid rejected": [best[0], (best[1] + 1) % 10, best[2]]}[case]
    expected = {"all accepted": best, "first rejected": best[:1], "mid rejected": best[:2]}[case]
    draft = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(5)), -1) \
        if with_draft_probs else None
    rng = torch.get_rng_state()
    assert verify(target, drafts, draft, None) == expected  # no generator: greedy draws nothing
    assert torch.equal(torch.get_rng_state(), rng)
    tokens, counts = verify_rows(target[None], torch.tensor([drafts]), draft[None] if draft is not None else None)
    assert tokens[0, :int(counts[0])].tolist() == expected


def test_verify_rows_draws_each_row_from_its_own_generator():
    """With one generator per row, what a row emits does not depend on the other rows of the batch."""
    g = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(5, 4, 8, generator=g), -1)
    draft = torch.softmax(torch.randn(5, 3, 8, generator=g), -1)
    drafts = torch.multinomial(draft.view(-1, 8), 1, generator=g).view(5, 3)
    together, n_together = verify_rows(target, drafts, draft, [torch.Generator().manual_seed(s) for s in range(5)])
    for b in range(5):
        alone = verify(target[b], drafts[b].tolist(), draft[b], torch.Generator().manual_seed(b))
        assert alone == together[b, :int(n_together[b])].tolist()


def test_greedy_rows_draw_nothing_in_a_batch_with_sampled_rows():
    """A greedy row (no generator) next to a sampled row (its own generator): the global generator is not
    touched, and the greedy row gets its greedy continuation."""
    greedy_target, best = one_hot_targets()
    sampled_target = torch.softmax(torch.randn(4, 10, generator=torch.Generator().manual_seed(3)), -1)
    drafts = torch.tensor([[best[0], (best[1] + 1) % 10, best[2]], [1, 2, 3]])
    draft = torch.softmax(torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(4)), -1)
    rng = torch.get_rng_state()
    tokens, counts = verify_rows(torch.stack([greedy_target, sampled_target]), drafts, draft,
                                 [None, torch.Generator().manual_seed(0)])
    assert torch.equal(torch.get_rng_state(), rng)
    assert tokens[0, :int(counts[0])].tolist() == best[:2]


def test_verify_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"target must be \(3, V\)"):
        verify(torch.ones(2, 5) / 5, [1, 2])
    with pytest.raises(ValueError, match=r"draft must be \(2, 5\)"):
        verify(torch.ones(3, 5) / 5, [1, 2], torch.ones(3, 5) / 5)


# ---- rejection sampling: the distribution (chi-square) ---------------------------------------------------------
# V = 6, k = 2. p0/q0: each has mass where the other has none (forced rejections, tokens only a correction
# can give). Row x of P1/Q1: the target's/draft's distribution of the second token after first token x.
V, N, ALPHA = 6, 20000, 1e-3
P0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00])
Q0 = torch.tensor([0.00, 0.10, 0.20, 0.30, 0.25, 0.15])
P1 = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(11)), -1)
P1[:, 2] = 0  # the second token is never 2...
P1 /= P1.sum(-1, keepdim=True)
Q1 = torch.softmax(2 * torch.randn(V, V, generator=torch.Generator().manual_seed(12)), -1)  # ...but q proposes it
P2 = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.25, 0.35])


def chi_square_p_value(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of each row of counts `observed` (m, V) against its distribution `probs` (m, V), pooled
    (the statistics add, and so do the degrees of freedom: the support's size minus one per row observed). An
    outcome of probability 0 that was observed gives 0. The p-value is chi2's survival function,
    Q(dof / 2, stat / 2) (the regularised upper incomplete gamma function)."""
    n = observed.sum(-1, keepdim=True).double()
    expected = n * probs.double()
    if bool((observed[expected == 0] > 0).any()):
        return 0.0
    seen = (expected > 0) & (n > 0)
    stat = ((observed.double() - expected)[seen] ** 2 / expected[seen]).sum()
    dof = int(((probs > 0).sum(-1) - 1)[n[:, 0] > 0].sum())
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def p_values(tokens: torch.Tensor, counts: torch.Tensor) -> list[float]:
    """The first emitted token against P0; the second given the first (rows that emitted two) against
    P1[first]; the third (both drafts accepted: the bonus token) against P2."""
    first = torch.nn.functional.one_hot(tokens[:, 0], V)
    two = counts >= 2
    second = torch.zeros(V, V, dtype=torch.long).index_put_((tokens[two, 0], tokens[two, 1]),
                                                             torch.ones(int(two.sum()), dtype=torch.long),
                                                             accumulate=True)
    third = torch.nn.functional.one_hot(tokens[counts == 3, 2], V)
    return [chi_square_p_value(first.sum(0, keepdim=True), P0[None]), chi_square_p_value(second, P1),
            chi_square_p_value(third.sum(0, keepdim=True), P2[None])]


def sampled_drafts(seed=0):
    """N draft pairs drawn from the draft (d0 ~ Q0, d1 ~ Q1[d0]) and the matching targets/drafts."""
    g = torch.Generator().manual_seed(seed)
    d0 = torch.multinomial(Q0, N, replacement=True, generator=g)
    d1 = torch.multinomial(Q1[d0], 1, generator=g)[:, 0]
    target = torch.stack([P0.expand(N, V), P1[d0], P2.expand(N, V)], 1)
    return torch.stack([d0, d1], 1), target, torch.stack([Q0.expand(N, V), Q1[d0]], 1)


def accept_everything(target, drafts, draft, generator):
    """A wrong sampler: every draft token accepted, then the bonus token."""
    bonus = torch.multinomial(target[:, -1], 1, generator=generator)
    return torch.cat([drafts, bonus], 1), torch.full((len(drafts),), drafts.shape[1] + 1)


def correction_from_p(target, drafts, draft, generator):
    """A wrong sampler: the right acceptance test, but the token after a rejection drawn from p, not from
    norm(max(0, p - q))."""
    k = drafts.shape[1]
    p = target[:, :k].gather(2, drafts[..., None])[..., 0]
    q = draft.gather(2, drafts[..., None])[..., 0]
    accepted = (torch.rand(p.shape, generator=generator) * q < p).long().cumprod(1).sum(1)
    last = torch.multinomial(target[torch.arange(len(drafts)), accepted], 1, generator=generator)
    return torch.cat([drafts, last], 1).scatter(1, accepted[:, None], last), accepted + 1


def test_verify_preserves_the_target_distribution_with_a_draft_distribution():
    """20k seeded verifications: every emitted position's distribution passes a chi-square test at ALPHA."""
    drafts, target, draft = sampled_drafts()
    tokens, counts = verify_rows(target, drafts, draft, torch.Generator().manual_seed(1))
    assert all(p > ALPHA for p in p_values(tokens, counts)), p_values(tokens, counts)
    assert 0 < int((counts == 1).sum()) and 0 < int((counts == 3).sum())  # rejections and full acceptances
    for wrong in (accept_everything, correction_from_p):  # the test has the power to see a wrong sampler
        tokens, counts = wrong(target, drafts, draft, torch.Generator().manual_seed(1))
        assert p_values(tokens, counts)[0] < ALPHA, wrong.__name__


def test_verify_preserves_the_target_distribution_with_a_deterministic_proposer():
    """draft=None (an n-gram proposal: q one-hot): the same chi-square tests pass."""
    d0 = torch.arange(N) % V  # deterministic proposals, tokens of probability 0 (5) among them
    d1 = (2 * d0 + 1) % V
    drafts = torch.stack([d0, d1], 1)
    target = torch.stack([P0.expand(N, V), P1[d0], P2.expand(N, V)], 1)
    tokens, counts = verify_rows(target, drafts, None, torch.Generator().manual_seed(2))
    assert all(p > ALPHA for p in p_values(tokens, counts)), p_values(tokens, counts)
    one_hot = torch.nn.functional.one_hot(drafts, V).float()
    tokens, counts = accept_everything(target, drafts, one_hot, torch.Generator().manual_seed(2))
    assert p_values(tokens, counts)[0] < ALPHA


def test_speculative_stats_acceptance_rate():
    stats = SpeculativeStats()
    stats.record(proposed=4, emitted=5)
    stats.record(proposed=4, emitted=1)
    assert (stats.accepted, stats.proposed, stats.acceptance_rate, stats.tokens_per_step) == (4, 8, 0.5, 3.0)


# ---- the draft model ----------------------------------------------------------------------------------------------
def speculative_greedy(target, drafter, prompts, max_tokens, k=4):
    """A greedy speculative loop: the draft proposes k tokens per row (all rows at once), the target (a plain
    forward, no cache) scores them, `verify` keeps the accepted prefix and one token; finished rows released."""
    outs = [list(p) for p in prompts]
    stats = SpeculativeStats()
    active = list(range(len(prompts)))
    while active:
        proposals = drafter.propose([(i, outs[i], GREEDY) for i in active], k)
        for i, (tokens, probs) in zip(list(active), proposals):
            assert probs.shape == (len(tokens), CONFIGS["gpt2"].vocab_size)
            with torch.no_grad():
                logits = target(torch.tensor([outs[i] + tokens]))[0, len(outs[i]) - 1:].float()
            new = verify(target_probs(logits, GREEDY), tokens, probs)
            stats.record(len(tokens), len(new))
            before = len(outs[i])
            outs[i] = (outs[i] + new)[:len(prompts[i]) + max_tokens[i]]
            drafter.rollback(i, min(before + len(new) - 1, len(outs[i])))  # the accepted draft tokens only
            assert drafter.cached[i] == outs[i][:drafter.length(i)]  # the cache holds accepted tokens only
            if len(outs[i]) == len(prompts[i]) + max_tokens[i]:
                active.remove(i)
                drafter.release(i)
    return [o[len(p):] for o, p in zip(outs, prompts)], stats


PROMPTS = [[3, 4, 5, 6, 7], [9, 1, 9, 2, 9, 3, 9, 4, 8, 7, 6, 5], [1, 2]]
MAX_TOKENS = [20, 9, 14]  # rows finish at different times: released rows, the rest moved


def greedy_reference(target, prompts, max_tokens):
    return [generate(target, torch.tensor([p]), n, temperature=0)[0, len(p):].tolist()
            for p, n in zip(prompts, max_tokens)]


@pytest.mark.parametrize("name", CONFIGS)
def test_a_draft_identical_to_the_target_has_every_greedy_draft_accepted(name):
    target = model_of(name)
    drafter = DraftModel(model_of(name), max_seqs=3, max_len=64)  # the same weights
    outs, stats = speculative_greedy(target, drafter, PROMPTS, MAX_TOKENS)
    assert outs == greedy_reference(target, PROMPTS, MAX_TOKENS)
    assert stats.proposed > 0 and stats.accepted == stats.proposed


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_speculative_decoding_with_another_draft_equals_greedy_decoding(name):
    target = model_of(name)
    drafter = DraftModel(model_of(name, seed=1), max_seqs=4, max_len=64)
    outs, stats = speculative_greedy(target, drafter, PROMPTS, MAX_TOKENS)
    assert outs == greedy_reference(target, PROMPTS, MAX_TOKENS)
    assert stats.accepted < stats.proposed  # rejections happened: rolled-back rows were caught up right


def test_draft_probs_are_the_draft_models_distribution_after_a_late_catch_up():
    """A row that the draft has not seen for many tokens (a prompt, then 11 more) is caught up in one go: its
    first draft distribution is the draft model's own on the whole sequence."""
    model = model_of("llama", seed=3)
    drafter = DraftModel(model, max_seqs=2, max_len=64)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7)
    seq = list(range(1, 30))
    calls = [[("a", seq[:9], params), ("b", seq[:4], params)], [("a", seq, params), ("b", seq[:5], params)]]
    drafter.propose(calls[0], 2)
    (tokens, probs), _ = drafter.propose(calls[1], 3)
    with torch.no_grad():
        expected = target_probs(model(torch.tensor([seq]))[0, -1].float(), params)
    assert len(tokens) == 3 and torch.allclose(probs[0], expected, atol=1e-5)
    assert all(float(probs[i, t]) > 0 for i, t in enumerate(tokens))  # drawn from the support
    again = DraftModel(model, max_seqs=2, max_len=64)
    again.propose(calls[0], 2)
    assert again.propose(calls[1], 3)[0][0] == tokens  # seeded: the same proposals again


def test_draft_model_limits_and_errors():
    drafter = DraftModel(model_of("gpt2"), max_seqs=2, max_len=20)
    out = drafter.propose([(0, list(range(1, 17)), GREEDY), (1, list(range(1, 20)), GREEDY)], 5)
    assert [len(t) for t, _ in out] == [3, 0]  # draft and bonus tokens fit in max_len
    assert out[1][1].shape == (0, 97)
    out = drafter.propose([(0, list(range(1, 12)), GREEDY), (1, [5, 6], GREEDY)], [2, 4])  # k per row
    assert [len(t) for t, _ in out] == [2, 4]
    drafter.release(1)
    with pytest.raises(ValueError, match="rows are all in use"):
        drafter.propose([(2, [1, 2], GREEDY), (3, [1, 2], GREEDY)], 2)
    with pytest.raises(ValueError, match="learned positions"):
        DraftModel(model_of("gpt2"), max_seqs=1, max_len=65)
