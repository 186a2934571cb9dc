"""Tiny causal language models from every model config, for the tests of long-context tools.

The causal cases are the variants of `configs/model/*.yaml` listed in
`tests/models/contract_variants/<model>.yaml` (as the backbone contract suite builds them)
whose backbone is causal: generation, unlimited-context evaluation and chunk parallelism are
tested on each, so a new model is covered by adding its config and a causal variant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
import torch
import yaml
from omegaconf import OmegaConf

from megalab.nn.embedding import SequenceEncoder
from megalab.tasks.language_modeling import LanguageModelingTask, LinearLMHead
from megalab.utils.paths import CONFIG_DIR, group_config

VOCAB = 32
DATA_SPEC = {"vocab_size": VOCAB, "d_input": None, "pad_id": None, "max_len": 64, "num_classes": 4}
TINY = ["model.d_model=16", "model.backbone.num_layers=2"]
VARIANT_DIR = Path(__file__).parent / "models" / "contract_variants"
VARIANTS: dict[str, dict[str, list[str]]] = {
    p.stem: yaml.safe_load(p.read_text()) for p in sorted(VARIANT_DIR.glob("*.yaml"))
}


def build_backbone(name: str, variant: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    """The tiny backbone of a model config variant, parameters perturbed off the init."""
    cfg = OmegaConf.create({"model": group_config("model", name), "data": DATA_SPEC})
    for override in TINY + VARIANTS.get(name, {}).get(variant, []):
        key, value = override.split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=False)
    torch.manual_seed(seed)
    backbone = hydra.utils.instantiate(cfg.model.backbone).build()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in backbone.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    for m in backbone.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return backbone.to(dtype)


def build_lm(name: str, variant: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> Any:
    """A language-model task around the tiny backbone (vocabulary `VOCAB`), in eval mode."""
    backbone = build_backbone(name, variant, dtype, seed)
    torch.manual_seed(seed + 2)
    encoder = SequenceEncoder(backbone.d_model, vocab_size=VOCAB)
    head = LinearLMHead(backbone.d_model, VOCAB)
    return LanguageModelingTask(encoder, backbone, head).to(dtype).eval()


def _all_cases() -> list[tuple[str, str]]:
    names = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
    return [(n, v) for n in names for v in VARIANTS.get(n, {"default": []})]


def _is_exact_causal(case: tuple[str, str]) -> bool:
    """Causal, and its streamed outputs equal one pass (`Backbone.exact_streaming`): the cases
    where incremental decoding and segment-wise evaluation must reproduce the full pass.
    LaMemo's look-ahead memory, refreshed by each segment, is tested against the authors' code
    instead (tests/models/lamemo/test_lamemo_golden.py, its step-by-step decode case)."""
    backbone = build_backbone(*case)
    return bool(backbone.causal and backbone.exact_streaming)


CAUSAL_CASES = [c for c in _all_cases() if _is_exact_causal(c)]
CAUSAL_IDS = [f"{n}-{v}" for n, v in CAUSAL_CASES]


def is_stateful(model: Any) -> bool:
    backbone = getattr(model, "backbone", model)
    return backbone.initial_state(1, next(backbone.parameters())) is not None


STATEFUL_CASES = [c for c in CAUSAL_CASES if is_stateful(build_backbone(*c))]
STATEFUL_IDS = [f"{n}-{v}" for n, v in STATEFUL_CASES]
