"""Every experiment config composes and trains for two steps on fixture data.

New files under `configs/experiment/` are picked up automatically. Fixture datasets are tiny,
so a few data-dependent sizes are overridden per data config (`FIXTURE_OVERRIDES`); model
and optimisation settings stay exactly as the experiment defines them. An experiment that sets
`requires_cuda: true` trains here on a CUDA machine only (`GPU_ONLY`).
"""

from __future__ import annotations

from typing import Any

import hydra
import pytest
import yaml
from hydra.core.hydra_config import HydraConfig

from conftest import CONFIG_DIR
from megalab.cli.train import train

EXPERIMENTS = sorted(
    p.relative_to(CONFIG_DIR / "experiment").with_suffix("").as_posix()
    for p in (CONFIG_DIR / "experiment").rglob("*.yaml")
)


def declared(name: str, key: str) -> Any:
    """Top-level `key` of experiment `name` as composing it gives it (None when unset), read from
    its file and the experiments it extends (`- /experiment/...` in its defaults) without
    composing: collection stays fast. The tests below check it against the composed config."""
    spec = yaml.safe_load((CONFIG_DIR / "experiment" / f"{name}.yaml").read_text()) or {}
    if key in spec:
        return spec[key]
    for entry in reversed(spec.get("defaults", [])):
        if isinstance(entry, str) and entry.startswith("/experiment/"):
            value = declared(entry.removeprefix("/experiment/"), key)
            if value is not None:
                return value
    return None


def _has_timm() -> bool:
    """Whether timm (and the torchvision it needs) imports."""
    try:
        import timm.data  # noqa: F401
    except Exception:
        return False
    return True


# Per data config: overrides that fit the experiment to its fixture. Every experiment also gets
# a small batch: 4 per optimizer step and accumulation step (see `fixture_overrides`).
FIXTURE_OVERRIDES: dict[str, list[str]] = {}

# Experiments whose two steps take more than ~20 s on 2 CPU cores (full attention over 16K
# pixels, 100M+ parameter models): they still compose and instantiate in the default suite,
# and train in `make test-full`.
HEAVY: set[str] = set()
# Mega-base ImageNet (90.7M parameters, 12 layers over 196 patches): ~2 min for two steps.
HEAVY |= {"mega/imagenet"}

# Speech Commands and ImageNet (tests/fixtures/{speech_commands,imagenet}.py): SC10 clips are
# subsampled 16x (1000 steps: one Mega chunk; 16,000 samples take minutes per CPU step); the
# ImageNet fixture has 3 classes; timm (the `vision` extra) is optional, so without it the DeiT
# recipe is swapped for the PIL-only training transform (tests/data/test_imagenet.py covers it).
FIXTURE_OVERRIDES["sc10"] = ["data.resolution=16", "data.max_len=1000"]
FIXTURE_OVERRIDES["imagenet"] = ["data.num_classes=3"] + (
    [] if _has_timm() else ["data.augment=basic", "data.mixup=0", "data.cutmix=0"]
)
# DeiT-B has 86M parameters.
HEAVY |= {"transformer/imagenet"}

# Language modelling (tests/fixtures/lm.py): 30,000-byte enwik8/text8 zips split 24K/3K/3K, a
# WikiText-103 fixture with 61,056 word types (so Mega's adaptive cutoffs 20000/60000 fit) and a
# PG-19 tokenizer trained to at most 400 tokens; 64-token segments (Mega's variable blocks: 20 to
# 60 tokens), and no official checksums for the fixture zips.
_LM_SHORT = ["data.max_len=64", "data.eval_max_len=64", "data.train_len_unit=10"]
_CHAR_FIXTURE = ["data.sha256=null", "data.valid_size=3000", "data.test_size=3000"]
FIXTURE_OVERRIDES["enwik8"] = [*_LM_SHORT, *_CHAR_FIXTURE]
FIXTURE_OVERRIDES["text8"] = [*_LM_SHORT, *_CHAR_FIXTURE]
FIXTURE_OVERRIDES["wikitext103"] = [*_LM_SHORT, "data.vocab_size=61056"]
FIXTURE_OVERRIDES["pg19"] = [*_LM_SHORT, "data.vocab_size=400", "data.tokenizer_sample_books=null"]
# Mega on WikiText-103 has 252M parameters (~200M in its 16 layers whatever the vocabulary), the
# PG-19 Transformer 110M (85M in its layers: GPT-2 small's shape, like DeiT-B above).
HEAVY |= {"mega/wikitext103", "transformer/pg19"}
# The ~100M Llama on PG-19 (85M in its 12 layers, like the PG-19 Transformer).
HEAVY |= {"llama/pg19"}
# Megalodon vs Llama at ~100M (make reproduce-megalodon-vs-llama): the 32K Llama and the
# 84M-layer Megalodon at both contexts (30-40 s for two CPU steps each).
HEAVY |= {"llama/pg19_32k", "megalodon/pg19_100m", "megalodon/pg19_100m_32k"}

