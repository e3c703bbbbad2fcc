"""GRPO's rollout source (meshlm/tune/grpo_rollouts.py): the off-policy lag samples a step's batch with the
weights of K steps before and keeps their log-probs as π_old; dynamic sampling drops zero-variance groups and
samples the next prompts; both resume exactly. A stub sampler (tokens a function of the seed) makes the batches
checkable by hand; the command runs end to end on a tiny GPT."""

from __future__ import annotations

import torch

from meshlm.core.config import build
from meshlm.models.gpt import GPT
from meshlm.tune import grpo
from meshlm.tune import grpo_rollouts as gr
from meshlm.tune.rewards import Reward
from tests.checkpoint_helpers import load_run
from tests.tune.test_grpo import (
    SMALL,
    SPACES,
    data,  # noqa: F401 -- the module fixture: a tiny base and prompts
)
from tests.tune.test_grpo import grpo as align
from tests.tune.test_grpo import rows as metric_rows
from tests.tune.tune_helpers import GPT2, VOCAB

G = 2


class Tok:
    eod_id = 0
    stop_ids = (0,)

    def decode(self, ids):
        return " ".join(map(str, ids))


def stub_sample(calls: list):
    """Two tokens per completion, both functions of the seed; the seeds are recorded."""
    def sample(prompts, max_tokens, temperature, top_k, seeds):
        calls.append(list(seeds))
        return [([5 + s % 7, 3 + s % 2], [-1.0, -2.0]) for s in seeds]
    return sample


def live(prompt, completion, row):
    """Flat prompts score 1 whatever the completion; live ones by the completion's first token's parity."""
    return 1.0 if row["kind"] == "flat" else float(int(completion.split()[0]) % 2)


def setup(kinds: list[str], **opts):
    torch.manual_seed(0)
    model = GPT(build({"model": {"family": "gpt", "vocab_size": VOCAB, **GPT2}}).model).eval()
    prompts = [grpo.Prompt(f"p:{i}", f"p{i}", [1 + i, 2], {"kind": k}) for i, k in enumerate(kinds)]
    o = grpo.Options(group_size=G, prompts_per_step=2, max_completion_length=2, **opts)
    calls = []
    return model, prompts, o, calls, gr.RolloutSource(model, stub_sample(calls), Tok(), [Reward("live", live, 1.0)],
                                                      prompts, o)


def test_off_policy_lag_samples_ahead_with_the_older_weights_and_keeps_their_log_probs():
    model, _, _, calls, source = setup(["live"] * 6, off_policy_lag=1)
    first = source.next(1, version=0)
    assert len(calls) == 2 and len(source.queue) == 1  # steps 1 and 2 sampled by the initial weights
    ids, where, _, tokens = source.queue[0].rows
    with torch.no_grad():
        before = gr.token_logps(model, ids, where, tokens)
        for p in model.parameters():  # the optimizer step of step 1
            p.add_(0.1 * torch.randn_like(p))
    second = source.next(2, version=1)
    assert len(calls) == 3  # step 3 sampled now, by the updated weights
    assert (first.version, second.version, source.queue[0].version) == (0, 0, 1)
    assert torch.equal(second.old, before) and torch.equal(second.raw, before)  # π_old: the sampling weights'
    with torch.no_grad():
        assert not torch.allclose(gr.token_logps(model, ids, where, tokens), before)
    # the prompts and seeds of a step do not depend on the lag: those of a lag-0 source
    _, _, _, calls0, source0 = setup(["live"] * 6)
    for step in (1, 2, 3):
        source0.next(step, version=step - 1)
    assert calls == calls0 and second.at == [2, 2, 3, 3]


