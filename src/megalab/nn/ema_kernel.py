"""The maths of diagonal linear recurrences, shared by Mega's damped EMA, Megalodon's complex
EMA (CEMA) and SeqBoat's EMA: kernels, FFT convolution, the recurrent step and the state.

For each channel d and each of the N state dimensions n, with input weight w_in, decay q and
output weight w_out (real, or complex for CEMA),

    h_t = w_in ⊙ x_t + q ⊙ h_{t−1},        y_t = Σ_n w_out ⊙ h_t        (Re(·) for complex)

unrolls to y = 𝒦 * x + (read-out of h_{−1}) with the Vandermonde kernel

    𝒦[d, l] = Σ_n w_out[d, n] · w_in[d, n] · q[d, n]^l.

Decays are passed as log q (D, N): real for a damped EMA (q ∈ (0, 1)), complex for CEMA
(log |q| + iθ). Nothing here builds the (D, N, L) tensor of powers: writing l = m·b + j with
b ≈ √L, q^l = q^{m·b}·q^j, so a kernel is one batched matmul of a (D, L/b, N) and a (D, N, b)
factor: O(D·N·√L) exponentials, and autograd keeps only those two small factors. The state
read-out and the state after a segment use the same split.

On CUDA, `ema_ops` hands the same functions from `megalab.kernels.ema` (Triton kernels
that hold no (D, N, L) tensor at all); this module stays the reference and the CPU path.
"""

from __future__ import annotations

import math
import sys
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from megalab.kernels import use_kernel


def next_fast_len(n: int) -> int:
    """Smallest 2^a·3^b·5^c ≥ n (fast FFT sizes)."""
    best = 1 << max(0, (n - 1).bit_length())
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            m = p35
            while m < n:
                m *= 2
            best = min(best, m)
            p35 *= 3
        p5 *= 5
    return best


def ema_ops(*tensors: Tensor) -> ModuleType:
    """Where `log_decay`, `ema_kernel`, `state_after`, `state_readout`, `state_decay` and
    `skip_output` come from for `tensors`.

    `megalab.kernels.ema` (Triton) when the `ema` kernel is chosen for them (`megalab.kernels.
    use_kernel`) and they are float32 or complex64, outside `torch.compile`; else this module.
    The kernels' `ema_kernel` and `state_readout` return the real part only, which is all any
    EMA reads (`.real` of a real tensor is itself).
    """
    if (
        all(t.dtype in (torch.float32, torch.complex64) for t in tensors)
        and not torch.compiler.is_compiling()
        and use_kernel("ema", *tensors)
    ):
        from megalab.kernels import ema

        return ema
    return sys.modules[__name__]


def log_decay(alpha_logit: Tensor, delta_logit: Tensor) -> Tensor:
    """log q = log(1 − σ(a)·σ(d)), stable for any logits (never −inf, exact gradients).

    1 − σ(a)σ(d) = (e^{−a} + e^{−d} + e^{−a−d}) / ((1 + e^{−a})(1 + e^{−d})).
    """
    terms = torch.stack([-alpha_logit, -delta_logit, -alpha_logit - delta_logit])
    return torch.logsumexp(terms, dim=0) - F.softplus(-alpha_logit) - F.softplus(-delta_logit)


