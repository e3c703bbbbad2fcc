"""The fused chunked head + cross-entropy against logits + F.cross_entropy: loss and every gradient."""

import pytest
import torch
import torch.nn.functional as F

from meshlm.core.config import ModelConfig
from meshlm.models.gpt import GPT
from meshlm.models.loss import IGNORE_INDEX, chunk_rows, linear_cross_entropy

V, H, N = 97, 16, 40


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, targets


def _grads(loss_fn, hidden, weight, targets):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, targets)
    (loss * 3.0).backward()  # a non-unit incoming gradient: backward must scale by it
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def _reference(hidden, weight, targets):
    return F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunk", [1, 7, 16, N, 1000])
def test_fused_loss_and_gradients_match_unfused_in_fp32(chunk):
    hidden, weight, targets = _inputs()
    ref = _grads(_reference, hidden, weight, targets)
    got = _grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk), hidden, weight, targets)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ignored_targets_add_nothing_and_leave_the_mean():
    hidden, weight, targets = _inputs(1)
    targets[::3] = IGNORE_INDEX
    ref = _grads(_reference, hidden, weight, targets)
    got = _grads(lambda h, w, t: linear_cross_entropy(h, w, t, 8), hidden, weight, targets)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got[1][::3].abs().max() == 0  # an ignored token's hidden state gets no gradient


def test_a_frozen_output_layer_gets_no_gradient_and_the_hidden_states_theirs():
    """Prompt tuning and LoRA freeze the head: no ∂W is computed, ∂h is unchanged (also with a row that
    has no target at all, and one whose every target is ignored)."""
    hidden, weight, targets = _inputs(4)
    targets[:30] = IGNORE_INDEX  # a fine-tuning batch: the loss on a few answer tokens only
    ref = _grads(_reference, hidden, weight, targets)
    weight.requires_grad_(False)
    hidden.grad = weight.grad = None
    loss = linear_cross_entropy(hidden, weight, targets, 4, target_rows=True)
    (loss * 3.0).backward()
    assert weight.grad is None
    torch.testing.assert_close(loss.detach(), ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref[1], rtol=1e-5, atol=1e-6)
    assert hidden.grad[:30].abs().max() == 0


def test_without_gradients_it_returns_the_same_loss():
    hidden, weight, targets = _inputs(2)
    with torch.no_grad():
        fused = linear_cross_entropy(hidden, weight, targets, 5)
        ref = _reference(hidden, weight, targets)
    torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-6)


def test_bf16_autocast_matches_the_unfused_bf16_path():
    hidden, weight, targets = _inputs(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(lambda h, w, t: F.cross_entropy((h @ w.t()).float(), t), hidden, weight, targets)
        got = _grads(lambda h, w, t: linear_cross_entropy(h, w, t, 8), hidden, weight, targets)
    assert got[1].dtype == hidden.dtype and got[2].dtype == weight.dtype
    for a, b in zip(got, ref, strict=True):  # bf16 matmuls: ~3 significant digits
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_gpt_forward_with_targets_equals_loss_on_logits_including_the_tied_embedding_grad():
    cfg = ModelConfig(vocab_size=V, n_layers=2, hidden_size=H, n_heads=2, seq_len=12, tie_embeddings=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, V, (3, 13))
    x, y = idx[:, :-1], idx[:, 1:]
    ref_loss = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = model(x, targets=y)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_chunk_rows_bounds_the_logits_chunk():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert chunk_rows(50257, 128, cpu) == 512  # CPU: at least 512 rows (the weight's reads amortised)
    assert chunk_rows(50257, 1024, cpu) == 2048  # ≥ 2h: 412 MB of logits ≤ 512 MiB
    assert chunk_rows(50257, 4096, cpu) == 2048  # 8192 rows would be 1.6 GB of logits: capped
    assert chunk_rows(10**9, 128, cpu) == 1
    assert chunk_rows(50257, 128, cuda) == 1024
    assert chunk_rows(50257, 384, cpu, torch.bfloat16) == 1024  # at least 2h rows: the power of two ≥ 768
    assert chunk_rows(50257, 384, cuda, torch.bfloat16) == 1024


def test_trainer_with_and_without_the_fused_loss_trains_alike(tmp_path):
    """The whole Trainer (accumulation over 2 micro-batches, clipping, AdamW, evaluation), 4 steps, fp32."""
    from meshlm.train.trainer import Trainer
    from tests.conftest import tiny_config

    def run(fused: bool) -> tuple[list[float], list[float], float]:
        cfg = tiny_config(tmp_path / str(fused), train={"fused_loss": fused})
        trainer = Trainer(cfg, progress=False)
        assert trainer.fused_loss is fused
        losses, norms = zip(*(trainer.train_step() for _ in range(4)), strict=True)
        return list(losses), list(norms), trainer.evaluate()["val_loss"]

    fused, plain = run(True), run(False)
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
