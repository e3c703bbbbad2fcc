"""Where a GRPO step's completions come from (`meshlm align --method grpo|rloo`, docs/align.md "On- and
off-policy"): sampling, scoring, the trainer's log-probs of what was sampled, and the two settings that decide
which weights sampled a step's batch and which groups it keeps.

* **Off-policy lag K** (`--off-policy-lag`, default 0): step s trains on completions sampled by the weights
  after step s − 1 − K (the first K + 1 batches by the initial weights). The source generates K batches ahead
  of training and queues them, as an asynchronous trainer whose engine runs K steps behind would; with K = 0
  every batch is sampled by the weights it trains (strictly on-policy). With K > 0 π_old is the sampling
  policy: the trainer's log-probs of the batch computed when it was sampled, by the weights that sampled it,
  so the importance ratio corrects the lag and the clipping bounds it. Which prompts and sampling seeds a step
  gets does not depend on K: only the weights that sample them do.
* **Dynamic sampling** (`--dynamic-sampling`, DAPO's): a group whose rewards are all equal has zero advantage
  and teaches nothing; such groups are dropped and the next prompts sampled, round after round, until the step
  has `--prompts-per-step` groups with some variance or `--max-sampling-rounds` rounds ran (then it trains on
  the groups it kept; if none, on the last round's). Each round takes the next prompts of the file.

Seeds: row i of round r of step s samples with seed·1,000,003 + s·10,007 + r·rows + i, so a resumed or
repeated run samples the same tokens. The state of the source (the file position and the queued batches with
their π_old) is saved with the run's state, so resuming is exact under any K.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshlm.tune import grpo_loss as gl
from meshlm.tune.rewards import Reward, RewardError, call_reward

# (prompts' token ids, max_tokens, temperature, top_k, one seed per prompt) → per prompt (the sampled ids, the
# sampler's log-prob of each under the raw distribution). `meshlm.commands.align.engine_sampler` makes one from
# meshlm's Engine (infer/ sits above tune/, so the command hands it in).
Sample = Callable[[list[list[int]], int, float, int, list[int]], list[tuple[list[int], list[float]]]]


@dataclass
class Rollout:
    prompts: list  # one `grpo.Prompt` per completion (each prompt G times, consecutive)
    ids: list[list[int]]  # the completions' tokens
    texts: list[str]  # what the rewards read (`completion_text`)
    engine_logps: list[list[float]]
    seconds: float


def completion_text(tokenizer, ids: list[int]) -> str:
    """What the rewards read: the completion's text without the end-of-turn token that stopped it (the
    engine's own rule: the tokenizer's `stop_ids`, else its `eod_id`), as TRL's decoding with
    `skip_special_tokens` and an OpenAI server's reply give it. The token stays in the trained completion."""
    stops = getattr(tokenizer, "stop_ids", None) or (tokenizer.eod_id,)
    return tokenizer.decode(ids[:-1] if ids and ids[-1] in stops else ids)


def rollout(sample: Sample, tokenizer, prompts: list, opts, step: int, first_row: int = 0) -> Rollout:
    """G sampled completions of each prompt (seeded by the run's seed, the step and the row: `first_row` is
    the row's offset within the step, past earlier dynamic-sampling rounds)."""
    rows = [p for p in prompts for _ in range(opts.group_size)]
    seeds = [opts.seed * 1_000_003 + step * 10_007 + first_row + i for i in range(len(rows))]
    start = time.perf_counter()
    out = sample([p.ids for p in rows], opts.max_completion_length, opts.temperature, opts.top_k, seeds)
    seconds = time.perf_counter() - start
    ids = [list(i) for i, _ in out]
    return Rollout(rows, ids, [completion_text(tokenizer, i) for i in ids], [list(lp) for _, lp in out], seconds)


def score(rewards: list[Reward], ro: Rollout, group_size: int) -> tuple[torch.Tensor, list[str]]:
    """(B, R) rewards per completion and function (NaN where the function failed) and the failures' messages."""
    table = torch.full((len(ro.ids), len(rewards)), float("nan"), dtype=torch.float64)
    failures = []
    for i, (p, text) in enumerate(zip(ro.prompts, ro.texts)):
        for j, r in enumerate(rewards):
            try:
                table[i, j] = call_reward(r, p.text, text, p.row, f"{p.where} (completion {i % group_size + 1})")
            except RewardError as err:
                failures.append(str(err))
    return table, failures


def total_rewards(table: torch.Tensor, rewards: list[Reward]) -> torch.Tensor:
    """The weighted sum over functions; NaN only where every function failed (TRL's rule)."""
    weights = torch.tensor([r.weight for r in rewards], dtype=table.dtype)
    total = (torch.nan_to_num(table, nan=0.0) * weights).sum(1)
    total[torch.isnan(table).all(1)] = float("nan")
    return total