def _split_len(length: int) -> tuple[int, int]:
    """Block size b ≈ √length and block count m with m·b ≥ length."""
    b = max(1, math.isqrt(max(length - 1, 0)) + 1)
    return b, -(-length // b)


def _powers(log_q: Tensor, exponents: Tensor) -> Tensor:
    """q^e for every exponent: (D, N, len(e)); exponents in log_q's (real) precision."""
    return torch.exp(exponents.to(log_q.dtype) * log_q.unsqueeze(-1))


def vandermonde_apply(coef: Tensor, log_q: Tensor, length: int, offset: int = 0) -> Tensor:
    """out[..., d, l] = Σ_n coef[..., d, n] · q[d, n]^(l + offset) for l < length.

    coef: (..., D, N); log_q: (D, N), real or complex (the output is complex if either is).
    """
    b, m = _split_len(length)
    real = log_q.real if log_q.is_complex() else log_q
    hi = _powers(log_q, offset + b * torch.arange(m, device=log_q.device, dtype=real.dtype))
    lo = _powers(log_q, torch.arange(b, device=log_q.device, dtype=real.dtype))
    if hi.is_complex() and not coef.is_complex():
        coef = coef.to(hi.dtype)
    elif coef.is_complex() and not hi.is_complex():
        hi, lo = hi.to(coef.dtype), lo.to(coef.dtype)
    out = torch.einsum("...dnm,dnj->...dmj", coef.unsqueeze(-1) * hi, lo)
    return out.flatten(-2)[..., :length]


def vandermonde_reduce(x: Tensor, log_q: Tensor) -> Tensor:
    """out[..., d, n] = Σ_l x[..., d, l] · q[d, n]^l  (the transpose of `vandermonde_apply`).

    x: (..., D, L) real; log_q: (D, N) real or complex.
    """
    length = x.shape[-1]
    b, m = _split_len(length)
    x = F.pad(x, (0, m * b - length)).unflatten(-1, (m, b))  # (..., D, m, b)
    real = log_q.real if log_q.is_complex() else log_q
    hi = _powers(log_q, b * torch.arange(m, device=log_q.device, dtype=real.dtype))
    lo = _powers(log_q, torch.arange(b, device=log_q.device, dtype=real.dtype))
    if log_q.is_complex():
        x = x.to(lo.dtype)
    inner = torch.einsum("...dmj,dnj->...dnm", x, lo)
    return (inner * hi).sum(-1)


def ema_kernel(w_in: Tensor, w_out: Tensor, log_q: Tensor, length: int) -> Tensor:
    """The (D, length) kernel 𝒦[d, l] = Σ_n w_out·w_in·q^l (complex if the decay is)."""
    return vandermonde_apply(w_in * w_out, log_q, length)


def state_after(x: Tensor, w_in: Tensor, log_q: Tensor) -> Tensor:
    """h_{L−1} from a zero start: Σ_t w_in ⊙ x_t q^{L−1−t}. x (B, D, L) -> (B, D, N)."""
    return w_in * vandermonde_reduce(x.flip(-1), log_q)


def state_readout(h: Tensor, w_out: Tensor, log_q: Tensor, length: int) -> Tensor:
    """The carried state's contribution Σ_n w_out q^{t+1} h_n for t < length: (B, D, length)."""
    return vandermonde_apply(h * w_out, log_q, length, offset=1)


def state_decay(h: Tensor, log_q: Tensor, length: int) -> Tensor:
    """q^length ⊙ h: the carried state after `length` more steps of zero input."""
    return torch.exp(length * log_q) * h


def recurrent_step(
    x: Tensor, h: Tensor, w_in: Tensor, w_out: Tensor, log_q: Tensor
) -> tuple[Tensor, Tensor]:
    """One step: h ← w_in x + q h; y = Σ_n w_out h.  x (B, D), h (B, D, N) -> (y, h)."""
    h = w_in * x.unsqueeze(-1).to(w_in.dtype) + torch.exp(log_q) * h
    return (h * w_out).sum(-1), h


def skip_output(y: Tensor, x: Tensor, omega: Tensor, silu: bool, dtype: torch.dtype) -> Tensor:
    """act(yᵀ + ω ⊙ x) as (B, L, D) in `dtype`: y (B, D, L) the EMA term, x (B, L, D) the skip
    input (cast to y's dtype first), act = SiLU (Mega) or the identity (CEMA)."""
    out = y.transpose(1, 2) + x.to(y.dtype) * omega.to(y.dtype)
    return (F.silu(out) if silu else out).to(dtype)


def fft_conv(x: Tensor, spec: Tensor, n_fft: int) -> Tensor:
    """Linear convolution of x (..., D, L) with a kernel given by its rfft `spec` (D, F).

    `n_fft` must be ≥ L + taps − 1 so that the circular convolution never wraps onto data. The
    plain autograd form: the layers run `megalab.nn.fft_conv.fft_conv_lean`, its hand-written
    backward, which the tests check against this one.
    """
    L = x.shape[-1]
    x_f = torch.fft.rfft(x, n=n_fft, dim=-1)
    return torch.fft.irfft(x_f * spec, n=n_fft, dim=-1)[..., :L]


def naive_recurrence(
    x: Tensor, w_in: Tensor, w_out: Tensor, log_q: Tensor, h0: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The recurrence as a loop over time (reference for tests): x (B, D, L) -> (y, h_last)."""
    B, D, L = x.shape
    dtype = torch.promote_types(x.dtype, w_in.dtype)
    dtype = torch.promote_types(dtype, log_q.dtype)
    h = x.new_zeros(B, D, w_in.shape[-1], dtype=dtype) if h0 is None else h0.to(dtype)
    ys = []
    for t in range(L):
        y, h = recurrent_step(x[..., t], h, w_in, w_out, log_q)
        ys.append(y)
    return torch.stack(ys, -1), h
