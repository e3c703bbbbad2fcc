"""The GRPO family's losses on tensors alone (no model): group-relative advantages, the clipped
importance-ratio objective, the k3 KL penalty and the loss types' normalisations, with TRL's definitions
(`GRPOTrainer`, `RLOOTrainer`; tests/tune/test_grpo_trl.py checks them against TRL).

Notation: a batch holds B = P·G completions, G per prompt, consecutive (prompt p owns rows p·G … p·G+G−1);
per-token tensors are (B, T) with `mask` 1 on the completion's tokens. π, π_old and π_ref are the per-token
log-probabilities of the sampled tokens under the policy being trained, the policy that sampled them, and
the frozen reference.

Advantages (GRPO, `group_advantages`): A_i = r_i − mean_group(r), divided by std + 1e-4 unless
scale_rewards="none"; std is the group's (scale_rewards="group") or the whole batch's ("batch"), both with
Bessel's correction (TRL's `nanstd`). RLOO (`rloo_advantages`): A_i = r_i − mean of the group's other G−1
rewards, then optionally whitened over the batch.

Per token (GRPO): ρ = exp(π − π_old); loss_t = −min(ρ·A, clip(ρ, 1−ε, 1+ε_high)·A) + β·KL_t with the k3
estimator KL_t = exp(π_ref − π) − (π_ref − π) − 1 (always ≥ 0). Clip-higher (DAPO) is ε_high > ε.

Normalisations of Σ loss_t over the batch:
* grpo: each completion's mean over its tokens, then the mean over completions;
* bnpo: the mean over every completion token of the (micro-)batch;
* dr_grpo: the sum over tokens divided by B · max_completion_length (a constant: no length bias);
* dapo: the sum over tokens divided by the completion tokens of the whole generation batch (`num_tokens`),
  so micro-batches of one step add up to a token-level mean.

RLOO (TRL's `RLOOTrainer`): one ratio per sequence, ρ = exp(Σ_t π − Σ_t π_old); loss = mean over completions
of −min(ρ·A, clip(ρ)·A); its KL is a reward penalty, r − β·Σ_t (π_old − π_ref) (`rloo_kl_rewards`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "rloo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # added to the std before dividing (TRL's)


@dataclass(frozen=True)
class LossSettings:
    """A loss type and its constants (TRL's names): `epsilon_high` None means equal to `epsilon`."""

    loss_type: str = "grpo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    max_completion_length: int = 256  # dr_grpo's constant denominator

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def sample_std(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation with Bessel's correction (n − 1) over `dim` (all elements when None), NaNs
    (unscored completions) left out."""
    keep = ~torch.isnan(x)
    mean = torch.nanmean(x) if dim is None else torch.nanmean(x, dim=dim, keepdim=True)
    sq = torch.where(keep, (x - mean) ** 2, torch.zeros_like(x))
    n = keep.sum() if dim is None else keep.sum(dim=dim)
    total = sq.sum() if dim is None else sq.sum(dim=dim)
    return torch.sqrt(total / (n - 1))


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group"):
    """GRPO's advantages of (B,) `rewards` in groups of `group_size`: (advantages (B,), zero_std (B,) bool,
    the std each row was judged by). `zero_std` marks rows whose std is 0 (a group that teaches nothing). A NaN
    reward (a completion no reward could score) is left out of its group's mean and std, and its advantage is 0."""
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    if scale_rewards == "batch":
        std = sample_std(rewards).expand_as(rewards)
    else:  # "group", and "none" (whose std only marks zero-variance groups)
        std = sample_std(grouped, dim=1).repeat_interleave(group_size)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std)), std


def rloo_advantages(rewards: torch.Tensor, group_size: int, normalize: bool = False) -> torch.Tensor:
    """RLOO's advantages: each reward minus the mean of the other G−1 of its group; `normalize` whitens them
    over the batch (mean 0, std 1, + 1e-4)."""
    grouped = rewards.view(-1, group_size)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    advantages = rewards - baseline.reshape(-1)
    if normalize:
        advantages = (advantages - advantages.mean()) / (sample_std(advantages) + STD_EPS)
    return advantages


def rloo_kl_rewards(rewards: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor,
                    beta: float) -> torch.Tensor:
    """RLOO's KL as a reward penalty: r − β·Σ_t (π_old − π_ref) over each completion's tokens."""
    return rewards - beta * ((old_logps - ref_logps) * mask).sum(-1)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π‖π_ref) per token: exp(π_ref − π) − (π_ref − π) − 1."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


