"""The training loop: micro-batches accumulated to the global batch, clipped AdamW steps, evaluation,
checkpoints, metrics, and a clean stop on SIGTERM/SIGINT.

Launched by torchrun, every process runs this loop on its part of the layout (`meshlm.parallel`): the
model is built on the meta device, cut for this rank, and only that part is allocated and initialised
(`parallel.build_model`). Only rank 0 logs, writes metrics and publishes checkpoints. With pipeline
parallelism (`parallel.pp` > 1) the step runs the pipeline schedule instead of the accumulation loop.
Under data parallelism each dp rank runs global / (micro · dp) micro-batches of its slice of the global
batch; the `Parallelized.grad_sync` reduces the gradients (overlapped with backward), completes the tp/pp
ones, clips, and under ZeRO steps the optimizer shards.

Resuming and saving are `train/state.py`'s (`CheckpointState`, this class's base), the run's output
`train/log.py`'s. Adapters (`meshlm tune`) and evaluation tasks (`train.eval_tasks`) come in as
`Extension`s (`train/extension.py`): `meshlm.commands.train.build_trainer(cfg)` is the trainer with every
extension `cfg` asks for. With `train.time_budget_s` the loop times its first steps and then fixes the step count
(`train/budget.py`): from then on `cfg.train.max_steps` is the planned count.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.checkpoint import sharded
from meshlm.checkpoint.single import latest_checkpoint, load_model_state
from meshlm.core.config import Config, ConfigError
from meshlm.core.errors import TrainingError
from meshlm.core.flops import finetune_flops
from meshlm.core.layout import recomputed_layers
from meshlm.core.memory import mtp_activation_bytes
from meshlm.core.precision import Precision
from meshlm.core.rng import deterministic_algorithms, seed_everything
from meshlm.data.dataset import BatchLoader
from meshlm.data.prefetch import PrefetchLoader
from meshlm.families.registry import get_spec
from meshlm.models.activations import measure_model_activations
from meshlm.models.generate import generate
from meshlm.models.loss import use_fused_loss
from meshlm.models.moe import moe_layers, set_aux_grad_scale, update_router_bias
from meshlm.parallel import TPRNGTracker, build_model, init_distributed
from meshlm.parallel.data import memory_report
from meshlm.parallel.heartbeat import start_heartbeat
from meshlm.train.budget import BudgetTooShort, TimeBudget, check_budget_schedule, duration, with_steps
from meshlm.train.extension import Extension, check_extensions
from meshlm.train.log import RunLog, eval_line, run_summary, train_line
from meshlm.train.metrics import (
    measure_peak_tflops,
    moe_groups,
    moe_metrics,
    mtp_groups,
    mtp_metrics,
    peak_memory_mb,
)
from meshlm.train.optim import build_optimizer, lr_at
from meshlm.train.out_dir import OutDir
from meshlm.train.state import CheckpointState
from meshlm.train.stragglers import straggler_line, straggler_watch
from meshlm.train.threads import restore_threads, thread_governor, thread_state


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA GPU is visible; use train.device=auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class Trainer(CheckpointState):
    def __init__(self, cfg: Config, progress: bool | None = None, datasets: tuple | None = None,
                 extensions: Sequence[Extension] = (), started: float | None = None):
        """`datasets`: (tokenizer, train, valid) given by the caller (`meshlm finetune`) instead of the
        family's `build_datasets`. `extensions`: the run's adapters and evaluation tasks (`train/extension.py`);
        a config asking for either needs its extension. `started`: when the command began (time.monotonic()),
        where train.time_budget_s starts counting; None: now."""
        started = time.monotonic() if started is None else started
        check_budget_schedule(cfg)
        self.budget = TimeBudget(cfg.train.time_budget_s, started) if cfg.train.time_budget_s > 0 else None
        self.extensions = list(extensions)
        self.checkpoints = check_extensions(cfg, self.extensions)  # the extension keeping them, or None: ours
        self.cfg = cfg
        t = cfg.train
        device = pick_device(t.device)
        if t.deterministic:  # read when cuBLAS starts: its deterministic workspace (torch's reproducibility notes)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # torchrun's environment → process groups (none for one process); cuda:LOCAL_RANK on GPUs.
        self.dims = init_distributed(cfg.parallel, device if device.type == "cpu" else None)
        # A stopped or frozen peer is reported by rank and host within parallel.heartbeat_s (parallel/heartbeat.py).
        self.heartbeat = start_heartbeat(self.dims, cfg.parallel.heartbeat_s)
        self.device = self.dims.device
        # None unless a CPU run may adapt; train.deterministic keeps the count (a resumed run: its checkpoint's).
        self.threads = None if t.deterministic else thread_governor(t.adapt_threads, self.device)
        self.progress = (t.progress if progress is None else progress) and self.dims.is_main
        self.out_dir = Path(t.out_dir)
        # What train.out_dir held before this run, so that a run refused at set-up or at its first step leaves
        # nothing behind (`remove_created`).
        self.out = OutDir.create(self.out_dir)
        try:
            self._set_up(datasets)
        except Exception:
            self.remove_created()
            raise

    def _set_up(self, datasets: tuple | None) -> None:
        """The rest of the set-up, in train.out_dir: the log, the resumed checkpoint, data, model, step."""
        cfg, t = self.cfg, self.cfg.train
        self.runlog = RunLog(self.out_dir, self.dims.is_main)
        if self.budget is not None:  # the first line: how long the run will take
            self.log(f"time budget {duration(self.budget.budget_s)} (train.time_budget_s={t.time_budget_s:g}, set-up "
                     "to sample): the first steps are timed, then the step count and schedule fit the budget")
        self.resume_from = self._find_resume()
        # train.precision=auto → what this device runs natively (or what the resumed run ran); the config keeps
        # the resolved name, so checkpoints record it.
        cfg = self.cfg = self._resolve_precision(cfg)
        t = cfg.train
        if t.precision == "fp16" and self.device.type == "cpu":
            self.log("note: fp16 on CPU is emulated and slow; bf16 is the CPU choice")
        if t.precision == "fp16" and self.dims.world_size > 1:
            raise ConfigError("train.precision=fp16 is not supported with several processes yet (the loss "
                              "scaler's overflow check is per rank); use train.precision=bf16")
        seed_everything(t.seed)
        self.spec = get_spec(cfg.model.family)  # the model family: its model, plans, loss, data and formulas
        for extension in self.extensions:  # e.g. `meshlm align`'s preference loss (`Extension.adapt_spec`)
            self.spec = extension.adapt_spec(self.spec)
        if t.sample_tokens and not self.spec.decoder:
            raise ConfigError(f"train.sample_tokens={t.sample_tokens} needs a model that generates text; "
                              f"model.family={cfg.model.family!r} does not: set train.sample_tokens=0")
        self._build_data(datasets)
        self._build_model()
        self._build_step()
        self._restore()
        self._keep_plan()

    def remove_created(self) -> None:
        """After a refusal (a config error found at set-up, a time budget too short): what this run created in
        train.out_dir is removed (train/out_dir.py); a checkpoint already saved is kept."""
        if self.dims.is_main:
            self.out.remove_created()

    def _build_data(self, datasets: tuple | None) -> None:
        cfg = self.cfg
        if cfg.data.document_mask and self.spec.document_inputs is None:  # before any data is prepared
            raise ConfigError(f"data.document_mask=true is not supported by model.family={self.spec.name!r} (its "
                              "rows are not packed documents); set data.document_mask=false")
        self.tokenizer, self.train_set, self.valid_set = datasets or self.spec.build_datasets(cfg,
                                                                                           progress=self.progress)
        if cfg.model.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                              f"{self.tokenizer.vocab_size}; set model.vocab_size={self.tokenizer.vocab_size}")
        self.n_params = self.spec.parameter_count(cfg.model)  # the whole model's
        # Tokens per row: model.seq_len, or a fine-tuning set's shorter rows (`--max-length`), for tokens/s and MFU.
        self.row_tokens = int(getattr(self.train_set, "T", cfg.model.seq_len))
        # Positions per row this step actually ran: a tuning set's batches end after their last target
        # (`tune/data.py` TuneDataset.trim), so its steps run fewer than `row_tokens`; this rank's mean.
        self.step_rows = float(self.row_tokens)
        # A fine-tuning set's share of row tokens with a target (the answers), for the fused head and the FLOPs.
        self.loss_fraction = getattr(self.train_set, "loss_fraction", None)
        # Packed documents, each attended and positioned alone (`documents`): the end-of-document id.
        self.eod_id = int(self.tokenizer.eod_id) if cfg.data.document_mask else None

    def _build_model(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        self.tp_rng = TPRNGTracker(t.seed, self.dims.tp_rank, self.device)
        # Built on the meta device; this rank allocates and initialises only its shards (equal to the slices
        # of the whole model built from the seed), then the extensions' transforms (adapters), the pipeline
        # schedule, recomputation and DP wrap it.
        transforms = [transform for e in self.extensions for transform in e.transforms]
        self.parallel = build_model(cfg, self.dims, rng=self.tp_rng, spec=self.spec, transforms=transforms)
        self.model = self.parallel.model  # this rank's part, plain parameter names
        self.has_moe = bool(moe_layers(self.model))  # MoE layers' per-step hooks run only if there are any
        self.legacy_resume = (self.resume_from is not None and self.dims.world_size == 1 and self.checkpoints is None
                              and not sharded.is_sharded(self.resume_from))
        if self.legacy_resume:  # a one-process checkpoint into one process: the plain state dicts
            self.model.load_state_dict(load_model_state(self.resume_from, self.device))
        self.loss_fn = self.parallel.loss_fn
        # A loss of several parts (BERT: MLM, sentence order, accuracies) records them for the log.
        self.part_names: tuple[str, ...] = getattr(self.loss_fn, "part_names", ())
        self.pipeline = self.parallel.pipeline  # pp > 1: this rank's stages and the schedule
        self.sync = self.parallel.grad_sync  # gradient reduction over dp, tp/pp fix-ups, clipping, ZeRO
        if self.pipeline is not None and t.compile:
            raise ConfigError("train.compile=true with parallel.pp > 1 is not supported yet; set train.compile=false")
        # Forward passes go through `self.forward`; `self.model` keeps the plain parameter names.
        self.forward = torch.compile(self.model) if t.compile else self.model
        # A fine-tuning set's targets are mostly ignored (prompt, padding): the fused head skips those rows
        # (a switch of the model's `head_loss`, models/gpt.py).
        if self.loss_fraction is not None and self.loss_fraction < 1.0 and hasattr(self.model, "loss_on_target_rows"):
            self.model.loss_on_target_rows = True
        # The fused chunked head + loss (models/loss.py) needs the whole output layer (tp = 1, else vocab-split
        # logits + `loss_fn`); under pp > 1 the last stage fuses it in the schedule's loss (parallel/pipeline.py).
        # `auto`: where it is faster than logits + cross-entropy for this shape and device (`fused_head_wins`).
        self.fused_loss = use_fused_loss(cfg, self.device) and self.spec.fused_loss and self.dims.tp == 1 \
            and self.pipeline is None
        if cfg.model.mtp_depth and self.pipeline is None:  # multi-token prediction: the model's own loss (gpt.py)
            self.fused_loss = True

    def _build_step(self) -> None:
        t = self.cfg.train
        self.optimizer = build_optimizer(self.sync, self.cfg.optim)
        self.precision = Precision(t.precision, self.device)
        self.accum = self.parallel.layout.microbatches  # per dp rank (core/layout.py)
        # Every dp rank reads the same sample order and takes its slice of each global batch.
        self.loader = BatchLoader(self.train_set, t.micro_batch_size, t.seed, dp_rank=self.dims.dp_rank,
                                  dp_size=self.dims.dp)
        if self.device.type == "cuda":  # the next micro-batches built ahead in pinned memory (data/prefetch.py)
            self.loader = PrefetchLoader(self.loader, self.device, depth=max(2, self.accum))
        self._memory_logged = False
        self.step = 0
        self.tokens_seen = 0
        self.stop_signal: str | None = None
        # Every train.straggler_every steps the ranks' compute and wait times are compared (train/stragglers.py).
        self.stragglers = straggler_watch(t.straggler_every, t.straggler_ratio, self.dims)

    def _restore(self) -> None:
        """The starting state: the checkpoint-owning extension's (a tune run: the frozen base, then the
        adapter's state or its first values), else the resumed checkpoint's, else `train.init_from`'s weights."""
        if self.checkpoints is not None:
            self.checkpoints.restore(self, self.resume_from)
        elif self.resume_from is not None:
            self._load(self.resume_from)
        elif self.cfg.train.init_from:
            self.init_from(self.cfg.train.init_from)

    def _keep_plan(self) -> None:
        """A resumed budget run keeps the step count its checkpoint planned (not measured again; at most
        train.max_steps)."""
        saved = self.saved_plan
        if self.budget is None or not saved or not saved.get("steps"):
            return
        self.budget.keep(saved, self.cfg.train.max_steps)
        self.cfg = with_steps(self.cfg, self.budget.steps)
        self.log(f"time budget: keeping the resumed run's plan of {self.budget.steps} steps "
                 f"(timed at {saved['step_s']:.2f} s/step)")

    # ---- one step ------------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        """Accumulate `global/micro` micro-batches, clip, step. Returns (mean loss, grad norm)."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg.optim, cfg.train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        self.stragglers.mark()  # the step's phases: compute, wait in collectives, the rest (train/stragglers.py)
        if self.has_moe:  # auxiliary-loss gradients get the LM loss's factor (models/moe.py); get_scale syncs
            set_aux_grad_scale(self.model, self.precision.scaler.get_scale() / self.accum)
        if self.pipeline is not None:  # the schedule runs every micro-batch's forward and backward
            total = self._pipeline_forward_backward()
        else:
            widths = 0
            for i in range(self.accum):
                x, y = self.loader.next()
                widths += x.shape[-1]
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                self.sync.set_last_microbatch(i == self.accum - 1)
                with self.precision.autocast():
                    loss = self.loss(x, y) / self.accum
                self.precision.scaler.scale(loss).backward()
                total += loss.detach()  # the full-vocabulary loss: identical on every tp rank
            self.step_rows = widths / self.accum
        self.stragglers.mark()
        total = self.sync.average_loss(total)  # the global batch's mean (over dp)
        # Wait for the dp reductions launched during backward, then complete the gradients tp ranks hold
        # parts of (SP norms, shared KV heads) and the tied embedding's two pipeline copies.
        self.sync.finish()
        self.precision.scaler.unscale_(self.optimizer)
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = self.sync.clip_grad_norm_(clip)  # each parameter (shard) once, over the whole layout
        loss, norm = self._host_values(total, grad_norm)
        self.stragglers.mark()
        scaler = self.precision.scaler
        # fp16: a finite loss with inf gradients is the GradScaler's to skip (it lowers the scale).
        if math.isfinite(loss) and (math.isfinite(norm) or scaler.is_enabled()):
            scaler.step(self.optimizer)
            self.bad_in_row = 0
        else:
            self._skip_step(loss, norm)
        scaler.update()
        self.sync.after_step()  # ZeRO-1/2: every rank's updated shard into everyone's parameters
        if self.has_moe:
            update_router_bias(self.model, moe_groups(self.dims, self.cfg.parallel.sp))  # sigmoid MoE routers
        if not self._memory_logged:  # measured now: Adam's states exist, gradients not yet released
            self.log(memory_report(self.sync, self.optimizer))
            self._memory_logged = True
        self.sync.zero_grad(self.optimizer)
        self.stragglers.mark()
        self.stragglers.end_step()
        self.step += 1
        self.tokens_seen += round(cfg.train.global_batch_size * self.step_rows)
        return loss, norm

    def _host_values(self, total: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float]:
        """The step's one host sync: the loss and the gradient norm together (and, with several processes,
        the stop flag, all-reduced on the device). Both are the same on every rank (the loss is averaged over
        dp, identical over tp, broadcast from the last pipeline stage; the norm is all-reduced over the whole
        layout, and NaN/inf survive those sums), so every rank takes the same skip decision."""
        values = [total.detach().float().reshape(()), grad_norm.detach().float().reshape(()).to(total.device)]
        if self.dims.world_size > 1:
            flag = torch.tensor(float(self.stop_signum), device=total.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            values.append(flag)
        host = torch.stack(values).tolist()
        if len(host) == 3 and host[2] and self._stop_seen == 0:
            self._stop_seen = int(host[2])
        return host[0], host[1]

    def thread_state(self) -> dict:
        """The thread count (and the governor's changes) a checkpoint records (`train/threads.py`)."""
        return thread_state(self.threads)

    def restore_threads(self, saved: dict | None) -> None:
        """A resumed run continues with its checkpoint's thread count (governed, or pinned by train.deterministic)."""
        if line := restore_threads(self.threads, saved, pinned=self.cfg.train.deterministic):
            self.log(line)

    def _skip_step(self, loss: float, norm: float) -> None:
        """No update: gradients dropped, weights and Adam's state unchanged. The iteration still counts
        (Megatron-style): the step number, the learning-rate schedule and the data position move on."""
        self.skipped_steps += 1
        self.bad_in_row += 1
        limit = self.cfg.train.max_bad_steps
        self.log(f"warning: step {self.step + 1}: loss {loss}, gradient norm {norm} not finite; update skipped "
                 f"({self.bad_in_row} in a row, {self.skipped_steps} in all; train.max_bad_steps={limit} in a row "
                 "stop the run)")
        if self.bad_in_row >= limit:
            raise TrainingError(
                f"stopped at step {self.step + 1}: {limit} steps in a row had a non-finite loss or gradient norm "
                f"(train.max_bad_steps={limit}); nothing was saved after them, the newest checkpoint is kept. "
                "Lower optim.lr, raise optim.warmup_steps, or use train.precision=fp32")

    skipped_steps = 0  # steps whose update was skipped (non-finite loss or gradient norm), over the whole run
    bad_in_row = 0
    stop_signum = 0  # the signal that asked this process to stop (0: none)
    _stop_seen = 0  # the largest signal number any rank saw, as of the last step (several processes)
    eod_id: int | None = None  # data.document_mask: the end-of-document id of the packed rows (None: off)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean token loss of one micro-batch through this rank's model (not the pipeline's)."""
        kw = self.documents(x)
        return self.forward(x, targets=y, **kw) if self.fused_loss else self.loss_fn(self.forward(x, **kw), y)

    def documents(self, x: torch.Tensor) -> dict:
        """The model's packed-document keyword arguments for ids `x` (positions and segments per token, from
        the end-of-document tokens, `data/documents.py`); {} without data.document_mask."""
        return {} if self.eod_id is None else self.spec.document_inputs(x, self.eod_id)

    def _pipeline_forward_backward(self) -> torch.Tensor:
        """The loop's micro-batches, in the loop's order, stacked for the schedule (it splits them again);
        returns the loss (the mean over micro-batches), broadcast from the last stage."""
        batches = [self.loader.next() for _ in range(self.pipeline.n_microbatches)]
        x = torch.cat([b[0] for b in batches]).to(self.device, non_blocking=True)
        y = torch.cat([b[1] for b in batches]).to(self.device, non_blocking=True)
        with self.precision.autocast():
            return self.pipeline.train_step(x, y, **self.documents(x))

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss over the first `eval_iters` micro-batches (fixed order), perplexity, bits/byte."""
        if len(self.valid_set) == 0:
            return {}
        self.model.eval()
        pending = self._take_parts()  # the training window's loss parts wait for the next log line
        t = self.cfg.train
        n = min(t.eval_iters, max(1, len(self.valid_set) // t.micro_batch_size))
        loader = BatchLoader(self.valid_set, min(t.micro_batch_size, len(self.valid_set)), 0, shuffle=False)
        losses = []
        for _ in range(n):
            x, y = loader.next()
            x, y = x.to(self.device), y.to(self.device)
            with self.precision.autocast():
                if self.pipeline is not None:  # forward through the stages; the loss comes from the last
                    losses.append(float(self.pipeline.eval_loss(x, y, **self.documents(x))))
                else:
                    losses.append(float(self.loss(x, y)))
        self.model.train()
        parts = self._parts_means()
        if pending is not None:
            self.loss_fn.put(pending)
        loss = sum(losses) / len(losses)
        if self.spec.eval_metrics is not None:
            return {"val_loss": loss, **self.spec.eval_metrics(parts, loss)}
        out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50))}
        if hasattr(self.valid_set, "bytes_per_token"):  # text of the corpus (a tune set scores its outputs only)
            out["val_bpb"] = loss / math.log(2) / self.valid_set.bytes_per_token
        return out

    def _take_parts(self):
        return self.loss_fn.take() if self.part_names else None

    def _parts_means(self) -> dict:
        """The loss parts' means since the last call, over this step window's micro-batches and the whole
        layout: recorded where the loss is computed (the last pipeline stage; equal on tp ranks), summed
        over pp and dp. One small collective, at log and evaluation steps only; every rank calls it."""
        if not self.part_names:
            return {}
        total, n = self.loss_fn.take()
        vec = torch.zeros(len(self.part_names) + 1, dtype=torch.float32, device=self.device)
        if total is not None:
            vec[:-1] = total
            vec[-1] = n
        d = self.dims
        if d.pp > 1:
            dist.all_reduce(vec, group=d.pp_group)
        if d.dp > 1:
            dist.all_reduce(vec, group=d.dp_group)
        values = (vec[:-1] / vec[-1].clamp_min(1)).tolist()
        return dict(zip(self.part_names, values))

    # ---- loop ----------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signal.Signals(signum).name
        self.stop_signum = max(self.stop_signum, int(signum))

    @property
    def exit_code(self) -> int:
        """0 for a finished run; 128 + the signal's number (SIGINT 130, SIGTERM 143) for a stopped one."""
        return 128 + self.stop_signum if self.stop_signal is not None and self.stop_signum else 0

    def log(self, text: str) -> None:
        """A line of the run's log (rank 0 only; through the progress bar while it shows)."""
        self.runlog.log(text)

    def run(self) -> dict:
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            with deterministic_algorithms(self.cfg.train.deterministic):
                return self._run()
        except BudgetTooShort:  # refused (train/budget.py): nothing left behind but a checkpoint already saved
            self.close_saves()
            self.remove_created()
            raise
        finally:
            self.close_saves()  # a background write in flight ends before the process does
            for s, h in handlers.items():
                signal.signal(s, h)
            if self.heartbeat is not None:
                self.heartbeat.stop()

    def _peak_tflops(self) -> float:
        if self.cfg.train.peak_tflops > 0:
            return self.cfg.train.peak_tflops
        dtype = torch.float32 if self.precision.name == "fp32" else self.precision.dtype
        peak = measure_peak_tflops(self.device, dtype)
        self.log(f"measured peak: {peak:.2f} TFLOP/s ({self.device.type}, {self.precision.name} matmul); "
                 "set train.peak_tflops to use a datasheet value")
        return peak

    def _step_flops(self, rows: float | None = None) -> tuple[float, float]:
        """(model FLOPs, hardware FLOPs with recomputation) of one step of rows of `rows` positions (default
        the set's row length), for TFLOP/s, MFU and HFU."""
        cfg, t, m = self.cfg, self.cfg.train, self.cfg.model
        rows = self.row_tokens if rows is None else rows
        flops = self.spec.flops(m, t.global_batch_size, rows)
        if self.loss_fraction is not None and self.spec.decoder:  # fine-tuning rows: the loss on the answers only
            # the answers' tokens per row do not shrink with the row: their share of a trimmed row grows
            share = min(1.0, self.loss_fraction * self.row_tokens / rows)
            flops = finetune_flops(m, t.global_batch_size, rows, share, frozen=cfg.tune.method != "none")
        hw_flops = flops + self.spec.recompute_flops(m, t.global_batch_size, t.recompute, rows,
                                                     layers=recomputed_layers(cfg))
        return flops, hw_flops

    def _log_activations(self) -> None:
        """Bytes saved for backward, measured on one micro-batch (random streams untouched); not under ZeRO-3,
        whose sharded (DTensor) parameters the counter cannot tell apart from activations."""
        cfg, t, m = self.cfg, self.cfg.train, self.cfg.model
        if self.dims.pp != 1 or self.sync.zero >= 3:
            return
        # At the rows the run trains on: a fine-tuning set's `--max-length` rows, not a released model's whole
        # context (SmolLM2's 8,192 positions would cost a forward of 9 GiB of activations here).
        rows = m.seq_len if self.spec.example_batch is not None else min(self.row_tokens, m.seq_len)
        modules = getattr(self.model, "mtp", None)  # multi-token prediction: its modules as rows after the layers
        mtp = list(modules or ())
        # the measurement's routing statistics (metrics, the sigmoid router's bias) and MTP losses are not the run's
        moe = [(layer, layer.stats, layer.step_counts) for _, layer in moe_layers(self.model)]
        recorded = modules.recorded if modules is not None else 0
        acts = measure_model_activations(self.model, self.loss_fn, t.micro_batch_size, rows, m.vocab_size,
                                         self.precision.autocast(), self.tp_rng, self.fused_loss,
                                         layers=[*getattr(self.model, self.spec.pipeline.layers), *mtp],
                                         example=self.spec.example_batch)
        self._take_parts()  # the measurement's loss parts are not the run's
        for layer, stats, counts in moe:
            layer.stats, layer.step_counts = stats, counts
        if modules is not None:
            modules.drop(recorded, modules.recorded - recorded)
        formula = self.spec.activation_bytes
        at_rows = replace(cfg, model=replace(m, seq_len=rows)) if rows != m.seq_len else cfg
        predicted = formula(at_rows, device_type=self.device.type) if formula else None
        if predicted is not None and mtp:
            predicted = [*predicted, *mtp_activation_bytes(at_rows, device_type=self.device.type)]
        self.log(acts.summary(predicted))

    def _run(self) -> dict:
        t = self.cfg.train
        for line in run_summary(self):
            self.log(line)
        peak = self._peak_tflops() * self.dims.world_size  # MFU against the peak of every device in the job
        self._log_activations()
        self.runlog.open(self.step, t.max_steps, self.progress)
        try:
            last_eval = self._loop(peak)
            path = self.save()
            if self.stop_signal is not None:
                self.log(f"stopped by {self.stop_signal} at step {self.step}; checkpoint saved to {path}")
            else:
                self.log(f"saved checkpoint {path}")
        finally:
            self.runlog.close()
        if t.sample_tokens and self.stop_signal is None:
            self.print_sample()
        if self.budget is not None:
            self.log(self.budget.summary(self.step))
        return {"step": self.step, **last_eval}

    def _loop(self, peak: float) -> dict:
        """Steps until train.max_steps or a stop signal, with the log, evaluation and save steps; returns the
        last evaluation's metrics."""
        t = self.cfg.train
        last_eval: dict = {}
        window_start, window_steps, window_rows = time.perf_counter(), 0, 0.0
        if self.budget is not None:
            self.budget.start(self.step)
        while self.step < t.max_steps and not self._stop_requested():
            began = time.perf_counter()
            loss, grad_norm = self.train_step()
            if self.budget is not None:
                self._follow_budget(time.perf_counter() - began)
                t = self.cfg.train  # max_steps: the planned count once planned
            self.poll_save()  # train.async_save: publish a finished background write, or stop on its error
            if self.threads is not None and (line := self.threads.after_step(self.step)):
                self.log(line)
            if (rec := self.stragglers.report(self.step)) is not None:  # a collective: every rank calls it
                self.runlog.write({**rec, "tokens": self.tokens_seen})
                self.log(straggler_line(rec))
            window_steps, window_rows = window_steps + 1, window_rows + self.step_rows
            self.runlog.bar.update(1)
            self.runlog.bar.set_postfix(loss=f"{loss:.3f}")
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                # No torch.cuda.synchronize(): every step already waits for its loss (`_host_values`).
                dt = (time.perf_counter() - window_start) / window_steps
                rows = window_rows / window_steps
                self._log_step(loss, grad_norm, dt, rows, *self._step_flops(rows), peak)
                window_start, window_steps, window_rows = time.perf_counter(), 0, 0.0
            if (t.eval_every and self.step % t.eval_every == 0) or self.step == t.max_steps:
                last_eval = self._eval_and_log()
                window_start, window_steps, window_rows = time.perf_counter(), 0, 0.0
            if t.save_every and self.step % t.save_every == 0 and self.step < t.max_steps:
                self.save(background=True)  # train.async_save: written while the next steps run
        return last_eval

    def _follow_budget(self, seconds: float) -> None:
        """Time the step just taken; at the planning steps set train.max_steps (every rank alike) and say so;
        fix it when the schedule starts to depend on it (`train/budget.py`)."""
        self.budget.observe(self.step, seconds)
        self.budget.check_first_step(self.cfg, self.step, seconds, self.n_params, self.accum, self.device,
                                     self.dims.world_size)
        lines = []
        if self.budget.due(self.step, self.cfg):
            lines.append(self.budget.plan(self.cfg, self.step, self.n_params, self.accum, self.device,
                                          self.dims.world_size))
            self.cfg = with_steps(self.cfg, self.budget.steps)
            self.runlog.set_total(self.budget.steps)
        lines.append(self.budget.settle(self.cfg, self.step))
        for line in lines:
            if line:
                self.log(line)

    def _log_step(self, loss: float, grad_norm: float, dt: float, rows: float, flops: float, hw_flops: float,
                  peak: float) -> None:
        """The training record of this step (`dt`: seconds per step over the window since the last one, of rows
        of `rows` positions on average)."""
        t = self.cfg.train
        parts = self._parts_means()  # every rank: a collective over pp and dp
        rec = {"kind": "train", "step": self.step, "loss": loss, **parts,
               "lr": lr_at(self.step - 1, self.cfg.optim, t.max_steps), "grad_norm": grad_norm,
               "tokens": self.tokens_seen, "skipped_steps": self.skipped_steps,
               "tokens_per_s": t.global_batch_size * rows / dt,
               "tflops": flops / dt / 1e12, "mfu": flops / dt / 1e12 / peak,
               "hfu": hw_flops / dt / 1e12 / peak, "peak_mem_mb": peak_memory_mb(self.device),
               "step_time_s": dt, "threads": torch.get_num_threads()}
        rec.update(moe_metrics(self.model, moe_groups(self.dims, self.cfg.parallel.sp)))  # every rank: collective
        rec.update(mtp_metrics(self.model, self.cfg.model.mtp_depth, mtp_groups(self.dims)))  # every rank, too
        self.runlog.write(rec)
        self.log(train_line(rec, parts))

    def _eval_and_log(self) -> dict:
        result = self.evaluate()
        for extension in self.extensions:  # train.eval_tasks: val_<task>_<metric> (meshlm/eval/during_training.py)
            result.update(extension.evaluate(self))
        if result:
            self.runlog.write({"kind": "eval", "step": self.step, "tokens": self.tokens_seen, **result})
            self.log(eval_line(self.step, result))
        return result

    def _stop_requested(self) -> bool:
        """A signal seen by any rank stops every rank after the same step: the ranks' signal numbers are
        all-reduced with each step's loss (`_host_values`), so this costs no extra sync."""
        if self.dims.world_size > 1 and self._stop_seen:
            if self.stop_signal is None:
                self.stop_signal = "a signal on another rank"
            self.stop_signum = self._stop_seen
            return True
        return self.dims.world_size == 1 and self.stop_signal is not None

    def print_sample(self) -> None:
        t = self.cfg.train
        model = self.model
        if self.dims.world_size > 1:  # the model lives on several ranks: rank 0 reads the checkpoint just saved
            if not self.dims.is_main:
                return
            model = self.spec.model_class(self.cfg.model).to(self.device)
            model.load_state_dict(load_model_state(latest_checkpoint(self.out_dir), self.device, spec=self.spec))
        ids = torch.tensor([self.tokenizer.encode(t.sample_prompt)], device=self.device)
        out = generate(model, ids, t.sample_tokens, temperature=0.8, top_p=0.9, seed=t.seed)  # nucleus sampling
        text = self.tokenizer.decode(out[0].tolist())
        print("\n---------------- sample ----------------\n" + text + "\n----------------------------------------")
