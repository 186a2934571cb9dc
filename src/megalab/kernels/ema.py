"""Triton kernels for the Vandermonde sums of Mega's EMA and Megalodon's CEMA, forward and backward.

Every EMA quantity that costs the powers of the decay over the whole length is one of two sums
(`megalab.nn.ema_kernel` is the PyTorch reference and the CPU path), with z[d, n, t] = q^{e(t)} =
exp(e(t) · log q[d, n]) and the exponent e(t) = base + t, or base + L − 1 − t (`reverse`):

    apply:   out[g, d, t] = Re Σ_n c[g, d, n] · z[d, n, t]       the kernel 𝒦 (G = 1, base 0) and
                                                                 the carried state's read-out
                                                                 (c = η ⊙ h₀, G = B, base 1)
    reduce:  out[g, d, n] = Σ_t x[g, d, t] · z[d, n, t]         the state after a segment
                                                                 (reverse: Σ_t x_t q^{L−1−t})

They are each other's transpose, so each one's backward is the other plus the derivative in log q,
Σ_t w_t · e(t) · z_t, computed in the same pass. A program holds a tile of (t, n) powers in
registers and never writes it: the (D, N, L) tensor of powers exists neither in memory nor among
the tensors autograd keeps, which are the (D, N) coefficients and decays (and, for `reduce`, its
input). Powers are exp(e · log q) in float32 from the stable log q of `log_decay`, as the
reference's; long sums over t are compensated (Kahan) float32 sums.

Gradients with complex tensors follow PyTorch's convention (grad = ∂L/∂Re + i ∂L/∂Im): for the
real `apply`, ∂/∂c = conj(Σ_t g_t z_t) and ∂/∂log q = Σ_g conj(c · Σ_t g_t e_t z_t); for the
holomorphic `reduce`, ∂/∂x_t = Re Σ_n conj(g_n) z_t (an `apply`) and ∂/∂log q = g · conj(Σ_t x_t
e_t z_t).

Only float32 (complex64) runs here; `megalab.nn.ema_kernel.ema_ops` picks this module or
the reference. The convolution itself stays `torch.fft` (cuFFT on a GPU).
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from torch import Tensor
from torch.autograd.function import once_differentiable

from megalab.kernels import LAUNCH_OPTIONS

__all__ = [
    "ema_kernel",
    "log_decay",
    "skip_output",
    "state_after",
    "state_decay",
    "state_readout",
    "vandermonde_apply",
    "vandermonde_reduce",
]

_BLOCK_T_APPLY = 64
_BLOCK_T_REDUCE = 128


@triton.jit
def _kahan(total: tl.tensor, comp: tl.tensor, value: tl.tensor) -> tuple[tl.tensor, tl.tensor]:
    """total + value with the running compensation `comp` (Kahan summation)."""
    y = value - comp
    s = total + y
    return s, (s - total) - y


@triton.jit
def _exponents(
    t: tl.tensor, t_ok: tl.tensor, base: tl.tensor, L: tl.tensor, REVERSE: tl.constexpr
) -> tl.tensor:
    """e(t) = base + t, or base + L − 1 − t (REVERSE), in float32; 0 past the end."""
    if REVERSE:
        return tl.where(t_ok, base + L - 1 - t, 0).to(tl.float32)
    return tl.where(t_ok, base + t, 0).to(tl.float32)


@triton.jit
def _load_log_q(
    q_ptr: tl.tensor, d: tl.tensor, n: tl.tensor, N: tl.tensor, n_ok: tl.tensor,
    COMPLEX: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:  # fmt: skip
    """(log |q|, arg q) of row d at n (real q: (log q, log q), the second unused)."""
    if COMPLEX:
        log_abs = tl.load(q_ptr + (d * N + n) * 2, mask=n_ok, other=0.0)
        theta = tl.load(q_ptr + (d * N + n) * 2 + 1, mask=n_ok, other=0.0)
        return log_abs, theta
    log_q = tl.load(q_ptr + d * N + n, mask=n_ok, other=0.0)
    return log_q, log_q


@triton.jit
def _apply_kernel(
    c_ptr: tl.tensor,  # (G·D, N) float32, or (G·D, N, 2) interleaved complex
    q_ptr: tl.tensor,  # (D, N) log q, or (D, N, 2) interleaved complex
    out_ptr: tl.tensor,  # (G·D, L) float32
    D: tl.tensor,
    N: tl.tensor,
    L: tl.tensor,
    base: tl.tensor,
    REVERSE: tl.constexpr,
    COMPLEX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)  # g·D + d
    d = row % D
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < L
    e = _exponents(t, t_ok, base, L, REVERSE)
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < N
        log_abs, theta = _load_log_q(q_ptr, d, n, N, n_ok, COMPLEX)
        if COMPLEX:
            c_re = tl.load(c_ptr + (row * N + n) * 2, mask=n_ok, other=0.0)
            c_im = tl.load(c_ptr + (row * N + n) * 2 + 1, mask=n_ok, other=0.0)
            z = tl.exp(e[:, None] * log_abs[None, :])
            angle = e[:, None] * theta[None, :]
            term = z * (c_re[None, :] * tl.cos(angle) - c_im[None, :] * tl.sin(angle))
        else:
            c = tl.load(c_ptr + row * N + n, mask=n_ok, other=0.0)
            term = c[None, :] * tl.exp(e[:, None] * log_abs[None, :])
        acc += tl.sum(term, axis=1)
    tl.store(out_ptr + row * L + t, acc, mask=t_ok)


@triton.jit
def _reduce_kernel(
    w_ptr: tl.tensor,  # (G·D, L) float32
    q_ptr: tl.tensor,  # (D, N) log q, or (D, N, 2) interleaved complex
    s0_ptr: tl.tensor,  # (G·D, N) Σ_t w z, or (G·D, N, 2) complex
    s1_ptr: tl.tensor,  # (G·D, N) Σ_t w e z, or (G·D, N, 2) complex (written when WITH_S1)
    D: tl.tensor,
    N: tl.tensor,
    L: tl.tensor,
    base: tl.tensor,
    REVERSE: tl.constexpr,
    COMPLEX: tl.constexpr,
    WITH_S1: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    d = row % D
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    log_abs, theta = _load_log_q(q_ptr, d, n, N, n_ok, COMPLEX)
    zero = tl.zeros((BLOCK_N,), dtype=tl.float32)
    s0_re, s0_im, s1_re, s1_im = zero, zero, zero, zero
    k0_re, k0_im, k1_re, k1_im = zero, zero, zero, zero  # Kahan compensations
    for t0 in range(0, L, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < L
        w = tl.load(w_ptr + row * L + t, mask=t_ok, other=0.0).to(tl.float32)
        e = _exponents(t, t_ok, base, L, REVERSE)
        wz = w[:, None] * tl.exp(e[:, None] * log_abs[None, :])
        if COMPLEX:
            angle = e[:, None] * theta[None, :]
            cos = tl.cos(angle)
            sin = tl.sin(angle)
            s0_re, k0_re = _kahan(s0_re, k0_re, tl.sum(wz * cos, axis=0))
            s0_im, k0_im = _kahan(s0_im, k0_im, tl.sum(wz * sin, axis=0))
            if WITH_S1:
                ewz = e[:, None] * wz
                s1_re, k1_re = _kahan(s1_re, k1_re, tl.sum(ewz * cos, axis=0))
                s1_im, k1_im = _kahan(s1_im, k1_im, tl.sum(ewz * sin, axis=0))
        else:
            s0_re, k0_re = _kahan(s0_re, k0_re, tl.sum(wz, axis=0))
            if WITH_S1:
                s1_re, k1_re = _kahan(s1_re, k1_re, tl.sum(e[:, None] * wz, axis=0))
    if COMPLEX:
        tl.store(s0_ptr + (row * N + n) * 2, s0_re, mask=n_ok)
        tl.store(s0_ptr + (row * N + n) * 2 + 1, s0_im, mask=n_ok)
        if WITH_S1:
            tl.store(s1_ptr + (row * N + n) * 2, s1_re, mask=n_ok)
            tl.store(s1_ptr + (row * N + n) * 2 + 1, s1_im, mask=n_ok)
    else:
        tl.store(s0_ptr + row * N + n, s0_re, mask=n_ok)
        if WITH_S1:
            tl.store(s1_ptr + row * N + n, s1_re, mask=n_ok)


# --------------------------------------------------------------------------------- launchers
def _planes(t: Tensor) -> Tensor:
    """A float32 tensor the kernels read: complex as interleaved (re, im) pairs."""
    t = t.resolve_conj().contiguous()
    return torch.view_as_real(t) if t.is_complex() else t


def _block_n(N: int) -> int:
    return min(triton.next_power_of_2(max(N, 1)), 32)


def _check(log_q: Tensor) -> None:
    if log_q.dim() != 2 or log_q.dtype not in (torch.float32, torch.complex64):
        raise ValueError(
            f"the Triton EMA kernels take log q as a (D, N) float32 or complex64 tensor, got "
            f"{tuple(log_q.shape)} {log_q.dtype}; use megalab.nn.ema_kernel for other dtypes"
        )


def _launch_apply(c: Tensor, log_q: Tensor, length: int, base: int, reverse: bool) -> Tensor:
    """Re Σ_n c[g, d, n] q[d, n]^{e(t)} for c (G, D, N) of log_q's kind: (G, D, length)."""
    G, D, N = c.shape
    out = torch.empty(G, D, length, device=c.device, dtype=torch.float32)
    if length == 0 or G * D == 0:
        return out
    grid = (G * D, triton.cdiv(length, _BLOCK_T_APPLY))
    _apply_kernel[grid](
        _planes(c), _planes(log_q), out, D, N, length, base,
        REVERSE=reverse, COMPLEX=log_q.is_complex(), BLOCK_T=_BLOCK_T_APPLY, BLOCK_N=_block_n(N),
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return out


def _launch_reduce(
    w: Tensor, log_q: Tensor, base: int, reverse: bool, with_s1: bool
) -> tuple[Tensor, Tensor | None]:
    """(Σ_t w z, Σ_t w e z) over t for w (G, D, L) real: each (G, D, N), complex if log_q is."""
    G, D, L = w.shape
    N = log_q.shape[-1]
    dtype = torch.complex64 if log_q.is_complex() else torch.float32
    s0 = torch.zeros(G, D, N, device=w.device, dtype=dtype)
    s1 = torch.zeros_like(s0) if with_s1 else None
    if G * D * N == 0 or L == 0:
        return s0, s1
    block_n = _block_n(N)
    grid = (G * D, triton.cdiv(N, block_n))
    s0_planes = _planes(s0)
    _reduce_kernel[grid](
        w.contiguous().float(), _planes(log_q), s0_planes,
        _planes(s1) if s1 is not None else s0_planes, D, N, L, base,
        REVERSE=reverse, COMPLEX=log_q.is_complex(), WITH_S1=with_s1,
        BLOCK_T=_BLOCK_T_REDUCE, BLOCK_N=block_n, **LAUNCH_OPTIONS,
    )  # fmt: skip
    return s0, s1


def _like(grad: Tensor, t: Tensor) -> Tensor:
    """`grad` in t's kind: its real part for a real t, complex for a complex one."""
    if not t.is_complex():
        return grad.real if grad.is_complex() else grad
    return grad.to(t.dtype)


def _as(c: Tensor, like: Tensor) -> Tensor:
    """c in like's kind, float32: Re c for a real `like` (only Re c reaches a real sum)."""
    if like.is_complex():
        return c.to(torch.complex64)
    return (c.real if c.is_complex() else c).float()


class _Apply(torch.autograd.Function):
    """out[g, d, t] = Re Σ_n c[g, d, n] q[d, n]^{e(t)}; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any, c: Tensor, log_q: Tensor, length: int, base: int, reverse: bool
    ) -> Tensor:
        ctx.save_for_backward(c, log_q)
        ctx.base, ctx.reverse = base, reverse
        return _launch_apply(_as(c, log_q), log_q, length, base, reverse)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        c, log_q = ctx.saved_tensors
        need_q = ctx.needs_input_grad[1]
        s0, s1 = _launch_reduce(grad, log_q, ctx.base, ctx.reverse, with_s1=need_q)
        grad_c = _like(s0.conj(), c) if ctx.needs_input_grad[0] else None
        grad_q = None
        if need_q:
            assert s1 is not None
            grad_q = _like((_as(c, s1) * s1).conj().sum(0), log_q)
        return grad_c, grad_q, None, None, None


class _Reduce(torch.autograd.Function):
    """out[g, d, n] = Σ_t x[g, d, t] q[d, n]^{e(t)}; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, log_q: Tensor, base: int, reverse: bool) -> Tensor:
        ctx.save_for_backward(x, log_q)
        ctx.base, ctx.reverse = base, reverse
        return _launch_reduce(x, log_q, base, reverse, with_s1=False)[0]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, log_q = ctx.saved_tensors
        grad_x = grad_q = None
        if ctx.needs_input_grad[0]:
            L = x.shape[-1]
            grad_x = _launch_apply(grad.conj(), log_q, L, ctx.base, ctx.reverse).to(x.dtype)
        if ctx.needs_input_grad[1]:
            _, s1 = _launch_reduce(x, log_q, ctx.base, ctx.reverse, with_s1=True)
            assert s1 is not None
            grad_q = _like((grad * s1.conj()).sum(0), log_q)
        return grad_x, grad_q, None, None


