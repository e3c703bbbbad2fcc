# The README's two commands: `make demo` and `make test`. Each does its own set-up (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup setup-test demo test lint bench

setup:
	@bash scripts/setup.sh

setup-test:
	@bash scripts/setup.sh --test

demo: setup
	$(PY) -m meshlm train --config demo

test: setup-test
	.venv/bin/lint-imports
	$(PY) -m ruff check meshlm tests benchmarks
	$(PY) -m pytest tests --durations=10

lint: setup-test
	$(PY) -m ruff check meshlm tests benchmarks

bench: setup
	$(PY) benchmarks/train_step.py
