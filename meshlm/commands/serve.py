"""`meshlm serve`: an OpenAI-compatible HTTP server for a checkpoint (`meshlm/infer/server.py`)."""

from __future__ import annotations

import argparse
import ipaddress
import math
import socket

from meshlm.core.config import ConfigError
from meshlm.infer.protocol import MAX_BODY_BYTES


def _layout_of(overrides: list[str]) -> tuple[int, int]:
    """(tp, pp): the tensor- and pipeline-parallel degrees of the only overrides serve takes, `--parallel.tp=N`
    and `--parallel.pp=N` (default 1 each)."""
    degrees = {"--parallel.tp": 1, "--parallel.pp": 1}
    for o in overrides:
        key, _, value = o.partition("=")
        if key not in degrees:
            raise ConfigError(f"serve takes only the overrides --parallel.tp=N and --parallel.pp=N (got {o!r}); see "
                              "meshlm serve -h")
        try:
            degrees[key] = int(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} must be an integer >= 1") from None
        if degrees[key] < 1:
            raise ConfigError(f"{key}={degrees[key]} must be >= 1")
    return degrees["--parallel.tp"], degrees["--parallel.pp"]


def _check_host(host: str) -> None:
    """ConfigError unless `host` is an address this machine can listen on (an IP address of one of its
    interfaces, a wildcard like 0.0.0.0, or a name that resolves to one), checked by binding a socket to it on
    a free port."""
    hint = "give an address of this machine, e.g. 127.0.0.1 (loopback) or 0.0.0.0 (every interface)"
    if all(c.isdigit() or c == "." for c in host):  # looks like IPv4: must be one (never looked up as a name)
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ConfigError(f"--host {host!r} is not a valid IPv4 address; {hint}") from None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError) as err:
        raise ConfigError(f"--host {host!r} does not resolve to an address ({getattr(err, 'strerror', err)}); "
                          f"{hint}") from None
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(address)
        except OSError as err:
            raise ConfigError(f"--host {host!r} cannot be listened on here ({err.strerror}); {hint}") from None


def _serve(args: argparse.Namespace, overrides: list[str]) -> int:
    tp, pp = _layout_of(overrides)
    from meshlm.infer.server import require_serving_dependencies, serve

    require_serving_dependencies()
    checks = [(0 <= args.port <= 65535, f"--port {args.port} must be in 0..65535"),
              (args.max_seqs >= 1, f"--max-seqs {args.max_seqs} must be >= 1"),
              (args.max_queue >= 1, f"--max-queue {args.max_queue} must be >= 1"),
              (args.max_len is None or args.max_len >= 2, f"--max-len {args.max_len} must be >= 2"),
              (args.api_key is None or args.api_key.strip() != "", "--api-key must not be empty"),
              (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0,
               f"--drain-timeout {args.drain_timeout} must be a number of seconds >= 0 (0: do not wait)"),
              (args.max_body_bytes >= 1,
               f"--max-body-bytes {args.max_body_bytes} must be >= 1 (default {MAX_BODY_BYTES}: 4 MiB)")]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if args.max_thinking_tokens is not None and (args.max_thinking_tokens < 0 or args.reasoning_parser is None):
        raise ConfigError(f"--max-thinking-tokens {args.max_thinking_tokens} must be >= 0 and needs "
                          "--reasoning-parser (the thinking model's format)")
    options = cache_options(args)
    if args.compile and (tp > 1 or pp > 1 or args.adapter or args.allow_runtime_lora):
        raise ConfigError("--compile compiles one process's step without adapters; drop --compile, or the "
                          "--parallel / --adapter / --allow-runtime-lora flags")
    quantize = quantize_options(args)
    _check_host(args.host)
    replies = {"tool_parser": args.tool_parser, "reasoning_parser": args.reasoning_parser,
               "max_thinking_tokens": args.max_thinking_tokens}
    return serve(args.checkpoint, args.host, args.port, args.max_seqs, args.max_len, args.max_queue, args.api_key,
                 args.served_model_name, tp, args.adapter, args.log_level, args.drain_timeout, args.max_body_bytes,
                 options, args.allow_runtime_lora, quantize=quantize, replies=replies, pp=pp, dtype=args.dtype,
                 engine_process=args.engine_process)