# --------------------------------------------------------------------------------- the EMA API
def vandermonde_apply(coef: Tensor, log_q: Tensor, length: int, offset: int = 0) -> Tensor:
    """out[..., d, l] = Re Σ_n coef[..., d, n] · q[d, n]^(l + offset) for l < length (real).

    `megalab.nn.ema_kernel.vandermonde_apply` keeps the complex sum; every EMA reads its real
    part only. coef: (..., D, N); log_q: (D, N) float32 or complex64.
    """
    _check(log_q)
    lead = coef.shape[:-2]
    c = coef.reshape(-1, *coef.shape[-2:])
    out = _Apply.apply(c, log_q, length, offset, False)
    return out.reshape(*lead, *out.shape[-2:])


def vandermonde_reduce(x: Tensor, log_q: Tensor, reverse: bool = False) -> Tensor:
    """out[..., d, n] = Σ_l x[..., d, l] · q[d, n]^l (q^{L−1−l} when `reverse`), x real."""
    _check(log_q)
    lead = x.shape[:-2]
    out = _Reduce.apply(x.reshape(-1, *x.shape[-2:]), log_q, 0, reverse)
    return out.reshape(*lead, *out.shape[-2:])


def ema_kernel(w_in: Tensor, w_out: Tensor, log_q: Tensor, length: int) -> Tensor:
    """The real (D, length) kernel 𝒦[d, l] = Re Σ_n w_out·w_in·q^l."""
    return vandermonde_apply(w_in * w_out, log_q, length)


