"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 §2.2): D sequential modules after the last layer.

Module k (1..D) sees, at position i, the previous depth's representation h^{k-1}_i and the embedding of token
t_{i+k}, and predicts t_{i+k+1}:

    h'_i  = W_k [RMSNorm_e(Emb(t_{i+k})); RMSNorm_h(h^{k-1}_i)]      (2h → h: `merge`, DeepSeek's eh_proj)
    h^k   = Block_k(h')                                               (one layer of the model's own kind)
    p^k_i = softmax(Head(Norm_k(h^k_i)))                              (`norm`: the module's own shared_head.norm)

The embedding and the output head are the model's own (shared, as in DeepSeek-V3); h^0 is the main model's
output after its final norm (what DeepSeek's and vLLM's code hand the first module); a later module takes the
previous one's block output. Training loss: L = L_main + λ/D · Σ_k CE_k, each CE_k the mean over the positions
that have a target. The tokens come from the targets y (y_i = t_{i+1}), so only the last stage of a pipeline,
which holds the head, needs them: the input token of module k at i is y_{i+k-1} and its target y_{i+k}, for
i ≤ T−1−k (the other positions are ignored; where y_{i+k-1} itself is ignored the target is ignored too).

The block is causal, so the padded tail (positions without a token) never reaches an earlier position. Serving
uses the modules as a speculative draft (`infer/speculative.py`): module k's prediction at the last position
is the guess for the token k + 1 ahead.

Names (read by parallel/, interop/, the formulas): `mtp.{k-1}.enorm`, `.hnorm`, `.merge` (h ← 2h, no bias),
`.block` (a `layers.Block`), `.norm`.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.core.config import ModelConfig
from meshlm.models.layers import Block, make_norm
from meshlm.models.loss import IGNORE_INDEX
from meshlm.models.mla import MultiHeadLatentAttention
from meshlm.models.moe import MoE


class MTPModule(nn.Module):
    """One prediction depth (module doc): norms, the 2h → h merge, one block like the model's last layer, and
    its own output norm. The embedding and the head are passed in (the model's, shared)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        last = cfg.n_layers - 1  # the block is of the last layer's kind (MoE, window) and index
        self.enorm = make_norm(cfg)
        self.hnorm = make_norm(cfg)
        self.merge = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = Block(cfg, MoE(cfg) if cfg.is_moe_layer(last) else None, last,
                           MultiHeadLatentAttention(cfg) if cfg.attention == "mla" else None)
        self.norm = make_norm(cfg)

    def forward(self, h: torch.Tensor, e: torch.Tensor, rope=None, cache=None, start=0) -> torch.Tensor:
        """h: the previous depth's stream (B, T, h), e: the embeddings of the tokens one further ahead (B, T, h)
        → this depth's stream (B, T, h), before `norm`. The block's stream is in h's dtype, as the main model's is
        (fp32 under autocast, where the merge's output is 16-bit), so the block computes and saves what a layer does."""
        merged = self.merge(torch.cat((self.enorm(e), self.hnorm(h)), dim=-1))
        return self.block(merged.to(h.dtype), rope, cache, start)


def shifted(targets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Module k's input tokens and targets from the main targets y (B, T): (y_{i+k-1}, y_{i+k}) at position i,
    the tail padded (tokens 0, targets ignored), and a target also ignored where its input token is."""
    pad = targets.new_full((targets.shape[0], k), IGNORE_INDEX)
    tokens = torch.cat((targets[:, k - 1:], pad[:, :k - 1]), dim=1)  # (B, T)
    goal = torch.cat((targets[:, k:], pad), dim=1)  # (B, T)
    goal = goal.masked_fill(tokens == IGNORE_INDEX, IGNORE_INDEX)
    return tokens.clamp_min(0), goal


class MultiTokenPrediction(nn.ModuleList):
    """The D modules, and their losses since the last `take_stats` (detached, on the device) for the trainer's
    metrics (`train.metrics.mtp_metrics`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(MTPModule(cfg) for _ in range(cfg.mtp_depth))
        self.loss_weight = cfg.mtp_loss_weight
        self._records: list[torch.Tensor] = []  # (D,) CE_k per call since the last `take_stats`

    def states(self, h0: torch.Tensor, targets: torch.Tensor, embed, rope) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each depth's normed output (what the shared head reads) and its targets, k = 1..D: `h0` the main model's
        normed output (B, T, h) (under sequence parallelism this rank's tokens), `embed(ids)` the shared embedding."""
        out, goals, h = [], [], h0
        for k, module in enumerate(self, start=1):
            tokens, goal = shifted(targets, k)
            h = module(h, embed(tokens), rope)
            out.append(module.norm(h))
            goals.append(goal)
        return out, goals

    def losses(self, h0: torch.Tensor, targets: torch.Tensor, embed, head_ce, rope) -> list[torch.Tensor]:
        """CE_k for k = 1..D (`states`), `head_ce(x, targets)` the shared head's mean cross-entropy on normed states
        (the vocab-parallel head's; a whole head runs every depth in one fused call instead: `models/gpt.py`)."""
        return [head_ce(x, goal) for x, goal in zip(*self.states(h0, targets, embed, rope))]

    def record(self, losses: list[torch.Tensor]) -> None:
        self._records.append(torch.stack([x.detach().float() for x in losses]))

    @property
    def recorded(self) -> int:
        return len(self._records)

    def drop(self, start: int, count: int) -> None:
        """Forget `count` records from `start` (calls that were not real micro-batches: a pipeline schedule's
        shape inference, `parallel/pipeline.py`)."""
        del self._records[start:start + count]

    def take_stats(self) -> tuple[torch.Tensor, int] | None:
        """(summed CE_k (D,), calls) since the last call, or None."""
        if not self._records:
            return None
        records, self._records = self._records, []
        return torch.stack(records).sum(0), len(records)

    def objective(self, main: torch.Tensor, losses: list[torch.Tensor]) -> torch.Tensor:
        """main + λ/D Σ CE_k in the gradient, `main` in value: the MTP term enters as (m − m.detach()), which is 0
        exactly, so the logged loss stays comparable with a model without MTP (its value is logged apart)."""
        extra = self.loss_weight / len(losses) * torch.stack([x.to(main.dtype) for x in losses]).sum()
        return main + (extra - extra.detach())

