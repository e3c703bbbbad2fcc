"""LAMB (train/lamb.py) against the paper's formulas written out plainly, in float64."""

import copy
import itertools
import math

import pytest
import torch

from meshlm.core.config import Config, ConfigError, ModelConfig, OptimConfig, ParallelConfig
from meshlm.models.gpt import GPT
from meshlm.parallel.data import GradSync
from meshlm.parallel.mesh import ParallelDims
from meshlm.train.lamb import Lamb
from meshlm.train.optim import build_optimizer

F64 = torch.float64
SHAPES = [(4, 3), (5,), (2, 3, 2), (1,)]


def quadratic(seed: int = 0):
    """Weights w_i and a loss Σ ½·a_i·w_i² + b_i·w_i whose gradient a_i·w_i + b_i the reference can
    compute by hand."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen, dtype=F64) for s in SHAPES]
    a = [torch.rand(s, generator=gen, dtype=F64) + 0.5 for s in SHAPES]
    b = [torch.randn(s, generator=gen, dtype=F64) for s in SHAPES]
    return weights, a, b


def set_grads(params, a, b):
    for p, ai, bi in zip(params, a, b):
        p.grad = ai * p.detach() + bi


def reference(weights, a, b, steps, lrs, wds, betas=(0.9, 0.999), eps=1e-6, bias_correction=True,
              ratio_scale=1.0):
    """The paper's LAMB, one parameter at a time (ratio_scale multiplies each trust ratio)."""
    b1, b2 = betas
    w = [x.clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t in range(1, steps + 1):
        for i in range(len(w)):
            g = a[i] * w[i] + b[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1 ** t) if bias_correction else m[i]
            v_hat = v[i] / (1 - b2 ** t) if bias_correction else v[i]
            u = m_hat / (v_hat.sqrt() + eps) + wds[i] * w[i]
            w_norm = math.sqrt(float((w[i] * w[i]).sum()))
            u_norm = math.sqrt(float((u * u).sum()))
            r = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            w[i] = w[i] - lrs[i] * (r * ratio_scale) * u
    return w


def run_lamb(weights, a, b, steps, groups=None, **kw):
    params = [torch.nn.Parameter(x.clone()) for x in weights]
    opt = Lamb(groups(params) if groups else params, **kw)
    for _ in range(steps):
        set_grads(params, a, b)
        opt.step()
    return params, opt


def assert_close(got, want, tol=1e-12):
    for g, w in zip(got, want):
        assert g.dtype == F64
        assert (g.detach() - w).abs().max().item() <= tol * max(1.0, w.abs().max().item())


@pytest.mark.parametrize("steps", [1, 7])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_steps_match_the_papers_formulas(steps, bias_correction):
    weights, a, b = quadratic()
    got, _ = run_lamb(weights, a, b, steps, lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01,
                      bias_correction=bias_correction)
    want = reference(weights, a, b, steps, [0.05] * 4, [0.01] * 4, betas=(0.9, 0.99),
                     bias_correction=bias_correction)
    assert_close(got, want)
    assert any((g.detach() - w0).abs().max() > 1e-3 for g, w0 in zip(got, weights))  # it moved


def test_weight_decay_and_lr_per_group():
    weights, a, b = quadratic(1)

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0, "lr": 0.02}]

    got, opt = run_lamb(weights, a, b, 5, groups=groups, lr=0.1, weight_decay=0.5)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert_close(got, reference(weights, a, b, 5, [0.1, 0.1, 0.02, 0.02], [0.1, 0.1, 0.0, 0.0]))


def test_trust_ratio_is_one_for_zero_weights_and_zero_updates():
    g = torch.tensor([0.5, -2.0, 1e-3], dtype=F64)
    zero_w = torch.nn.Parameter(torch.zeros(3, dtype=F64))  # ‖w‖ = 0
    still = torch.nn.Parameter(torch.ones(2, dtype=F64))  # gradient 0, no decay: ‖u‖ = 0
    opt = Lamb([zero_w, still], lr=0.1, eps=1e-6, weight_decay=0.0)
    zero_w.grad, still.grad = g.clone(), torch.zeros(2, dtype=F64)
    opt.step()
    # step 1 with bias correction: m̂ = g, v̂ = g², so u = g / (|g| + eps) and w = −lr·1·u
    assert torch.equal(zero_w.detach(), -0.1 * (g / (g.abs() + 1e-6)))
    assert torch.equal(still.detach(), torch.ones(2, dtype=F64))
    assert torch.isfinite(zero_w).all()


def test_parameters_without_gradients_are_skipped():
    weights, a, b = quadratic(2)
    params = [torch.nn.Parameter(x.clone()) for x in weights]
    calls = []
    opt = Lamb(params, lr=0.1, reduce_squares=lambda s, ps: calls.append((s.clone(), ps)) or s)
    set_grads(params, a, b)
    params[1].grad = None
    opt.step()
    assert torch.equal(params[1].detach(), weights[1]) and params[1] not in opt.state
    (squares, ps), = calls
    assert squares.shape == (6,) and [id(p) for p in ps] == [id(p) for i, p in enumerate(params) if i != 1]
    params[0].grad = params[2].grad = params[3].grad = None
    params[1].grad = torch.zeros_like(params[1])
    opt.step()  # the others had no gradient: their step counts stay at 1
    assert [float(opt.state[p]["step"]) for p in params] == [1.0, 1.0, 1.0, 1.0]


