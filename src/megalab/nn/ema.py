"""Multi-dimensional damped EMA (Ma et al. 2023, Mega, eqs. 3-5 and Appendix A).

For every channel j of x ∈ R^{L×d} and every one of the h EMA dimensions n:

    u_t = β_{j,n} x_{t,j}
    h_t = α_{j,n} u_t + (1 − α_{j,n} δ_{j,n}) h_{t−1}            (eq. 5)
    y_{t,j} = Σ_n η_{j,n} h_t / √h

Unrolled, y = 𝒦 * x + (readout of h_0) with the Vandermonde kernel (eq. 26)

    𝒦[j, l] = Σ_n η_{j,n}/√h · α_{j,n} β_{j,n} · q_{j,n}^l,   q = 1 − α⊙δ ∈ (0, 1).

As in the authors' code (facebookresearch/mega, `MultiHeadEMA`), which the paper does not spell
out: α = σ(·), δ = σ(·); the sub-layer returns X' = SiLU(EMA(x̃) + ω ⊙ x) with a learned
per-channel skip ω applied to the *unmasked* input, where x̃ is x with padded positions zeroed;
the kernel can be truncated to its first `truncation` taps; and encoders use a bidirectional EMA
with a second kernel set running backwards in time, both sums including the current token:

    y_t = Σ_{m<K} 𝒦_fwd[m] x̃_{t−m} + Σ_{m<K} 𝒦_bwd[m] x̃_{t+m}.

The ImageNet model of the authors' separate mega-image repo (`shift=True`, its default) starts
the backward sum one step later, at x̃_{t+1}, so the current token enters through 𝒦_fwd[0] only:

    y_t = Σ_{m<K} 𝒦_fwd[m] x̃_{t−m} + Σ_{m<K} 𝒦_bwd[m] x̃_{t+1+m}        (`shift=True`)

That code computes it as one circular FFT of length N = L + K: the kernel is 𝒦_fwd followed
by L zeros, plus L zeros followed by the time-reversed 𝒦_bwd (𝒦_bwd[m] at index N − 1 − m),
and x̃ is zero-padded to N. The circular wrap never reaches real data: a forward tap m > t reads
index N + t − m ∈ [L + 1, N − 1] and a backward tap reads index t + 1 + m ≤ N − 1, and x̃ is zero
on [L, N). So for every L and every K ≤ L (truncated or not; the ImageNet model has K = L = 196)
it is exactly the linear sum above, which is what we compute: the backward kernel gets a zero
lag-0 tap, [0, 𝒦_bwd[0], …, 𝒦_bwd[K−1]], on an FFT of length ≥ L + K. The shifted model is the
non-shifted one with that delayed backward kernel; the fairseq repo has no shift.

Parameter names follow the paper: our `alpha` (input weight α) is the code's `delta` and our
`delta` (damping δ) is the code's `alpha`; our `eta` is the code's `gamma` (see
`megalab.models.<model>.convert`).

Speed. The kernel maths lives in `megalab.nn.ema_kernel` (shared with the complex EMA): the
kernel is never built as the (d, h, L) tensor of powers q^l but as one batched matmul of two
O(d·h·√L) factors, and the streaming read-out and state update use the same split.
On CUDA the kernel and the state terms come from Triton kernels (`megalab.kernels.ema`) that
keep only the (d, h) coefficients for the backward.
The convolution is one real FFT of length ≥ L + K − 1 (the bidirectional kernel's spectrum is
FFT(𝒦_fwd) + conj(FFT(𝒦_bwd)), no explicit two-sided kernel), computed in at least float32 like
the authors' code; float64 inputs stay float64. In eval mode without autograd the kernel's
spectrum is cached until a parameter changes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.nn.carried import CarriedLayer
from megalab.nn.ema_kernel import ema_ops, log_decay, next_fast_len, recurrent_step
from megalab.nn.fft_conv import SpectrumCache, fft_conv_lean, fold_directions, rfft_lean

__all__ = ["DampedEMA", "log_decay", "next_fast_len"]


class DampedEMA(CarriedLayer[Tensor]):
    """Mega's EMA sub-layer: X' = SiLU(EMA(x̃) + ω ⊙ x), batch-first (B, L, D).

    Args:
        d_model: channels d.
        ema_dim: EMA expansion h (the paper's h, the code's `ndim`). `ema_dim=0` removes the
            EMA (the paper's h = 0 ablation): the empty sum over n makes EMA(x) = 0, so the
            sub-layer computes X' = SiLU(ω ⊙ x), a position-wise map with no mixing over time;
            the rest of the layer is unchanged. (The authors' code cannot run h = 0.)
        bidirectional: add a second, backward-running kernel set (encoders).
        truncation: keep only the first `truncation` kernel taps in the full (stateless) pass;
            None keeps all L. Like the authors' code, the streaming path (a state is passed) is
            the exact infinite-memory recurrence and ignores truncation. `truncation=0` is the
            code's empty kernel (its `min(truncation, L)`): causal, the stateless pass then
            computes EMA(x) = 0, X' = SiLU(ω ⊙ x); bidirectional, the code fails on the empty
            kernel, so it is refused here.
        shift: bidirectional only: the backward kernel starts at x_{t+1} instead of x_t (the
            mega-image ImageNet model; see the module docstring). False: the fairseq EMA.
    """

    def __init__(
        self,
        d_model: int,
        ema_dim: int = 16,
        bidirectional: bool = False,
        truncation: int | None = None,
        shift: bool = False,
    ) -> None:
        super().__init__()
        if ema_dim < 0:
            raise ValueError(f"ema_dim must be >= 0, got {ema_dim}")
        if shift and not bidirectional:
            raise ValueError(
                "shift=True moves the backward kernel of a bidirectional EMA one step ahead; a "
                "causal EMA has no backward kernel (use bidirectional=True or shift=False)"
            )
        if truncation is not None and truncation < 0:
            raise ValueError(
                f"truncation must be a kernel length >= 0 or None (the whole sequence), "
                f"got {truncation}"
            )
        if truncation == 0 and bidirectional:
            raise ValueError(
                "truncation=0 gives a bidirectional EMA an empty kernel, which the authors' code "
                "cannot run (its backward kernel padding fails); use truncation=None for the "
                "whole sequence or a positive kernel length"
            )
        self.d_model = d_model
        self.ema_dim = ema_dim
        self.bidirectional = bidirectional
        self.causal = not bidirectional
        self.truncation = truncation
        self.shift = shift
        rows = 2 * d_model if bidirectional else d_model
        # α (input weight) and δ (damping) as logits; β expansion; η output projection.
        self.alpha = nn.Parameter(torch.empty(rows, ema_dim))
        self.delta = nn.Parameter(torch.empty(rows, ema_dim))
        self.beta = nn.Parameter(torch.empty(rows, ema_dim))
        self.eta = nn.Parameter(torch.empty(rows, ema_dim))
        self.omega = nn.Parameter(torch.empty(d_model))
        self.scale = math.sqrt(1.0 / ema_dim) if ema_dim > 0 else 0.0
        self._spectrum = SpectrumCache()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The authors' init: logits N(0, 0.2); β = [1, −1, 1, ...] + N(0, 0.02); η, ω N(0, 1)."""
        with torch.no_grad():
            nn.init.normal_(self.alpha, mean=0.0, std=0.2)
            nn.init.normal_(self.delta, mean=0.0, std=0.2)
            self.beta.normal_(mean=0.0, std=0.02).add_(self.beta_signs())
            nn.init.normal_(self.eta, mean=0.0, std=1.0)
            nn.init.normal_(self.omega, mean=0.0, std=1.0)
        self._spectrum.clear()

    def beta_signs(self) -> Tensor:
        """[1, −1, 1, ...] (h,), the mean of β's init, on β's device (an init run after the
        module moved, as a deferred or sharded init does, adds it there)."""
        sign = self.beta.new_ones(self.ema_dim)
        sign[1::2] = -1.0
        return sign

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, ema_dim={self.ema_dim}, "
            f"bidirectional={self.bidirectional}, truncation={self.truncation}"
            + (", shift=True" if self.shift else "")
        )

    # ----------------------------------------------------------------------------- coefficients
    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        """(α⊙β, η/√h, log q), each (D', h); q = 1 − α⊙δ is the per-dimension decay."""
        alpha = torch.sigmoid(self.alpha)
        log_q = ema_ops(self.alpha, self.delta).log_decay(self.alpha, self.delta)
        return alpha * self.beta, self.eta * self.scale, log_q

    def kernel(self, length: int) -> Tensor:
        """The (D', length) kernel 𝒦[c, l] = Σ_n η_n/√h · α_n β_n · q_n^l (eq. 26).

        Built by the Triton `ema` kernel where it is chosen (`ema_ops`).
        """
        coefficients = self.coefficients()
        return ema_ops(*coefficients).ema_kernel(*coefficients, length)

    def _kernel_spectrum(self, K: int, n_fft: int, dtype: torch.dtype) -> Tensor:
        """rfft of the kernel at length n_fft as (D, n_fft//2 + 1); both directions folded in.

        Cached in eval mode when autograd is off, keyed on the parameters' versions, so a cached
        spectrum never carries a graph and is dropped as soon as any parameter changes.
        """

        def spectrum() -> Tensor:
            k = self.kernel(K).to(dtype)
            if self.shift:
                # Σ_m k_bwd[m] x_{t+1+m}: the backward kernel delayed by one tap (its lag 0 is 0).
                k = torch.cat([F.pad(k[: self.d_model], (0, 1)), F.pad(k[self.d_model :], (1, 0))])
            spec = rfft_lean(k, n_fft)  # (D', F)
            return fold_directions(spec, self.d_model) if self.bidirectional else spec

        params = (self.alpha, self.delta, self.beta, self.eta)
        return self._spectrum.get(self, params, (K, n_fft, dtype), spectrum)

    # ----------------------------------------------------------------------------- forward
    def advance(
        self, x: Tensor, mask: Tensor | None, state: Tensor | None, want_state: bool
    ) -> tuple[Tensor, Tensor | None]:
        """X' = SiLU(EMA(x̃) + ω ⊙ x), x̃ the input with padded positions zeroed.

        The state is the (B, D, h) hidden state h after the segment's last position (causal
        only); with an incoming state the exact recurrence is used (no truncation), like the code.
        """
        B, L, D = x.shape
        cdt = torch.promote_types(x.dtype, torch.float32)
        if self.ema_dim == 0:
            new_state = x.new_zeros(B, D, 0) if want_state else None
            return F.silu(x.to(cdt) * self.omega).to(x.dtype), new_state

        with torch.autocast(device_type=x.device.type, enabled=False):
            xt = x.to(cdt).transpose(1, 2)  # (B, D, L): time last for the FFT
            keep = None if mask is None else mask.unsqueeze(1).to(cdt)  # (B, 1, L)
            # x̃: padded inputs zeroed (the convolution applies the mask itself).
            x_tilde = xt if keep is None or not want_state else xt * keep
            if state is not None and L == 1:
                y, new_state = self._one_step(x_tilde[..., 0], state.to(cdt))
                y = y.unsqueeze(-1)
            else:
                K = L if (state is not None or self.truncation is None) else min(self.truncation, L)
                if K == 0:  # truncation=0 (causal): the code's empty kernel convolves to zero
                    y = torch.zeros_like(xt)
                else:
                    y = self._fft_conv(xt, K, keep)
                new_state = None
                if want_state:
                    w_in, w_out, log_q = (t.to(cdt) for t in self.coefficients())
                    ops = ema_ops(x_tilde, log_q)  # Triton or the reference
                    # Σ_t (α⊙β) x_t q^{L−1−t}: the state after the segment's last token.
                    new_state = ops.state_after(x_tilde, w_in, log_q)
                    if state is not None:
                        h0 = state.to(cdt)
                        # y_t += Σ_n η_n q_n^{t+1} h_n ;  h_L += q^L h
                        y = y + ops.state_readout(h0, w_out, log_q, L)
                        new_state = new_state + ops.state_decay(h0, log_q, L)
        # SiLU(yᵀ + ω ⊙ x), ω ⊙ x on the unmasked input as in the code (fused on CUDA).
        out = ema_ops(y, self.omega).skip_output(y, x, self.omega, silu=True, dtype=x.dtype)
        return out, (new_state.to(x.dtype) if new_state is not None else None)

    def _fft_conv(self, x: Tensor, K: int, mask: Tensor | None = None) -> Tensor:
        """Linear convolution of (B, D, L) x ⊙ mask (B, 1, L) with the length-K kernel(s) by one
        real FFT (`megalab.nn.fft_conv`: no complex FFT and no padded copies in the backward)."""
        L = x.shape[-1]
        # A linear convolution needs n_fft ≥ L + (taps − 1); the shifted backward kernel has
        # K + 1 taps (its lag 0 is zero), so it needs L + K, the mega-image code's FFT length.
        n_fft = next_fast_len(L + K - 1 + int(self.shift))
        return fft_conv_lean(x, self._kernel_spectrum(K, n_fft, x.dtype), n_fft, mask)

    def _one_step(self, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """One token: h ← (α⊙β) x + q ⊙ h;  y = Σ_n η_n h_n / √h.  x (B, D), h (B, D, h)."""
        w_in, w_out, log_q = (t.to(x.dtype) for t in self.coefficients())
        return recurrent_step(x, h, w_in, w_out, log_q)

    def step(self, x: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The naive recurrence for one token: x (B, D) → (X'_t (B, D), new state (B, D, h))."""
        out, new_state = self.forward(
            x.unsqueeze(1),
            state=state if state is not None else self.initial_state(x.shape[0], x),
        )
        return out[:, 0], new_state

    def initial_state(self, batch_size: int, like: Tensor) -> Tensor:
        """A zero state h_0 of shape (B, D, h) with `like`'s dtype and device."""
        return like.new_zeros(batch_size, self.d_model, self.ema_dim)
