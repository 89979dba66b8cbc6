# The two commands of the README: `make demo` and `make test`. Both set everything up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-all lint typecheck bench gpu-check wheelhouse clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: any other spec would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[hf,dev,tune,tensorboard,wandb,float8]"
	touch $(STAMP)

# The lifecycle, in under 3 minutes on 2 CPU cores: (a) a BPE tokenizer trained on the fly on the
# Python standard library and a small LLaMA config (examples/lifecycle_setup.py), pre-trained from
# random weights on that corpus at dp2 x tp2 (4 processes), with a checkpoint and an eval loss;
# (b) the checkpoint exported to a Hugging Face folder; (c) fine-tuned from that folder's weights
# at another layout, pp2 x tp2, whose first loss continues where pre-training ended; (d) the
# explanation of a 7B-shaped schedule at tp8 x pp4 x dp4 (no devices).
DEMO := demo-out
demo: $(STAMP)
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/python examples/lifecycle_setup.py $(DEMO)/base
	$(BIN)/slapo-fn train --model $(DEMO)/base --data stdlib --dp 2 --tp 2 --seq 128 --batch 8 --steps 50 \
		--lr 3e-3 --warmup 5 --log-every 10 --eval-every 25 --eval-batches 4 --checkpoint-dir $(DEMO)/ckpt \
		--no-progress | tee $(DEMO)/pretrain.log
	$(BIN)/slapo-fn export $(DEMO)/ckpt $(DEMO)/hf --model $(DEMO)/base
	$(BIN)/slapo-fn train --model $(DEMO)/hf --data stdlib --pp 2 --tp 2 --seq 128 --batch 8 --steps 10 \
		--lr 1e-3 --log-every 5 --no-progress | tee $(DEMO)/finetune.log
	@echo "pre-training (dp2 x tp2) ended at: $$(grep '^step 50 loss' $(DEMO)/pretrain.log | cut -d' ' -f1-4)"
	@echo "fine-tuning (pp2 x tp2) began at:  $$(grep '^step 1 loss' $(DEMO)/finetune.log | cut -d' ' -f1-4)"
	$(BIN)/slapo-fn explain --model llama-7b --tp 8 --pp 4 --dp 4

# The default suite, which CI runs (about 15 minutes on 2 cores). Tests marked `slow` repeat what
# it covers at greater length (the whole `make demo`, tune with a crash and a hang, two nodes,
# resume, the docs pages beyond the README); `make test-all` adds them (about 26 minutes).
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" --doctest-modules slapo_fn tests

test-all: $(STAMP)
	$(BIN)/python -m pytest -q --doctest-modules slapo_fn tests

lint: $(STAMP)
	$(BIN)/ruff check slapo_fn tests benchmarks examples
	$(BIN)/lint-imports
	$(BIN)/mypy

typecheck: $(STAMP)
	$(BIN)/mypy

# Each benchmark prints one JSON line; on a GPU machine: make gpu-check (below).
bench: $(STAMP)
	$(BIN)/python benchmarks/schedule_cost.py
	$(BIN)/python benchmarks/fusion.py
	$(BIN)/python benchmarks/tp_overhead.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/recipe_speed.py
	$(BIN)/python benchmarks/paper_models.py
	$(BIN)/python benchmarks/moe.py
	$(BIN)/python benchmarks/explain_scale.py
	$(BIN)/python benchmarks/checkpoint_digest.py
	$(BIN)/python benchmarks/start_time.py

# GPU figures in one call of the lent GPU machine (benchmarks/gpu_check.sh says how): run there as
# `bash benchmarks/gpu_check.sh OUT` or `make gpu-check OUT=folder`; `--smoke` runs it on CPU here.
OUT ?= gpu-check-out
gpu-check:
	bash benchmarks/gpu_check.sh $(OUT)

# The wheels the GPU machine lacks (it has no network), for Python 3.12 on x86-64 Linux, in .whl/
# (ignored by git; carried to the machine): the transformers this project is tested on (the machine
# has 5.17; its other needs, tokenizers 0.23, huggingface-hub 1.x and safetensors 0.8, are there)
# and torchao for --float8 (abi3: any Python 3.10+).
WHEELHOUSE := .whl
GPU_WHEELS := transformers==5.24.0 torchao==0.18.0
wheelhouse:
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(WHEELHOUSE) $(GPU_WHEELS)
	@du -sh $(WHEELHOUSE) && ls $(WHEELHOUSE)

clean:
	rm -rf $(VENV) $(DEMO) *.egg-info .pytest_cache .mypy_cache .ruff_cache
