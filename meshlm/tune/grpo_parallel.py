"""`torchrun … meshlm align --method grpo|rloo --parallel.tp=N | --parallel.pp=N | --parallel.dp=N --parallel.zero=Z`:
GRPO and RLOO (`tune/grpo.py`) under meshlm's parallel layouts, equal to one process (docs/align.md, "Parallel
layouts"; tests/tune/test_grpo_parallel.py).

How each layout splits a step of P prompts × G completions:
* **dp** (`parallel.dp`, with ZeRO 0–2 over it): dp rank r rolls out and trains on prompts [r·P/dp, (r+1)·P/dp)
  of the step: whole groups, so its advantages need no other rank's rewards; the sampling seeds stay those of the
  global rows (the engine's sampler shifted by the rank's first row), so the rollouts are one process's. The
  rewards (and RLOO's KL penalties) are all-gathered over dp before the advantages, so `--scale-rewards batch`
  and every metric see the whole batch. Each rank's loss is normalised so that their mean (the gradient
  all-reduce's) is the one-process loss: the mean over sequences (grpo, rloo) and the constant denominator
  (dr_grpo) need nothing; bnpo and dapo divide by the completion tokens of the whole batch (all-reduced) / dp.
  Gradients are reduced by meshlm's bucketed data parallelism (`parallel/buckets.py`), ZeRO-1/2 shards included.
* **tp**: every tp rank runs its own `Engine` over its shards in lockstep (the runner all-gathers the
  vocab-split logits, so every rank samples the same tokens from the same seeds and schedules the same steps):
  the smaller change than serve's rank-0-schedules loop, which would need the sampled tokens sent back anyway.
  The trainer's log-probs of the sampled tokens come from the vocab-split logits (`vocab_parallel_logps`).
* **pp** (dp = 1; tp × pp allowed): rollouts run serve's pipeline runner (`infer/pipeline_runner.py`): rank 0
  runs the engine and the other ranks replay its steps; the completions are then broadcast. The loss runs as a
  plain stage-by-stage forward (the residual stream sent down the pipeline, the last stage computing the
  log-probs and the loss) and backward (the stream's gradient sent back up): one micro-batch, no schedule.

Metrics are the one-process ones (reduced over the ranks); rank 0 writes metrics.jsonl, DIR/grpo_state.pt (every
rank's trained shards and optimizer state, gathered: resuming needs the same layout and is exact) and the final
checkpoint (the whole model, gathered, in the one-process format). Not supported yet, each refused with a
ConfigError: `--adapter lora`, `--off-policy-lag` > 0, `--dynamic-sampling`, dp × pp, parallel.zero=3,
sp, cp, ep and vpp.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.core.config import ConfigError
from meshlm.core.console import say
from meshlm.parallel.pipeline import rank_at
from meshlm.parallel.tensor_layers import reduce_from_tensor_region
from meshlm.tune import grpo
from meshlm.tune import grpo_loss as gl
from meshlm.tune import grpo_rollouts as gr

LAYOUT_KEYS = ("tp", "pp", "dp", "zero", "timeout_s", "bucket_mb")


def layout_overrides(overrides: list[str]) -> dict:
    """The `--parallel.key=value` overrides GRPO takes, as {key: number}; any other parallel key is a ConfigError."""
    out = {}
    for o in overrides:
        key, _, value = o.removeprefix("--").partition("=")
        if not key.startswith("parallel."):
            continue
        name = key.removeprefix("parallel.")
        if name not in LAYOUT_KEYS or not value:
            raise ConfigError(f"--method grpo|rloo takes --parallel.{{{', '.join(LAYOUT_KEYS)}}}=N, not {o!r}; drop it")
        try:
            out[name] = float(value) if name in ("timeout_s", "bucket_mb") else int(value)
        except ValueError:
            raise ConfigError(f"{o}: give a number") from None
    return out


def wanted(overrides: list[str]) -> bool:
    """Whether this run is parallel: launched by torchrun on several ranks, or given a --parallel.* override."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or any(o.removeprefix("--").startswith("parallel.")
                                                               for o in overrides)


