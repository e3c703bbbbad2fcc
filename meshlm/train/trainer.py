"""The training loop: micro-batches accumulated to the global batch, clipped AdamW steps, evaluation,
checkpoints, metrics, and a clean stop on SIGTERM/SIGINT.

Launched by torchrun, every process runs this loop on its part of the layout (`meshlm.parallel`): the
model is built on the meta device, cut for this rank, and only that part is allocated and initialised
(`parallel.build_model`). Only rank 0 logs, writes metrics and publishes checkpoints. With pipeline
parallelism (`parallel.pp` > 1) the step runs the pipeline schedule instead of the accumulation loop.
Under data parallelism each dp rank runs global / (micro · dp) micro-batches of its slice of the global
batch; the `Parallelized.grad_sync` reduces the gradients (overlapped with backward), completes the tp/pp
ones, clips, and under ZeRO steps the optimizer shards. A multi-process checkpoint is per-rank pieces of
layout-free tensors (`dist_checkpoint.py`): it resumes under any layout, and `ckpt.load_model_state`
reads it whole in one process (`meshlm generate`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from meshlm.config import Config, ConfigError
from meshlm.data.dataset import BatchLoader
from meshlm.data.prefetch import PrefetchLoader
from meshlm.errors import CheckpointError, TrainingError
from meshlm.infer.generate import generate
from meshlm.models.loss import use_fused_loss
from meshlm.models.registry import get_spec
from meshlm.parallel import TPRNGTracker, build_model, init_distributed
from meshlm.parallel.data import memory_report
from meshlm.parallel.heartbeat import start_heartbeat
from meshlm.plan.activations import measure_model_activations
from meshlm.plan.flops import finetune_flops
from meshlm.plan.layout import recomputed_layers
from meshlm.train import checkpoint as ckpt
from meshlm.train import ckpt_files, dist_checkpoint
from meshlm.train.metrics import measure_peak_tflops, peak_memory_mb, truncate_metrics
from meshlm.train.optim import build_optimizer, lr_at
from meshlm.train.precision import Precision, resolve_precision, resume_precision
from meshlm.tune import state as tune_state
from meshlm.tune.adapters import describe_adapter, init_virtual_tokens


def _num_tokens(dataset) -> int:
    n = getattr(dataset, "num_tokens", None)
    return int(n) if n is not None else len(dataset.tokens)


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA GPU is visible; use train.device=auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Config, progress: bool | None = None, datasets: tuple | None = None):
        """`datasets`: (tokenizer, train, valid) given by the caller (`meshlm finetune`) instead of the
        family's `build_datasets`."""
        self.cfg = cfg
        t = cfg.train
        device = pick_device(t.device)
        # torchrun's environment → process groups (none for one process); cuda:LOCAL_RANK on GPUs.
        self.dims = init_distributed(cfg.parallel, device if device.type == "cpu" else None)
        # A stopped or frozen peer is reported by rank and host within parallel.heartbeat_s (parallel/heartbeat.py).
        self.heartbeat = start_heartbeat(self.dims, cfg.parallel.heartbeat_s)
        self.device = self.dims.device
        self.progress = (t.progress if progress is None else progress) and self.dims.is_main
        self.out_dir = Path(t.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
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
        if t.sample_tokens and not self.spec.decoder:
            raise ConfigError(f"train.sample_tokens={t.sample_tokens} needs a model that generates text; "
                              f"model.family={cfg.model.family!r} does not: set train.sample_tokens=0")
        self.tokenizer, self.train_set, self.valid_set = datasets or self.spec.build_datasets(cfg,
                                                                                           progress=self.progress)
        if cfg.model.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                              f"{self.tokenizer.vocab_size}; set model.vocab_size={self.tokenizer.vocab_size}")
        self.n_params = self.spec.parameter_count(cfg.model)  # the whole model's
        # Tokens per row: model.seq_len, or a fine-tuning set's shorter rows (`--max-length`), for tokens/s and MFU.
        self.row_tokens = int(getattr(self.train_set, "T", cfg.model.seq_len))
        # A fine-tuning set's share of row tokens with a target (the answers), for the fused head and the FLOPs.
        self.loss_fraction = getattr(self.train_set, "loss_fraction", None)
        self.tp_rng = TPRNGTracker(t.seed, self.dims.tp_rank, self.device)
        # Built on the meta device; this rank allocates and initialises only its shards (equal to the slices
        # of the whole model built from the seed), then the pipeline schedule, recomputation and DP wrap it.
        self.parallel = build_model(cfg, self.dims, rng=self.tp_rng, spec=self.spec)
        self.model = self.parallel.model  # this rank's part, plain parameter names
        self.tuning = cfg.tune.method != "none"  # an adapter on a frozen base (tune/): its own checkpoints
        self.legacy_resume = (self.resume_from is not None and self.dims.world_size == 1 and not self.tuning
                              and not dist_checkpoint.is_sharded(self.resume_from))
        if self.legacy_resume:  # a one-process checkpoint into one process: the plain state dicts
            self.model.load_state_dict(ckpt.load_model_state(self.resume_from, self.device))
        self.loss_fn = self.parallel.loss_fn
        # A loss of several parts (BERT: MLM, sentence order, accuracies) records them for the log.
        self.part_names: tuple[str, ...] = getattr(self.loss_fn, "part_names", ())
        self.pipeline = self.parallel.pipeline  # pp > 1: this rank's stages and the schedule
        self.sync = self.parallel.grad_sync  # gradient reduction over dp, tp/pp fix-ups, clipping, ZeRO
        if self.pipeline is not None and t.compile:
            raise ConfigError("train.compile=true with parallel.pp > 1 is not supported yet; set train.compile=false")
        # Forward passes go through `self.forward`; `self.model` keeps the plain parameter names.
        self.forward = torch.compile(self.model) if t.compile else self.model
        # A fine-tuning set's targets are mostly ignored (prompt, padding): the fused head skips those rows.
        if self.loss_fraction is not None and self.loss_fraction < 1.0:
            self.model.loss_on_target_rows = True
        # The fused chunked head + loss (models/loss.py) needs the whole output layer (tp = 1, else vocab-split
        # logits + `loss_fn`); under pp > 1 the last stage fuses it in the schedule's loss (parallel/pipeline.py).
        # `auto`: where it is faster than logits + cross-entropy for this shape and device (`fused_head_wins`).
        self.fused_loss = use_fused_loss(cfg, self.device) and self.spec.fused_loss and self.dims.tp == 1 \
            and self.pipeline is None
        self.optimizer = build_optimizer(self.sync, cfg.optim)
        self.precision = Precision(t.precision, self.device)
        self.accum = self.parallel.layout.microbatches  # per dp rank (plan/layout.py)
        # Every dp rank reads the same sample order and takes its slice of each global batch.
        self.loader = BatchLoader(self.train_set, t.micro_batch_size, t.seed, dp_rank=self.dims.dp_rank,
                                  dp_size=self.dims.dp)
        if self.device.type == "cuda":  # the next micro-batches built ahead in pinned memory (data/prefetch.py)
            self.loader = PrefetchLoader(self.loader, self.device, depth=max(2, self.accum))
        self._memory_logged = False
        self.step = 0
        self.tokens_seen = 0
        self.stop_signal: str | None = None
        if self.tuning:  # the frozen base's weights, every time; then the adapter's state, or its first values
            self._init_from(cfg.tune.base)
            if self.resume_from is not None:
                tune_state.load(self, self.resume_from)
                self.log(f"resumed from {self.resume_from} at step {self.step}")
            else:
                init_virtual_tokens(self)
            self.log(describe_adapter(self))
        elif self.resume_from is not None:
            self._load(self.resume_from)
        elif t.init_from:
            self._init_from(t.init_from)

    def _resolve_precision(self, cfg: Config) -> Config:
        """`cfg` with train.precision resolved (train/precision.py): `auto` becomes the device's native 16-bit
        format or fp32, or, when resuming, the precision the checkpoint's run resolved to. Printed."""
        asked = cfg.train.precision
        name, why = resolve_precision(asked, self.device, cfg.model.hidden_size)
        if asked == "auto" and self.resume_from is not None:
            saved = resume_precision(ckpt.load_config_dict(self.resume_from))
            if saved is not None:
                name, why = saved, f"as the resumed run {self.resume_from.name}"
        if name == "fp16" and asked == "auto" and self.dims.world_size > 1:
            name, why = "fp32", f"{why}; fp16 is not supported with several processes yet"
        if asked == "auto":
            self.log(f"precision: auto → {name} ({why}); set train.precision to choose")
        if name == asked:
            return cfg
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=name))

    # ---- checkpoints -------------------------------------------------------------------------------
    def _find_resume(self) -> Path | None:
        """Rank 0 picks the checkpoint (the newest valid one for `auto`, verified by checksum) and tells
        everyone; checkpoints present but none valid stop the run rather than start over."""
        resume = self.cfg.train.resume
        if self.dims.is_main:
            ckpt.prune_temporaries(self.out_dir)
        if resume == "never":
            self.dims.barrier()
            return None
        box = [self._pick_checkpoint(resume) if self.dims.is_main else None]
        if self.dims.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        path, error = box[0]
        if error is not None:
            raise CheckpointError(error)
        return None if path is None else Path(path)

    def _pick_checkpoint(self, resume: str) -> tuple[str | None, str | None]:
        """(checkpoint path, None) or (None, the error every rank raises)."""
        try:
            if resume != "auto":
                return str(ckpt.resolve_checkpoint(resume, log=self.log)), None
            path, note, present = ckpt.find_checkpoint(self.out_dir)
        except CheckpointError as err:
            return None, str(err)
        if path is None and present:
            return None, (f"{ckpt.checkpoints_dir(self.out_dir)} holds checkpoints but none is valid ({note}); "
                          "restore one, or set train.resume=never to start over")
        if note:
            self.log(f"note: {note}; resuming from {path.name}")
        return (None if path is None else str(path)), None

    def state_parts(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "state": {"step": self.step, "tokens_seen": self.tokens_seen, "rng": rng_state(),
                      "loader": self.loader.state_dict(), "scaler": self.precision.state_dict(),
                      "tokenizer": self.tokenizer.name},
        }

    def save(self) -> Path:
        """Publish this step's checkpoint (never one with non-finite weights), then keep the newest
        `train.keep_last` valid ones."""
        if self.tuning:
            path = tune_state.save(self)
        elif self.dims.world_size == 1:
            parts = self.state_parts()
            parts["state"]["skipped_steps"] = self.skipped_steps
            path = ckpt.save_checkpoint(self.out_dir, self.step, parts, self.cfg.to_dict())
        else:
            path = self._save_sharded()
        if self.dims.is_main:
            ckpt_files.prune_old(self.out_dir, self.cfg.train.keep_last, self.step)
        return path

    def _save_sharded(self) -> Path:
        """Every rank writes the pieces of the layout-free tensors it owns (weights and Adam states) and its
        random streams; rank 0 adds the index and the shared state and publishes `latest` once every rank
        reported success (`dist_checkpoint.save`, a collective)."""
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "loader": self.loader.state_dict(),
                 "skipped_steps": self.skipped_steps,
                 "scaler": self.precision.state_dict(), "tokenizer": self.tokenizer.name, "layout": self._layout()}
        rank_state = {"rng": rng_state(), "tp_rng": self.tp_rng.get_state()}
        return dist_checkpoint.save(self.out_dir, self.step, self.sync, self.optimizer, state, self.cfg.to_dict(),
                                    rank_state)

    def _layout(self) -> dict:
        d = self.dims
        return {"world_size": d.world_size, "tp": d.tp, "pp": d.pp, "dp": d.dp, "sp": self.cfg.parallel.sp,
                "zero": self.sync.zero}

    def _load(self, path: Path) -> None:
        """Optimizer, data position and random streams (and, but for a one-process checkpoint resumed in one
        process, the weights) from a checkpoint of any layout."""
        state = ckpt.load_part(path, "state")
        if state.get("tokenizer", self.tokenizer.name) != self.tokenizer.name:
            raise ConfigError(f"checkpoint {path} was trained with tokenizer {state['tokenizer']!r}, not "
                              f"data.tokenizer={self.tokenizer.name!r}; set data.tokenizer to match")
        saved = state.get("layout", {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "sp": False, "zero": 0})
        if self.legacy_resume:
            saved_optim = ckpt.load_part(path, "optim", self.device)
            dist_checkpoint.check_same_optimizer(path, dist_checkpoint.saved_muon(saved_optim), self.optimizer)
            self.optimizer.load_state_dict(saved_optim)
            set_rng_state(state["rng"])
        else:  # any layout into this one: each rank reads the pieces of its tensors
            dist_checkpoint.load(path, self.sync, self.optimizer)
            mine = dist_checkpoint.load_rank_state(path, self.dims.rank, self._layout())
            if mine is not None:  # the same layout: the very random streams, so dropout continues exactly
                set_rng_state(mine["rng"])
                self.tp_rng.set_state(mine["tp_rng"])
            elif saved != self._layout():
                self.log(f"resuming a checkpoint of layout {saved} under {self._layout()}: weights, optimizer "
                         "and data position carry over; dropout masks start new streams")
        self.restore_position(state)
        self.log(f"resumed from {path} at step {self.step}")

    def restore_position(self, state: dict) -> None:
        """Step, tokens seen, data position, loss scale and skipped steps from a checkpoint's shared state."""
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.loader.load_state_dict(state["loader"])
        self.precision.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)

    def _init_from(self, path: str) -> None:
        """A fresh run's weights from checkpoint `path` (any layout), where its tensors match this model's;
        the rest (a new task head) keep their seeded init. The optimizer starts fresh."""
        from meshlm.config import config_from_dict

        source = ckpt.resolve_checkpoint(path, log=self.log)
        source_cfg = config_from_dict(ckpt.load_config_dict(source)).model
        if source_cfg.family != self.cfg.model.family:
            raise ConfigError(f"train.init_from={path!r} holds a model.family={source_cfg.family!r} model, not "
                              f"{self.cfg.model.family!r}; pick a checkpoint of the same family")
        new = dist_checkpoint.load_matching_weights(source, self.sync, source_cfg)
        total = len(dist_checkpoint.logical_shapes(self.cfg.model))
        if len(new) == total:
            raise ConfigError(f"train.init_from={path!r}: none of its tensors fits this model (another shape); set "
                              "the model.* keys as in its config.json")
        self.log(f"initialised from {source}: {total - len(new)} of {total} tensors"
                 + (f"; new: {', '.join(new)}" if new else ""))

    def _truncate_metrics(self, step: int) -> None:
        """Drop metric lines past the resumed step (a killed run may have logged beyond its checkpoint; a
        fresh start, step 0, keeps none) and lines a kill tore (with a note)."""
        path = self.out_dir / "metrics.jsonl"
        if path.exists() and self.dims.is_main:
            torn = truncate_metrics(path, step)
            if torn:
                self.log(f"note: skipped {torn} unreadable line(s) of {path} (a run killed while writing it)")

    # ---- one step ------------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        """Accumulate `global/micro` micro-batches, clip, step. Returns (mean loss, grad norm)."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg.optim, cfg.train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        if self.pipeline is not None:  # the schedule runs every micro-batch's forward and backward
            total = self._pipeline_forward_backward()
        else:
            for i in range(self.accum):
                x, y = self.loader.next()
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                self.sync.set_last_microbatch(i == self.accum - 1)
                with self.precision.autocast():
                    loss = self.loss(x, y) / self.accum
                self.precision.scaler.scale(loss).backward()
                total += loss.detach()  # the full-vocabulary loss: identical on every tp rank
        total = self.sync.average_loss(total)  # the global batch's mean (over dp)
        # Wait for the dp reductions launched during backward, then complete the gradients tp ranks hold
        # parts of (SP norms, shared KV heads) and the tied embedding's two pipeline copies.
        self.sync.finish()
        self.precision.scaler.unscale_(self.optimizer)
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = self.sync.clip_grad_norm_(clip)  # each parameter (shard) once, over the whole layout
        loss, norm = self._host_values(total, grad_norm)
        scaler = self.precision.scaler
        # fp16: a finite loss with inf gradients is the GradScaler's to skip (it lowers the scale).
        if math.isfinite(loss) and (math.isfinite(norm) or scaler.is_enabled()):
            scaler.step(self.optimizer)
            self.bad_in_row = 0
        else:
            self._skip_step(loss, norm)
        scaler.update()
        self.sync.after_step()  # ZeRO-1/2: every rank's updated shard into everyone's parameters
        if not self._memory_logged:  # measured now: Adam's states exist, gradients not yet released
            self.log(memory_report(self.sync, self.optimizer))
            self._memory_logged = True
        self.sync.zero_grad(self.optimizer)
        self.step += 1
        self.tokens_seen += cfg.train.global_batch_size * self.row_tokens
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

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean token loss of one micro-batch through this rank's model (not the pipeline's)."""
        return self.forward(x, targets=y) if self.fused_loss else self.loss_fn(self.forward(x), y)

    def _pipeline_forward_backward(self) -> torch.Tensor:
        """The loop's micro-batches, in the loop's order, stacked for the schedule (it splits them again);
        returns the loss (the mean over micro-batches), broadcast from the last stage."""
        batches = [self.loader.next() for _ in range(self.pipeline.n_microbatches)]
        x = torch.cat([b[0] for b in batches]).to(self.device, non_blocking=True)
        y = torch.cat([b[1] for b in batches]).to(self.device, non_blocking=True)
        with self.precision.autocast():
            return self.pipeline.train_step(x, y)

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
                    losses.append(float(self.pipeline.eval_loss(x, y)))
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
        if not self.dims.is_main:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    _bar = None

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run(cfg, t)
        finally:
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

    def _run(self, cfg: Config, t) -> dict:
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        m, d = cfg.model, self.dims
        self.log(f"model: {self.n_params / 1e6:.2f}M parameters, {m.n_layers} layers, h={m.hidden_size}, "
                 f"{m.n_heads} heads ({m.kv_heads} kv), seq {m.seq_len}; train {len(self.train_set)} samples "
                 f"({_num_tokens(self.train_set):,} tokens), valid {len(self.valid_set)} samples; device "
                 f"{self.device.type}, {t.precision}")
        if d.world_size > 1:
            self.log(f"layout: {d.world_size} processes = pp {d.pp} × dp {d.dp} × tp {d.tp}"
                     f"{' with sequence parallelism' if cfg.parallel.sp else ''}")
        if self.pipeline is not None:
            pipe = self.pipeline
            self.log(f"pipeline: {pipe.n_stages} stages ({d.pp} ranks × vpp {cfg.parallel.vpp}), layers per stage "
                     f"{pipe.layer_counts}, {pipe.n_microbatches} micro-batches per step, "
                     f"{type(pipe.schedule).__name__}")
        peak = self._peak_tflops() * d.world_size  # MFU against the peak of every device in the job
        flops = self.spec.flops(m, t.global_batch_size, self.row_tokens)
        if self.loss_fraction is not None and self.spec.decoder:  # fine-tuning rows: the loss on the answers only
            flops = finetune_flops(m, t.global_batch_size, self.row_tokens, self.loss_fraction,
                                   frozen=cfg.tune.method != "none")
        hw_flops = flops + self.spec.recompute_flops(m, t.global_batch_size, t.recompute, self.row_tokens,
                                                     layers=recomputed_layers(cfg))
        # Bytes saved for backward, measured on one micro-batch (random streams untouched); not under ZeRO-3,
        # whose sharded (DTensor) parameters the counter cannot tell apart from activations.
        if d.pp == 1 and self.sync.zero < 3:
            acts = measure_model_activations(self.model, self.loss_fn, t.micro_batch_size, m.seq_len, m.vocab_size,
                                             self.precision.autocast(), self.tp_rng, self.fused_loss,
                                             layers=list(getattr(self.model, self.spec.pipeline.layers)),
                                             example=self.spec.example_batch)
            self._take_parts()  # the measurement's loss parts are not the run's
            formula = self.spec.activation_bytes
            self.log(acts.summary(formula(cfg, device_type=self.device.type) if formula else None))
        self._truncate_metrics(self.step)
        writer = SummaryWriter(str(self.out_dir / "tensorboard")) if d.is_main else None
        metrics = open(self.out_dir / "metrics.jsonl", "a") if d.is_main else None  # noqa: SIM115 (closed in the finally below)
        self._bar = tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step",
                         disable=not self.progress, dynamic_ncols=True)
        last_eval: dict = {}
        window_start, window_steps = time.perf_counter(), 0
        try:
            while self.step < t.max_steps and not self._stop_requested():
                loss, grad_norm = self.train_step()
                window_steps += 1
                self._bar.update(1)
                self._bar.set_postfix(loss=f"{loss:.3f}")
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    # No torch.cuda.synchronize(): every step already waits for its loss (`_host_values`).
                    dt = (time.perf_counter() - window_start) / window_steps
                    parts = self._parts_means()  # every rank: a collective over pp and dp
                    rec = {"kind": "train", "step": self.step, "loss": loss, **parts,
                           "lr": lr_at(self.step - 1, cfg.optim, t.max_steps), "grad_norm": grad_norm,
                           "tokens": self.tokens_seen, "skipped_steps": self.skipped_steps,
                           "tokens_per_s": t.global_batch_size * self.row_tokens / dt,
                           "tflops": flops / dt / 1e12, "mfu": flops / dt / 1e12 / peak,
                           "hfu": hw_flops / dt / 1e12 / peak, "peak_mem_mb": peak_memory_mb(self.device),
                           "step_time_s": dt}
                    self._write(metrics, writer, rec)
                    more = "".join(f" | {k} {v:.4f}" for k, v in parts.items())
                    self.log(f"step {self.step:>6} | loss {loss:.4f}{more} | lr {rec['lr']:.2e} | gnorm {grad_norm:.3f}"
                             f" | {rec['tokens_per_s']:,.0f} tok/s | {rec['tflops']:.3f} TFLOP/s | "
                             f"MFU {100 * rec['mfu']:.1f}% | HFU {100 * rec['hfu']:.1f}% | mem {rec['peak_mem_mb']:,.0f} MiB")
                    window_start, window_steps = time.perf_counter(), 0
                if (t.eval_every and self.step % t.eval_every == 0) or self.step == t.max_steps:
                    last_eval = self._eval_and_log(metrics, writer)
                    window_start, window_steps = time.perf_counter(), 0
                if t.save_every and self.step % t.save_every == 0 and self.step < t.max_steps:
                    self.save()
            path = self.save()
            if self.stop_signal is not None:
                self.log(f"stopped by {self.stop_signal} at step {self.step}; checkpoint saved to {path}")
            else:
                self.log(f"saved checkpoint {path}")
        finally:
            self._bar.close()
            self._bar = None
            if d.is_main:
                metrics.close()
                writer.close()
        if t.sample_tokens and self.stop_signal is None:
            self.print_sample()
        return {"step": self.step, **last_eval}

    def _eval_and_log(self, metrics, writer) -> dict:
        result = self.evaluate()
        if self.cfg.train.eval_tasks:  # train.eval_tasks: val_<task>_<metric> (meshlm/eval/during_training.py)
            from meshlm.eval.during_training import run_eval_tasks

            result.update(run_eval_tasks(self))
        if result:
            self._write(metrics, writer, {"kind": "eval", "step": self.step, "tokens": self.tokens_seen, **result})
            if "val_bpb" in result:
                self.log(f"eval step {self.step}: val loss {result['val_loss']:.4f} | ppl {result['val_ppl']:.1f} | "
                         f"bits/byte {result['val_bpb']:.3f}")
            else:
                self.log(f"eval step {self.step}: " + " | ".join(f"{k} {v:.4f}" for k, v in result.items()))
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

    def _write(self, metrics, writer, rec: dict) -> None:
        if not self.dims.is_main:
            return
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()
        prefix = "valid" if rec["kind"] == "eval" else "train"
        for key, value in rec.items():
            if isinstance(value, float) and key != "step":
                writer.add_scalar(f"{prefix}/{key}", value, rec["tokens"])

    def print_sample(self) -> None:
        t = self.cfg.train
        model = self.model
        if self.dims.world_size > 1:  # the model lives on several ranks: rank 0 reads the checkpoint just saved
            if not self.dims.is_main:
                return
            model = self.spec.model_class(self.cfg.model).to(self.device)
            model.load_state_dict(ckpt.load_model_state(ckpt.latest_checkpoint(self.out_dir), self.device))
        ids = torch.tensor([self.tokenizer.encode(t.sample_prompt)], device=self.device)
        out = generate(model, ids, t.sample_tokens, temperature=0.8, top_p=0.9, seed=t.seed)  # nucleus sampling
        text = self.tokenizer.decode(out[0].tolist())
        print("\n---------------- sample ----------------\n" + text + "\n----------------------------------------")
