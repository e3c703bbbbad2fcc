"""Per-request sampling: the request's parameters (`SamplingParams`, checked by `validate`), a token's record
(`TokenInfo`), and the choice of the next token from the model's logits (`sample_token`: penalties, then greedy or
temperature / top-k / top-p with the request's own generator).

The engine calls `begin(req, tokenizer)` when a request is submitted and `observe(req, token)` after each token it
accepts, so that per-request state (a guided-decoding matcher, say) follows the output; `sample_token` applies
everything that shapes the logits before the draw. Plain functions of the request: nothing here knows about the
cache or the batch.

What shapes the logits, in order: the penalties, `logit_bias` (OpenAI's: added to the token's logit, -100..100),
then the guide's mask (`infer/guided.py`: a `response_format`'s grammar; a token it refuses is -inf whatever its
bias). `SamplingParams.shapes_logits` says whether any of them is on: when it is not, a greedy request's token is
the plain argmax of the logits, which the engine may take from a batched argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from meshlm.models.generate import sample_next

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # > 1 discourages every token of the prompt and output (CTRL's rule)
    presence_penalty: float = 0.0  # subtracted from tokens already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    logprobs: int | None = None  # None: none; N: the chosen token's and the top N
    echo: bool = False  # the prompt's log-probabilities too (its first token has none)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before the draw, in [-100, 100]
    guide: object | None = None  # a grammar the output follows: `infer/guided.py`'s `Format` (`start()`: a Guide)

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 0, "max_tokens", "must be >= 0"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0: off)"),
            (math.isfinite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             "must be > 0 (1: off)"),
            (math.isfinite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             "must be in [-2, 2]"),
            (math.isfinite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS, "logprobs",
             f"must be in 0..{MAX_TOP_LOGPROBS}"),
            (self.seed is None or 0 <= self.seed < 2 ** 63, "seed", "must be in 0..2^63-1"),
            (self.logit_bias is None or all(isinstance(t, int) and t >= 0 and isinstance(b, int | float)
                                            and -100 <= b <= 100 for t, b in self.logit_bias.items()),
             "logit_bias", "must map token ids (>= 0) to biases in [-100, 100]"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(f"{param} {message} (got {getattr(self, param)!r})", param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def shapes_logits(self) -> bool:
        """Whether anything changes the logits before the draw (penalties, logit_bias, a guide): when not, a
        greedy token is the argmax of the model's logits."""
        return (self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)
                or bool(self.logit_bias) or self.guide is not None)


class InvalidRequest(ValueError):
    """A request the engine cannot take; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class TokenInfo:
    """One token: its id, text, the model's log-probability, and the top N (id, log-probability)."""

    id: int
    text: str
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


def apply_penalties(logits: torch.Tensor, req) -> torch.Tensor:
    p = req.params
    if p.repetition_penalty != 1.0 and req.seen:
        ids = torch.tensor(sorted(req.seen), device=logits.device)
        vals = logits[ids]
        logits = logits.clone()
        logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.counts:
        ids = torch.tensor(list(req.counts), device=logits.device)
        counts = torch.tensor(list(req.counts.values()), dtype=logits.dtype, device=logits.device)
        logits = logits.clone()
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float] | None) -> torch.Tensor:
    """`logits` with each biased token's bias added (ids past the logits are ignored: the engine checks them)."""
    if not bias:
        return logits
    ids = [t for t in bias if t < logits.shape[-1]]
    if not ids:
        return logits
    logits = logits.clone()
    logits[torch.tensor(ids, device=logits.device)] += torch.tensor([float(bias[t]) for t in ids],
                                                                    dtype=logits.dtype, device=logits.device)
    return logits


def shape_logits(logits: torch.Tensor, req) -> torch.Tensor:
    """The (V,) logits the draw sees: penalties, then logit_bias, then the guide's mask."""
    logits = apply_logit_bias(apply_penalties(logits, req), req.params.logit_bias)
    guide = getattr(req, "guide", None)
    return guide.mask(logits) if guide is not None else logits


def sample_token(logits: torch.Tensor, req) -> int:
    """One id from (V,) fp32 logits by the request's parameters (`models/generate.py`'s `sample_next`: however
    small the temperature or extreme the penalties, no NaN reaches the draw)."""
    p = req.params
    logits = shape_logits(logits, req)
    if p.greedy:
        return int(logits.argmax())
    return int(sample_next(logits[None], p.temperature, p.top_k, p.top_p, req.generator)[0, 0])


def begin(req, tokenizer) -> None:
    """Per-request state, set up when `req` is submitted (after `validate`): the guide of its grammar."""
    req.guide = req.params.guide.start() if req.params.guide is not None else None


def observe(req, token: int) -> None:
    """`req` accepted `token` (after `sample_token` chose it, or a speculative step verified it)."""
    guide = getattr(req, "guide", None)
    if guide is not None:
        guide.advance(token)
