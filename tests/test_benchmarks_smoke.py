"""Every script in benchmarks/ runs end to end at its smallest size (`--smoke`) and prints its table.

The scripts are found by glob, so a new one is covered the day it lands: a script without `--smoke` fails
here with the fix in the message, and so does a new helper module (a file without a `__main__` block) until it
is listed in HELPERS. A smoke run is a tiny model, a step or two and a few requests, without outside servers
(vLLM, llama.cpp: their parts are skipped with a printed note); its numbers mean nothing, only that the script
still works against today's meshlm (benchmarks/activation_memory.py crashed for a while after `parallelize`
changed what it returns, and nothing noticed). Each run is a subprocess with one OpenMP thread and the
session's corpus cache (conftest's MESHLM_CACHE); it must exit 0 with its table's header line on stdout.

The selected scripts' runs start together, two at a time (`PARALLEL`: this machine's 2 cores), when the first
of these tests asks for its result, so the file takes about half the sum of their times; meshlm's caches
are safe for concurrent builders (per-process temporary files, atomic renames), as torchrun's ranks need.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT, session_cache_dir

BENCHMARKS = ROOT / "benchmarks"

# Modules of benchmarks/ that the scripts import and that are not scripts themselves.
HELPERS = {
    "world.py": "spawns a gloo world of CPU processes for a script (run_world)",
    "smoke.py": "the --smoke flag, its printed notes and tiny random checkpoints",
    "checkpoints.py": "loads a run directory through meshlm's checkpoint door (load_run)",
    "grpo_task_data.py": "the GRPO task's seeded arithmetic word problems (grpo_task.py)",
}

# Scripts that cannot run a smoke run, with the reason: none.
NO_SMOKE: dict[str, str] = {}

# Scripts whose smoke run another test file makes and checks more closely (its rows, not only its table): not run
# here a second time.
SMOKED_ELSEWHERE = {"gpu_train.py": "tests/train/test_gpu_benchmark.py"}

# A line of each script's table (or report) that only a finished run prints. A script not listed here must
# print a Markdown table (a `| ... |` header line followed by its `|---|` line).
HEADERS = {
    "activation_memory.py": "| t | SP | recompute | measured / layer | formula / layer | measured / formula |",
    "async_save.py": "| mode | save at step | write s | in save call s |",
    "bert_pretrain.py": "| model | MLM accuracy | MLM perplexity | SOP accuracy |",
    "busy_step.py": "alone s/step busy s/step slowdown",
    "chat_packing.py": "| mode | rows | steps | useful tokens/row |",
    "chat_task.py": "| model | pref. accuracy (sum log-prob) |",
    "chat_task_smollm2.py": "| trainer | held-out loss | last train loss |",
    "context_parallel.py": "| cp | rank | saved in layers, measured (MiB) |",
    "demo_quality.py": "| run | wall time | held-out bits/byte |",
    "document_mask.py": "| seq | rows | causal ms/step | documents ms/step | ratio |",
    "dp_overlap.py": "| mode | step time | exposed communication |",
    "eval_unigram.py": '"shakespeare-choice": {',
    "finetune_genre.py": "| accuracy | macro F1 | time",
    "gguf_import.py": "GGUF file",
    "gguf_llamacpp.py": "meshlm logits:",
    "gguf_tokenizer.py": "| reader | works with meshlm's ids |",
    "gloo_collectives.py": "| run | full tensor | all-reduce ms |",
    "init_memory.py": "| layout | build | rank | baseline GiB |",
    "moe_vs_dense.py": "| gpt-moe-tiny, 2 processes (gloo), 2 steps | tokens/s | wall |",
    "pipeline_bubble.py": "| pp | vpp | m | theory (p−1)/(v·m) |",
    "plan_trials.py": "| layout | processes | predicted s | measured s |",
    "plan_validation.py": "| row | layout | published TFLOP/s | predicted |",
    "prepare.py": "| method | processes | tokens/s | MB/s |",
    "serve.py": "| clients | requests | req/s | output tok/s |",
    "serve_compare.py": "| model | precision | workload | clients | engine | weights | out tok/s |",
    "serve_adapters.py": "| case | output tokens/s | vs the base alone |",
    "serve_engine.py": "| bench | proposer | out tok/s | vs off |",
    "serve_load.py": '"out_tok_per_s":',
    "tp_comm.py": "| t | SP | collectives per layer, forward (measured) |",
    "train_step.py": "meshlm tok/s  ref tok/s  ratio",
    "tune_probe.py": "linear probe for the play",
    "tune_task.py": "| method | accuracy (best of 8 answers) |",
}

TIMEOUT_S = 600  # a wedged script fails instead of hanging the suite
PARALLEL = 2  # smoke runs at once


def _is_script(path: Path) -> bool:
    main_block = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.MULTILINE)
    return main_block.search(path.read_text(encoding="utf-8")) is not None


def _scripts() -> list[str]:
    return sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name not in HELPERS and p.name not in SMOKED_ELSEWHERE)


def _has_markdown_table(text: str) -> bool:
    lines = text.splitlines()
    return any(a.startswith("|") and re.match(r"^\|\s*:?-{3}", b) for a, b in itertools.pairwise(lines))


def _problem(name: str) -> str | None:
    """Why benchmarks/NAME cannot be smoke-run (not a script, no --smoke flag), or None."""
    path = BENCHMARKS / name
    if not _is_script(path):
        return (f"benchmarks/{name} has no `if __name__ == \"__main__\":` block: list it in HELPERS of "
                "tests/test_benchmarks_smoke.py if other scripts import it, else make it a script")
    source = path.read_text(encoding="utf-8")
    if "--smoke" not in source and "add_smoke_flag" not in source:
        return (f"benchmarks/{name} takes no --smoke flag: give it one (benchmarks/smoke.py's add_smoke_flag: a tiny "
                "model, 1-2 steps, a few requests, outside servers skipped with a printed note) so that this test "
                "runs it")
    return None


def _smoke_run(name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / name), "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory) -> dict[str, Future]:
    """The smoke run of every script selected in this session (`-k` honoured), started at once on a pool of
    `PARALLEL` workers; each test waits for its own. The environment is fixed here, once: the session's corpus
    cache (conftest's `session_cache_dir`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MESHLM_CACHE": str(session_cache_dir(tmp_path_factory))}
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_benchmark_smoke_run"]
    runnable = [n for n in selected if n not in NO_SMOKE and _problem(n) is None]
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        futures = {name: pool.submit(_smoke_run, name, env) for name in runnable}
        yield futures
        for future in futures.values():
            future.cancel()


def test_helpers_listed_are_modules_not_scripts():
    """HELPERS names real files of benchmarks/ that have no `__main__` block (else they are scripts)."""
    for name in HELPERS:
        path = BENCHMARKS / name
        assert path.exists(), f"benchmarks/{name} is listed in HELPERS but does not exist; remove it from the list"
        assert not _is_script(path), f"benchmarks/{name} has a __main__ block: it is a script, not a helper"


def test_scripts_smoked_elsewhere_are_run_there():
    """Each script of SMOKED_ELSEWHERE exists and the test file named for it runs it with --smoke."""
    for name, test_file in SMOKED_ELSEWHERE.items():
        assert (BENCHMARKS / name).exists(), f"benchmarks/{name} is gone: remove it from SMOKED_ELSEWHERE"
        text = (ROOT / test_file).read_text(encoding="utf-8")
        assert f"benchmarks/{name}" in text and "--smoke" in text, f"{test_file} no longer runs benchmarks/{name} --smoke"


@pytest.mark.parametrize("name", _scripts())
def test_benchmark_smoke_run(name: str, smoke_runs: dict[str, Future]):
    """`python benchmarks/NAME --smoke` exits 0 and prints its table."""
    if name in NO_SMOKE:
        pytest.skip(f"benchmarks/{name}: {NO_SMOKE[name]}")
    problem = _problem(name)
    assert problem is None, problem
    proc = smoke_runs[name].result()
    tail = f"\n--- stdout (end) ---\n{proc.stdout[-3000:]}\n--- stderr (end) ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"benchmarks/{name} --smoke exited with {proc.returncode}{tail}"
    header = HEADERS.get(name)
    if header is not None:
        assert header in proc.stdout, f"benchmarks/{name} --smoke printed no line with {header!r}{tail}"
    else:
        assert _has_markdown_table(proc.stdout), (
            f"benchmarks/{name} --smoke printed no Markdown table (a `| ... |` line, then `|---|`); if its report "
            f"is another shape, add a line it prints to HEADERS in tests/test_benchmarks_smoke.py{tail}")


def test_serve_compare_refuses_negative_waves_before_any_work():
    """`--waves` (and `--requests`) below 0 is one error line naming both flags, exit code 2, before a server
    or an export starts."""
    run = subprocess.run([sys.executable, str(BENCHMARKS / "serve_compare.py"), "--waves", "-1"], cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip() == "serve_compare: --requests 0 and --waves -1 must be >= 0 (0: the model's default)"


def test_serve_compare_restarts_a_llama_server_that_segfaults_at_load_with_no_repack(tmp_path):
    """A server that dies of SIGSEGV before it answers raises `ExitedAtStart` carrying the signal; serve_compare
    takes that, from llama-server without --no-repack/-nr, for the crash of llama.cpp's AMX path (restarted once
    with --no-repack), and any other exit for a failure."""
    script = r"""
import argparse, signal, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from serve_compare import crashed_in_extra_buffers
from serve_load import ExitedAtStart, ServerProcess, free_port

def exit_of(command):
    try:
        with ServerProcess("llamacpp", ["sh", "-c", command], {}, free_port(), Path(sys.argv[1]), 30):
            return None
    except ExitedAtStart as err:
        return err

def args(kind, flags=""):
    return argparse.Namespace(llamacpp=(kind, [], ""), llamacpp_args=flags)

segv, plain = exit_of("kill -SEGV $$"), exit_of("exit 3")
print(segv.code, plain.code, crashed_in_extra_buffers(segv, args("llama-server")),
      crashed_in_extra_buffers(segv, args("llama-server", "--no-repack")),
      crashed_in_extra_buffers(segv, args("llama-server", "-t 2 -nr")),
      crashed_in_extra_buffers(segv, args("llama-cpp-python")), crashed_in_extra_buffers(plain, args("llama-server")))
"""
    log = tmp_path / "server.log"
    run = subprocess.run([sys.executable, "-c", script, str(log)], cwd=ROOT, check=False, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["-11", "3", "True", "False", "False", "False", "False"]


def test_the_two_load_clients_count_the_same_tokens(tmp_path):
    """serve_load's aiohttp client (`--client aiohttp`) sends what the openai client sends and reads the same
    counts from `meshlm serve`: every request's max_tokens, streamed and not, with a first-token time when
    streamed; a wrong API key is an error counted, not a crash."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import asyncio

        from serve_load import run_load
        from smoke import tiny_checkpoint
    finally:
        sys.path.remove(str(BENCHMARKS))
    from tests.infer.server_helpers import ServeProcess

    run = tiny_checkpoint(tmp_path / "tiny", n_layers=1, hidden_size=32, n_heads=2, seq_len=64)
    server = ServeProcess("--checkpoint", str(run), "--served-model-name", "smoke", "--max-seqs", "4",
                          api_key="k")
    try:
        prompts = [[5, 6, 7], [8] * 12, [9, 10], [11] * 20, [12]]
        for stream in (True, False):
            results = {c: asyncio.run(run_load(server.url, "smoke", prompts, 2, 6, "k", stream=stream, client=c))
                       for c in ("openai", "aiohttp")}
            for client, r in results.items():
                assert (r.requests, r.errors, r.out_tokens) == (5, 0, 30), (client, stream, r)
                assert (r.ttft_p50_ms > 0) if stream else r.ttft_p50_ms != r.ttft_p50_ms, (client, stream, r)
        refused = asyncio.run(run_load(server.url, "smoke", prompts[:2], 1, 6, "wrong", client="aiohttp"))
        assert (refused.requests, refused.errors) == (0, 2) and "HTTP 401" in refused.first_error
    finally:
        server.stop()


def test_the_aiohttp_client_sends_once_more_after_a_stale_connection():
    """A pooled keep-alive connection the server closed meanwhile (llama-server's HTTP library closes one after
    a few requests) fails at the socket ("Can not write request body"), or the server closes it before a status
    line: serve_load's aiohttp client sends the request once more, as httpx does under the openai client; a
    second failure is the request's error."""
    import asyncio

    import aiohttp

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from serve_load import _post
    finally:
        sys.path.remove(str(BENCHMARKS))

    class Session:
        def __init__(self, failures, error):
            self.failures, self.error, self.calls = failures, error, []

        async def post(self, url, json, headers):
            self.calls.append((url, json, headers))
            if len(self.calls) <= self.failures:
                raise self.error
            return "reply"

    for error in (aiohttp.ClientOSError(None, "Can not write request body"), aiohttp.ServerDisconnectedError()):
        once = Session(1, error)
        assert asyncio.run(_post(once, "http://x/v1/completions", {"prompt": [1]}, "k")) == "reply"
        assert len(once.calls) == 2 and once.calls[0] == once.calls[1]  # the same request again
        twice = Session(2, error)
        with pytest.raises(type(error)):
            asyncio.run(_post(twice, "http://x/v1/completions", {"prompt": [1]}, "k"))
        assert len(twice.calls) == 2
    other = Session(1, aiohttp.ClientPayloadError("cut"))  # any other failure is the request's at once
    with pytest.raises(aiohttp.ClientPayloadError):
        asyncio.run(_post(other, "http://x/v1/completions", {"prompt": [1]}, "k"))
    assert len(other.calls) == 1
