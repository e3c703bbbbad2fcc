"""Autoregressive sampling with a KV cache: temperature, top-k, top-p (nucleus), seeded.

The prompt is run once to fill the cache, then one token per step attends to the cached keys/values.
Greedy decoding (temperature 0) with the cache equals greedy decoding without it (tested).
"""

from __future__ import annotations

import torch

from meshlm.models.gpt import GPT


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits: (B, V) → next ids (B, 1)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, use_cache: bool = True,
             eod_id: int | None = None) -> torch.Tensor:
    """prompt: (B, T0) ids → (B, T0 + n) ids. Stops early when every row produced `eod_id`."""
    was_training = model.training
    model.eval()
    device = prompt.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    limit = model.cfg.seq_len if model.pos_emb is not None else prompt.shape[1] + max_new_tokens
    if prompt.shape[1] + max_new_tokens > limit:
        max_new_tokens = max(0, limit - prompt.shape[1])
    out = prompt
    caches = model.new_caches(prompt.shape[0], prompt.shape[1] + max_new_tokens) if use_cache else None
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        if use_cache:
            start = 0 if i == 0 else out.shape[1] - 1
            logits = model(out[:, start:], caches=caches, start=start)
        else:
            logits = model(out)
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
        out = torch.cat([out, nxt], dim=1)
        if eod_id is not None:
            done |= nxt[:, 0] == eod_id
            if bool(done.all()):
                break
    model.train(was_training)
    return out
