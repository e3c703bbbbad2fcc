"""Will it fit? Bytes a run needs per process, from `core.memory`'s formulas and the family's counts, against
this machine's memory (`core.fit`).

`meshlm train`, `meshlm generate`, `meshlm serve` and `meshlm bench memory` call these before they allocate
anything, so that `model.n_layers=10**9` or `model.hidden_size=10**7` stop at once with one line instead of
building layers until the OOM killer comes. The estimates leave out the runtime, the allocator's slack and
the data, so they are lower bounds: a run is refused only when even they exceed the memory, never because
it might not fit.
"""

from __future__ import annotations

import os

from meshlm.core.config import Config, ModelConfig
from meshlm.core.fit import check_fits, device_type_of
from meshlm.core.memory import model_state_bytes_per_param, mtp_activation_bytes, pipeline_activation_factor
from meshlm.families.registry import get_spec, muon_share


def training_bytes(cfg: Config, world_size: int | None = None, device_type: str = "cpu") -> dict[str, float]:
    """Per process: fp32 weights, gradients and the optimizer's states (16 B/param with Adam, less under
    `optim.name=muon`: `model_state_bytes_per_param`), split by tp × pp and, with ZeRO, over dp; and the
    activations one pipeline stage holds in flight."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    world = world_size or int(os.environ.get("WORLD_SIZE", "1") or 1)
    dp = p.dp or max(1, world // (p.tp * p.pp))
    per = model_state_bytes_per_param("fp32", dp, distributed_optimizer=p.zero >= 1, muon_share=muon_share(cfg))
    if p.zero >= 2:
        per["grads"] /= dp
    if p.zero >= 3:
        per["weights"] /= dp
    local = family_parameter_count(m) / (p.tp * p.pp)
    out = {name: value * local for name, value in per.items()}
    micro_batches = max(1, t.global_batch_size // (t.micro_batch_size * dp))
    layers = _all_layers_activation_bytes(cfg, device_type) / p.pp
    out["activations"] = layers * pipeline_activation_factor(p.pp, micro_batches, p.vpp)
    return out



def family_parameter_count(m: ModelConfig) -> int:
    """The model family's own parameter count (`ModelSpec.parameter_count`); an unknown `model.family` is
    the usual one-line error."""
    return get_spec(m.family).parameter_count(m)



def _all_layers_activation_bytes(cfg: Config, device_type: str) -> float:
    """The family's `activation_bytes` summed (0 for a family without a formula: still a lower bound),
    without a list of n_layers entries for absurd n_layers (then a lower bound: every layer saves at least
    what the first layer of a recomputed region does), and the multi-token prediction modules'."""
    layer_activation_bytes = get_spec(cfg.model.family).activation_bytes
    if layer_activation_bytes is None:
        return 0.0
    n = cfg.model.n_layers
    mtp = sum(mtp_activation_bytes(cfg, device_type=device_type)) if cfg.model.mtp_depth else 0.0
    if n <= 100_000:
        return sum(layer_activation_bytes(cfg, device_type=device_type)) + mtp
    return min(layer_activation_bytes(cfg, n_layers=1, device_type=device_type)) * n + mtp



def weights_bytes(m: ModelConfig, tp: int = 1) -> float:
    return 4.0 * family_parameter_count(m) / tp



def check_training_fits(cfg: Config) -> None:
    device = device_type_of(cfg)
    check_fits(training_bytes(cfg, device_type=device), "training this model",
               "make the model smaller (model.n_layers, model.hidden_size, model.vocab_size, model.seq_len), "
               "lower train.micro_batch_size, set train.recompute=full, or spread it over more processes "
               "(parallel.tp, parallel.pp, parallel.zero with dp)", device)



def check_bench_fits(cfg: Config) -> None:
    """`meshlm bench memory`: the weights and one micro-batch's activations (no gradients, no optimizer)."""
    device = device_type_of(cfg)
    needed = {"weights": weights_bytes(cfg.model, cfg.parallel.tp),
              "activations": _all_layers_activation_bytes(cfg, device)}
    check_fits(needed, "measuring this model", "make the model smaller (model.n_layers, model.hidden_size), "
               "lower train.micro_batch_size or model.seq_len, or spread it with parallel.tp", device)
