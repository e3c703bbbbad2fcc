"""`meshlm serve` against `vllm serve` (the serving issue): the same weights, the same OpenAI-client load, one
server at a time on this machine.

    bash benchmarks/setup_vllm.sh                  # once: vLLM's CPU build in its own venv (not .venv)
    .venv/bin/python benchmarks/serve_vs_vllm.py   # the full run (~15 min alone on a 2-core CPU)
    .venv/bin/python benchmarks/serve_vs_vllm.py --quick                    # a small end-to-end run
    .venv/bin/python benchmarks/serve_vs_vllm.py --meshlm-args="--some-flag 1" --json out.json
    .venv/bin/python benchmarks/serve_vs_vllm.py --smoke        # meshlm alone (vLLM skipped) on a 1-layer demo-
                                                                # shaped random model: 2 requests of 2 tokens

For each size: the meshlm checkpoint, exported with `meshlm convert --checkpoint RUN --to-hf DIR`; vLLM serves
the export, then meshlm serves the checkpoint; each server runs alone, gets one warm-up, then every workload
at every client count (benchmarks/serve_load.py: the official `openai` client, streamed /v1/completions of
token-id prompts, greedy, `ignore_eos`, exactly `--max-tokens` output tokens), and is stopped (its whole
process group: no orphans on an error or Ctrl-C). One table at the end, with meshlm's output tokens/s over
vLLM's on the same row.

The choices, sized so that the full run takes about 15 minutes alone on a 2-core Xeon (fp32):
- sizes: `demo`, the README's model (configs/demo.toml: Llama style, 6 x 256, vocabulary 4,096, 256
  positions), trained for `--demo-steps` (20, about 80 s) steps of the demo config into a temporary
  directory unless `--demo-checkpoint RUN` is given (`make demo`'s runs/demo: the full 25-minute training;
  throughput does not depend on how well it is trained); `gpt2-124m`, configs/gpt2-124m.toml's shape (12 x 768,
  GPT-2 vocabulary, 1,024 positions), randomly initialised and saved as a checkpoint.
- workloads, lengths within each model's context: demo: random prompts of 96-160 tokens, or a shared
  144-token system prompt + a 16-40-token user turn; gpt2-124m: random 128-256, or a 512-token system prompt
  + 16-48; `--max-tokens` 64 output tokens per request.
- clients 1, 16, 64; requests per point: demo max(16, 2 x clients), gpt2-124m max(8, clients) (so 16 and 64
  clients keep every client busy from the start), or max(`--requests`, clients).
- precision: float32 on both servers (this CPU has no native bf16; meshlm serves fp32 weights, vLLM gets
  `--dtype float32`).
- vLLM settings (the fastest found on this machine, see docs/serving.md "Against vLLM"): its defaults (V1
  engine, chunked prefill, prefix caching, torch.compile) with `--max-num-seqs` = the most clients,
  VLLM_CPU_KVCACHE_SPACE=4 (GiB), Debian's tcmalloc and the venv's Intel OpenMP preloaded (vLLM's CPU guide),
  its uvicorn access log off, its own thread binding (`auto`: one core computes, one is left to the API
  server). Measured on gpt2-124m at 16 clients: `--vllm-args=--enforce-eager` (no torch.compile) 15-25% and
  `--vllm-bind 0-1` (both cores compute) 25-40% fewer tokens/s; on the demo model both within noise.
  meshlm: `--max-seqs` = the most clients, `--max-len` = the context, OMP_NUM_THREADS=`--threads`, plus
  `--meshlm-args`. The load generator runs in this process and takes some CPU too, alike for both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_load import WORKLOADS, Lengths, corpus_ids, make_requests, run_load, warm_up
from smoke import add_smoke_flag, skipped, tiny_checkpoint

MODEL_NAME = "bench"
DEFAULT_VLLM_VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache" / "meshlm-bench" / "vllm"))


@dataclass
class Size:
    config: str
    context: int
    lengths: Lengths
    min_requests: int
    per_client: int


SIZES = {
    "demo": Size("demo", 256, Lengths(prompt_min=96, prompt_max=160, prefix_tokens=144, user_min=16, user_max=40),
                 min_requests=16, per_client=2),
    "gpt2-124m": Size("gpt2-124m", 1024, Lengths(prompt_min=128, prompt_max=256, prefix_tokens=512, user_min=16,
                                                 user_max=48), min_requests=8, per_client=1),
}


def fail(message: str) -> None:
    print(f"serve_vs_vllm: {message}", file=sys.stderr)
    sys.exit(2)


# ---- servers in their own process groups -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server command in its own session (process group), its output in `log`; `stop` ends the whole
    group (SIGINT, then SIGTERM, then SIGKILL), so no worker it forked outlives it."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log: Path, startup_s: float):
        self.name, self.cmd, self.env, self.port, self.log, self.startup_s = name, cmd, env, port, log, startup_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None

    def __enter__(self):
        start = time.perf_counter()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                         start_new_session=True)
        while time.perf_counter() - start < self.startup_s:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} at start; the end of "
                                   f"{self.log}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        self.startup_took = time.perf_counter() - start
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer within {self.startup_s:.0f} s; the end of {self.log}:\n"
                           f"{self.tail()}")

    def __exit__(self, *exc):
        self.stop()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.time() + wait
            while time.time() < deadline and group_alive(self.proc.pid):
                self.proc.poll()
                time.sleep(0.2)
            if not group_alive(self.proc.pid):
                break
        self.proc.poll()
        self.proc = None


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # zombies of the group leader count as gone once reaped by poll(); others: look for live members
    out = subprocess.run(["ps", "-o", "stat=", "-g", str(pgid)], capture_output=True, text=True,
                         check=False).stdout.split()
    return any(not s.startswith("Z") for s in out)


def vllm_server(hf_dir: Path, size: Size, args, log: Path) -> ServerProcess:
    python = Path(args.vllm_python)
    if not python.exists():
        fail(f"--vllm-python {python} does not exist; run `bash benchmarks/setup_vllm.sh` first (or set "
             f"--vllm-python / VLLM_VENV)")
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(size.context), "--max-num-seqs", str(max(args.clients)),
           "--disable-uvicorn-access-log", *shlex.split(args.vllm_args)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    env.pop("OMP_NUM_THREADS", None)  # vLLM sets its own threads from the binding
    if args.vllm_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
    preload = [str(p) for p in (Path("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                                python.parent.parent / "lib" / "libiomp5.so") if p.exists()]
    if preload and not args.vllm_no_preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    return ServerProcess("vllm", cmd, env, port, log, args.startup_timeout)


def meshlm_server(ckpt: Path, size: Size, args, log: Path) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "meshlm", "serve", "--checkpoint", str(ckpt), "--port", str(port),
           "--served-model-name", MODEL_NAME, "--max-seqs", str(max(args.clients)), "--max-queue", "4096",
           "--max-len", str(size.context), *shlex.split(args.meshlm_args)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    return ServerProcess("meshlm", cmd, env, port, log, args.startup_timeout)


# ---- the checkpoints ---------------------------------------------------------------------------------------------
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


def random_checkpoint(work: Path, config: str) -> Path:
    """configs/<config>.toml's shape, randomly initialised (seed 0), saved as a meshlm checkpoint."""
    out = work / config
    if (out / "checkpoints").exists():
        return out
    print(f"saving a randomly initialised {config} checkpoint ...", flush=True)
    code = ("import sys, torch\n"
            "from meshlm.checkpoint.single import save_checkpoint\n"
            "from meshlm.core.config import load_config\n"
            "from meshlm.families.registry import get_spec\n"
            "cfg = load_config(sys.argv[1], ['--train.out_dir=' + sys.argv[2], '--train.precision=fp32'])\n"
            "torch.manual_seed(0)\n"
            "model = get_spec(cfg.model.family).model_class(cfg.model)\n"
            "save_checkpoint(sys.argv[2], 1, {'model': model.state_dict()}, cfg.to_dict())\n")
    done = subprocess.run([sys.executable, "-c", code, config, str(out)], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"saving {config} failed:\n{done.stderr[-3000:]}")
    return out


