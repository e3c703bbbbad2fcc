"""DeepSeek-V3's multi-token prediction modules in Hugging Face files (families/hf_deepseek.py `mtp_entries`,
interop/hf_deepseek.py): written and read in DeepSeek's own naming, `model.layers.{n + k}.` with `enorm`, `hnorm`,
`eh_proj`, a whole decoder layer, `shared_head.norm` and copies of the shared embedding and head, with
`num_nextn_predict_layers` in config.json.

A tiny transformers DeepSeek-V3 (built offline from its config class, which saves no MTP tensors though its config
says num_nextn_predict_layers=1) imports without modules; given depth-1 modules (random), meshlm exports them:
transformers loads the file with the module's layer as its only unexpected keys and the same logits, and meshlm reads
the file back to the very tensors, modules included.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from interop_helpers import perturbed
from safetensors import safe_open

from meshlm.interop.hf import load_hf, save_hf
from meshlm.models.gpt import GPT

transformers = pytest.importorskip("transformers")
SHAPE = {"vocab_size": 257, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
         "n_routed_experts": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 12,
         "qk_nope_head_dim": 16, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
         "first_k_dense_replace": 1, "max_position_embeddings": 32, "tie_word_embeddings": False}


def test_mtp_modules_round_trip_in_deepseek_naming(tmp_path):
    torch.manual_seed(0)
    hf = perturbed(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE)))
    assert hf.config.num_nextn_predict_layers == 1
    hf.save_pretrained(str(tmp_path / "hf"))
    plain = load_hf(tmp_path / "hf")
    assert plain.cfg.mtp_depth == 0 and plain.mtp is None  # the files hold no modules: none imported

    model = GPT(dataclasses.replace(plain.cfg, mtp_depth=1))
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("mtp.") for k in missing)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.mtp.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.eval()
    save_hf(model, tmp_path / "out")

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        mtp = {k for k in names if k.startswith("model.layers.2.")}
        assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
                "model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.norm.weight",
                "model.layers.2.shared_head.head.weight", "model.layers.2.input_layernorm.weight",
                "model.layers.2.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.mlp.gate.weight",
                "model.layers.2.mlp.shared_experts.down_proj.weight"} <= mtp
        assert torch.equal(f.get_tensor("model.layers.2.eh_proj.weight"), model.mtp[0].merge.weight)
        assert torch.equal(f.get_tensor("model.layers.2.embed_tokens.weight"), model.tok_emb.weight)

    back, info = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    unexpected = set(info["unexpected_keys"])  # (transformers names its fused experts' tensors its own way)
    assert not info["missing_keys"] and unexpected and all(k.startswith("model.layers.2.") for k in unexpected)
    ids = torch.randint(0, 257, (2, 16), generator=gen)
    with torch.no_grad():
        assert float((back.eval()(ids).logits - model(ids)).abs().max()) <= 1e-5

    again = load_hf(tmp_path / "out")
    assert again.cfg.mtp_depth == 1
    ours, theirs = model.state_dict(), again.state_dict()
    assert sorted(ours) == sorted(theirs)
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key


def test_an_architecture_without_modules_refuses_them(tmp_path):
    from meshlm.core.config import ConfigError, ModelConfig

    cfg = ModelConfig(vocab_size=64, n_layers=1, hidden_size=16, n_heads=2, seq_len=8, position="rope",
                      norm="rmsnorm", activation="swiglu", bias=False, mtp_depth=1)
    with pytest.raises(ConfigError, match="model.mtp_depth=1: Hugging Face llama has no multi-token prediction"):
        save_hf(GPT(cfg), tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # no file written
