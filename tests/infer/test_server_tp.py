"""`torchrun --nproc-per-node 2 -m meshlm serve --parallel.tp=2` (gloo on CPU): greedy tokens equal tp=1's, also
with small blocks, chunked prefill and speculative decoding (the leader broadcasts each step's plan); so do n=2
seeded, sampled choices with a logit_bias (sampling runs on rank 0)."""

import json
import sys
import threading

import pytest

from meshlm.infer.engine import Engine, SamplingParams
from tests.checkpoint_helpers import load_run
from tests.infer.server_helpers import ServeProcess, http, save_gpt_checkpoint

LLAMA = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False,
         "n_kv_heads": 2}


@pytest.mark.slow
def test_tp2_server_greedy_equals_tp1(tmp_path):
    ckpt = save_gpt_checkpoint(tmp_path / "llama", seed=3, **LLAMA)  # GQA: 4 query heads, 2 KV heads
    prompts = ["Hello there", "ROMEO. But soft, what light", "a", "To be, or not to be: that is"]
    lengths = [12, 7, 15, 9]
    model, tokenizer, _ = load_run(str(ckpt))
    expected = Engine(model, tokenizer, max_seqs=4).generate(
        [tokenizer.encode(p) for p in prompts], [SamplingParams(max_tokens=n, temperature=0) for n in lengths])
    bias = {str(tokenizer.encode(" the")[0]): 4.0, str(tokenizer.encode(",")[0]): 2.5}  # n=2, seeded, biased
    choices = Engine(model, tokenizer, max_seqs=4).generate([tokenizer.encode("Hello there")] * 2, [
        SamplingParams(max_tokens=10, seed=7 + i, logit_bias={int(t): b for t, b in bias.items()}) for i in range(2)])

    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "meshlm"]
    server = ServeProcess("--checkpoint", str(ckpt), "--parallel.tp=2", "--max-seqs", "4", "--block-size", "4", "--max-batched-tokens", "8",
                          "--speculative", "ngram", prefix=launcher)  # small blocks, chunks, drafts: every step kind
    try:
        results = [None] * len(prompts)

        def ask(i):  # concurrently: the rows of one batch decode together on both ranks
            results[i] = http("POST", server.url + "/v1/completions",
                              {"prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0, "logprobs": 0})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for (status, _, body), req in zip(results, expected):
            assert status == 200, body
            out = json.loads(body)
            assert out["choices"][0]["text"] == req.text
            assert out["usage"]["completion_tokens"] == len(req.output_ids)
            assert "".join(out["choices"][0]["logprobs"]["tokens"]) == tokenizer.decode(req.output_ids)
        status, _, body = http("POST", server.url + "/v1/completions", {"prompt": "Hello there", "max_tokens": 10,
                                                                        "n": 2, "seed": 7, "logit_bias": bias})
        assert status == 200, body
        assert [c["text"] for c in json.loads(body)["choices"]] == [r.text for r in choices]
    finally:
        server.stop(timeout=60)
