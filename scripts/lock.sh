#!/usr/bin/env bash
# Regenerates the hash-pinned locks in requirements/ (see docs/dependencies.md):
#   test.lock     <- pyproject.toml [project] dependencies and [test] extra + requirements/test.in (pip-compile)
#   runtime.lock  <- pyproject.toml [project] dependencies + requirements/runtime.in, within test.lock
#   assets.lock   <- requirements/assets.in, without dependencies                       (uv pip compile --no-deps)
# Usage: scripts/lock.sh [pip-compile options]
#   no option: re-resolve after an edit of pyproject.toml or requirements/*.in, keeping every
#              other pin; --upgrade: take the newest releases of everything;
#              --upgrade-package NAME (repeatable): take the newest release of NAME only.
# The tools live in a throwaway venv (pinned versions); setup.sh does not need them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
  { echo "lock.sh: needs Python 3.11 (the locks are resolved for it; set PYTHON=...)" >&2; exit 1; }
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
"$PY" -m venv "$tools"
"$tools/bin/python" -m pip install -q --disable-pip-version-check pip==26.3 pip-tools==7.6.2 uv==0.13.9
export CUSTOM_COMPILE_COMMAND=scripts/lock.sh UV_CUSTOM_COMPILE_COMMAND=scripts/lock.sh
compile() {
  "$tools/bin/pip-compile" -q --generate-hashes --allow-unsafe --strip-extras \
    --no-emit-index-url --no-emit-find-links "$@"
}
# test.lock first: runtime.lock is a subset of it, at the same versions (-c).
compile "$@" --extra test -o requirements/test.lock pyproject.toml requirements/test.in
compile "$@" -c requirements/test.lock -o requirements/runtime.lock pyproject.toml requirements/runtime.in
"$tools/bin/uv" pip compile -q --no-deps --generate-hashes --python-version 3.11 \
  -o requirements/assets.lock requirements/assets.in
echo "lock.sh: $(grep -c '^[a-z0-9]' requirements/runtime.lock) runtime, $(grep -c '^[a-z0-9]' requirements/test.lock) test," \
  "$(grep -c '^[a-z0-9]' requirements/assets.lock) asset packages pinned"
