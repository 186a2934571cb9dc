"""Sequence normalisation layers for batch-first (B, L, D) tensors, as in Mega's code.

All use eps = 1e-5 (the authors' `SequenceNorm` passes it to every type):

- `layernorm`: standard LayerNorm over D.
- `scalenorm`: g · x / sqrt(mean_D(x²) + eps) with ONE scalar gain g. This is RMS-based, not
  Nguyen & Salazar's g·x/‖x‖₂.
- `rmsnorm`: w ⊙ x / sqrt(mean_D(x²) + eps) with a per-channel gain w and no bias.
- `batchnorm` / `syncbatchnorm`: BatchNorm1d over channels with statistics over batch × time
  (every position, padded ones included, as in the code).

`SequenceNorm(norm_type, d_model)` builds one of them under `.norm`, so state-dict names read
`<...>.norm.norm.weight` like the authors' modules. `affine=False` builds every type without its
learned gain and bias (the code's `affine` flag): batch norm then keeps only its running
statistics.

The interface for norms over time. Every norm here takes (B, L, D) and an optional mask (B, L)
(True at real tokens). Norms whose statistics run along the sequence (Megalodon's timestep norm,
a group norm over time) also take and return a carried state: they follow `StreamingNorm`,
`norm(x, mask, state) -> (y, new_state)`, so a block can hold either kind behind one call.
Position-wise norms ignore the mask; batch norm, as the authors' code, includes padded positions
in its statistics.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class StreamingNorm(Protocol):
    """A norm over (B, L, D) whose statistics may carry across segments."""

    def __call__(
        self, x: Tensor, mask: Tensor | None = None, state: Any = None
    ) -> tuple[Tensor, Any]: ...


NORM_TYPES = ("layernorm", "scalenorm", "rmsnorm", "batchnorm", "syncbatchnorm")


class ScaleNorm(nn.Module):
    """y = g · x / RMS(x), one learned scalar g (init 1); `affine=False` drops g (y = x / RMS(x),
    the code's non-affine ScaleNorm)."""

    def __init__(self, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.scalar = nn.Parameter(torch.ones(1)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        mean_square = xf.square().mean(dim=-1, keepdim=True)
        if self.scalar is not None:
            xf = self.scalar * xf
        return (xf * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """y = w ⊙ x / RMS(x), per-channel gain w (init 1), no bias; `affine=False` drops w."""

    def __init__(self, d_model: int, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight
        return y.to(x.dtype)


class SequenceNorm(nn.Module):
    """One of `NORM_TYPES` applied to (B, L, D); the module itself lives under `.norm`."""

    def __init__(
        self, norm_type: str, d_model: int, eps: float = 1e-5, affine: bool = True
    ) -> None:
        super().__init__()
        self.norm_type = norm_type
        self.norm: nn.Module
        if norm_type == "layernorm":
            self.norm = nn.LayerNorm(d_model, eps=eps, elementwise_affine=affine)
        elif norm_type == "scalenorm":
            self.norm = ScaleNorm(eps=eps, affine=affine)
        elif norm_type == "rmsnorm":
            self.norm = RMSNorm(d_model, eps=eps, affine=affine)
        elif norm_type == "batchnorm":
            self.norm = nn.BatchNorm1d(d_model, eps=eps, affine=affine)
        elif norm_type == "syncbatchnorm":
            self.norm = nn.SyncBatchNorm(d_model, eps=eps, affine=affine)
        else:
            raise ValueError(
                f"unknown norm_type {norm_type!r}; allowed values: {', '.join(NORM_TYPES)}"
            )

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, D) -> (B, L, D); `mask` is accepted for the common interface and unused."""
        if isinstance(self.norm, nn.modules.batchnorm._BatchNorm):
            # Statistics over batch × time: BatchNorm1d on (B, D, L), in at least float32.
            xf = x.to(torch.promote_types(x.dtype, torch.float32))
            with torch.autocast(device_type=x.device.type, enabled=False):
                y = self.norm(xf.transpose(1, 2)).transpose(1, 2)
            return y.to(x.dtype)
        return self.norm(x)


class PlusOneLayerNorm(nn.Module):
    """LayerNorm with the "plus 1" scale: y = (x − μ)/√(σ² + ε) ⊙ (1 + γ) + β, γ = β = 0 at init.

    Megalodon's parameterisation of every norm scale (Ma et al. 2024, App. B.2): weight decay
    pulls γ towards 0, i.e. the scale towards 1. Statistics in at least float32.
    """

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: Tensor) -> Tensor:
        shape = (x.shape[-1],)
        return F.layer_norm(x, shape, 1.0 + self.weight, self.bias, self.eps)


class PlusOneRMSNorm(nn.Module):
    """RMSNorm with the "plus 1" scale: y = x / √(mean(x²) + ε) ⊙ (1 + γ), γ = 0 at init.

    The mean square is taken in at least float32 (as apex's RMSNorm that Megalodon's code uses),
    and the result is cast back to the input dtype.
    """

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(y.dtype))).to(x.dtype)
