"""Zeroing padded positions: the one step every layer that takes a token mask shares."""

from __future__ import annotations

from torch import Tensor


def zero_pads(x: Tensor, mask: Tensor | None) -> Tensor:
    """`x` (B, L, D) with the positions where `mask` (B, L) is False set to zero."""
    return x if mask is None else x * mask.unsqueeze(-1).to(x.dtype)
