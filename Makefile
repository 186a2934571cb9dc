# megalab: `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Pin torch for the install step (CI uses TORCH=torch==2.13.0, a local CPU wheel). Empty:
# install torch only if it is not importable yet.
TORCH ?=
PYTEST_ARGS ?=
ARGS ?=

.PHONY: help install train test test-full lint format clean

help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  \033[36m%-26s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo ""
	@echo "Variables: TORCH=torch==<version> pins torch; ARGS='key=value ...' adds Hydra overrides."

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python ## Create .venv and install megalab with its dev tools
	@if [ -n "$(TORCH)" ]; then \
		$(BIN)/python -m pip install --quiet "$(TORCH)"; \
	elif ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		$(BIN)/python -m pip install --quiet torch; \
	fi
	$(BIN)/python -m pip install --quiet -e ".[dev]"

train: install ## Quick start: a small Transformer on short ListOps (CPU, a few minutes)
	$(BIN)/python -m megalab.train experiment=quickstart $(ARGS)

test: install ## Run the default test suite (excludes tests marked slow)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

test-full: install ## Run every test, including the slow ones
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install ## Check style with ruff
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: install ## Format the code with ruff
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks

clean: ## Remove caches and build artefacts (keeps .venv, data/ and logs/)
	rm -rf build dist .pytest_cache .ruff_cache src/*.egg-info
	find . -name __pycache__ -type d -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

# --- Reproducing the papers' tables ---------------------------------------------------------
