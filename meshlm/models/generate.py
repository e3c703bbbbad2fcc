"""Autoregressive sampling with a KV cache: temperature, top-k, top-p (nucleus), seeded.

The prompt is run once to fill the cache, then one token per step attends to the cached keys/values. The cache is
`models/layers.KVCache` (contiguous rows, one per prompt), behind the one cache interface attention uses
(`models/cache.py`), as the serving engine's paged pool is (`models/paged.py`).
Greedy decoding (temperature 0) with the cache equals greedy decoding without it (tested). Generation ends at
any of the tokenizer's stop ids (the model's declared end-of-sequence ids, `data.tokenizers`). `stream` yields a
single prompt's tokens one by one (for `meshlm chat`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from meshlm.models.gpt import GPT


class NonFiniteLogits(ValueError):
    """The model's logits hold NaN: no token can be drawn from them (a broken checkpoint or an overflow)."""


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 `logits / temperature` (temperature > 0) that never overflows into NaN: each row is shifted so its
    largest logit is 0 first (softmax is unchanged), so however small the temperature the largest stays 0 and
    the rest go towards -inf (greedy decoding in the limit). A temperature below fp32's smallest normal number
    (about 1.2e-38, which fp32 cannot divide by: it rounds to 0) counts as that number. Infinite logits are
    clamped to fp32's largest finite value; NaN ones raise NonFiniteLogits."""
    logits = logits.float()
    if bool(torch.isnan(logits).any()):
        raise NonFiniteLogits("the model's logits hold NaN (a checkpoint with non-finite weights?); no token "
                              "can be sampled")
    big = torch.finfo(torch.float32).max
    logits = logits.clamp(-big, big)
    shifted = logits - logits.max(dim=-1, keepdim=True).values  # <= 0, the largest exactly 0
    return shifted / max(float(temperature), torch.finfo(torch.float32).tiny)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits: (B, V) → next ids (B, 1). Temperature 0 (or top-k 1) is greedy decoding; a temperature so small
    that dividing by it overflows samples from the largest logits only (`scaled_logits`): no NaN ever reaches
    the draw."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = scaled_logits(logits, temperature)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)  # finite: every row holds its largest logit at 0, never masked above
    return torch.multinomial(probs, 1, generator=generator)


def _new_tokens(model: GPT, prompt: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int,
                top_p: float, seed: int | None, use_cache: bool) -> Iterator[torch.Tensor]:
    """Each step's sampled ids (B, 1), the prompt run once to fill the KV cache (`use_cache`), then one token a
    step; at most `max_new_tokens`, fewer where learned positions end at model.seq_len."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=prompt.device)
        generator.manual_seed(seed)
    limit = model.cfg.seq_len if model.pos_emb is not None else prompt.shape[1] + max_new_tokens
    if prompt.shape[1] + max_new_tokens > limit:
        max_new_tokens = max(0, limit - prompt.shape[1])
    out = prompt
    caches = model.new_caches(prompt.shape[0], prompt.shape[1] + max_new_tokens) if use_cache else None
    for i in range(max_new_tokens):
        if use_cache:
            start = 0 if i == 0 else out.shape[1] - 1
            logits = model(out[:, start:], caches=caches, start=start)
        else:
            logits = model(out)
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
        out = torch.cat([out, nxt], dim=1)
        yield nxt


def _stop_tensor(stop_ids: Iterable[int] | None, eod_id: int | None, device) -> torch.Tensor | None:
    ids = [*(stop_ids or ()), *([eod_id] if eod_id is not None else [])]
    return torch.tensor(sorted(set(map(int, ids))), device=device) if ids else None


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, use_cache: bool = True,
             eod_id: int | None = None, stop_ids: Iterable[int] | None = None) -> torch.Tensor:
    """prompt: (B, T0) ids → (B, T0 + n) ids. Stops early when every row produced one of `stop_ids` (the
    tokenizer's declared end-of-sequence ids; `eod_id` adds one); a row that stopped earlier than the others
    goes on past its stop id, which the caller cuts at (`cut_at_stop`)."""
    was_training = model.training
    model.eval()
    stops = _stop_tensor(stop_ids, eod_id, prompt.device)
    out = prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    try:
        for nxt in _new_tokens(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, use_cache):
            out = torch.cat([out, nxt], dim=1)
            if stops is not None:
                done |= torch.isin(nxt[:, 0], stops)
                if bool(done.all()):
                    break
    finally:
        model.train(was_training)
    return out


def cut_at_stop(ids: list[int], stop_ids: Iterable[int]) -> tuple[list[int], bool]:
    """(`ids` up to, not including, the first stop id; whether one was found)."""
    stops = set(stop_ids)
    for i, token in enumerate(ids):
        if token in stops:
            return ids[:i], True
    return list(ids), False


@torch.no_grad()
def stream(model: GPT, prompt: list[int], max_new_tokens: int, temperature: float = 0.8, top_k: int = 0,
           top_p: float = 1.0, seed: int | None = None, stop_ids: Iterable[int] = ()) -> Iterator[int]:
    """The new ids of one prompt, each yielded as soon as it is sampled (KV cache; the same steps as `generate`,
    so greedy decoding gives its tokens); ends at `max_new_tokens` or at a stop id, which is not yielded."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    stops = set(map(int, stop_ids))
    try:
        x = torch.tensor([prompt], dtype=torch.long, device=device)
        for nxt in _new_tokens(model, x, max_new_tokens, temperature, top_k, top_p, seed, use_cache=True):
            token = int(nxt[0, 0])
            if token in stops:
                return
            yield token
    finally:
        model.train(was_training)
