"""`meshlm bench memory` (its parser: `commands/bench.py`): measured activation memory per layer beside the
formula, and model states.

Builds the model as training does (whole from the seed, `parallelize`: tensor parallelism, then
recomputation), runs one forward and loss on a micro-batch of random tokens under the saved-tensor counter
(`models.activations`) and prints, on rank 0, each layer's measured bytes next to `core.memory`'s formula,
the formula's terms, and the bytes of weights, gradients and the optimizer's states (`optim.name`'s) per
rank.
"""

from __future__ import annotations

import torch

from meshlm.core.config import Config, ConfigError
from meshlm.core.memory import (
    activation_dtypes,
    activation_terms,
    attention_backend,
    korthikanti_bytes,
    model_state_bytes,
)
from meshlm.core.precision import Precision, resolve_precision
from meshlm.families.registry import get_spec, muon_share
from meshlm.models.activations import measure_model_activations
from meshlm.models.loss import use_fused_loss
from meshlm.parallel import TPRNGTracker, build_model, init_distributed


def bench_memory(cfg: Config) -> str:
    """The report (on rank 0; "" elsewhere). Every rank of the layout must call it."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if p.pp > 1 or p.dp > 1:
        raise ConfigError(f"meshlm bench memory measures one tensor-parallel model; set parallel.pp=1 and "
                          f"parallel.dp=1 (got {p.pp} and {p.dp}): a layer saves the same bytes in any pipeline "
                          "stage or data-parallel replica (a stage holds min(pp, micro-batches) of them in 1F1B)")
    dims = init_distributed(p, torch.device("cpu") if t.device == "cpu" else None)
    torch.manual_seed(t.seed)
    spec = get_spec(m.family)
    rng = TPRNGTracker(t.seed, dims.tp_rank, dims.device)
    par = build_model(cfg, dims, rng=rng, spec=spec)  # meta-built: this rank allocates only its shards
    model, loss_fn = par.model, par.loss_fn
    precision = Precision(resolve_precision(t.precision, dims.device, m.hidden_size)[0], dims.device)
    report = measure_model_activations(model, loss_fn, t.micro_batch_size, m.seq_len, m.vocab_size,
                                       precision.autocast(), rng, fused_loss=use_fused_loss(cfg, dims.device)
                                       and p.tp == 1 and spec.fused_loss, example=spec.example_batch)
    if not dims.is_main:
        return ""
    device_type = dims.device.type
    dtypes, backend = activation_dtypes(precision.name, device_type), attention_backend(device_type, m.dropout)
    formula = spec.activation_bytes(cfg, dtypes=dtypes, backend=backend)
    mode = t.recompute + (f" ({t.recompute_method}, recompute_num_layers={t.recompute_num_layers})"
                          if t.recompute == "full" else "")
    title = (f"activation memory, one micro-batch: b={t.micro_batch_size} s={m.seq_len} h={m.hidden_size} "
             f"a={m.n_heads} g={m.kv_heads} f={m.ffn_size}, {m.activation}, {m.norm}, {m.position} positions, "
             f"dropout {m.dropout}; tp={p.tp} sp={p.sp}; recompute {mode}; {precision.name} on {device_type} "
             f"(SDPA {backend} backend); rank 0 of {dims.world_size}")
    lines = [title, "", "| layer | measured bytes | formula bytes | measured / formula |", "|---|---|---|---|"]
    for i, (got, want) in enumerate(zip(report.per_layer, formula)):
        lines.append(f"| {i} | {got:,} | {want:,.0f} | {got / want if want else float('nan'):.3f} |")
    outside = (f"outside the layers (embedding, final norm, head, loss): {report.outside_bytes:,} bytes; "
               f"autocast copies of weights: {report.param_copy_bytes:,} bytes")
    total = f"| all | {report.layers_total:,} | {sum(formula):,.0f} | {report.layers_total / sum(formula):.3f} |"
    lines += [total, "", outside, "", "formula terms of a stored layer (bytes):"]
    terms = activation_terms(m, t.micro_batch_size, p.tp, p.sp, "none" if t.recompute == "full" else t.recompute,
                             dtypes, backend)
    lines += [f"  {name}: {value:,.0f}" for name, value in terms.items()]
    paper = korthikanti_bytes(m.seq_len, t.micro_batch_size, m.hidden_size, m.n_heads, p.tp, p.sp,
                              t.recompute if t.recompute != "full" else "full")
    lines.append(f"Korthikanti et al. 2022 Table 2 for this shape (16-bit, dropout, GeLU, MHA): {paper:,.0f} "
                 "bytes/layer")
    local = sum(q.numel() for q in model.parameters())
    # the optimizer's states: optim.name's (Muon: fewer)
    states = model_state_bytes(local, "fp32", muon_share=muon_share(cfg))
    optimizer = "Adam" if cfg.optim.name != "muon" else \
        f"Muon + AdamW, {100 * muon_share(cfg):.1f}% of parameters in Muon's hidden matrices"
    lines.append(f"model states on this rank: {local:,} parameters (model {spec.parameter_count(m):,}) × "
                 f"{states['total'] / max(1, local):.2f} B = {states['total'] / 2 ** 20:,.1f} MiB (weights "
                 f"{states['weights'] / 2 ** 20:,.1f}, grads {states['grads'] / 2 ** 20:,.1f}, {optimizer} "
                 f"{states['optimizer'] / 2 ** 20:,.1f})")
    return "\n".join(lines)
