"""`optim.name=muon`: torch's Muon on the hidden layers' matrices, torch's AdamW on the rest, as one optimizer
(meshlm/train/optim.py `MuonAdamW`)."""

from __future__ import annotations

import copy

import pytest
import torch

from meshlm.checkpoint.single import load_part, resolve_checkpoint
from meshlm.core.config import ConfigError, ModelConfig, OptimConfig
from meshlm.core.layout import check_optimizer_sharding
from meshlm.families.registry import spec_of
from meshlm.models.gpt import GPT
from meshlm.models.params import param_groups
from meshlm.train.optim import build_optimizer, lr_at
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.train.test_resume import train_losses

LLAMA = {"n_kv_heads": 2, "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False,
         "tie_embeddings": False}


def small_model(**extra) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layers=2, hidden_size=32, n_heads=4, seq_len=16, vocab_size=64, **extra))


def train_steps(model, opt, cfg: OptimConfig, steps: int, start: int = 0) -> None:
    g = torch.Generator().manual_seed(1)
    for step in range(start + steps):
        x = torch.randint(0, 64, (2, 17), generator=g)
        if step < start:
            continue
        for group in opt.param_groups if not isinstance(opt, tuple) else [gr for o in opt for gr in o.param_groups]:
            group["lr"] = lr_at(step, cfg, 10)
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        for o in opt if isinstance(opt, tuple) else (opt,):
            o.step()
            o.zero_grad(set_to_none=True)


@pytest.mark.parametrize("extra", [{}, LLAMA], ids=["gpt2", "llama"])
def test_muon_steps_exactly_the_hidden_matrices(extra):
    model = small_model(**extra)
    names = {id(p): n for n, p in model.named_parameters()}
    hidden, decay, no_decay = param_groups(model, 0.1, muon=True)
    assert hidden["muon"] and not decay["muon"] and not no_decay["muon"]
    linears = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    assert sorted(names[id(p)] for p in hidden["params"]) == sorted(
        f"layers.{i}.{lin}.weight" for i in range(2) for lin in linears)
    rest = {names[id(p)] for p in decay["params"] + no_decay["params"]}
    assert "tok_emb.weight" in rest and all(not n.startswith("layers.") or n.endswith(("bias", "norm1.weight",
                                            "norm2.weight")) for n in rest)
    assert ("lm_head.weight" in rest) == (not model.cfg.tie_embeddings)
    # without muon: AdamW's two groups, the same as before the option existed
    assert [len(g["params"]) for g in param_groups(model, 0.1)] == [len(hidden["params"]) + len(decay["params"]),
                                                                    len(no_decay["params"])]


@pytest.mark.parametrize("extra", [{}, LLAMA], ids=["gpt2", "llama"])
def test_muon_adamw_equals_torch_muon_and_adamw_run_side_by_side(extra):
    """The combined optimizer is torch.optim.Muon (Nesterov, match_rms_adamw) on the hidden matrices and
    torch.optim.AdamW on the rest, under the schedule: bit-identical weights after 5 steps."""
    cfg = OptimConfig(name="muon", lr=1e-2, min_lr=1e-3, warmup_steps=2, weight_decay=0.1)
    ours = small_model(**extra)
    ref = copy.deepcopy(ours)
    train_steps(ours, build_optimizer(ours, cfg), cfg, 5)
    hidden, decay, no_decay = param_groups(ref, cfg.weight_decay, muon=True)
    muon = torch.optim.Muon(hidden["params"], lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=0.95,
                            nesterov=True, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": decay["params"], "weight_decay": cfg.weight_decay},
                               {"params": no_decay["params"], "weight_decay": 0.0}], lr=cfg.lr,
                              betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    train_steps(ref, (muon, adamw), cfg, 5)
    moved = 0
    for (name, a), b, p0 in zip(ours.named_parameters(), ref.parameters(), small_model(**extra).parameters(),
                                strict=True):
        assert torch.equal(a, b), name
        moved += not torch.equal(a, p0)
    assert moved == len(list(ours.parameters()))