# LRA (tests/fixtures/lra_*.py): the Text and Retrieval fixtures hold one document longer than
# 4000 bytes (to test truncation); 512 tokens keep full attention over a fixture batch cheap.
FIXTURE_OVERRIDES["lra_text"] = ["data.max_len=512"]
FIXTURE_OVERRIDES["lra_retrieval"] = ["data.max_len=512"]
# Path-X: attention over 16,384 pixels materialises (B, heads, 16K, 16K) scores on a CPU (4096²
# per chunk for Mega-chunk: 80 s and ~5 GB per example for one step)
# (a Transformer fixture step at batch 4 went past 20 GB and was killed), and SeqBoat's 6 layers
# (look-around blocks of 3 x 256 keys, or full attention over the activated half for
# SeqBoat-full) do not fit a CPU fixture step either. Such an experiment declares
# `requires_cuda: true` (every Path-X run does): it trains in the slow suite on a CUDA machine
# only, and is instantiated everywhere.
GPU_ONLY: set[str] = {n for n in EXPERIMENTS if declared(n, "requires_cuda")}
HEAVY |= GPU_ONLY
# The 30 SeqBoat ablations (Tables 7-8) change one to three backbone keys of seqboat/lra_image,
# lra_listops and lra_pathfinder, which train in the default suite; each variant's code path
# trains in tests/models/seqboat/test_seqboat.py. The variants compose and instantiate in the
# default suite and train in the slow suite (ListOps about 1 s of CPU each; Image 4 to 40 s:
# SeqBoat-full always active over 1,024 pixels is the slowest), which keeps the default suite
# within its time budget.
HEAVY |= {n for n in EXPERIMENTS if n.startswith("seqboat_ablation/")}
# SeqBoat on enwik8 (Table 5: 14 layers at D = 616, 39M parameters over 8,192-token blocks):
# about 2 minutes for two CPU steps.
HEAVY |= {"seqboat/enwik8"}
# The Transformer on ListOps: full attention over 2,002 tokens at the fixture batch of 4. The
# memory plan's bound from 512 tokens does not fit there, so it measures the step at full length
# (up to 6.9 GB resident while probing) and trains in micro-batches where memory is short: 44 s
# in all on 2 shared cores, twice the next slowest of the default suite.
HEAVY |= {"transformer/lra_listops"}
# Mega with full attention over CIFAR's 1,024 pixels (~20 s for two steps here, the slowest LRA
# experiment of the default suite): Mega-chunk's Image experiment trains the same pipeline there.
HEAVY |= {"mega/lra_image"}

# WMT'16 En-De (megalab/testing/wmt.py): 160 training pairs, whose BPE and dictionary cover a
# few dozen subwords; the dictionary is padded to data.vocab_size, 512 here instead of 33,000.
# Fixture sentences have at most 22 subwords: beam search stops at 30 output tokens instead of
# fairseq's 200 (an untrained model never ends a sentence, and each step runs 6 decoder layers
# of Mega-base). The variants of the two base experiments (Mega-laplace, German->English, the
# big arch) train in the slow suite.
FIXTURE_OVERRIDES["wmt16_en_de"] = [
    "data.vocab_size=512",
    "task.generation.max_len_b=30",
    "task.val_generation.max_len_b=30",
]
# Mega-base En-De itself (6 + 6 layers, ~20 s for two steps here) too: Mega's translation model
# trains in the default suite through docs/translation.md (tests/test_docs_commands.py, one layer
# each side) and the Transformer's En-De experiment.
HEAVY |= {
    "mega/wmt16_en_de",
    "mega/wmt16_en_de_laplace",
    "mega/wmt16_de_en",
    "mega/wmt16_de_en_laplace",
    "mega/wmt16_en_de_big",
    "transformer/wmt16_de_en",
}


# Megalodon (Ma et al. 2024): ImageNet (83M) and WikiText-103 (252M) train in the slow suite
# like Mega's; Path-X (16,384 pixels) on a GPU only. The 1.3B PG-19 model and the 7B
# pretraining recipe do not fit a 2-step CPU run (weights, gradients and Adam moments: 21 GB and
# 118 GB): they train at a tiny width (`EXPERIMENT_OVERRIDES`, same recipe otherwise), and
# their presets' parameter counts are checked on the meta device
# (tests/models/megalodon/test_megalodon.py).
HEAVY |= {"megalodon/imagenet", "megalodon/wikitext103"}
_MEGALODON_TINY = [
    "model.d_model=64",
    "model.backbone.num_layers=2",
    "model.backbone.z_dim=32",
    "model.backbone.v_dim=64",
    "model.backbone.ffn_dim=96",
    "model.backbone.norm_groups=4",
    "model.backbone.chunk_size=16",
]
EXPERIMENT_OVERRIDES: dict[str, list[str]] = {
    "megalodon/pg19": _MEGALODON_TINY,
    "megalodon/pretrain_7b": _MEGALODON_TINY,
}
# Transformer-XL / LaMemo (151M on WikiText-103, 41M on characters, 16-26 s each for two steps
# here): one per model family trains in the default suite, the others in the slow one.
HEAVY |= {
    "lamemo/wikitext103",
    "lamemo/wikitext103_no_interpolation",
    "lamemo/wikitext103_no_look_ahead",
    "lamemo/wikitext103_xl_rpe",
    "lamemo/text8",
    "transformer_xl/wikitext103",
    "transformer_xl/wikitext103_base",
    "transformer_xl/enwik8",
    "transformer_xl/enwik8_base",
    "transformer_rpe/wikitext103",
    "transformer_rpe/text8",
}

