"""The model side of evaluation: for token sequences, the log-probability of each next token and the
greedy (argmax) prediction at each position, batched, in one process or under any parallel layout.

Every task (`tasks.py`), the lm-evaluation-harness model (`harness.py`) and the evaluation during
training reduce to `Scorer.score(items)`, where an item is (inputs, targets) of equal length and
`targets[i]` is the token that follows `inputs[: i + 1]` (or -1: not scored). One forward pass per batch
gives every position's numbers. Items are sorted by length (longest first) into batches of `batch_size`,
right-padded: a causal model's outputs at the real positions do not depend on what follows them.

Under a parallel layout (torchrun) every rank runs the same batches (data-parallel replicas repeat the work):

* tensor parallelism: the output layer's logits are split over the vocabulary; the log-sum-exp, the
  target's logit and the argmax are reduced over the tp group (max, sum, min of the best index), so no rank
  ever holds a whole (B, T, V) tensor;
* pipeline parallelism: the stages' forwards run one after the other with point-to-point sends (as the
  pipeline's evaluation loss does), and the last stage broadcasts the (B, T) results to its pipeline.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

Forward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Scored:
    """One item's numbers: `logprobs[i]` = log p(targets[i] | inputs[: i + 1]) (0 where targets[i] < 0),
    `greedy[i]` = the most likely token after inputs[: i + 1] (the lowest id among ties)."""

    logprobs: np.ndarray  # float64 (n,)
    greedy: np.ndarray  # int64 (n,)


def token_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), argmax) per position from whole (B, T, V) logits; targets < 0 give 0."""
    z = logits[..., :vocab_size].to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(targets >= 0, picked - lse, torch.zeros_like(lse))
    return logp, z.argmax(dim=-1)


