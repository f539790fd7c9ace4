# One command per habit; CI (.ci/run) runs the same ones.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install run test test-fast bench lint models browser-deps clean

# torch is installed first and pinned to the CPU wheel, so nothing pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/uvicorn app.main:app --host $(HOST) --port $(PORT)

# Debian's chromium for the Playwright browser tests (playwright cannot download browsers here).
browser-deps:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core; \
	  else echo "browser tests need Debian's chromium: sudo apt-get install chromium"; fi; fi

test: install browser-deps
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not browser"

bench: install
	$(BIN)/python -m bench

lint: install
	$(BIN)/ruff check circuits_core app tests bench
	$(BIN)/mypy

models: install
	$(BIN)/python -m circuits_core.training all --out checkpoints

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache artifacts
