"""`torchrun … meshlm align` under tp = 2 (vocab-split logits: the row log-probs from the vocab-parallel
cross-entropy), pp = 2 (the last stage computes the log-probs and the pair loss) and dp = 2 with ZeRO-1 (each
rank a slice of the pairs) trains like one process: per-step losses within 1e-5 (relative), as the other
parallel equivalence tests, and the same final evaluation. DPO on the whole model, dropout off."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from meshlm.cli import main
from tests.tune.test_align import pair_rows
from tests.tune.tune_helpers import QUIET, metrics, save_base, train_losses, write_jsonl

TOL = 1e-5
STEPS = 3
LAYOUTS = {"tp2": ["--parallel.tp=2"], "pp2": ["--parallel.pp=2"], "dp2_zero1": ["--parallel.zero=1"]}


def args_for(root) -> list[str]:
    return ["align", "--checkpoint", str(root / "base"), "--method", "dpo", "--train", str(root / "train.jsonl"),
            "--valid", str(root / "valid.jsonl"), *QUIET, f"--train.max_steps={STEPS}", "--train.log_every=1",
            "--optim.lr=3e-3", "--optim.warmup_steps=1", "--parallel.timeout_s=60", "--max-length", "16"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("align_parallel")
    save_base(root / "base")
    write_jsonl(root / "train.jsonl", pair_rows(32, 1))
    write_jsonl(root / "valid.jsonl", pair_rows(6, 2))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*args_for(root), "--out", str(root / "one")]) == 0
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(root, layout):
    out = root / layout
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "meshlm", *args_for(root), "--out", str(out), *LAYOUTS[layout]],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = root / "one"
    ref, got = train_losses(one), train_losses(out)
    assert len(ref) == len(got) == STEPS
    assert ref[-1] < ref[0]
    for a, b in zip(ref, got):
        assert abs(a - b) <= TOL * abs(a), (ref, got)
    ref_eval, got_eval = metrics(one, "eval")[-1], metrics(out, "eval")[-1]
    # The summed log-probs (about -20) within 1e-5 of themselves; a reward is β times the small difference of
    # two of them, so its rounding is that of the log-probs (1e-5 · 20 · β), not 1e-5 of itself.
    for key in ("val_loss", "val_logps/chosen", "val_logps/rejected"):
        assert got_eval[key] == pytest.approx(ref_eval[key], rel=TOL), key
    for key in ("val_rewards/chosen", "val_rewards/rejected", "val_rewards/margins"):
        assert got_eval[key] == pytest.approx(ref_eval[key], abs=TOL * 0.1 * 2 * abs(ref_eval["val_logps/chosen"])), key
