"""`meshlm serve` with several adapters on one base, chosen per request by the `model` field: two LoRA
adapters (other seeds and targets) and a prompt-tuning adapter, tuned for a few steps on a tiny base. Each
model's greedy completion equals the tuned model alone, and each LoRA adapter's equals `meshlm generate
--adapter`'s (its row is the prompt alone, as tuning rows are); concurrent requests for
different models share decode steps (the engine's mixed-step counter) and still equal the sequential answers.
All of it with the engine in the server's process and in a process of its own (`--engine-process`)."""

from __future__ import annotations

import functools
import json
import threading

import openai
import pytest
import torch

from meshlm.checkpoint.load import open_checkpoint
from meshlm.tune.export import apply_adapter, read_adapter
from tests.checkpoint_helpers import load_run
from tests.conftest import run_cli
from tests.infer.server_helpers import ServeProcess, http
from tests.tune.tune_helpers import QUIET, repeat_rows, run, save_base, write_jsonl

PROMPTS = ["say gold:", "say red:", "say blue: say", "green"]
MODELS = ["base", "alpha", "lora-b", "soft"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = save_base(root / "base")
    train = write_jsonl(root / "train.jsonl", repeat_rows(32, 1))
    out = {"root": root, "base": base}
    for name, method, extra in (("lora-a", "lora", ["--tune.lora_targets=['q','v','down']", "--train.seed=1"]),
                                ("lora-b", "lora", ["--tune.lora_targets=['o','up']", "--train.seed=7"]),
                                ("soft", "prompt", ["--tune.virtual_tokens=3"])):
        out[name] = root / name
        code, _, err = run("tune", "--checkpoint", str(base), "--method", method, "--train", str(train), "--valid",
                           str(train), "--out", str(out[name]), "--max-length", "16", *QUIET, "--train.max_steps=4",
                           "--optim.lr=3e-2", *extra)
        assert code == 0, err
    return out


@pytest.fixture(scope="module", params=["--no-engine-process", "--engine-process"],
                ids=["one process", "engine process"])
def served(tuned, request):
    """base + alpha (NAME=DIR) + lora-b (a plain DIR) + soft (a prompt adapter), 8 cache rows; the engine in the
    server's process, then in a process of its own (which loads the adapters itself)."""
    server = ServeProcess("--checkpoint", str(tuned["base"]), "--adapter", f"alpha={tuned['lora-a']}",
                          "--adapter", str(tuned["lora-b"]), "--adapter", f"soft={tuned['soft']}", "--max-seqs", "8",
                          request.param)
    yield server
    assert server.stop() == 0, "".join(server.stderr)[-3000:]


@functools.cache
def tuned_model(base: str, directory: str | None):
    """(model, tokenizer, head ids): the base with the adapter in `directory` (LoRA merged, virtual tokens
    attached), as `meshlm generate --adapter` runs it: the virtual tokens' placeholders before the prompt
    (LoRA and the base: nothing)."""
    model, tok, cfg = load_run(base)
    head = []
    if directory is not None:
        adapter = read_adapter(directory, cfg, open_checkpoint(base))
        apply_adapter(model, cfg, adapter)
        head = [0] * adapter.virtual_tokens
    return model, tok, head


def greedy(tuned, directory, prompt: str, n: int) -> str:
    """The tuned model alone, greedy, stopping at the end of the document as the server does."""
    model, tok, head = tuned_model(str(tuned["base"]), None if directory is None else str(directory))
    ids, new = head + tok.encode(prompt), []
    with torch.no_grad():
        while len(new) < n:
            nxt = int(model(torch.tensor([ids + new]))[0, -1].argmax())
            if nxt == tok.eod_id:
                break
            new.append(nxt)
    return tok.decode(new)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def mixed_steps(server) -> float:
    text = http("GET", server.url + "/metrics")[2]
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("meshlm_mixed_decode_steps_total "))


def test_models_lists_the_base_and_every_adapter(served, tuned):
    status, _, body = http("GET", served.url + "/v1/models")
    assert status == 200, body
    data = json.loads(body)["data"]
    assert [m["id"] for m in data] == MODELS
    assert [m["parent"] for m in data] == [None, "base", "base", "base"]
    assert data[1]["root"] == str(tuned["lora-a"])
    assert [m.id for m in client(served).models.list().data] == MODELS