def export_hf(ckpt: Path, hf_dir: Path, tokenizer) -> Path:
    """`meshlm convert --to-hf`; where it wrote no tokenizer files (a `shakespeare-bpe:N` vocabulary), the
    tokenizer.json that meshlm tokenizes with, so vLLM can detokenize."""
    if not (hf_dir / "config.json").exists():
        meshlm_cli("convert", "--checkpoint", str(ckpt), "--to-hf", str(hf_dir))
    names = {"tokenizer.json", "vocab.json", "tokenizer.model"}
    vocab_file = Path(getattr(tokenizer, "vocab_file", "") or "")
    if not any((hf_dir / n).exists() for n in names) and vocab_file.name == "tokenizer.json":
        shutil.copyfile(vocab_file, hf_dir / "tokenizer.json")
        (hf_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return hf_dir


# ---- the run -----------------------------------------------------------------------------------------------------
def n_requests(size: Size, clients: int, args) -> int:
    if args.requests:
        return max(args.requests, clients)
    return max(size.min_requests, size.per_client * clients)


def run_server(server: ServerProcess, size_name: str, size: Size, ids: list[int], args, rows: list[dict]) -> None:
    """Every point of one server, appended to `rows` as it is measured (an interrupted run keeps them)."""
    with server:
        print(f"  {server.name} up after {server.startup_took:.0f} s", flush=True)
        warm_up(server.url, MODEL_NAME, size.lengths.longest())
        for workload in args.workloads:
            for c in args.clients:
                prompts = make_requests(workload, ids, n_requests(size, c, args), size.lengths, seed=c)
                load = os.getloadavg()[0]
                r = asyncio.run(run_load(server.url, MODEL_NAME, prompts, c, args.max_tokens))
                row = {"size": size_name, "workload": workload, "server": server.name, "load_before": load,
                       "load_after": os.getloadavg()[0], **asdict(r)}
                rows.append(row)
                print(f"  {server.name:6s} {workload:13s} {c:3d} clients: {r.out_tok_per_s:7.1f} tok/s, "
                      f"TTFT p99 {r.ttft_p99_ms:7.0f} ms, {r.requests} req in {r.wall_s:.1f} s"
                      f"{', ' + str(r.errors) + ' errors: ' + r.first_error if r.errors else ''}", flush=True)


def run_size(size_name: str, work: Path, args, rows: list[dict]) -> None:
    from meshlm.checkpoint.load import open_checkpoint
    from meshlm.data.tokenizers import get_tokenizer

    size = SIZES[size_name]
    if size.lengths.longest() + args.max_tokens > size.context:
        fail(f"--max-tokens {args.max_tokens}: the longest {size_name} prompt ({size.lengths.longest()} tokens) "
             f"+ max_tokens must fit its context of {size.context}; lower --max-tokens")
    ckpt = demo_checkpoint(work, args) if size_name == "demo" else random_checkpoint(work, size.config)
    tokenizer = get_tokenizer(open_checkpoint(str(ckpt)).config.data.tokenizer)
    hf_dir = export_hf(ckpt, work / f"{size_name}-hf", tokenizer) if "vllm" in args.servers else None
    ids = corpus_ids(tokenizer)
    for name in args.servers:
        print(f"{size_name}: {name} ...", flush=True)
        log = work / f"{size_name}-{name}.log"
        server = vllm_server(hf_dir, size, args, log) if name == "vllm" else meshlm_server(ckpt, size, args, log)
        try:
            run_server(server, size_name, size, ids, args, rows)
        except RuntimeError as err:  # a server that does not start: say so, go on with the others
            print(f"  {name} failed: {err}", file=sys.stderr, flush=True)


def table(rows: list[dict]) -> str:
    vllm = {(r["size"], r["workload"], r["clients"]): r for r in rows if r["server"] == "vllm"}
    header = ("| size | workload | clients | server | out tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) | "
              "TPOT p50 (ms) | TPOT p99 (ms) | meshlm/vLLM tok/s |")
    lines = [header, "|---" * 11 + "|"]
    for r in sorted(rows, key=lambda r: (r["size"], r["workload"], r["clients"], r["server"] != "vllm")):
        base = vllm.get((r["size"], r["workload"], r["clients"]))
        ratio = (f"{r['out_tok_per_s'] / base['out_tok_per_s']:.2f}x" if r["server"] == "meshlm" and base
                 and base["out_tok_per_s"] > 0 else "")
        err = f" ({r['errors']} errors)" if r["errors"] else ""
        lines.append(f"| {r['size']} | {r['workload']} | {r['clients']} | {r['server']}{err} | "
                     f"{r['out_tok_per_s']:.1f} | {r['req_per_s']:.2f} | {r['ttft_p50_ms']:.0f} | "
                     f"{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | {ratio} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    intro, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=" ".join(intro.split()), epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="demo,gpt2-124m", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--clients", default="1,16,64", help="comma-separated concurrent client counts")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--servers", default="vllm,meshlm", help="comma-separated, in this order (vllm, meshlm)")
    p.add_argument("--requests", type=int, default=0, help="requests per point: max(this, clients) (default: "
                                                           "per size, see above)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--meshlm-args", default="", help="extra `meshlm serve` flags, one string given with =: "
                                                       "--meshlm-args=\"--flag value\"")
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags, likewise: --vllm-args=--enforce-eager")
    p.add_argument("--vllm-python", default=str(DEFAULT_VLLM_VENV / "bin" / "python"),
                   help="the python of setup_vllm.sh's venv (default: $VLLM_VENV/bin/python, else "
                        "~/.cache/meshlm-bench/vllm/bin/python)")
    p.add_argument("--vllm-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's own, 'auto')")
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE in GiB")
    p.add_argument("--vllm-no-preload", action="store_true", help="do not LD_PRELOAD tcmalloc and Intel OpenMP")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="meshlm serve's OMP_NUM_THREADS")
    p.add_argument("--demo-checkpoint", default=None, help="a trained demo run (e.g. runs/demo after make demo)")
    p.add_argument("--demo-steps", type=int, default=20, help="training steps of the demo model otherwise")
    p.add_argument("--work-dir", default=None, help="keep checkpoints, exports and server logs here (reused "
                                                    "when present) instead of a temporary directory")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds a server may take to answer")
    p.add_argument("--quick", action="store_true", help="a small run for development: the demo size (unless "
                   "--sizes is given), clients 1,4, 4 requests a point, 16 tokens, 5 training steps")
    add_smoke_flag(p)
    p.add_argument("--json", default=None, metavar="OUT", help="also write the rows and settings as JSON")
    args = p.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        args.sizes = args.sizes if "--sizes" in given else "demo"
        args.clients = args.clients if "--clients" in given else "1,4"
        args.requests = args.requests or 4
        args.max_tokens = args.max_tokens if "--max-tokens" in given else 16
        args.demo_steps = args.demo_steps if "--demo-steps" in given else 5
    if args.smoke:
        skipped("vLLM (meshlm serve alone)")
        args.sizes, args.clients, args.workloads, args.servers = "demo", "2", "random", "meshlm"
        args.requests, args.max_tokens, args.threads = 2, 2, 1
    return check_args(args)


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    def listed(flag: str, value: str, known) -> list[str]:
        items = [v.strip() for v in value.split(",") if v.strip()]
        bad = [v for v in items if v not in known]
        if not items or bad:
            fail(f"{flag} {value!r}: choose from {', '.join(known)}")
        return items

    args.sizes = listed("--sizes", args.sizes, SIZES)
    args.workloads = listed("--workloads", args.workloads, WORKLOADS)
    args.servers = listed("--servers", args.servers, ("vllm", "meshlm"))
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        fail(f"--clients {args.clients!r} must be comma-separated integers, e.g. 1,16,64")
    if not args.clients or min(args.clients) < 1:
        fail(f"--clients {args.clients} must be integers >= 1")
    if args.max_tokens < 2:
        fail(f"--max-tokens {args.max_tokens} must be >= 2 (TPOT needs two tokens)")
    if args.demo_checkpoint and not Path(args.demo_checkpoint).exists():
        fail(f"--demo-checkpoint {args.demo_checkpoint} does not exist")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the servers' stop()
    started, load = time.time(), os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    rows, interrupted = [], False
    with tempfile.TemporaryDirectory(prefix="serve_vs_vllm-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            for size_name in args.sizes:
                run_size(size_name, work, args, rows)
        except KeyboardInterrupt:
            print("interrupted; the servers are stopped", file=sys.stderr)
            interrupted = True
        finally:
            if rows:
                print("\n" + table(rows))
    end_load = os.getloadavg()
    print(f"\n{time.time() - started:.0f} s; load average at the end: {end_load[0]:.2f} {end_load[1]:.2f} "
          f"{end_load[2]:.2f}; fp32, {args.max_tokens} output tokens per request")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(json.dumps({"settings": settings, "load_start": load, "load_end": end_load,
                                               "rows": rows, "interrupted": interrupted}, indent=2) + "\n")
    if interrupted:
        sys.exit(130)


if __name__ == "__main__":
    main()
