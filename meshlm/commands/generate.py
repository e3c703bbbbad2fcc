"""`meshlm generate`: sample text from a checkpoint (KV cache, temperature, top-k, nucleus; an adapter of
`meshlm tune` on top). Generation ends at any of the model's declared end-of-sequence ids (the tokenizer's
`stop_ids`), which is not printed."""

from __future__ import annotations

import argparse
import math
import sys

from meshlm.commands.serve import add_dtype_flag, add_quantize_flags, quantize_options
from meshlm.core.config import ConfigError


def check_sampling(args: argparse.Namespace) -> None:
    """The sampling arguments of `meshlm generate` (the lengths are checked against the model later)."""
    from meshlm.core.config import SEED_MAX

    checks = [
        (args.max_new_tokens >= 0, f"--max-new-tokens {args.max_new_tokens} must be >= 0"),
        (math.isfinite(args.temperature) and args.temperature >= 0,
         f"--temperature {args.temperature} must be a finite number >= 0 (0: greedy decoding)"),
        (args.top_k >= 0, f"--top-k {args.top_k} must be >= 0 (0: keep every token)"),
        (math.isfinite(args.top_p) and 0 < args.top_p <= 1,
         f"--top-p {args.top_p} must be in (0, 1] (1: off; e.g. 0.9 keeps the tokens holding 90% of the mass)"),
        (args.seed is None or 0 <= args.seed <= SEED_MAX, f"--seed {args.seed} must be in 0..{SEED_MAX}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _check_lengths(cfg, n_prompt: int, max_new_tokens: int) -> int:
    """How many tokens to generate: a prompt longer than the context is an error; with learned positions,
    generation stops at model.seq_len (said on stderr); RoPE may go further while the KV cache fits."""
    from meshlm.core.fit import check_fits, kv_cache_bytes
    from meshlm.train.fit import weights_bytes

    m = cfg.model
    if n_prompt > m.seq_len:
        raise ConfigError(f"--prompt is {n_prompt} tokens, longer than the model's context of model.seq_len="
                          f"{m.seq_len} tokens; shorten the prompt")
    if m.position == "learned" and n_prompt + max_new_tokens > m.seq_len:
        print(f"note: generating {m.seq_len - n_prompt} tokens, not {max_new_tokens}: the prompt "
              f"({n_prompt} tokens) and the new tokens fill the model's context of model.seq_len={m.seq_len} "
              "(learned positions)", file=sys.stderr)
        max_new_tokens = m.seq_len - n_prompt
    needed = {"weights": weights_bytes(m), "KV cache": kv_cache_bytes(m, 1, n_prompt + max_new_tokens)}
    check_fits(needed, f"generating {max_new_tokens:,} tokens", "lower --max-new-tokens (at most model.seq_len="
               f"{m.seq_len} is what the model was trained for)")
    return max_new_tokens


def _generate(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"generate takes no config overrides (got {overrides[0]!r}); see meshlm generate -h")
    check_sampling(args)
    quantize = quantize_options(args)
    import torch

    from meshlm.checkpoint.load import load_model
    from meshlm.core.precision import cast_parameters, serving_dtype_note
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.infer.local import GenerationFailed, local_engine, stream
    from meshlm.infer.sampling import SamplingParams
    from meshlm.interop.checkpoints import open_checkpoint
    from meshlm.models.generate import NonFiniteLogits, cut_at_stop, generate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    checkpoint = open_checkpoint(args.checkpoint)  # resolved and verified once; a fallback note said once
    cfg = checkpoint.config
    spec = get_spec(cfg.model.family)
    if not spec.decoder:
        raise ConfigError(f"{args.checkpoint} holds a model.family={cfg.model.family!r} model, which does not "
                          "generate text; use meshlm embed or meshlm finetune with it, or a GPT checkpoint here")
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    ids = tokenizer.encode(args.prompt) or [tokenizer.eod_id]
    adapter, head = None, []
    if args.adapter is not None:  # checked against this base before anything is loaded
        from meshlm.tune.export import apply_adapter, read_adapter

        adapter = read_adapter(args.adapter, cfg, checkpoint)
        # As the tuning data lays an example out (tune/data.py): the task's virtual-token placeholders (a
        # prompt adapter), then the prompt; nothing else.
        head = [adapter.task_index(args.task)] * adapter.virtual_tokens
    elif args.task is not None:
        raise ConfigError("--task chooses the virtual prompt of an --adapter; give --adapter DIR")
    max_new_tokens = _check_lengths(cfg, len(head) + len(ids), args.max_new_tokens)
    model = load_model(checkpoint, spec, device)
    served, index = None, 0
    if adapter is not None and adapter.tune.method == "lora":
        apply_adapter(model, cfg, adapter)  # LoRA merged into the weights: no extra work per token
    elif adapter is not None:  # the task's virtual tokens placed before the prompt at prefill (infer/adapters.py)
        from meshlm.infer.adapters import AdapterSet

        served, index = AdapterSet(model, cfg, [("adapter", one_task(adapter, args.task))]), 1
    if args.dtype != "fp32":
        if note := serving_dtype_note(args.dtype, torch.device(device)):
            print(f"note: {note}", file=sys.stderr)
        cast_parameters(model, args.dtype)
    if quantize is not None:  # after merging: the adapter's update is quantized with the base
        print(f"note: {quantize.apply(model).line()}", file=sys.stderr)
    stops = () if args.ignore_eos else tokenizer.stop_ids
    try:
        if max_new_tokens == 0:
            new = []
        elif args.no_cache:  # every step recomputes the whole prefix (a check of the cached path)
            prompt = torch.tensor([head + ids], device=device)
            out = generate(model, prompt, max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, use_cache=False, stop_ids=stops)
            new = out[0, prompt.shape[1]:].tolist()
        else:  # the serving engine's paged path, in this process (infer/local.py)
            engine = local_engine(model, tokenizer, len(head) + len(ids) + max_new_tokens, served)
            params = SamplingParams(max_tokens=max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                    top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
            new = list(stream(engine, ids, params, adapter=index))
    except (NonFiniteLogits, GenerationFailed) as err:
        raise ConfigError(f"{args.checkpoint}: {err}") from None
    new, _ = cut_at_stop(new, stops)  # the reply ends before its stop id
    print(tokenizer.decode(ids + new))
    return 0


def one_task(adapter, task: str | None):
    """A prompt `adapter` (tune.export.Adapter) with only `task`'s virtual tokens (the engine serves one table)."""
    from dataclasses import replace

    i = adapter.task_index(task)
    table = adapter.tensors["prompt.table"]
    return replace(adapter, tensors={**adapter.tensors, "prompt.table": table[i:i + 1]},
                   tasks=adapter.tasks[i:i + 1])


def add_generate_command(sub) -> None:
    """Register `meshlm generate` on the CLI's subparsers."""
    gen = sub.add_parser("generate", help="sample text from a checkpoint")
    gen.add_argument("--checkpoint", required=True, help="run directory (uses its latest checkpoint), a step dir, "
                     "or a .gguf file (converted once into $MESHLM_CACHE/gguf/)")
    gen.add_argument("--prompt", default="\n")
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true", help="go on past the model's end-of-sequence ids (as "
                     "the API's ignore_eos): exactly --max-new-tokens tokens, the end ids printed as text")
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole prefix each step")
    gen.add_argument("--adapter", default=None, metavar="DIR", help="an adapter of meshlm tune (or a PEFT "
                     "directory) tuned on --checkpoint")
    gen.add_argument("--task", default=None, help="with a several-task prompt adapter: the task's prompt")
    add_dtype_flag(gen)
    add_quantize_flags(gen)
    gen.set_defaults(func=_generate)
