"""The small float64 SeqBoat layer the SeqBoat tests perturb and compare (shared by
test_seqboat.py and test_seqboat_options.py)."""

from __future__ import annotations

import torch

from megalab.models.seqboat.model import SeqBoatConfig, SeqBoatLayer

DT = torch.float64
BASE = {"d_model": 16, "num_layers": 1, "z_dim": 8, "v_dim": 24, "ema_dim": 4, "dropout": 0.0,
        "input_dropout": 0.0, "chunk_size": 3}  # fmt: skip


def make_layer(seed: int = 0, base: dict | None = None, **kw) -> SeqBoatLayer:
    """A layer of `base` (default `BASE`) updated by `kw`, its weights moved off their init (so
    every path matters), in float64 and eval mode."""
    torch.manual_seed(seed)
    layer = SeqBoatLayer(SeqBoatConfig(**{**(BASE if base is None else base), **kw}))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer.to(DT).eval()
