"""`torchrun --nproc-per-node 2 -m meshlm serve --parallel.tp=2` (gloo on CPU): greedy tokens equal tp=1's."""

import json
import sys
import threading

import pytest

from meshlm.checkpoint.load import load_model_from_checkpoint
from meshlm.infer.engine import Engine, SamplingParams
from tests.infer.server_helpers import ServeProcess, http, save_gpt_checkpoint

LLAMA = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False,
         "n_kv_heads": 2}


@pytest.mark.slow
def test_tp2_server_greedy_equals_tp1(tmp_path):
    ckpt = save_gpt_checkpoint(tmp_path / "llama", seed=3, **LLAMA)  # GQA: 4 query heads, 2 KV heads
    prompts = ["Hello there", "ROMEO. But soft, what light", "a", "To be, or not to be: that is"]
    lengths = [12, 7, 15, 9]
    model, tokenizer, _ = load_model_from_checkpoint(str(ckpt))
    expected = Engine(model, tokenizer, max_seqs=4).generate(
        [tokenizer.encode(p) for p in prompts], [SamplingParams(max_tokens=n, temperature=0) for n in lengths])

    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "meshlm"]
    server = ServeProcess("--checkpoint", str(ckpt), "--parallel.tp=2", "--max-seqs", "4", prefix=launcher)
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
    finally:
        server.stop(timeout=60)