def test_each_model_answers_with_its_own_adapter(served, tuned):
    dirs = {"base": None, "alpha": tuned["lora-a"], "lora-b": tuned["lora-b"], "soft": tuned["soft"]}
    c = client(served)
    got = {}
    for model in MODELS:
        for prompt in PROMPTS:
            out = c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
            assert out.model == model
            got[model, prompt] = out.choices[0].text
            assert got[model, prompt] == greedy(tuned, dirs[model], prompt, 6), (model, prompt)
    # the adapters change the answers (so the comparison above could fail), and differently
    for a, b in (("alpha", "base"), ("lora-b", "base"), ("soft", "base"), ("alpha", "lora-b")):
        assert any(got[a, p] != got[b, p] for p in PROMPTS), (a, b, got)
    chat = c.chat.completions.create(model="soft", messages=[{"role": "user", "content": "say red"}], max_tokens=3,
                                     temperature=0)
    assert chat.model == "soft" and chat.usage.completion_tokens >= 1


def test_lora_completions_equal_meshlm_generate(served, tuned):
    """The real CLI in its own process, greedy: `meshlm generate --adapter DIR` (LoRA merged, the prompt
    alone) against the server's unmerged LoRA rows, both past the end of the document (ignore_eos and
    --ignore-eos)."""
    c = client(served)
    for model, directory in (("alpha", tuned["lora-a"]), ("lora-b", tuned["lora-b"])):
        for prompt in PROMPTS[:2]:
            out = c.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
            assert out.usage.prompt_tokens == len(tuned_model(str(tuned["base"]), None)[1].encode(prompt))
            assert out.usage.completion_tokens == 8
            cli = run_cli("generate", "--checkpoint", str(tuned["base"]), "--adapter", str(directory), "--prompt",
                          prompt, "--temperature", "0", "--max-new-tokens", "8", "--ignore-eos")
            assert cli.returncode == 0, cli.stderr
            assert cli.stdout == prompt + out.choices[0].text + "\n", (model, prompt)


def test_lora_echo_shows_the_prompt_alone(served, tuned):
    """A LoRA request echoes its prompt alone, every token counted as a prompt token; the prompt's
    log-probabilities are the tuned model's."""
    model, tok, head = tuned_model(str(tuned["base"]), str(tuned["lora-a"]))
    prompt = PROMPTS[2]
    ids = tok.encode(prompt)
    out = client(served).completions.create(model="alpha", prompt=prompt, max_tokens=0, temperature=0, echo=True,
                                            logprobs=0)
    assert out.choices[0].text == prompt and out.usage.prompt_tokens == len(ids)
    lp = out.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids] and lp.token_logprobs[0] is None
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([head + ids]))[0].float(), -1)
    for i, t in enumerate(ids[1:], start=len(head)):
        assert lp.token_logprobs[i - len(head) + 1] == pytest.approx(float(want[i, t]), abs=1e-4)


def test_concurrent_requests_for_different_models_share_steps(served):
    c = client(served)
    jobs = [(m, p) for p in PROMPTS for m in MODELS] * 2  # 32 requests, 8 rows
    alone = {(m, p): c.completions.create(model=m, prompt=p, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for m, p in set(jobs)}
    before = mixed_steps(served)
    results, errors = [None] * len(jobs), []

    def ask(i):
        m, p = jobs[i]
        try:
            results[i] = client(served).completions.create(model=m, prompt=p, max_tokens=12, temperature=0,
                                                           extra_body={"ignore_eos": True}).choices[0].text
        except Exception as err:  # noqa: BLE001 -- reported below
            errors.append(err)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert mixed_steps(served) > before  # rows of several models were decoded in one step
    for job, text in zip(jobs, results):
        assert text == alone[job], job


def test_unknown_model_is_a_404(served):
    status, _, body = http("POST", served.url + "/v1/completions", {"model": "gamma", "prompt": "a", "max_tokens": 2})
    assert status == 404, body
    err = json.loads(body)["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "'alpha'" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client(served).chat.completions.create(model="gamma", messages=[{"role": "user", "content": "x"}])


def test_start_up_errors_are_one_line(tuned):
    base, a, b = str(tuned["base"]), str(tuned["lora-a"]), str(tuned["lora-b"])
    other = save_base(tuned["root"] / "other", seed=3)
    cases = [
        (["--checkpoint", str(other), "--adapter", a], "fingerprint"),
        (["--checkpoint", base, "--adapter", f"x={a}", "--adapter", f"x={b}"], "two adapters are named 'x'"),
        (["--checkpoint", base, "--adapter", f"base={a}"], "the base model's name"),
        (["--checkpoint", base, "--served-model-name", "lora-a", "--adapter", a], "the base model's name"),
        (["--checkpoint", base, "--adapter", a, "--parallel.tp=2"], "drop --parallel.tp"),
    ]
    for args, message in cases:
        code, _, err = run("serve", *args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)