def check_layout(layout: dict, opts: grpo.Options, adapter: str, world: int) -> tuple[int, int, int]:
    """(tp, pp, dp) of this world, or a ConfigError naming what the parallel GRPO does not run."""
    from meshlm.core.layout import factor_world

    pp_, dp_, tp_ = factor_world(world, layout.get("tp", 1), layout.get("pp", 1), layout.get("dp", 0), 1)
    if adapter != "none":
        raise ConfigError("--adapter lora runs GRPO in one process only for now; drop --adapter or the parallel layout")
    if pp_ > 1 and dp_ > 1:
        raise ConfigError(f"--parallel.pp={pp_} with dp={dp_}: GRPO runs pipeline parallelism with dp = 1 only; "
                          f"launch {pp_ * tp_} processes")
    if opts.off_policy_lag or opts.dynamic_sampling:
        raise ConfigError("--off-policy-lag and --dynamic-sampling run GRPO in one process only for now; drop them or "
                          "the parallel layout")
    if layout.get("zero", 0) == 3:
        raise ConfigError("--parallel.zero=3 is not supported by GRPO; use 0, 1 or 2")
    if opts.prompts_per_step % dp_:
        raise ConfigError(f"--prompts-per-step {opts.prompts_per_step} must be a multiple of dp={dp_}: each "
                          "data-parallel rank takes whole groups")
    return tp_, pp_, dp_


def layout_config(checkpoint, layout: dict, dims_: tuple[int, int, int], rows: int):
    """The base's config with the layout and one micro-batch of this rank's `rows` per step, dropout off, the
    head unfused (the loss reads the logits)."""
    from meshlm.core.config import config_from_dict

    tp_, pp_, dp_ = dims_
    values = checkpoint.config.to_dict()
    values["parallel"] = {**values["parallel"], "tp": tp_, "pp": pp_, "dp": dp_, "zero": layout.get("zero", 0),
                          "timeout_s": layout.get("timeout_s", 600.0), "sp": False, "vpp": 1, "pp_layers": [],
                          "cp": 1, "ep": 1, "bucket_mb": layout.get("bucket_mb", 25.0)}
    values["train"] = {**values["train"], "micro_batch_size": rows, "global_batch_size": rows * dp_,
                       "fused_loss": False, "recompute": "none", "compile": False}
    values["model"] = {**values["model"], "dropout": 0.0}
    return config_from_dict(values)