def test_muon_state_dict_resumes_exactly():
    cfg = OptimConfig(name="muon", lr=1e-2, warmup_steps=1)
    straight = small_model()
    opt = build_optimizer(straight, cfg)
    train_steps(straight, opt, cfg, 2)
    saved_model, saved_opt = copy.deepcopy(straight.state_dict()), copy.deepcopy(opt.state_dict())
    assert {k for st in opt.state.values() for k in st} == {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"}
    train_steps(straight, opt, cfg, 3, start=2)
    resumed = small_model()
    resumed.load_state_dict(saved_model)
    opt2 = build_optimizer(resumed, cfg)
    opt2.load_state_dict(saved_opt)
    train_steps(resumed, opt2, cfg, 3, start=2)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_trainer_with_muon_learns_and_resumes_exactly(tmp_path):
    def run(out, steps, **train):
        cfg = tiny_config(out, optim={"name": "muon", "lr": 1e-2}, train={"max_steps": steps, **train})
        t = Trainer(cfg)
        t.run()
        return t

    straight = run(tmp_path / "a", 6)
    run(tmp_path / "b", 3)
    resumed = run(tmp_path / "b", 6, resume="auto")
    assert resumed.step == 6
    a = load_part(resolve_checkpoint(tmp_path / "a"), "model")
    b = load_part(resolve_checkpoint(tmp_path / "b"), "model")
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = train_losses(tmp_path / "a")
    assert losses == train_losses(tmp_path / "b")  # Muon's buffers came back with the checkpoint
    assert [s for s, _ in losses] == list(range(1, 7)) and losses[-1][1] < losses[0][1]
    assert "optim.pt" in {p.name for p in resolve_checkpoint(tmp_path / "a").iterdir()}
    assert straight.step == 6


@pytest.mark.parametrize("zero,tp,needle", [(1, 1, "parallel.zero=1"), (0, 2, "parallel.tp=2")])
def test_muon_refuses_layouts_that_split_its_matrices(zero, tp, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        check_optimizer_sharding("muon", zero, tp)
    assert "optim.name=adamw" in str(err.value)
    check_optimizer_sharding("muon", 0, 1)  # data and pipeline parallelism keep matrices whole


def test_bad_muon_momentum_names_the_key():
    with pytest.raises(ConfigError, match="optim.muon_momentum"):
        OptimConfig(name="muon", muon_momentum=1.0).validate()


def one_step_model_states(optim: str, **extra):
    """A small GPT (most of its parameters in the hidden matrices) in one process, as the trainer builds it,
    after one optimizer step (gradients still held): (config, gradient sync, optimizer)."""
    from meshlm.core.config import build
    from meshlm.families.registry import get_spec
    from meshlm.families.spec import family_loss
    from meshlm.parallel.dp import apply_data_parallel
    from meshlm.parallel.mesh import ParallelDims

    model_keys = {"n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 64, **extra}
    cfg = build({"model": model_keys, "optim": {"name": optim, "lr": 1e-3},
                 "train": {"micro_batch_size": 2, "global_batch_size": 2}})
    torch.manual_seed(0)
    spec = get_spec(cfg.model.family)
    model = spec.model_class(cfg.model)
    sync = apply_data_parallel(model, ParallelDims(), cfg, 1, spec=spec_of(model))
    opt = build_optimizer(sync, cfg.optim)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    family_loss(spec, cfg.model)(model(x[:, :-1]), x[:, 1:]).backward()
    sync.finish()
    opt.step()
    return cfg, sync, opt


@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("extra", [{}, LLAMA], ids=["gpt2", "llama"])
def test_model_states_log_line_theory_follows_the_optimizer(optim, extra):
    """The start-of-training "model states" line: its theory counts the states the optimizer built keeps
    (Muon: one buffer on the hidden matrices), within the 3% of the measured-against-theory dp tests."""
    import re

    from meshlm.parallel.data import memory_report, state_tensors_per_param

    _, sync, opt = one_step_model_states(optim, **extra)
    line = memory_report(sync, opt)
    measured = float(re.search(r"= ([\d.]+) B/param \(theory", line)[1])
    theory = float(re.search(r"= ([\d.]+) B/param\); largest", line)[1])
    assert abs(measured - theory) <= 0.03 * theory, line
    if optim == "adamw":
        assert theory == 16.0 and state_tensors_per_param(opt) == 2.0 and "master weights: 16 = 16.00" in line
    else:
        hidden = sum(p.numel() for p in opt.param_groups[0]["params"])
        total = sum(p.numel() for g in opt.param_groups for p in g["params"])
        assert state_tensors_per_param(opt) == pytest.approx(2 - hidden / total)
        assert theory < 14, "most of this model is hidden matrices: well below Adam's 16"
        assert "Muon's 1 on the hidden matrices" in line