def state_after(x: Tensor, w_in: Tensor, log_q: Tensor) -> Tensor:
    """h_{L−1} from a zero start: Σ_t w_in ⊙ x_t q^{L−1−t}. x (B, D, L) -> (B, D, N)."""
    return w_in * vandermonde_reduce(x, log_q, reverse=True)


def state_readout(h: Tensor, w_out: Tensor, log_q: Tensor, length: int) -> Tensor:
    """The carried state's contribution Re Σ_n w_out q^{t+1} h_n for t < length: (B, D, length)."""
    return vandermonde_apply(h * w_out, log_q, length, offset=1)


def state_decay(h: Tensor, log_q: Tensor, length: int) -> Tensor:
    """q^length ⊙ h: (D, N) powers, as cheap in PyTorch as in a kernel."""
    return torch.exp(length * log_q) * h


# --------------------------------------------------------------------------------- the output
@triton.jit
def _skip_tile(
    L: tl.tensor, D: tl.tensor, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """This program's (batch, steps, features) of a (B, L, D) tensor, the in-range mask and the
    offsets of the tile in a contiguous (B, L, D) tensor."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (t < L)[:, None] & (d < D)[None, :]
    return b, t, d, ok, (b * L + t[:, None]) * D + d[None, :]


@triton.jit
def _skip_fwd_kernel(
    y_ptr: tl.tensor,  # (B, D, L) float32, any strides: the EMA term
    x_ptr: tl.tensor,  # (B, L, D) any strides, any float dtype: the skip input
    w_ptr: tl.tensor,  # (D,) float32: ω
    out_ptr: tl.tensor,  # (B, L, D) contiguous, the output dtype
    pre_ptr: tl.tensor,  # (B, L, D) contiguous float32: the pre-activation (written when SAVE_PRE)
    L: tl.tensor,
    D: tl.tensor,
    sy_b: tl.tensor,
    sy_d: tl.tensor,
    sy_t: tl.tensor,
    sx_b: tl.tensor,
    sx_t: tl.tensor,
    sx_d: tl.tensor,
    SILU: tl.constexpr,
    SAVE_PRE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    b, t, d, ok, offsets = _skip_tile(L, D, BLOCK_T, BLOCK_D)
    y = tl.load(y_ptr + b * sy_b + d[None, :] * sy_d + t[:, None] * sy_t, mask=ok, other=0.0)
    x = tl.load(x_ptr + b * sx_b + t[:, None] * sx_t + d[None, :] * sx_d, mask=ok, other=0.0)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0)
    pre = y + x.to(tl.float32) * w[None, :]
    if SAVE_PRE:
        tl.store(pre_ptr + offsets, pre, mask=ok)
    out = pre
    if SILU:
        out = pre * tl.sigmoid(pre)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _skip_bwd_kernel(
    g_ptr: tl.tensor,  # (B, L, D) any strides: the output's gradient
    pre_ptr: tl.tensor,  # (B, L, D) contiguous float32 (read when SILU)
    w_ptr: tl.tensor,  # (D,) float32
    dy_ptr: tl.tensor,  # (B, D, L) contiguous float32
    dx_ptr: tl.tensor,  # (B, L, D) contiguous, x's dtype
    L: tl.tensor,
    D: tl.tensor,
    sg_b: tl.tensor,
    sg_t: tl.tensor,
    sg_d: tl.tensor,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    b, t, d, ok, offsets = _skip_tile(L, D, BLOCK_T, BLOCK_D)
    g = tl.load(g_ptr + b * sg_b + t[:, None] * sg_t + d[None, :] * sg_d, mask=ok, other=0.0)
    g = g.to(tl.float32)
    if SILU:
        pre = tl.load(pre_ptr + offsets, mask=ok, other=0.0)
        s = tl.sigmoid(pre)
        g = g * s * (1.0 + pre * (1.0 - s))  # d/dp p·σ(p)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0)
    tl.store(dy_ptr + (b * D + d[None, :]) * L + t[:, None], g, mask=ok)
    tl.store(dx_ptr + offsets, (g * w[None, :]).to(dx_ptr.dtype.element_ty), mask=ok)


_BLOCK_T_SKIP = 32
_BLOCK_D_SKIP = 32


class _SkipOutput(torch.autograd.Function):
    """act(yᵀ + ω ⊙ x) in one pass; keeps x and, for SiLU, the float32 pre-activation."""

    @staticmethod
    def forward(
        ctx: Any,
        y: Tensor,
        x: Tensor,
        omega: Tensor,
        silu: bool,
        dtype: torch.dtype,
        save_pre: bool,
    ) -> Tensor:
        B, D, L = y.shape
        out = torch.empty(B, L, D, device=y.device, dtype=dtype)
        save_pre = silu and save_pre
        pre = torch.empty(B, L, D, device=y.device, dtype=torch.float32) if save_pre else out
        grid = (B, triton.cdiv(L, _BLOCK_T_SKIP), triton.cdiv(D, _BLOCK_D_SKIP))
        if out.numel():
            _skip_fwd_kernel[grid](
                y, x, omega, out, pre, L, D, *y.stride(), *x.stride(),
                SILU=silu, SAVE_PRE=save_pre, BLOCK_T=_BLOCK_T_SKIP, BLOCK_D=_BLOCK_D_SKIP,
                **LAUNCH_OPTIONS,
            )  # fmt: skip
        ctx.save_for_backward(x, omega, pre if save_pre else None)
        ctx.silu = silu
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        x, omega, pre = ctx.saved_tensors
        B, L, D = grad.shape
        dy = torch.empty(B, D, L, device=grad.device, dtype=torch.float32)
        dx = torch.empty(B, L, D, device=grad.device, dtype=x.dtype)
        grid = (B, triton.cdiv(L, _BLOCK_T_SKIP), triton.cdiv(D, _BLOCK_D_SKIP))
        if dy.numel():
            _skip_bwd_kernel[grid](
                grad, pre if ctx.silu else dy, omega, dy, dx, L, D, *grad.stride(),
                SILU=ctx.silu, BLOCK_T=_BLOCK_T_SKIP, BLOCK_D=_BLOCK_D_SKIP, **LAUNCH_OPTIONS,
            )  # fmt: skip
        grad_omega = (dy * x.transpose(1, 2)).sum((0, 2))  # Σ_{b,t} ∂pre · x
        return dy, dx, grad_omega, None, None, None


def skip_output(y: Tensor, x: Tensor, omega: Tensor, silu: bool, dtype: torch.dtype) -> Tensor:
    """act(yᵀ + ω ⊙ x) as (B, L, D) in `dtype`, act = SiLU or the identity; y (B, D, L) float32.

    One read of y and x and one write, where PyTorch runs a cast, a product, a transposed sum, the
    activation and a cast; the backward writes ∂y in y's (B, D, L) layout for the FFT.
    """
    if y.dtype != torch.float32 or omega.dtype != torch.float32:
        raise ValueError(
            f"the Triton EMA output takes a float32 EMA term and ω, got {y.dtype} and "
            f"{omega.dtype}; use megalab.nn.ema_kernel.skip_output for other dtypes"
        )
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (y, x, omega))
    return _SkipOutput.apply(y, x, omega, silu, dtype, backward)


# ---------------------------------------------------------------------------------- the decay
@triton.jit
def _log1p(u: tl.tensor) -> tl.tensor:
    """log(1 + u) for u > −1 to a few ulps (Goldberg's correction of the rounded 1 + u)."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@triton.jit
def _softplus(x: tl.tensor) -> tl.tensor:
    """log(1 + eˣ) without overflow; −softplus(−x) = log σ(x)."""
    return tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x)))


