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
detached, as TRL does; with `--off-policy-lag` the sampling weights' log-probs: `tune/grpo_rollouts.py`). One
process here (`tune/grpo_parallel.py` runs the tp, pp and dp layouts); every weight trains (the reference, when β > 0: a frozen copy of the
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
from meshlm.tune.grpo_rollouts import (  # noqa: F401 -- the rollout phase's names, also used as grpo.X
    Batch,
    Rollout,
    RolloutSource,
    Sample,
    batch_rows,
    completion_text,
    mismatch,
    rollout,
    score,
    token_logps,
    total_rewards,
)
from meshlm.tune.rewards import Reward, RewardError, call_reward, load_rewards

INFO_FILE = "grpo.json"
STATE_FILE = "grpo_state.pt"


@dataclass(frozen=True)
class Flags:
    """`meshlm align --method grpo|rloo`'s flags as parsed (`meshlm.commands.align.grpo_flags` builds them; the
    preference methods' own flags are left out); `check_options` checks them."""

    checkpoint: str
    method: str
    train: str
    out: str
    beta: float
    adapter: str = "none"
    chat_template: str | None = None
    reward: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] | None = None
    num_generations: int = 4
    prompts_per_step: int = 4
    steps: int = 10
    num_iterations: int = 1
    loss_type: str = "grpo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    scale_rewards: str = "group"
    max_completion_length: int = 64
    temperature: float = 1.0
    top_k: int = 0
    lr: float = 1e-6
    seed: int = 0
    off_policy_lag: int = 0
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    save_every: int = 10


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
    off_policy_lag: int = 0
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    # what the run reads and writes
    checkpoint: str = ""
    train: str = ""
    out: str = ""
    adapter: str = "none"
    chat_template: str | None = None


