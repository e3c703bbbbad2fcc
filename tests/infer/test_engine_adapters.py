"""Several adapters in one engine (meshlm/infer/adapters.py): rows of the base, of two LoRA adapters and of a
prompt adapter share decode steps, and each request's greedy tokens equal the tuned model alone (LoRA merged
into a copy of the base, virtual tokens attached, as `meshlm generate --adapter` runs them: a LoRA request's
row starts with the end-of-document token, as tuning rows do)."""

import copy
from types import SimpleNamespace

import pytest
import torch

from meshlm.core.config import ConfigError, TuneConfig, build
from meshlm.families.registry import get_spec
from meshlm.infer.adapters import AdapterSet, parse_adapter_args
from meshlm.infer.engine import Engine, InvalidRequest, SamplingParams
from meshlm.tune.adapters import apply_lora, is_adapter
from meshlm.tune.export import Adapter, apply_adapter
from tests.infer.test_engine import CONFIGS, CharTokenizer, alone, model_of, prompts_of


def config_of(name, tune: TuneConfig):
    m = CONFIGS[name]
    return build({"model": {k: getattr(m, k) for k in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "seq_len",
                                                       "vocab_size", "position", "norm", "activation", "bias",
                                                       "tie_embeddings")},
                  "tune": {"method": tune.method, "base": "unused", "lora_targets": tune.lora_targets,
                           "lora_rank": tune.lora_rank, "lora_alpha": tune.lora_alpha,
                           "virtual_tokens": tune.virtual_tokens}})


def lora_adapter(name, targets, seed) -> Adapter:
    """A LoRA adapter with random A and B (B is zeros at the start of tuning: random here, so it matters)."""
    tune = TuneConfig(method="lora", base="unused", lora_targets=targets, lora_rank=4, lora_alpha=8.0)
    cfg = config_of(name, tune)
    scratch = model_of(name)
    apply_lora(scratch, get_spec("gpt"), cfg, SimpleNamespace(pp_rank=0, tp_rank=0, tp=1), None)
    g = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(p.shape, generator=g) * 0.3 for n, p in scratch.named_parameters() if is_adapter(p)}
    return Adapter(tune, tensors, [], f"lora-{seed}")


def prompt_adapter(name, n, seed) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(1, n, CONFIGS[name].hidden_size, generator=g)
    return Adapter(TuneConfig(method="prompt", base="unused", virtual_tokens=n), {"prompt.table": table}, [], "p")


def tuned_alone(name, adapter, prompt, n):
    """Greedy tokens of the base with `adapter` applied as `meshlm generate --adapter` does (the virtual tokens'
    placeholders before the prompt; LoRA: the prompt alone)."""
    model = copy.deepcopy(model_of(name))
    cfg = config_of(name, adapter.tune)
    apply_adapter(model, cfg, adapter)
    head = [0] * adapter.virtual_tokens
    return alone(model, head + prompt, n)


@pytest.mark.parametrize("name", CONFIGS)
def test_rows_of_different_adapters_share_steps_and_equal_each_alone(name):
    base = model_of(name)
    cfg = config_of(name, TuneConfig())
    adapters = [lora_adapter(name, ["q", "v", "down"], 1), lora_adapter(name, ["o", "up"], 2),
                prompt_adapter(name, 3, 3)]
    served = AdapterSet(base, cfg, [("a", adapters[0]), ("b", adapters[1]), ("p", adapters[2])])
    engine = Engine(base, CharTokenizer(), max_seqs=5, adapters=served)  # 12 requests through 5 rows
    prompts = prompts_of([3, 9, 1, 6, 12, 4, 7, 2, 10, 5, 8, 3], seed=4)
    which = [i % 4 for i in range(12)]  # 0: the base, 1, 2: LoRA, 3: the prompt adapter
    lengths = [6 + i % 5 for i in range(12)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    reqs = engine.generate(prompts, params, which)
    assert engine.stats["mixed_steps"] > 0
    outputs = {}
    for prompt, n, k, req in zip(prompts, lengths, which, reqs):
        want = alone(base, prompt, n) if k == 0 else tuned_alone(name, adapters[k - 1], prompt, n)
        assert req.output_ids == want, (k, prompt)
        outputs.setdefault(tuple(prompt), {})[k] = req.output_ids
    # the four models differ (the test could fail): each adapter on the first prompt, against the base
    prompt = prompts[0]
    results = [alone(base, prompt, 8)] + [tuned_alone(name, a, prompt, 8) for a in adapters]
    assert len({tuple(r) for r in results}) == 4, results
    # the base model's weights were not touched: a base row alone still equals the plain model
    assert engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].output_ids == \
        alone(model_of(name), prompt, 8)


