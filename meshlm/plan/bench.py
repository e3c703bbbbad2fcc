"""`meshlm bench memory` (its parser: `commands/bench.py`): measured activation memory per layer beside the
formula, and model states.

Builds the model as training does (whole from the seed, `parallelize`: tensor parallelism, then
recomputation), runs one forward and loss on a micro-batch of random tokens under the saved-tensor counter
(`models.activations`) and prints, on rank 0, each layer's measured bytes next to `core.memory`'s formula,
the formula's terms, and the bytes of weights, gradients and the optimizer's states (`optim.name`'s) per
rank. Under context parallelism (`parallel.cp` > 1, under torchrun) every cp rank measures its share of the
rows and the report lists each rank's layers beside `activation_bytes_per_rank`, with the ring's transient
buffers and the bytes a rank sends per layer (`ring_buffer_bytes`, `ring_send_bytes`: formulas;
`benchmarks/context_parallel.py` counts the sends).
"""

from __future__ import annotations

import dataclasses

import torch

from meshlm.core.config import Config, ConfigError
from meshlm.core.memory import (
    activation_bytes_per_rank,
    activation_dtypes,
    activation_terms,
    attention_backend,
    korthikanti_bytes,
    model_state_bytes,
    mtp_activation_bytes,
    mtp_activation_terms,
    ring_send_bytes,
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
    # multi-token prediction (models/mtp.py): its modules measured as rows of their own, after the layers, and the
    # model's own loss, which runs them, as the trainer computes it
    mtp = list(getattr(model, "mtp", None) or ())
    report = measure_model_activations(model, loss_fn, t.micro_batch_size, m.seq_len, m.vocab_size,
                                       precision.autocast(), rng, fused_loss=bool(mtp) or (use_fused_loss(cfg, dims.device)
                                       and p.tp == 1 and spec.fused_loss), example=spec.example_batch,
                                       layers=[*getattr(model, spec.pipeline.layers), *mtp])
    cp_layers = _gather_cp_layers(report.layers_total, dims) if p.cp > 1 else []
    if not dims.is_main:
        return ""
    device_type = dims.device.type
    dtypes, backend = activation_dtypes(precision.name, device_type), attention_backend(device_type, m.dropout)
    formula = spec.activation_bytes(cfg, dtypes=dtypes, backend=backend)
    formula += mtp_activation_bytes(cfg, dtypes=dtypes, backend=backend) if mtp else []
    mode = t.recompute + (f" ({t.recompute_method}, recompute_num_layers={t.recompute_num_layers})"
                          if t.recompute == "full" else "")
    title = (f"activation memory, one micro-batch: b={t.micro_batch_size} s={m.seq_len} h={m.hidden_size} "
             f"a={m.n_heads} g={m.kv_heads} f={m.ffn_size}, {m.activation}, {m.norm}, {m.position} positions, "
             f"dropout {m.dropout}; tp={p.tp} sp={p.sp} cp={p.cp}; recompute {mode}; {precision.name} on {device_type} "
             f"({'ring attention' if p.cp > 1 else f'SDPA {backend} backend'}); rank 0 of {dims.world_size}")
    lines = [title, "", "| layer | measured bytes | formula bytes | measured / formula |", "|---|---|---|---|"]
    for i, (got, want) in enumerate(zip(report.per_layer, formula)):
        label = i if i < m.n_layers else f"mtp {i - m.n_layers + 1}"  # mtp_activation_bytes: norms, merge, block
        lines.append(f"| {label} | {got:,} | {want:,.0f} | {got / want if want else float('nan'):.3f} |")
    outside = (f"outside the layers (embedding, final norm, head, loss): {report.outside_bytes:,} bytes; "
               f"autocast copies of weights: {report.param_copy_bytes:,} bytes")
    total = f"| all | {report.layers_total:,} | {sum(formula):,.0f} | {report.layers_total / sum(formula):.3f} |"
    lines += [total, "", outside, ""]
    if cp_layers:
        lines += _cp_lines(cfg, spec, cp_layers, formula, dtypes, backend)
    moe = m.moe_layers() > 0  # the terms of a MoE layer (models/moe.py), of a local one if any is (its band mask)
    local = any(m.layer_window(i) > 0 for i in range(m.n_layers))
    lines.append(f"formula terms of a stored {'MoE ' if moe else ''}{'sliding-window ' if local else ''}layer (bytes):")
    terms = activation_terms(m, t.micro_batch_size, p.tp, p.sp, "none" if t.recompute == "full" else t.recompute,
                             dtypes, backend, cp=p.cp, moe=moe, local=local)
    lines += [f"  {name}: {value:,.0f}" for name, value in terms.items()]
    if mtp:  # the first module's (a later one keeps no hnorm input: the previous module's output norm keeps it)
        lines.append("formula terms of multi-token prediction module 1 (bytes):")
        mode = t.recompute if t.recompute != "full" or not t.recompute_num_layers else "none"
        lines += [f"  {name}: {value:,.0f}" for name, value in mtp_activation_terms(
            m, t.micro_batch_size, 1, p.tp, p.sp, mode, dtypes, backend, cp=p.cp,
            head_keeps_h=p.tp > 1 and dtypes.compute >= dtypes.residual).items()]
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


def _gather_cp_layers(layers_total: int, dims) -> list[int]:
    """Every cp rank's bytes saved in the layers, by cp rank (on every rank: the gather is collective)."""
    import torch.distributed as dist

    got = [0] * dims.cp
    dist.all_gather_object(got, layers_total, group=dims.cp_group)
    return got


def _cp_lines(cfg: Config, spec, cp_layers: list[int], formula: list[float], dtypes, backend: str) -> list[str]:
    """The cp ranks' measured layers beside the formula at s/cp tokens (`activation_bytes_per_rank`'s
    `layers`: the family's per-layer bytes under `parallel.cp`) and at cp = 1, and the ring's formulas."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    want = sum(formula)
    whole = sum(spec.activation_bytes(dataclasses.replace(cfg, parallel=dataclasses.replace(p, cp=1)),
                                      dtypes=dtypes, backend=backend))
    lines = [(f"context parallelism: {p.cp} ranks, {m.seq_len // p.cp} of the {m.seq_len} tokens of each row on each; "
             f"formula for the layers of one process (cp=1): {whole:,.0f} bytes"), "",
             "| cp rank | measured bytes in layers | formula bytes | measured / formula | measured / formula at cp=1 |",
             "|---|---|---|---|---|"]
    lines += [f"| {r} | {got:,} | {want:,.0f} | {got / want:.3f} | {got / whole:.3f} (1/cp = {1 / p.cp:.3f}) |"
              for r, got in enumerate(cp_layers)]
    b = t.micro_batch_size
    buffers = activation_bytes_per_rank(m, b, 1, p.tp, p.sp, "none", dtypes, backend, cp=p.cp)
    sent = ring_send_bytes(m, b, p.tp, p.cp, dtypes)
    lines += ["", (f"ring, per rank (formulas): transient buffers {buffers['total'] - buffers['layers']:,.0f} bytes "
              f"(ring_buffer_bytes: once per rank, not saved for backward); sent per layer and micro-batch "
              f"{sent['forward']:,.0f} bytes forward ({p.cp - 1} K/V blocks), {sent['backward']:,.0f} backward "
              f"({p.cp - 1} K/V blocks, {p.cp} dK/dV blocks) (ring_send_bytes; benchmarks/context_parallel.py counts "
              "the sends)"), ""]
    return lines