# Per experiment: sizes only the fixture forces. Transformer-XL's own WikiText-103 softmax
# splits at 200,000 words, beyond the fixture's 61,056 types.
EXPERIMENT_OVERRIDES |= {
    "transformer_xl/wikitext103_base": ["model.encoder.cutoffs=[20000,40000,60000]"],
}
# Transformer-XL large (285M parameters, 245M in its 18 layers of width 1024): slow suite.
HEAVY |= {"transformer_xl/wt103_large"}
EXPERIMENT_OVERRIDES |= {
    "transformer_xl/wt103_large": ["model.encoder.cutoffs=[20000,40000,60000]"],
}


def test_experiments_exist() -> None:
    assert "quickstart" in EXPERIMENTS
    assert {"mega/lra_pathx", "mega_chunk/lra_pathx"} <= GPU_ONLY  # set, and inherited


def fixture_overrides(compose_cfg, name: str) -> list[str]:
    """Overrides that fit experiment `name` to the fixtures: its data config's entry and a batch
    of 4 per accumulation step (paper configs accumulate up to 8 micro-batches)."""
    cfg = compose_cfg(f"experiment={name}")
    data = HydraConfig.get().runtime.choices["data"]
    batch = 4 * int(cfg.trainer.get("accumulate_grad_batches") or 1)
    return [
        f"data.batch_size={batch}",
        "data.eval_batch_size=4",
        *FIXTURE_OVERRIDES.get(data, []),
        *EXPERIMENT_OVERRIDES.get(name, []),
    ]


# The default suite's time budget (10 minutes on 2 cores): variants whose code and data paths
# another experiment of the default suite trains already run in the slow suite. Mega-chunk,
# Megalodon-chunk and SeqBoat-full differ from their base model's experiments by backbone keys
# only: ListOps (and Mega-chunk's Image, Mega's own being slow) stay; every LRA task still trains
# with the base models. S4D's Image and Pathfinder share its ListOps/Text/Retrieval code and the
# other models' pixel pipelines. The Transformer baselines' character-level runs share the
# Transformer with its WikiText-103 run and the enwik8/text8 pipelines with Mega, LaMemo and
# Transformer-XL. Mega's SC10-big is SC10-base's model, wider.
HEAVY |= {
    *(f"mega_chunk/lra_{t}" for t in ("pathfinder", "retrieval", "text")),
    *(f"megalodon_chunk/lra_{t}" for t in ("image", "pathfinder", "retrieval", "text")),
    *(f"seqboat_full/lra_{t}" for t in ("image", "pathfinder", "retrieval", "text")),
    "s4d/lra_image",
    "s4d/lra_pathfinder",
    "transformer/enwik8",
    "transformer/text8",
    "transformer_rpe/enwik8",
    "mega/sc10_big",
    "megalodon/lra_image",  # Megalodon's LRA pipeline: its four other tasks; pixels: four models
    "seqboat/lra_image",  # SeqBoat's: ListOps, Text, Retrieval, Pathfinder; pixels: as above
    "s4d/lra_text",  # S4D's: ListOps and SC10; the text and retrieval pipelines: five models
    "s4d/lra_retrieval",
    # The Transformer's LM: tests/test_language_modeling.py; WikiText-103's data: tests/data.
    "transformer/wikitext103",
}


def _marks(name: str) -> list[pytest.MarkDecorator]:
    if name in GPU_ONLY:
        return [pytest.mark.slow, pytest.mark.gpu]
    return [pytest.mark.slow] if name in HEAVY else []


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in EXPERIMENTS])
def test_experiment_trains_two_steps(compose_cfg, name: str) -> None:
    # Path-X trains on one GPU with the paper's data parallelism (DDP over NCCL, one process).
    gpu = ["trainer=ddp", "trainer.devices=1"] if name in GPU_ONLY else []
    cfg = compose_cfg(f"experiment={name}", *fixture_overrides(compose_cfg, name), *gpu)
    assert bool(cfg.get("requires_cuda")) == (name in GPU_ONLY)  # what `declared` read
    record = train(cfg)
    assert record["global_step"] == 2
    assert record["experiment"] == name
    assert record["metrics"], "the run reported no metrics"


@pytest.mark.parametrize("name", sorted(HEAVY))
def test_heavy_experiment_instantiates(compose_cfg, name: str) -> None:
    cfg = compose_cfg(f"experiment={name}", *fixture_overrides(compose_cfg, name))
    assert bool(cfg.get("requires_cuda")) == (name in GPU_ONLY)  # what `declared` read
    task = hydra.utils.instantiate(cfg.task)
    assert sum(p.numel() for p in task.parameters()) > 0
