"""DeepSeek-V3 to and from meshlm's GPT (interop/hf_deepseek.py, families/hf_deepseek.py; models/mla.py).

Tiny DeepSeek-V3 models are built offline by `transformers` from `DeepseekV3Config`, every parameter perturbed
(latent norms apart from one) and the router's `e_score_correction_bias` set at random (so a dropped selection
bias changes which experts are chosen), with q compression (V3) and without (q_lora_rank None, V2-Lite), a first
dense layer, shared experts and routed_scaling_factor 2.5. They are saved with `save_pretrained`, imported with
`meshlm convert --from-hf`, compared with `transformers` (logits within 1e-5, greedy generation through
`meshlm generate`'s loop and the paged serving engine, token for token), exported with `--to-hf` and loaded by
`from_pretrained` with no missing or unexpected keys, to the very tensors they started from.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from interop_helpers import (
    IdTokenizer,
    assert_generate_and_serve_equal_hf,
    assert_same_state,
    load_whole,
    ok,
    one_error_line,
    perturbed,
)

from meshlm.checkpoint.single import save_checkpoint
from meshlm.core.config import ConfigError
from meshlm.infer.engine import Engine
from meshlm.infer.sampling import SamplingParams
from meshlm.interop.hf import load_hf
from meshlm.interop.hf_config import hf_config_dict, model_config_from_hf
from meshlm.models.generate import generate
from meshlm.models.gpt import GPT
from tests.checkpoint_helpers import load_run
from tests.conftest import tiny_config

transformers = pytest.importorskip("transformers")
TOL = 1e-5
SEQ = 32
VOCAB = 50257  # the bundled gpt2 tokenizer's size: the imports record data.tokenizer=gpt2
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
         "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 24,
         "qk_rope_head_dim": 8, "v_head_dim": 12, "qk_nope_head_dim": 16, "n_group": 1, "topk_group": 1,
         "num_experts_per_tok": 2, "first_k_dense_replace": 1, "norm_topk_prob": True,
         "max_position_embeddings": SEQ, "tie_word_embeddings": False, "rope_theta": 1e4}


def deepseek(**overrides):
    torch.manual_seed(0)
    hf = perturbed(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SHAPE, **overrides})))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return hf


def _ids(seed: int = 1, n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("q_lora_rank, n_group, topk_group", [(24, 1, 1), (None, 4, 2)])
def test_deepseek_v3_converts_both_ways(q_lora_rank, n_group, topk_group, tmp_path):
    """V3's shape (q compression) without groups; V2-Lite's plain q_proj with group-limited routing (8 experts in 4
    groups, the best 2 groups kept)."""
    hf = deepseek(q_lora_rank=q_lora_rank, n_group=n_group, topk_group=topk_group)
    hf.save_pretrained(str(tmp_path / "hf"))
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    model, _, cfg = load_run(str(tmp_path / "run"))
    m = cfg.model
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == \
        ("mla", q_lora_rank or 0, 16, 16, 8, 12)
    assert (m.moe_experts, m.moe_top_k, m.moe_first_dense, m.moe_shared_experts, m.moe_router, m.moe_routed_scale,
            m.moe_expert_hidden, m.ffn_size, m.moe_groups, m.moe_topk_groups) == \
        (8, 2, 1, 1, "sigmoid", 2.5, 16, 48, n_group, topk_group)
    assert float(model.layers[1].mlp.router.score_bias.abs().max()) > 0  # the selection bias came along
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        assert float((model(ids) - want).abs().max()) <= TOL
        if n_group > 1:  # the groups change which experts are chosen here
            ungrouped = dataclasses.replace(m, moe_groups=1, moe_topk_groups=1)
            for layer in model.layers[1:]:
                layer.mlp.cfg = ungrouped
            assert float((model(ids) - want).abs().max()) > 1e-3
        ok(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")])
        back = load_whole(transformers.DeepseekV3ForCausalLM, tmp_path / "out")
        assert_same_state(back.state_dict(), hf.state_dict())
        assert torch.equal(back(ids).logits, want)


def test_greedy_generation_equals_transformers_and_the_engine(tmp_path):
    """meshlm's generate (KV cache of full keys and values) and the paged engine continue as transformers' greedy
    generate does, token for token."""
    hf = deepseek()
    hf.save_pretrained(str(tmp_path))
    model = load_hf(tmp_path).eval()
    prompt = _ids(2, 5)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    ours = generate(model, prompt, 10, temperature=0)
    assert torch.equal(ours, theirs)
    assert len(set(ours[:, 5:].flatten().tolist())) > 4  # a continuation, not one token repeated
    engine = Engine(model, IdTokenizer(), max_seqs=2)
    reqs = engine.generate([row.tolist() for row in prompt], SamplingParams(max_tokens=10, temperature=0,
                                                                            ignore_eos=True))
    assert [r.output_ids for r in reqs] == theirs[:, 5:].tolist()


def test_yarn_with_deepseek_mscale_matches_transformers():
    """DeepSeek's YaRN: cos/sin scaled by mscale(m)/mscale(m_all), the softmax by mscale(m_all)²."""
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 8,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
    hf = deepseek(rope_parameters=rope)
    cfg = model_config_from_hf(hf.config)
    assert (cfg.rope_scaling, cfg.rope_mscale_all_dim) == ("yarn", 0.8) and cfg.rope_attention_factor != 1.0
    from meshlm.interop.hf import _from_hf_state

    model = _from_hf_state(cfg, hf.state_dict(), "deepseek_v3").eval()
    with torch.no_grad():
        assert float((model(_ids()) - hf(_ids()).logits).abs().max()) <= TOL
    back = hf_config_dict(cfg)
    assert back["rope_parameters"]["mscale_all_dim"] == 0.8


def test_what_meshlm_lacks_is_refused():
    def refused(words, **overrides):
        with pytest.raises(ConfigError) as err:
            model_config_from_hf(transformers.DeepseekV3Config(**{**SHAPE, **overrides}).to_dict())
        for word in words:
            assert word in str(err.value), (word, str(err.value))
        assert "\n" not in str(err.value)

    refused(["model.moe_groups=3", "equal"], n_group=3, topk_group=1)
    refused(["attention_bias=true"], attention_bias=True)
    refused(["hidden_act='gelu'"], hidden_act="gelu")


def test_exports_of_what_the_formats_cannot_hold_are_one_line(tmp_path):
    """A dense MLA model: HF DeepSeek-V3 always has experts, a llama GGUF has no latent attention."""
    run = tmp_path / "run"
    mla = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False,
           "attention": "mla", "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
    cfg = tiny_config(run, model=mla)
    save_checkpoint(run, 1, {"model": GPT(cfg.model).state_dict()}, cfg.to_dict())
    one_error_line(["convert", "--checkpoint", str(run), "--to-hf", str(tmp_path / "hf")], "model.moe_experts=0",
                   "deepseek_v3")
    one_error_line(["convert", "--checkpoint", str(run), "--to-gguf", str(tmp_path / "m.gguf")],
                   "model.attention='mla'")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m.gguf").exists()


def test_generate_and_serve_equal_transformers_greedy(tmp_path):
    """`meshlm generate` (one sequence, KV cache) and `meshlm serve` (the paged engine, two prompts batched) give
    transformers' greedy tokens for an imported DeepSeek-V3."""
    assert_generate_and_serve_equal_hf(deepseek(bos_token_id=50256, eos_token_id=50256), tmp_path)
