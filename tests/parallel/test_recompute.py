"""Activation recomputation in one process: unchanged numbers, what is saved, and the config errors.

The tensor-parallel cases (tp=2 with and without SP, the TP dropout stream replayed) are in
test_recompute_tp.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from meshlm.core.config import ConfigError, build
from meshlm.core.flops import model_flops, recompute_flops
from meshlm.core.layout import full_recompute_chunks, recomputed_layers
from meshlm.families.registry import get_spec, spec_of
from meshlm.models.activations import measure_saved_activations
from meshlm.models.generate import generate
from meshlm.models.gpt import GPT
from meshlm.parallel import parallelize
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.recompute import apply_recompute
from meshlm.parallel.rng import TPRNGTracker

STEPS, SEED, VOCAB = 5, 1234, 101
LLAMA = {"n_kv_heads": 2, "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False,
         "tie_embeddings": False}
MODES = [{"recompute": "selective"},
         {"recompute": "full"},
         {"recompute": "full", "recompute_num_layers": 2},
         {"recompute": "full", "recompute_num_layers": 3},
         {"recompute": "full", "recompute_method": "block", "recompute_num_layers": 1}]
MODE_IDS = ["selective", "full", "full_uniform2", "full_uniform3", "full_block1"]


def _config(arch: str = "gpt", dropout: float = 0.1, n_layers: int = 4, **train):
    model = {"vocab_size": VOCAB, "n_layers": n_layers, "hidden_size": 32, "n_heads": 4, "seq_len": 16,
             "dropout": dropout, **(LLAMA if arch == "llama" else {})}
    return build({"model": model, "train": train})


def _train(cfg) -> tuple[list[float], dict]:
    torch.manual_seed(SEED)
    model = GPT(cfg.model)
    parallelize(model, ParallelDims(), cfg, spec=spec_of(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        batch = torch.randint(0, VOCAB, (2, cfg.model.seq_len + 1), generator=data)
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference():
    return {arch: _train(_config(arch)) for arch in ("gpt", "llama")}


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_recompute_losses_match_none_with_dropout(reference, arch, mode):
    """Dropout on: the recomputation replays the same masks, so losses and weights are unchanged."""
    losses, state = _train(_config(arch, **mode))
    ref_losses, ref_state = reference[arch]
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-6 * abs(want), (losses, ref_losses)
    assert ref_losses[-1] != ref_losses[0]
    assert state.keys() == ref_state.keys()  # parameter names unchanged by the wrapping
    assert max(float((state[k] - v).abs().max()) for k, v in ref_state.items()) <= 1e-6


def test_recomputed_model_evaluates_and_generates_like_the_plain_one():
    cfg = _config("llama", dropout=0.0, recompute="full", recompute_num_layers=2)
    torch.manual_seed(SEED)
    plain = GPT(cfg.model)
    wrapped = GPT(cfg.model)
    wrapped.load_state_dict(plain.state_dict())
    apply_recompute(wrapped, cfg, spec=spec_of(wrapped))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain(ids), wrapped(ids))
    out_plain = generate(plain.eval(), ids[:1], 6, temperature=0.0)
    assert torch.equal(out_plain, generate(wrapped.eval(), ids[:1], 6, temperature=0.0))  # KV-cache path


def test_full_recompute_saves_only_the_region_inputs():
    """uniform chunks of 2: one saved input (s·b·h fp32) per chunk; block 1: the first layer only."""
    sbh_bytes = 16 * 2 * 32 * 4
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))

    def per_layer(**train):
        cfg = _config(dropout=0.0, **train)
        model = GPT(cfg.model)
        apply_recompute(model, cfg, spec=spec_of(model))
        return measure_saved_activations(model, lambda: model(ids).sum()).per_layer

    stored = per_layer()[0]
    assert stored > 10 * sbh_bytes
    assert per_layer(recompute="full", recompute_num_layers=2) == [sbh_bytes, 0, sbh_bytes, 0]
    assert per_layer(recompute="full", recompute_num_layers=3) == [sbh_bytes, 0, 0, sbh_bytes]
    assert per_layer(recompute="full", recompute_method="block", recompute_num_layers=1) == \
        [sbh_bytes, stored, stored, stored]
    assert per_layer(recompute="full") == [sbh_bytes] * 4


def test_recompute_chunks_follow_megatron_methods():
    assert full_recompute_chunks(5, "uniform", 0) == [[0], [1], [2], [3], [4]]
    assert full_recompute_chunks(5, "uniform", 2) == [[0, 1], [2, 3], [4]]
    assert full_recompute_chunks(5, "block", 2) == [[0], [1]]
    assert full_recompute_chunks(5, "block", 0) == [[0], [1], [2], [3], [4]]
    with pytest.raises(ConfigError, match="train.recompute_num_layers=6 exceeds the 5 layers"):
        full_recompute_chunks(5, "block", 6)


@pytest.mark.parametrize("train,parallel,match", [
    ({"recompute": "partial"}, {}, "train.recompute='partial' is not one of none, selective, full"),
    ({"recompute": "full", "recompute_method": "blocks"}, {}, "train.recompute_method='blocks'"),
    ({"recompute": "full", "recompute_num_layers": -1}, {}, "train.recompute_num_layers=-1 must be >= 0"),
    ({"recompute": "selective", "recompute_num_layers": 2}, {}, "only applies to train.recompute='full'"),
    ({"recompute_method": "block"}, {}, "train.recompute_method='block' only applies"),
    ({"recompute": "full", "recompute_num_layers": 5}, {}, "exceeds the 4 layers of a pipeline stage"),
    ({"recompute": "full", "recompute_num_layers": 3}, {"pp": 2}, "exceeds the 2 layers of a pipeline stage"),
])
def test_invalid_recompute_settings_name_the_key(train, parallel, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        build({"model": {"n_layers": 4}, "train": train, "parallel": parallel})


def test_hardware_flops_count_the_recomputed_forward():
    m = _config().model
    none = model_flops(m, 8)
    hfu = {}
    for mode in MODES:
        cfg = _config(**mode)
        hfu[mode.get("recompute_method", "uniform") + mode["recompute"]] = \
            none + recompute_flops(m, 8, cfg.train.recompute, layers=recomputed_layers(cfg))
    assert none < hfu["uniformselective"] < hfu["blockfull"] < hfu["uniformfull"]
    assert recomputed_layers(_config(recompute="full", recompute_method="block", recompute_num_layers=1)) == 1
    assert recomputed_layers(_config()) == 0


def test_trainer_logs_hfu_above_mfu_and_the_measured_activations(tmp_path, capsys):
    from meshlm.train.trainer import Trainer
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, train={"max_steps": 2, "recompute": "selective", "sample_tokens": 0})
    Trainer(cfg).run()
    out = capsys.readouterr().out
    assert "activations saved for backward" in out and "measured/formula 1.000" in out
    assert "HFU" in out
    rec = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rec if r["kind"] == "train"]
    assert train and all(r["hfu"] > r["mfu"] for r in train)


def test_compile_with_tp_dropout_replay_is_a_clear_error():
    cfg = _config(recompute="selective", compile=True)
    with pytest.raises(ConfigError, match="train.compile=true cannot trace"):
        apply_recompute(GPT(cfg.model), cfg, rng=TPRNGTracker(0, 0), spec=get_spec(cfg.model.family))
    apply_recompute(GPT(cfg.model), cfg, spec=get_spec(cfg.model.family))  # no TP stream: the plain checkpoint, which compile traces
