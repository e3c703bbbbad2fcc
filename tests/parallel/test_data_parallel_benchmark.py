"""benchmarks/dp_overlap.py runs (tiny sizes) and the bytes each rank sends per step equal the ring theory."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_dp_overlap_benchmark_runs_and_bytes_match_theory():
    cmd = [sys.executable, "benchmarks/dp_overlap.py", "--layers", "2", "--hidden", "64", "--vocab", "256",
           "--seq", "16", "--micro-batch", "2", "--bucket-mb", "0.05", "--steps", "2", "--warmup", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {cells[1].strip(): cells for cells in (line.split("|") for line in proc.stdout.splitlines())
            if len(cells) > 7 and cells[1].strip() in ("compute only", "overlap off", "overlap on")}
    assert set(rows) == {"compute only", "overlap off", "overlap on"}
    mb = lambda cell: float(re.match(r"\s*([\d.]+) MB", cell).group(1))
    for mode in ("overlap off", "overlap on"):  # measured bytes written to the sockets = 2·(d−1)/d·N at d = 2
        sent, theory = mb(rows[mode][6]), mb(rows[mode][7])
        assert abs(sent - theory) <= 0.02 * theory + 0.01, rows[mode]
    assert mb(rows["compute only"][6]) == 0.0