# ---- log-probabilities under a layout ----------------------------------------------------------------------
def vocab_parallel_logps(z: torch.Tensor, tokens: torch.Tensor, group, vocab_size: int) -> torch.Tensor:
    """log softmax(z)[token] from (B, L, V/t) vocab-split logits: z_y − m − log Σ_v exp(z_v − m), with the max m
    (a constant) and the two sums reduced over tp. The sums go through Megatron's `g` (all-reduce forward,
    identity backward), so each rank's gradient is softmax − onehot on its own columns, as the vocab-parallel
    cross-entropy's. Padding columns (ids ≥ vocab_size) are −∞: no probability, no gradient."""
    width = z.shape[-1]
    start = dist.get_rank(group) * width
    if vocab_size - start < width:
        cols = torch.arange(width, device=z.device)
        z = z.masked_fill(cols >= vocab_size - start, float("-inf"))
    m = z.detach().amax(-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = z - m.unsqueeze(-1)
    local = tokens - start
    mine = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    sums = reduce_from_tensor_region(torch.stack([shifted.exp().sum(-1), torch.where(mine, picked, 0.0)]), group)
    return sums[1] - sums[0].log()


def head_logps(par, x: torch.Tensor, where, tokens, temperature: float) -> torch.Tensor:
    """(B, L) log-probs of `tokens` at positions `where` of the last layer's stream x (B, S, h), as
    `grpo.token_logps`: the head on the completion positions only."""
    m = par.model
    picked = m.head(x.gather(1, where.unsqueeze(-1).expand(-1, -1, x.shape[-1]))).float()  # (B, L, V or V/t)
    if par.dims.tp > 1:
        return vocab_parallel_logps(picked / temperature, tokens, par.dims.tp_group, m.cfg.vocab_size)
    return torch.log_softmax(picked / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def forward(par, ids, where, tokens, temperature: float = 1.0):
    """This rank's part of the trainer's forward: (log-probs (B, L) on the last stage else None, the stage's
    received input, its output). Without pp every rank is the last stage. Under pp the stages run one after the
    other, the residual stream (B, S, h) sent down the pipeline group."""
    m, d, pipe = par.model, par.dims, par.pipeline
    if pipe is None:
        x = m.run_layers(m.embed(ids), None, None, 0, m.rope(ids.shape[1]))  # (B, S, h)
        return head_logps(par, x, where, tokens, temperature), None, None
    layer_ids = pipe.modules[0].layer_ids
    inp = None
    if pipe.has_first:
        x = m.embed(ids)
    else:
        dtype = next(p for p in m.parameters()).dtype
        inp = torch.empty((*ids.shape, pipe.hidden_size), dtype=dtype, device=d.device)
        dist.recv(inp, src=rank_at(d, d.pp_rank - 1), group=d.pp_group)
        x = inp.requires_grad_(torch.is_grad_enabled())
    out = m.run_layers(x, layer_ids, None, 0, m.rope(ids.shape[1]))
    if not pipe.has_last:
        dist.send(out.detach().contiguous(), dst=rank_at(d, d.pp_rank + 1), group=d.pp_group)
        return None, inp, out
    return head_logps(par, out, where, tokens, temperature), inp, None


def backward(par, loss, inp, out) -> None:
    """Backward of `forward`'s graph: the loss on the last stage; elsewhere the gradient of the stage's output,
    received from the next stage; the input's gradient then goes to the previous stage."""
    d, pipe = par.dims, par.pipeline
    if pipe is None or pipe.has_last:
        loss.backward()
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank_at(d, d.pp_rank + 1), group=d.pp_group)
        out.backward(grad)
    if pipe is not None and not pipe.has_first:
        dist.send(inp.grad.contiguous(), dst=rank_at(d, d.pp_rank - 1), group=d.pp_group)


def logps_everywhere(par, ids, where, tokens, temperature: float = 1.0) -> torch.Tensor:
    """(B, L) log-probs, no gradient, on every rank (broadcast from the last pipeline stage)."""
    with torch.no_grad():
        logps = forward(par, ids, where, tokens, temperature)[0]
    pipe = par.pipeline
    if pipe is None:
        return logps
    if logps is None:
        logps = torch.empty(tokens.shape, dtype=torch.float32, device=par.dims.device)
    dist.broadcast(logps, src=pipe.last_rank, group=par.dims.pp_group)
    return logps


# ---- reductions over the ranks -----------------------------------------------------------------------------
def gather_dp(t: torch.Tensor, dims) -> torch.Tensor:
    """The dp ranks' equal-sized `t`, concatenated along dim 0 in dp order (the whole batch's rows)."""
    if dims.dp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dims.dp)]
    dist.all_gather(parts, t.contiguous(), group=dims.dp_group)
    return torch.cat(parts)


def sum_dp(values: list[float], dims, op=dist.ReduceOp.SUM) -> list[float]:
    if dims.dp == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=dims.device)  # NCCL reduces device tensors only
    dist.all_reduce(t, op=op, group=dims.dp_group)
    return t.tolist()


def from_last_stage(obj, par):
    """`obj` of the last pipeline stage on every rank of the pipeline (itself without pp)."""
    if par.pipeline is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=par.pipeline.last_rank, group=par.dims.pp_group)
    return box[0]


def weighted_metrics(metrics: dict, weight: float, dims) -> dict:
    """Per-rank means (over `weight` tokens or rows) → the whole batch's: Σ mean·weight / Σ weight over dp."""
    keys = sorted(metrics)
    sums = sum_dp([metrics[k] * weight for k in keys] + [weight], dims)
    return {k: s / max(sums[-1], 1e-30) if dims.dp > 1 else metrics[k] for k, s in zip(keys, sums)}


def global_advantages(total: torch.Tensor, mask, old, ref, opts: grpo.Options, dims):
    """(this rank's advantages, the batch's advantage metrics): `grpo.advantages_of` on the rewards (and RLOO's
    KL penalties Σ_t (π_old − π_ref)) of every dp rank."""
    G = opts.group_size
    rewards = gather_dp(total, dims)
    _, zero_std, _ = gl.group_advantages(rewards, G, "group")
    if opts.method == "rloo":
        shaped = rewards
        if ref is not None:
            shaped = rewards - opts.loss.beta * gather_dp(((old - ref) * mask).sum(-1), dims)
        adv = torch.nan_to_num(gl.rloo_advantages(shaped, G), nan=0.0)
    else:
        adv, zero_std, _ = gl.group_advantages(rewards, G, opts.scale_rewards)
    n = total.shape[0]
    return adv[dims.dp_rank * n:(dims.dp_rank + 1) * n], gl.advantage_metrics(rewards, adv, zero_std, G)


