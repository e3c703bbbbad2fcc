"""Using an adapter beyond `meshlm generate`: `meshlm eval --adapter` scores the tuned model (LoRA merged,
virtual tokens before every row), equal to brute force on the tuned model; `meshlm serve --adapter` serves
a LoRA adapter next to the base (its greedy completion equals the tuned model's on the prompt alone, as
tuning rows begin) and a virtual-token adapter (its completion equals `meshlm generate --adapter`'s). Several adapters on one server:
tests/infer/test_server_adapters.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from meshlm.checkpoint.load import open_checkpoint
from meshlm.tune.export import apply_adapter, read_adapter
from tests.checkpoint_helpers import load_run
from tests.eval.eval_helpers import last_logprob
from tests.tune.tune_helpers import QUIET, repeat_rows, run, save_base, write_jsonl

CHOICES = [{"context": f"say {w}:", "choices": ["red", "blue", "green", "gold"], "label": i % 4}
           for i, w in enumerate(["red", "blue", "green", "gold", "blue", "red"])]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("use")
    base = save_base(root / "base")
    train = write_jsonl(root / "train.jsonl", repeat_rows(32, 1))
    out = {"root": root, "base": base, "choice": write_jsonl(root / "choice.jsonl", CHOICES)}
    for method in ("lora", "prompt"):
        out[method] = root / method
        code, _, err = run("tune", "--checkpoint", str(base), "--method", method, "--train", str(train), "--valid",
                           str(train), "--out", str(out[method]), "--max-length", "16", *QUIET, "--train.max_steps=4",
                           "--optim.lr=3e-2", "--tune.virtual_tokens=3", "--tune.lora_targets=['q','v','down']")
        assert code == 0, err
    return out


def tuned_model(tuned, method: str):
    model, tok, cfg = load_run(str(tuned["base"]))
    adapter = read_adapter(tuned[method], cfg, open_checkpoint(tuned["base"]))
    apply_adapter(model, cfg, adapter)
    return model, tok, [0] * adapter.virtual_tokens


@pytest.mark.parametrize("method", ["lora", "prompt"])
def test_eval_with_adapter_equals_brute_force(tuned, method):
    code, out, err = run("eval", "--checkpoint", str(tuned["base"]), "--adapter", str(tuned[method]), "--task",
                         "choice", "--data", str(tuned["choice"]))
    assert code == 0, err
    res = json.loads(out)
    model, tok, head = tuned_model(tuned, method)
    hits, lls_all = [], []
    for row in CHOICES:
        ctx = head + tok.encode(row["context"])
        lls = []
        for c in row["choices"]:
            stream = head + tok.encode(row["context"] + " " + c)
            lls.append(sum(last_logprob(model, stream[:i], stream[i]) for i in range(len(ctx), len(stream))))
        hits.append(int(np.argmax(lls)) == row["label"])
        lls_all.append(lls)
    assert res["accuracy"] == pytest.approx(np.mean(hits))
    # The adapter is on in `meshlm eval`: a continuous score moves with it (the choice task's accuracy alone may
    # not move after 4 steps, and comparing whole results would compare their wall-time field).
    text = tuned["root"] / "text.txt"
    text.write_text("".join(f"{r['input']}{r['output']}\n" for r in repeat_rows(16, 2)))
    ppl = {name: json.loads(run("eval", "--checkpoint", str(tuned["base"]), *extra, "--task", "perplexity",
                                "--data", str(text))[1])["perplexity"]
           for name, extra in (("tuned", ["--adapter", str(tuned[method])]), ("base", []))}
    assert abs(ppl["tuned"] - ppl["base"]) > 1e-6 * ppl["base"], ppl
    # the per-choice log-likelihoods moved too (not just the same argmax)
    plain, ptok, _ = load_run(str(tuned["base"]))
    row = CHOICES[0]
    stream = ptok.encode(row["context"] + " red")
    ctx = ptok.encode(row["context"])
    plain_ll = sum(last_logprob(plain, stream[:i], stream[i]) for i in range(len(ctx), len(stream)))
    assert abs(plain_ll - lls_all[0][0]) > 1e-3


def test_eval_adapter_bad_inputs(tuned):
    code, _, err = run("eval", "--checkpoint", str(tuned["base"]), "--adapter-task", "x", "--task", "choice",
                       "--data", str(tuned["choice"]))
    assert code == 2 and "--adapter-task" in err
    other = save_base(tuned["root"] / "other", seed=3)
    code, _, err = run("eval", "--checkpoint", str(other), "--adapter", str(tuned["lora"]), "--task", "choice",
                       "--data", str(tuned["choice"]))
    assert code == 2 and "fingerprint" in err and len(err.strip().splitlines()) == 1


def test_serve_with_lora_adapter(tuned):
    from tests.infer.server_helpers import ServeProcess, http

    server = ServeProcess("--checkpoint", str(tuned["base"]), "--adapter", str(tuned["lora"]), "--max-seqs", "2")
    try:
        status, _, body = http("GET", server.url + "/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["base", "lora"]
        status, _, body = http("POST", server.url + "/v1/completions",
                               {"model": "lora", "prompt": "say gold:", "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        text = json.loads(body)["choices"][0]["text"]
    finally:
        assert server.stop() == 0
    model, tok, _ = tuned_model(tuned, "lora")
    ids, new = tok.encode("say gold:"), []  # the prompt alone, as tuning rows begin
    with torch.no_grad():
        while len(new) < 4:  # greedy, stopping at the end of the document as the server does
            nxt = int(model(torch.tensor([ids + new]))[0, -1].argmax())
            if nxt == tok.eod_id:
                break
            new.append(nxt)
    assert text == tok.decode(new)


def test_serve_with_a_virtual_token_adapter_equals_generate(tuned):
    from tests.infer.server_helpers import ServeProcess, http

    prompt = "say gold:"
    server = ServeProcess("--checkpoint", str(tuned["base"]), "--adapter", str(tuned["prompt"]), "--max-seqs", "2")
    try:  # ignore_eos: `meshlm generate` does not stop at the end of the document either
        status, _, body = http("POST", server.url + "/v1/completions", {"model": "prompt", "prompt": prompt,
                                                                        "max_tokens": 5, "temperature": 0,
                                                                        "ignore_eos": True})
        assert status == 200, body
        text = json.loads(body)["choices"][0]["text"]
    finally:
        assert server.stop() == 0
    code, out, err = run("generate", "--checkpoint", str(tuned["base"]), "--adapter", str(tuned["prompt"]),
                         "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "5")
    assert code == 0, err
    assert out == prompt + text + "\n"
