"""Several documented `meshlm` commands in one fresh interpreter instead of one each.

A `meshlm` process spends most of a tiny command's CPU starting: importing torch, meshlm and (the first time an
optimizer is built) torch._dynamo, 2-4 s of CPU each on this 2-core machine, more than the narrowed command's
own work. `run_meshlm_batch` runs a list of commands in one new Python process, one after the other, each
through `meshlm.cli.main(argv)` (what the `meshlm` console script calls) with the argv bash gives it
(`shell_words`: quotes and `$(...)` expanded as the typed line has them), its own stdout and stderr and its
exit code. The test process itself runs none of them, so nothing a command leaves behind reaches the suite;
and a command that still works after others ran in the same process (a later `generate --seed 1` equal to an
earlier one, a resumed run equal to a straight one) proves at least what separate processes prove.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

# The program of the batch process: each argv through meshlm.cli.main, outputs captured per command; the first
# failure stops the batch (later commands of a documented sequence build on the earlier ones). Once the results
# are written it leaves as the console script does (`meshlm.cli.leave_at_exit`: exit handlers, then os._exit
# without the interpreter's teardown); a runner that failed exits the usual way.
_RUNNER = """
import contextlib, io, json, os, sys, traceback
from meshlm.cli import leave_at_exit, main

commands, results = json.loads(open(sys.argv[1]).read()), []
for argv, env in commands:
    out, err, before = io.StringIO(), io.StringIO(), dict(os.environ)
    os.environ.update(env)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    os.environ.clear()
    os.environ.update(before)
    results.append({"code": code or 0, "stdout": out.getvalue(), "stderr": err.getvalue()})
    if code:
        break
with open(sys.argv[2], "w") as f:
    f.write(json.dumps(results))
leave_at_exit(0)
"""


def shell_words(line: str, cwd: str | Path | None = None) -> list[str]:
    """The words bash makes of a simple command line (quotes removed, `$(...)` run), as the program gets them."""
    proc = subprocess.run(["bash", "-c", f"printf '%s\\0' {line}"], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=True)
    return proc.stdout.split("\0")[:-1]


def run_meshlm_batch(argvs: list[list[str]], cwd: str | Path, timeout: float = 600, env: dict | None = None,
                     command_env: dict[int, dict[str, str]] | None = None) -> list[subprocess.CompletedProcess]:
    """Each `meshlm` argv (without the program name) run in order in one new interpreter (environment `env`, plus
    `command_env[i]` while command i runs): a CompletedProcess per argv. After a command fails the rest are not
    run (exit code -1, saying so); if the interpreter itself died, every entry carries its exit code and output."""
    with tempfile.TemporaryDirectory() as tmp:
        todo, done = Path(tmp) / "argvs.json", Path(tmp) / "results.json"
        todo.write_text(json.dumps([[argv, (command_env or {}).get(i, {})] for i, argv in enumerate(argvs)]))
        proc = subprocess.run([sys.executable, "-c", _RUNNER, str(todo), str(done)], cwd=cwd, capture_output=True,
                              text=True, timeout=timeout, check=False, env=env)
        if not done.exists():
            died = {"code": proc.returncode or 1, "stdout": proc.stdout, "stderr": proc.stderr}
            results = [died] * len(argvs)
        else:
            results = json.loads(done.read_text())
    skipped = {"code": -1, "stdout": "", "stderr": "not run: an earlier command of the batch failed"}
    results += [skipped] * (len(argvs) - len(results))
    return [subprocess.CompletedProcess(["meshlm", *argv], r["code"], r["stdout"], r["stderr"])
            for argv, r in zip(argvs, results)]
