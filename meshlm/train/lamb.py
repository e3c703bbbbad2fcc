"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes").

Adam's update, then rescaled per parameter tensor by a trust ratio so that every layer moves by a step
proportional to its own weight norm:

    m ← β1·m + (1−β1)·g             v ← β2·v + (1−β2)·g²
    m̂ = m / (1−β1^t)                v̂ = v / (1−β2^t)          (bias_correction=False: m̂ = m, v̂ = v)
    u = m̂ / (√v̂ + eps) + wd·w
    r = ‖w‖ / ‖u‖  if both norms are > 0, else 1
    w ← w − lr·r·u

The step runs on whole groups with `torch._foreach_*` ops and never synchronises with the device: the
trust ratios come from one stacked tensor of 2n squared norms ([‖w_0‖², …, ‖w_{n−1}‖², ‖u_0‖², …,
‖u_{n−1}‖²] over the n parameters stepped, every group in order) and `torch.where`. That tensor goes
through one optional `reduce_squares(squares, params)` call per step, where a parallel layout sums the
squares of tensor-parallel shards over their group so the ratio is that of the whole parameter
(docs/optim.md). Flat ZeRO shards are not parameters: LAMB needs whole (or tp-sharded) tensors.

State per parameter, under Adam's names so checkpoints treat both alike: `step` (a CPU float32 scalar,
as torch's AdamW keeps it; read on the host without touching the device), `exp_avg`, `exp_avg_sq` (the
parameter's dtype and device).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

ReduceSquares = Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]


class Lamb(torch.optim.Optimizer):
    """LAMB over `params` (tensors or param groups; per group: lr, betas, eps, weight_decay,
    bias_correction). `reduce_squares(squares, params) -> squares`: see the module docstring; None keeps
    the local norms (right whenever every parameter is whole on this rank)."""

    config_name = "lamb"  # its `optim.name` (named in checkpoint errors)

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 bias_correction: bool = True, reduce_squares: ReduceSquares | None = None):
        if not 0.0 <= lr:
            raise ValueError(f"Lamb: invalid learning rate {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Lamb: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: invalid betas {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Lamb: invalid weight_decay {weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction}
        super().__init__(params, defaults)
        self.reduce_squares = reduce_squares  # not a group option: it is not saved in state_dict

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _updates(self, group: dict, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Advance the moments of `params` (all with gradients) and return Adam's update u for each."""
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):
            raise RuntimeError("Lamb does not support sparse gradients")
        states = [self._state(p) for p in params]
        ms = [s["exp_avg"] for s in states]
        vs = [s["exp_avg_sq"] for s in states]
        steps = []
        for s in states:
            s["step"] += 1
            steps.append(float(s["step"]))  # a CPU tensor: no device synchronisation

        torch._foreach_mul_(ms, beta1)
        torch._foreach_add_(ms, grads, alpha=1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)

        eps = group["eps"]
        if group["bias_correction"]:
            updates = torch._foreach_div(ms, [1 - beta1 ** t for t in steps])  # m̂
            denom = torch._foreach_div(vs, [1 - beta2 ** t for t in steps])  # v̂
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, eps)
            torch._foreach_div_(updates, denom)  # m̂ / (√v̂ + eps)
        else:
            denom = torch._foreach_sqrt(vs)
            torch._foreach_add_(denom, eps)
            updates = torch._foreach_div(ms, denom)  # m / (√v + eps)
        del denom
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        return updates

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        stepped: list[tuple[dict, list[torch.Tensor], list[torch.Tensor]]] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                stepped.append((group, params, self._updates(group, params)))
        if not stepped:
            return loss

        params = [p for _, ps, _ in stepped for p in ps]
        updates = [u for _, _, us in stepped for u in us]
        n = len(params)
        acc = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        norms = torch._foreach_norm(params, 2, dtype=acc) + torch._foreach_norm(updates, 2, dtype=acc)
        squares = torch.stack(norms).square()
        if self.reduce_squares is not None:
            squares = self.reduce_squares(squares, params)
            if tuple(squares.shape) != (2 * n,):
                raise RuntimeError(f"Lamb: reduce_squares returned shape {tuple(squares.shape)}, "
                                   f"expected ({2 * n},)")
        w_norm, u_norm = squares[:n].sqrt(), squares[n:].sqrt()
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))

        start = 0
        for group, ps, us in stepped:
            scale = ratio[start:start + len(ps)] * -group["lr"]  # −lr·r, one 0-dim tensor per parameter
            start += len(ps)
            torch._foreach_addcmul_(ps, us, list(scale.unbind()))  # w ← w + u·(−lr·r)
        return loss
