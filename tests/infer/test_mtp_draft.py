"""`--speculative mtp` (infer/mtp_draft.py): the served model's multi-token prediction modules as the draft.

The draft is what the modules were trained to predict (checked through the training loss itself); greedy output
through the engine equals plain greedy decoding; seeded sampling repeats; depth D caps the drafts per step at D;
the server builds the proposer from its options, refuses a model without modules, and reports the acceptance rate
in /metrics with the other speculation modes' counters.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from meshlm.core.config import ConfigError
from meshlm.infer.engine import CacheOptions, Engine, SamplingParams
from meshlm.infer.mtp_draft import MTPDraft
from meshlm.infer.speculative import Speculator
from meshlm.models.gpt import GPT
from tests.infer.test_engine import CONFIGS, CharTokenizer, alone, prompts_of


def mtp_model(name: str, depth: int = 2, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(CONFIGS[name], mtp_depth=depth)).eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_first_draft_is_the_token_the_training_loss_scores_best(name):
    """Module 1's loss at the last position, for every candidate v as the target after t_{L-1}: its minimum is
    at the draft (the training path: `head_loss` on the sequence with v appended)."""
    model = mtp_model(name, depth=1)
    tokens = prompts_of([9], seed=4)[0]
    (draft,), _ = MTPDraft(model).propose([("a", tokens, SamplingParams(temperature=0))], 4)[0]
    V, L = model.cfg.vocab_size, len(tokens)
    x = torch.tensor([tokens]).repeat(V, 1)  # (V, L): t_0..t_{L-1}
    y = torch.cat((x[:, 1:], torch.arange(V)[:, None]), dim=1)  # (V, L): t_1..t_{L-1}, v
    with torch.no_grad():
        h = model.norm(model.run_layers(model.embed(x)))
        scores = []
        for v in range(V):  # CE_1 of row v: only its last scored position (L − 2, target v) differs between rows
            scores.append(model.mtp.losses(h[v:v + 1], y[v:v + 1], model.tok_emb, model.normed_loss,
                                           model.rope(L))[0])
    assert int(torch.stack(scores).argmin()) == draft


@pytest.mark.parametrize("name", CONFIGS)
def test_speculative_mtp_greedy_outputs_equal_the_plain_model(name):
    model = mtp_model(name)
    prompts = prompts_of([3, 11, 1, 7], seed=1) + [[5, 6, 7, 5, 6, 7, 5, 6]]
    lengths = [12, 5, 18, 9, 14]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    engine = Engine(model, CharTokenizer(), max_seqs=4, options=CacheOptions(block_size=4, num_draft_tokens=3),
                    speculator=Speculator("mtp", MTPDraft(model)))
    drafted = []
    propose = engine.speculator.propose
    engine.speculator.propose = lambda reqs, k: [drafted.append(len(d)) or (d, q) for d, q in propose(reqs, k)]
    reqs = engine.generate(prompts, params)
    for p, n, r in zip(prompts, lengths, reqs):
        assert r.output_ids == alone(model, p, n)
    s = engine.stats
    assert s["draft_tokens"] > 0 and 0 <= s["accepted_tokens"] <= s["draft_tokens"]
    assert max(drafted) == 2  # depth 2: at most two drafts a step, though 3 were allowed
    assert engine.pool.used == 0


def test_speculative_mtp_sampling_with_a_seed_repeats():
    model = mtp_model("llama")
    prompts = prompts_of([4, 9, 2], seed=3)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    runs = []
    for _ in range(2):
        engine = Engine(model, CharTokenizer(), max_seqs=4, options=CacheOptions(block_size=4),
                        speculator=Speculator("mtp", MTPDraft(model)))
        runs.append([r.output_ids for r in engine.generate(prompts, params)])
        assert engine.stats["draft_tokens"] > 0
    assert runs[0] == runs[1] and len({tuple(r) for r in runs[0]}) == 3


def test_server_builds_the_mtp_proposer_and_refuses_a_model_without_modules():
    from meshlm.infer.server import make_speculator

    options = CacheOptions(block_size=4, speculative="mtp", num_draft_tokens=2)
    speculator = make_speculator(options, mtp_model("llama"), CharTokenizer(), 4, 64)
    assert speculator.method == "mtp" and isinstance(speculator.draft, MTPDraft)
    plain = GPT(CONFIGS["llama"]).eval()
    with pytest.raises(ConfigError, match="--speculative mtp needs a model with multi-token prediction"):
        make_speculator(options, plain, CharTokenizer(), 4, 64)


def test_metrics_report_the_mtp_acceptance_rate():
    from tests.infer.server_helpers import http
    from tests.infer.test_server_load import serve_in_thread, wait_until

    model = mtp_model("gpt2")
    engine = Engine(model, CharTokenizer(), max_seqs=2, options=CacheOptions(block_size=4, num_draft_tokens=2),
                    speculator=Speculator("mtp", MTPDraft(model)))
    with serve_in_thread(engine) as url:
        status, _, body = http("POST", url + "/v1/completions", {"prompt": "ABCABCABC", "max_tokens": 12,
                                                                  "temperature": 0})
        assert status == 200
        wait_until(lambda: engine.running == 0)
        text = http("GET", url + "/metrics")[2]
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    d, a = engine.stats["draft_tokens"], engine.stats["accepted_tokens"]
    assert d > 0 and int(float(values["meshlm_spec_draft_tokens_total"])) == d
    assert int(float(values["meshlm_spec_accepted_tokens_total"])) == a
    assert float(values["meshlm_spec_acceptance_rate"]) == pytest.approx(a / d)
    want = CharTokenizer().decode(alone(model, CharTokenizer().encode("ABCABCABC"), 12))
    assert '"text":"' + want + '"' in body.replace(" ", "") or want in body


def test_serve_refuses_mtp_speculation_for_a_model_without_modules(tmp_path):
    from tests.infer.server_helpers import free_port, save_gpt_checkpoint
    from tests.interop.interop_helpers import one_error_line

    ckpt = save_gpt_checkpoint(tmp_path / "ckpt")  # model.mtp_depth 0
    one_error_line(["serve", "--checkpoint", str(ckpt), "--port", str(free_port()), "--speculative", "mtp"],
                   "--speculative mtp needs a model with multi-token prediction modules")


def test_meshlm_serve_speculative_mtp_answers_the_plain_greedy_text_and_reports_acceptance(tmp_path):
    """`meshlm serve --speculative mtp` on a checkpoint with modules: greedy completions equal the plain model's
    greedy text, and /metrics counts the modules' drafts."""
    from meshlm.models.generate import generate
    from tests.checkpoint_helpers import load_run
    from tests.infer.server_helpers import ServeProcess, http, save_gpt_checkpoint

    ckpt = save_gpt_checkpoint(tmp_path / "ckpt", mtp_depth=2)
    model, tokenizer, _ = load_run(str(ckpt))
    server = ServeProcess("--checkpoint", str(ckpt), "--speculative", "mtp", "--num-draft-tokens", "3")
    try:
        for prompt in ("Once upon a time", "ROMEO."):
            status, _, body = http("POST", server.url + "/v1/completions",
                                   {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
            assert status == 200, body
            ids = tokenizer.encode(prompt)
            want = tokenizer.decode(generate(model, torch.tensor([ids]), 10, temperature=0)[0, len(ids):].tolist())
            assert json.loads(body)["choices"][0]["text"] == want
        text = http("GET", server.url + "/metrics")[2]
    finally:
        assert server.stop() == 0, "".join(server.stderr)[-3000:]
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    drafted, accepted = float(values["meshlm_spec_draft_tokens_total"]), float(values["meshlm_spec_accepted_tokens_total"])
    assert drafted > 0 and float(values["meshlm_spec_acceptance_rate"]) == pytest.approx(accepted / drafted)