@triton.jit
def _log_decay_kernel(
    a_ptr: tl.tensor,  # (n,) float32: the α logits
    d_ptr: tl.tensor,  # (n,) float32: the δ logits
    out_ptr: tl.tensor,  # (n,) float32: log q (forward, written) or log q (backward, read)
    g_ptr: tl.tensor,  # (n,) float32: ∂/∂log q (read when BACKWARD)
    da_ptr: tl.tensor,  # (n,) float32: ∂/∂α logits (written when BACKWARD)
    dd_ptr: tl.tensor,  # (n,) float32: ∂/∂δ logits (written when BACKWARD)
    n: tl.tensor,
    BACKWARD: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    a = tl.load(a_ptr + offs, mask=ok, other=0.0)
    d = tl.load(d_ptr + offs, mask=ok, other=0.0)
    log_sig_a = -_softplus(-a)  # log σ(a)
    if BACKWARD:
        # ∂ log q/∂a = −σ(a)σ(−a)σ(d)/q, ∂/∂d = −σ(d)σ(−d)σ(a)/q, from logs (no overflow)
        log_q = tl.load(out_ptr + offs, mask=ok, other=0.0)
        g = tl.load(g_ptr + offs, mask=ok, other=0.0)
        common = log_sig_a - _softplus(-d) - log_q  # log(σ(a)σ(d)/q)
        tl.store(da_ptr + offs, -g * tl.exp(common - _softplus(a)), mask=ok)
        tl.store(dd_ptr + offs, -g * tl.exp(common - _softplus(d)), mask=ok)
    else:
        # q ≥ 1/2: log1p(−σ(a)σ(d)), exact to float32 rounding relative to log q however near
        # to 0 it is; q < 1/2: 1 − σ(a)σ(d) = σ(−a) + σ(a)σ(−d), two positive terms added in
        # logs (no underflow, however near to 0 q is)
        p = tl.sigmoid(a) * tl.sigmoid(d)
        x = -_softplus(a)
        y = log_sig_a - _softplus(d)
        log_small_q = tl.maximum(x, y) + _log1p(tl.exp(-tl.abs(x - y)))
        log_q = tl.where(p <= 0.5, _log1p(-tl.minimum(p, 0.5)), log_small_q)
        tl.store(out_ptr + offs, log_q, mask=ok)


_BLOCK_DECAY = 256


def _launch_log_decay(
    a: Tensor, d: Tensor, log_q: Tensor, grad: Tensor, da: Tensor, dd: Tensor, backward: bool
) -> None:
    """Forward: log q into `log_q` (the other tensors unread). Backward: ∂/∂a and ∂/∂d into da
    and dd, from `grad` and the saved log q."""
    n = a.numel()
    if n:
        _log_decay_kernel[(triton.cdiv(n, _BLOCK_DECAY),)](
            a, d, log_q, grad, da, dd, n, BACKWARD=backward, BLOCK=_BLOCK_DECAY, **LAUNCH_OPTIONS,
        )  # fmt: skip


class _LogDecay(torch.autograd.Function):
    """log(1 − σ(a)σ(d)) and its gradient, one launch each; keeps a, d and log q."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, d: Tensor) -> Tensor:
        log_q = torch.empty_like(a)
        _launch_log_decay(a, d, log_q, log_q, log_q, log_q, backward=False)
        ctx.save_for_backward(a, d, log_q)
        return log_q

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        a, d, log_q = ctx.saved_tensors
        da, dd = torch.empty_like(a), torch.empty_like(d)
        _launch_log_decay(a, d, log_q, grad.contiguous(), da, dd, backward=True)
        return da, dd


def log_decay(alpha_logit: Tensor, delta_logit: Tensor) -> Tensor:
    """log q = log(1 − σ(a)·σ(d)) for float32 logits, as `megalab.nn.ema_kernel.log_decay`.

    One kernel forward and one backward, where the reference's log-sum-exp, softpluses and their
    gradients are about 29 launches (each EMA layer, each step). Both forms are stable for any
    logits; they agree to float32 rounding (tests/kernels/test_ema.py).
    """
    if alpha_logit.dtype != torch.float32 or delta_logit.dtype != torch.float32:
        raise ValueError(
            f"the Triton decay takes float32 logits, got {alpha_logit.dtype} and "
            f"{delta_logit.dtype}; use megalab.nn.ema_kernel.log_decay for other dtypes"
        )
    a, d = torch.broadcast_tensors(alpha_logit, delta_logit)
    out: Tensor = _LogDecay.apply(a.contiguous(), d.contiguous())
    return out
