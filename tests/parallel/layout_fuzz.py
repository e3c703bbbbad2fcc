"""The layout fuzz's machinery (test_layout_fuzz.py): a combination of family and parallel features, the
`meshlm train` command a user would give for it, meshlm's own refusal of the unsupported ones, the run under a
forked gloo world (parallel_world.py) against the same command in one process, and the comparison.

Each combination trains a narrow model (2 layers, 4 with pp × vpp = 4; width 32; 32 tokens; 8 rows a step;
warm-up 1 so that the steps move the weights; clipping at 1.0 active) for `STEPS` steps on the bundled corpus,
through the real `Trainer` on every rank: its config validation, data, layout, checkpoint. Compared with the
one-process run of the same keys: the loss and gradient norm of every step (metrics.jsonl) and the final
weights (the checkpoint, read whole). Deterministic combinations run the command twice in the same world and
need the two to be bit-identical.

Tolerance (`TOL`), one for every layout: what one process against plain dp=2 shows, fp32 rounding and nothing
else. A layout sums the same terms in another order (dp's gradient all-reduce, tp's and pp's partial norms, cp's
and ep's token groups), which moves an fp32 value by a few units in its 7th digit. Measured over 25 steps
(benchmarks/RESULTS.md, "Correct at every combination"): the losses of every layout within 2.2e-7 relative, so
1e-6 here (the issue's bar); the gradient norms within 1e-7 on most steps, but a few rounding-sensitive steps
reach 2e-5 even under plain dp=2 (a norm whose gradient nearly cancels), so 2e-5. The weights: AdamW turns a
rounding difference δg of a gradient element that nearly cancels (|g| ~ eps) into up to lr·δg/eps of weight, and
with AdamW's default eps of 1e-8 that reached 4.9e-5 (one element of 4096, gpt-pp2-vpp2-dp2-cp2 in the first
seed-1 run, whose losses and gradient norms matched to 9e-8 and 9e-7; 3.4e-7 with eps 1e-5). So the fuzz trains
with optim.eps=1e-6, for every layout and its reference alike: lr·δg/eps stays near 1e-6 and 2e-5 absolute is
the bar, tight enough that a wrong gradient shows.
In float64 the layouts agree to 1e-12 (tp, pp) and 1e-9 (MoE; tests/parallel/test_grad_norm_exact.py and
test_moe_parallel_exact.py), which is what says the residue is rounding. The looser bars this file had for tp,
pp and split MoE token sets (up to 1e-3 for gradient norms) covered bugs that are fixed.

A combination that crashes or hangs is a failure of the fuzz like a difference (its error's last lines in the
table's message), and the fuzz goes on to the next one.
"""

from __future__ import annotations

import functools
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from meshlm.checkpoint import single as ckpt
from meshlm.core.config import ConfigError, load_config
from meshlm.core.layout import plan_layout
from meshlm.families.registry import get_spec

STEPS = 3
FAMILIES = {  # family → (bundled config, model keys)
    "gpt": ("gpt-tiny", []),
    "llama": ("llama-tiny", ["--model.n_kv_heads=2"]),  # grouped-query attention: 4 heads, 2 KV heads
    "moe": ("gpt-moe-tiny", ["--model.moe_experts=4", "--model.moe_expert_hidden=32"]),
    # Qwen3's per-head q/k norms, heads of 16 over a width of 32, one KV head (held by both ranks under tp 2)
    "qwen3": ("llama-tiny", ["--model.n_kv_heads=1", "--model.qk_norm=true", "--model.head_size=16"]),
    "bert": ("bert-tiny", []),
}
COMMON = ["--model.hidden_size=32", "--model.n_heads=4", "--model.seq_len=32", f"--train.max_steps={STEPS}",
          "--train.micro_batch_size=1", "--train.global_batch_size=8", "--train.eval_iters=1", "--train.eval_every=0",
          "--train.log_every=1", "--train.peak_tflops=1", "--train.sample_tokens=0", "--train.progress=false",
          "--train.precision=fp32", "--train.fused_loss=true", "--train.save_every=0", "--train.adapt_threads=false",
          "--optim.warmup_steps=1", "--optim.eps=1e-6", "--parallel.timeout_s=60", "--parallel.heartbeat_s=0"]

# Tolerances against one process in fp32, the same for every layout (module docstring): relative for the loss
# and gradient norm (every step), absolute for the weights.
TOL = {"loss": 1e-6, "grad_norm": 2e-5, "weights": 2e-5}


