"""A training run's output, on rank 0 only: log lines (written through the progress bar while it shows),
`metrics.jsonl` (one JSON record per log step and per evaluation) and TensorBoard scalars (`train/…`,
`valid/…`, against tokens seen), and the lines that describe the run, a step and an evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.train.metrics import truncate_metrics


class RunLog:
    """Rank 0's log, metrics file and TensorBoard writer (every method is a no-op on the other ranks)."""

    def __init__(self, out_dir: Path, is_main: bool):
        self.out_dir, self.is_main = out_dir, is_main
        self.bar = None  # the tqdm bar while the loop runs
        self.metrics = None  # metrics.jsonl, open while the loop runs
        self.writer = None  # TensorBoard's SummaryWriter, open while the loop runs

    def log(self, text: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def open(self, step: int, max_steps: int, progress: bool) -> None:
        """Start the loop's output at `step`: metrics.jsonl cut back to it (`truncate`), the files opened
        for appending, the progress bar shown (when `progress`)."""
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.truncate(step)
        if self.is_main:
            self.writer = SummaryWriter(str(self.out_dir / "tensorboard"))
            self.metrics = open(self.out_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in `close`)
        self.bar = tqdm(total=max_steps, initial=step, desc="train", unit="step", disable=not progress,
                        dynamic_ncols=True)

    def set_total(self, steps: int) -> None:
        """The progress bar's end: the step count a time budget fixed."""
        if self.bar is not None:
            self.bar.total = steps
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
        self.bar = None
        if self.is_main:
            self.metrics.close()
            self.writer.close()

    def truncate(self, step: int) -> None:
        """Drop metric lines past the resumed step (a killed run may have logged beyond its checkpoint; a
        fresh start, step 0, keeps none) and lines a kill tore (with a note)."""
        path = self.out_dir / "metrics.jsonl"
        if path.exists() and self.is_main:
            torn = truncate_metrics(path, step)
            if torn:
                self.log(f"note: skipped {torn} unreadable line(s) of {path} (a run killed while writing it)")

    def write(self, rec: dict) -> None:
        """One record: a line of metrics.jsonl and its float values as TensorBoard scalars against
        `rec["tokens"]` (`valid/` for an evaluation, `stragglers/` for a straggler report, `train/` else)."""
        if not self.is_main:
            return
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        prefix = {"eval": "valid", "stragglers": "stragglers"}.get(rec["kind"], "train")
        for key, value in rec.items():
            if isinstance(value, float) and key != "step":
                self.writer.add_scalar(f"{prefix}/{key}", value, rec["tokens"])


def run_summary(trainer) -> list[str]:
    """The lines that open a run's log: the model and data, the layout, the pipeline."""
    cfg, d, t, m = trainer.cfg, trainer.dims, trainer.cfg.train, trainer.cfg.model
    model = (f"model: {trainer.n_params / 1e6:.2f}M parameters, {m.n_layers} layers, h={m.hidden_size}, "
             f"{m.n_heads} heads ({m.kv_heads} kv), seq {m.seq_len}; train {len(trainer.train_set)} samples "
             f"({num_tokens(trainer.train_set):,} tokens), valid {len(trainer.valid_set)} samples; device "
             f"{trainer.device.type}, {t.precision}")
    lines = [model]
    if d.world_size > 1:
        cp = f" × cp {d.cp} (ring attention, {m.seq_len // d.cp} tokens per rank)" if d.cp > 1 else ""
        ep = f"; ep {d.ep} ({m.moe_experts // d.ep} experts per rank, all-to-all)" if d.ep > 1 else ""
        lines.append(f"layout: {d.world_size} processes = pp {d.pp} × dp {d.dp}{cp} × tp {d.tp}"
                     f"{' with sequence parallelism' if cfg.parallel.sp else ''}{ep}")
    pipe = trainer.pipeline
    if pipe is not None:
        lines.append(f"pipeline: {pipe.n_stages} stages ({d.pp} ranks × vpp {cfg.parallel.vpp}), layers per stage "
                     f"{pipe.layer_counts}, {pipe.n_microbatches} micro-batches per step, "
                     f"{type(pipe.schedule).__name__}")
    return lines


def num_tokens(dataset) -> int:
    """A dataset's token count: its `num_tokens`, else the length of its `tokens`."""
    n = getattr(dataset, "num_tokens", None)
    return int(n) if n is not None else len(dataset.tokens)


def train_line(rec: dict, parts: dict) -> str:
    """The log line of a training record (`kind` train) with the loss parts `parts`."""
    more = "".join(f" | {k} {v:.4f}" for k, v in parts.items())
    if "moe_max_load" in rec:  # mixture of experts (train/metrics.py `moe_metrics`)
        more += (f" | moe aux {rec['moe_aux']:.3f} max load {rec['moe_max_load']:.2f}x"
                 f" dropped {100 * rec['moe_dropped']:.1f}%")
    if "mtp_loss" in rec:  # multi-token prediction (train/metrics.py `mtp_metrics`)
        more += f" | mtp {rec['mtp_loss']:.4f}"
    return (f"step {rec['step']:>6} | loss {rec['loss']:.4f}{more} | lr {rec['lr']:.2e} | gnorm {rec['grad_norm']:.3f}"
            f" | {rec['tokens_per_s']:,.0f} tok/s | {rec['tflops']:.3f} TFLOP/s | "
            f"MFU {100 * rec['mfu']:.1f}% | HFU {100 * rec['hfu']:.1f}% | mem {rec['peak_mem_mb']:,.0f} MiB")


def eval_line(step: int, result: dict) -> str:
    """The log line of an evaluation's metrics."""
    if "val_bpb" in result:
        return (f"eval step {step}: val loss {result['val_loss']:.4f} | ppl {result['val_ppl']:.1f} | "
                f"bits/byte {result['val_bpb']:.3f}")
    return f"eval step {step}: " + " | ".join(f"{k} {v:.4f}" for k, v in result.items())
