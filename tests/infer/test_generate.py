import pytest
import torch

from meshlm.cli import main
from meshlm.core.config import ModelConfig
from meshlm.models.generate import NonFiniteLogits, generate, sample_next
from meshlm.models.gpt import GPT
from tests.infer.server_helpers import save_gpt_checkpoint

CONFIGS = {
    "gpt2": ModelConfig(n_layers=2, hidden_size=32, n_heads=4, seq_len=64, vocab_size=97),
    "llama": ModelConfig(n_layers=2, hidden_size=32, n_heads=4, n_kv_heads=2, seq_len=64, vocab_size=97,
                         position="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_with_kv_cache_equals_without(name):
    torch.manual_seed(0)
    model = GPT(CONFIGS[name])
    prompt = torch.randint(0, 97, (3, 5))
    with_cache = generate(model, prompt, 40, temperature=0, use_cache=True)
    without = generate(model, prompt, 40, temperature=0, use_cache=False)
    assert with_cache.shape == (3, 45)
    assert torch.equal(with_cache, without)


@pytest.mark.parametrize("name", CONFIGS)
def test_cached_logits_match_full_forward(name):
    torch.manual_seed(1)
    model = GPT(CONFIGS[name]).eval()
    ids = torch.randint(0, 97, (2, 12))
    full = model(ids)
    caches = model.new_caches(2, 12)
    step_logits = [model(ids[:, :4], caches=caches, start=0)[:, -1]]
    for t in range(4, 12):
        step_logits.append(model(ids[:, t:t + 1], caches=caches, start=t)[:, -1])
    torch.testing.assert_close(torch.stack(step_logits, 1), full[:, 3:], atol=1e-5, rtol=1e-5)


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    torch.manual_seed(0)
    model = GPT(CONFIGS["gpt2"])
    prompt = torch.zeros(1, 1, dtype=torch.long)
    a = generate(model, prompt, 20, temperature=1.0, seed=7)
    b = generate(model, prompt, 20, temperature=1.0, seed=7)
    assert torch.equal(a, b)
    assert torch.equal(generate(model, prompt, 20, temperature=1.0, top_k=1, seed=3),
                       generate(model, prompt, 20, temperature=0))


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, 0, 0.7, g)) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 needs the second token; the rest never drawn


def test_learned_positions_stop_at_seq_len():
    model = GPT(CONFIGS["gpt2"])
    out = generate(model, torch.zeros(1, 60, dtype=torch.long), 50, temperature=0)
    assert out.shape[1] == 64


def test_a_vanishing_temperature_samples_the_largest_logit_and_never_nan():
    """Issue 35: a temperature below fp32's smallest normal (1e-300 rounds to 0) once made logits / temperature
    NaN, and torch.multinomial failed on it."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 97, generator=g) * 30
    for t in (1e-300, 1e-38, 1e-45, 5e-324):
        for top_k, top_p in ((0, 1.0), (5, 0.5)):
            assert torch.equal(sample_next(logits, t, top_k, top_p, g), logits.argmax(-1, keepdim=True)), t
    overflowing = logits.clone()
    overflowing[:, 3] = float("inf")  # an overflowing model (or penalty): the largest is still drawn
    assert sample_next(overflowing, 1e-300, 0, 1.0, g).flatten().tolist() == [3] * 4
    broken = logits.clone()
    broken[1, 5] = float("nan")
    with pytest.raises(NonFiniteLogits, match="NaN"):
        sample_next(broken, 0.7, 0, 1.0, g)


def test_the_generate_command_with_a_vanishing_temperature_decodes_greedily(tmp_path, capsys):
    ckpt = save_gpt_checkpoint(tmp_path / "tiny-gpt")
    outputs = []
    for temperature in ("0", "1e-300"):
        code = main(["generate", "--checkpoint", str(ckpt), "--prompt", "Hello", "--max-new-tokens", "8",
                     "--temperature", temperature, "--seed", "1"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        outputs.append(captured.out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("Hello")
