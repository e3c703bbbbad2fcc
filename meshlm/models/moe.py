"""Mixture of experts: a router over SwiGLU experts in place of a GPT block's MLP (docs/moe.md).

CONTRACT (read by parallel/ and interop/; changes to it are written here first)
  Keys: `ModelConfig.moe_*` (core/config.py); layer i is MoE when `cfg.is_moe_layer(i)`.
  Names inside `layers.N.`: `mlp.router.weight` (E, H); buffer `mlp.router.score_bias` (E,) (sigmoid router only,
  saved); `mlp.experts.fc` (E, 2F, H) = per expert [W_gate; W_up]; `mlp.experts.proj` (E, H, F);
  `mlp.shared.fc.weight` (2S, H) and `mlp.shared.proj.weight` (H, S) (a `layers.MLP`, S = shared_experts · F);
  `mlp.shared_gate.weight` (1, H). With `moe_bias` (gpt-oss): `mlp.router.bias` (E,), `mlp.experts.fc_bias` (E, 2F)
  = per expert [b_gate; b_up], `mlp.experts.proj_bias` (E, H); otherwise no biases.
  Dispatch: `MoE.forward` routes (fp32), applies capacity, then calls
      y = self.dispatch(x, tokens, experts, weights, self.experts)
  x (N, H) the layer's tokens; tokens / experts (A,) int64 and weights (A,) fp32 the kept assignments (A ≤ N·k),
  ordered token-major (token t's slots in rank order); returns y (N, H) = Σ_a weights[a] · expert_{experts[a]}(x[tokens[a]])
  in x's dtype (tokens no expert took: 0). `LocalDispatch` is the one-process implementation. Experts are computed by
  `Experts.run(rows, counts)`: rows sorted by LOCAL expert id, counts (n_local,) how many rows each — an all-to-all
  dispatch (expert parallelism) slices `experts.fc/proj` (and their biases) to the rank's `n_local` contiguous
  experts, sets `experts.first` (the global id of its first one) and calls `run` on the rows it received.
  Aux losses: added to the gradients by `AuxLossGrad` (the output passes through unchanged), scaled by
  `MoE.aux_grad_scale` (the trainer sets it each step to the loss scale / micro-batches, `set_aux_grad_scale`).
  Statistics for metrics and the sigmoid router's bias: `MoE.stats` (on the device, summed over the micro-batches
  since the last `take_stats`; `train.metrics.moe_metrics` logs them); `update_router_bias(model, groups)` after
  each optimizer step, the load summed over `groups` (`train.metrics.moe_groups`: dp × cp, + tp under SP).
  Rows split over ranks (cp; tp under SP): `MoE.token_groups` (the aux loss's f_i counted over all their
  tokens, `route`) and `MoE.aux_weight` (1/tp under SP), set by parallel/expert.py, so the aux and z losses
  and their gradients are one process's.

Routing per token (logits z = W_r x (+ b_r with moe_bias) in fp32):
  softmax: p = softmax(z), the top_k of p; weights = those p (renormalised to sum 1 with moe_norm_topk).
  sigmoid: s = sigmoid(z), the top_k of s + score_bias (the bias only selects), weights = those s (renormalised
  with moe_norm_topk); p = s / Σ s for the aux loss. With moe_groups > 1 the top_k are taken among the
  moe_topk_groups best groups only (`limit_to_groups`). Either way the weights are then × moe_routed_scale.
Aux loss (Switch): E · Σ_i f_i · P_i, f_i = share of the N·k assignments routed (before capacity) to expert i,
  P_i = mean over tokens of p_i; 1 at perfect balance. Z-loss: mean over tokens of logsumexp(z)².
Capacity (moe_capacity_factor cf > 0): each expert keeps at most C = ceil(cf · N · k / E) of its assignments,
  those of the highest router weight; ties by token index, then slot (lower kept first) — deterministic, so
  every layout that routes the same tokens drops the same ones.
Experts: proj(act(x W_gate + b_gate, x W_up + b_up)) + b_proj (biases with moe_bias), act = silu(g)·u (swiglu) or
  gpt-oss's `clamped_swiglu`. gpt-oss's router (softmax over the top-k logits) is the softmax router with
  moe_norm_topk: exp(z_i) / Σ_topk exp(z_j) either way.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshlm.core.config import ModelConfig
from meshlm.models.layers import MLP


class AuxLossGrad(torch.autograd.Function):
    """Identity on `x`; in backward, `scale` · d(aux)/d(its inputs) joins the gradients (the LM loss's value
    does not change, and no loss plumbing does: pipeline stages and recomputation see a plain activation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_dtype = aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class Router(nn.Module):
    """z = W_r x (+ b_r with `moe_bias`, gpt-oss); the sigmoid router's `score_bias` (a buffer, saved) shifts
    selection only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.moe_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.moe_experts)) if cfg.moe_bias else None
        if cfg.moe_router == "sigmoid":
            self.register_buffer("score_bias", torch.zeros(cfg.moe_experts, dtype=torch.float32))
        else:
            self.score_bias = None

    def reset_bias(self) -> None:
        if self.score_bias is not None:
            self.score_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)  # at least fp32 (float64 runs stay float64)
        bias = self.bias.to(dtype) if self.bias is not None else None
        with torch.autocast(x.device.type, enabled=False):  # routing in fp32 under autocast too (autocast would
            return F.linear(x.to(dtype), self.weight.to(dtype), bias)  # cast the linear's operands to 16 bits)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation: g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) · g · σ(alpha·g).
    The clamps bound the activations of its low-precision experts; the + 1 lets an expert pass g when u = 0."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


class Experts(nn.Module):
    """`n_local` SwiGLU experts, stacked: fc (n, 2F, H) = [W_gate; W_up], proj (n, H, F); with `moe_bias` their
    biases fc_bias (n, 2F) and proj_bias (n, H). `first`: the global id of expert 0 here (expert parallelism
    holds a contiguous slice)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, Fw = cfg.moe_experts, cfg.hidden_size, cfg.expert_size
        self.n_experts, self.n_local, self.first = E, E, 0
        self.fc = nn.Parameter(torch.empty(E, 2 * Fw, H))
        self.proj = nn.Parameter(torch.empty(E, H, Fw))
        self.fc_bias = nn.Parameter(torch.empty(E, 2 * Fw)) if cfg.moe_bias else None
        self.proj_bias = nn.Parameter(torch.empty(E, H)) if cfg.moe_bias else None
        self.clamped = cfg.moe_activation == "swiglu_clamped"
        self.alpha, self.limit = cfg.moe_swiglu_alpha, cfg.moe_swiglu_limit

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert e on rows x (n, H): proj(silu(x W_gate) ⊙ x W_up), or with biases and the clamped
        activation (gpt-oss) proj(clamped_swiglu(x W_gate + b_gate, x W_up + b_up)) + b_proj."""
        fc_bias = self.fc_bias[e] if self.fc_bias is not None else None
        gate, up = F.linear(x, self.fc[e], fc_bias).chunk(2, dim=-1)
        h = clamped_swiglu(gate, up, self.alpha, self.limit) if self.clamped else F.silu(gate) * up
        return F.linear(h, self.proj[e], self.proj_bias[e] if self.proj_bias is not None else None)

    def run(self, rows: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """Rows sorted by local expert, `counts[e]` of them for expert e: each group through its expert
        (one matmul pair per expert that got rows), in the same order."""
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.expert(e, rows[start:start + n]))
            start += n
        return torch.cat(outs) if outs else rows.new_zeros(0, self.proj.shape[1])


class LocalDispatch:
    """All experts in this process: sort the assignments by expert, run each group, scatter back weighted."""

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 module: Experts) -> torch.Tensor:
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=module.n_experts)
        rows = tokens[order]
        out = module.run(x.index_select(0, rows), counts)
        return add_rows(x, rows, (out * weights[order, None]).to(x.dtype))


class _AddRows(torch.autograd.Function):
    """`zeros_like(like).index_add_(0, index, src)` whose backward keeps only `index`: index_add_'s own keeps
    `src` alive for its shape alone (the weighted expert outputs, A·h elements per MoE layer, fp32 under autocast)."""

    @staticmethod
    def forward(ctx, like: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        return torch.zeros_like(like, dtype=src.dtype).index_add_(0, index, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return None, None, grad.index_select(0, index)


def add_rows(like: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """The experts' weighted rows `src` (A, H) summed per token into a tensor of `like`'s shape (N, H): row a goes
    to token `index[a]`, the tokens no row reaches stay 0 (the dispatches' last step)."""
    return _AddRows.apply(like, index, src)


@dataclasses.dataclass
class Routing:
    """One forward's routing: the kept assignments (token-major) and what the losses and metrics need."""

    tokens: torch.Tensor  # (A,) int64
    experts: torch.Tensor  # (A,) int64
    weights: torch.Tensor  # (A,) fp32
    counts: torch.Tensor  # (E,) assignments per expert before capacity
    dropped: torch.Tensor  # () assignments dropped by capacity
    aux: torch.Tensor  # () load-balancing loss (unscaled)
    z: torch.Tensor  # () router z-loss (unscaled)


def route(logits: torch.Tensor, cfg: ModelConfig, score_bias: torch.Tensor | None = None,
          token_groups=()) -> Routing:
    """Top-k routing of logits (N, E) (see the module doc): selection, weights, aux and z losses, capacity.

    `token_groups`: the process groups holding the other tokens of the same rows (context parallelism, tp
    under sequence parallelism). The aux loss is not linear in the token set: its f_i are then counted over
    all of them (one all-reduce of E numbers per group), while P_i stays this rank's mean, so that the mean of
    the ranks' aux losses (and of their gradients) is one process's aux loss of the whole rows. `counts`
    stays this rank's own (the metrics and the bias update sum it over their groups)."""
    N, E = logits.shape
    k = cfg.moe_top_k
    if cfg.moe_router == "softmax":
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(k, dim=-1)
    else:
        scores = logits.sigmoid()
        with torch.no_grad():  # the selection only picks indices: none of it is saved for backward
            select = scores if score_bias is None else scores + score_bias
            if cfg.moe_groups > 1:
                select = limit_to_groups(select, cfg.moe_groups, cfg.moe_topk_groups)
            chosen = select.topk(k, dim=-1).indices
        weights = scores.gather(1, chosen)
        probs = None  # s / Σ s, for the aux loss only (below)
    if cfg.moe_norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    if cfg.moe_routed_scale != 1.0:  # DeepSeek-V3's routed_scaling_factor (after the renormalisation)
        weights = weights * cfg.moe_routed_scale
    experts = chosen.reshape(-1)
    counts = torch.bincount(experts, minlength=E).to(torch.float32)
    share = counts / max(N * k, 1)  # f_i: each token has k assignments, so counts sum to N·k
    if token_groups:
        load = counts.clone()
        for group in token_groups:
            dist.all_reduce(load, group=group)
        share = load / load.sum().clamp_min(1)
    with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.moe_aux_loss > 0):  # else a metric only
        if probs is None:
            probs = scores / scores.sum(-1, keepdim=True)
        aux = E * (share * probs.mean(0)).sum()
    with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.moe_z_loss > 0):
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    tokens = torch.arange(N, device=logits.device).repeat_interleave(k)
    weights = weights.reshape(-1)
    dropped = torch.zeros((), device=logits.device)
    if cfg.moe_capacity_factor > 0:
        keep = capacity_mask(experts, weights.detach(), E, math.ceil(cfg.moe_capacity_factor * N * k / E))
        dropped = (~keep).sum().float()
        tokens, experts, weights = tokens[keep], experts[keep], weights[keep]
    return Routing(tokens, experts, weights, counts, dropped, aux, z)


