"""Megalodon's complex exponential moving average (CEMA; Ma et al. 2024, eqs. 2-3).

For every channel d of x ∈ R^{L×D} and every one of the N state dimensions n:

    h_t = α_{d,n} x_{t,d} + q_{d,n} h_{t−1},      q_{d,n} = (1 − α_{d,n} δ_{d,n}) e^{i θ_{d,n}}
    y_{t,d} = Re(Σ_n η_{d,n} h_t) + ω_d x_{t,d}
    θ_{d,n} = n · (2π/N) · σ(ϑ_d),  n = 1..N       (one learned base angle per channel, eq. 3)

with α = σ(·), δ = σ(·) real (D, N), η complex (D, N) scaled by 1/√N, ω the skip weight. Unrolled,
y = 𝒦 * x + ω ⊙ x + (read-out of a carried h) with the real kernel

    𝒦[d, l] = Re(Σ_n η_{d,n} α_{d,n} q_{d,n}^l).

This is the authors' code (XuezheMax/megalodon, `MultiHeadComplexEMA`), which differs from the
paper's eq. 2 in ways that do not change the function class (docs/reference/megalodon-code.md §4):
the input coefficient is the real α (the paper rotates it by e^{iθ} too, a constant phase that
η absorbs); there is no β expansion (x is broadcast to the N components); the base angle is
bounded by a sigmoid. Naming: the paper's base angle ω_j is the code's `theta` (ours too), and
the code's `omega` (ours too) is the skip weight, which the paper's CEMA equation leaves out.
The authors' init: α, δ logits ~ N(0, 0.2²); σ(ϑ_d) = D^{−k/D} for k a random permutation of
1..D (geometrically spread frequencies); Re η ~ N(0, 1), Im η = 0; ω ~ TruncNormal(0, 0.25²)
on [−1, 1].

Computation (`megalab.nn.ema_kernel`, with log q = log(1 − αδ) + iθ complex): the kernel is built
blockwise (q^l = q^{m·b} q^j, b ≈ √L), so autograd never holds a (D, N, L) complex tensor, and
applied as one real FFT convolution of length ≥ 2L − 1 (the code: 2·nextpow2(L)); both in at
least float32/complex64, also under bf16 autocast. A carried state h (B, D, N) complex adds its
read-out Re(Σ_n η q^{t+1} h) and is advanced to h ← α Σ_t q^{L−1−t} x_t + q^L h (the code's
`ema_hidden`), so streaming segment by segment equals one pass; a single token takes the exact
recurrence. In eval mode without autograd the kernel's spectrum is cached until a parameter
changes (the code caches the coefficients likewise). On CUDA the kernel, the state read-out and
the state after a segment come from Triton kernels (`megalab.kernels.ema`, the code's
`ema_parameters` and `ema_hidden` ops) that keep only (D, N) tensors for the backward.

Bidirectional CEMA (our encoder variant for classification; the authors' Megalodon code has no
encoder): a second set of rows runs backwards in time, as Mega's bidirectional EMA, both sums
including the current token: y_t = Σ_m 𝒦_fwd[m] x_{t−m} + Σ_m 𝒦_bwd[m] x_{t+m} + ω x_t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from megalab.nn.carried import CarriedLayer
from megalab.nn.ema_kernel import (
    ema_ops,
    next_fast_len,
    recurrent_step,
)
from megalab.nn.fft_conv import SpectrumCache, fft_conv_lean, fold_directions, rfft_lean
from megalab.nn.state import register_state

__all__ = ["CEMAState", "ComplexEMA", "complex_dtype"]


def complex_dtype(dtype: torch.dtype) -> torch.dtype:
    """complex128 for float64, else complex64 (the state and coefficient dtype)."""
    return torch.complex128 if dtype == torch.float64 else torch.complex64


@register_state
@dataclass
class CEMAState:
    """The CEMA hidden state h (B, D, N), complex: what a layer carries across segments.

    It is also what chunk-parallel training passes from one rank to the next.
    """

    h: Tensor


class ComplexEMA(CarriedLayer[CEMAState]):
    """CEMA sub-layer: y = Re(𝒦 * x) + ω ⊙ x on batch-first (B, L, D) inputs.

    Args:
        d_model: channels D.
        ema_dim: state dimensions N per channel (the code's `ndim`, 16 in every preset).
        bidirectional: add a backward-running set of rows (encoders; not streamable).
    """

    def __init__(self, d_model: int, ema_dim: int = 16, bidirectional: bool = False) -> None:
        super().__init__()
        if d_model < 1 or ema_dim < 1:
            raise ValueError(f"CEMA needs d_model >= 1 and ema_dim >= 1, got {d_model}, {ema_dim}")
        self.d_model = d_model
        self.ema_dim = ema_dim
        self.bidirectional = bidirectional
        self.causal = not bidirectional
        rows = 2 * d_model if bidirectional else d_model
        # α (input weight) and δ (damping) logits, ϑ the base-angle logit, η as a real view
        # (..., 2) of the complex output weights, ω the skip weight.
        self.alpha = nn.Parameter(torch.empty(rows, ema_dim))
        self.delta = nn.Parameter(torch.empty(rows, ema_dim))
        self.theta = nn.Parameter(torch.empty(rows))
        self.eta = nn.Parameter(torch.empty(rows, ema_dim, 2))
        self.omega = nn.Parameter(torch.empty(d_model))
        self.scale = math.sqrt(1.0 / ema_dim)
        self._spectrum = SpectrumCache()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The authors' init (see the module docstring); each direction draws its own order."""
        D = self.d_model
        with torch.no_grad():
            nn.init.normal_(self.alpha, mean=0.0, std=0.2)
            nn.init.normal_(self.delta, mean=0.0, std=0.2)
            # σ(ϑ) = exp(−k ln(D)/D) for k = 1..D in a random order, stored as a logit. The
            # permutation is drawn on the CPU, as the code does before broadcasting it.
            k = torch.arange(1, D + 1, dtype=torch.float64)
            freqs = torch.exp(-k * math.log(D) / D) if D > 1 else torch.full((1,), 0.5)
            logits = [torch.logit(freqs[torch.randperm(D)]) for _ in range(self.theta.numel() // D)]
            self.theta.copy_(torch.cat(logits).to(self.theta.dtype))
            nn.init.normal_(self.eta[..., 0], mean=0.0, std=1.0)
            self.eta[..., 1].zero_()
            nn.init.trunc_normal_(self.omega, mean=0.0, std=0.25, a=-1.0, b=1.0)
        self._spectrum.clear()

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, ema_dim={self.ema_dim}, bidirectional={self.bidirectional}"

    # ----------------------------------------------------------------------------- coefficients
    def coefficients(self, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
        """(α, η/√N, log q), each (D', N): α real, η and log q complex, in `dtype` precision.

        log q = log(1 − αδ) + iθ with θ_n = n·(2π/N)·σ(ϑ); the real part is evaluated in a form
        that never reaches −∞ (`log_decay`).
        """
        alpha_logit, delta_logit = self.alpha.to(dtype), self.delta.to(dtype)
        p = torch.sigmoid(alpha_logit)
        harmonics = torch.arange(1, self.ema_dim + 1, device=p.device, dtype=dtype)
        base = torch.sigmoid(self.theta.to(dtype)) * (2 * math.pi / self.ema_dim)
        log_abs_q = ema_ops(alpha_logit, delta_logit).log_decay(alpha_logit, delta_logit)
        log_q = torch.complex(log_abs_q, base.unsqueeze(-1) * harmonics)
        eta = torch.view_as_complex(self.eta.to(dtype)) * self.scale
        return p, eta, log_q

    def kernel(self, length: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """The real (D', length) kernel 𝒦[d, l] = Re(Σ_n η_n α_n q_n^l).

        Built by the Triton `ema` kernel where it is chosen (`ema_ops`).
        """
        coefficients = self.coefficients(dtype)
        return ema_ops(*coefficients).ema_kernel(*coefficients, length).real

    def _kernel_spectrum(self, n_fft: int, length: int, dtype: torch.dtype) -> Tensor:
        """rfft of the kernel at length n_fft as (D, n_fft//2 + 1), both directions folded in.

        Cached in eval mode without autograd, keyed on the parameters' versions.
        """

        def spectrum() -> Tensor:
            spec = rfft_lean(self.kernel(length, dtype), n_fft)  # (D', F)
            return fold_directions(spec, self.d_model) if self.bidirectional else spec

        params = (self.alpha, self.delta, self.theta, self.eta)
        return self._spectrum.get(self, params, (n_fft, length, dtype), spectrum)

    # ----------------------------------------------------------------------------- forward
    def advance(
        self, x: Tensor, mask: Tensor | None, state: CEMAState | None, want_state: bool
    ) -> tuple[Tensor, CEMAState | None]:
        """y = Re(𝒦 * x̃) + ω ⊙ x̃ (+ the carried state's read-out), in x's dtype.

        x̃ is the input with padded positions zeroed; the state is the hidden state h after the
        segment (causal only).
        """
        L = x.shape[1]
        if x.shape[-1] != self.d_model:
            raise ValueError(f"CEMA expects {self.d_model} channels, got input of shape {x.shape}")
        cdt = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            xt = x.to(cdt)
            if mask is not None:
                xt = xt * mask.unsqueeze(-1).to(cdt)
            xt = xt.transpose(1, 2)  # (B, D, L): time last for the FFT
            h0 = None if state is None else state.h.to(complex_dtype(cdt))
            if h0 is not None and L == 1:
                p, eta, log_q = self.coefficients(cdt)
                y_c, h = recurrent_step(xt[..., 0], h0, p, eta, log_q)
                y = y_c.real.unsqueeze(-1)
            else:
                n_fft = next_fast_len(2 * L - 1)
                y = fft_conv_lean(xt, self._kernel_spectrum(n_fft, L, cdt), n_fft)
                h = None
                if want_state:
                    p, eta, log_q = self.coefficients(cdt)
                    ops = ema_ops(xt, log_q)  # Triton or the reference
                    h = ops.state_after(xt, p, log_q)  # α Σ_t q^{L−1−t} x_t
                    if h0 is not None:
                        y = y + ops.state_readout(h0, eta, log_q, L).real  # Re Σ_n η q^{t+1} h
                        h = h + ops.state_decay(h0, log_q, L)  # + q^L h
            omega = self.omega.to(cdt)  # + ω ⊙ x̃, back to (B, L, D) (fused on CUDA)
            out = ema_ops(y, omega).skip_output(y, xt.transpose(1, 2), omega, False, x.dtype)
        new_state = CEMAState(h) if h is not None else None  # h is set exactly when want_state
        return out, new_state

    def initial_state(self, batch_size: int, like: Tensor) -> CEMAState:
        """A zero state h of shape (B, D, N), complex64 (complex128 for float64 `like`)."""
        dtype = complex_dtype(torch.promote_types(like.dtype, torch.float32))
        return CEMAState(torch.zeros(batch_size, self.d_model, self.ema_dim, dtype=dtype,
                                     device=like.device))  # fmt: skip
