"""Qwen3 and Qwen3-MoE to and from meshlm's GPT (interop/hf_qwen3.py; `model.qk_norm`, `model.head_size`).

Tiny models are built offline by `transformers` from their config classes, every parameter perturbed (so the
per-head q/k norms are not ones and a dropped or swapped norm shows), with heads wider than hidden / heads
(Qwen3-0.6B's shape: 16 heads of 128 over a width of 1024), saved with `save_pretrained`, imported with
`meshlm convert --from-hf`, compared with `transformers` (logits within 1e-5, greedy generation token for token),
exported with `--to-hf` and loaded by `from_pretrained` into the same class with no missing or unexpected keys,
to the very tensors it started from. What meshlm lacks (a sliding window in use, attention biases) is refused.
"""

from __future__ import annotations

import pytest
import torch
from interop_helpers import IdTokenizer, assert_same_state, load_whole, ok, one_error_line, perturbed

from meshlm.checkpoint.single import save_checkpoint
from meshlm.commands.train import build_trainer
from meshlm.core.config import ConfigError, ModelConfig
from meshlm.interop.hf import from_hf_moe, load_hf, save_hf, to_hf_llama
from meshlm.interop.hf_config import model_config_from_hf
from meshlm.models.bert import BERT
from meshlm.models.generate import generate
from meshlm.models.gpt import GPT
from tests.checkpoint_helpers import load_run
from tests.conftest import tiny_config

transformers = pytest.importorskip("transformers")
TOL = 1e-5
SEQ = 16
VOCAB = 50257  # the bundled gpt2 tokenizer's size: the imports record data.tokenizer=gpt2
# head_dim 16 with hidden 32 and 4 heads: q is 64 wide, twice the hidden size (model.head_size)
ATTENTION = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "max_position_embeddings": SEQ, "rope_theta": 1e6}


def qwen3(**overrides):
    torch.manual_seed(0)
    values = {**ATTENTION, "intermediate_size": 48, "num_hidden_layers": 2, "tie_word_embeddings": True}
    return perturbed(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**values, **overrides})))