def limit_to_groups(select: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: the selection scores (N, E) with every expert outside each token's
    `keep` best groups at -inf; a group of E/groups experts scores the sum of its two best selection scores."""
    N, E = select.shape
    group_scores = select.view(N, groups, E // groups).topk(2, dim=-1).values.sum(-1)  # (N, G)
    best = group_scores.topk(keep, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return select.masked_fill(~allowed.repeat_interleave(E // groups, dim=1), float("-inf"))


def capacity_mask(experts: torch.Tensor, weights: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """(A,) bool: assignment a (token-major order) is kept when fewer than `capacity` assignments to its expert
    rank before it by (higher weight first, then lower position a)."""
    order = torch.argsort(-weights, stable=True)  # by weight, ties in position order
    order = order[torch.argsort(experts[order], stable=True)]  # grouped by expert, each group by weight
    counts = torch.bincount(experts, minlength=n_experts)
    group_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(order), device=experts.device) - group_start[experts[order]]
    keep = torch.zeros_like(experts, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep


class MoE(nn.Module):
    """A block's MLP as a mixture of experts: routed experts (+ shared experts). `forward(x)` (B, T, H)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        shared = cfg.moe_shared_experts * cfg.expert_size
        if shared:
            self.shared = MLP(dataclasses.replace(cfg, ffn_hidden_size=shared, activation="swiglu", bias=False))
        else:
            self.shared = None
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.moe_shared_gate else None
        self.dispatch = LocalDispatch()
        # The process groups holding other tokens of this rank's rows, and this rank's weight of the aux and z
        # losses (1/tp under sequence parallelism, whose MoE gradients are summed over tp): `route`'s
        # `token_groups`; set by parallel/expert.py (none in one process).
        self.token_groups: tuple = ()
        self.aux_weight = 1.0
        self.aux_grad_scale = 1.0  # the trainer's loss scale / micro-batches (`set_aux_grad_scale`)
        self.stats: dict[str, torch.Tensor] | None = None  # summed since the last take_stats
        self.step_counts: torch.Tensor | None = None  # routed assignments per expert since the last bias update

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        r = route(self.router(flat), self.cfg, self.router.score_bias, self.token_groups if self.training else ())
        y = self.dispatch(flat, r.tokens, r.experts, r.weights, self.experts)
        if self.shared is not None:
            s = self.shared(flat)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(flat)) * s
            y = y + s
        if self.training and torch.is_grad_enabled():
            self._record(r, flat.shape[0])
            loss = (self.cfg.moe_aux_loss * r.aux + self.cfg.moe_z_loss * r.z) * self.aux_weight
            if loss.requires_grad:  # some coefficient > 0
                y = AuxLossGrad.apply(y, loss, self.aux_grad_scale)
        return y.reshape(shape)

    @torch.no_grad()
    def _record(self, r: Routing, n_tokens: int) -> None:
        new = {"counts": r.counts, "dropped": r.dropped, "aux": r.aux.detach() * n_tokens,
               "z": r.z.detach() * n_tokens, "tokens": torch.tensor(float(n_tokens), device=r.counts.device)}
        if self.stats is None:
            self.stats = new
        else:
            self.stats = {key: self.stats[key] + value for key, value in new.items()}
        self.step_counts = r.counts if self.step_counts is None else self.step_counts + r.counts

    def take_stats(self) -> dict[str, torch.Tensor] | None:
        stats, self.stats = self.stats, None
        return stats

    @torch.no_grad()
    def update_bias(self, groups=()) -> None:
        """The sigmoid router's bias after an optimizer step: += rate · sign(mean load − load), the load of the
        step's tokens summed over `groups` (the ranks that route different tokens through this layer's replicas:
        data parallel, and tp under sequence parallelism), so that every replica applies the same update."""
        counts, self.step_counts = self.step_counts, None
        if self.router.score_bias is None or counts is None:
            return
        counts = counts.clone()
        for group in groups:
            dist.all_reduce(counts, group=group)
        self.router.score_bias += self.cfg.moe_bias_rate * torch.sign(counts.mean() - counts)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, module) of every MoE layer of `model` (any wrapper around the plain modules)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def set_aux_grad_scale(model: nn.Module, scale: float) -> None:
    """The factor the auxiliary losses' gradients get: that of the LM loss (loss scale / micro-batches)."""
    for _, m in moe_layers(model):
        m.aux_grad_scale = scale


def update_router_bias(model: nn.Module, groups=()) -> None:
    """After each optimizer step: every sigmoid router's bias from the step's global load, summed over `groups`
    (`MoE.update_bias`)."""
    for _, m in moe_layers(model):
        m.update_bias(groups)
