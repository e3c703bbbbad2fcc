"""The trainer's checkpoints: which one a run resumes, what a checkpoint holds, saving it, and loading it
back (or a fresh run's weights from `train.init_from`).

One process writes the one-process format (`checkpoint/single.py`: model.pt, optim.pt, state.pt);
several write per-rank pieces of layout-free tensors (`checkpoint/sharded.py`), which resume under any
layout and which `single.load_model_state` reads whole in one process (`meshlm generate`). A run whose
extension owns the checkpoints (`meshlm tune`'s adapter, `train/extension.py`) has that extension save
and restore them instead.

`CheckpointState` is a part of `train.trainer.Trainer` (its base class): the methods use the trainer's
attributes (`cfg`, `dims`, `out_dir`, `model`, `optimizer`, `sync`, `loader`, `precision`, `tokenizer`,
`tp_rng`, `step`, `tokens_seen`, `skipped_steps`, `legacy_resume`, `checkpoints`, `extensions`, `budget`,
`log`). A budget run's plan (`train/budget.py`: the step count it fixed) is part of the state, so a resumed
run keeps its schedule.

With `train.async_save` the loop's `train.save_every` checkpoints are copied to host memory at the step and
written by one background thread (`checkpoint/background.py`) while training goes on; `poll_save` completes
one at a step boundary (publish, `keep_last`, the extensions' `published`), the next save and the end of the
run wait for it, and its error stops the run with a synchronous save's message. The final save is
synchronous.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.distributed as dist

from meshlm.checkpoint import sharded
from meshlm.checkpoint.background import BackgroundWriter, SingleJob
from meshlm.checkpoint.consistency import run_disagreement
from meshlm.checkpoint.files import checkpoints_dir, load_config_dict, prune_old, prune_temporaries
from meshlm.checkpoint.single import find_checkpoint, load_part, resolve_checkpoint, save_checkpoint
from meshlm.core.config import Config, ConfigError, config_from_dict
from meshlm.core.errors import CheckpointError
from meshlm.core.precision import resolve_precision, resume_precision
from meshlm.core.rng import rng_state, set_rng_state
from meshlm.families.registry import get_spec


class CheckpointState:
    """Resuming and saving a run (see the module doc)."""

    saved_plan: dict | None = None  # the resumed checkpoint's time-budget plan, if any
    budget = None  # the run's `train.budget.TimeBudget` (train.time_budget_s), set by the trainer

    # ---- which checkpoint ------------------------------------------------------------------------------
    def _find_resume(self) -> Path | None:
        """Rank 0 picks the checkpoint (the newest valid one for `auto`, verified by checksum) and tells
        everyone; checkpoints present but none valid stop the run rather than start over."""
        resume = self.cfg.train.resume
        if self.dims.is_main:
            prune_temporaries(self.out_dir)
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
                path = resolve_checkpoint(resume, log=self.log, spec_of=get_spec)
                mismatch = run_disagreement(path, self.cfg.to_dict(), get_spec)
                return (None, mismatch) if mismatch else (str(path), None)
            path, note, present = find_checkpoint(self.out_dir, spec_of=get_spec)
            mismatch = run_disagreement(path, self.cfg.to_dict(), get_spec) if path is not None else None
        except CheckpointError as err:
            return None, str(err)
        if mismatch is not None:
            return None, mismatch
        if path is None and present:
            return None, (f"{checkpoints_dir(self.out_dir)} holds checkpoints but none is valid ({note}); "
                          "restore one, or set train.resume=never to start over")
        if note:
            self.log(f"note: {note}; resuming from {path.name}")
        return (None if path is None else str(path)), None

    def _resolve_precision(self, cfg: Config) -> Config:
        """`cfg` with train.precision resolved (core/precision.py): `auto` becomes the device's native 16-bit
        format or fp32, or, when resuming, the precision the checkpoint's run resolved to. Printed."""
        asked = cfg.train.precision
        name, why = resolve_precision(asked, self.device, cfg.model.hidden_size)
        if asked == "auto" and self.resume_from is not None:
            saved = resume_precision(load_config_dict(self.resume_from))
            if saved is not None:
                name, why = saved, f"as the resumed run {self.resume_from.name}"
        if name == "fp16" and asked == "auto" and self.dims.world_size > 1:
            name, why = "fp32", f"{why}; fp16 is not supported with several processes yet"
        if asked == "auto":
            self.log(f"precision: auto → {name} ({why}); set train.precision to choose")
        if name == asked:
            return cfg
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=name))

    # ---- what a checkpoint holds -----------------------------------------------------------------------
    def layout_summary(self) -> dict:
        """This run's layout as checkpoints record it: world size, tp, pp, dp, sp, the ZeRO stage (and cp
        when > 1)."""
        d = self.dims
        return {"world_size": d.world_size, "tp": d.tp, "pp": d.pp, "dp": d.dp, "sp": self.cfg.parallel.sp,
                "zero": self.sync.zero, **({"cp": d.cp} if d.cp > 1 else {}), **({"ep": d.ep} if d.ep > 1 else {})}

    def run_state(self) -> dict:
        """The shared state of a multi-process (or tune) checkpoint: step, tokens seen, data position,
        skipped steps, loss scale, tokenizer and layout (`restore_position` reads it back)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "loader": self.loader.state_dict(),
                "skipped_steps": self.skipped_steps, "scaler": self.precision.state_dict(),
                "tokenizer": self.tokenizer.name, "layout": self.layout_summary(), **self.plan_state()}

    def plan_state(self) -> dict:
        """{"time_budget": the budget's plan} once a budget run fixed its step count, else {}."""
        return {"time_budget": self.budget.state()} if self.budget is not None and self.budget.planned else {}

    def state_parts(self) -> dict:
        """A one-process checkpoint's parts: the model's and optimizer's state dicts and the run's state."""
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "state": {"step": self.step, "tokens_seen": self.tokens_seen, "rng": rng_state(),
                      "loader": self.loader.state_dict(), "scaler": self.precision.state_dict(),
                      "tokenizer": self.tokenizer.name, "threads": self.thread_state(), **self.plan_state()},
        }

    # ---- saving ----------------------------------------------------------------------------------------
    _writer: BackgroundWriter | None = None  # train.async_save's worker thread, made at the first background save

    def save(self, background: bool = False) -> Path | None:
        """Publish this step's checkpoint (never one with non-finite weights), then keep the newest
        `train.keep_last` valid ones. A save still in flight is completed first. `background` (the loop's
        train.save_every saves) with train.async_save: the state is copied to host memory and written by the
        background thread; it is published at a later step boundary (`poll_save`) and None is returned."""
        self._complete_save(waiting=True)
        if background and self.cfg.train.async_save and self.checkpoints is None:
            self._save_in_background()
            return None
        if self.checkpoints is not None:
            path = self.checkpoints.save(self)
        elif self.dims.world_size == 1:
            parts = self.state_parts()
            parts["state"]["skipped_steps"] = self.skipped_steps
            path = save_checkpoint(self.out_dir, self.step, parts, self.cfg.to_dict())
        else:
            path = self._save_sharded()
        self._published(path, self.step)
        return path

    def _published(self, path: Path, step: int) -> None:
        """After a publish: rank 0 prunes to `train.keep_last`; every rank's extensions hear of it."""
        if self.dims.is_main:
            prune_old(self.out_dir, self.cfg.train.keep_last, step)
        for extension in self.extensions:
            extension.published(self, path)

    def _save_sharded(self) -> Path:
        """Every rank writes the pieces of the layout-free tensors it owns (weights and Adam states) and its
        random streams; rank 0 adds the index and the shared state and publishes `latest` once every rank
        reported success (`sharded.save`, a collective)."""
        rank_state = {"rng": rng_state(), "tp_rng": self.tp_rng.get_state(), "threads": self.thread_state()}
        return sharded.save(self.out_dir, self.step, self.sync, self.optimizer, self.run_state(),
                            self.cfg.to_dict(), rank_state, spec=self.spec)

    def _save_in_background(self) -> None:
        """Copy this step's state to host memory (every rank, this thread) and hand it to the worker thread
        (`checkpoint/background.py`); with several processes, starting it is a collective (the temporary
        directory's name) and so is completing it (`poll_save`)."""
        writer = self._writer = self._writer or BackgroundWriter()
        copier = writer.copier
        if self.dims.world_size == 1:
            parts = self.state_parts()
            parts["state"]["skipped_steps"] = self.skipped_steps
            job = SingleJob(self.out_dir, self.step, copier.copy(parts), self.cfg.to_dict())
        else:
            rank_state = {"rng": rng_state(), "tp_rng": self.tp_rng.get_state(), "threads": self.thread_state()}
            job = sharded.begin(self.out_dir, self.step, self.sync, self.optimizer,
                                copier.copy(self.run_state()), self.cfg.to_dict(), copier.copy(rank_state),
                                copy=copier.tensor, spec=self.spec)
        writer.submit(job)

    def poll_save(self) -> None:
        """At a step boundary (every rank alike): publish the background save if every rank's worker finished
        it (several processes: one small all-reduce while a save is in flight); its error stops the run here."""
        if self._writer is not None and self._writer.job is not None and self._writer.done_everywhere(self.dims):
            self._complete_save(waiting=False)

    def _complete_save(self, waiting: bool) -> None:
        """Complete the background save in flight, if any (`waiting`: first wait for this rank's worker, and
        say so): publish it, or raise its error (the lines of a synchronous save)."""
        writer = self._writer
        if writer is None or writer.job is None:
            return
        step = writer.job.step
        if waiting:
            seconds = writer.wait()
            self.log(f"checkpoint: waited {seconds:.2f} s at step {self.step} for step {step}'s background write "
                     "to finish (train.async_save writes one checkpoint at a time)")
        self._published(writer.collect(), step)

    def close_saves(self) -> None:
        """At the end of `run` (also after an error): let a background write in flight end and stop the
        worker thread. A one-process save publishes itself; a sharded one is published only by
        `_complete_save` (a collective), so here it stays a temporary directory, pruned by the next run."""
        if self._writer is not None:
            self._writer.close()

    # ---- loading ---------------------------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        """Optimizer, data position and random streams (and, but for a one-process checkpoint resumed in one
        process, the weights) from a checkpoint of any layout."""
        state = load_part(path, "state")
        if state.get("tokenizer", self.tokenizer.name) != self.tokenizer.name:
            raise ConfigError(f"checkpoint {path} was trained with tokenizer {state['tokenizer']!r}, not "
                              f"data.tokenizer={self.tokenizer.name!r}; set data.tokenizer to match")
        saved = state.get("layout", {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "sp": False, "zero": 0})
        if self.legacy_resume:
            saved_optim = load_part(path, "optim", self.device)
            sharded.check_same_optimizer(path, sharded.saved_muon(saved_optim), self.optimizer)
            self.optimizer.load_state_dict(saved_optim)
            set_rng_state(state["rng"])
            self.restore_threads(state.get("threads"))  # the count its steps ran with (train/threads.py)
        else:  # any layout into this one: each rank reads the pieces of its tensors
            sharded.load(path, self.sync, self.optimizer, spec=self.spec, log=self.log)
            mine = sharded.load_rank_state(path, self.dims.rank, self.layout_summary())
            if mine is not None:  # the same layout: the very random streams, so dropout continues exactly
                set_rng_state(mine["rng"])
                self.tp_rng.set_state(mine["tp_rng"])
                self.restore_threads(mine.get("threads"))
            elif saved != self.layout_summary():
                self.log(f"resuming a checkpoint of layout {saved} under {self.layout_summary()}: weights, "
                         "optimizer and data position carry over; dropout masks start new streams")
        self.restore_position(state)
        self.log(f"resumed from {path} at step {self.step}")

    def restore_position(self, state: dict) -> None:
        """Step, tokens seen, data position, loss scale and skipped steps from a checkpoint's shared state."""
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.loader.load_state_dict(state["loader"])
        self.precision.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
        self.saved_plan = state.get("time_budget")  # a budget run's plan, kept when resumed (Trainer._keep_plan)

    def init_from(self, path: str) -> None:
        """A fresh run's weights from checkpoint `path` (any layout), where its tensors match this model's;
        the rest (a new task head) keep their seeded init. The optimizer starts fresh."""
        source = resolve_checkpoint(path, log=self.log)
        source_cfg = config_from_dict(load_config_dict(source)).model
        if source_cfg.family != self.cfg.model.family:
            raise ConfigError(f"train.init_from={path!r} holds a model.family={source_cfg.family!r} model, not "
                              f"{self.cfg.model.family!r}; pick a checkpoint of the same family")
        new = sharded.load_matching_weights(source, self.sync, source_cfg, spec=self.spec)
        total = len(sharded.logical_shapes(self.cfg.model, spec=self.spec))
        if len(new) == total:
            raise ConfigError(f"train.init_from={path!r}: none of its tensors fits this model (another shape); set "
                              "the model.* keys as in its config.json")
        self.log(f"initialised from {source}: {total - len(new)} of {total} tensors"
                 + (f"; new: {', '.join(new)}" if new else ""))