def batch_rows(ro: Rollout, pad_id: int):
    """(ids (B, S), completion positions index (B, L), mask (B, L), tokens (B, L)): each row prompt +
    completion right-padded; position t of completion k is predicted at row position len(prompt) + t − 1."""
    L = max(1, max(len(c) for c in ro.ids))
    S = max(len(p.ids) + len(c) for p, c in zip(ro.prompts, ro.ids))
    ids = torch.full((len(ro.ids), S), pad_id, dtype=torch.long)
    tokens = torch.full((len(ro.ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(ro.ids), L)
    where = torch.zeros(len(ro.ids), L, dtype=torch.long)
    for b, (p, c) in enumerate(zip(ro.prompts, ro.ids)):
        n = len(p.ids)
        ids[b, :n + len(c)] = torch.tensor(p.ids + c)
        tokens[b, :len(c)] = torch.tensor(c, dtype=torch.long)
        mask[b, :len(c)] = 1
        where[b] = (n - 1 + torch.arange(L)).clamp(max=S - 1)
    return ids, where, mask, tokens


def token_logps(model, ids, where, tokens, temperature: float = 1.0):
    """(B, L) log-probabilities of `tokens` at completion positions `where`, of logits / temperature."""
    # The head runs on the completion positions only (as `forward` would, then picking them): the prompts'
    # positions would cost a (B, S, V) logits tensor for nothing.
    x = model.run_layers(model.embed(ids), None, None, 0, model.rope(ids.shape[1]))  # (B, S, h)
    picked = model.head(x.gather(1, where.unsqueeze(-1).expand(-1, -1, x.shape[-1]))).float()  # (B, L, V)
    return torch.log_softmax(picked / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def mismatch(engine_logps: list[list[float]], trainer: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """Over the sampled tokens: the largest and the mean |engine − trainer| log-prob, and NeMo-RL's
    multiplicative probability error, mean(exp(|engine − trainer|)) − 1 (its `token_mult_prob_error` less 1:
    0 for equal log-probs), in float64 so that differences near fp32's rounding are not lost to it."""
    eng = torch.zeros_like(trainer, dtype=torch.float64)
    for b, row in enumerate(engine_logps):
        eng[b, :len(row)] = torch.tensor(row, dtype=torch.float64)
    if not mask.any():
        return 0.0, 0.0, 0.0
    m = mask.to(torch.float64)
    diff = (eng - trainer.to(torch.float64)).abs() * m
    n = m.sum()
    return float(diff.max()), float(diff.sum() / n), float((torch.expm1(diff) * m).sum() / n)


# ---- a step's batch --------------------------------------------------------------------------------------------
@dataclass
class Batch:
    """One step's completions, scored, with the trainer's log-probs from the weights that sampled them."""

    step: int  # the step it trains
    version: int  # the optimizer steps taken by the weights that sampled it
    at: list[int]  # each row's prompt: its index in the prompt list
    ro: Rollout
    table: torch.Tensor  # (B, R) rewards per function (NaN: failed)
    failures: list[str]
    rows: tuple  # batch_rows(ro)
    raw: torch.Tensor  # (B, L) log-probs of the raw distribution (temperature 1): the engine check's reference
    old: torch.Tensor | None  # π_old at the loss's temperature, or None: the current policy, detached
    rounds: int  # generation rounds (dynamic sampling)
    dropped: int  # zero-variance groups dropped
    sampled_zero_std: float  # the share of all generated groups with zero variance
    seconds: float  # the trainer's forward at sampling time

    def state(self) -> dict:
        """Plain data for the run's state file (torch.load with weights_only)."""
        return {"step": self.step, "version": self.version, "at": self.at, "ids": self.ro.ids,
                "engine_logps": self.ro.engine_logps, "gen_s": self.ro.seconds, "table": self.table,
                "failures": self.failures, "raw": self.raw.cpu(),
                "old": self.old.cpu() if self.old is not None else None, "rounds": self.rounds,
                "dropped": self.dropped, "sampled_zero_std": self.sampled_zero_std, "seconds": self.seconds}


class RolloutSource:
    """Batches for steps 1, 2, ... in order (`next`), sampled `opts.off_policy_lag` steps ahead of training,
    with dynamic sampling when `opts.dynamic_sampling`. `cursor`: the next prompt's position in the file's
    endless repetition; `queued`: saved batches (`Batch.state`) of a resumed run."""

    def __init__(self, model, sample: Sample, tokenizer, rewards: list[Reward], prompts: list, opts,
                 cursor: int = 0, queued: list[dict] = ()):
        self.model, self.sample, self.tokenizer, self.rewards = model, sample, tokenizer, rewards
        self.prompts, self.opts, self.cursor = prompts, opts, cursor
        self.queue: deque[Batch] = deque(self._restore(q) for q in queued)

    def next(self, step: int, version: int) -> Batch:
        """Step `step`'s batch; the weights now (after `version` optimizer steps) sample the batches up to step
        `step` + lag that are not queued yet."""
        while len(self.queue) < self.opts.off_policy_lag + 1:
            self.queue.append(self._generate(step + len(self.queue), version))
        batch = self.queue.popleft()
        assert batch.step == step, (batch.step, step)
        return batch

    def state(self) -> dict:
        return {"cursor": self.cursor, "queued": [b.state() for b in self.queue]}

    # ---- sampling ----------------------------------------------------------------------------------------
    def _take(self) -> list[int]:
        n, P = len(self.prompts), self.opts.prompts_per_step
        at = [(self.cursor + i) % n for i in range(P)]
        self.cursor += P
        return at

    def _generate(self, step: int, version: int) -> Batch:
        opts, G = self.opts, self.opts.group_size
        kept_at, kept_ro, kept_table, failures = [], [], [], []
        rounds = dropped = zero = 0
        gen_s = 0.0
        while True:
            at = self._take()
            ro = rollout(self.sample, self.tokenizer, [self.prompts[i] for i in at], opts, step,
                         first_row=rounds * len(at) * G)
            table, failed = score(self.rewards, ro, G)
            failures += failed
            rounds, gen_s = rounds + 1, gen_s + ro.seconds
            _, zero_std, _ = gl.group_advantages(total_rewards(table, self.rewards), G, "group")
            live = [k for k in range(len(at)) if not bool(zero_std[k * G])]
            zero += len(at) - len(live)
            if not opts.dynamic_sampling:
                live = list(range(len(at)))
            dropped += len(at) - len(live)
            kept_at += [at[k] for k in live]
            kept_ro += [(ro, k) for k in live]
            kept_table += [table[k * G:(k + 1) * G] for k in live]
            if len(kept_at) >= opts.prompts_per_step or rounds >= opts.max_sampling_rounds:
                break
        if not kept_at:  # nothing with variance in any round: the last round's groups (zero advantages)
            kept_at, kept_ro = at, [(ro, k) for k in range(len(at))]
            kept_table, dropped = [table[k * G:(k + 1) * G] for k in range(len(at))], dropped - len(at)
        P = min(len(kept_at), opts.prompts_per_step)
        ro = _joined(kept_ro[:P], G, gen_s)
        return self._scored(step, version, [i for i in kept_at[:P] for _ in range(G)], ro,
                            torch.cat(kept_table[:P]), failures, rounds, dropped, zero / (rounds * len(at)))

    def _scored(self, step, version, at, ro, table, failures, rounds, dropped, zero_share) -> Batch:
        """The batch with the trainer's log-probs of its completions, by the weights that sampled it."""
        opts = self.opts
        start = time.perf_counter()
        rows = self._rows(ro)
        ids, where, _, tokens = rows
        with torch.no_grad():
            raw = token_logps(self.model, ids, where, tokens)  # the engine's distribution: temperature 1
            old = None  # π_old: the current policy, detached in the loss (one on-policy pass), else these
            if opts.num_iterations > 1 or opts.method == "rloo" or opts.off_policy_lag > 0:
                old = raw if opts.temperature == 1 else token_logps(self.model, ids, where, tokens, opts.temperature)
        return Batch(step, version, at, ro, table, failures, rows, raw, old, rounds, dropped, zero_share,
                     time.perf_counter() - start)

    def _rows(self, ro: Rollout) -> tuple:
        """`batch_rows` on the model's device."""
        device = next(self.model.parameters()).device
        return tuple(t.to(device) for t in batch_rows(ro, self.tokenizer.eod_id))

    def _restore(self, s: dict) -> Batch:
        prompts = [self.prompts[i] for i in s["at"]]
        ro = Rollout(prompts, s["ids"], [completion_text(self.tokenizer, i) for i in s["ids"]], s["engine_logps"],
                     s["gen_s"])
        device = next(self.model.parameters()).device
        old = s["old"].to(device) if s["old"] is not None else None
        return Batch(s["step"], s["version"], s["at"], ro, s["table"], s["failures"],
                     self._rows(ro), s["raw"].to(device), old, s["rounds"], s["dropped"],
                     s["sampled_zero_std"], s["seconds"])


def _joined(parts: list[tuple[Rollout, int]], G: int, seconds: float) -> Rollout:
    """One rollout of group k of each (rollout, k)."""
    def rows(r: Rollout, k: int, field: str) -> list:
        return getattr(r, field)[k * G:(k + 1) * G]
    return Rollout(*[[x for r, k in parts for x in rows(r, k, f)] for f in ("prompts", "ids", "texts", "engine_logps")],
                   seconds)
