# megalab: `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Pin torch for the install step (CI uses TORCH=torch==2.13.0, a local CPU wheel). Empty:
# install torch only if it is not importable yet.
TORCH ?=
# The tested versions of every dependency (constraints.txt) for the install step; torch follows
# TORCH, or stays as installed. Empty: install the newest versions pyproject.toml allows.
CONSTRAINTS ?= constraints.txt
PYTEST_ARGS ?=
# `make test` and `make test-memory` run the tests in this many worker processes (pytest-xdist),
# each test file whole in one of them (`--dist loadfile`: a file's module fixtures are built once,
# its tests run in their order); 2 fits the 2-core CI machine (each worker peaks near 5 GB).
# TEST_WORKERS=0 runs them in the pytest process itself.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
ARGS ?=

.PHONY: help install train test test-full test-memory lint format clean

help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  \033[36m%-26s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo ""
	@echo "Variables: TORCH=torch==<version> pins torch; ARGS='key=value ...' adds Hydra overrides."

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python ## Create .venv and install megalab with its dev tools (versions of constraints.txt)
	@if [ -n "$(TORCH)" ]; then \
		$(BIN)/python -m pip install --quiet "$(TORCH)"; \
	elif ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		$(BIN)/python -m pip install --quiet $(if $(CONSTRAINTS),-c "$(CONSTRAINTS)") torch; \
	fi
	$(if $(CONSTRAINTS),grep -v '^torch==' "$(CONSTRAINTS)" > $(VENV)/constraints-but-torch.txt)
	$(BIN)/python -m pip install --quiet $(if $(CONSTRAINTS),-c $(VENV)/constraints-but-torch.txt) -e ".[dev]"

train: install ## Quick start: a small Transformer on short ListOps (CPU, a few minutes)
	$(BIN)/python -m megalab.cli.train experiment=quickstart $(ARGS)

test: install ## Run the default test suite (excludes tests marked slow)
	$(BIN)/python -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-full: install ## Run every test, including the slow ones
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-memory: install ## The default suite with each test's peak resident memory (fails past 6 GB; report in test-memory.json)
	MEGALAB_TEST_MEMORY=$(CURDIR)/test-memory.json $(BIN)/python -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

lint: install ## Check style with ruff and types with mypy (src/, every function annotated)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy src

format: install ## Format the code with ruff
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks

clean: ## Remove caches and build artefacts (keeps .venv, data/ and logs/)
	rm -rf build dist .pytest_cache .ruff_cache .mypy_cache src/*.egg-info
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

# $(call reproduce,<sweep files>,<paper tables to render>[,<overrides for every run>])
define reproduce
	@dir="$(REPRO_ROOT)/$@/$(REPRO_TIME)"; \
	$(REPRO_PY) -m megalab.cli.sweep $(1) --out "$$dir" --seeds "$(SEEDS)" $(if $(SMOKE),--smoke) \
		$(foreach o,$(ONLY),--only $(o)) $(if $(TRAINER),trainer=$(TRAINER)) $(ARGS) $(3); \
	status=$$?; \
	$(REPRO_PY) -m megalab.cli.tables "$$dir" $(foreach t,$(2),--table $(t)) || status=1; \
	echo "Runs, table.md and plots: $$dir"; \
	exit $$status
endef

.PHONY: reproduce-mega-lra reproduce-mega-ablations reproduce-mega-sc

reproduce-mega-lra: $(REPRO_INSTALL) ## Mega Table 2: Mega, Mega-chunk and the Transformer (XFM‡) on the 6 LRA tasks x SEEDS (SMOKE=1, TRAINER=)
	$(call reproduce,sweeps/mega_lra.yaml sweeps/mega_lra_pathx.yaml sweeps/transformer_lra.yaml,mega/table2_lra)

reproduce-mega-ablations: $(REPRO_INSTALL) ## Mega Fig. 4 + Table 3: chunk size, EMA dim, attention fn on LRA Text/Image
	$(call reproduce,$(MEGA_ABLATIONS),mega/fig4_chunk_size mega/fig4_ema_dim mega/table3_attention)

reproduce-mega-sc: $(REPRO_INSTALL) ## Mega Table 4: Mega-chunk base and big (and the XFM row's Transformer) on raw Speech Commands SC10 x SEEDS
	$(call reproduce,sweeps/mega_sc10.yaml sweeps/transformer_sc10.yaml,mega/table4_sc)

# --- Mega: translation, language modelling, ImageNet, and the summary (Tables 1, 5, 6, 7) ----
# SMOKE=1 settings where the paper's do not fit the fixture datasets (the tests' overrides,
# tests/test_experiments.py): a small padded dictionary and short beams for the WMT fixture,
# short LM segments, the ImageNet fixture's 3 classes (and, without timm, a plain transform).
# `++` for keys of one task only: a multirun composes the base config (no experiment) first.
MT_SMOKE = data.vocab_size=512 ++task.generation.max_len_b=30 ++task.val_generation.max_len_b=30
IMAGENET_SMOKE = data.num_classes=3 $(shell $(REPRO_PY) -c "import timm.data" 2>/dev/null \
	|| echo ++data.augment=basic ++data.mixup=0 ++data.cutmix=0)
LM_SMOKE = data.max_len=64 data.eval_max_len=64 data.train_len_unit=10
WT103_SMOKE = $(LM_SMOKE) data.vocab_size=61056
ENWIK8_SMOKE = $(LM_SMOKE) data.sha256=null data.valid_size=3000 data.test_size=3000
# Table 5 tests with longer attention chunks than training: WikiText-103 2048 in segments of 2
# chunks, enwik8 4096 in segments of 3 (--test-chunk-size 2048/4096 --chunk-nums 2/3).
WT103_TEST = $(if $(SMOKE),model.backbone.chunk_size=32 data.eval_max_len=64,model.backbone.chunk_size=2048 data.eval_max_len=4096)
ENWIK8_TEST = $(if $(SMOKE),model.backbone.chunk_size=32 data.eval_max_len=64,model.backbone.chunk_size=4096 data.eval_max_len=12288)
EVAL_SMOKE = trainer=cpu trainer.limit_test_batches=1 data.num_workers=0
MEGA_TARGETS := reproduce-mega-lra reproduce-mega-ablations reproduce-mega-sc reproduce-mega-lm \
	reproduce-mega-mt reproduce-mega-imagenet

# $(call reproduce_lm,<experiment>,<folder>,<smoke overrides>,<test overrides>): train, then test
# every run again with the paper's test chunk (megalab.cli.eval_runs -> <run>/eval_metrics.json).
define reproduce_lm
	$(REPRO_PY) -m megalab.cli.sweep sweeps/mega_lm.yaml --only experiment=$(1) --out "$$dir/$(2)" \
		--seeds "$(SEEDS)" $(if $(SMOKE),--smoke) $(if $(TRAINER),trainer=$(TRAINER)) $(ARGS) \
		$(if $(SMOKE),$(3)) || status=1; \
	$(REPRO_PY) -m megalab.cli.eval_runs "$$dir/$(2)" --experiment $(1) --name paper_test_chunk \
		$(4) $(if $(TRAINER),trainer=$(TRAINER)) $(if $(SMOKE),$(EVAL_SMOKE) \
		paths.data_dir="$$dir/$(2)/smoke_data") || status=1;
endef

.PHONY: reproduce-mega-mt reproduce-mega-lm reproduce-mega-imagenet reproduce-mega

reproduce-mega-mt: $(REPRO_INSTALL) ## Mega Table 6: Mega-softmax/laplace and Transformer-base on WMT'16 En<->De x SEEDS
	$(call reproduce,sweeps/mega_mt.yaml,mega/table6_wmt,$(if $(SMOKE),$(MT_SMOKE)))

reproduce-mega-lm: $(REPRO_INSTALL) ## Mega Table 5: WikiText-103 and enwik8, tested with the paper's longer chunks
	@dir="$(REPRO_ROOT)/$@/$(REPRO_TIME)"; status=0; \
	$(call reproduce_lm,mega/wikitext103,wikitext103,$(WT103_SMOKE),$(WT103_TEST)) \
	$(call reproduce_lm,mega/enwik8,enwik8,$(ENWIK8_SMOKE),$(ENWIK8_TEST)) \
	$(REPRO_PY) -m megalab.cli.tables "$$dir" --table mega/table5_lm || status=1; \
	echo "Runs, table.md and plots: $$dir"; \
	exit $$status

reproduce-mega-imagenet: $(REPRO_INSTALL) ## Mega Table 7: Mega-base and DeiT-B on ImageNet-1k
	$(call reproduce,sweeps/mega_imagenet.yaml,mega/table7_imagenet,$(if $(SMOKE),$(IMAGENET_SMOKE)))

# The line that runs $(MAKE) is run by `make -n` too (to print what the sub-makes would do): it
# holds nothing else, and a failed target leaves a marker that the last line turns into the status.
reproduce-mega: $(REPRO_INSTALL) ## Every Mega table (1-7, Fig. 4): all the targets above, then Table 1 over their runs
	@for t in $(MEGA_TARGETS); do \
		$(MAKE) --no-print-directory $$t REPRO_TIME=$(REPRO_TIME) REPRO_INSTALL= \
		|| { mkdir -p "$(REPRO_ROOT)/$@/$(REPRO_TIME)"; echo $$t >> "$(REPRO_ROOT)/$@/$(REPRO_TIME)/failed"; }; \
	done
	@dirs=$$(for t in $(MEGA_TARGETS); do echo "$(REPRO_ROOT)/$$t/$(REPRO_TIME)"; done); \
	mkdir -p "$(REPRO_ROOT)/$@/$(REPRO_TIME)"; \
	$(REPRO_PY) -m megalab.cli.tables $$dirs --table mega/table1_summary \
		--out "$(REPRO_ROOT)/$@/$(REPRO_TIME)" || echo tables >> "$(REPRO_ROOT)/$@/$(REPRO_TIME)/failed"
	@! test -e "$(REPRO_ROOT)/$@/$(REPRO_TIME)/failed" \
		|| { echo "failed: $$(cat "$(REPRO_ROOT)/$@/$(REPRO_TIME)/failed" | tr '\n' ' ')" >&2; exit 1; }

# --- Megalodon (Ma et al. 2024) ----------------------------------------------------------------
# The Mega rows of these tables come from the same targets (Mega's sweeps, or Mega's experiments
# inside the Megalodon sweep files).
MEGALODON_ABLATIONS := $(addprefix sweeps/megalodon_lra_,chunk_size.yaml cema_dim.yaml \
	norm_groups.yaml rope_base.yaml)

.PHONY: reproduce-megalodon-lra reproduce-megalodon-sc reproduce-megalodon-wt103 \
	reproduce-megalodon-pg19 reproduce-megalodon-imagenet reproduce-megalodon-ablations

reproduce-megalodon-lra: $(REPRO_INSTALL) ## Megalodon Table 6: Megalodon(-chunk) and Mega(-chunk) on the 6 LRA tasks
	$(call reproduce,sweeps/megalodon_lra.yaml sweeps/megalodon_lra_pathx.yaml sweeps/mega_lra.yaml sweeps/mega_lra_pathx.yaml,megalodon/table6_lra)

reproduce-megalodon-sc: $(REPRO_INSTALL) ## Megalodon Table 7: Megalodon and Mega (base, big) on raw SC10
	$(call reproduce,sweeps/megalodon_sc10.yaml sweeps/mega_sc10.yaml,megalodon/table7_sc)

# SMOKE=1: short LM segments on the fixtures, as Mega's Table 5 (`++`: Table 8's sweep runs two
# experiments in one multirun, see above); the 1.3B PG-19 model at a tiny width (its weights and
# Adam moments alone, 21 GB, do not fit a CPU; tests/test_experiments.py does the same).
PG19_SMOKE = $(LM_SMOKE) data.vocab_size=400 data.tokenizer_sample_books=null \
	model.d_model=64 model.backbone.num_layers=2 model.backbone.z_dim=32 model.backbone.v_dim=64 \
	model.backbone.ffn_dim=96 model.backbone.norm_groups=4 model.backbone.chunk_size=16

reproduce-megalodon-wt103: $(REPRO_INSTALL) ## Megalodon Table 8: Megalodon and Mega on WikiText-103
	$(call reproduce,sweeps/megalodon_wt103.yaml,megalodon/table8_wt103,$(if $(SMOKE),$(addprefix ++,$(WT103_SMOKE))))

reproduce-megalodon-pg19: $(REPRO_INSTALL) ## Megalodon Table 5: Megalodon-1.3B on PG-19 (word-level perplexity)
	$(call reproduce,sweeps/megalodon_pg19.yaml,megalodon/table5_pg19,$(if $(SMOKE),$(PG19_SMOKE)))

reproduce-megalodon-imagenet: $(REPRO_INSTALL) ## Megalodon Table 4: Megalodon, Mega and DeiT-B on ImageNet-1k
	$(call reproduce,sweeps/megalodon_imagenet.yaml,megalodon/table4_imagenet,$(if $(SMOKE),$(IMAGENET_SMOKE)))

reproduce-megalodon-ablations: $(REPRO_INSTALL) ## Megalodon chunk size, CEMA dim, norm groups, RoPE base on LRA Text/Image
	$(call reproduce,$(MEGALODON_ABLATIONS),)

# --- SeqBoat (Ren et al., NeurIPS 2023) ----------------------------------------------------
SEQBOAT_TABLE6 := seqboat/table6_train_speed seqboat/table6_train_memory seqboat/table6_eval_speed

.PHONY: reproduce-seqboat-lra reproduce-seqboat-ablations reproduce-seqboat-sc reproduce-seqboat-enwik8

# Tables 1 and 6 set SeqBoat beside Mega, Mega-chunk and the Transformer trained on the same
# machine: their efficiency columns are ratios to those runs (A.6: same hardware and batch size).
SEQBOAT_LRA_SWEEPS := sweeps/seqboat_lra.yaml sweeps/seqboat_lra_pathx.yaml sweeps/mega_lra.yaml \
	sweeps/mega_lra_pathx.yaml sweeps/transformer_lra.yaml

reproduce-seqboat-lra: $(REPRO_INSTALL) ## SeqBoat Tables 1 and 6: SeqBoat(-full), Mega(-chunk) and the Transformer on the 6 LRA tasks
	$(call reproduce,$(SEQBOAT_LRA_SWEEPS),seqboat/table1_lra $(SEQBOAT_TABLE6))

reproduce-seqboat-ablations: $(REPRO_INSTALL) ## SeqBoat Tables 7-8 + Fig. 5: ablations, working-memory size, router temperature
	$(call reproduce,sweeps/seqboat_ablations.yaml sweeps/seqboat_memory_size.yaml sweeps/seqboat_temperature.yaml,seqboat/table7_ablations_full seqboat/table8_ablations)

reproduce-seqboat-sc: $(REPRO_INSTALL) ## SeqBoat Table 2: SeqBoat and Mega-chunk on raw Speech Commands SC10 x SEEDS
	$(call reproduce,sweeps/seqboat_sc10.yaml,seqboat/table2_sc)

# SMOKE=1 fits the runs to the 30,000-byte enwik8 fixture (no official checksum, 64-byte
# segments); `++` because the multirun composes the base config, without enwik8's keys, first.
SEQBOAT_ENWIK8_SMOKE := $(addprefix ++,$(ENWIK8_SMOKE))

reproduce-seqboat-enwik8: $(REPRO_INSTALL) ## SeqBoat Table 3: SeqBoat and Mega on enwik8 (8 GPUs per run)
	$(call reproduce,sweeps/seqboat_enwik8.yaml,seqboat/table3_lm,$(if $(SMOKE),$(SEQBOAT_ENWIK8_SMOKE)))

# --- LaMemo (Ji et al., NAACL 2022) and Transformer-XL ------------------------------------------
# SMOKE=1 runs on the fixtures, whose WikiText-103 has 61,056 word types and whose enwik8/text8
# zips are 30,000 bytes without official checksums: these overrides fit the data to them (`++`:
# a multirun over experiments first composes without them, where the keys do not exist).
LAMEMO_SMOKE_WT103 := ++data.vocab_size=61056 ++data.max_len=64 ++data.eval_max_len=64
LAMEMO_SMOKE_CHAR := ++data.sha256=null ++data.valid_size=3000 ++data.test_size=3000 \
	++data.max_len=64 ++data.eval_max_len=64
# Fig. 5's tests on the fixture: six batches of two segments, so that the memory length changes
# the numbers (the first segment of a stream has no memory: with one batch every point is equal).
LAMEMO_SMOKE_FIG5 := trainer.limit_test_batches=6 data.eval_batch_size=2
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
		$(REPRO_PY) -m megalab.cli.sweep sweeps/lamemo_wt103.yaml --out "$$dir/train" --seeds 1 \
			$(if $(SMOKE),--smoke) --only experiment=lamemo/wikitext103,transformer_xl/wikitext103 \
			$(if $(TRAINER),trainer=$(TRAINER)) $(ARGS) || exit 1; \
		lamemo=$${lamemo:-$$($(call best_ckpt,$$dir/train,lamemo/wikitext103))}; \
		xl=$${xl:-$$($(call best_ckpt,$$dir/train,transformer_xl/wikitext103))}; \
	fi; \
	$(REPRO_PY) -m megalab.cli.sweep sweeps/lamemo_extrapolation.yaml --out "$$dir" --seeds 1 \
		$(if $(SMOKE),--smoke) $(if $(TRAINER),trainer=$(TRAINER)) $(ARGS) "ckpt_path=$$lamemo" \
		$(if $(SMOKE),$(LAMEMO_SMOKE_FIG5)) || status=1; \
	$(REPRO_PY) -m megalab.cli.sweep sweeps/lamemo_extrapolation_xl.yaml --out "$$dir" --seeds 1 \
		$(if $(SMOKE),--smoke) $(if $(TRAINER),trainer=$(TRAINER)) $(ARGS) "ckpt_path=$$xl" \
		$(if $(SMOKE),$(LAMEMO_SMOKE_FIG5)) || status=1; \
	$(REPRO_PY) -m megalab.cli.tables "$$dir" --table lamemo/fig5_extrapolation || status=1; \
	echo "Runs, table.md and the plot: $$dir"; \
	exit $$status

# --- Benchmarks -------------------------------------------------------------------------------
# Rotated rounds in one process, medians with min-max (benchmarks/bench_mega.py docstring); the
# JSON is kept under benchmarks/results/ and its tables replace the generated block of
# docs/benchmarks.md. The quick default takes minutes on an idle 2-core machine; FULL=1 adds 16K
# tokens per sequence and runs 7 rounds. ARGS= passes options to bench_mega.py (e.g.
# ARGS="--sections layer --update" re-measures one section).
BENCH_JSON ?= benchmarks/results/bench_mega.json

.PHONY: bench

bench: $(REPRO_INSTALL) ## Run the Mega benchmark suite (FULL=1: all lengths) and write docs/benchmarks.md tables from its JSON
	$(REPRO_PY) benchmarks/bench_mega.py $(if $(FULL),--full) --json $(BENCH_JSON) $(ARGS)
	$(REPRO_PY) benchmarks/report.py $(BENCH_JSON) docs/benchmarks.md

# --- Megalodon vs Llama at ~100M parameters (Megalodon Fig. 1 and Fig. 4 in miniature) --------
# The two models at equal parameters (108.5M / 109.5M), tokens (2.6B) and recipe on PG-19, at 4K
# and 32K context (sweeps/megalodon_vs_llama.yaml), one seed by default; then the Fig. 4 ratios
# (tables/megalodon/fig4_throughput.yaml) and the loss curves beside the tokens/s
# (megalab.cli.curves: curves.png, curves.md). SMOKE=1: the PG-19 fixture (400-token vocabulary),
# windows of 64 tokens for the 4K pair and 512 for the 32K pair (the same 8x), 2 CPU steps, and
# both models shrunk alike to 2 layers of width 64 (the ~100M ones take minutes per CPU step):
# Megalodon with the presets' ratios (z = D/4, v = 2D, SwiGLU 1.5 D, 32 channels per norm group)
# and a 64-token chunk (one chunk at the 4K pair's window, eight at the 32K pair's, as 4,096 at
# 4K and 32K), Llama with 4 heads of 16 and a SwiGLU of 3 D (layers of 106,272 / 106,816
# parameters). About 2 minutes on 2 CPU cores (4 runs of ~30 s, mostly start-up).
VS_LLAMA_SMOKE := ++data.vocab_size=400 ++data.tokenizer_sample_books=null \
	++model.d_model=64 ++model.backbone.num_layers=2
VS_LLAMA_SMOKE_megalodon := ++model.backbone.z_dim=16 ++model.backbone.v_dim=128 \
	++model.backbone.ffn_dim=96 ++model.backbone.norm_groups=2 ++model.backbone.chunk_size=64
VS_LLAMA_SMOKE_llama := ++model.backbone.num_heads=4 ++model.backbone.ffn_dim=192
VS_LLAMA_ctx4k := megalodon/pg19_100m llama/pg19
VS_LLAMA_ctx32k := megalodon/pg19_100m_32k llama/pg19_32k
# $(call vs_llama,<ctx4k|ctx32k: the pair and its folder>,<smoke window>): one sweep per model
# (into <folder>/<megalodon|llama>), each with its model's SMOKE=1 sizes
define vs_llama
	$(foreach e,$(VS_LLAMA_$(1)),$(REPRO_PY) -m megalab.cli.sweep sweeps/megalodon_vs_llama.yaml \
		--only experiment=$(e) --out "$$dir/$(1)/$(firstword $(subst /, ,$(e)))" --seeds "$(SEEDS)" \
		$(if $(SMOKE),--smoke) $(if $(TRAINER),trainer=$(TRAINER)) $(ARGS) \
		$(if $(SMOKE),$(VS_LLAMA_SMOKE) $(VS_LLAMA_SMOKE_$(firstword $(subst /, ,$(e)))) \
		++data.max_len=$(2) ++data.eval_max_len=$(2)) || status=1;)
endef

.PHONY: reproduce-megalodon-vs-llama

reproduce-megalodon-vs-llama: SEEDS = 1
reproduce-megalodon-vs-llama: $(REPRO_INSTALL) ## Megalodon Fig. 1 + 4 in miniature: Megalodon vs Llama (~100M) on PG-19 at 4K and 32K, loss curves and tokens/s (SMOKE=1: ~2 min)
	@dir="$(REPRO_ROOT)/$@/$(REPRO_TIME)"; status=0; \
	$(call vs_llama,ctx4k,64) \
	$(call vs_llama,ctx32k,512) \
	$(REPRO_PY) -m megalab.cli.tables "$$dir" --table megalodon/fig4_throughput || status=1; \
	$(REPRO_PY) -m megalab.cli.curves "$$dir" || status=1; \
	echo "Runs, table.md, curves.md and curves.png: $$dir"; \
	exit $$status

# --- One CUDA machine: correctness and speed in one command (docs/gpu.md) ---------------------
# `make gpu-check` on a machine with CUDA PyTorch: (1) with WHEELS=<dir>, installs megalab's
# pure-Python dependencies from that folder without network (`make gpu-wheels` fills it on a
# machine with PyPI) and megalab itself over the image's torch; then runs the GPU tests, the
# golden tests on CUDA, the Triton kernels' tests compiled, two training steps per model and
# trainer, and benchmarks/bench_gpu.py, each part time-boxed (benchmarks/gpu_check.py), into
# benchmarks/results/gpu_check.{json,md}. GPU_PYTHON: the image's interpreter (with its torch).
WHEELS ?=
GPU_PYTHON ?= python3
GPU_WHEELS_DIR ?= gpu-wheels
GPU_WHEELS_PYTHON ?= 3.12

.PHONY: gpu-check gpu-wheels

gpu-check: ## On a CUDA machine: GPU tests, golden on CUDA, compiled kernels, trainer runs, bench_gpu (< 8 min; WHEELS=dir installs offline)
	@if [ -n "$(WHEELS)" ]; then \
		set -e; \
		$(GPU_PYTHON) -m pip install --quiet --no-index --find-links "$(WHEELS)" \
			$$([ -f "$(WHEELS)/constraints.txt" ] && echo -c "$(WHEELS)/constraints.txt") \
			$$($(GPU_PYTHON) benchmarks/gpu_check.py --requirements); \
		$(GPU_PYTHON) -m pip install --quiet --no-index --find-links "$(WHEELS)" --no-deps -e .; \
	fi
	$(GPU_PYTHON) benchmarks/gpu_check.py $(ARGS)

gpu-wheels: ## Download the wheels gpu-check WHEELS= installs (GPU_WHEELS_DIR, Python 3.12 manylinux x86-64; no torch/NVIDIA)
	$(PYTHON) benchmarks/gpu_check.py --download-wheels $(GPU_WHEELS_DIR) \
		--python-version $(GPU_WHEELS_PYTHON)
