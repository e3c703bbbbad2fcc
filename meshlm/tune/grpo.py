"""`meshlm align --method grpo|rloo`: online reinforcement learning with verifiable rewards (docs/align.md).

    meshlm align --method grpo|rloo --checkpoint BASE --train PROMPTS.jsonl --reward module:function [...]
                 --out DIR [--num-generations G] [--prompts-per-step P] [--steps N] [--num-iterations MU]
                 [--loss-type grpo|bnpo|dr_grpo|dapo] [--beta B] [--epsilon E] [--epsilon-high EH]
                 [--scale-rewards group|batch|none] [--max-completion-length L] [--temperature T] [--top-k K] [--save-every N]

Each step: P prompts (in file order, wrapping round) → G sampled completions each from meshlm's `Engine`
running the very module being trained → rewards (the weighted sum of `--reward` functions) → group-relative
advantages → MU optimisation passes over the P·G completions with the loss of `tune/grpo_loss.py`.

Generation and training share one model object: the command's sampler (`meshlm.commands.align.engine_sampler`,
handed in because infer/ sits above tune/) builds meshlm's `Engine` on this very module, whose `Runner` calls
its `embed`, `run_layers` and `head`, so after `optimizer.step()` the next rollout samples from the new weights
with nothing copied or reloaded. What the engine keeps between rollouts stays valid: its KV cache is written
at each request's prefill and read only by that request, and prefix caching is off (a cached prompt prefix
would hold keys and values of the old weights); nothing is compiled. The model runs in eval mode throughout
(dropout off, as TRL's GRPOTrainer does), the engine under `torch.no_grad`.

The check NeMo-RL makes: the engine's log-probabilities of the sampled tokens (the paged, incremental path)
against the trainer's recomputed ones (one full forward per row), both of the raw distribution
(temperature 1); the largest and the mean difference are logged every step (`logprob_mismatch_max`,
`logprob_mismatch_mean`).

π_old: the trainer's log-probs before the step's first update (with MU = 1 they are the current ones,
detached, as TRL does). One process; every weight trains (the reference, when β > 0: a frozen copy of the
base made before training), or with `--adapter lora` a LoRA adapter on the frozen base (the reference: the
model with its adapter off, no second model; the adapter is merged into DIR's checkpoint at the end). The
ordinary `Trainer` is not used: its batches come from a fixed dataset through its `BatchLoader`, while
rollouts depend on the weights of the step before. The run writes
DIR/grpo.json, DIR/metrics.jsonl (one row per step, "tokens": completion tokens so far), TensorBoard scalars
(DIR/tensorboard, the trainer's `RunLog`), DIR/grpo_state.pt every `--save-every` steps and at the end (the
trained parameters, AdamW's state, the step: the same --out again resumes exactly, the sampling seeds being
functions of the seed, the step and the row) and, at the end, a checkpoint of the trained model in DIR
(`meshlm generate --checkpoint DIR`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from meshlm.core.config import ConfigError, check_output_dir
from meshlm.core.console import say
from meshlm.data.items import DataError
from meshlm.data.jsonl import Line, read_jsonl, short_json
from meshlm.tune import grpo_loss as gl
from meshlm.tune.rewards import Reward, RewardError, call_reward, load_rewards

INFO_FILE = "grpo.json"
STATE_FILE = "grpo_state.pt"


@dataclass(frozen=True)
class Options:
    """The run's settings (the command's flags, checked)."""

    method: str = "grpo"
    group_size: int = 4
    prompts_per_step: int = 4
    steps: int = 10
    num_iterations: int = 1
    lr: float = 1e-6
    max_completion_length: int = 64
    temperature: float = 1.0
    top_k: int = 0
    scale_rewards: str = "group"
    seed: int = 0
    loss: gl.LossSettings = field(default_factory=gl.LossSettings)
    save_every: int = 10


def check_options(args: argparse.Namespace) -> Options:
    """Options from the parsed flags; a ConfigError naming the flag and the fix."""
    g = args.num_generations
    if g < 2:
        raise ConfigError(f"--num-generations {g}: GRPO compares the completions of one prompt; use 2 or more")
    for flag, value in (("--prompts-per-step", args.prompts_per_step), ("--steps", args.steps),
                        ("--num-iterations", args.num_iterations),
                        ("--max-completion-length", args.max_completion_length), ("--save-every", args.save_every)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    if args.top_k < 0:
        raise ConfigError(f"--top-k {args.top_k} must be >= 0 (0: off)")
    checks = (("--lr", args.lr, args.lr > 0), ("--temperature", args.temperature, args.temperature > 0),
              ("--beta", args.beta, args.beta >= 0), ("--epsilon", args.epsilon, args.epsilon > 0),
              ("--epsilon-high", args.epsilon_high, args.epsilon_high is None or args.epsilon_high > 0))
    for flag, value, ok in checks:
        if value is not None and not (ok and math.isfinite(value)):
            raise ConfigError(f"{flag} {value} must be a finite number > 0 (--beta: >= 0)")
    loss_type = "rloo" if args.method == "rloo" else args.loss_type
    if args.method == "rloo" and args.loss_type != "grpo":
        raise ConfigError(f"--loss-type {args.loss_type} is for --method grpo; RLOO has its own sequence-level loss")
    loss = gl.LossSettings(loss_type, args.beta, args.epsilon, args.epsilon_high, args.max_completion_length)
    return Options(args.method, g, args.prompts_per_step, args.steps, args.num_iterations, args.lr,
                   args.max_completion_length, args.temperature, args.top_k, args.scale_rewards, args.seed, loss,
                   args.save_every)


# ---- prompts ------------------------------------------------------------------------------------------------
@dataclass
class Prompt:
    where: str  # file:line
    text: str  # as the model sees it (a conversation rendered with its generation prompt)
    ids: list[int]
    row: dict


def prompt_text(line: Line, template) -> str:
    """The line's `prompt`: plain text as is, or a list of messages rendered by the chat template with its
    generation prompt (`template()` gives the template, found on first use)."""
    from meshlm.data.chat import render

    value = line.obj.get("prompt")
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        t = template()
        text = render(t, value, add_generation_prompt=True)
        if text == render(t, value, add_generation_prompt=False):
            raise ConfigError(f"the chat template {getattr(t, 'source', '')!r} adds no generation prompt (the "
                              "assistant turn's opening); give --chat-template FILE with one, or plain-text prompts")
        return text
    if value is None:
        raise DataError(f"{line.where}: no 'prompt' field; each line is {{\"prompt\": text or messages, ...}}")
    raise DataError(f"{line.where}: 'prompt' is {short_json(value)}; give non-empty text or a non-empty list of "
                    "messages")


def read_prompts(path: str, tokenizer, template, max_len: int, room: int) -> list[Prompt]:
    """The prompts of `path`, tokenized; a prompt longer than `max_len − room` (room: the completion's tokens)
    is one error naming its line."""
    out = []
    for line in read_jsonl(path, "--train"):
        text = prompt_text(line, template)
        ids = tokenizer.encode(text)
        if not ids:
            raise DataError(f"{line.where}: the prompt encodes to no tokens; give a non-empty prompt")
        if len(ids) + room > max_len:
            raise DataError(f"{line.where}: the prompt's {len(ids)} tokens and --max-completion-length {room} are "
                            f"more than the model's {max_len} positions; shorten the prompt or lower "
                            "--max-completion-length")
        out.append(Prompt(line.where, text, ids, line.obj))
    return out


# ---- one step -----------------------------------------------------------------------------------------------
@dataclass
class Rollout:
    prompts: list[Prompt]  # one per completion (each prompt G times, consecutive)
    ids: list[list[int]]  # the completions' tokens
    texts: list[str]
    engine_logps: list[list[float]]
    seconds: float


# (prompts' token ids, max_tokens, temperature, top_k, one seed per prompt) → per prompt (the sampled ids, the
# sampler's log-prob of each under the raw distribution). `meshlm.commands.align.engine_sampler` makes one from
# meshlm's Engine (infer/ sits above tune/, so the command hands it in).
Sample = Callable[[list[list[int]], int, float, int, list[int]], list[tuple[list[int], list[float]]]]
# (model, tokenizer, rows at once, positions per row) → a Sample running that very model.
MakeSampler = Callable[[object, object, int, int], Sample]


def rollout(sample: Sample, tokenizer, prompts: list[Prompt], opts: Options, step: int) -> Rollout:
    """G sampled completions of each prompt (seeded by the run's seed, the step and the row)."""
    rows = [p for p in prompts for _ in range(opts.group_size)]
    seeds = [opts.seed * 1_000_003 + step * 10_007 + i for i in range(len(rows))]
    start = time.perf_counter()
    out = sample([p.ids for p in rows], opts.max_completion_length, opts.temperature, opts.top_k, seeds)
    seconds = time.perf_counter() - start
    ids = [list(i) for i, _ in out]
    return Rollout(rows, ids, [tokenizer.decode(i) for i in ids], [list(lp) for _, lp in out], seconds)


def score(rewards: list[Reward], ro: Rollout, group_size: int) -> tuple[torch.Tensor, list[str]]:
    """(B, R) rewards per completion and function (NaN where the function failed) and the failures' messages."""
    table = torch.full((len(ro.ids), len(rewards)), float("nan"), dtype=torch.float64)
    failures = []
    for i, (p, text) in enumerate(zip(ro.prompts, ro.texts)):
        for j, r in enumerate(rewards):
            try:
                table[i, j] = call_reward(r, p.text, text, p.row, f"{p.where} (completion {i % group_size + 1})")
            except RewardError as err:
                failures.append(str(err))
    return table, failures


def total_rewards(table: torch.Tensor, rewards: list[Reward]) -> torch.Tensor:
    """The weighted sum over functions; NaN only where every function failed (TRL's rule)."""
    weights = torch.tensor([r.weight for r in rewards], dtype=table.dtype)
    total = (torch.nan_to_num(table, nan=0.0) * weights).sum(1)
    total[torch.isnan(table).all(1)] = float("nan")
    return total


def batch_rows(ro: Rollout, pad_id: int):
    """(ids (B, S), completion positions index (B, L), mask (B, L), tokens (B, L)): each row prompt +
    completion right-padded; position t of completion k is predicted at row position len(prompt) + t − 1."""
    L = max(1, max(len(c) for c in ro.ids))
    S = max(len(p.ids) + len(c) for p, c in zip(ro.prompts, ro.ids))
    ids = torch.full((len(ro.ids), S), pad_id, dtype=torch.long)
    tokens = torch.full((len(ro.ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(ro.ids), L)
    where = torch.zeros(len(ro.ids), L, dtype=torch.long)
    for b, (p, c) in enumerate(zip(ro.prompts, ro.ids)):
        n = len(p.ids)
        ids[b, :n + len(c)] = torch.tensor(p.ids + c)
        tokens[b, :len(c)] = torch.tensor(c, dtype=torch.long)
        mask[b, :len(c)] = 1
        where[b] = (n - 1 + torch.arange(L)).clamp(max=S - 1)
    return ids, where, mask, tokens


def token_logps(model, ids, where, tokens, temperature: float = 1.0):
    """(B, L) log-probabilities of `tokens` at completion positions `where`, of logits / temperature."""
    # The head runs on the completion positions only (as `forward` would, then picking them): the prompts'
    # positions would cost a (B, S, V) logits tensor for nothing.
    x = model.run_layers(model.embed(ids), None, None, 0, model.rope(ids.shape[1]))  # (B, S, h)
    picked = model.head(x.gather(1, where.unsqueeze(-1).expand(-1, -1, x.shape[-1]))).float()  # (B, L, V)
    return torch.log_softmax(picked / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def mismatch(engine_logps: list[list[float]], trainer: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """The largest and the mean |engine − trainer| log-prob over the sampled tokens."""
    eng = torch.zeros_like(trainer)
    for b, row in enumerate(engine_logps):
        eng[b, :len(row)] = torch.tensor(row, dtype=trainer.dtype)
    diff = (eng - trainer).abs() * mask
    return (float(diff.max()), float(diff.sum() / mask.sum())) if mask.any() else (0.0, 0.0)


def advantages_of(rewards: torch.Tensor, ro_mask: torch.Tensor, old: torch.Tensor, ref, opts: Options):
    """(advantages (B,), metrics) of a generation batch: GRPO's group-relative ones, or RLOO's leave-one-out
    ones of the rewards less β·Σ(π_old − π_ref)."""
    G = opts.group_size
    _, zero_std, _ = gl.group_advantages(rewards, G, "group")
    if opts.method == "rloo":
        shaped = rewards if ref is None else gl.rloo_kl_rewards(rewards, old, ref, ro_mask, opts.loss.beta)
        adv = torch.nan_to_num(gl.rloo_advantages(shaped, G), nan=0.0)
    else:
        adv, zero_std, _ = gl.group_advantages(rewards, G, opts.scale_rewards)
    return adv, gl.advantage_metrics(rewards, adv, zero_std, G)


def optimise(model, optimizer, batch, old, ref, adv, opts: Options) -> dict:
    """`opts.num_iterations` passes of one whole-batch step each; the last pass's loss metrics."""
    ids, where, mask, tokens = batch
    metrics = {}
    for _ in range(opts.num_iterations):
        logps = token_logps(model, ids, where, tokens, opts.temperature)
        loss, parts = gl.grpo_loss(logps, logps.detach() if old is None else old, ref, mask, adv.to(logps.dtype),
                                   opts.loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        metrics = {"loss": loss.item(), "grad_norm": norm.item(), **parts.metrics}
    return metrics


def one_step(model, reference, sample: Sample, tokenizer, optimizer, rewards: list[Reward], prompts: list[Prompt],
             opts: Options, step: int) -> dict:
    """Roll out, score, and optimise one step; its metrics row."""
    ro = rollout(sample, tokenizer, prompts, opts, step)
    table, failures = score(rewards, ro, opts.group_size)
    for message in failures:
        say(f"step {step}: {message}; that completion is left out of its group")
    total = total_rewards(table, rewards)
    start = time.perf_counter()
    batch = ids, where, mask, tokens = batch_rows(ro, tokenizer.eod_id)
    with torch.no_grad():
        raw = token_logps(model, ids, where, tokens)  # the engine's distribution: temperature 1
        old = None  # π_old: the current policy, detached in the loss (one pass), else these numbers
        if opts.num_iterations > 1 or opts.method == "rloo":
            old = raw if opts.temperature == 1 else token_logps(model, ids, where, tokens, opts.temperature)
        ref = reference(ids, where, tokens) if reference is not None else None
    adv, adv_metrics = advantages_of(total, mask, old, ref, opts)
    loss_metrics = optimise(model, optimizer, batch, old, ref, adv, opts)
    train_s = time.perf_counter() - start
    n_tokens = float(mask.sum())
    worst, mean = mismatch(ro.engine_logps, raw, mask)
    row = {"kind": "train", "step": step, "completion_tokens": n_tokens, **loss_metrics, **adv_metrics,
           "completion_length": n_tokens / len(ro.ids), "logprob_mismatch_max": worst, "logprob_mismatch_mean": mean,
           "reward_failures": len(failures), "generation_s": ro.seconds, "training_s": train_s,
           "rollout_tokens_per_s": n_tokens / max(ro.seconds, 1e-9),
           "train_tokens_per_s": float(ids.numel()) * opts.num_iterations / max(train_s, 1e-9)}
    for j, r in enumerate(rewards):
        col = table[:, j][~torch.isnan(table[:, j])]
        row[f"rewards/{r.name}/mean"] = float(col.mean()) if col.numel() else float("nan")
        row[f"rewards/{r.name}/std"] = float(gl.sample_std(col)) if col.numel() > 1 else 0.0
    return row


# ---- the command --------------------------------------------------------------------------------------------
def prepare(args: argparse.Namespace, overrides: list[str]):
    """Everything before training, writing nothing: (options, rewards, checkpoint, tokenizer, prompts)."""
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.interop.checkpoints import open_checkpoint
    from meshlm.tune.align import chat_template

    for o in overrides:
        if not (args.adapter == "lora" and o.removeprefix("--").startswith("tune.lora_")):
            raise ConfigError(f"--method {args.method} takes no {o.split('=')[0]} yet; its own flags set the run "
                              "(and, with --adapter lora, --tune.lora_rank, _alpha, _dropout, _targets)")
    opts = check_options(args)
    rewards = load_rewards(args.reward or [], args.reward_weights)
    check_output_dir("--out", args.out)
    resume = resume_point(args, opts, rewards)
    checkpoint = open_checkpoint(args.checkpoint)
    cfg = checkpoint.config
    if not get_spec(cfg.model.family).decoder:
        raise ConfigError(f"--checkpoint {args.checkpoint!r} holds a model.family={cfg.model.family!r} model; "
                          f"--method {args.method} needs a decoder (GPT) checkpoint")
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    prompts = read_prompts(args.train, tokenizer, chat_template(cfg.data.tokenizer, args.chat_template),
                           cfg.model.seq_len, opts.max_completion_length)
    first = prompts[0]
    for r in rewards:  # a reward that cannot score an empty completion of the first row fails now, not mid-run
        try:
            call_reward(r, first.text, "", first.row, f"{first.where} (an empty completion, checked before training)")
        except RewardError as err:
            raise ConfigError(str(err)) from None
    return opts, rewards, checkpoint, tokenizer, prompts, resume


# ---- resuming ----------------------------------------------------------------------------------------------
def run_info(args: argparse.Namespace, opts: Options, rewards: list[Reward]) -> dict:
    """DIR/grpo.json: what the run is; a resumed run must match it in all but `steps` and `save_every`."""
    return {"method": opts.method, "checkpoint": args.checkpoint, "train": args.train, "adapter": args.adapter,
            "rewards": [[r.name, r.weight] for r in rewards],
            **{k: v for k, v in asdict(opts).items() if k != "loss"}, **asdict(opts.loss)}


def resume_point(args: argparse.Namespace, opts: Options, rewards: list[Reward]) -> dict | None:
    """The saved state of the run in --out (None: a new run), checked against these options; a non-empty
    --out without one, a different run's, or one already past --steps is a ConfigError (nothing written)."""
    out = Path(args.out)
    if not out.exists() or not any(out.iterdir()):
        return None
    if not (out / STATE_FILE).exists() or not (out / INFO_FILE).exists():
        raise ConfigError(f"--out {args.out!r} is not empty and holds no GRPO run to resume ({STATE_FILE}); give a "
                          "new directory")
    saved = json.loads((out / INFO_FILE).read_text())
    ignored = ("steps", "save_every")
    now = json.loads(json.dumps(run_info(args, opts, rewards)))
    changed = sorted(k for k in set(saved) | set(now) if k not in ignored and saved.get(k) != now.get(k))
    if changed:
        raise ConfigError(f"--out {args.out!r} holds a run with other settings ({', '.join(changed)}); resume with "
                          "the same flags (only --steps and --save-every may change) or give a new directory")
    state = torch.load(out / STATE_FILE, map_location="cpu", weights_only=True)
    if state["step"] >= opts.steps:
        raise ConfigError(f"--out {args.out!r} has already run {state['step']} steps; give --steps above that to "
                          "go on")
    return state


def save_state(out: Path, model, optimizer, step: int, tokens: int) -> None:
    """DIR/grpo_state.pt: the trained parameters (the adapter's, or every weight), AdamW's state, the step and
    the tokens so far, written whole or not at all. The sampling needs nothing: its seeds follow from --seed,
    the step and the row."""
    params = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    tmp = out / (STATE_FILE + ".tmp")
    torch.save({"step": step, "tokens": tokens, "params": params, "optim": optimizer.state_dict()}, tmp)
    tmp.replace(out / STATE_FILE)


def load_state(model, optimizer, state: dict) -> None:
    """The saved trained parameters and optimizer state into the freshly built model and optimizer."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state["params"].items():
            named[name].copy_(value)
    optimizer.load_state_dict(state["optim"])


def add_lora(model, spec, checkpoint, overrides: list[str]) -> None:
    """A LoRA adapter (`meshlm tune`'s, with `--tune.lora_*` overrides) on `model`, the base frozen."""
    from meshlm.core.config import apply_overrides, build
    from meshlm.tune.adapters import apply_adapters

    values = checkpoint.config.to_dict()
    values["tune"] = {"method": "lora", "base": str(checkpoint.path)}
    apply_adapters(model, spec, build(apply_overrides(values, overrides)), dims=None)


@contextlib.contextmanager
def adapter_off(model):
    """`model` without its LoRA updates while inside (each scaling 0: the base's outputs, bit for bit)."""
    from meshlm.tune.lora import LoRA

    loras = [m for m in model.modules() if isinstance(m, LoRA)]
    saved = [m.scaling for m in loras]
    for m in loras:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(loras, saved):
            m.scaling = scaling


def make_reference(model, opts: Options, lora: bool):
    """(ids, where, tokens) → the frozen reference's log-probs, or None when β = 0: with LoRA the model with its
    adapter off (no second model in memory), else a frozen copy of the base made now."""
    if opts.loss.beta == 0:
        return None
    if lora:
        def off(ids, where, tokens):
            with adapter_off(model):
                return token_logps(model, ids, where, tokens, opts.temperature)
        return off
    frozen = copy.deepcopy(model).requires_grad_(False)
    return lambda ids, where, tokens: token_logps(frozen, ids, where, tokens, opts.temperature)


def run_grpo(args: argparse.Namespace, overrides: list[str], make_sampler: MakeSampler) -> int:
    """`meshlm align --method grpo|rloo` (parsed by `meshlm.commands.align`), sampling with
    `make_sampler(model, tokenizer, rows, positions)` (`meshlm.commands.align.engine_sampler`)."""
    from meshlm.checkpoint.load import load_model
    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.families.registry import get_spec
    from meshlm.train.log import RunLog

    opts, rewards, checkpoint, tokenizer, prompts, resume = prepare(args, overrides)
    torch.manual_seed(opts.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = get_spec(checkpoint.config.model.family)
    model = load_model(checkpoint, spec, device)  # eval mode: dropout off
    if args.adapter == "lora":
        add_lora(model, spec, checkpoint, overrides)
    reference = make_reference(model, opts, lora=args.adapter == "lora")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opts.lr, betas=(0.9, 0.99),
                                  weight_decay=0.0)
    if resume is not None:  # after the reference was made: it is the base, not the resumed weights
        load_state(model, optimizer, resume)
    first, tokens = (resume["step"], resume["tokens"]) if resume is not None else (0, 0)
    longest = max(len(p.ids) for p in prompts) + opts.max_completion_length
    n_rows = opts.prompts_per_step * opts.group_size
    sample = make_sampler(model, tokenizer, n_rows, longest)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / INFO_FILE).write_text(json.dumps(run_info(args, opts, rewards), indent=1) + "\n")
    say(f"{opts.method} ({opts.loss.loss_type}, beta {opts.loss.beta:g}) on {args.checkpoint}: {opts.steps} steps of "
        f"{opts.prompts_per_step} prompts x {opts.group_size} completions, lr {opts.lr:g}"
        + (f"; resuming after step {first}" if first else ""))
    log = RunLog(out, is_main=True)  # metrics.jsonl (cut back to `first`) and TensorBoard, as the trainer's
    log.open(first, opts.steps, progress=False)
    try:
        for step in range(first + 1, opts.steps + 1):
            start = (step - 1) * opts.prompts_per_step
            chosen = [prompts[(start + i) % len(prompts)] for i in range(opts.prompts_per_step)]
            row = one_step(model, reference, sample, tokenizer, optimizer, rewards, chosen, opts, step)
            tokens += int(row["completion_tokens"])
            log.write({**row, "tokens": tokens})
            log.log(f"step {step}: reward {row['reward']:.4f} ± {row['reward_std']:.4f} | loss {row['loss']:.4f} | "
                    f"length {row['completion_length']:.1f} | zero-std groups {row['frac_reward_zero_std']:.2f} | "
                    f"logprob mismatch {row['logprob_mismatch_max']:.2e} | gen {row['generation_s']:.1f}s "
                    f"train {row['training_s']:.1f}s")
            if step % opts.save_every == 0 or step == opts.steps:
                save_state(out, model, optimizer, step, tokens)
    finally:
        log.close()
    if args.adapter == "lora":  # DIR's checkpoint is the base with the adapter merged in
        from meshlm.tune.lora import merge_lora

        for linear in [m for m in model.modules() if hasattr(m, "_lora_hook")]:
            merge_lora(linear)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    save_checkpoint(out, opts.steps, {"model": state, "optim": optimizer.state_dict(),
                                      "state": {"step": opts.steps, "tokens_seen": 0}}, checkpoint.config.to_dict())
    say(f"{opts.method}: {opts.steps} steps; the trained model is {args.out}'s checkpoint")
    return 0
