"""`meshlm align`: preference optimisation (DPO, IPO, SimPO) of a checkpoint on prompt / chosen / rejected
pairs, or online reinforcement learning (GRPO, RLOO) with reward functions on prompts (docs/align.md); the
work is `meshlm.tune.align.run_align`'s and `meshlm.tune.grpo.run_grpo`'s."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshlm.tune.align import AlignOptions
    from meshlm.tune.grpo import Flags

PREFERENCE = ("dpo", "ipo", "simpo")
ONLINE = ("grpo", "rloo")
METHODS = PREFERENCE + ONLINE
ADAPTERS = ("none", "lora")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # --method grpo's normalisations (meshlm/tune/grpo_loss.py)
DEFAULT_BETA = {"preference": 0.1, "online": 0.0}  # TRL's DPOConfig / GRPOConfig defaults


def _align(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.core.config import ConfigError

    if args.method in ONLINE:
        from meshlm.tune import grpo_parallel
        from meshlm.tune.grpo import run_grpo

        if grpo_parallel.wanted(overrides):  # torchrun, or --parallel.*: the layouts' run (tune/grpo_parallel.py)
            return grpo_parallel.run(grpo_flags(args), overrides, engine_sampler)
        return run_grpo(grpo_flags(args), overrides, engine_sampler)
    if args.valid is None:
        raise ConfigError(f"--method {args.method} needs --valid FILE.jsonl (held-out pairs)")
    from meshlm.commands.train import trainer_extensions
    from meshlm.tune.align import run_align

    return run_align(align_options(args), overrides, trainer_extensions)


def align_options(args: argparse.Namespace) -> AlignOptions:
    """The typed options of `meshlm align --method dpo|ipo|simpo`'s parsed flags (what `meshlm.tune.align` takes;
    --beta's preference default filled in)."""
    from meshlm.tune.align import AlignOptions

    beta = DEFAULT_BETA["preference"] if args.beta is None else args.beta
    return AlignOptions(checkpoint=args.checkpoint, method=args.method, train=args.train, valid=args.valid,
                        out=args.out, beta=beta, label_smoothing=args.label_smoothing,
                        simpo_gamma=args.simpo_gamma, adapter=args.adapter, epochs=args.epochs,
                        max_length=args.max_length, chat_template=args.chat_template)


def grpo_flags(args: argparse.Namespace) -> Flags:
    """The typed flags of `meshlm align --method grpo|rloo` (what `meshlm.tune.grpo` takes): the online RL group's
    and the shared ones GRPO reads (--beta's online default filled in; lists as tuples)."""
    import dataclasses

    from meshlm.tune.grpo import Flags

    names = {f.name for f in dataclasses.fields(Flags)}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k in names}
    beta = DEFAULT_BETA["online"] if given["beta"] is None else given["beta"]
    return Flags(**{**given, "reward": given["reward"] or (), "beta": beta})  # no --reward: checked in grpo.prepare


def engine_sampler(model, tokenizer, rows: int, positions: int, par=None):
    """GRPO's sampler (`meshlm.tune.grpo.Sample`): meshlm's Engine on `model` itself (no copy: each rollout
    samples from the weights as they are), `rows` requests at once of up to `positions` tokens, prefix
    caching off (a cached prefix would keep keys and values of older weights). Returns, per prompt, the sampled
    ids and the engine's log-prob of each (the raw distribution, before temperature and top-k).

    `par`: this rank's `Parallelized` part of the model under torchrun (`meshlm.tune.grpo_parallel`). Under
    tensor parallelism every tp rank runs its own engine in lockstep (its runner all-gathers the vocab-split
    logits, so each samples the same tokens); under pipeline parallelism rank 0's engine drives serve's
    `PipelineRunner`, the other ranks replay its steps, and rank 0's completions are broadcast to every rank."""
    from meshlm.infer.engine import CacheOptions, Engine
    from meshlm.infer.runner import Runner

    options = CacheOptions(prefix_caching=False, max_batched_tokens=None)
    dims = par.dims if par is not None else None
    if dims is not None and dims.pp > 1:
        return _pipeline_sampler(par, tokenizer, rows, positions, options)
    runner = None
    if dims is not None and dims.tp > 1:
        runner = Runner(model, options.blocks_for(rows, positions), options.block_size, model.cfg.vocab_size,
                        tp_group=dims.tp_group)
    engine = Engine(model, tokenizer, max_seqs=rows, max_len=positions, max_queue=max(256, rows), runner=runner,
                    options=options)
    return lambda prompts, max_tokens, temperature, top_k, seeds: _generate(engine, prompts, max_tokens, temperature,
                                                                         top_k, seeds)


