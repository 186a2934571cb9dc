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
# Each target runs its sweep files offline (megalab-sweep: Hydra multiruns, no W&B server) into
# $(REPRO_ROOT)/<target>/<time>/, then prints the paper-vs-ours table and writes it there as
# table.md, with the sweep plots. Variables:
#   SEEDS=5 | SEEDS=1,2,7    number of seeds (1..N) or a list; empty: the sweep file's own
#                            (default 5, or 1 with SMOKE=1)
#   SMOKE=1                  2 CPU steps per run on the fixture datasets (megalab-data smoke)
#   TRAINER=gpu|ddp|cpu      trainer config for every run (default: each experiment's own)
#   ONLY='experiment=mega/lra_listops,mega/lra_text'   restrict a swept parameter
#   ARGS='key=value ...'     extra Hydra overrides for every run
#   REPRO_INSTALL=           skip the install step (use the current .venv as it is)
SEEDS ?= $(if $(SMOKE),1,5)
SMOKE ?=
TRAINER ?=
ONLY ?=
REPRO_ROOT ?= logs/reproduce
REPRO_INSTALL ?= install
REPRO_TIME := $(shell date +%Y-%m-%d_%H-%M-%S)
REPRO_PY = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
MEGA_ABLATIONS := $(addprefix sweeps/mega_lra_,text_chunk_size.yaml image_chunk_size.yaml \
	text_ema_dim.yaml image_ema_dim.yaml text_attention.yaml image_attention.yaml)

# $(call reproduce,<sweep files>,<paper tables to render>)
define reproduce
	@dir="$(REPRO_ROOT)/$@/$(REPRO_TIME)"; \
	$(REPRO_PY) -m megalab.sweep $(1) --out "$$dir" --seeds "$(SEEDS)" $(if $(SMOKE),--smoke) \
		$(foreach o,$(ONLY),--only $(o)) $(if $(TRAINER),trainer=$(TRAINER)) $(ARGS); \
	status=$$?; \
	$(REPRO_PY) -m megalab.tables "$$dir" $(foreach t,$(2),--table $(t)) || status=1; \
	echo "Runs, table.md and plots: $$dir"; \
	exit $$status
endef

.PHONY: reproduce-mega-lra reproduce-mega-ablations reproduce-mega-sc

reproduce-mega-lra: $(REPRO_INSTALL) ## Mega Table 2: Mega and Mega-chunk on the 6 LRA tasks x SEEDS (SMOKE=1, TRAINER=)
	$(call reproduce,sweeps/mega_lra.yaml sweeps/mega_lra_pathx.yaml,mega/table2_lra)

reproduce-mega-ablations: $(REPRO_INSTALL) ## Mega Fig. 4 + Table 3: chunk size, EMA dim, attention fn on LRA Text/Image
	$(call reproduce,$(MEGA_ABLATIONS),mega/fig4_chunk_size mega/fig4_ema_dim mega/table3_attention)

reproduce-mega-sc: $(REPRO_INSTALL) ## Mega Table 4: Mega-chunk base and big on raw Speech Commands SC10 x SEEDS
	$(call reproduce,sweeps/mega_sc10.yaml,mega/table4_sc)

# --- SeqBoat (Ren et al., NeurIPS 2023) ----------------------------------------------------
SEQBOAT_TABLE6 := seqboat/table6_train_speed seqboat/table6_train_memory seqboat/table6_eval_speed

.PHONY: reproduce-seqboat-lra reproduce-seqboat-ablations reproduce-seqboat-sc reproduce-seqboat-enwik8

reproduce-seqboat-lra: $(REPRO_INSTALL) ## SeqBoat Table 1 (+ Table 6 efficiency): SeqBoat and SeqBoat-full on the 6 LRA tasks
	$(call reproduce,sweeps/seqboat_lra.yaml sweeps/seqboat_lra_pathx.yaml,seqboat/table1_lra $(SEQBOAT_TABLE6))

reproduce-seqboat-ablations: $(REPRO_INSTALL) ## SeqBoat Tables 7-8 + Fig. 5: ablations, working-memory size, router temperature
	$(call reproduce,sweeps/seqboat_ablations.yaml sweeps/seqboat_memory_size.yaml sweeps/seqboat_temperature.yaml,seqboat/table7_ablations_full seqboat/table8_ablations)

reproduce-seqboat-sc: $(REPRO_INSTALL) ## SeqBoat Table 2: SeqBoat and Mega-chunk on raw Speech Commands SC10 x SEEDS
	$(call reproduce,sweeps/seqboat_sc10.yaml,seqboat/table2_sc)

reproduce-seqboat-enwik8: $(REPRO_INSTALL) ## SeqBoat Table 3: SeqBoat and Mega on enwik8 (8 GPUs per run)
	$(call reproduce,sweeps/seqboat_enwik8.yaml,seqboat/table3_lm)
