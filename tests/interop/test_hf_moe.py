"""Mixtral and Qwen2-MoE to and from meshlm's mixture-of-experts GPT (interop/hf_moe.py, families/hf_moe.py).

Tiny models are built offline by `transformers` from a config, every parameter perturbed (`perturbed`), saved
with `save_pretrained` (per-expert tensors), imported with `meshlm convert --from-hf`, compared with
`transformers` (logits within 1e-5), exported with `--to-hf` and loaded by `from_pretrained` into the same class
with no missing or unexpected keys, to the very tensors it started from. A meshlm-trained MoE exports too,
with `meshlm convert --to-hf` and with `train.save_hf`, from one process and from an expert-parallel run's
per-rank pieces (torchrun, ~30 s: the one check that experts sliced over ranks reassemble); what Hugging Face
cannot hold is one error line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from interop_helpers import assert_same_state, load_whole, ok, one_error_line, perturbed

from meshlm.checkpoint.single import resolve_checkpoint, save_checkpoint
from meshlm.commands.train import build_trainer
from meshlm.core.config import ConfigError
from meshlm.interop.hf import from_hf_moe
from meshlm.interop.hf_config import model_config_from_hf
from tests.checkpoint_helpers import load_run
from tests.conftest import ROOT, tiny_config

transformers = pytest.importorskip("transformers")
TOL = 1e-5
SEQ = 16
VOCAB = 50257  # the bundled gpt2 tokenizer's size: the imports record data.tokenizer=gpt2
ATTENTION = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": SEQ, "tie_word_embeddings": False}


def mixtral(**overrides):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**ATTENTION, intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
                                     num_experts_per_tok=2, **overrides)
    return perturbed(transformers.MixtralForCausalLM(cfg))


def qwen2_moe(**overrides):
    """Four layers: 0 and 1 dense (mlp_only_layers), 2 dense (decoder_sparse_step=2 skips it), 3 MoE; the
    shared expert twice an expert's width, the top-k weights not renormalised, biases on q/k/v (as
    Qwen1.5-MoE-A2.7B: meshlm's model.bias with o_proj's and the dense MLPs' biases zero)."""
    torch.manual_seed(0)
    values = {**ATTENTION, "intermediate_size": 64, "num_hidden_layers": 4, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 48,
              "decoder_sparse_step": 2, "mlp_only_layers": [0, 1], "norm_topk_prob": False, "qkv_bias": True}
    return perturbed(transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**values, **overrides})))


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make, cls", [(mixtral, "MixtralForCausalLM"), (qwen2_moe, "Qwen2MoeForCausalLM")])
def test_moe_converts_both_ways(make, cls, tmp_path):
    hf = make()
    hf.save_pretrained(str(tmp_path / "hf"))
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    model, _, cfg = load_run(str(tmp_path / "run"))
    assert cfg.model.moe_experts == 4 and cfg.data.tokenizer == "gpt2"
    if cls == "Qwen2MoeForCausalLM":
        m = cfg.model
        assert (m.moe_shared_experts, m.moe_shared_gate, m.moe_norm_topk, m.moe_expert_hidden) == (2, True, False, 24)
        assert m.bias and not model.layers[0].attn.proj.bias.any()
        assert [m.is_moe_layer(i) for i in range(4)] == [False, False, False, True] and m.ffn_size == 64
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        assert float((model(ids) - want).abs().max()) <= TOL
        ok(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")])
        back = load_whole(getattr(transformers, cls), tmp_path / "out")
        assert_same_state(back.state_dict(), hf.state_dict())
        assert torch.equal(back(ids).logits, want)


@pytest.mark.parametrize("make", [mixtral, qwen2_moe])
def test_fused_in_memory_state_dict_converts(make):
    """transformers 5 holds the experts fused (`experts.gate_up_proj` (E, 2F, H), `experts.down_proj`); they
    read like the per-expert tensors `save_pretrained` writes."""
    hf = make()
    assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())
    model = from_hf_moe(hf.config, hf.state_dict()).eval()
    with torch.no_grad():
        assert float((model(_ids()) - hf(_ids()).logits).abs().max()) <= TOL


def _same_logits(hf_dir, checkpoint) -> float:
    hf = load_whole(transformers.AutoModelForCausalLM, hf_dir)
    ours = load_run(checkpoint)[0]
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return float((hf(ids).logits - ours(ids)).abs().max())


