"""`models.init.meta_device`: a model built there has every parameter and RoPE table of the ordinary build
(shapes, dtypes, ties), stores nothing, runs none of torch's random initialisers on it, and, in a fresh
process, never imports torch's compiler stack (torch's meta `normal_` and `arange` would: ~140 MiB)."""

from __future__ import annotations

import subprocess
import sys

import torch

from meshlm.core.config import build
from meshlm.models.bert import BERT
from meshlm.models.gpt import GPT
from meshlm.models.init import meta_device

LLAMA = {"family": "gpt", "vocab_size": 300, "n_layers": 2, "hidden_size": 32, "n_heads": 4, "n_kv_heads": 2,
         "seq_len": 16, "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False,
         "moe_experts": 4, "moe_top_k": 2, "tie_embeddings": True}


def test_meta_build_has_the_ordinary_builds_tensors():
    cfg = build({"model": LLAMA}).model
    real = GPT(cfg)
    with meta_device():
        meta = GPT(cfg)
    ours = dict(meta.named_parameters(remove_duplicate=False))
    assert ours.keys() == dict(real.named_parameters(remove_duplicate=False)).keys()
    for name, p in real.named_parameters(remove_duplicate=False):
        assert ours[name].is_meta and ours[name].shape == p.shape and ours[name].dtype == p.dtype, name
    assert meta.lm_head.weight is meta.tok_emb.weight  # the tie survives
    for name, b in real.named_buffers():
        got = dict(meta.named_buffers())[name]
        assert got.is_meta and got.shape == b.shape, name
    meta.to_empty(device="cpu")
    meta.init_buffers(torch.device("cpu"))  # the tables, made on the real device as the loaders do
    torch.testing.assert_close(meta.rope_cos, real.rope_cos, rtol=0, atol=0)


def test_random_initialisers_still_run_on_real_tensors_inside():
    with meta_device():
        w = torch.empty(4, 4, device="cpu")
        torch.nn.init.normal_(w)
        v = torch.zeros(8, device="cpu").uniform_()
    assert w.abs().sum() > 0 and v.abs().sum() > 0


def test_meta_build_never_imports_the_compiler_stack():
    code = ("import sys, torch\n"
            "from meshlm.core.config import build\n"
            "from meshlm.models.gpt import GPT\n"
            "from meshlm.models.bert import BERT\n"
            "from meshlm.models.init import meta_device\n"
            f"cfg = build({{'model': {LLAMA!r}}}).model\n"
            "bert = build({'model': {'family': 'bert', 'vocab_size': 300, 'n_layers': 1, 'hidden_size': 32, "
            "'n_heads': 4, 'seq_len': 16}}).model\n"
            "with meta_device():\n"
            "    GPT(cfg); BERT(bert)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
    # the check has teeth: the plain meta device does import it
    plain = code.replace("with meta_device():", "with torch.device('meta'):")
    out = subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_bert_builds_on_meta_too():
    cfg = build({"model": {"family": "bert", "vocab_size": 300, "n_layers": 1, "hidden_size": 32, "n_heads": 4,
                           "seq_len": 16}}).model
    with meta_device():
        model = BERT(cfg)
    assert all(p.is_meta for p in model.parameters())
