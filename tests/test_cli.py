"""User errors: one line naming the key or path and the fix, exit code 2, no traceback; CLI start-up."""

import subprocess
import sys

import pytest

from tests.conftest import run_cli


@pytest.mark.parametrize("args, words", [
    (["train", "--train.max_stepz=3"], ["train.max_stepz", "train.max_steps"]),
    (["train", "--train.max_steps=abc"], ["train.max_steps", "expected int"]),
    (["train", "--train.micro_batch_size=3", "--train.global_batch_size=10"], ["global_batch_size", "set it to 9"]),
    (["train", "--config", "missing.toml"], ["missing.toml", "does not exist"]),
    (["train", "--train.resume=/nonexistent/run"], ["/nonexistent/run", "no checkpoint"]),
    (["generate", "--checkpoint", "/nonexistent/run"], ["/nonexistent/run", "no checkpoint"]),
    (["plot", "/nonexistent/run"], ["metrics.jsonl"]),
    (["train", "--data.paths=[\"/nonexistent/corpus.txt\"]"], ["data.paths", "/nonexistent/corpus.txt"]),
])
def test_user_errors_exit_2_with_one_clear_line(args, words, tmp_path):
    extra = [f"--train.out_dir={tmp_path}"] if args[0] == "train" else []
    proc = run_cli(*args, *extra, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0]


def test_unknown_flag_is_a_usage_error():
    proc = run_cli("train", "--bogus")
    assert proc.returncode == 2 and "--train.lr=3e-4" in proc.stderr


def test_prepare_never_imports_torch(tmp_path):
    """`meshlm prepare` (and the CLI's parser) start without torch: it takes ~2 s to import on this CPU."""
    (tmp_path / "a.txt").write_text("To be, or not to be.\n")
    code = ("import sys; from meshlm.cli import main\n"
            f"sys.argv = ['meshlm', 'prepare', '--input', {str(tmp_path / 'a.txt')!r}, '--output', "
            f"{str(tmp_path / 'out' / 'a')!r}, '--tokenizer', 'gpt2']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"
    assert (tmp_path / "out" / "a.bin").stat().st_size > 0


EXIT_SCRIPT = """
import atexit, sys, threading, time
from meshlm import cli
out = sys.argv[1]

def command():
    atexit.register(lambda: open(out + ".atexit", "w").write("ran"))  # a command's own exit handler
    threading.Thread(target=lambda: (time.sleep(0.5), open(out + ".thread", "w").write("ran"))).start()
    print("the end of a reply", end="")  # no newline: still in stdout's buffer when main returns
    sys.stderr.write("a warning without a newline")
    left = Left()  # garbage in a reference cycle: its finalizer runs
    left.me = left
    return int(sys.argv[2])

class Left:
    def __del__(self):
        open(out + ".finalized", "w").write("ran")

class Teardown:
    def __del__(self, open=open):  # builtins may be gone by then: its own reference
        open(out + ".teardown", "w").write("ran")

GLOBAL = Teardown()  # finalized only by the interpreter's teardown

cli.main = command
cli.run() if sys.argv[3] == "run" else sys.exit(command())
"""


@pytest.mark.parametrize("code", [0, 3])
def test_the_console_scripts_exit_keeps_everything_the_interpreters_exit_keeps(code, tmp_path):
    """`meshlm` (`cli.run`) ends with `os._exit` once the command returned (`leave_at_exit`): its exit code, its
    unflushed stdout and stderr, a thread that is not a daemon (joined first) and a command's own exit handler (run
    before `_leave`) all arrive as the interpreter's usual exit (the same script ending in `sys.exit`) leaves them,
    and so does the finalizer of an object the command left in a reference cycle (collected first). What only the
    interpreter's teardown finalizes (a module's global) is not, there alone. (A file object in such a cycle may
    lose its buffer either way: gc may finalize the raw file before the buffer above it; meshlm's files are closed
    by their owners.)"""
    left = {}
    for how in ("run", "plain"):
        out = tmp_path / how / "x"
        out.parent.mkdir()
        proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(out), str(code), how], capture_output=True,
                              text=True, check=False, timeout=120)
        assert proc.returncode == code, proc.stderr
        assert proc.stdout == "the end of a reply" and proc.stderr == "a warning without a newline"
        left[how] = sorted(p.name for p in out.parent.iterdir())
    assert left["run"] == ["x.atexit", "x.finalized", "x.thread"]
    assert left["plain"] == ["x.atexit", "x.finalized", "x.teardown", "x.thread"]


def test_a_command_that_raises_leaves_with_its_traceback(tmp_path):
    """An exception out of `main` is not `leave_at_exit`'s: the usual traceback and exit code 1."""
    script = "from meshlm import cli\ncli.main = lambda: 1 / 0\ncli.run()\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 1 and "ZeroDivisionError" in proc.stderr and "Traceback" in proc.stderr


def test_python_m_meshlm_and_the_console_script_run_the_same_entry():
    """torchrun's workers (`-m meshlm`) and the installed `meshlm` both go through `cli.run`."""
    from pathlib import Path

    from tests.conftest import ROOT

    assert "run()" in (ROOT / "meshlm" / "__main__.py").read_text()
    assert 'meshlm = "meshlm.cli:run"' in (ROOT / "pyproject.toml").read_text()
    script = Path(sys.executable).parent / "meshlm"
    assert "from meshlm.cli import run" in script.read_text()