def qwen3_moe(**overrides):
    """Three layers: 0 dense (mlp_only_layers), 1 and 2 MoE; renormalised top-k (as Qwen3-30B-A3B), no shared
    expert, untied."""
    torch.manual_seed(0)
    values = {**ATTENTION, "intermediate_size": 40, "num_hidden_layers": 3, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 24, "mlp_only_layers": [0], "norm_topk_prob": True,
              "tie_word_embeddings": False}
    return perturbed(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**values, **overrides})))


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make, cls", [(qwen3, "Qwen3ForCausalLM"), (qwen3_moe, "Qwen3MoeForCausalLM")])
def test_qwen3_converts_both_ways(make, cls, tmp_path):
    hf = make()
    hf.save_pretrained(str(tmp_path / "hf"))
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    model, _, cfg = load_run(str(tmp_path / "run"))
    m = cfg.model
    assert (m.qk_norm, m.head_size, m.head_dim, m.bias, m.rope_theta) == (True, 16, 16, False, 1e6)
    assert float((model.layers[0].attn.q_norm.weight.detach() - 1).abs().max()) > 0  # the perturbed norms came along
    if cls == "Qwen3MoeForCausalLM":
        assert (m.moe_experts, m.moe_top_k, m.moe_expert_hidden, m.moe_norm_topk, m.moe_shared_experts) == \
            (4, 2, 24, True, 0)
        assert [m.is_moe_layer(i) for i in range(3)] == [False, True, True] and m.ffn_size == 40
    else:
        assert m.tie_embeddings and m.ffn_size == 48
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        assert float((model(ids) - want).abs().max()) <= TOL
        ok(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")])
        back = load_whole(getattr(transformers, cls), tmp_path / "out")
        assert_same_state(back.state_dict(), hf.state_dict())
        assert torch.equal(back(ids).logits, want)


@pytest.mark.parametrize("make", [qwen3, qwen3_moe])
def test_greedy_generation_equals_transformers(make, tmp_path):
    """meshlm's generate (KV cache, one token at a time after the prompt) and the serving engine that `meshlm
    serve` and `meshlm generate` run (paged cache, both prompts decoding together) continue as transformers'
    greedy generate does, token for token (untied: a tied random model mostly repeats its last token)."""
    from meshlm.infer.engine import Engine, SamplingParams

    hf = make(tie_word_embeddings=False)
    hf.save_pretrained(str(tmp_path))
    model = load_hf(tmp_path)
    prompt = _ids(2)[:, :5]
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    ours = generate(model.eval(), prompt, 10, temperature=0)
    assert torch.equal(ours, theirs)
    assert len(set(ours[:, 5:].flatten().tolist())) > 4  # a continuation, not one token repeated
    reqs = Engine(model, IdTokenizer(), max_seqs=2).generate(
        [row.tolist() for row in prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [r.output_ids for r in reqs] == theirs[:, 5:].tolist()


def test_fused_in_memory_state_dict_converts():
    """transformers 5 holds Qwen3-MoE's experts fused (`experts.gate_up_proj` (E, 2F, H)); they read like the
    per-expert tensors `save_pretrained` writes."""
    hf = qwen3_moe()
    assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())
    model = from_hf_moe(hf.config, hf.state_dict()).eval()
    with torch.no_grad():
        assert float((model(_ids()) - hf(_ids()).logits).abs().max()) <= TOL


def test_llama_with_wide_heads_converts(tmp_path):
    """model.head_size serves Llama's head_dim too (heads apart from hidden / heads)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in ATTENTION.items() if k != "rope_theta"},
                                      intermediate_size=48, num_hidden_layers=2)
    hf = perturbed(transformers.LlamaForCausalLM(config))
    hf.save_pretrained(str(tmp_path / "hf"))
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    model, _, cfg = load_run(str(tmp_path / "run"))
    assert (cfg.model.head_size, cfg.model.qk_norm) == (16, False)
    with torch.no_grad():
        assert float((model(_ids()) - hf(_ids()).logits).abs().max()) <= TOL
        ok(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")])
        assert_same_state(load_whole(transformers.LlamaForCausalLM, tmp_path / "out").state_dict(), hf.state_dict())


LLAMA = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False,
         "n_kv_heads": 2, "qk_norm": True, "head_size": 16}
TRAINED = {"qwen3": {}, "qwen3_moe": {"n_layers": 3, "moe_experts": 4, "moe_top_k": 2, "moe_expert_hidden": 16,
                                      "moe_first_dense": 1, "moe_norm_topk": False}}


@pytest.mark.parametrize("arch", TRAINED)
def test_meshlm_trained_qk_norm_model_loads_in_transformers(arch, tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(out, model={**LLAMA, **TRAINED[arch]}, train={"max_steps": 2, "save_every": 2, "seed": 3})
    build_trainer(cfg).run()
    ok(["convert", "--checkpoint", str(out), "--to-hf", str(tmp_path / "hf")])
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "hf")).model_type == arch
    hf = load_whole(transformers.AutoModelForCausalLM, tmp_path / "hf")
    ours = load_run(str(out))[0]
    assert float((ours.layers[0].attn.k_norm.weight.detach() - 1).abs().max()) > 0  # trained: the norms moved
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert float((hf(ids).logits - ours(ids)).abs().max()) <= TOL


def test_what_meshlm_lacks_is_refused():
    def refused(hf_config, *words):
        with pytest.raises(ConfigError) as err:
            model_config_from_hf(hf_config.to_dict())
        for word in words:
            assert word in str(err.value), (word, str(err.value))

    small = {**ATTENTION, "num_hidden_layers": 2}
    refused(transformers.Qwen3Config(**small, use_sliding_window=True, sliding_window=8), "use_sliding_window=true")
    refused(transformers.Qwen3Config(**small, layer_types=["full_attention", "sliding_attention"]),
            "sliding_attention")
    refused(transformers.Qwen3Config(**small, attention_bias=True), "attention_bias=true")
    refused(transformers.Qwen3MoeConfig(**small, mlp_only_layers=[1]), "mlp_only_layers=[1]")
    off = model_config_from_hf(transformers.Qwen3Config(**small, sliding_window=8, use_sliding_window=False).to_dict())
    assert off.qk_norm  # the window's keys, present but off, are accepted


def test_qk_norm_config_rules_name_the_key(tmp_path):
    base = {"vocab_size": 64, "n_layers": 1, "hidden_size": 32, "n_heads": 4, "seq_len": 8, "qk_norm": True}
    with pytest.raises(ConfigError, match=r"model\.qk_norm=true.*model\.norm='layernorm'.*rmsnorm"):
        ModelConfig(**base).validate()
    bert = ModelConfig(**base, family="bert", norm="rmsnorm", activation="gelu_exact", bert_head="encoder")
    with pytest.raises(ConfigError, match=r"model\.qk_norm=True.*BERT has no per-head q/k norms"):
        save_hf(BERT(bert), tmp_path)
    assert not any(tmp_path.iterdir())
    with pytest.raises(ConfigError, match=r"model\.head_size=-1"):
        ModelConfig(**{**base, "qk_norm": False}, head_size=-1).validate()
    cfg = ModelConfig(**base, norm="rmsnorm", position="rope", activation="swiglu", bias=False)
    with pytest.raises(ConfigError, match=r"qk_norm=true.*llama.*'qwen3'"):
        to_hf_llama(GPT(cfg))


def test_export_of_what_qwen3_cannot_hold_is_one_line(tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(run, model={**LLAMA, "moe_experts": 4, "moe_shared_experts": 1, "moe_shared_gate": True})
    save_checkpoint(run, 1, {"model": perturbed(GPT(cfg.model)).state_dict()}, cfg.to_dict())
    one_error_line(["convert", "--checkpoint", str(run), "--to-hf", str(tmp_path / "hf")],
                   "model.moe_shared_experts=1", "qwen3_moe")
    assert not (tmp_path / "hf").exists()


def test_gguf_export_refuses_what_it_would_drop(tmp_path):
    """llama.cpp's `llama` GGUF has no per-head q/k norms and meshlm writes no head width: refused, not dropped."""
    run = tmp_path / "run"
    cfg = tiny_config(run, model=LLAMA)
    save_checkpoint(run, 1, {"model": GPT(cfg.model).state_dict()}, cfg.to_dict())
    one_error_line(["convert", "--checkpoint", str(run), "--to-gguf", str(tmp_path / "m.gguf")],
                   "model.qk_norm=True", "model.head_size=16")
    assert not (tmp_path / "m.gguf").exists()


def test_qwen3_0_6b_shape_reads_and_counts_as_transformers_builds_it():
    """Qwen3-0.6B's published shape (hidden 1024, 16 heads of 128, 8 KV heads, 28 layers, tied): the config reads
    with head_size 128, and meshlm's parameter count (core/memory.py, the q/k norms included) equals the
    parameters of both models built on the meta device: 596,049,920."""
    from meshlm.core.memory import parameter_count

    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                      intermediate_size=3072, tie_word_embeddings=True, max_position_embeddings=40960,
                                      rope_theta=1e6)
    m = model_config_from_hf(config.to_dict())
    assert (m.head_size, m.qk_norm, m.kv_heads, m.tie_embeddings) == (128, True, 8, True)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.Qwen3ForCausalLM(config).parameters())
        ours = GPT(m).num_params()
    assert parameter_count(m) == ours == theirs == 596_049_920