def test_reduce_squares_is_called_once_per_step_and_used():
    weights, a, b = quadratic(3)
    n = len(weights)
    seen = []

    def record(squares, params):
        seen.append((squares.clone(), [p.detach().clone() for p in params]))
        return squares

    _, _ = run_lamb(weights, a, b, 3, lr=0.1, weight_decay=0.01, reduce_squares=record)
    assert len(seen) == 3
    for squares, before in seen:
        assert squares.shape == (2 * n,) and squares.dtype == F64
        assert torch.allclose(squares[:n], torch.stack([(w * w).sum() for w in before]), rtol=1e-13, atol=0)
        assert (squares[n:] > 0).all()

    # Two identical tp shards: both squares double, the ratio (and the update) is unchanged.
    doubled, _ = run_lamb(weights, a, b, 3, lr=0.1, weight_decay=0.01, reduce_squares=lambda s, ps: 2 * s)
    assert_close(doubled, reference(weights, a, b, 3, [0.1] * n, [0.01] * n))

    # Only ‖w‖² doubled: every trust ratio grows by √2.
    def double_weights(s, ps):
        return torch.cat([2 * s[:len(ps)], s[len(ps):]])

    scaled, _ = run_lamb(weights, a, b, 3, lr=0.1, weight_decay=0.01, reduce_squares=double_weights)
    assert_close(scaled, reference(weights, a, b, 3, [0.1] * n, [0.01] * n, ratio_scale=math.sqrt(2)))


def test_reduce_squares_of_the_wrong_shape_is_refused():
    weights, a, b = quadratic()
    with pytest.raises(RuntimeError, match="reduce_squares"):
        run_lamb(weights, a, b, 1, reduce_squares=lambda s, ps: s.sum())


def test_state_dict_round_trip_resumes_bit_exactly():
    weights, a, b = quadratic(4)
    params, opt = run_lamb(weights, a, b, 3, lr=0.05, weight_decay=0.01)
    saved_w = [p.detach().clone() for p in params]
    saved = copy.deepcopy(opt.state_dict())
    for _ in range(4):
        set_grads(params, a, b)
        opt.step()

    resumed = [torch.nn.Parameter(w.clone()) for w in saved_w]
    opt2 = Lamb(resumed, lr=0.05, weight_decay=0.01)
    opt2.load_state_dict(saved)
    assert isinstance(opt2.state[resumed[0]]["step"], torch.Tensor)
    for _ in range(4):
        set_grads(resumed, a, b)
        opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(params, resumed))
    assert float(opt2.state[resumed[0]]["step"]) == 7.0


def test_float32_and_mixed_precision_parameters():
    w32 = torch.nn.Parameter(torch.randn(8, 4))
    w16 = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    opt = Lamb([w32, w16], lr=0.01)
    w32.grad, w16.grad = torch.randn(8, 4), torch.randn(8, dtype=torch.bfloat16)
    before = w32.detach().clone()
    opt.step()
    assert opt.state[w16]["exp_avg"].dtype == torch.bfloat16 and opt.state[w32]["exp_avg"].dtype == torch.float32
    assert torch.isfinite(w32).all() and not torch.equal(w32.detach(), before)
    # a step moves w by lr·‖w‖ in norm (r·‖u‖ = ‖w‖)
    assert (w32.detach() - before).norm().item() == pytest.approx(0.01 * before.norm().item(), rel=1e-5)


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=64, n_layers=2, hidden_size=32, n_heads=2, seq_len=16))


def test_build_optimizer_picks_lamb_with_the_weight_decay_groups():
    model = tiny_gpt()
    opt = build_optimizer(model, OptimConfig(name="lamb", lr=3e-3, beta1=0.8, beta2=0.9, eps=1e-7,
                                             weight_decay=0.05))
    assert type(opt) is Lamb
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["eps"] == 1e-7
    assert opt.param_groups[0]["lr"] == 3e-3
    assert type(build_optimizer(model, OptimConfig())) is torch.optim.AdamW
    sync = GradSync(model, ParallelDims())
    assert type(build_optimizer(sync, OptimConfig(name="lamb"))) is Lamb


def test_lamb_refuses_zero_sharded_optimizers():
    sync = GradSync(tiny_gpt(), ParallelDims())
    sync.zero = 1  # what BucketedDataParallel / FSDP2 say of themselves
    with pytest.raises(ConfigError, match="optim.name=lamb needs whole parameters; parallel.zero=1"):
        build_optimizer(sync, OptimConfig(name="lamb"))
    assert type(build_optimizer(sync, OptimConfig())) is torch.optim.AdamW
    for zero in (1, 2, 3):
        with pytest.raises(ConfigError, match="use parallel.zero=0 or optim.name=adamw"):
            Config(optim=OptimConfig(name="lamb"), parallel=ParallelConfig(zero=zero)).validate()
    Config(optim=OptimConfig(name="lamb")).validate()


def test_unknown_optimizer_name_is_a_config_error():
    with pytest.raises(ConfigError, match="optim.name='sgd' is not one of adamw, lamb"):
        OptimConfig(name="sgd").validate()


def test_tiny_gpt_trains_with_lamb():
    model = tiny_gpt()
    opt = build_optimizer(model, OptimConfig(name="lamb", lr=5e-2, weight_decay=0.01))
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (4, 16), generator=gen)
    targets = torch.roll(idx, -1, dims=1)
    losses = []
    for _ in range(20):
        loss = model(idx, targets=targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.75 * losses[0], losses
