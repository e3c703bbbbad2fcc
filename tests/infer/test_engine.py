"""The inference engine (meshlm/infer/engine.py): continuous batching equals one request at a time."""

import pytest
import torch
import torch.nn.functional as F

from meshlm.core.config import ModelConfig
from meshlm.infer.engine import (
    Engine,
    InvalidRequest,
    QueueFull,
    Request,
    Runner,
    SamplingParams,
    apply_penalties,
    wait_for,
)
from meshlm.models.generate import generate
from meshlm.models.gpt import GPT

CONFIGS = {
    "gpt2": ModelConfig(n_layers=2, hidden_size=32, n_heads=4, seq_len=64, vocab_size=97),
    "llama": ModelConfig(n_layers=2, hidden_size=32, n_heads=4, n_kv_heads=2, seq_len=64, vocab_size=97,
                         position="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False),
}


class CharTokenizer:
    """id i ↔ one character; id 0 is the end of document."""

    eod_id = 0

    def decode(self, ids):
        return "".join(chr(0x41 + i) for i in ids)

    def encode(self, text):
        return [ord(c) - 0x41 for c in text]


def model_of(name, seed=0):
    torch.manual_seed(seed)
    return GPT(CONFIGS[name]).eval()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in lengths]


def alone(model, prompt, n, use_cache=True):
    out = generate(model, torch.tensor([prompt]), n, temperature=0, use_cache=use_cache)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", CONFIGS)
def test_batched_greedy_equals_unbatched_with_rows_joining_midway(name):
    model = model_of(name)
    prompts = prompts_of([3, 11, 1, 7, 20, 5, 9])
    engine = Engine(model, CharTokenizer(), max_seqs=3)  # 7 requests through 3 rows: rows freed and refilled
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 5, 18, 9, 3, 14, 7)]
    first = [engine.submit(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    for _ in range(3):
        engine.step()
    assert all(len(r.output_ids) == 3 for r in first)  # a prefill step (the first token), 2 decode steps
    rest = [engine.submit(p, sp) for p, sp in zip(prompts[2:], params[2:])]  # join while the first two run
    while not all(r.finished for r in first + rest):
        engine.step()
    for prompt, sp, req in zip(prompts, params, first + rest):
        assert req.output_ids == alone(model, prompt, sp.max_tokens), prompt
        assert req.finish_reason == "length"
    assert engine.running == 0 and engine.queue_length == 0


@pytest.mark.parametrize("name", CONFIGS)
def test_engine_with_kv_cache_equals_no_cache(name):
    model = model_of(name, seed=1)
    prompts = prompts_of([4, 13, 2], seed=1)
    reqs = Engine(model, CharTokenizer(), max_seqs=4).generate(
        prompts, SamplingParams(max_tokens=15, temperature=0, ignore_eos=True))
    for prompt, req in zip(prompts, reqs):
        assert req.output_ids == alone(model, prompt, 15, use_cache=False)


@pytest.mark.parametrize("name", CONFIGS)
def test_logprobs_equal_log_softmax_of_a_full_forward(name):
    model = model_of(name, seed=2)
    prompts = prompts_of([6, 10], seed=2)
    sp = SamplingParams(max_tokens=8, temperature=0.9, seed=5, logprobs=3, echo=True, ignore_eos=True)
    reqs = Engine(model, CharTokenizer(), max_seqs=2).generate(prompts, sp)
    for prompt, req in zip(prompts, reqs):
        ids = prompt + req.output_ids
        with torch.no_grad():
            full = F.log_softmax(model(torch.tensor([ids]))[0].float(), -1)  # (T, V)
        n = len(prompt)
        chosen = torch.tensor([t.logprob for t in req.output])
        torch.testing.assert_close(chosen, full[n - 1:-1].gather(1, torch.tensor(req.output_ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=1e-4)
        for i, tok in enumerate(req.output):
            values, top = torch.topk(full[n - 1 + i], 3)
            assert [t for t, _ in tok.top] == top.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in tok.top]), values, atol=1e-4, rtol=1e-4)
        assert [t.id for t in req.prompt_tokens] == prompt and req.prompt_tokens[0].logprob is None
        echo = torch.tensor([t.logprob for t in req.prompt_tokens[1:]])
        torch.testing.assert_close(echo, full[:n - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0],
                                   atol=1e-4, rtol=1e-4)


def test_seeded_sampling_does_not_depend_on_the_batch():
    model = model_of("gpt2", seed=3)
    prompt = prompts_of([5], seed=3)[0]
    sp = SamplingParams(max_tokens=20, temperature=1.0, top_k=20, top_p=0.9, seed=11, ignore_eos=True)
    solo = Engine(model, CharTokenizer(), max_seqs=1).generate([prompt], sp)[0]
    others = SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    batch = Engine(model, CharTokenizer(), max_seqs=4).generate(prompts_of([3, 8, 2], seed=4) + [prompt],
                                                                [others] * 3 + [sp])
    assert batch[-1].output_ids == solo.output_ids
    different = Engine(model, CharTokenizer(), max_seqs=1).generate([prompt], SamplingParams(
        max_tokens=20, temperature=1.0, top_k=20, top_p=0.9, seed=12, ignore_eos=True))[0]
    assert different.output_ids != solo.output_ids


def test_stop_strings_and_eod_end_a_request():
    model = model_of("gpt2", seed=4)
    prompt = prompts_of([4], seed=5)[0]
    tok = CharTokenizer()
    full = Engine(model, tok).generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop = full.text[6:8]
    cut = Engine(model, tok).generate([prompt], SamplingParams(max_tokens=20, temperature=0, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    eod = full.output_ids[5]
    by_id = Engine(model, tok).generate([prompt], SamplingParams(max_tokens=20, temperature=0,
                                                                 stop_token_ids=(eod,)))[0]
    first = full.output_ids.index(eod)
    assert by_id.finish_reason == "stop" and by_id.output_ids == full.output_ids[:first + 1]
    assert by_id.text == tok.decode(full.output_ids[:first])


def test_penalties_follow_their_rules():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    req = Request([0, 1], SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    req.seen, req.counts = {0, 1, 2}, {2: 3}
    out = apply_penalties(logits, req)
    # repetition: positive logits divided, negative multiplied; then presence + frequency × count on output ids
    torch.testing.assert_close(out, torch.tensor([1.0, -2.0, 0.25 - 0.5 - 0.75, 3.0]))
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0]))  # the model's logits are not changed


def test_bounded_queue_and_invalid_requests():
    model = model_of("gpt2")
    engine = Engine(model, CharTokenizer(), max_seqs=2, max_queue=3)
    sp = SamplingParams(max_tokens=4, temperature=0)
    for _ in range(3):
        engine.submit([1, 2], sp)
    with pytest.raises(QueueFull):
        engine.submit([1, 2], sp)
    engine.step()  # two join the batch: room in the queue again
    engine.submit([1, 2], sp)
    with pytest.raises(InvalidRequest) as err:
        engine.submit([1] * 65, sp)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequest) as err:
        engine.submit([1] * 60, SamplingParams(max_tokens=5))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as err:
        engine.submit([1], SamplingParams(top_p=0))
    assert err.value.param == "top_p"
    # the default pool: every row's max_len in blocks (layers × k,v × blocks·block_size·heads·hs × fp32)
    assert engine.runner.cache_bytes() == 2 * 2 * (2 * 4 * 16 * 4 * 8) * 4


