"""Linear convolution by one real FFT, with a hand-written backward.

    y = irfft(rfft(x̃, n) · K̂, n)[:L],        x̃ = x ⊙ mask,  K̂ the kernel's spectrum (D, F)

Autograd through `torch.fft` works but is wasteful here: the backward of `rfft` is a full complex
FFT (twice the work of a real one) of a zero-padded gradient, and autograd keeps both the input
spectrum rfft(x̃) and the zero-padded copy of x̃ it was computed from (2 KB per token for
d = 128 and n = 2L). The gradients have closed forms in the same FFT size n:

    ∂/∂x̃ = irfft(rfft(g, n) · conj(K̂), n)[:L]               (correlation with the kernel)
    ∂/∂K̂ = Σ_batch c · rfft(g, n) · conj(rfft(x̃, n)) / n

where c = 2 on the bins 1 … n − F that stand for their complex conjugates in a real signal
(F = n//2 + 1) and 1 on the others: this is exactly what autograd computes for `irfft` after
`rfft`, so the gradients agree to rounding (tested in float64). The backward is not itself
differentiable (double backward raises).
n ≥ L + taps − 1 keeps every circular product free of wrap-around, for the forward and for both
gradients.

Mega's EMA, Megalodon's CEMA and SeqBoat's S4D convolve through it. The backward keeps the input
spectrum only (half of what autograd keeps) and runs one real FFT and one inverse, against
autograd's real FFT plus a complex one of the same length. `rfft_lean` is `torch.fft.rfft` for
the kernel side, whose backward is one irfft and keeps nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


def _masked(x: Tensor, mask: Tensor | None) -> Tensor:
    return x if mask is None else x * mask


class _FFTConv(torch.autograd.Function):
    """y = irfft(rfft(x ⊙ mask, n) · spec, n)[..., :L]; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, spec: Tensor, mask: Tensor | None, n_fft: int) -> Tensor:
        L = x.shape[-1]
        x_f = torch.fft.rfft(_masked(x, mask), n=n_fft)
        y = torch.fft.irfft(x_f * spec, n=n_fft)
        ctx.save_for_backward(x_f, spec, mask)
        ctx.length = L
        ctx.n_fft = n_fft
        return y[..., :L]

    @staticmethod
    @once_differentiable  # the saved spectrum carries no graph back to x
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x_f, spec, mask = ctx.saved_tensors
        n, L = ctx.n_fft, ctx.length
        g_f = torch.fft.rfft(grad, n=n)
        grad_x = grad_spec = None
        if ctx.needs_input_grad[1]:
            # Σ_batch ĝ · conj(x̂) from the saved input spectrum.
            prod = x_f.conj() * g_f
            lead = prod.dim() - spec.dim()
            prod = prod.sum(dim=tuple(range(lead))) if lead else prod
            # 1/n, and bins 1 … n − F of a real signal's half spectrum also stand for their
            # conjugates (irfft counts them twice).
            weight = torch.full((prod.shape[-1],), 1.0 / n, dtype=grad.dtype, device=grad.device)
            weight[1 : n - prod.shape[-1] + 1] = 2.0 / n
            grad_spec = (prod * weight).sum_to_size(spec.shape)
        if ctx.needs_input_grad[0]:
            grad_x = _masked(torch.fft.irfft(g_f.mul_(spec.conj()), n=n)[..., :L], mask)
        return grad_x, grad_spec, None, None


class _RFFT(torch.autograd.Function):
    """rfft(x, n) along the last axis, whose backward is one irfft and saves nothing."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, n_fft: int) -> Tensor:
        ctx.n_fft, ctx.length = n_fft, x.shape[-1]
        return torch.fft.rfft(x, n=n_fft)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        n = ctx.n_fft
        # The adjoint of the half spectrum: Re Σ_f e^{2πi f t/n} grad_f = n · irfft(grad') with
        # grad' = grad halved on the bins 1 … n − F that irfft counts twice.
        half = grad.clone()
        half[..., 1 : n - grad.shape[-1] + 1] *= 0.5
        return torch.fft.irfft(half, n=n)[..., : ctx.length] * n, None


def rfft_lean(x: Tensor, n_fft: int) -> Tensor:
    """`torch.fft.rfft(x, n=n_fft)` over the last axis; its backward (one irfft) keeps no copy
    of the zero-padded input, which autograd's rfft saves (it then runs a complex FFT)."""
    if n_fft < x.shape[-1]:
        raise ValueError(f"n_fft={n_fft} is shorter than the input length {x.shape[-1]}")
    return _RFFT.apply(x, n_fft)


def fft_conv_lean(x: Tensor, spec: Tensor, n_fft: int, mask: Tensor | None = None) -> Tensor:
    """Linear convolution of x (..., D, L) ⊙ mask with a kernel given by its rfft `spec`.

    The same result as `megalab.nn.ema_kernel.fft_conv(x * mask, spec, n_fft)`, with the
    backward of the module docstring (no complex FFT, no padded copies kept). `mask`
    broadcasts against x, e.g. (B, 1, L) for padded tokens; `n_fft` must be ≥ L + taps − 1.
    """
    if n_fft < x.shape[-1]:
        raise ValueError(f"n_fft={n_fft} is shorter than the input length {x.shape[-1]}")
    if mask is not None:
        mask = mask.to(x.dtype)
    return _FFTConv.apply(x, spec, mask, n_fft)


class SpectrumCache:
    """The kernel spectrum of the last inference call, reused while the parameters are unchanged.

    A streaming evaluation runs a layer once per segment with the same parameters; rebuilding the
    kernel and its FFT every call is wasted work. The cache is used only in eval mode without
    autograd (a cached spectrum never carries a graph) and outside `torch.compile`; it is keyed
    on each parameter's version counter and storage, so an in-place update or a reassignment
    drops it, and any training-mode or autograd call clears it.
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.value: Tensor | None = None

    def clear(self) -> None:
        self.key, self.value = None, None

    def get(
        self,
        module: torch.nn.Module,
        params: tuple[Tensor, ...],
        settings: tuple,
        compute: Callable[[], Tensor],
    ) -> Tensor:
        """`compute()`, or its cached value for the same `settings` and parameter versions."""
        if module.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            self.clear()
            return compute()
        key = (settings, tuple((p._version, p.data_ptr(), p.device) for p in params))
        if key != self.key or self.value is None:
            self.key, self.value = key, compute()
        return self.value


def fold_directions(spec: Tensor, d_model: int) -> Tensor:
    """One (D, F) spectrum from a bidirectional kernel's (2D, F): forward rows plus backward rows.

    Σ_m k_bwd[m] x_{t+m} is a convolution with the time-reversed kernel, whose spectrum is the
    conjugate of the kernel's, so both directions run in one FFT convolution.
    """
    return spec[:d_model] + spec[d_model:].conj()
