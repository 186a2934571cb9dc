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

from typing import Any

import torch
from torch import Tensor, nn

from megalab.nn.positions import sinusoid_frequencies


def rope_inv_freq(dim: int, base: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """θ_j = base^(−2j/dim) for j < dim/2."""
    return sinusoid_frequencies(
        (dim + 1) // 2, dim / 2, base=base, dtype=dtype, power_dtype=torch.float64
    )


class InvFreq:
    """θ of `rope_inv_freq` on a device, made on the host and copied once per (dim, base,
    dtype, device).

    A copy from host memory to a CUDA tensor waits for the GPU's queue to drain (a stream sync):
    made at every forward, the table would stop the launches once per layer.
    """

    def __init__(self) -> None:
        self._tables: dict[tuple[int, float, torch.dtype, torch.device], Tensor] = {}

    def __call__(self, dim: int, base: float, dtype: torch.dtype, device: torch.device) -> Tensor:
        key = (dim, base, dtype, device)
        table = self._tables.get(key)
        if table is None:
            with torch.inference_mode(False):  # usable in training after an inference call
                table = rope_inv_freq(dim, base, dtype).to(device)
            self._tables[key] = table
        return table


def rope_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles positions·θ (..., d/2) in `dtype`: computed once, they rotate
    every tensor at those positions (queries and keys)."""
    angle = positions.to(dtype).unsqueeze(-1) * inv_freq.to(dtype)  # (..., d/2)
    return torch.cos(angle), torch.sin(angle)


def _halves(x: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    first, second = x.chunk(2, dim=-1)
    return first, second


def _rotated(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, inverse: bool) -> Tensor:
    """R x = (x₁ cos − x₂ sin, x₂ cos + x₁ sin), or Rᵀ x = (x₁ cos + x₂ sin, x₂ cos − x₁ sin)
    with `inverse`, written into one new tensor (three passes a half, each a kernel on a GPU;
    no copy to join the halves), with the formula's roundings."""
    sign = 1.0 if inverse else -1.0
    x1, x2 = _halves(x, interleaved)
    # A backward that is itself differentiated (create_graph), or a traced graph (functional
    # operations only; the compiler fuses them anyway): the formula as plain operations.
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        halves = (x1 * cos + sign * (x2 * sin), x2 * cos - sign * (x1 * sin))
        return torch.stack(halves, dim=-1).flatten(-2) if interleaved else torch.cat(halves, -1)
    half = torch.broadcast_shapes((*x.shape[:-1], x.shape[-1] // 2), cos.shape)
    out = x.new_empty((*half[:-1], 2 * half[-1]))
    o1, o2 = _halves(out, interleaved)
    torch.mul(x1, cos, out=o1).add_(x2 * sin, alpha=sign)  # ±1: exact, each product rounded
    torch.mul(x2, cos, out=o2).add_(x1 * sin, alpha=-sign)
    return out


class _Rotation(torch.autograd.Function):
    """R x in the dtype of cos/sin, cast back to x's; the backward is the inverse rotation Rᵀg.

    The products and sums autograd forms from the formula, bit for bit, in fewer operations
    (each one a pass over the tensor, a kernel launch on a GPU; tests/nn/test_rope.py).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved, ctx.dtype, ctx.shape = interleaved, x.dtype, x.shape
        return _rotated(x.to(cos.dtype), cos, sin, interleaved, inverse=False).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        cos, sin = ctx.saved_tensors
        gx = _rotated(grad.to(cos.dtype), cos, sin, ctx.interleaved, inverse=True)
        if gx.shape != ctx.shape:  # x broadcast against larger angle tables
            gx = gx.sum_to_size(ctx.shape)
        return gx.to(ctx.dtype), None, None, None


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """x (..., d) rotated by the angles of `rope_tables` (the pairing as the module docstring)."""
    if cos.requires_grad or sin.requires_grad:  # angles that learn: autograd's own backward
        return _rotated(x.to(cos.dtype), cos, sin, interleaved, inverse=False).to(x.dtype)
    out: Tensor = _Rotation.apply(x, cos, sin, interleaved)
    return out


def apply_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, interleaved: bool) -> Tensor:
    """Rotate x (..., d) by positions·θ; `positions` broadcasts against x.shape[:-1]."""
    cos, sin = rope_tables(positions, inv_freq, torch.promote_types(x.dtype, torch.float32))
    return rotate(x, cos, sin, interleaved)


class RotaryEmbedding(nn.Module):
    """RoPE for heads of width `dim` (even); `forward(x, positions)` rotates x (..., dim)."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary embedding needs an even head width, got {dim}")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.inv_freq = InvFreq()

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}, interleaved={self.interleaved}"

    def tables(self, positions: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin at `positions` for tensors like `like` (float32, or float64 for float64)."""
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        inv_freq = self.inv_freq(self.dim, self.base, dtype, like.device)
        return rope_tables(positions, inv_freq, dtype)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (..., dim) rotated by `positions` (broadcastable to x.shape[:-1])."""
        return rotate(x, *self.tables(positions, x), self.interleaved)

    def pair(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q and k rotated by the same `positions`, with the tables computed once."""
        cos, sin = self.tables(positions, q)
        return rotate(q, cos, sin, self.interleaved), rotate(k, cos, sin, self.interleaved)