def test_cancelled_request_frees_its_row():
    model = model_of("gpt2")
    engine = Engine(model, CharTokenizer(), max_seqs=1)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    a, b = engine.submit([1, 2, 3], sp), engine.submit([4, 5], sp)
    engine.step()
    engine.cancel(a)
    while not b.finished:
        engine.step()
    assert a.finish_reason == "abort" and len(a.output_ids) < 30
    assert b.output_ids == alone(model, [4, 5], 30)


def test_a_vanishing_temperature_samples_greedily():
    """Issue 35: 1e-300 rounds to 0 in fp32, and logits / temperature once made NaN (then multinomial failed)."""
    model = model_of("gpt2", seed=5)
    prompt = prompts_of([6], seed=6)[0]
    for temperature in (1e-300, 1e-38, 5e-324):
        req = Engine(model, CharTokenizer()).generate([prompt], SamplingParams(
            max_tokens=12, temperature=temperature, top_p=0.9, presence_penalty=0.5, ignore_eos=True))[0]
        greedy = Engine(model, CharTokenizer()).generate([prompt], SamplingParams(
            max_tokens=12, temperature=0, top_p=0.9, presence_penalty=0.5, ignore_eos=True))[0]
        assert req.finish_reason == "length" and req.output_ids == greedy.output_ids, temperature


class FlakyRunner(Runner):
    """A runner whose forward fails whenever its tokens hold token 13, and fails once more when `fail_once` is
    set (as a model error or an out-of-memory would)."""

    fail_once = False

    def forward(self, plan):
        if 13 in plan["ids"]:
            raise RuntimeError("forward failed on token 13")
        if self.fail_once:
            self.fail_once = False
            raise RuntimeError("transient failure")
        return super().forward(plan)


def test_a_failing_request_fails_alone_and_the_engine_serves_on():
    """Issue 35: an exception while running one request fails that request (finish_reason "error", its error
    said), never the engine: the other requests finish as they would alone (a failed step is run again request
    by request, so the one that fails is found), and later ones run."""
    model = model_of("gpt2", seed=6)
    runner = FlakyRunner(model, 16, 16, 97)
    engine = Engine(model, CharTokenizer(), max_seqs=4, runner=runner)
    engine.start()
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    try:
        good, bad, other = (engine.submit(p, sp) for p in ([1, 2, 3], [5, 13, 7], [9, 8]))
        for r in (good, bad, other):
            assert wait_for(r, 60).finished
        assert bad.finish_reason == "error" and "token 13" in bad.error
        assert good.output_ids == alone(model, [1, 2, 3], 10) and other.output_ids == alone(model, [9, 8], 10)
        assert engine.alive
        runner.fail_once = True  # a step that fails once: its requests run again one by one, unharmed
        again = [engine.submit([1, 2, 3], sp), engine.submit([9, 8], sp)]
        for r, ref in zip(again, (good, other)):
            assert wait_for(r, 60).finish_reason == "length" and r.output_ids == ref.output_ids
        assert engine.alive and engine.stats["requests_failed"] == 1
    finally:
        engine.stop(60)