@dataclass(frozen=True)
class Combo:
    """One combination: a model family and the parallel, memory and data features of its run."""

    family: str = "gpt"
    tp: int = 1
    sp: bool = False
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    recompute: str = "none"
    document_mask: bool = False
    deterministic: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def name(self) -> str:
        parts = [self.family] + [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("vpp", self.vpp),
                                                          ("dp", self.dp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        parts += ["sp"] * self.sp + [f"zero{self.zero}"] * (self.zero > 0)
        parts += [f"rc-{self.recompute}"] * (self.recompute != "none") + ["docmask"] * self.document_mask
        return "-".join(parts + ["det"] * self.deterministic)

    def model_argv(self) -> list[str]:
        layers = 4 if self.pp * self.vpp > 2 else 2
        return [*FAMILIES[self.family][1], f"--model.n_layers={layers}", *COMMON,
                f"--data.document_mask={str(self.document_mask).lower()}",
                f"--train.deterministic={str(self.deterministic).lower()}"]

    def argv(self) -> list[str]:
        """The command's keys: the model's, then the layout's."""
        return [*self.model_argv(), f"--parallel.tp={self.tp}", f"--parallel.sp={str(self.sp).lower()}",
                f"--parallel.pp={self.pp}", f"--parallel.vpp={self.vpp}", f"--parallel.dp={self.dp}",
                f"--parallel.cp={self.cp}", f"--parallel.ep={self.ep}", f"--parallel.zero={self.zero}",
                f"--train.recompute={self.recompute}"]

    def tolerance(self) -> dict:
        return TOL


def random_combo(rng: random.Random) -> Combo:
    """A combination drawn at random, unsupported ones included (meshlm refuses those): world of at most 8."""
    family = rng.choice(list(FAMILIES))
    tp, pp, cp = rng.choice([1, 1, 2]), rng.choice([1, 1, 2]), rng.choice([1, 1, 2])
    dp = rng.choice([1, 2, 2, 4])
    while tp * pp * cp * dp > 8:
        dp //= 2
    return Combo(family=family, tp=tp, sp=tp > 1 and rng.random() < 0.5, pp=pp,
                 vpp=2 if pp > 1 and rng.random() < 0.3 else 1, dp=dp, cp=cp,
                 ep=2 if (family == "moe" and rng.random() < 0.6) or rng.random() < 0.05 else 1,
                 zero=rng.choice([0, 1, 2, 3]), recompute=rng.choice(["none", "selective", "full"]),
                 document_mask=family != "bert" and rng.random() < 0.3, deterministic=rng.random() < 0.3)


def config_of(combo: Combo, out_dir: Path | str, *, layout: bool = True):
    """The validated config of the combination's command (`layout` False: the one-process reference's)."""
    argv = combo.argv() if layout else combo.model_argv()
    return load_config(FAMILIES[combo.family][0], [*argv, f"--train.out_dir={out_dir}"])


def refusal(combo: Combo) -> str | None:
    """meshlm's own one-line refusal of the combination (config validation, then the layout's rules for its
    world), or None if it is supported. Nothing is built or written."""
    try:
        cfg = config_of(combo, "unused")
        spec = get_spec(cfg.model.family)
        plan_layout(cfg, combo.pp, combo.dp, combo.tp, cp=combo.cp, decoder=spec.decoder)
        if cfg.data.document_mask and spec.document_inputs is None:  # the trainer's first check (`_build_data`)
            raise ConfigError(f"data.document_mask=true is not supported by model.family={spec.name!r}")
    except ConfigError as err:
        return str(err)
    return None


def _train_ranks(rank: int, world: int, out_dir: str, combo: Combo, repeats: int) -> None:
    """One rank of the combination's command, `repeats` times (fresh trainers, outputs run0, run1, ...)."""
    from meshlm.train.trainer import Trainer

    for i in range(repeats):
        Trainer(config_of(combo, Path(out_dir) / f"run{i}")).run()


def records(out: Path, family: str) -> dict:
    """A run's per-step losses and gradient norms (metrics.jsonl) and final weights (its checkpoint, whole)."""
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    spec = get_spec("bert" if family == "bert" else "gpt")
    return {"loss": [r["loss"] for r in train], "grad_norm": [r["grad_norm"] for r in train],
            "weights": ckpt.load_model_state(ckpt.resolve_checkpoint(out, log=None), spec=spec)}


def run_layout(combo: Combo, out_dir: Path, repeats: int) -> list[dict]:
    """The combination under its world (forked gloo ranks, with a deadline), `repeats` runs."""
    from parallel_world import run_world

    run_world(functools.partial(_train_ranks, combo=combo, repeats=repeats), combo.world, out_dir, deadline_s=300)
    return [records(out_dir / f"run{i}", combo.family) for i in range(repeats)]


def run_reference(combo: Combo, out_dir: Path) -> dict:
    """The same command in one process (this one, one thread), without the layout's keys."""
    from meshlm.train.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(config_of(combo, out_dir, layout=False)).run()
    finally:
        torch.set_num_threads(threads)
    return records(out_dir, combo.family)


def differences(ref: dict, got: dict) -> dict:
    """Worst relative difference of the losses and gradient norms over the steps, worst absolute weight one."""
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-30)
    out = {k: max(rel(a, b) for a, b in zip(got[k], ref[k])) for k in ("loss", "grad_norm")}
    out["weights"] = max(float((got["weights"][k] - v).abs().max()) for k, v in ref["weights"].items())
    return out


def report(combo: Combo, ref: dict, got: dict, diff: dict) -> str:
    """A failure's message: the combination, its tolerances, every step's values side by side."""
    lines = [f"{combo.name()} differs from one process beyond {combo.tolerance()}: worst {diff}",
             "step | loss (1 process) | loss (layout) | grad_norm (1 process) | grad_norm (layout)"]
    for i, (a, b, c, d) in enumerate(zip(ref["loss"], got["loss"], ref["grad_norm"], got["grad_norm"]), 1):
        lines.append(f"{i:4d} | {a:.9g} | {b:.9g} | {c:.9g} | {d:.9g}")
    worst = max(ref["weights"], key=lambda k: float((got["weights"][k] - ref["weights"][k]).abs().max()))
    lines.append(f"largest weight difference in {worst}")
    return "\n".join(lines)


def bit_identical(a: dict, b: dict) -> bool:
    return a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["weights"].keys() == b["weights"].keys() \
        and all(torch.equal(v, b["weights"][k]) for k, v in a["weights"].items())


def crash_message(err: Exception, root: Path) -> str:
    """A crashed world's error: the exception, and the last lines of the first rank's traceback (error_*.txt)."""
    for path in sorted(root.rglob("error_*.txt")):
        return f"{err!r}; {path.name}:\n" + "\n".join(path.read_text().splitlines()[-6:])
    return repr(err)


def check(combo: Combo, root: Path, references: dict, reference_root: Path) -> dict:
    """Refuse, or run the combination (under `root`) and its one-process reference (`references`, by model keys,
    run under `reference_root` if new) and compare: a summary row with `outcome` "refused", "pass" or "FAIL", the
    message, and the worst differences."""
    began = time.monotonic()
    row = {**asdict(combo), "name": combo.name(), "world": combo.world}
    if (why := refusal(combo)) is not None:
        return {**row, "outcome": "refused", "message": why, "seconds": time.monotonic() - began}
    key = (combo.family, *combo.model_argv())
    if key not in references:
        references[key] = run_reference(combo, Path(reference_root) / f"ref{len(references)}")
    ref = references[key]
    try:
        runs = run_layout(combo, Path(root) / combo.name(), repeats=2 if combo.deterministic else 1)
    except Exception as err:  # noqa: BLE001 (a crash or a hang: a failure, and the fuzz goes on)
        return {**row, "outcome": "FAIL", "message": f"{combo.name()} crashed: {crash_message(err, Path(root))}",
                "seconds": time.monotonic() - began}
    diff = differences(ref, runs[0])
    tol = combo.tolerance()
    problems = [report(combo, ref, runs[0], diff)] if any(diff[k] > tol[k] for k in tol) else []
    if combo.deterministic and not bit_identical(runs[0], runs[1]):
        problems.append(f"{combo.name()}: train.deterministic=true, but two runs differ: losses {runs[0]['loss']} "
                        f"and {runs[1]['loss']}, gradient norms {runs[0]['grad_norm']} and {runs[1]['grad_norm']}")
    return {**row, **diff, "outcome": "FAIL" if problems else "pass", "message": "\n".join(problems),
            "seconds": time.monotonic() - began}


def summary(rows: list[dict]) -> str:
    """The table the fuzz prints: one row per combination, then the counts of passes, failures and refusals."""
    lines = ["combination | world | outcome | loss rel | grad_norm rel | weights abs | s",
             "---|---|---|---|---|---|---"]
    for r in rows:
        nums = " | ".join(f"{r[k]:.1e}" if k in r else "-" for k in ("loss", "grad_norm", "weights"))
        lines.append(f"{r['name']} | {r['world']} | {r['outcome']} | {nums} | {r['seconds']:.0f}")
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("pass", "FAIL", "refused")}
    lines.append(f"{len(rows)} combinations: {counts['pass']} passed, {counts['FAIL']} failed, "
                 f"{counts['refused']} refused by meshlm's validation")
    return "\n".join(lines)