@dataclass
class LossParts:
    """What one loss evaluation gives besides the loss: per-token ratios and KL, and the metrics."""

    ratio: torch.Tensor  # (B, T) for the GRPO types, (B, 1) for rloo
    kl: torch.Tensor | None  # (B, T) k3 KL (None when β = 0 or rloo)
    metrics: dict[str, float]


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    if x.shape[1] == 1:  # one value per sequence
        return float(x.mean())
    return float((x * mask).sum() / mask.sum().clamp(min=1.0))


def clip_metrics(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, s: LossSettings) -> dict:
    """TRL's clip fractions: low (ρ < 1−ε where A < 0), high (ρ > 1+ε_high where A > 0), and either (region),
    as means over the completion tokens (over completions for rloo)."""
    low = (ratio < 1 - s.epsilon) & (advantages < 0)
    high = (ratio > 1 + s.high) & (advantages > 0)
    return {"clip_ratio/low_mean": _masked_mean(low.float(), mask),
            "clip_ratio/high_mean": _masked_mean(high.float(), mask),
            "clip_ratio/region_mean": _masked_mean((low | high).float(), mask)}


def _normalise(per_token: torch.Tensor, mask: torch.Tensor, s: LossSettings, num_tokens) -> torch.Tensor:
    """Σ over the batch of the masked per-token loss, normalised as `s.loss_type` says (module docstring)."""
    masked = per_token * mask
    if s.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if s.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if s.loss_type == "dr_grpo":
        return masked.sum() / (per_token.shape[0] * s.max_completion_length)
    if s.loss_type == "dapo":
        total = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=per_token.dtype)
        return masked.sum() / total.clamp(min=1.0)
    raise ValueError(f"unknown loss type {s.loss_type!r}; one of {', '.join(LOSS_TYPES)}")


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None, mask: torch.Tensor,
              advantages: torch.Tensor, s: LossSettings, num_tokens=None) -> tuple[torch.Tensor, LossParts]:
    """The loss of one (micro-)batch and its parts. logps: (B, T) the policy's, differentiable; old_logps,
    ref_logps: (B, T) constants (ref_logps needed when β > 0); mask: (B, T) 0/1; advantages: (B,).
    `num_tokens`: dapo's denominator, the completion tokens of the whole generation batch (default: this
    batch's)."""
    if s.loss_type == "rloo":
        return rloo_loss(logps, old_logps, mask, advantages, s)
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - s.epsilon, 1 + s.high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if s.beta != 0.0:
        kl = k3_kl(logps, ref_logps)
        per_token = per_token + s.beta * kl
    loss = _normalise(per_token, mask, s, num_tokens)
    metrics = clip_metrics(ratio.detach(), adv, mask, s)
    if kl is not None:
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    return loss, LossParts(ratio.detach(), None if kl is None else kl.detach(), metrics)


def rloo_loss(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
              s: LossSettings) -> tuple[torch.Tensor, LossParts]:
    """RLOO's sequence-level clipped loss (TRL's `RLOOTrainer`): old_logps (B, T) per token, summed here."""
    mask = mask.to(logps.dtype)
    log_ratio = (logps * mask).sum(1) - (old_logps * mask).sum(1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - s.epsilon, 1 + s.high)
    loss = (-torch.min(ratio * advantages, clipped * advantages)).mean()
    r = ratio.detach().unsqueeze(1)
    return loss, LossParts(r, None, clip_metrics(r, advantages.unsqueeze(1), mask, s))


def advantage_metrics(rewards: torch.Tensor, advantages: torch.Tensor, zero_std: torch.Tensor,
                      group_size: int) -> dict[str, float]:
    """Reward and advantage statistics of a generation batch (NaN rewards, unscored, left out), and the share of
    its groups whose rewards are all equal (zero std: no signal)."""
    groups = zero_std.view(-1, group_size)[:, 0]
    return {"reward": float(torch.nanmean(rewards)),
            "reward_std": float(sample_std(rewards)) if rewards.numel() > 1 else 0.0,
            "advantage_mean": float(advantages.mean()),
            "advantage_std": float(sample_std(advantages)) if advantages.numel() > 1 else 0.0,
            "frac_reward_zero_std": float(groups.float().mean())}
