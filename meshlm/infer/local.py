"""The serving engine in-process, one prompt at a time: `meshlm generate` and `meshlm chat` decode through the
same paged KV cache, scheduler, runner and sampler as `meshlm serve` (docs/serving.md), so there is one cache
path for every command that generates, and what the server's greedy decoding gives, these give too.

- `local_engine(model, tokenizer, max_len)`: an `Engine` of one row holding `max_len` positions, whole
  prompts in one step (no chunking: one prompt, nothing to interleave with), prefix caching on request (the
  chat's turns share their history's blocks);
- `stream(engine, prompt, params)`: the new token ids as they are sampled, the stop id included when the
  request ended on one (the caller cuts at it, as `models.generate.cut_at_stop` does); a request the engine
  failed (non-finite logits, say) raises `GenerationFailed` with the engine's one-line reason.

The engine's thread is never started: each `step` runs in the caller's thread, so Ctrl-C reaches the caller
between (or inside) steps; an interrupted engine is not reused (`meshlm chat` builds a new one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from meshlm.infer.engine import CacheOptions, Engine
from meshlm.infer.sampling import SamplingParams


class GenerationFailed(RuntimeError):
    """The engine failed the request: its reason (e.g. "NonFiniteLogits: the logits hold NaN ...")."""


def local_engine(model, tokenizer, max_len: int, adapters=None, prefix_caching: bool = False) -> Engine:
    """An engine of one sequence of up to `max_len` positions over `model` (see the module docstring)."""
    options = CacheOptions(prefix_caching=prefix_caching, max_batched_tokens=None)
    engine = Engine(model, tokenizer, max_seqs=1, max_len=max_len, max_queue=1, adapters=adapters,
                    options=options)
    engine.print_errors = False  # a failed request is the caller's error, said once (GenerationFailed)
    return engine


def stream(engine: Engine, prompt: list[int], params: SamplingParams, adapter: int = 0) -> Iterator[int]:
    """The ids `engine` samples after `prompt` (see the module docstring); leaving the loop early (a stop
    string, an exception) cancels the request and frees its row."""
    req = engine.submit(prompt, params, adapter=adapter)
    sent = 0
    try:
        while True:
            if not req.finished:
                engine.step()
            while sent < len(req.output_ids):
                sent += 1
                yield req.output_ids[sent - 1]
            if req.finished:
                break
    finally:
        if not req.finished:
            engine.cancel(req)
            with contextlib.suppress(Exception):  # after an interrupted step the engine is dropped anyway
                engine.step()  # the cancelled request is finished and its blocks are freed
    if req.finish_reason == "error":
        raise GenerationFailed(req.error)
