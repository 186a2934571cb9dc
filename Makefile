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

# --- LaMemo (Ji et al., NAACL 2022) and Transformer-XL ------------------------------------------
# SMOKE=1 runs on the fixtures, whose WikiText-103 has 61,056 word types and whose enwik8/text8
# zips are 30,000 bytes without official checksums: these overrides fit the data to them (`++`:
# a multirun over experiments first composes without them, where the keys do not exist).
LAMEMO_SMOKE_WT103 := ++data.vocab_size=61056 ++data.max_len=64 ++data.eval_max_len=64
LAMEMO_SMOKE_CHAR := ++data.sha256=null ++data.valid_size=3000 ++data.test_size=3000 \
	++data.max_len=64 ++data.eval_max_len=64
# Checkpoints for the Fig. 5 extrapolation (empty: train both models first).
LAMEMO_CKPT ?=
XL_CKPT ?=
# $(call best_ckpt,<runs folder>,<experiment>): the best checkpoint a run of <experiment> wrote.
best_ckpt = $(REPRO_PY) -c "import json, pathlib, sys; \
	runs = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).rglob('metrics.json'))]; \
	print(next(r['best_checkpoint'] for r in runs if r['experiment'] == sys.argv[2]))" "$(1)" "$(2)"

.PHONY: reproduce-lamemo-wt103 reproduce-lamemo-char reproduce-lamemo-ablations \
	reproduce-lamemo-extrapolation

reproduce-lamemo-wt103: ARGS += $(if $(SMOKE),$(LAMEMO_SMOKE_WT103))
reproduce-lamemo-wt103: $(REPRO_INSTALL) ## LaMemo Table 1: Transformer+RPE, XL, LaMemo on WikiText-103 x SEEDS (SMOKE=1)
	$(call reproduce,sweeps/lamemo_wt103.yaml,lamemo/table1_wt103)

reproduce-lamemo-char: ARGS += $(if $(SMOKE),$(LAMEMO_SMOKE_CHAR))
reproduce-lamemo-char: $(REPRO_INSTALL) ## LaMemo Table 2: the three models on text8 and enwik8 x SEEDS
	$(call reproduce,sweeps/lamemo_char.yaml,lamemo/table2_char)

reproduce-lamemo-ablations: ARGS += $(if $(SMOKE),$(LAMEMO_SMOKE_WT103))
reproduce-lamemo-ablations: $(REPRO_INSTALL) ## LaMemo Table 3: interpolation, look-ahead and RPE ablations
	$(call reproduce,sweeps/lamemo_ablations.yaml,lamemo/table3_ablation)

reproduce-lamemo-extrapolation: ARGS += $(if $(SMOKE),$(LAMEMO_SMOKE_WT103))
reproduce-lamemo-extrapolation: $(REPRO_INSTALL) ## LaMemo Fig. 5: test memory 64..640 (LAMEMO_CKPT=, XL_CKPT=; else trains both)
	@dir="$(REPRO_ROOT)/$@/$(REPRO_TIME)"; status=0; \
	lamemo="$(LAMEMO_CKPT)"; xl="$(XL_CKPT)"; \
	if [ -z "$$lamemo" ] || [ -z "$$xl" ]; then \
		$(REPRO_PY) -m megalab.sweep sweeps/lamemo_wt103.yaml --out "$$dir/train" --seeds 1 \
			$(if $(SMOKE),--smoke) --only experiment=lamemo/wikitext103,transformer_xl/wikitext103 \
			$(if $(TRAINER),trainer=$(TRAINER)) $(ARGS) || exit 1; \
		lamemo=$${lamemo:-$$($(call best_ckpt,$$dir/train,lamemo/wikitext103))}; \
		xl=$${xl:-$$($(call best_ckpt,$$dir/train,transformer_xl/wikitext103))}; \
	fi; \
	$(REPRO_PY) -m megalab.sweep sweeps/lamemo_extrapolation.yaml --out "$$dir" --seeds 1 \
		$(if $(SMOKE),--smoke) $(if $(TRAINER),trainer=$(TRAINER)) $(ARGS) "ckpt_path=$$lamemo" || status=1; \
	$(REPRO_PY) -m megalab.sweep sweeps/lamemo_extrapolation_xl.yaml --out "$$dir" --seeds 1 \
		$(if $(SMOKE),--smoke) $(if $(TRAINER),trainer=$(TRAINER)) $(ARGS) "ckpt_path=$$xl" || status=1; \
	$(REPRO_PY) -m megalab.tables "$$dir" --table lamemo/fig5_extrapolation || status=1; \
	echo "Runs, table.md and the plot: $$dir"; \
	exit $$status
