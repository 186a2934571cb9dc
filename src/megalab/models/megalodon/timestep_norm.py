"""Megalodon's timestep normalization (Ma et al. 2024, §3.2, eq. 4) and its non-causal twin.

TimestepNorm is GroupNorm made causal: the D features form G contiguous groups of D/G, and the
statistics of a group at step t cover every feature of the group at every (real) step ≤ t,

    μ_t = 1/(n_t·D/G) Σ_{i≤t} Σ_{j∈g} x_{i,j},   σ²_t = 1/(n_t·D/G) Σ_{i≤t} Σ_{j∈g} (x_{i,j} − μ_t)²
    y_t = (x_t − μ_t) / √(σ²_t + ε) · (1 + γ) + β                       (plus-1 scale, App. B.2)

with n_t the number of real steps so far (biased variance, ε = 1e-5 inside the root, as the
authors' code). Every step weighs the same (its D/G features), padded steps (mask False) are
skipped: they output 0 and leave the statistics unchanged. The statistics run over the whole
sequence, not per attention chunk, and carry across segments in a `TimestepNormState`
(count (B,), mean and var (B, G)), so streaming equals one pass; the same state is what
chunk-parallel training hands from rank to rank. A stream starts from count 0 (the code's
`prior_count = 0`, whose prior mean and variance then have no effect).

The learnable prior (the code's `prior_count > 0`): the statistics start from c₀ = prior_count
pseudo-steps of a learned per-group mean μ₀ (`prior_mean`, init 0) and variance exp(`prior_logv`)
(init 0, so 1), merged like carried statistics,

    μ_t = (c₀μ₀ + Σ_{i≤t} m_i) / (c₀ + n_t)
    σ²_t = (c₀(σ₀² + μ₀²) + Σ_{i≤t} (v_i + m_i²)) / (c₀ + n_t) − μ_t²

so the prior enters as the initial state (`initial_state`, and the fresh start of a stateless
pass), and gradients reach μ₀ and log σ₀². As in the code, `prior_count` is a buffer (a checkpoint
sets it) and the prior exists only when it is positive: a count-0 norm has neither.

Numerics. Each step contributes its group mean m_t and population variance v_t; merging them
equals the Chan/Welford update the code runs (with Kahan summation) in fp32. We compute the merge
in closed form with shifted sums, S1_t = Σ (m_i − K), S2_t = Σ (v_i + (m_i − K)²), with K the
first step's (or the carried) mean, so μ_t = K + S1_t/n_t and σ²_t = S2_t/n_t − (S1_t/n_t)² never
subtract two large E[x²] and E[x]² terms; the running sums accumulate in float64, which keeps
them accurate over millions of steps (tested at 1M), and everything else runs in the input's
precision, at least float32 (also under bf16 autocast). On CUDA the Triton kernel
(`megalab.kernels.timestep_norm`, switch "timestep_norm") computes the same in float32 alone,
with compensated block merges instead of float64 sums; this code stays the reference and the CPU
path.

`SequenceGroupNorm` is the classifier variants' GroupNorm (the paper replaces TimestepNorm with
"standard group normalization" for classification): the same groups and plus-1 affine, with
statistics over all real steps of the sequence (the authors' repository ships this op as
`group_sequence_norm`; Megalodon's model code does not use it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from megalab.kernels import use_kernel
from megalab.nn.state import register_state

__all__ = ["SequenceGroupNorm", "TimestepNorm", "TimestepNormState"]


@register_state
@dataclass
class TimestepNormState:
    """Running statistics of a `TimestepNorm`: steps seen `count` (B,) int64, per-group `mean`
    and population `var` (B, G)."""

    count: Tensor
    mean: Tensor
    var: Tensor


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 for the running sums (MPS has no float64: float32 there)."""
    return torch.float32 if device.type == "mps" else torch.float64