def _generate(engine, prompts: list[list[int]], max_tokens: int, temperature: float, top_k: int, seeds: list[int]):
    from meshlm.infer.sampling import SamplingParams

    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed, logprobs=0)
              for seed in seeds]
    reqs = engine.generate(prompts, params)
    failed = [r.error for r in reqs if getattr(r, "error", None)]
    if failed:
        raise RuntimeError(f"generation failed: {failed[0]}")
    return [(list(r.output_ids), [t.logprob for t in r.output]) for r in reqs]


def _pipeline_sampler(par, tokenizer, rows: int, positions: int, options):
    """The pipeline's sampler: rank 0 runs the engine over `PipelineRunner` and stops the other ranks' replay
    loop after each rollout; its completions (or its error) are then broadcast to every rank."""
    import torch.distributed as dist

    from meshlm.infer.engine import Engine
    from meshlm.infer.pipeline_runner import PipelineRunner
    from meshlm.infer.runner import worker_loop

    dims, model = par.dims, par.model
    runner = PipelineRunner(model, par.pipeline, options.blocks_for(rows, positions), options.block_size,
                            model.cfg.vocab_size, tp_group=dims.tp_group if dims.tp > 1 else None)
    engine = Engine(model, tokenizer, max_seqs=rows, max_len=positions, max_queue=max(256, rows), runner=runner,
                    options=options) if dims.rank == 0 else None

    def sample(prompts, max_tokens, temperature, top_k, seeds):
        box = [(None, None)]  # (rank 0's error, its completions)
        if engine is None:
            worker_loop(runner)
        else:
            try:
                box[0] = (None, _generate(engine, prompts, max_tokens, temperature, top_k, seeds))
            except Exception as err:  # noqa: BLE001 -- every rank raises it, after the broadcast below
                box[0] = (f"{type(err).__name__}: {err}", None)
            finally:
                runner.shutdown()
        dist.broadcast_object_list(box, src=0)
        error, out = box[0]
        if error is not None:
            raise RuntimeError(f"generation failed on rank 0: {error}")
        return out

    return sample


