"""Speculative decoding's building blocks: a cheap proposer guesses the next k tokens, the target model scores
them in one forward of k + 1 positions, and rejection sampling keeps a prefix of the guesses plus one token of
its own, so that each target forward yields 1..k + 1 tokens (docs/serving.md, "Speculative decoding").

- `target_probs(logits, params)`: the distribution the engine's sampler draws from (temperature, top-k, top-p
  exactly as `models/generate.py`'s `sample_next`; a one-hot of the argmax for greedy parameters).
- `verify(target, draft_tokens, draft, generator)`: rejection sampling (Leviathan et al. 2023, Chen et al.
  2023). The tokens it returns are distributed exactly as tokens drawn one at a time from `target`.
- Proposers: `ngram_propose` (prompt lookup: the continuation of the suffix's latest earlier occurrence; no
  model) and `DraftModel` (a smaller meshlm GPT with the same tokenizer and its own paged KV cache, through
  the engine's `Runner`).

Nothing of the engine's queue or acceptance: the engine owns the target's cache, penalties, stop rules (a draft model
runs on a `Runner` of its own).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from meshlm.models.generate import scaled_logits


# ---- the target's distribution -----------------------------------------------------------------------------
def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """(T, V) logits (penalties already applied) → (T, V) fp32 probabilities: what the engine's sampler draws
    from with `params` (a `SamplingParams`). Greedy parameters (temperature 0 or top-k 1): a one-hot of each
    row's argmax. Otherwise `sample_next`'s steps, the same operations in the same order: `scaled_logits`,
    top-k (ties with the k-th kept), top-p (the smallest prefix of the sorted probabilities reaching top_p),
    softmax. A (V,) input gives (V,)."""
    single = logits.dim() == 1
    logits = logits[None] if single else logits
    if params.greedy:
        probs = F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return probs[0] if single else probs
    logits = scaled_logits(logits, params.temperature)
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return probs[0] if single else probs


# ---- rejection sampling ----------------------------------------------------------------------------------------
Generators = torch.Generator | None | Sequence[torch.Generator | None]


def uniforms(rows: torch.Tensor, n: int, generators: Generators, device) -> torch.Tensor:
    """(B, n) uniforms in [0, 1): drawn for the rows where the bool (B,) `rows` is True, zeros elsewhere.
    `generators`: one generator for every row, or one per row (a request's own: what a row draws then never
    depends on the other rows of the batch)."""
    out = torch.zeros(len(rows), n, device=device)
    picked = rows.nonzero()[:, 0].tolist()
    if not picked:
        return out
    if generators is None or isinstance(generators, torch.Generator):
        gen = generators
        drawn = torch.rand(len(picked), n, generator=gen, device=gen.device if gen is not None else "cpu")
        out[picked] = drawn.to(device)
        return out
    for b in picked:
        gen = generators[b]
        out[b] = torch.rand(n, generator=gen, device=gen.device if gen is not None else "cpu").to(device)
    return out


def draw(weights: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """One index per row of non-negative (B, V) `weights` (not necessarily normalised) → (B,) int64, with one
    uniform per row (inverse transform sampling: the first index whose cumulative weight exceeds u × the
    row's total). A row with a single non-zero weight (greedy) is that index, without a draw, so greedy
    requests need no generator."""
    weights = weights.float()
    support = weights > 0
    single = support.sum(-1) == 1
    if bool(single.all()):
        return support.to(torch.int8).argmax(-1)
    cdf = weights.cumsum(-1)
    u = uniforms(~single, 1, generators, cdf.device)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_max(cdf.shape[-1] - 1)
    last = cdf.shape[-1] - 1 - support.flip(-1).to(torch.int8).argmax(-1)  # each row's last index with weight
    hit = support.gather(1, index[:, None])[:, 0]
    return torch.where(hit, index, last)  # (u × total rounded up to the total: the last index with weight)


def verify(target: torch.Tensor, draft_tokens: Sequence[int], draft: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> list[int]:
    """Rejection sampling of k proposed tokens against the target's distributions.

    target: (k + 1, V) probabilities (`target_probs`): row i is the target's distribution of the token after
    the first i draft tokens (row k: after all of them; with penalties, counted with those i tokens).
    draft_tokens: the k proposed ids. draft: (k, V), the distribution each was drawn from; None for a
    deterministic proposer (n-gram lookup: a one-hot q). Draft token i is accepted with probability
    min(1, p_i(x) / q_i(x)); at the first rejection the last token is drawn from norm(max(0, p_i - q_i)), and
    when all k are accepted it is a bonus token drawn from target[k]. Returns the accepted draft prefix plus
    that one token (1..k + 1 ids), distributed exactly as tokens drawn one at a time from the target. Every
    draw uses `generator`; greedy (one-hot targets) is exactly the greedy continuation, without any draw."""
    k = len(draft_tokens)
    if target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(f"target must be ({k + 1}, V) for {k} draft tokens (got {tuple(target.shape)})")
    if draft is not None and tuple(draft.shape) != (k, target.shape[1]):
        raise ValueError(f"draft must be ({k}, {target.shape[1]}) (got {tuple(draft.shape)})")
    tokens = torch.tensor([list(draft_tokens)], dtype=torch.long, device=target.device).view(1, k)
    out, count = verify_rows(target[None], tokens, draft[None] if draft is not None else None, [generator])
    return out[0, :int(count[0])].tolist()


def verify_rows(target: torch.Tensor, draft_tokens: torch.Tensor, draft: torch.Tensor | None = None,
                generators: Generators = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` for B rows at once (every row of a decode step): target (B, k + 1, V), draft_tokens (B, k)
    int64, draft (B, k, V) or None, generators one per row (each request's own) or one for all. Returns
    (tokens (B, k + 1), counts (B,)): row b emits tokens[b, :counts[b]]. A row draws k uniforms only when
    one of its acceptances is a coin flip (0 < p < q), and one for its last token unless that is certain."""
    B, k = draft_tokens.shape
    x = draft_tokens.to(target.device)
    p = target[:, :k].float().gather(2, x[..., None])[..., 0]  # (B, k): p_i(x_i)
    q = draft.float().gather(2, x[..., None].to(draft.device))[..., 0].to(p.device) if draft is not None \
        else torch.ones_like(p)
    flips = ((p > 0) & (p < q)).any(-1)  # rows with a coin flip; elsewhere every ratio p / q is 0 or >= 1
    u = uniforms(flips, k, generators, p.device)  # zeros where no flip: then the test is p >= q > 0 or p > 0
    accept = u * q < p  # probability min(1, p / q)
    n = accept.to(torch.long).cumprod(1).sum(1)  # (B,) accepted prefix lengths
    rows = torch.arange(B, device=target.device)
    last = target[rows, n].float()  # (B, V): at the first rejection p_n, or target[k] for the bonus token
    if k:
        rejected = n < k
        at = n.clamp_max(k - 1)
        if draft is not None:
            q_n = draft[rows.to(draft.device), at.to(draft.device)].float().to(last.device)
        else:
            q_n = F.one_hot(x[rows, at], last.shape[-1]).to(last)
        residual = (last - q_n * rejected[:, None]).clamp_min(0)
        empty = ~(residual.sum(-1) > 0)  # p == q up to rounding: a rejection only rounding can make
        last = torch.where(empty[:, None], last, residual)
    tokens = torch.cat([x, torch.zeros(B, 1, dtype=torch.long, device=x.device)], 1)
    tokens[rows, n] = draw(last, generators).to(tokens.device)
    return tokens, n + 1


@dataclass
class SpeculativeStats:
    """Counters of speculative steps: `acceptance_rate` = accepted draft tokens / proposed draft tokens;
    `tokens_per_step` = emitted tokens / verification steps (1 + acceptance_rate × k when every step proposes
    k; plain decoding: 1)."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0

    def record(self, proposed: int, emitted: int) -> None:
        """One verification of `proposed` draft tokens that emitted `emitted` tokens (accepted ones + 1)."""
        self.steps += 1
        self.proposed += proposed
        self.accepted += emitted - 1
        self.emitted += emitted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


# ---- n-gram (prompt lookup) proposer -----------------------------------------------------------------------
def ngram_propose(tokens: Sequence[int], k: int, n_max: int = 4, n_min: int = 1) -> list[int]:
    """Prompt-lookup drafting: the longest suffix n-gram of `tokens` (n from n_max down to n_min) that occurs
    earlier, at its most recent earlier occurrence; up to k tokens that followed it there. The continuation is
    read as if the sequence went on with the proposal itself, so a repeating pattern (a period shorter than k)
    fills all k. [] when no suffix of n_min tokens or more occurs earlier."""
    length = len(tokens)
    if k <= 0 or length < 2 or n_min < 1 or n_max < n_min:
        return []
    t = np.asarray(tokens, dtype=np.int64)
    ends = np.arange(length - 1)  # candidate occurrences end at e < length - 1 (one token follows them)
    run = np.zeros(length - 1, dtype=np.int64)  # matched suffix length at each end, up to n_max
    alive = np.ones(length - 1, dtype=bool)
    for m in range(min(n_max, length - 1)):
        idx = ends - m
        alive &= (idx >= 0) & (t[np.maximum(idx, 0)] == t[length - 1 - m])
        if not alive.any():
            break
        run += alive
    best = int(run.max())
    if best < n_min:
        return []
    end = int(np.flatnonzero(run == best)[-1])  # the most recent occurrence of the longest suffix
    out = t.tolist()
    for j in range(k):  # out[end + 1 + j] is an original token or an earlier proposal (end + 1 < length)
        out.append(out[end + 1 + j])
    return out[length:]


# ---- draft-model proposer ------------------------------------------------------------------------------------
class DraftModel:
    """A smaller meshlm GPT (same tokenizer) proposing k tokens for many rows at once, with its own paged KV
    cache: a `Runner` (the serving engine's: `models/paged.py`'s pool and attention over block tables) of
    `max_seqs` × ⌈`max_len` / `block_size`⌉ blocks, and per key (a request id) a block table that grows as the
    key's sequence does; one key's blocks are never another's.

    `propose(batch, k)` catches each row up on the tokens it has not cached yet (the tokens accepted since
    last time; a new key: its whole prompt) in one forward over every row, then runs k batched decode steps,
    drawing each draft token from the draft's own `target_probs` with the row's parameters (greedy: the
    argmax). The key remembers the tokens its blocks hold and compares them with the next call's `tokens`, so
    rejected draft tokens are never reused (their positions are written again); `rollback(key, length)` drops
    them at once, `release(key)` gives its blocks back."""

    def __init__(self, model, max_seqs: int, max_len: int, vocab_size: int | None = None, block_size: int = 16):
        from meshlm.infer.runner import Runner

        cfg = model.cfg
        if cfg.position == "learned" and max_len > cfg.seq_len:
            raise ValueError(f"max_len {max_len} is more than the draft model's learned positions "
                             f"(model.seq_len={cfg.seq_len})")
        self.model = model.eval()
        self.max_seqs, self.max_len, self.block_size = max_seqs, max_len, block_size
        self.vocab_size = vocab_size or cfg.vocab_size
        self.device = next(model.parameters()).device
        blocks = max_seqs * -(-max_len // block_size)
        self.runner = Runner(self.model, blocks, block_size, cfg.vocab_size)
        self.free = list(range(blocks))
        self.tables: dict[Hashable, list[int]] = {}  # per key: its blocks, in position order
        self.cached: dict[Hashable, list[int]] = {}  # per key: the tokens whose keys/values its blocks hold
        self.generators: dict[Hashable, torch.Generator | None] = {}

    def cache_bytes(self) -> int:
        return self.runner.cache_bytes()

    def length(self, key: Hashable) -> int:
        """Positions of `key`'s row holding tokens (0 for an unknown key)."""
        return len(self.cached.get(key, ()))

    def rollback(self, key: Hashable, length: int) -> None:
        """Keep only the first `length` cached positions of `key` (the accepted tokens)."""
        if key in self.cached:
            del self.cached[key][max(0, length):]

    def release(self, key: Hashable) -> None:
        """Give `key`'s blocks back (a finished request)."""
        self.free.extend(self.tables.pop(key, ()))
        self.cached.pop(key, None)
        self.generators.pop(key, None)

    def room(self, tokens: Sequence[int], k: int) -> int:
        """Draft tokens a row of len(tokens) may take: all of them and the bonus token fit in max_len."""
        return max(0, min(k, self.max_len - 1 - len(tokens)))

    @torch.no_grad()
    def propose(self, batch: Sequence[tuple], k: int | Sequence[int]) -> list[tuple[list[int], torch.Tensor]]:
        """batch: (key, tokens, params) or (key, tokens, params, generator) per row: tokens the row's whole
        sequence so far (prompt and accepted output), params its `SamplingParams`, generator the draws'
        (default: the key's own, seeded from params.seed when it has one). k: draft tokens per row, or one per
        row. Returns per row (draft_tokens, draft_probs (n, V) fp32) with n = min(k, max_len - 1 -
        len(tokens)) (0: nothing to propose)."""
        ks = [k] * len(batch) if isinstance(k, int) else list(k)
        if len(ks) != len(batch):
            raise ValueError(f"k: {len(ks)} values for {len(batch)} rows")
        keys = [item[0] for item in batch]
        if len(set(keys)) != len(keys):
            raise ValueError("propose: a key appears twice in one batch")
        wants = [self.room(item[1], n) if item[1] else 0 for item, n in zip(batch, ks)]
        out: list[tuple[list[int], torch.Tensor]] = [([], torch.zeros(0, self.vocab_size, device=self.device))
                                                     for _ in batch]
        order = sorted((i for i in range(len(batch)) if wants[i] > 0), key=lambda i: -wants[i])
        if not order:
            return out
        rows = [batch[i] for i in order]
        for key, item, n in zip((keys[i] for i in order), rows, (wants[i] for i in order)):
            self._hold(key, len(item[1]) + n - 1)  # the catch-up and every draft token fed but the last
        gens = [self._generator(item) for item in rows]
        logits = self._catch_up([keys[i] for i in order], [item[1] for item in rows])
        drafts, probs = self._draft_steps([keys[i] for i in order], rows, [wants[i] for i in order], gens, logits)
        for j, i in enumerate(order):
            self.cached[keys[i]] = list(batch[i][1]) + drafts[j][:-1]  # the last draft token is not fed
            out[i] = (drafts[j], torch.stack(probs[j]))
        return out

    def _generator(self, item: tuple) -> torch.Generator | None:
        key, _, params = item[:3]
        if len(item) > 3:
            return item[3]
        if key not in self.generators:
            gen = None
            if not params.greedy:
                seed = params.seed + 1 if params.seed is not None else int(torch.randint(0, 2 ** 62, ()).item())
                gen = torch.Generator().manual_seed(seed % 2 ** 63)
            self.generators[key] = gen
        return self.generators[key]

    def _hold(self, key: Hashable, positions: int) -> None:
        """`key`'s table long enough for `positions` positions (a new key: a fresh table), blocks from the free
        list; ValueError when `max_seqs` keys already hold blocks."""
        if key not in self.tables:
            if len(self.tables) >= self.max_seqs:
                raise ValueError(f"the draft model's {self.max_seqs} rows are all in use (release finished keys, "
                                 "or raise max_seqs)")
            self.tables[key], self.cached[key] = [], []
        table = self.tables[key]
        while len(table) * self.block_size < positions:
            table.append(self.free.pop())

    def _forward(self, keys: list[Hashable], ids: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Row b feeds ids[b] at positions starts[b].. into key b's blocks; (B, V) fp32 logits of each row's
        last token."""
        from meshlm.infer.scheduler import ForwardPlan

        rows = tuple((range(s, s + len(t)), tuple(self.tables[key])) for key, t, s in zip(keys, ids, starts))
        ends = list(itertools.accumulate(len(t) for t in ids))
        plan = ForwardPlan(ids=tuple(t for row in ids for t in row), rows=rows, select=tuple(e - 1 for e in ends))
        logits = self.runner.forward(plan)
        if logits.shape[-1] < self.vocab_size:  # a draft vocabulary smaller than the target's
            logits = F.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
        return logits[:, :self.vocab_size]

    def _catch_up(self, keys: list[Hashable], sequences: list[Sequence[int]]) -> torch.Tensor:
        """Feed each key what it has not cached of its sequence (at least the last token), all rows in one
        forward (a long run, a new prompt, attends alone in it); (n, V) logits of each row's next token."""
        cached = [min(self._common(self.cached[key], seq), len(seq) - 1) for key, seq in zip(keys, sequences)]
        return self._forward(keys, [list(seq[c:]) for seq, c in zip(sequences, cached)], cached)

    @staticmethod
    def _common(cached: list[int], tokens: Sequence[int]) -> int:
        """The length of the common prefix of the cached tokens and the row's sequence."""
        n = min(len(cached), len(tokens))
        if list(tokens[:n]) == cached[:n]:
            return n
        return next(i for i in range(n) if cached[i] != tokens[i])

    def _draft_steps(self, keys: list[Hashable], rows: list[tuple], wants: list[int], gens: list,
                     logits: torch.Tensor):
        """Draw each row's draft tokens: the first from the catch-up's logits, then one batched decode step
        per further token, for the rows (a prefix: sorted by `wants`) still wanting one."""
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        for j in range(max(wants)):
            if j:
                n = sum(w > j for w in wants)
                starts = [len(rows[r][1]) + j - 1 for r in range(n)]
                logits = self._forward(keys[:n], [[drafts[r][-1]] for r in range(n)], starts)
            q = torch.stack([target_probs(logits[r], rows[r][2]) for r in range(len(logits))])
            picked = draw(q, gens[:len(q)]).tolist()  # greedy rows: a one-hot q, its argmax without a draw
            for r, token in enumerate(picked):
                probs[r].append(q[r])
                drafts[r].append(token)
        return drafts, probs


class Speculator:
    """The engine's proposer: prompt lookup (`method` "ngram"), a draft model (`draft`, a `DraftModel`), or the
    served model's multi-token prediction modules ("mtp", `draft` an `infer.mtp_draft.MTPDraft`: the same
    `propose`/`rollback`/`release`), over the engine's requests (their `id`, `tokens()`, `params`, `generator`)."""

    def __init__(self, method: str, draft: DraftModel | None = None, n_max: int = 4):
        if method not in ("ngram", "draft", "mtp") or (method != "ngram") != (draft is not None):
            raise ValueError(f"speculative method {method!r}: 'ngram', or 'draft' with a DraftModel, or 'mtp' "
                             "with an MTPDraft")
        self.method, self.draft, self.n_max = method, draft, n_max

    def propose(self, reqs: Sequence, k: int) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to `k` draft tokens per request, with the distributions they were drawn from (None: n-gram)."""
        if self.draft is None:
            return [(ngram_propose(r.tokens(), k, self.n_max), None) for r in reqs]
        return self.draft.propose([(r.id, r.tokens(), r.params, r.generator) for r in reqs], k)

    def rollback(self, req, length: int) -> None:
        if self.draft is not None:
            self.draft.rollback(req.id, length)

    def release(self, req) -> None:
        if self.draft is not None:
            self.draft.release(req.id)

