"""Rotary position embedding (RoPE, Su et al. 2021) on queries and keys.

Channel pairs of a head of width d are rotated by the angle p·θ_j at position p, with
θ_j = base^(−2j/d), j < d/2, so that ⟨R_p q, R_s k⟩ depends on p − s only. Two pairings exist:

- `interleaved=True`: pairs (2j, 2j+1), as complex numbers (Megalodon, the original RoFormer).
- `interleaved=False`: pairs (j, j + d/2), the halves (Llama / Hugging Face `rotate_half`).

The angles are computed in at least float32 (float64 inputs stay float64), then the result is
cast back to the input dtype. This is RoPE on Q/K; Mega's `rotary` relative bias
(`megalab.nn.attention.RotaryRelativePositionalBias`) is a different thing.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megalab.nn.positions import sinusoid_frequencies


def rope_inv_freq(dim: int, base: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """θ_j = base^(−2j/dim) for j < dim/2."""
    return sinusoid_frequencies(
        (dim + 1) // 2, dim / 2, base=base, dtype=dtype, power_dtype=torch.float64
    )


def apply_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, interleaved: bool) -> Tensor:
    """Rotate x (..., d) by positions·θ; `positions` broadcasts against x.shape[:-1]."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    angle = positions.to(cdt).unsqueeze(-1) * inv_freq.to(cdt)  # (..., d/2)
    cos, sin = torch.cos(angle), torch.sin(angle)
    xf = x.to(cdt)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE for heads of width `dim` (even); `forward(x, positions)` rotates x (..., dim)."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary embedding needs an even head width, got {dim}")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}, interleaved={self.interleaved}"

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (..., dim) rotated by `positions` (broadcastable to x.shape[:-1])."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        inv_freq = rope_inv_freq(self.dim, self.base, dtype).to(x.device)
        return apply_rope(x, positions, inv_freq, self.interleaved)
