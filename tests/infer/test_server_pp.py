"""`torchrun --nproc-per-node 2 -m meshlm serve --parallel.pp=2` (gloo on CPU): each rank holds one stage's layers
and KV cache (`infer/pipeline_runner.py`); greedy completions and chat replies, streamed and not, from several
concurrent requests (steps that batch several rows) equal one process's engine, for a GPT-2-style model (tied
embeddings: the last stage holds the embedding too) and a Llama-style one (RoPE, GQA, a sliding-window layer
and a global one: the local layer's pool of its own), also with small blocks, chunked prefill and n-gram drafts,
and under pp=2 × tp=2. A killed rank ends the whole server, not a hang;
what pipeline serving does not serve is refused in one line."""

import contextlib
import io
import json
import os
import signal
import sys
import threading
import time

import openai
import pytest

from meshlm.cli import main
from meshlm.infer.engine import Engine, SamplingParams
from meshlm.infer.protocol import CHAT_STOP, chat_prompt
from tests.checkpoint_helpers import load_run
from tests.infer.server_helpers import ServeProcess, free_port, http, save_gpt_checkpoint

LLAMA = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False,
         "n_kv_heads": 2}
WINDOWS = {"sliding_window": 6, "window_pattern": 2}
PROMPTS = ["Hello there", "ROMEO. But soft, what light", "a", "To be, or not to be: that is"]
LENGTHS = [12, 7, 15, 9]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"}]


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m", "meshlm"]


def one_process(ckpt) -> tuple[list[str], str]:
    """The single-process engine's greedy texts of PROMPTS and its chat reply to MESSAGES (8 tokens)."""
    model, tokenizer, _ = load_run(str(ckpt))
    texts = [r.text for r in Engine(model, tokenizer, max_seqs=4).generate(
        [tokenizer.encode(p) for p in PROMPTS], [SamplingParams(max_tokens=n, temperature=0) for n in LENGTHS])]
    chat = Engine(model, tokenizer, max_seqs=1).generate([tokenizer.encode(chat_prompt(MESSAGES))],
                                                         [SamplingParams(max_tokens=8, temperature=0)])[0].text
    return texts, chat.split(CHAT_STOP)[0]


def concurrent_completions(url: str) -> list[dict]:
    """PROMPTS sent together (their rows decode in the same steps on every rank); the last one streamed."""
    results: list = [None] * len(PROMPTS)

    def ask(i):
        body = {"prompt": PROMPTS[i], "max_tokens": LENGTHS[i], "temperature": 0}
        if i == len(PROMPTS) - 1:
            status, _, text = http("POST", url + "/v1/completions", {**body, "stream": True})
            events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
            results[i] = (status, "".join(e["choices"][0]["text"] for e in events if e["choices"]))
        else:
            status, _, text = http("POST", url + "/v1/completions", body)
            results[i] = (status, json.loads(text)["choices"][0]["text"] if status == 200 else text)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def check_server(server: ServeProcess, texts: list[str], chat: str) -> None:
    results = concurrent_completions(server.url)
    for (status, got), want in zip(results, texts):
        assert status == 200, got
        assert got == want
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = c.chat.completions.create(model="x", messages=MESSAGES, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == chat
    stream = c.chat.completions.create(model="x", messages=MESSAGES, max_tokens=8, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == chat


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of torchrun's worker `rank` (a child of the launcher whose environment says RANK=rank)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in env:
            return int(entry)
    raise AssertionError(f"no worker of rank {rank} under pid {launcher_pid}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_pp2_server_greedy_equals_one_process(tmp_path, family):
    llama = family == "llama"
    # llama: layer 0 local (a window of 6), layer 1 global: the local layer's stage holds a pool of its own
    ckpt = save_gpt_checkpoint(tmp_path / family, seed=3, **({**LLAMA, **WINDOWS} if llama else {}))
    texts, chat = one_process(ckpt)
    # llama: small blocks, prefill chunks and n-gram drafts (a token and its drafts in one row): every step kind
    extra = ["--block-size", "4", "--max-batched-tokens", "8", "--speculative", "ngram"] if llama else []
    server = ServeProcess("--checkpoint", str(ckpt), "--parallel.pp=2", "--max-seqs", "4", *extra, "--served-model-name", "x",
                          prefix=torchrun(2))
    try:
        check_server(server, texts, chat)
        if llama:  # the local layers' own pool, smaller than the main one (blocks leave the window)
            _, _, metrics = http("GET", server.url + "/metrics")
            local = next(line for line in metrics.splitlines() if line.startswith("meshlm_kv_cache_local_blocks "))
            main_pool = next(line for line in metrics.splitlines() if line.startswith("meshlm_kv_cache_blocks "))
            assert 0 < float(local.split()[-1]) < float(main_pool.split()[-1]), (local, main_pool)
        if llama:  # a dead rank ends the server (the launcher stops the others) instead of leaving it hanging
            os.kill(rank_pid(server.proc.pid, 1), signal.SIGKILL)
            start = time.monotonic()
            code = server.proc.wait(90)
            assert code != 0 and time.monotonic() - start < 90
    finally:
        server.stop(timeout=60)


@pytest.mark.slow
def test_pp2_tp2_server_greedy_equals_one_process(tmp_path):
    ckpt = save_gpt_checkpoint(tmp_path / "llama", seed=5, **LLAMA)  # 4 query heads, 2 KV heads: tp=2 fits
    texts, chat = one_process(ckpt)
    server = ServeProcess("--checkpoint", str(ckpt), "--parallel.pp=2", "--parallel.tp=2", "--max-seqs", "4",
                          "--block-size", "4", "--served-model-name", "x", prefix=torchrun(4), deadline_s=180)
    try:
        check_server(server, texts, chat)
    finally:
        server.stop(timeout=60)


@pytest.mark.parametrize("flags, refused", [
    (["--adapter", "plays"], "--adapter"), (["--allow-runtime-lora"], "--allow-runtime-lora"),
    (["--quantize", "int8"], "--quantize"), (["--speculative", "draft", "--draft-checkpoint", "d"], "--speculative draft")])
def test_pp_refuses_what_it_does_not_serve_in_one_line(tmp_path, flags, refused):
    ckpt = save_gpt_checkpoint(tmp_path / "gpt")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["serve", "--checkpoint", str(ckpt), "--parallel.pp=2", "--port", str(free_port()), *flags])
    assert code == 2 and out.getvalue() == ""
    assert err.getvalue() == f"error: {refused} serves without pipeline parallelism; drop --parallel.pp=2 or {refused}\n"