def loss_settings(opts: grpo.Options, mask: torch.Tensor, dims):
    """(settings, num_tokens) of this rank's loss so that the mean over dp is the one-process loss: bnpo and dapo
    (Σ over the batch's tokens / their count) become Σ_rank / (count / dp); the others are already so."""
    if dims.dp == 1 or opts.loss.loss_type not in ("bnpo", "dapo"):
        return opts.loss, None
    tokens = sum_dp([float(mask.sum())], dims)[0]
    return replace(opts.loss, loss_type="dapo"), tokens / dims.dp


# ---- one step --------------------------------------------------------------------------------------------------
def optimise(par, optimizer, batch, old, ref, adv, opts: grpo.Options) -> dict:
    """`opts.num_iterations` passes of one step each over this rank's rows (the layout's gradient sync: backward
    → finish → clip → step → after_step → zero_grad); the last pass's loss metrics, the whole batch's."""
    ids, where, mask, tokens = batch
    sync, d = par.grad_sync, par.dims
    settings, num_tokens = loss_settings(opts, mask, d)
    weight = float(mask.shape[0]) if opts.method == "rloo" else float(mask.sum())
    metrics = {}
    for _ in range(opts.num_iterations):
        logps, inp, out = forward(par, ids, where, tokens, opts.temperature)
        loss, parts = None, None
        if logps is not None:
            loss, parts = gl.grpo_loss(logps, logps.detach() if old is None else old, ref, mask,
                                       adv.to(logps.dtype), settings, num_tokens)
        sync.set_last_microbatch(True)
        backward(par, loss, inp, out)
        sync.finish()
        norm = sync.clip_grad_norm_(1.0)
        optimizer.step()
        sync.after_step()
        sync.zero_grad(optimizer)
        value = loss.detach() if loss is not None else None
        value, parts_metrics = from_last_stage((value, parts.metrics if parts is not None else None), par)
        metrics = {"loss": float(sync.average_loss(value)), "grad_norm": float(norm),
                   **weighted_metrics(parts_metrics, weight, d)}
    return metrics


def reward_columns(table: torch.Tensor, rewards) -> dict:
    """Mean and std per reward function over the batch's scored completions (as `grpo.one_step`)."""
    row = {}
    for j, r in enumerate(rewards):
        col = table[:, j][~torch.isnan(table[:, j])]
        row[f"rewards/{r.name}/mean"] = float(col.mean()) if col.numel() else float("nan")
        row[f"rewards/{r.name}/std"] = float(gl.sample_std(col)) if col.numel() > 1 else 0.0
    return row


def one_step(par, reference, sample, tokenizer, optimizer, rewards, prompts, opts: grpo.Options, step: int) -> dict:
    """`grpo.one_step` on this rank's share of the step's prompts; the metrics row of the whole batch."""
    d = par.dims
    ro = gr.rollout(sample, tokenizer, prompts, opts, step)
    table, failures = gr.score(rewards, ro, opts.group_size)
    if d.dp > 1:
        gathered = [None] * d.dp
        dist.all_gather_object(gathered, failures, group=d.dp_group)
        failures = [f for part in gathered for f in part]
    for message in failures:
        say(f"step {step}: {message}; that completion is left out of its group")
    total = gr.total_rewards(table, rewards).to(d.device)  # (on the device: NCCL gathers device tensors only)
    start = time.perf_counter()
    batch = ids, where, mask, tokens = tuple(t.to(d.device) for t in gr.batch_rows(ro, tokenizer.eod_id))
    raw = logps_everywhere(par, ids, where, tokens)
    old = None
    if opts.num_iterations > 1 or opts.method == "rloo":
        old = raw if opts.temperature == 1 else logps_everywhere(par, ids, where, tokens, opts.temperature)
    ref = reference(ids, where, tokens) if reference is not None else None
    adv, adv_metrics = global_advantages(total, mask, old, ref, opts, d)
    loss_metrics = optimise(par, optimizer, batch, old, ref, adv, opts)
    train_s = time.perf_counter() - start
    worst, mean, mult = gr.mismatch(ro.engine_logps, raw, mask)
    worst = sum_dp([worst], d, dist.ReduceOp.MAX)[0]
    here = float(mask.sum())
    abs_sum, mult_sum, n_tokens, n_rows, cells = sum_dp([mean * here, mult * here, here, float(len(ro.ids)),
                                                         float(ids.numel())], d)
    return {"kind": "train", "step": step, "completion_tokens": n_tokens, **loss_metrics, **adv_metrics,
            "completion_length": n_tokens / n_rows, "logprob_mismatch_max": worst,
            "logprob_mismatch_mean": abs_sum / n_tokens if n_tokens else 0.0,
            "token_mult_prob_error": mult_sum / n_tokens if n_tokens else 0.0,
            "policy_lag": 0, "reward_failures": len(failures), "generation_s": ro.seconds, "training_s": train_s,
            "rollout_tokens_per_s": n_tokens / max(ro.seconds, 1e-9),
            "train_tokens_per_s": cells * opts.num_iterations / max(train_s, 1e-9),
            **reward_columns(gather_dp(table.to(d.device), d), rewards)}


