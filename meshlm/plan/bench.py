"""`meshlm bench memory`: measured activation memory per layer beside the formula, and model states.

    meshlm bench memory --config llama-tiny --train.recompute=selective
    torchrun --nproc-per-node 2 -m meshlm bench memory --config gpt-tiny --parallel.tp=2 --parallel.sp=true

Builds the model as training does (whole from the seed, `parallelize`: tensor parallelism, then
recomputation), runs one forward and loss on a micro-batch of random tokens under the saved-tensor counter
(`plan.activations`) and prints, on rank 0, each layer's measured bytes next to `plan.memory`'s formula,
the formula's terms, and the bytes of weights, gradients and the optimizer's states (`optim.name`'s) per
rank.
"""

from __future__ import annotations

import argparse

from meshlm.config import DEFAULT_CONFIG, Config, ConfigError, bundled_configs


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measurements of this build (meshlm bench memory)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    memory = kinds.add_parser("memory", help="activation bytes saved for backward per layer, measured and by "
                                             "formula; extra --section.key=value override the config")
    memory.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"bundled name ({', '.join(bundled_configs())}) or path to a .toml file")
    memory.set_defaults(func=_bench_memory)


def _bench_memory(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.config import load_config
    from meshlm.parallel import destroy
    from meshlm.plan.fit import check_bench_fits

    cfg = load_config(args.config, overrides)
    check_bench_fits(cfg)
    try:
        text = bench_memory(cfg)
    except BaseException:
        destroy()
        raise
    destroy(wait_for_all=True)
    if text:
        print(text)
    return 0


def bench_memory(cfg: Config) -> str:
    """The report (on rank 0; "" elsewhere). Every rank of the layout must call it."""
    import torch

    from meshlm.models.loss import use_fused_loss
    from meshlm.models.registry import get_spec
    from meshlm.parallel import TPRNGTracker, build_model, init_distributed
    from meshlm.plan.activations import measure_model_activations
    from meshlm.plan.memory import (
        activation_dtypes,
        activation_terms,
        attention_backend,
        korthikanti_bytes,
        model_state_bytes,
        muon_fraction,
    )
    from meshlm.train.precision import Precision, resolve_precision

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
    states = model_state_bytes(local, "fp32", cfg=cfg)  # the optimizer's states: optim.name's (Muon: fewer)
    optimizer = "Adam" if cfg.optim.name != "muon" else \
        f"Muon + AdamW, {100 * muon_fraction(cfg):.1f}% of parameters in Muon's hidden matrices"
    lines.append(f"model states on this rank: {local:,} parameters (model {spec.parameter_count(m):,}) × "
                 f"{states['total'] / max(1, local):.2f} B = {states['total'] / 2 ** 20:,.1f} MiB (weights "
                 f"{states['weights'] / 2 ** 20:,.1f}, grads {states['grads'] / 2 ** 20:,.1f}, {optimizer} "
                 f"{states['optimizer'] / 2 ** 20:,.1f})")
    return "\n".join(lines)