def check_options(f: Flags) -> Options:
    """Options from the parsed flags; a ConfigError naming the flag and the fix."""
    g = f.num_generations
    if g < 2:
        raise ConfigError(f"--num-generations {g}: GRPO compares the completions of one prompt; use 2 or more")
    for flag, value in (("--prompts-per-step", f.prompts_per_step), ("--steps", f.steps),
                        ("--num-iterations", f.num_iterations),
                        ("--max-completion-length", f.max_completion_length), ("--save-every", f.save_every)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    if f.top_k < 0:
        raise ConfigError(f"--top-k {f.top_k} must be >= 0 (0: off)")
    if f.off_policy_lag < 0:
        raise ConfigError(f"--off-policy-lag {f.off_policy_lag} must be >= 0 (0: strictly on-policy)")
    if f.max_sampling_rounds < 1:
        raise ConfigError(f"--max-sampling-rounds {f.max_sampling_rounds} must be >= 1")
    checks = (("--lr", f.lr, f.lr > 0), ("--temperature", f.temperature, f.temperature > 0),
              ("--beta", f.beta, f.beta >= 0), ("--epsilon", f.epsilon, f.epsilon > 0),
              ("--epsilon-high", f.epsilon_high, f.epsilon_high is None or f.epsilon_high > 0))
    for flag, value, ok in checks:
        if value is not None and not (ok and math.isfinite(value)):
            raise ConfigError(f"{flag} {value} must be a finite number > 0 (--beta: >= 0)")
    loss_type = "rloo" if f.method == "rloo" else f.loss_type
    if f.method == "rloo" and f.loss_type != "grpo":
        raise ConfigError(f"--loss-type {f.loss_type} is for --method grpo; RLOO has its own sequence-level loss")
    loss = gl.LossSettings(loss_type, f.beta, f.epsilon, f.epsilon_high, f.max_completion_length)
    return Options(f.method, g, f.prompts_per_step, f.steps, f.num_iterations, f.lr, f.max_completion_length,
                   f.temperature, f.top_k, f.scale_rewards, f.seed, loss, f.save_every, f.off_policy_lag,
                   f.dynamic_sampling, f.max_sampling_rounds, f.checkpoint, f.train, f.out, f.adapter,
                   f.chat_template)


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
# (model, tokenizer, rows at once, positions per row) → a Sample running that very model.
MakeSampler = Callable[[object, object, int, int], Sample]


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
        loss, parts = gl.grpo_loss(logps, logps.detach() if old is None else old, ref, mask, adv.to(device=logps.device, dtype=logps.dtype),
                                   opts.loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        metrics = {"loss": loss.item(), "grad_norm": norm.item(), **parts.metrics}
    return metrics


def one_step(model, reference, source: RolloutSource, optimizer, rewards: list[Reward], opts: Options,
             step: int) -> dict:
    """Take step `step`'s batch from `source` (sampled now, or `--off-policy-lag` steps ago), score it and
    optimise; its metrics row."""
    b = source.next(step, version=step - 1)
    for message in b.failures:
        say(f"step {step}: {message}; that completion is left out of its group")
    ids, where, mask, tokens = b.rows
    total = total_rewards(b.table, rewards).to(mask.device)
    start = time.perf_counter()
    with torch.no_grad():
        ref = reference(ids, where, tokens) if reference is not None else None
    adv, adv_metrics = advantages_of(total, mask, b.old, ref, opts)
    loss_metrics = optimise(model, optimizer, b.rows, b.old, ref, adv, opts)
    train_s = time.perf_counter() - start + b.seconds
    n_tokens = float(mask.sum())
    worst, mean, mult = mismatch(b.ro.engine_logps, b.raw, mask)
    row = {"kind": "train", "step": step, "completion_tokens": n_tokens, **loss_metrics, **adv_metrics,
           "completion_length": n_tokens / len(b.ro.ids), "logprob_mismatch_max": worst, "logprob_mismatch_mean": mean,
           "token_mult_prob_error": mult,
           "reward_failures": len(b.failures), "generation_s": b.ro.seconds, "training_s": train_s,
           "rollout_tokens_per_s": n_tokens / max(b.ro.seconds, 1e-9),
           "train_tokens_per_s": float(ids.numel()) * opts.num_iterations / max(train_s, 1e-9),
           "policy_lag": step - 1 - b.version}
    if opts.dynamic_sampling:
        row.update({"sampling_rounds": b.rounds, "groups_dropped": b.dropped,
                    "sampled_frac_reward_zero_std": b.sampled_zero_std})
    for j, r in enumerate(rewards):
        col = b.table[:, j][~torch.isnan(b.table[:, j])]
        row[f"rewards/{r.name}/mean"] = float(col.mean()) if col.numel() else float("nan")
        row[f"rewards/{r.name}/std"] = float(gl.sample_std(col)) if col.numel() > 1 else 0.0
    return row


# ---- the command --------------------------------------------------------------------------------------------
def prepare(flags: Flags, overrides: list[str]):
    """Everything before training, writing nothing: (options, rewards, checkpoint, tokenizer, prompts, the saved
    state to resume from or None)."""
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.interop.checkpoints import open_checkpoint
    from meshlm.tune.align import chat_template

    for o in overrides:  # --parallel.*: the layout (`tune/grpo_parallel.py` checks them)
        if not (flags.adapter == "lora" and o.removeprefix("--").startswith("tune.lora_")
                or o.removeprefix("--").startswith("parallel.")):
            raise ConfigError(f"--method {flags.method} takes no {o.split('=')[0]} yet; its own flags set the run "
                              "(and --parallel.tp, pp, dp, zero; with --adapter lora, --tune.lora_rank, _alpha, "
                              "_dropout, _targets)")
    opts = check_options(flags)
    rewards = load_rewards(list(flags.reward), None if flags.reward_weights is None else list(flags.reward_weights))
    check_output_dir("--out", opts.out)
    resume = resume_point(opts, rewards)
    checkpoint = open_checkpoint(opts.checkpoint)
    cfg = checkpoint.config
    if not get_spec(cfg.model.family).decoder:
        raise ConfigError(f"--checkpoint {opts.checkpoint!r} holds a model.family={cfg.model.family!r} model; "
                          f"--method {opts.method} needs a decoder (GPT) checkpoint")
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    prompts = read_prompts(opts.train, tokenizer, chat_template(cfg.data.tokenizer, opts.chat_template),
                           cfg.model.seq_len, opts.max_completion_length)
    first = prompts[0]
    for r in rewards:  # a reward that cannot score an empty completion of the first row fails now, not mid-run
        try:
            call_reward(r, first.text, "", first.row, f"{first.where} (an empty completion, checked before training)")
        except RewardError as err:
            raise ConfigError(str(err)) from None
    return opts, rewards, checkpoint, tokenizer, prompts, resume


# ---- resuming ----------------------------------------------------------------------------------------------
def run_info(opts: Options, rewards: list[Reward]) -> dict:
    """DIR/grpo.json: what the run is; a resumed run must match it in all but `steps` and `save_every` (and
    where --out is: a moved directory resumes)."""
    return {"rewards": [[r.name, r.weight] for r in rewards],
            **{k: v for k, v in asdict(opts).items() if k not in ("loss", "out")}, **asdict(opts.loss)}


def resume_point(opts: Options, rewards: list[Reward]) -> dict | None:
    """The saved state of the run in --out (None: a new run), checked against these options; a non-empty
    --out without one, a different run's, or one already past --steps is a ConfigError (nothing written)."""
    out = Path(opts.out)
    if not out.exists() or not any(out.iterdir()):
        return None
    if not (out / STATE_FILE).exists() or not (out / INFO_FILE).exists():
        raise ConfigError(f"--out {opts.out!r} is not empty and holds no GRPO run to resume ({STATE_FILE}); give a "
                          "new directory")
    saved = json.loads((out / INFO_FILE).read_text())
    ignored = ("steps", "save_every")
    now = json.loads(json.dumps(run_info(opts, rewards)))
    changed = sorted(k for k in set(saved) | set(now) if k not in ignored and saved.get(k) != now.get(k))
    if changed:
        raise ConfigError(f"--out {opts.out!r} holds a run with other settings ({', '.join(changed)}); resume with "
                          "the same flags (only --steps and --save-every may change) or give a new directory")
    state = torch.load(out / STATE_FILE, map_location="cpu", weights_only=True)
    if state["step"] >= opts.steps:
        raise ConfigError(f"--out {opts.out!r} has already run {state['step']} steps; give --steps above that to "
                          "go on")
    return state


def save_state(out: Path, model, optimizer, step: int, tokens: int, rollouts: dict | None = None) -> None:
    """DIR/grpo_state.pt: the trained parameters (the adapter's, or every weight), AdamW's state, the step, the
    tokens so far and the rollout source's state (`RolloutSource.state`: the prompt file's position and the
    batches sampled ahead under --off-policy-lag), written whole or not at all. The sampling itself needs
    nothing: its seeds follow from --seed, the step and the row."""
    params = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    tmp = out / (STATE_FILE + ".tmp")
    torch.save({"step": step, "tokens": tokens, "params": params, "optim": optimizer.state_dict(),
                "rollouts": rollouts}, tmp)
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


def run_grpo(flags: Flags, overrides: list[str], make_sampler: MakeSampler) -> int:
    """`meshlm align --method grpo|rloo` (parsed by `meshlm.commands.align`), sampling with
    `make_sampler(model, tokenizer, rows, positions)` (`meshlm.commands.align.engine_sampler`)."""
    from meshlm.checkpoint.load import load_model
    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.families.registry import get_spec
    from meshlm.train.log import RunLog

    opts, rewards, checkpoint, tokenizer, prompts, resume = prepare(flags, overrides)
    if resume is not None and "layout" in resume:  # a parallel run's state (`grpo_parallel.save_state`)
        raise ConfigError(f"--out {opts.out!r} holds a run of layout [tp, pp, dp, zero] = {resume['layout']}; resume "
                          "it under torchrun with that layout or give a new directory")
    torch.manual_seed(opts.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = get_spec(checkpoint.config.model.family)
    model = load_model(checkpoint, spec, device)  # eval mode: dropout off
    if opts.adapter == "lora":
        add_lora(model, spec, checkpoint, overrides)
    reference = make_reference(model, opts, lora=opts.adapter == "lora")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opts.lr, betas=(0.9, 0.99),
                                  weight_decay=0.0)
    if resume is not None:  # after the reference was made: it is the base, not the resumed weights
        load_state(model, optimizer, resume)
    first, tokens = (resume["step"], resume["tokens"]) if resume is not None else (0, 0)
    longest = max(len(p.ids) for p in prompts) + opts.max_completion_length
    n_rows = opts.prompts_per_step * opts.group_size
    sample = make_sampler(model, tokenizer, n_rows, longest)
    saved = (resume or {}).get("rollouts") or {"cursor": first * opts.prompts_per_step, "queued": []}
    source = RolloutSource(model, sample, tokenizer, rewards, prompts, opts, saved["cursor"], saved["queued"])
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / INFO_FILE).write_text(json.dumps(run_info(opts, rewards), indent=1) + "\n")
    say(f"{opts.method} ({opts.loss.loss_type}, beta {opts.loss.beta:g}) on {opts.checkpoint}: {opts.steps} steps of "
        f"{opts.prompts_per_step} prompts x {opts.group_size} completions, lr {opts.lr:g}"
        + (f"; resuming after step {first}" if first else ""))
    log = RunLog(out, is_main=True)  # metrics.jsonl (cut back to `first`) and TensorBoard, as the trainer's
    log.open(first, opts.steps, progress=False)
    try:
        for step in range(first + 1, opts.steps + 1):
            row = one_step(model, reference, source, optimizer, rewards, opts, step)
            tokens += int(row["completion_tokens"])
            log.write({**row, "tokens": tokens})
            log.log(f"step {step}: reward {row['reward']:.4f} ± {row['reward_std']:.4f} | loss {row['loss']:.4f} | "
                    f"length {row['completion_length']:.1f} | zero-std groups {row['frac_reward_zero_std']:.2f} | "
                    f"logprob mismatch {row['logprob_mismatch_max']:.2e} | gen {row['generation_s']:.1f}s "
                    f"train {row['training_s']:.1f}s")
            if step % opts.save_every == 0 or step == opts.steps:
                save_state(out, model, optimizer, step, tokens, source.state())
    finally:
        log.close()
    if opts.adapter == "lora":  # DIR's checkpoint is the base with the adapter merged in
        from meshlm.tune.lora import merge_lora

        for linear in [m for m in model.modules() if hasattr(m, "_lora_hook")]:
            merge_lora(linear)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    save_checkpoint(out, opts.steps, {"model": state, "optim": optimizer.state_dict(),
                                      "state": {"step": opts.steps, "tokens_seen": 0}}, checkpoint.config.to_dict())
    say(f"{opts.method}: {opts.steps} steps; the trained model is {opts.out}'s checkpoint")
    return 0
