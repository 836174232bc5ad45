# The README's two commands: `make train` (the default CPU job) and `make test` (the test suite).
# Both create .venv and install everything on first use.
PYTHON ?= python3
VENV ?= .venv
# Install torch before the project so pip never swaps in another build. On a CPU-only machine
# without a local wheel, a smaller CPU build: make train TORCH_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
TORCH_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test test-quick lint format bench-samplers bench-throughput bench-timing bench-sweep bench-data bench-chat-tokenize bench-memory-plan bench-evaluation bench-strategies bench-dpo-reference bench-dpo-parity gpu-check clean

setup: $(STAMP)

# torch goes through pip, which honours this machine's pip configuration (a local wheel, an index). The rest through
# uv, 64 s where pip took 115 s for a fresh venv on 2 cores (docs/suite_timings.md); uv leaves the installed torch alone.
# uv reads no pip.conf (a private index goes in UV_INDEX_URL): where uv cannot be had or cannot install, pip does.
# Bytecode is compiled at install as pip does: with PYTHONDONTWRITEBYTECODE set, every process would compile what it
# imports again. That is most of the install's time (measured 60-90 s with it, 26 s without): COMPILE_BYTECODE=no
# skips it, for a run that lets Python write the bytecode of what it imports (.ci/run).
COMPILE_BYTECODE ?= yes
UV_BYTECODE := $(if $(filter no,$(COMPILE_BYTECODE)),,--compile-bytecode)
PIP_BYTECODE := $(if $(filter no,$(COMPILE_BYTECODE)),--no-compile,)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(PIP_BYTECODE) "$(TORCH)" $(TORCH_ARGS)
	if ! { $(BIN)/python -m pip install -q uv && \
		$(BIN)/uv pip install -q $(UV_BYTECODE) --python $(BIN)/python -e ".[dev]"; }; then \
		echo "make setup: uv could not install the project; pip installs it instead"; \
		$(BIN)/python -m pip install -q $(PIP_BYTECODE) -e ".[dev]"; \
	fi
	touch $(STAMP)

train: setup  ## the default job: tiny Qwen2 + bundled data, 2 CPU processes
	$(BIN)/ddptrain train $(ARGS)

# Two pytest workers (pytest-xdist): the 2-rank tests run in turn on one, the rest beside them on the other
# (tests/conftest.py, BESIDE_THE_RANKS). TEST_WORKERS=0 runs everything in one process, one test after another.
TEST_WORKERS ?= 2

test: setup  ## the whole suite: unit, 2-process gloo, end-to-end
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-quick: setup  ## the inner loop: the unit tests only (about a minute on 2 cores)
	$(BIN)/python -m pytest tests/unit -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench-samplers: setup
	$(BIN)/python -m ddptrain.bench.samplers --data ../shared/data/alpaca/alpaca_data_52k.jsonl \
		--tokenizer ../shared/data/tokenizers/qwen2 --world-size 4 --micro-batch-size 8

bench-throughput: setup
	$(BIN)/python -m ddptrain.bench.throughput --data ../shared/data/alpaca/alpaca_data_52k.jsonl \
		--tokenizer ../shared/data/tokenizers/qwen2 --repeats 2

bench-timing: setup  ## what trainer.timing costs: the same job timed and untimed, interleaved
	$(BIN)/python -m ddptrain.bench.throughput --data ../shared/data/alpaca/alpaca_data_52k.jsonl \
		--tokenizer ../shared/data/tokenizers/qwen2 --steps 30 --warmup 5 --repeats 4 \
		--variants ddptrain:length_grouped,untimed:length_grouped

bench-sweep: setup  ## a 2-job sweep one job after another vs hydra/launcher=parallel, interleaved
	$(BIN)/python -m ddptrain.bench.sweep --repeats 3 --steps 300

bench-data: setup
	$(BIN)/python -m ddptrain.bench.data_prep --data ../shared/data/alpaca/alpaca_data_52k.jsonl \
		--tokenizer ../shared/data/tokenizers/qwen2 --num-proc 1 2

bench-chat-tokenize: setup  ## conversations: the tokenizer's chat template against ChatML pieces
	$(BIN)/python -m ddptrain.bench.chat_tokenize --data ../shared/data/alpaca/alpaca_data_52k.jsonl \
		--tokenizer ../shared/data/tokenizers/qwen2 --rows 10000

bench-memory-plan: setup  ## the memory plan: Qwen2.5-7B / 0.5B predictions, and predicted vs measured on this CPU
	$(BIN)/python -m ddptrain.bench.memory_plan
	$(BIN)/python -m ddptrain.bench.memory_plan --cpu-check
	$(BIN)/python -m ddptrain.bench.memory_plan --presets

bench-dpo-reference: setup  ## DPO: the adapter-off reference in every step vs one precomputed before training
	$(BIN)/python -m ddptrain.bench.dpo_reference --repeats 3 --steps 40 --warmup 5

bench-dpo-parity: setup  ## DPO: ddptrain and TRL's DPOTrainer on the same pairs, losses and s/step (trl: dev extra)
	$(BIN)/python -m ddptrain.bench.dpo_parity --model small --steps 10

bench-evaluation: setup  ## eval on 1 rank vs 2 (the same loss), what the save check costs a save and a run
	$(BIN)/python -m ddptrain.bench.evaluation --data ../shared/data/alpaca/alpaca_data_52k.jsonl
	$(BIN)/python -m ddptrain.bench.save_check

bench-strategies: setup  ## parallel.strategy=fsdp2 against ddp on 2 CPU ranks: tokens/s, peak memory per rank, bytes
	$(BIN)/python -m ddptrain.bench.strategies --repeats 3

gpu-check: setup  ## tests/gpu and the GPU benchmark in tiers by GPU count, one table (1 GPU: < 8 min); no GPU: lists them
	$(BIN)/python scripts/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