# ---- state ---------------------------------------------------------------------------------------------------
def layout_key(d, zero: int) -> list[int]:
    return [d.tp, d.pp, d.dp, zero]


def save_state(out: Path, par, optimizer, step: int, tokens: int, zero: int) -> None:
    """DIR/grpo_state.pt on rank 0: every rank's trained shards and optimizer state (gathered), the layout, the
    step and the tokens so far, written whole or not at all."""
    mine = {"params": {n: p.detach().cpu().clone() for n, p in par.model.named_parameters() if p.requires_grad},
            "optim": optimizer.state_dict()}
    ranks = [mine]
    if par.dims.world_size > 1:
        ranks = [None] * par.dims.world_size if par.dims.is_main else None
        dist.gather_object(mine, ranks, dst=0)
    if par.dims.is_main:
        tmp = out / (grpo.STATE_FILE + ".tmp")
        torch.save({"step": step, "tokens": tokens, "layout": layout_key(par.dims, zero), "ranks": ranks}, tmp)
        tmp.replace(out / grpo.STATE_FILE)


def load_state(par, optimizer, state: dict, zero: int, out: str) -> None:
    """This rank's saved shards and optimizer state, from a run of the same layout (else a ConfigError)."""
    if state.get("layout") != layout_key(par.dims, zero):
        saved = state.get("layout") or "one process"
        raise ConfigError(f"--out {out!r} holds a run of layout [tp, pp, dp, zero] = {saved}; resume it with the same "
                          f"layout (this one is {layout_key(par.dims, zero)}) or give a new directory")
    mine = state["ranks"][par.dims.rank]
    grpo.load_state(par.model, optimizer, mine)


def full_model_state(par) -> dict | None:
    """The whole plain model's state dict on rank 0 (tp shards gathered, pipeline stages merged), else None."""
    from meshlm.parallel import full_state_dict

    state = {k: v.detach().cpu().clone() for k, v in full_state_dict(par.model).items()}
    if par.pipeline is None or par.dims.tp_rank != 0:  # (the tp ranks of a stage hold the same gathered state)
        return state if par.dims.is_main else None
    parts = [None] * par.dims.pp if par.dims.is_main else None  # over rank 0's pipeline (dp = 1)
    dist.gather_object(state, parts, dst=0, group=par.dims.pp_group)
    if not par.dims.is_main:
        return None
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


# ---- the command -------------------------------------------------------------------------------------------
def make_reference(par, load, opts: grpo.Options):
    """(ids, where, tokens) → the frozen base's log-probs on every rank, or None when β = 0: a second copy of the
    base on the same layout (`load()`), its weights frozen."""
    if opts.loss.beta == 0:
        return None
    frozen = load()
    frozen.model.requires_grad_(False)
    return lambda ids, where, tokens: logps_everywhere(frozen, ids, where, tokens, opts.temperature)


def build(overrides: list[str], opts: grpo.Options, checkpoint):
    """(Parallelized, reference, optimizer, layout) of this rank: the process group started, the base loaded on
    the layout of the --parallel.* overrides."""
    from meshlm.checkpoint.load import load_parallel
    from meshlm.families.registry import get_spec
    from meshlm.parallel import init_distributed

    layout = layout_overrides(overrides)
    dims_ = check_layout(layout, opts, opts.adapter, int(os.environ.get("WORLD_SIZE", "1")))
    rows = opts.prompts_per_step // dims_[2] * opts.group_size
    cfg = layout_config(checkpoint, layout, dims_, rows)
    dims = init_distributed(cfg.parallel, None if torch.cuda.is_available() else torch.device("cpu"))
    spec = get_spec(checkpoint.config.model.family)

    def load():
        torch.manual_seed(opts.seed)
        return load_parallel(checkpoint, spec, cfg, dims)

    par = load()
    reference = make_reference(par, load, opts)
    optimizer = par.grad_sync.build_optimizer(
        [{"params": [p for p in par.model.parameters() if p.requires_grad]}],
        lambda groups: torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.99), weight_decay=0.0))
    return par, reference, optimizer, layout