def test_virtual_tokens_count_against_the_context():
    base = model_of("gpt2")
    served = AdapterSet(base, config_of("gpt2", TuneConfig()), [("p", prompt_adapter("gpt2", 5, 0))])
    engine = Engine(base, CharTokenizer(), max_seqs=2, max_len=16, adapters=served)
    engine.check([1] * 10, SamplingParams(max_tokens=6))  # the base: 16 positions
    with pytest.raises(InvalidRequest, match="virtual tokens"):
        engine.check([1] * 10, SamplingParams(max_tokens=6), adapter=1)  # 5 + 10 + 6 > 16
    engine.check([1] * 10, SamplingParams(max_tokens=1), adapter=1)
    with pytest.raises(InvalidRequest):
        engine.check([1], SamplingParams(max_tokens=1), adapter=2)


def test_a_lora_row_is_its_prompt_alone():
    """As a tuning row (and `meshlm generate --adapter`, and PEFT with the exported tokenizer): nothing before
    the prompt, not even an end-of-document token; the whole context is the prompt's and the output's."""
    base = model_of("gpt2")
    adapter = lora_adapter("gpt2", ["q", "v"], 5)
    tokenizer = CharTokenizer()
    tokenizer.eod_id = 7  # not 0, the prompt adapters' placeholder id
    served = AdapterSet(base, config_of("gpt2", TuneConfig()), [("a", adapter)])
    engine = Engine(base, tokenizer, max_seqs=2, max_len=16, adapters=served)
    assert engine.head(0) == [] and engine.head(1) == []
    engine.check([1] * 10, SamplingParams(max_tokens=6), adapter=1)  # 10 + 6 = 16 positions, as the base
    with pytest.raises(InvalidRequest, match="context of 16 tokens"):
        engine.check([1] * 10, SamplingParams(max_tokens=7), adapter=1)
    prompt = [3, 1, 4, 1, 5]
    req = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0,
                                                   echo=True), [1])[0]
    merged = copy.deepcopy(base)
    apply_adapter(merged, config_of("gpt2", adapter.tune), adapter)
    assert req.output_ids == alone(merged, prompt, 4)
    assert req.output_ids != alone(merged, [7] + prompt, 4)  # a head would matter here (the line above could fail)
    assert engine.stats["prompt_tokens"] == len(prompt)
    assert [t.id for t in req.prompt_tokens] == prompt and req.prompt_tokens[0].logprob is None
    with torch.no_grad():
        want = torch.log_softmax(merged(torch.tensor([prompt]))[0].float(), -1)
    assert [t.logprob for t in req.prompt_tokens[1:]] == pytest.approx([float(want[i - 1, t]) for i, t in
                                                                        enumerate(prompt[1:], start=1)], abs=1e-5)


def test_adapter_arguments():
    assert parse_adapter_args(["runs/x", "b=runs/y", "runs/a=b"], "base") == \
        [("x", "runs/x"), ("b", "runs/y"), ("a=b", "runs/a=b")]
    for values, match in ((["runs/base"], "base model's name"), (["x=runs/a", "runs/x"], "two adapters"),
                          (["=runs/a"], "NAME=DIR")):
        with pytest.raises(ConfigError, match=match):
            parse_adapter_args(values, "base")
