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
	$(BIN)/python -m pip install -q -e ".[hf,dev,tune,tensorboard]"
	touch $(STAMP)

# The main job: a small LLaMA trained with a real schedule (Megatron TP x FSDP) on 4 local
# processes, then the explanation of a 7B-shaped schedule at tp8 x pp4 x dp4 (no devices).
demo: $(STAMP)
	$(BIN)/slapo-fn train --model llama-small --dp 2 --tp 2 --steps 60 --lr 3e-3 --log-every 10
	$(BIN)/slapo-fn explain --model llama-7b --tp 8 --pp 4 --dp 4

test: $(STAMP)
	$(BIN)/python -m pytest -q --doctest-modules slapo_fn tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" --doctest-modules slapo_fn tests

lint: $(STAMP)
	$(BIN)/ruff check slapo_fn tests benchmarks examples
	$(BIN)/lint-imports
	$(BIN)/mypy

typecheck: $(STAMP)
	$(BIN)/mypy

# Each benchmark prints one JSON line; on a GPU machine add benchmarks/gpu_throughput.py.
bench: $(STAMP)
	$(BIN)/python benchmarks/schedule_cost.py
	$(BIN)/python benchmarks/fusion.py
	$(BIN)/python benchmarks/tp_overhead.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/recipe_speed.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