def _add_online_flags(p) -> None:
    """--method grpo|rloo's flags (TRL's GRPOConfig names and defaults where it has them)."""
    g = p.add_argument_group("online RL (--method grpo|rloo)")
    g.add_argument("--reward", action="append", metavar="MODULE:FUNCTION",
                   help="a reward function f(prompt, completion, row) -> float; repeat for several (built-ins: "
                        "meshlm.tune.rewards:exact_number, exact_string, format_regex)")
    g.add_argument("--reward-weights", type=float, nargs="+", default=None, metavar="W",
                   help="one weight per --reward (default 1 each)")
    g.add_argument("--num-generations", type=int, default=4, metavar="G", help="completions per prompt (default 4)")
    g.add_argument("--prompts-per-step", type=int, default=4, metavar="P", help="prompts per step (default 4)")
    g.add_argument("--steps", type=int, default=10, help="optimisation steps (default 10)")
    g.add_argument("--num-iterations", type=int, default=1, metavar="MU",
                   help="optimisation passes over each step's completions (default 1: on-policy)")
    g.add_argument("--loss-type", choices=LOSS_TYPES, default="grpo",
                   help="the loss's normalisation (default grpo; dapo: token-level, dr_grpo: constant length)")
    g.add_argument("--epsilon", type=float, default=0.2, help="the ratio's clip range (default 0.2)")
    g.add_argument("--epsilon-high", type=float, default=None,
                   help="the upper clip range (default --epsilon; DAPO's clip-higher: 0.28)")
    g.add_argument("--scale-rewards", choices=("group", "batch", "none"), default="group",
                   help="divide advantages by the group's std, the batch's, or not (Dr. GRPO: none)")
    g.add_argument("--max-completion-length", type=int, default=64, metavar="L",
                   help="tokens per completion at most (default 64)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the K likeliest tokens (default 0: off)")
    g.add_argument("--lr", type=float, default=1e-6, help="AdamW's learning rate (default 1e-6, TRL's)")
    g.add_argument("--seed", type=int, default=0, help="the sampling and initialisation seed (default 0)")
    g.add_argument("--off-policy-lag", type=int, default=0, metavar="K",
                   help="train step s on completions sampled by the weights of step s-1-K (default 0: strictly "
                        "on-policy); the importance ratio to the sampling policy corrects the lag")
    g.add_argument("--dynamic-sampling", action="store_true",
                   help="DAPO's dynamic sampling: drop groups whose rewards are all equal and sample the next "
                        "prompts until --prompts-per-step groups have some variance")
    g.add_argument("--max-sampling-rounds", type=int, default=4, metavar="N",
                   help="generation rounds per step at most under --dynamic-sampling (default 4)")
    g.add_argument("--save-every", type=int, default=10, metavar="N",
                   help="save the run's state every N steps and at the end (default 10): the same --out again "
                        "resumes from it, exactly")


def add_align_command(sub) -> None:
    """Register `meshlm align` on the CLI's subparsers."""
    p = sub.add_parser("align", help="preference optimisation (DPO, IPO, SimPO) or online RL (GRPO, RLOO)",
                       description="DPO, IPO or SimPO of a checkpoint (or of a LoRA adapter on it) on .jsonl lines "
                                   "{\"prompt\", \"chosen\", \"rejected\"}, or GRPO / RLOO on {\"prompt\", ...} "
                                   "lines with --reward functions (docs/align.md); extra --section.key=value override "
                                   "the config (preference methods).")
    p.add_argument("--checkpoint", required=True, help="the base (and frozen reference): a run directory, a step dir "
                   "or a .gguf file")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--train", required=True, metavar="FILE.jsonl")
    p.add_argument("--valid", default=None, metavar="FILE.jsonl", help="held-out pairs (preference methods)")
    p.add_argument("--out", required=True, metavar="DIR", help="the run directory (the same DIR again resumes)")
    p.add_argument("--beta", type=float, default=None, help="the preference strength β (default 0.1), or the KL "
                   "penalty's weight for grpo|rloo (default 0: no reference model)")
    p.add_argument("--label-smoothing", type=float, default=0.0, metavar="EPS",
                   help="conservative DPO / SimPO: the share of pairs assumed flipped (default 0)")
    p.add_argument("--simpo-gamma", type=float, default=0.5, metavar="GAMMA",
                   help="SimPO's target reward margin γ (default 0.5, TRL's)")
    p.add_argument("--adapter", choices=ADAPTERS, default="none",
                   help="none: train every weight (default); lora: a LoRA adapter on the frozen base (tune.lora_*)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training pairs (default 1; "
                                                          "--train.max_steps overrides)")
    p.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="tokens per row, prompt + completion (default model.seq_len)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="the Jinja2 chat template of conversational lines (default: the base tokenizer's, or "
                        "meshlm's builtin one)")
    _add_online_flags(p)
    p.set_defaults(func=_align)
