"""Language-model losses: plain cross-entropy on logits, and the fused chunked head + cross-entropy.

With a 50k vocabulary the output layer dominates a small model's step: for B·T tokens the logits are a
(B·T, V) fp32 tensor (412 MB at 16×128 tokens), written by the head's matmul, read and written again by
log-softmax, its backward and the zero-filled gradient of the gather. `linear_cross_entropy` never builds
it. It walks the tokens in chunks of `chunk_rows` (on a CPU at least 512 and 2h tokens, long enough to
amortise reading the whole weight per chunk), and for each chunk:

    z = h_c Wᵀ,  p = softmax(z),  loss += Σ (logsumexp(z) − z[target])
    dz = (p − onehot(target)) / n,  ∂h_c = dz W,  ∂W += dzᵀ h_c

so the gradients are finished in the forward pass (the trick of Liger-Kernel's fused linear cross-entropy)
and backward only scales them by the incoming gradient. Same FLOPs as the unfused head (three matmuls),
peak memory one chunk of logits instead of two full copies; on a 2-core CPU the head and loss take
0.78–0.97× the unfused time at h = 128…1024 (`fused_head_wins`; benchmarks/RESULTS.md). The last pipeline stage uses it
too. Tensor parallelism keeps the unfused path: its vocab-parallel cross-entropy (parallel/tensor.py) needs
the logits split over ranks.

Targets equal to `IGNORE_INDEX` (-100, as in `F.cross_entropy`) add nothing to the loss or the gradients
and are left out of the mean. With `target_rows=True` their rows are dropped before the head, so a
fine-tuning batch (mostly prompt and padding, with the loss on the answer only) pays the output layer for
its answer tokens alone, at the price of one host read per call to count them (the trainer asks for it on
fine-tuning sets only: a pretraining step keeps its single host sync). A frozen output layer (prompt
tuning, LoRA) gets no ∂W matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def accumulation_dtype(x: torch.Tensor | torch.dtype) -> torch.dtype:
    """fp32 for 16-bit and fp32 inputs, float64 for float64: softmax and sums run in at least fp32 and never
    round a double down (the equivalence tests run in float64)."""
    return torch.promote_types(x if isinstance(x, torch.dtype) else x.dtype, torch.float32)
CHUNK_BYTES = {"cpu": 512 << 20, "cuda": 256 << 20}  # fp32 logits per chunk, at most: big GEMMs on GPU
CPU_MIN_ROWS = 512  # tokens per chunk on a CPU, at least (`chunk_rows`)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy from (B, T, V) logits and (B, T) targets, computed in fp32."""
    return F.cross_entropy(logits.to(accumulation_dtype(logits)).view(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


@dataclass(frozen=True)
class TokenOps:
    """Per-token operations on output-layer logits, as the layout computes them: `ce(logits, targets)` the
    mean cross-entropy and `correct(logits, targets)` the (B, T) greedy hits. Whole logits at tp = 1;
    vocab-split ones under tensor parallelism (`parallel/tensor.py` passes the vocab-parallel pair). A
    family whose loss has several parts builds it from these (`ModelSpec.loss_for`)."""

    ce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = None  # type: ignore[assignment]
    correct: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.ce is None:
            object.__setattr__(self, "ce", cross_entropy)
        if self.correct is None:
            object.__setattr__(self, "correct", greedy_correct)


def greedy_correct(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the argmax of whole logits (B, T, V) is the target."""
    return logits.detach().argmax(-1) == targets


class PartsLoss:
    """A loss made of named parts (BERT: MLM loss, SOP loss, accuracies) that records them, detached and
    on the device (no host sync), for the trainer to log: `record` adds one micro-batch's parts, `take`
    returns (their sum, count) and starts over, `put` adds a taken (sum, count) back."""

    part_names: tuple[str, ...] = ()

    def __init__(self):
        self._records: list[tuple[torch.Tensor, int]] = []

    def record(self, *parts: torch.Tensor) -> None:
        self._records.append((torch.stack([p.detach().to(torch.float32).reshape(()) for p in parts]), 1))

    def take(self) -> tuple[torch.Tensor | None, int]:
        records, self._records = self._records, []
        if not records:
            return None, 0
        return torch.stack([r for r, _ in records]).sum(0), sum(n for _, n in records)

    def put(self, taken: tuple[torch.Tensor | None, int]) -> None:
        total, n = taken
        if total is not None:
            self._records.append((total, n))

    @property
    def recorded(self) -> int:
        """Records held (calls since the last `take`, plus what was `put` back)."""
        return len(self._records)

    def drop(self, start: int, count: int) -> None:
        """Forget `count` records from position `start` (calls that were not real micro-batches)."""
        del self._records[start:start + count]


def chunk_rows(vocab_size: int, hidden_size: int, device: torch.device, dtype: torch.dtype = torch.float32) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits fit `CHUNK_BYTES` on CUDA; on a CPU the
    power of two ≥ 2h and at least `CPU_MIN_ROWS`, as long as its logits fit `CHUNK_BYTES` (at least one row).

    Every chunk's three matmuls read the whole (V, h) weight (77 MB at h = 384 for GPT-2's vocabulary), so
    on a CPU a chunk must be long enough to amortise that read; keeping a chunk's logits in cache matters
    less (measurements in `fused_head_wins`: 64-row chunks, the former default, lost to the unfused head at
    h = 128 and 384; 512 and 1024 rows won). In bf16/fp16 each matmul also converts the weight first
    (h = 384: 64-row chunks ran 1.4× slower than the unfused head, 1024-row chunks 1.04× faster).
    """
    rows = max(1, CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"]) // (4 * vocab_size))
    fits = 1 << (rows.bit_length() - 1)
    if device.type == "cpu":
        return min(fits, max(CPU_MIN_ROWS, 1 << (2 * hidden_size - 1).bit_length()))
    return fits


def fused_head_wins(vocab_size: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> bool:
    """`train.fused_loss=auto`: whether the fused chunked head + loss is faster than logits + cross-entropy
    for this shape and device. On CUDA it is (no (tokens, V) logits written and read back). On a CPU both run
    the same three matmuls, and the fused head wins when its chunks are long enough to amortise reading the
    whole weight per chunk: at least 2h rows (`chunk_rows`). Measured on a 2-core Xeon (AVX-512), head +
    loss forward and backward, fused time / unfused time, fp32, GPT-2's vocabulary:

        h = 128, 1024 tokens:   64 rows 1.06,  256 rows 0.89,  512 rows 0.78
        h = 384, 2048 tokens:   64 rows 1.28,  256 rows 1.10, 1024 rows 0.83, 2048 rows 0.86
        h = 768, 1024 tokens: 2048 rows (one chunk) 0.97
        h = 1024, 1024 tokens: 2048 rows (one chunk) 0.85

    so on a CPU it is off only where `CHUNK_BYTES` caps the chunk below 2h rows (a huge vocabulary)."""
    if device.type != "cpu":
        return True
    return chunk_rows(vocab_size, hidden_size, device, dtype) >= 2 * hidden_size


def use_fused_loss(cfg, device: torch.device) -> bool:
    """`train.fused_loss` resolved for `cfg`'s model on `device` (true / false as set; auto by
    `fused_head_wins` at the run's precision)."""
    setting = cfg.train.fused_loss
    if setting != "auto":
        return bool(setting)
    from meshlm.core.precision import DTYPES, resolve_precision

    precision, _ = resolve_precision(cfg.train.precision, device, cfg.model.hidden_size)
    return fused_head_wins(cfg.model.vocab_size, cfg.model.hidden_size, device, DTYPES[precision])


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None, target_rows: bool = False) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` without materialising the logits.

    hidden (..., h), weight (V, h), targets (...) → scalar fp32 loss. Under autocast the matmuls run in the
    autocast dtype and softmax in fp32, as the unfused path does. Without gradients (evaluation) it only
    sums the chunk losses.
    """
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if target_rows:  # only the rows with a target go through the head (index_select's backward scatters
        rows = (t1 != IGNORE_INDEX).nonzero().squeeze(1)  # their gradients back, zeros elsewhere)
        h2, t1 = h2.index_select(0, rows), t1.index_select(0, rows)
    chunk = chunk or chunk_rows(weight.shape[0], weight.shape[1], hidden.device, _compute_dtype(hidden))
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h2, weight, t1, chunk, None)[0]
    dtype = _compute_dtype(hidden)
    acc = accumulation_dtype(dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        w, total = weight.to(dtype), torch.zeros((), dtype=acc, device=hidden.device)
        for s in range(0, h2.shape[0], chunk):
            z = torch.log_softmax((h2[s:s + chunk].to(dtype) @ w.t()).to(acc), dim=-1)
            total -= _picked(z, t1[s:s + chunk]).sum()
        return total / (t1 != IGNORE_INDEX).sum()


def linear_cross_entropy_sum(hiddens: list[torch.Tensor], weight: torch.Tensor, targets: list[torch.Tensor],
                             scales: list[float], target_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_k scales[k]·CE_k, CE_k the mean cross-entropy of `hiddens[k] @ weight.T` against `targets[k]`, in one fused
    call: one weight gradient (V, h) is finished and kept for backward, not one per term (multi-token prediction's
    main loss and module losses share the head: `models/gpt.py`). Returns (the weighted sum, differentiable; the CE_k
    (K,), detached, in the accumulation dtype). Each row's gradient carries its term's scale / n_k; `target_rows` as
    in `linear_cross_entropy`."""
    h2 = torch.cat([h.reshape(-1, h.shape[-1]) for h in hiddens])
    t1 = torch.cat([t.reshape(-1) for t in targets])
    counts = torch.stack([(t != IGNORE_INDEX).sum() for t in targets])  # n_k, on the device (no host sync)
    term = torch.cat([torch.full((t.numel(),), k, device=t1.device) for k, t in enumerate(targets)])  # each row's k
    omega = (torch.tensor(scales, dtype=torch.float64, device=t1.device) / counts.clamp_min(1)).to(
        accumulation_dtype(_compute_dtype(h2)))  # each row's weight: its term's scale / n_k
    if target_rows:
        rows = (t1 != IGNORE_INDEX).nonzero().squeeze(1)
        h2, t1, term = h2.index_select(0, rows), t1.index_select(0, rows), term.index_select(0, rows)
    chunk = chunk_rows(weight.shape[0], weight.shape[1], h2.device, _compute_dtype(h2))
    total, row_ce = _LinearCrossEntropy.apply(h2, weight, t1, chunk, omega[term] * (t1 != IGNORE_INDEX))
    ce = torch.zeros(len(targets), dtype=row_ce.dtype, device=row_ce.device).index_add_(0, term, row_ce)
    return total, ce / counts


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _picked(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logp[i, targets[i]], 0 where the target is ignored."""
    keep = targets != IGNORE_INDEX
    return logp.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1) * keep


class _LinearCrossEntropy(torch.autograd.Function):
    """(loss, per-row losses): the mean over the rows with a target, or with `row_weights` (N,) the weighted sum
    Σ_i ω_i·ce_i and beside it each row's ce_i (N,), not differentiable (else an empty tensor)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                row_weights: torch.Tensor | None):
        dtype = _compute_dtype(hidden)
        acc = accumulation_dtype(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            n = (targets != IGNORE_INDEX).sum() if row_weights is None else torch.ones((), device=hidden.device)
            row_ce = torch.empty(0 if row_weights is None else len(targets), dtype=acc, device=hidden.device)
            loss = torch.zeros((), dtype=acc, device=hidden.device)
            need_h, need_w = hidden.requires_grad, weight.requires_grad
            grad_h = torch.empty(hidden.shape if need_h else (0,), dtype=acc, device=hidden.device)
            grad_w = torch.zeros(weight.shape if need_w else (0,), dtype=acc, device=weight.device)
            rows = torch.arange(min(chunk, hidden.shape[0]), device=hidden.device)
            for s in range(0, hidden.shape[0], chunk):
                t = targets[s:s + chunk]
                keep = (t != IGNORE_INDEX).unsqueeze(1)
                h = hidden[s:s + chunk].to(dtype) * keep  # an ignored token's row adds nothing to ∂W
                z = torch.log_softmax((h @ w.t()).to(acc), dim=-1)  # (c, V): log p
                picked = _picked(z, t)
                z.exp_()  # p
                z[rows[:len(t)], t.clamp_min(0)] -= 1.0  # p − onehot: ∂loss_i/∂z_i
                if row_weights is None:
                    loss -= picked.sum()
                else:  # ∂(Σ ω_i·ce_i)/∂z_i = ω_i·(p − onehot)
                    omega = row_weights[s:s + chunk]
                    row_ce[s:s + chunk] = -picked
                    loss -= (picked * omega).sum()
                    z *= omega.unsqueeze(1)
                dz = z.to(dtype)
                if need_h:
                    grad_h[s:s + chunk] = (dz @ w).to(acc) * keep
                if not need_w:
                    continue
                if dtype == acc:
                    grad_w.addmm_(dz.t(), h)
                else:  # accumulate the chunks' bf16/fp16 products in fp32
                    grad_w += (dz.t() @ h).to(acc)
        ctx.save_for_backward(grad_h, grad_w, n)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.need = (need_h, need_w)
        ctx.mark_non_differentiable(row_ce)
        return loss / n, row_ce

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_rows: torch.Tensor | None = None):
        grad_h, grad_w, n = ctx.saved_tensors
        scale = grad_loss / n
        (need_h, need_w), (dtype_h, dtype_w) = ctx.need, ctx.dtypes
        return ((grad_h * scale).to(dtype_h) if need_h else None, (grad_w * scale).to(dtype_w) if need_w else None,
                None, None, None)
