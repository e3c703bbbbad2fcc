# The README's two commands: `make demo` and `make test`. Each does its own set-up (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup setup-test demo test lint bench

setup:
	@bash scripts/setup.sh

setup-test:
	@bash scripts/setup.sh --test

demo: setup
	$(PY) -m meshlm train --config demo

# The tests: one process per CPU (pytest-xdist; a file's tests stay together, so its module fixtures are built
# once), each with one OpenMP thread: tiny models gain nothing from threads, and two processes of two spinning
# threads each on two cores slow each other several-fold (docs/threads.md).
test: setup-test
	.venv/bin/lint-imports
	$(PY) -m ruff check meshlm tests benchmarks
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -n auto --dist loadfile --durations=10

lint: setup-test
	$(PY) -m ruff check meshlm tests benchmarks

bench: setup
	$(PY) benchmarks/train_step.py