def train(par, reference, sample, tokenizer, optimizer, rewards, prompts, opts: grpo.Options, out: Path,
          first: int, tokens: int, zero: int) -> None:
    """Steps first + 1 … opts.steps, each rank on its share of the step's prompts (as `grpo.run_grpo`'s loop);
    rank 0 logs and writes the metrics; every rank takes part in saving the state."""
    from meshlm.train.log import RunLog

    d = par.dims
    share = opts.prompts_per_step // d.dp
    log = RunLog(out, is_main=d.is_main)
    log.open(first, opts.steps, progress=False)
    try:
        for step in range(first + 1, opts.steps + 1):
            start = (step - 1) * opts.prompts_per_step + d.dp_rank * share
            chosen = [prompts[(start + i) % len(prompts)] for i in range(share)]
            row = one_step(par, reference, sample, tokenizer, optimizer, rewards, chosen, opts, step)
            tokens += int(row["completion_tokens"])
            log.write({**row, "tokens": tokens})
            log.log(f"step {step}: reward {row['reward']:.4f} ± {row['reward_std']:.4f} | loss {row['loss']:.4f} | "
                    f"length {row['completion_length']:.1f} | logprob mismatch {row['logprob_mismatch_max']:.2e}")
            if step % opts.save_every == 0 or step == opts.steps:
                save_state(out, par, optimizer, step, tokens, zero)
    finally:
        log.close()


def run(flags: grpo.Flags, overrides: list[str], make_sampler) -> int:
    """`grpo.run_grpo` under the layout of the --parallel.* overrides (module docstring); `make_sampler(model,
    tokenizer, rows, positions, par=)` builds the engine's sampler on this rank's part of the model."""
    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.parallel import destroy

    opts, rewards, checkpoint, tokenizer, prompts, resume = grpo.prepare(flags, overrides)
    try:
        par, reference, optimizer, layout = build(overrides, opts, checkpoint)
        d, zero = par.dims, layout.get("zero", 0)
        if resume is not None:
            load_state(par, optimizer, resume, zero, opts.out)
        first, tokens = (resume["step"], resume["tokens"]) if resume is not None else (0, 0)
        rows = opts.prompts_per_step // d.dp * opts.group_size
        longest = max(len(p.ids) for p in prompts) + opts.max_completion_length
        sample = make_sampler(par.model, tokenizer, rows, longest, par=par)
        offset = d.dp_rank * rows  # this rank's first row of the step: its seeds are the global rows'

        def shifted(ids, max_tokens, temperature, top_k, seeds):
            return sample(ids, max_tokens, temperature, top_k, [s + offset for s in seeds])

        out = Path(opts.out)
        if d.is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / grpo.INFO_FILE).write_text(json.dumps(grpo.run_info(opts, rewards), indent=1) + "\n")
        say(f"{opts.method} ({opts.loss.loss_type}, beta {opts.loss.beta:g}) on {opts.checkpoint} over tp={d.tp} "
            f"pp={d.pp} dp={d.dp} (ZeRO-{zero}): {opts.steps} steps of {opts.prompts_per_step} prompts x "
            f"{opts.group_size} completions, lr {opts.lr:g}" + (f"; resuming after step {first}" if first else ""))
        train(par, reference, shifted, tokenizer, optimizer, rewards, prompts, opts, out, first, tokens, zero)
        state = full_model_state(par)
        if state is not None:  # rank 0: the whole model, in the one-process format
            save_checkpoint(out, opts.steps, {"model": state, "optim": {},
                                              "state": {"step": opts.steps, "tokens_seen": 0}},
                            checkpoint.config.to_dict())
        say(f"{opts.method}: {opts.steps} steps; the trained model is {opts.out}'s checkpoint")
        destroy(wait_for_all=True)
    finally:
        destroy()
    return 0
