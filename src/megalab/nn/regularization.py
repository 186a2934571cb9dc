"""Stochastic depth (DropPath; Huang et al. 2016), as the mega-image repo's timm `DropPath`.

In training, each sample's residual branch is kept with probability 1 − p and then divided by
1 − p (so its expectation is unchanged), or zeroed with probability p; in eval it is the
identity. One Bernoulli draw per sample, broadcast over every other axis: the mega-image code
draws a (B, 1) mask for its time-first (L, B, D) tensors, we draw (B, 1, 1) for batch-first
(B, L, D) ones — the same per-sample rule.

`drop_path_rates(rate, depth)` is the usual linear rule over depth (DeiT, mega-image's
`VisionMEGA`): layer i of n gets `rate · i / (n − 1)`, from 0 at the first layer to `rate` at
the last.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def drop_path(
    x: Tensor, p: float = 0.0, training: bool = False, scale_by_keep: bool = True
) -> Tensor:
    """Zero whole samples of `x` (dim 0) with probability `p`; rescale the rest by 1/(1 − p)."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    shape = (x.shape[0],) + (1,) * (x.dim() - 1)
    mask = x.new_empty(shape).bernoulli_(keep)
    if keep > 0.0 and scale_by_keep:
        mask.div_(keep)
    return x * mask


class DropPath(nn.Module):
    """Per-sample stochastic depth on a residual branch of shape (B, ...); see `drop_path`."""

    def __init__(self, p: float = 0.0, scale_by_keep: bool = True) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"drop-path rate must be in [0, 1], got {p}")
        self.p = p
        self.scale_by_keep = scale_by_keep

    def forward(self, x: Tensor) -> Tensor:
        """Identity in eval mode or at p = 0."""
        return drop_path(x, self.p, self.training, self.scale_by_keep)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def drop_path_rates(rate: float, depth: int) -> list[float]:
    """Linear stochastic-depth rule: `torch.linspace(0, rate, depth)` as a list of floats."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"drop-path rate must be in [0, 1], got {rate}")
    return [float(r) for r in torch.linspace(0.0, rate, depth, device="cpu")]