LLAMA = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False,
         "n_kv_heads": 2}
TRAINED = {"mixtral": {"moe_experts": 4, "moe_top_k": 2},
           "qwen2_moe": {"n_layers": 3, "moe_experts": 4, "moe_top_k": 2, "moe_expert_hidden": 16, "moe_every": 2,
                         "moe_shared_experts": 1, "moe_shared_gate": True, "moe_norm_topk": False}}


@pytest.mark.parametrize("arch", TRAINED)
def test_meshlm_trained_moe_loads_in_transformers(arch, tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(out, model={**LLAMA, **TRAINED[arch]},
                      train={"max_steps": 2, "save_every": 2, "save_hf": "end", "seed": 3})
    build_trainer(cfg).run()
    ok(["convert", "--checkpoint", str(out), "--to-hf", str(tmp_path / "hf")])
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "hf")).model_type == arch
    assert _same_logits(tmp_path / "hf", out) <= TOL
    assert _same_logits(out / "hf_checkpoints" / "latest", out) <= TOL  # train.save_hf's copy


def test_hf_options_meshlm_lacks_are_refused():
    def refused(hf_config, *words):
        with pytest.raises(ConfigError) as err:
            model_config_from_hf(hf_config.to_dict())
        for word in words:
            assert word in str(err.value), (word, str(err.value))

    small = {**ATTENTION, "num_hidden_layers": 4}
    refused(transformers.MixtralConfig(**small, sliding_window=8), "sliding_window=8")
    refused(transformers.Qwen2MoeConfig(**small, qkv_bias=False, mlp_only_layers=[2]), "mlp_only_layers=[2]")
    refused(transformers.Qwen2MoeConfig(**small, qkv_bias=False, moe_intermediate_size=24,
                                        shared_expert_intermediate_size=40), "shared_expert_intermediate_size=40")
    refused(transformers.Qwen3MoeConfig(**small, use_sliding_window=True, sliding_window=8), "use_sliding_window=true")


@pytest.mark.parametrize("model, words", [
    ({"moe_router": "sigmoid"}, ["model.moe_router='sigmoid'", "softmax"]),
    ({"moe_capacity_factor": 1.5}, ["model.moe_capacity_factor=1.5", "0.0"]),
    ({"moe_norm_topk": False}, ["model.moe_norm_topk=False", "Qwen2-MoE"]),
    ({"moe_shared_experts": 1}, ["model.moe_shared_gate=False", "True"]),
    ({"moe_shared_experts": 1, "moe_shared_gate": True, "bias": True}, ["layers.0.attn.proj.bias", "model.bias=false"]),
])
def test_export_of_what_hf_cannot_hold_is_one_line(model, words, tmp_path):
    from meshlm.models.gpt import GPT

    run = tmp_path / "run"
    cfg = tiny_config(run, model={**LLAMA, "moe_experts": 4, **model})
    save_checkpoint(run, 1, {"model": perturbed(GPT(cfg.model)).state_dict()}, cfg.to_dict())
    one_error_line(["convert", "--checkpoint", str(run), "--to-hf", str(tmp_path / "hf")], *words)
    assert not (tmp_path / "hf").exists()


def test_expert_parallel_checkpoint_exports(tmp_path):
    """The per-rank pieces of an ep 2 run (each rank 2 of the 4 experts) assemble, one tensor at a time, into
    Hugging Face's per-expert tensors: `--to-hf` and `train.save_hf` (torchrun, 2 processes)."""
    out = tmp_path / "run"
    small = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32", "--model.moe_experts=4",
             "--model.moe_expert_hidden=32", "--train.micro_batch_size=2", "--train.global_batch_size=4",
             "--train.eval_iters=1", "--train.eval_every=0", "--train.log_every=1", "--train.peak_tflops=1",
             "--train.sample_tokens=0", "--train.progress=false", "--parallel.timeout_s=60", "--train.precision=fp32",
             "--train.max_steps=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "meshlm", "train",
           "--config", "gpt-moe-tiny", *small, "--parallel.ep=2", "--train.save_hf=end", f"--train.out_dir={out}"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (resolve_checkpoint(out) / "index.json").exists(), "per-rank pieces"
    ok(["convert", "--checkpoint", str(out), "--to-hf", str(tmp_path / "hf")])
    assert _same_logits(tmp_path / "hf", out) <= TOL
    assert _same_logits(out / "hf_checkpoints" / "latest", out) <= TOL