class _GroupStatsNorm(nn.Module):
    """Shared parts: groups, plus-1 affine (γ, β zero-initialised), per-step group statistics."""

    def __init__(self, d_model: int, num_groups: int, eps: float = 1e-5, affine: bool = True):
        super().__init__()
        if num_groups < 1 or d_model % num_groups:
            raise ValueError(
                f"{type(self).__name__}: d_model={d_model} must be a multiple of "
                f"num_groups={num_groups} (the groups are contiguous slices of the features)"
            )
        self.d_model = d_model
        self.num_groups = num_groups
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d_model)) if affine else None
        self.bias = nn.Parameter(torch.zeros(d_model)) if affine else None

    def extra_repr(self) -> str:
        return f"{self.d_model}, num_groups={self.num_groups}, eps={self.eps}"

    def _step_stats(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, L, D) in float -> grouped x (B, L, G, D/G), step mean and variance (B, L, G)."""
        B, L, D = x.shape
        if self.d_model != D:
            raise ValueError(f"{type(self).__name__} expects {self.d_model} features, got {D}")
        xg = x.view(B, L, self.num_groups, D // self.num_groups)
        m = xg.mean(-1)
        # Two-pass population variance (torch.var is ~10x slower on CPU for short groups).
        return xg, m, (xg - m.unsqueeze(-1)).square().mean(-1)

    def _normalize(self, xg: Tensor, mean: Tensor, var: Tensor, mask: Tensor | None) -> Tensor:
        """(x − μ)/√(σ² + ε)·(1 + γ) + β, zero at padded steps: (B, L, D)."""
        B, L = xg.shape[:2]
        y = ((xg - mean.unsqueeze(-1)) * torch.rsqrt(var + self.eps).unsqueeze(-1)).view(B, L, -1)
        if self.weight is not None:
            assert self.bias is not None  # weight and bias are created together
            y = y * (1.0 + self.weight.to(y.dtype)) + self.bias.to(y.dtype)
        if mask is not None:
            y = torch.where(mask.unsqueeze(-1), y, torch.zeros((), dtype=y.dtype, device=y.device))
        return y


class TimestepNorm(_GroupStatsNorm):
    """Causal group norm with cumulative statistics and a carried state (`StreamingNorm`).

    `norm(x, mask=None, state=None) -> (y, new_state)`: x (B, L, D), mask (B, L) True at real
    steps; the new state is returned when a state is passed (start a stream from
    `initial_state`).

    Args:
        d_model: features D.  num_groups: G (D/G features per group; 64 in the 7B code).
        eps: inside the square root.  affine: learn the plus-1 scale and the bias.
        prior_count: c₀ > 0 adds the code's learnable prior: `prior_mean` and `prior_logv`
            (G,) parameters, zero-initialised, that start the statistics (module docstring).
    """

    prior_count: Tensor | None
    prior_mean: nn.Parameter | None
    prior_logv: nn.Parameter | None

    def __init__(
        self,
        d_model: int,
        num_groups: int,
        eps: float = 1e-5,
        affine: bool = True,
        prior_count: int = 0,
    ) -> None:
        super().__init__(d_model, num_groups, eps=eps, affine=affine)
        if prior_count < 0:
            raise ValueError(f"prior_count must be >= 0 (0: no prior), got {prior_count}")
        if prior_count > 0:
            self.register_buffer("prior_count", torch.tensor(prior_count, dtype=torch.int64))
            self.prior_mean = nn.Parameter(torch.zeros(num_groups))
            self.prior_logv = nn.Parameter(torch.zeros(num_groups))
        else:
            self.prior_count = self.prior_mean = self.prior_logv = None

    def extra_repr(self) -> str:
        prior = "" if self.prior_count is None else f", prior_count={int(self.prior_count)}"
        return super().extra_repr() + prior

    def _prior_state(self, batch_size: int, like: Tensor) -> TimestepNormState | None:
        """The learned prior as carried statistics (count c₀, mean μ₀, var exp(log σ₀²))."""
        if self.prior_count is None:
            return None
        assert self.prior_mean is not None and self.prior_logv is not None
        dtype = torch.promote_types(like.dtype, torch.float32)
        B, G = batch_size, self.num_groups
        return TimestepNormState(
            self.prior_count.to(like.device).expand(B).clone(),
            self.prior_mean.to(dtype).expand(B, G),
            self.prior_logv.to(dtype).exp().expand(B, G),
        )

    def initial_state(self, batch_size: int, like: Tensor) -> TimestepNormState:
        """Count 0 (mean 0 and variance 1, unused while the count is 0), or the learned prior."""
        prior = self._prior_state(batch_size, like)
        if prior is not None:
            return prior
        dtype = torch.promote_types(like.dtype, torch.float32)
        G = self.num_groups
        return TimestepNormState(
            torch.zeros(batch_size, dtype=torch.int64, device=like.device),
            torch.zeros(batch_size, G, dtype=dtype, device=like.device),
            torch.ones(batch_size, G, dtype=dtype, device=like.device),
        )

    def forward(
        self, x: Tensor, mask: Tensor | None = None, state: TimestepNormState | None = None
    ) -> tuple[Tensor, TimestepNormState | None]:
        cdt = torch.promote_types(x.dtype, torch.float32)
        if cdt == torch.float32 and use_kernel("timestep_norm", x):
            return self._kernel_forward(x, mask, state)
        with torch.autocast(device_type=x.device.type, enabled=False):
            xg, m, v = self._step_stats(x.to(cdt))
            start = state if state is not None else self._prior_state(x.shape[0], x)
            mean, var, new_state = cumulative_stats(m, v, mask, start)
            if state is None:  # a stateless pass (from the prior or count 0) returns no state
                new_state = None
            y = self._normalize(xg, mean.to(cdt), var.to(cdt), mask)
        if new_state is not None:
            new_state = TimestepNormState(new_state.count, new_state.mean.to(cdt),
                                          new_state.var.to(cdt))  # fmt: skip
        return y.to(x.dtype), new_state

    def _kernel_forward(
        self, x: Tensor, mask: Tensor | None, state: TimestepNormState | None
    ) -> tuple[Tensor, TimestepNormState | None]:
        """The Triton kernel (`megalab.kernels.timestep_norm`): float32 statistics, compensated
        sums, no float64; same results as the PyTorch path below."""
        from megalab.kernels.timestep_norm import timestep_norm

        if self.d_model != x.shape[-1]:
            raise ValueError(f"{type(self).__name__} expects {self.d_model} features, "
                             f"got {x.shape[-1]}")  # fmt: skip
        # A fresh stream starts from the learned prior where there is one (as the path below).
        start = state if state is not None else self._prior_state(x.shape[0], x)
        count, mean0, var0 = (
            (start.count, start.mean.contiguous(), start.var.contiguous())
            if start is not None
            else (None,) * 3
        )
        with torch.autocast(device_type=x.device.type, enabled=False):
            y, mean, var = timestep_norm(
                x, self.weight, self.bias, mask, count, mean0, var0, self.num_groups, self.eps
            )
        if state is None:
            return y, None
        count = state.count + (mask.sum(dim=1) if mask is not None else x.shape[1])
        return y, TimestepNormState(count, mean, var)


def cumulative_stats(
    m: Tensor, v: Tensor, mask: Tensor | None, state: TimestepNormState | None
) -> tuple[Tensor, Tensor, TimestepNormState | None]:
    """Causal merge of per-step group statistics.

    m, v: (B, L, G) step means and population variances; mask (B, L) True at real steps; state:
    the carried (count, mean, var), or None for a fresh start. Returns the mean and variance
    after each step (B, L, G, in the accumulation dtype) and, when a state is passed, the state
    after the last step (in the accumulation dtype; counts int64).
    """
    B, L, G = m.shape
    acc = _accumulation_dtype(m.device)
    m, v = m.to(acc), v.to(acc)
    valid = torch.ones(B, L, dtype=torch.bool, device=m.device) if mask is None else mask.bool()
    valid3 = valid.unsqueeze(-1)
    zero = torch.zeros((), dtype=acc, device=m.device)
    # The shift K: the carried mean, or the first real step's mean (no gradient needed: the
    # result does not depend on K).
    first = valid.to(torch.int8).argmax(dim=1)  # (B,): 0 when a row has no real step
    m_first = m.gather(1, first.view(B, 1, 1).expand(B, 1, G)).squeeze(1)
    if state is not None:
        c0 = state.count.to(acc).unsqueeze(-1)  # (B, 1)
        mu0, var0 = state.mean.to(acc), state.var.to(acc)
    else:  # a fresh start: count 0 (the prior mean and variance then have no effect)
        c0 = torch.zeros(B, 1, dtype=acc, device=m.device)
        mu0 = torch.zeros(B, G, dtype=acc, device=m.device)
        var0 = torch.ones(B, G, dtype=acc, device=m.device)
    K = torch.where(c0 > 0, mu0, m_first).detach()
    d = torch.where(valid3, m - K.unsqueeze(1), zero)
    e = torch.where(valid3, v + d.square(), zero)
    n = c0.unsqueeze(1) + valid3.to(acc).cumsum(dim=1)  # (B, L, 1) real steps so far (+ prior)
    s1 = (c0 * (mu0 - K)).unsqueeze(1) + d.cumsum(dim=1)
    s2 = (c0 * (var0 + (mu0 - K).square())).unsqueeze(1) + e.cumsum(dim=1)
    inv_n = 1.0 / n.clamp_min(1.0)
    dm = s1 * inv_n
    mean = K.unsqueeze(1) + dm
    var = (s2 * inv_n - dm.square()).clamp_min(0.0)
    if state is None:
        return mean, var, None
    seen = n[:, -1] > 0  # (B, 1): any statistics at all (carried or new)
    new_state = TimestepNormState(
        state.count + valid.sum(dim=1),
        torch.where(seen, mean[:, -1], mu0),
        torch.where(seen, var[:, -1], var0),
    )
    return mean, var, new_state


class SequenceGroupNorm(_GroupStatsNorm):
    """Non-causal group norm over time: statistics over every real step of the sequence.

    The classifier variants' norm (bidirectional models). Same interface as `TimestepNorm`
    (`norm(x, mask) -> (y, None)`) but it carries no state and cannot be streamed.
    """

    def forward(
        self, x: Tensor, mask: Tensor | None = None, state: None = None
    ) -> tuple[Tensor, None]:
        if state is not None:
            raise ValueError(
                "SequenceGroupNorm uses the whole sequence's statistics and cannot be streamed; "
                "use TimestepNorm for a causal, stateful model"
            )
        cdt = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            xg, m, v = self._step_stats(x.to(cdt))
            if mask is None:
                mean = m.mean(dim=1, keepdim=True)
                var = (v + (m - mean).square()).mean(dim=1, keepdim=True)
            else:
                # `where`, not a product: padded steps may hold anything (also inf/NaN).
                real = mask.unsqueeze(-1)
                n = real.to(cdt).sum(dim=1, keepdim=True).clamp_min(1.0)
                mean = torch.where(real, m, 0.0).sum(dim=1, keepdim=True) / n
                dev = torch.where(real, v + (m - mean).square(), 0.0)
                var = dev.sum(dim=1, keepdim=True) / n
            y = self._normalize(xg, mean, var, mask)
        return y.to(x.dtype), None