def test_dynamic_sampling_drops_zero_variance_groups_and_samples_the_next_prompts():
    kinds = ["flat", "flat", "live", "flat", "live", "live", "flat", "flat"]
    _, _, opts, calls, source = setup(kinds, dynamic_sampling=True, max_sampling_rounds=4)
    b = source.next(1, version=0)
    # round 1: prompts 0, 1 (flat: dropped); round 2: 2 (kept), 3 (dropped); round 3: 4 and 5, only 4 needed
    assert b.rounds == 3 and b.dropped == 3 and source.cursor == 6
    assert b.at == [2, 2, 4, 4] and [p.where for p in b.ro.prompts] == ["p:2", "p:2", "p:4", "p:4"]
    base = opts.seed * 1_000_003 + 1 * 10_007
    assert calls == [[base + i for i in range(4)], [base + 4 + i for i in range(4)], [base + 8 + i for i in range(4)]]
    assert b.table[:, 0].tolist() == [float((5 + s % 7) % 2) for s in (base + 4, base + 5, base + 8, base + 9)]
    assert b.sampled_zero_std == 3 / 6
    # a round limit with nothing live: the last round's groups, all of them
    _, _, _, _, flat = setup(["flat"] * 4, dynamic_sampling=True, max_sampling_rounds=2)
    b = flat.next(1, version=0)
    assert b.rounds == 2 and b.at == [2, 2, 3, 3] and b.dropped == 2


def test_queued_batches_survive_a_save_and_load(tmp_path):
    _, prompts, opts, _, source = setup(["live"] * 6, off_policy_lag=2)
    source.next(1, version=0)
    path = tmp_path / "state.pt"
    torch.save(source.state(), path)
    state = torch.load(path, weights_only=True)  # plain data, as the run's state file is read
    again = gr.RolloutSource(source.model, stub_sample([]), Tok(), source.rewards, prompts, opts, state["cursor"],
                             state["queued"])
    assert again.cursor == source.cursor == 6
    for a, b in zip(source.queue, again.queue):
        assert (a.step, a.version, a.at, a.ro.ids, a.ro.texts) == (b.step, b.version, b.at, b.ro.ids, b.ro.texts)
        assert torch.equal(a.old, b.old) and all(torch.equal(x, y) for x, y in zip(a.rows, b.rows))


def test_the_command_with_lag_and_dynamic_sampling_resumes_exactly(data, tmp_path):  # noqa: F811
    common = ["--reward", SPACES, "--lr", "3e-3", "--off-policy-lag", "1", "--dynamic-sampling", *SMALL]
    whole, part = tmp_path / "whole", tmp_path / "part"
    code, _, err = align(data, whole, *common, "--steps", "3")
    assert code == 0, err
    got = metric_rows(whole)
    assert [r["policy_lag"] for r in got] == [0, 1, 1]
    assert all(r["logprob_mismatch_max"] < 1e-5 for r in got)  # the check runs against the sampling weights
    assert all(r["sampling_rounds"] >= 1 for r in got)
    code, _, err = align(data, part, *common, "--steps", "2", "--save-every", "1")
    assert code == 0, err
    code, _, err = align(data, part, *common, "--steps", "3")
    assert code == 0, err
    assert [r["reward"] for r in metric_rows(part)] == [r["reward"] for r in got]
    a, b = load_run(str(whole))[0], load_run(str(part))[0]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))



def test_mismatch_reports_the_largest_the_mean_and_nemo_rls_multiplicative_error():
    """`mismatch` over the sampled tokens only (mask): max |Δ|, mean |Δ| and mean(exp(|Δ|)) − 1, NeMo-RL's
    `token_mult_prob_error` less 1; the padding beyond each row's completion never counts."""
    import math

    engine = [[-0.5, -1.0], [-2.0]]
    trainer = torch.tensor([[-0.4, -1.3, 9.0], [-2.0, 7.0, 7.0]], dtype=torch.float32)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    worst, mean, mult = gr.mismatch(engine, trainer, mask)
    d = [abs(-0.5 - float(torch.tensor(-0.4))), abs(-1.0 - float(torch.tensor(-1.3))), 0.0]
    assert math.isclose(worst, max(d), rel_tol=1e-12) and math.isclose(mean, sum(d) / 3, rel_tol=1e-12)
    assert math.isclose(mult, sum(math.expm1(x) for x in d) / 3, rel_tol=1e-12)
    assert gr.mismatch([[]], torch.zeros(1, 2), torch.zeros(1, 2)) == (0.0, 0.0, 0.0)
