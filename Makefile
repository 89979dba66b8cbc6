# The two commands of the README: `make demo` and `make test`. Both set everything up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-fast lint typecheck bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: any other spec would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[hf,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q --doctest-modules slapo_fn tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" --doctest-modules slapo_fn tests

lint: $(STAMP)
	$(BIN)/ruff check slapo_fn tests benchmarks examples
	$(BIN)/mypy

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/schedule_cost.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
