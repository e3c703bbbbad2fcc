"""A mixture-of-experts checkpoint through `meshlm generate`, `meshlm serve` and `meshlm eval`, against
`transformers`: a tiny Mixtral built offline, perturbed, imported with `meshlm convert --from-hf`.

Greedy generation (the KV cache path through the MoE layers, one sequence at a time and batched by the
serving engine) must give the tokens of `transformers`' greedy `generate`, and the perplexity of `meshlm eval`
the one computed from `transformers`' logits.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from meshlm.cli import main
from meshlm.data.tokenizers import get_tokenizer
from tests.infer.server_helpers import ServeProcess, http

transformers = pytest.importorskip("transformers")
EOD = 50256
PROMPTS = ["ROMEO. But soft, what light", "Hello"]
NEW = 10


def _cli(*argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    assert code == 0, err.getvalue()
    return out.getvalue()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(transformers model, meshlm run directory) of one tiny Mixtral: 2 layers of 4 experts, top 2."""
    root = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=EOD + 1, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                                     bos_token_id=EOD, eos_token_id=EOD, initializer_range=0.2)
    hf = transformers.MixtralForCausalLM(cfg).eval()  # a wide init: confident predictions, no near-ties
    hf.save_pretrained(str(root / "hf"))
    _cli("convert", "--from-hf", str(root / "hf"), "--out", str(root / "tiny-moe"))
    return hf, root / "tiny-moe"


def _hf_greedy(hf, prompt: str) -> list[int]:
    ids = torch.tensor([get_tokenizer("gpt2").encode(prompt)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=EOD)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == NEW and EOD not in new  # else the comparisons below would stop early
    return new


def test_generate_and_serve_equal_transformers_greedy(mixtral):
    hf, run = mixtral
    tok = get_tokenizer("gpt2")
    want = {p: _hf_greedy(hf, p) for p in PROMPTS}
    for prompt in PROMPTS:
        text = _cli("generate", "--checkpoint", str(run), "--prompt", prompt, "--max-new-tokens", str(NEW),
                    "--temperature", "0")
        assert text == tok.decode(tok.encode(prompt) + want[prompt]) + "\n"
    server = ServeProcess("--checkpoint", str(run), "--max-seqs", "4")
    try:
        body = {"model": run.name, "prompt": PROMPTS, "max_tokens": NEW, "temperature": 0}
        status, _, text = http("POST", server.url + "/v1/completions", body)
        assert status == 200, text
        choices = sorted(json.loads(text)["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == [tok.decode(want[p]) for p in PROMPTS]
    finally:
        assert server.stop() == 0, "".join(server.stderr)[-3000:]


def test_eval_perplexity_equals_transformers(mixtral, tmp_path):
    hf, run = mixtral
    text = "Good morrow, kind sir; what news from the court of the king?"
    (tmp_path / "t.txt").write_text(text)
    res = json.loads(_cli("eval", "--checkpoint", str(run), "--task", "perplexity", "--data", str(tmp_path / "t.txt")))
    stream = torch.tensor([[EOD, *get_tokenizer("gpt2").encode(text)]])
    assert stream.shape[1] <= 64  # one window: no context is cut
    with torch.no_grad():
        logp = torch.log_softmax(hf(stream).logits[0, :-1].double(), -1)
    nll = -float(logp.gather(1, stream[0, 1:, None]).sum())
    assert res["tokens"] == stream.shape[1] - 1
    assert res["perplexity"] == pytest.approx(math.exp(nll / res["tokens"]), rel=1e-5)