def add_serve_command(sub) -> None:
    """Register `meshlm serve` on the CLI's subparsers."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for a checkpoint (needs meshlm[serve])")
    p.add_argument("--checkpoint", required=True, help="run directory (its latest checkpoint), a step directory, "
                   "or a .gguf file (converted once into $MESHLM_CACHE/gguf/)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the "
                                                              "checkpoint directory's name)")
    p.add_argument("--max-seqs", type=int, default=32, help="sequences decoded together (rows of the KV cache)")
    p.add_argument("--max-len", type=int, default=None, help="positions per cache row, prompt and output "
                                                             "(default: model.seq_len)")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a row; beyond: 429")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds SIGTERM waits for open requests")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="the largest request body taken; a "
                   "larger one is answered 413 before it is read (default: 4 MiB)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--adapter", action="append", default=None, metavar="[NAME=]DIR", help="an adapter of meshlm "
                   "tune (or PEFT; LoRA or prompt tuning) tuned on --checkpoint, served as model NAME (default: DIR's "
                   "name) next to the base; repeat it for several, chosen per request by the model field")
    p.add_argument("--allow-runtime-lora", action="store_true", help="allow POST /v1/load_lora_adapter and "
                   "/v1/unload_lora_adapter (LoRA adapters of this base, added and removed while serving; behind "
                   "--api-key when one is set)")
    r = p.add_argument_group("tool calls and reasoning (docs/serving.md)")
    r.add_argument("--tool-parser", choices=["hermes", "llama3_json", "mistral"], default=None, help="how the model "
                   "writes tool calls (default: found from what the chat template renders for a tool)")
    r.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"], default=None, help="split the reply's "
                   "<think>...</think> into reasoning_content (default: none)")
    r.add_argument("--max-thinking-tokens", type=int, default=None, help="close the think block after this many "
                   "tokens (a request's max_thinking_tokens overrides it; needs --reasoning-parser)")
    g = p.add_argument_group("KV cache and scheduling (docs/serving.md)")
    g.add_argument("--block-size", type=int, default=16, help="positions per KV cache block (default 16)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks in the pool (default: "
                   "--max-seqs rows of --max-len positions)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share the cache blocks of identical prompt prefixes between requests")
    g.add_argument("--max-batched-tokens", type=int, default=512, help="tokens one step runs at most: decoding "
                   "rows first, then prefill chunks of long prompts (default 512; 0: whole prompts, no chunking)")
    g.add_argument("--speculative", choices=["ngram", "draft", "mtp"], default=None, help="speculative decoding: ngram "
                   "(prompt lookup), draft (a smaller checkpoint, --draft-checkpoint, with the same tokenizer) or mtp "
                   "(the model's own multi-token prediction modules, model.mtp_depth: up to that many tokens a step)")
    g.add_argument("--draft-checkpoint", default=None, help="the draft model of --speculative draft")
    g.add_argument("--num-draft-tokens", type=int, default=4, help="tokens proposed per step (default 4)")
    g.add_argument("--compile", action="store_true", help="run each step as one torch.compile graph (weights frozen, "
                   "matrix products autotuned), compiled at start (minutes on a 2-core CPU with a cold cache; decode "
                   "steps 1.3-3x faster there, docs/serving.md)")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None, help="the engine in a "
                   "process of its own, as vLLM runs it: the HTTP server's Python no longer shares the engine's "
                   "interpreter (default: wherever it can, one process's decoder without run-time adapters; "
                   "--no-engine-process keeps one process; docs/serving.md)")
    add_dtype_flag(p)
    add_quantize_flags(p)
    p.set_defaults(func=_serve)


def add_dtype_flag(p) -> None:
    """`--dtype fp32|bf16|fp16` (serve, generate): the weights, activations and KV cache in that precision."""
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="the weights, activations "
                   "and KV cache in this precision (default fp32; bf16 halves the weights and the cache and is "
                   "faster where the CPU computes it natively, AVX512-BF16 or AMX; docs/serving.md)")


def add_quantize_flags(p) -> None:
    """`--quantize`, `--quantize-group-size`, `--quantize-float-head` (serve, generate, eval; infer/quantize.py)."""
    g = p.add_argument_group("quantized weights (docs/serving.md)")
    g.add_argument("--quantize", default=None, metavar="int8|int4", help="weight-only quantization of the "
                   "transformer blocks' linears on a CPU: int8 (per-channel scales) or int4 (group-wise scales and "
                   "zero points); one process only")
    g.add_argument("--quantize-group-size", type=int, default=32, metavar="N", help="int4: inputs per scale and "
                   "zero point, 32, 64 or 128 (default 32)")
    g.add_argument("--quantize-float-head", action="store_true", help="keep the output head in float (by "
                   "default it goes to int8 too: faster decoding of a large vocabulary; docs/serving.md)")


def quantize_options(args: argparse.Namespace):
    """The checked `infer.quantize.QuantizeOptions` of the flags (None: no --quantize)."""
    if args.quantize is None:
        if args.quantize_float_head or args.quantize_group_size != 32:
            raise ConfigError("--quantize-group-size and --quantize-float-head go with --quantize int8|int4")
        return None
    from meshlm.infer.quantize import QuantizeOptions

    return QuantizeOptions(args.quantize, args.quantize_group_size, not args.quantize_float_head)


def cache_options(args: argparse.Namespace):
    """The engine's CacheOptions from the flags, each checked (ConfigError naming the flag)."""
    from meshlm.infer.engine import CacheOptions

    checks = [(args.block_size >= 1, f"--block-size {args.block_size} must be >= 1"),
              (args.num_blocks is None or args.num_blocks >= 1, f"--num-blocks {args.num_blocks} must be >= 1"),
              (args.max_batched_tokens >= 0,
               f"--max-batched-tokens {args.max_batched_tokens} must be >= 0 (0: no limit)"),
              (1 <= args.num_draft_tokens <= 16, f"--num-draft-tokens {args.num_draft_tokens} must be in 1..16"),
              ((args.speculative == "draft") == (args.draft_checkpoint is not None),
               "--speculative draft needs --draft-checkpoint DIR (and --draft-checkpoint needs --speculative draft)")]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    return CacheOptions(args.block_size, args.num_blocks, args.prefix_caching, args.max_batched_tokens or None,
                        args.speculative, args.draft_checkpoint, args.num_draft_tokens, compile=args.compile)
