"""S4D: a diagonal state space kernel (Gu et al., NeurIPS 2022), for SeqBoat's "SSM with S4D"
ablation (Table 7), with the interface of Mega's `DampedEMA`.

For each channel d and each of the N/2 complex modes n (conjugate pairs: N real dimensions), the
zero-order-hold discretisation of x'(t) = A x(t) + B u(t), y = Re(C x) with B = 1 gives

    𝒦[d, l] = 2 Re( Σ_n C_{d,n} · (exp(Δ_d A_{d,n}) − 1) / A_{d,n} · exp(Δ_d A_{d,n})^l ),

and the sub-layer returns SiLU(𝒦 * x̃ + D ⊙ x) like the EMA (x̃: padded positions zeroed, D ⊙ x
on the unmasked input). S4D-Lin initialisation: A = −½ + iπn, log Δ ~ U(log 10⁻³, log 10⁻¹),
C ~ CN(0, 1), D ~ N(0, 1). Bidirectional: a second parameter set runs backwards in time, both
sums including the current token (the EMA's convention); with `shift=True` the backward sum
starts at x_{t+1} instead, as the S4 repository's bidirectional convolution
(Σ_{m≥0} 𝒦_fwd[m] x̃_{t−m} + Σ_{m≥0} 𝒦_bwd[m] x̃_{t+1+m}). `silu=False` returns 𝒦 * x̃ + D ⊙ x
without the SiLU (the S4 repository's layer, which applies its own activation afterwards). The
kernel, the FFT convolution and the streaming state come from `megalab.nn.ema_kernel` (complex
decays).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.nn.carried import CarriedLayer
from megalab.nn.ema_kernel import (
    ema_kernel,
    next_fast_len,
    recurrent_step,
    state_after,
    state_decay,
    state_readout,
)
from megalab.nn.fft_conv import fft_conv_lean, fold_directions, rfft_lean
from megalab.nn.masking import zero_pads


class S4D(CarriedLayer[Tensor]):
    """SiLU(𝒦 * x̃ + D ⊙ x) with an S4D kernel, batch-first (B, L, D).

    Args:
        d_model: channels.  state_dim: N, the real state size (N/2 complex modes).
        bidirectional: add a backward kernel set (encoders).
        truncation: keep the first `truncation` taps in the stateless pass.
        dt_min, dt_max: range of the initial step sizes Δ (log-uniform).
        shift: bidirectional only: the backward kernel starts at x_{t+1} (the S4 repository).
        silu: apply SiLU to the output (SeqBoat); False returns 𝒦 * x̃ + D ⊙ x (S4).
    """

    def __init__(
        self,
        d_model: int,
        state_dim: int = 16,
        bidirectional: bool = False,
        truncation: int | None = None,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        shift: bool = False,
        silu: bool = True,
    ) -> None:
        super().__init__()
        if state_dim < 2 or state_dim % 2:
            raise ValueError(f"S4D needs an even state_dim >= 2 (conjugate pairs), got {state_dim}")
        if truncation is not None and truncation <= 0:
            raise ValueError(f"truncation must be positive or None, got {truncation}")
        if shift and not bidirectional:
            raise ValueError("shift=True delays the backward kernel: it needs bidirectional=True")
        self.d_model = d_model
        self.state_dim = state_dim
        self.bidirectional = bidirectional
        self.causal = not bidirectional
        self.truncation = truncation
        self.shift, self.silu = shift, silu
        rows, modes = (2 * d_model if bidirectional else d_model), state_dim // 2
        self.log_dt = nn.Parameter(torch.empty(rows))
        self.log_A_real = nn.Parameter(torch.empty(rows, modes))
        self.A_imag = nn.Parameter(torch.empty(rows, modes))
        self.C = nn.Parameter(torch.empty(rows, modes, 2))  # complex C as (real, imag)
        self.omega = nn.Parameter(torch.empty(d_model))
        self.dt_min, self.dt_max = dt_min, dt_max
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """S4D-Lin: A = −½ + iπn, log Δ uniform, C ~ CN(0, 1), D ~ N(0, 1)."""
        with torch.no_grad():
            lo, hi = math.log(self.dt_min), math.log(self.dt_max)
            self.log_dt.uniform_(lo, hi)
            self.log_A_real.fill_(math.log(0.5))
            modes = self.A_imag.shape[1]
            self.A_imag.copy_(math.pi * torch.arange(modes).expand_as(self.A_imag))
            self.C.normal_(0.0, 0.5**0.5)
            self.omega.normal_(0.0, 1.0)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, state_dim={self.state_dim}, "
            f"bidirectional={self.bidirectional}, truncation={self.truncation}"
            + (", shift=True" if self.shift else "")
            + ("" if self.silu else ", silu=False")
        )

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        """(w_in, w_out, log q), each (D', N/2) complex: (e^{ΔA} − 1)/A, 2C, ΔA."""
        A = torch.complex(-self.log_A_real.exp(), self.A_imag)
        dtA = self.log_dt.exp().unsqueeze(-1) * A
        return (dtA.exp() - 1) / A, 2 * torch.view_as_complex(self.C.contiguous()), dtA

    def kernel(self, length: int) -> Tensor:
        """The real (D', length) kernel."""
        return ema_kernel(*self.coefficients(), length).real

    def advance(
        self, x: Tensor, mask: Tensor | None, state: Tensor | None, want_state: bool
    ) -> tuple[Tensor, Tensor | None]:
        """SiLU(𝒦 * x̃ + D ⊙ x) (without SiLU when `silu=False`); with a (B, D, N/2) complex
        state (causal only) the exact recurrence continues a stream (no truncation), as
        `DampedEMA`."""
        L, D = x.shape[1:]
        cdt = torch.promote_types(x.dtype, torch.float32)
        residual = x.to(cdt) * self.omega
        x_tilde = zero_pads(x, mask)
        with torch.autocast(device_type=x.device.type, enabled=False):
            xt = x_tilde.to(cdt).transpose(1, 2)
            w_in, w_out, log_q = (t.to(torch.promote_types(cdt, torch.complex64)) for t in
                                  self.coefficients())  # fmt: skip
            if state is not None and L == 1:
                y, new_state = recurrent_step(xt[..., 0], state, w_in, w_out, log_q)
                y = y.real.to(cdt).unsqueeze(-1)
            else:
                K = L if (state is not None or self.truncation is None) else min(self.truncation, L)
                k = ema_kernel(w_in, w_out, log_q, K).real.to(cdt)
                if self.shift:  # Σ_m k_bwd[m] x_{t+1+m}: the backward kernel one tap later
                    k = torch.cat([F.pad(k[:D], (0, 1)), F.pad(k[D:], (1, 0))])
                n_fft = next_fast_len(L + K - 1 + int(self.shift))
                spec = rfft_lean(k, n_fft)
                if self.bidirectional:
                    spec = fold_directions(spec, D)
                y = fft_conv_lean(xt, spec, n_fft)
                new_state = None
                if want_state:
                    new_state = state_after(xt, w_in, log_q)
                    if state is not None:
                        y = y + state_readout(state, w_out, log_q, L).real.to(cdt)
                        new_state = new_state + state_decay(state, log_q, L)
        out = y.transpose(1, 2) + residual
        out = (F.silu(out) if self.silu else out).to(x.dtype)
        return out, new_state

    def initial_state(self, batch_size: int, like: Tensor) -> Tensor:
        """A zero (B, D, N/2) complex state."""
        dtype = torch.promote_types(torch.promote_types(like.dtype, torch.float32), torch.complex64)
        return torch.zeros(batch_size, self.d_model, self.state_dim // 2, dtype=dtype,
                           device=like.device)  # fmt: skip