def vocab_parallel_token_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                               group) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_stats` from (B, T, V/t) logits split over the vocabulary across `group` (padding columns,
    ids >= vocab_size, left out)."""
    width = logits.shape[-1]
    start = dist.get_rank(group) * width
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)).clone()
    if vocab_size - start < width:
        z[..., max(vocab_size - start, 0):] = float("-inf")
    local_best, local_arg = z.max(dim=-1)
    best = local_best.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    total = torch.exp(z - best.unsqueeze(-1)).sum(dim=-1)
    dist.all_reduce(total, group=group)
    lse = best + torch.log(total)
    local_t = targets - start
    mine = (local_t >= 0) & (local_t < width) & (targets >= 0)
    picked = z.gather(-1, local_t.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(mine, picked, torch.zeros_like(picked))
    dist.all_reduce(picked, group=group)
    logp = torch.where(targets >= 0, picked - lse, torch.zeros_like(lse))
    # The argmax: the lowest global id among the ranks whose best equals the global best.
    candidate = torch.where(local_best == best, local_arg + start, torch.full_like(local_arg, 2 ** 62))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
    return logp, candidate


def plain_forward(model: torch.nn.Module, vocab_size: int) -> Forward:
    """The forward of a whole model in one process (anything mapping (B, T) ids to (B, T, V) logits)."""

    @torch.no_grad()
    def forward(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_stats(model(x), y, vocab_size)

    return forward


def parallel_forward(parallelized, vocab_size: int) -> Forward:
    """The forward of this rank's part of a parallel model (`meshlm.parallel.build_model`); results on every
    rank. A last stage that fuses its head into the loss (`train.fused_loss`) gets its logits from the head."""
    from meshlm.parallel.pipeline import rank_at

    dims, pipe, model = parallelized.dims, parallelized.pipeline, parallelized.model

    def stats(logits: torch.Tensor, y: torch.Tensor):
        if dims.tp > 1 and logits.shape[-1] < vocab_size:
            return vocab_parallel_token_stats(logits, y, vocab_size, dims.tp_group)
        return token_stats(logits, y, vocab_size)

    @torch.no_grad()
    def forward(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if pipe is None:
            return stats(model(x), y)
        pp = dims.pp
        dtype = next(p for m in pipe.modules for p in m.parameters()).dtype
        shape = (x.shape[0], x.shape[1] // pipe.seq_shard, pipe.hidden_size)
        logp = torch.zeros(x.shape, dtype=torch.float32, device=dims.device)
        best = torch.zeros(x.shape, dtype=torch.int64, device=dims.device)
        with pipe._peers("evaluation forward"):
            for k, s in enumerate(pipe.stage_ids):
                if s == 0:
                    act = x
                else:
                    act = torch.empty(shape, dtype=dtype, device=dims.device)
                    dist.recv(act, src=rank_at(dims, (s - 1) % pp), group=dims.pp_group)
                out = pipe.modules[k](act)
                if s == pipe.n_stages - 1 and pipe.modules[k].fused_head:  # (a training run's pipeline)
                    out = pipe.modules[k]._head(out)  # the hidden states → logits
                if s < pipe.n_stages - 1:
                    dist.send(out.to(dtype).contiguous(), dst=rank_at(dims, (s + 1) % pp), group=dims.pp_group)
                else:
                    lp, best = stats(out, y)
                    logp = lp.to(torch.float32)
            dist.broadcast(logp, src=pipe.last_rank, group=dims.pp_group)
            dist.broadcast(best, src=pipe.last_rank, group=dims.pp_group)
        return logp, best

    return forward


class Scorer:
    """Batched per-token scoring of a causal language model (see the module docstring).

    `forward(x, y)` maps (B, T) inputs and targets to (B, T) log-probabilities and argmax ids;
    `seq_len` is the longest input the model takes; `progress` shows a bar on stderr."""

    def __init__(self, forward: Forward, seq_len: int, tokenizer=None, batch_size: int = 8,
                 device: torch.device | str = "cpu", progress: bool = False, is_main: bool = True):
        if batch_size < 1:
            from meshlm.core.config import ConfigError

            raise ConfigError(f"--batch-size {batch_size} must be >= 1")
        self.forward, self.seq_len, self.tokenizer = forward, seq_len, tokenizer
        self.batch_size, self.device = batch_size, torch.device(device)
        self.progress, self.is_main = progress, is_main

    def score(self, items: list[tuple[list[int], list[int]]], desc: str = "scoring") -> list[Scored]:
        for inputs, targets in items:
            if not 0 < len(inputs) <= self.seq_len or len(targets) != len(inputs):
                raise ValueError(f"an item of {len(inputs)} inputs and {len(targets)} targets (1..{self.seq_len})")
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
        out: list[Scored | None] = [None] * len(items)
        bar = None
        if self.progress and self.is_main and items:
            from tqdm import tqdm

            bar = tqdm(total=len(items), desc=desc, unit="seq", file=sys.stderr, dynamic_ncols=True)
        try:
            for lo in range(0, len(order), self.batch_size):
                chunk = order[lo:lo + self.batch_size]
                width = len(items[chunk[0]][0])
                x = torch.zeros((len(chunk), width), dtype=torch.long)
                y = torch.full((len(chunk), width), -1, dtype=torch.long)
                for row, i in enumerate(chunk):
                    inputs, targets = items[i]
                    x[row, :len(inputs)] = torch.tensor(inputs, dtype=torch.long)
                    y[row, :len(targets)] = torch.tensor(targets, dtype=torch.long)
                logp, best = self.forward(x.to(self.device), y.to(self.device))
                logp, best = logp.double().cpu().numpy(), best.cpu().numpy().astype(np.int64)
                for row, i in enumerate(chunk):
                    n = len(items[i][0])
                    out[i] = Scored(logp[row, :n].copy(), best[row, :n].copy())
                if bar is not None:
                    bar.update(len(chunk))
        finally:
            if bar is not None:
                bar.close()
        return out  # type: ignore[return-value]

    # ---- the two requests every task is made of -------------------------------------------------------
    def continuation(self, pairs: list[tuple[list[int], list[int]]], desc: str = "scoring"):
        """For each (context tokens, continuation tokens): (Σ log p(continuation | context), whether every
        continuation token is the greedy choice, the per-token log-probs, the per-token greedy hits).
        The context is cut from the left so that context + continuation fits seq_len + 1 tokens (at least
        one context token is needed: give the end-of-document token for an empty context)."""
        items = []
        for ctx, cont in pairs:
            if not ctx or not cont:
                raise ValueError("a continuation request needs a context token and a continuation token")
            whole = (ctx + cont)[-(self.seq_len + 1):]
            inputs = whole[:-1]
            targets = whole[1:]
            n = len(cont)
            targets = [-1] * (len(targets) - n) + targets[-n:] if n <= len(targets) else targets
            items.append((inputs, targets))
        results = []
        for (ctx, cont), (inputs, _), s in zip(pairs, items, self.score(items, desc)):
            n = min(len(cont), len(inputs))
            lp = s.logprobs[-n:]
            hits = s.greedy[-n:] == np.asarray(cont[-n:])
            results.append((float(lp.sum()), bool(hits.all()), lp, hits))
        return results

    def rolling(self, tokens: list[int], prefix: int, stride: int | None = None) -> np.ndarray:
        """log p of every token of `tokens` given the ones before it and `prefix` (the end-of-document
        token) before the first, in windows of seq_len tokens that advance by `stride` (default seq_len:
        non-overlapping); each token is scored once, in the first window where it is a target past the
        previous windows' end, with all of that window's context before it. Returns (len(tokens),)."""
        return self.score_windows([windows(tokens, prefix, self.seq_len, stride or self.seq_len)])[0]

    def score_windows(self, docs: list[list[tuple[list[int], list[int]]]], desc: str = "perplexity") -> list[np.ndarray]:
        flat = [w for doc in docs for w in doc]
        scored = iter(self.score(flat, desc))
        out = []
        for doc in docs:
            parts = []
            for inputs, targets in doc:
                s = next(scored)
                parts.append(s.logprobs[np.asarray(targets) >= 0])
            out.append(np.concatenate(parts) if parts else np.zeros(0))
        return out


def windows(tokens: list[int], prefix: int, seq_len: int, stride: int) -> list[tuple[list[int], list[int]]]:
    """The (inputs, targets) windows that score every token of `tokens` once (targets -1: context only).

    The stream is [prefix] + tokens; token j of the stream (j >= 1) is the target of input position j - 1.
    Windows end at seq_len, seq_len + stride, seq_len + 2·stride, ... (the last at the stream's end); each
    holds the seq_len inputs before its end (fewer at the start) and scores the targets after the previous
    window's end. With stride = seq_len the windows do not overlap."""
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride {stride} must be in 1..{seq_len}")
    stream = [prefix, *tokens]
    last = len(stream) - 1  # the last target's index in the stream
    out, done, end = [], 0, min(seq_len, last)
    while done < last:
        begin = max(0, end - seq_len)
        inputs = stream[begin:end]
        targets = [t if begin + 1 + k > done else -1 for k, t in enumerate(stream[begin + 1:end + 1])]
        out.append((inputs, targets))
        done = end
        end = min(end + stride, last)
    return out


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
