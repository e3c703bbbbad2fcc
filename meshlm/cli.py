"""meshlm command line: `meshlm train | generate | chat | embed | finetune | tune | serve | eval | harness | plot | prepare |
tokenizer train | bench memory | convert`.

User errors (bad config or argument, missing or corrupt checkpoint or asset, bad data, a full disk, a
run too large for this machine, a run whose losses stay non-finite) print one line starting with
`error:` that names the key or path and the fix, and exit with code 2, without a traceback; argparse's
usage errors too (docs/reliability.md). A training run stopped by SIGINT or SIGTERM saves its checkpoint
and exits with 130 or 143.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
from typing import NoReturn

from meshlm.commands.align import add_align_command
from meshlm.commands.bench import add_bench_command
from meshlm.commands.chat import add_chat_command
from meshlm.commands.convert import add_convert_command
from meshlm.commands.data import add_data_commands
from meshlm.commands.embed import add_embed_command
from meshlm.commands.eval import add_eval_command
from meshlm.commands.finetune import add_finetune_command
from meshlm.commands.generate import add_generate_command
from meshlm.commands.plan import add_plan_command
from meshlm.commands.plot import add_plot_command
from meshlm.commands.serve import add_serve_command
from meshlm.commands.train import add_train_command
from meshlm.commands.tune import add_tune_command
from meshlm.core.config import ConfigError

# The exit code `leave_at_exit` was given; None: the interpreter's usual exit.
_LEAVE_CODE: int | None = None


def _leave() -> None:
    """The last exit handler (registered when this module loads, before any command registers its own: atexit runs
    them last-in, first-out, after the interpreter has joined every thread that is not a daemon): once
    `leave_at_exit` asked for it, collect what the command left in reference cycles (their finalizers run), flush
    stdout and stderr, and end the process with `os._exit`, skipping the interpreter's
    teardown (clearing every module of torch, sympy and dynamo, with garbage collections over them: about 1 s of
    CPU per process, more than a small command's own work; RESULTS.md, "A command's exit")."""
    if _LEAVE_CODE is None:
        return
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`meshlm generate | head`) or a closed stream
            pass
    os._exit(_LEAVE_CODE)


atexit.register(_leave)


def leave_at_exit(code: int) -> None:
    """End this process with `code` once its exit handlers have run, without the interpreter's teardown (`_leave`).
    For a process whose work is done (the console script after `main`); a library caller's process keeps its own
    exit."""
    global _LEAVE_CODE
    _LEAVE_CODE = code


def one_line(message: str) -> str:
    """`message` as one printable line: newlines and other control characters (from user input) escaped."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in message)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line `error: ...` (exit code 2) instead of the usage and the
    error; the subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {one_line(message)}; see {self.prog} -h\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="meshlm", description="GPT training with Megatron-style parallelism")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_command(sub)  # meshlm train
    add_generate_command(sub)  # meshlm generate
    add_chat_command(sub)  # meshlm chat (an interactive conversation in the terminal)
    add_plot_command(sub)  # meshlm plot
    add_data_commands(sub)  # meshlm prepare, meshlm tokenizer train
    add_bench_command(sub)  # meshlm bench memory
    add_plan_command(sub)  # meshlm plan (the auto-configurator)
    add_convert_command(sub)  # meshlm convert --to-single | --to-hf | --from-hf
    add_embed_command(sub)  # meshlm embed
    add_finetune_command(sub)  # meshlm finetune
    add_tune_command(sub)  # meshlm tune
    add_align_command(sub)  # meshlm align (DPO, IPO, SimPO)
    add_serve_command(sub)  # meshlm serve (OpenAI-compatible HTTP server; needs meshlm[serve])
    add_eval_command(sub)  # meshlm eval, meshlm harness
    return parser


# OpenMP's settings of how waiting threads wait; a user who set any of them keeps exactly what they set.
THREAD_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


# libgomp (torch's OpenMP on Linux): a waiting thread spins 10,000 iterations (tens of microseconds), then sleeps,
# instead of libgomp's default 300,000. On a CPU shared with a busy process, threads waiting for a descheduled one
# soon give their core back (a step 1.6-2.1x slower beside one busy process instead of 2.8-3.1x); alone, a step
# was up to 20% slower in some runs, so it is opt-in: MESHLM_SHARED_CPU=1 (docs/threads.md).
THREAD_POLICY = {"GOMP_SPINCOUNT": "10000"}
SHARED_CPU_VARIABLE = "MESHLM_SHARED_CPU"


def thread_policy(environ: dict, nvidia_gpu: bool) -> dict[str, str]:
    """The OpenMP variables meshlm sets in `environ` (`THREAD_POLICY`; docs/threads.md, measured by
    benchmarks/busy_step.py): only when `MESHLM_SHARED_CPU=1` asks for it, and never where the user set any of
    `THREAD_POLICY_VARIABLES` or on a host with an NVIDIA GPU (its CPU threads mostly wait for the GPU)."""
    wanted = environ.get(SHARED_CPU_VARIABLE, "").strip().lower() in ("1", "true", "yes")
    if not wanted or nvidia_gpu or any(name in environ for name in THREAD_POLICY_VARIABLES):
        return {}
    return dict(THREAD_POLICY)


def set_thread_policy() -> None:
    """`thread_policy` into this process's environment, before torch loads (commands are torch-free at
    import); torchrun's workers start through `main` too."""
    os.environ.update(thread_policy(os.environ, os.path.isdir("/proc/driver/nvidia/gpus")))


def main(argv: list[str] | None = None) -> int:
    set_thread_policy()
    from meshlm.core.errors import CheckpointError, CheckpointWriteError, TrainingError
    from meshlm.data.assets import AssetError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if not (e.startswith("--") and "." in e.split("=", 1)[0] and "=" in e)]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides look like --train.lr=3e-4)")
    try:
        return args.func(args, extra)
    except (ConfigError, CheckpointError, CheckpointWriteError, TrainingError, AssetError) as err:
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        return 2


def run() -> NoReturn:
    """The `meshlm` console script and `python -m meshlm` (torchrun's workers too): `main`, then its exit code
    through `leave_at_exit`. A command that raised leaves the usual way, with its traceback."""
    code = main()
    code = 0 if code is None else code
    if isinstance(code, int):
        leave_at_exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
