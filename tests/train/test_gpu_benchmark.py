"""benchmarks/gpu_train.py --smoke runs on this machine (CPU: a tiny shape, no compile) on the synthetic corpus
the offline GPU box uses, and reports a finite row per variant. Not a cuda test: it guards the script that
benchmarks/gpu_check.sh runs on the GPU against breaking unseen."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_gpu_train_benchmark_smoke_runs_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "benchmarks/gpu_train.py", "--smoke", "--data", "synthetic", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"flash", "auto", "foreach", "math"}  # compile is left out of --smoke (minutes on CPU)
    for r in rows.values():
        assert "error" not in r and r["finite"], r
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and 0 < r["mfu"] == r["hfu"]  # no recompute: HFU = MFU
    assert rows["foreach"]["adamw"] == "foreach" and rows["flash"]["adamw"] == "fused"
    assert result["peak_tflops"] > 0 and "| flash " in proc.stdout and "memory estimate" in proc.stdout


def test_gpu_check_script_runs_on_cpu(tmp_path):
    """The README's `PYTHONPATH=. bash benchmarks/gpu_check.sh`: on a CPU the CUDA tests are skipped and the
    benchmark runs its smoke shape; every part must end ok and the log and rows land under $OUT."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OUT": str(tmp_path), "HOME": str(tmp_path),
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for part in ("environment", "cuda-tests", "gpu-train"):
        assert f"---- {part}: ok" in proc.stdout, proc.stdout[-3000:]
    assert (tmp_path / "gpu_check.log").stat().st_size > 0 and json.loads((tmp_path / "gpu_train.json").read_text())


def test_every_cuda_test_lives_where_gpu_check_collects_them():
    """gpu_check.sh collects tests/cuda alone (`-m cuda tests/cuda`): a test marked `cuda` anywhere else would
    never run on the GPU box. The marker, by any spelling pytest accepts, only in that folder."""
    marked = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").rglob("*.py"))
              if re.search(r"mark\.cuda\b", p.read_text())]
    assert marked == ["tests/cuda/test_cuda.py"]
    assert "-m cuda tests/cuda " in (ROOT / "benchmarks/gpu_check.sh").read_text()
