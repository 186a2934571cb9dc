"""Triton kernel for Megalodon's timestep norm
(`megalab.models.megalodon.timestep_norm.TimestepNorm`).

Same semantics as the PyTorch module, which stays the reference and the CPU path: for each
(batch, group) the statistics after step t cover the group's D/G features at every real step
≤ t plus the carried state (count c₀, mean μ₀, population variance σ₀²); padded steps output 0
and leave the statistics unchanged; biased variance, ε inside the root, plus-1 affine

    y_t = (x_t − μ_t) / √(σ²_t + ε) · (1 + γ) + β.

Forward: a chunked scan over the sequence, all float32 (no float64 anywhere), with the
sequence split into blocks of `BLOCK_T` steps.

1. `_fwd_block_stats`, one program per (block, batch·group): each step's group mean m_t and
   population variance v_t (two-pass over its D/G features), merged into the block's count,
   mean and M2 = Σ (v_t + (m_t − M)²) (per-step units: the variance is M2 / count).
2. `_fwd_scan_blocks`, one program per (batch·group): the carried state merged with the block
   totals by Chan's parallel-Welford update, `CHUNK` blocks at a time: a tree scan within the
   chunk (depth log₂ CHUNK), then the running totals take the chunk's total with their mean and
   M2 each kept as an unevaluated sum hi + lo (Neumaier/Kahan compensation), so the merges over
   the whole sequence lose no more than a rounding or two. It writes the statistics before each
   block (as pass 3's count, shift and shifted sums) and the state after the last.
3. `_fwd_normalize`, one program per (block, batch·group): a scan within the block from its
   prefix, with shifted sums as in the PyTorch code, S1_t = S1ₚ + Σ (m_i − K) and
   S2_t = S2ₚ + Σ (v_i + (m_i − K)²), K the prefix mean (the block's own mean when nothing
   precedes it), so μ_t = K + S1_t/n_t and σ²_t = S2_t/n_t − (S1_t/n_t)² sum only O(σ²) terms
   over at most BLOCK_T steps. It writes y and, for the backward, μ_t and r_t = 1/√(σ²_t + ε).

The authors' CUDA kernel runs a prefix scan over Welford states with Kahan-compensated updates in
fp32; this is the same arithmetic in a three-pass form. docs/kernels.md has the measured error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from torch import Tensor

from megalab.kernels import LAUNCH_OPTIONS

__all__ = ["timestep_norm"]


@triton.jit
def _block_program(
    G: tl.tensor, NBLK: tl.tensor
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """This program's (block, batch·group, batch, group): one flat grid of NBLK blocks per
    batch·group, so no per-axis limit on either."""
    pid = tl.program_id(0)
    bg = pid // NBLK
    return pid % NBLK, bg, bg // G, bg % G


@triton.jit
def _load_tile(
    x_ptr: tl.tensor, mask_ptr: tl.tensor, b: tl.tensor, g: tl.tensor, blk: tl.tensor, L: tl.tensor,
    D: tl.tensor, Dg: tl.tensor,
    HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
) -> tuple[tl.tensor, ...]:  # fmt: skip
    """The (BLOCK_T, BLOCK_D) tile of group g's features at the block's steps, in float32, its
    offsets, and which steps are real (in range and unmasked)."""
    offs_t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    in_t = offs_t < L
    in_d = offs_d < Dg
    row = b.to(tl.int64) * L + offs_t
    offs = row[:, None] * D + g * Dg + offs_d[None, :]
    x = tl.load(x_ptr + offs, mask=in_t[:, None] & in_d[None, :], other=0.0).to(tl.float32)
    valid = in_t
    if HAS_MASK:
        valid = valid & (tl.load(mask_ptr + row, mask=in_t, other=0) != 0)
    return x, offs, offs_t, in_t, in_d, valid


@triton.jit
def _load_step_stats(
    x_ptr: tl.tensor, mask_ptr: tl.tensor, b: tl.tensor, g: tl.tensor, blk: tl.tensor, L: tl.tensor,
    D: tl.tensor, Dg: tl.tensor,
    HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
) -> tuple[tl.tensor, ...]:  # fmt: skip
    """`_load_tile`, plus each step's group mean and population variance (two-pass)."""
    x, offs, offs_t, in_t, in_d, valid = _load_tile(
        x_ptr, mask_ptr, b, g, blk, L, D, Dg, HAS_MASK, BLOCK_T, BLOCK_D
    )
    m = tl.sum(x, axis=1) / Dg
    xc = tl.where(in_d[None, :], x - m[:, None], 0.0)
    return x, offs, offs_t, in_t, in_d, valid, m, tl.sum(xc * xc, axis=1) / Dg


@triton.jit
def _two_sum(hi: tl.tensor, lo: tl.tensor, add: tl.tensor) -> tuple[tl.tensor, tl.tensor]:
    """hi + lo += add, with the rounding error of the addition kept in lo (Neumaier)."""
    s = hi + add
    bp = s - hi
    err = (hi - (s - bp)) + (add - bp)
    return s, lo + err


@triton.jit
def _fwd_block_stats(
    x_ptr: tl.tensor, mask_ptr: tl.tensor, stats_ptr: tl.tensor, L: tl.tensor, D: tl.tensor,
    Dg: tl.tensor, G: tl.tensor, NBLK: tl.tensor,
    HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
) -> None:  # fmt: skip
    blk, bg, b, g = _block_program(G, NBLK)
    _, _, _, _, _, valid, m, v = _load_step_stats(
        x_ptr, mask_ptr, b, g, blk, L, D, Dg, HAS_MASK, BLOCK_T, BLOCK_D
    )
    w = valid.to(tl.float32)
    nb = tl.sum(w, axis=0)
    mb = tl.sum(tl.where(valid, m, 0.0), axis=0) / tl.maximum(nb, 1.0)
    dm = m - mb
    m2b = tl.sum(tl.where(valid, v + dm * dm, 0.0), axis=0)
    base = stats_ptr + (bg.to(tl.int64) * NBLK + blk) * 3
    tl.store(base, nb)
    tl.store(base + 1, mb)
    tl.store(base + 2, m2b)


@triton.jit
def _chan(
    n_a: tl.tensor, m_a: tl.tensor, M2_a: tl.tensor, n_b: tl.tensor, m_b: tl.tensor, M2_b: tl.tensor
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Chan's merge of two (count, mean, M2) statistics (associative: a scan's combine)."""
    n = n_a + n_b
    inv = 1.0 / tl.maximum(n, 1.0)
    delta = m_b - m_a
    m = tl.where(n_a == 0, m_b, tl.where(n_b == 0, m_a, m_a + delta * n_b * inv))
    return n, m, M2_a + M2_b + delta * delta * n_a * n_b * inv


@triton.jit
def _fwd_scan_blocks(
    stats_ptr: tl.tensor, prefix_ptr: tl.tensor, count_ptr: tl.tensor, mean0_ptr: tl.tensor,
    var0_ptr: tl.tensor, mean_out_ptr: tl.tensor, var_out_ptr: tl.tensor, G: tl.tensor,
    NBLK: tl.tensor,
    CHUNK: tl.constexpr,
) -> None:  # fmt: skip
    """The statistics before each block: `CHUNK` blocks at a time, a tree scan (Chan's merge)
    within the chunk from the running totals, which take each chunk's total compensated."""
    bg = tl.program_id(0)
    b = bg // G
    c0 = tl.load(count_ptr + b).to(tl.float32)
    mu0 = tl.load(mean0_ptr + bg).to(tl.float32)
    var0 = tl.load(var0_ptr + bg).to(tl.float32)
    n = c0
    mean_hi = tl.where(c0 > 0, mu0, 0.0)  # count 0: the prior mean and variance have no effect
    mean_lo = mean_hi * 0.0
    m2_hi = tl.where(c0 > 0, c0 * var0, 0.0)
    m2_lo = m2_hi * 0.0
    row = bg.to(tl.int64) * NBLK
    # Pass 3 reads (count, shift K, S1 = Σ (m − K), S2 = M2 + n·(mean − K)²) before each block.
    lane = tl.arange(0, 4)
    first = tl.where(lane == 0, n, tl.where(lane == 1, mean_hi, tl.where(lane == 3, m2_hi, 0.0)))
    tl.store(prefix_ptr + row * 4 + lane, first)
    for start in range(0, NBLK, CHUNK):
        j = start + tl.arange(0, CHUNK)
        in_j = j < NBLK
        stat = (row + j) * 3
        nb = tl.load(stats_ptr + stat, mask=in_j, other=0.0)
        mb = tl.load(stats_ptr + stat + 1, mask=in_j, other=0.0)
        m2b = tl.load(stats_ptr + stat + 2, mask=in_j, other=0.0)
        # The tree scan runs on means shifted by c (the running mean, else the chunk's), so
        # its roundings are of O(σ) numbers, not of the mean itself.
        c = tl.where(n > 0, mean_hi, tl.sum(nb * mb) / tl.maximum(tl.sum(nb), 1.0))
        mb = tl.where(nb > 0, mb - c, 0.0)
        back = c - mean_hi  # exactly 0 once anything is seen
        n_s, m_s, m2_s = tl.associative_scan((nb, mb, m2b), 0, _chan)
        # Before block j + 1: the running totals merged with this chunk up to block j. The
        # shift K is that merged mean, rounded; S1 keeps what the rounding (and the totals'
        # compensation mean_lo) left, so S2/n − (S1/n)² cancels nothing.
        n_t = n + n_s
        inv_t = 1.0 / tl.maximum(n_t, 1.0)
        delta = (m_s + back) - mean_lo
        s1 = n_t * mean_lo + delta * n_s  # n_t · (merged mean − mean_hi)
        K = tl.where(n > 0, mean_hi + s1 * inv_t, m_s + c)
        s1 = tl.where(n > 0, s1 - n_t * (K - mean_hi), 0.0)
        m2_t = (m2_hi + m2_lo) + m2_s + delta * delta * n * n_s * inv_t
        pre = prefix_ptr + (row + j + 1) * 4
        nxt = j + 1 < NBLK
        tl.store(pre, n_t, mask=nxt)
        tl.store(pre + 1, K, mask=nxt)
        tl.store(pre + 2, s1, mask=nxt)
        tl.store(pre + 3, m2_t + s1 * s1 * inv_t, mask=nxt)
        # The running totals take the chunk's total (Chan's merge, compensated).
        nc, mc, m2c = tl.reduce((nb, mb, m2b), 0, _chan)
        n_new = n + nc
        inv = 1.0 / tl.maximum(n_new, 1.0)
        delta_c = (mc + back) - mean_lo
        mean_hi, mean_lo = _two_sum(mean_hi, mean_lo, delta_c * nc * inv)
        m2_hi, m2_lo = _two_sum(m2_hi, m2_lo, m2c + delta_c * delta_c * n * nc * inv)
        n = n_new
    seen = n > 0
    tl.store(mean_out_ptr + bg, tl.where(seen, mean_hi + mean_lo, mu0))
    tl.store(var_out_ptr + bg, tl.where(seen, (m2_hi + m2_lo) / tl.maximum(n, 1.0), var0))


@triton.jit
def _fwd_normalize(
    x_ptr: tl.tensor, mask_ptr: tl.tensor, w_ptr: tl.tensor, b_ptr: tl.tensor,
    prefix_ptr: tl.tensor, y_ptr: tl.tensor, mu_ptr: tl.tensor, rstd_ptr: tl.tensor, L: tl.tensor,
    D: tl.tensor, Dg: tl.tensor, G: tl.tensor, NBLK: tl.tensor, eps: tl.tensor,
    HAS_MASK: tl.constexpr, AFFINE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
) -> None:  # fmt: skip
    blk, bg, b, g = _block_program(G, NBLK)
    x, offs, offs_t, in_t, in_d, valid, m, v = _load_step_stats(
        x_ptr, mask_ptr, b, g, blk, L, D, Dg, HAS_MASK, BLOCK_T, BLOCK_D
    )
    pre = prefix_ptr + (bg.to(tl.int64) * NBLK + blk) * 4
    n_p = tl.load(pre)
    K = tl.load(pre + 1)
    s1_p = tl.load(pre + 2)
    s2_p = tl.load(pre + 3)
    w = valid.to(tl.float32)
    # Nothing before the block (its prefix is 0): the shift is the block's own mean.
    K = tl.where(n_p > 0, K, tl.sum(tl.where(valid, m, 0.0), axis=0) / tl.maximum(tl.sum(w), 1.0))
    d = tl.where(valid, m - K, 0.0)
    e = tl.where(valid, v + d * d, 0.0)
    n = n_p + tl.cumsum(w, axis=0)
    inv_n = 1.0 / tl.maximum(n, 1.0)
    dm = (s1_p + tl.cumsum(d, axis=0)) * inv_n
    mu = K + dm
    var = tl.maximum((s2_p + tl.cumsum(e, axis=0)) * inv_n - dm * dm, 0.0)
    rstd = 1.0 / tl.sqrt(var + eps)
    y = (x - mu[:, None]) * rstd[:, None]
    if AFFINE:
        offs_d = g * Dg + tl.arange(0, BLOCK_D)
        gamma = tl.load(w_ptr + offs_d, mask=in_d, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + offs_d, mask=in_d, other=0.0).to(tl.float32)
        y = y * (1.0 + gamma[None, :]) + beta[None, :]
    y = tl.where(valid[:, None], y, 0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=in_t[:, None] & in_d[None, :])
    stat = (b.to(tl.int64) * L + offs_t) * G + g
    tl.store(mu_ptr + stat, mu, mask=in_t)
    tl.store(rstd_ptr + stat, rstd, mask=in_t)


@triton.jit
def _bwd_step_terms(
    x_ptr: tl.tensor, dy_ptr: tl.tensor, mask_ptr: tl.tensor, w_ptr: tl.tensor, mu_ptr: tl.tensor,
    rstd_ptr: tl.tensor, prefix_ptr: tl.tensor, dmean_ptr: tl.tensor, dvar_ptr: tl.tensor,
    L: tl.tensor, D: tl.tensor, Dg: tl.tensor, G: tl.tensor, NBLK: tl.tensor,
    HAS_MASK: tl.constexpr, AFFINE: tl.constexpr, STATE_GRAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
) -> tuple[tl.tensor, ...]:  # fmt: skip
    """Per step of the block: the mean and variance terms u_t, c_t, p_t of the backward (see
    `_TimestepNormFn`), with x̂ and the gradient g = dy·(1 + γ) at x̂ (zero at padded steps),
    for this program's block (`_block_program`)."""
    blk, bg, b, g = _block_program(G, NBLK)
    x, offs, offs_t, in_t, in_d, valid = _load_tile(
        x_ptr, mask_ptr, b, g, blk, L, D, Dg, HAS_MASK, BLOCK_T, BLOCK_D
    )
    live = valid[:, None] & in_d[None, :]
    dy = tl.load(dy_ptr + offs, mask=live, other=0.0).to(tl.float32)
    dy = tl.where(live, dy, 0.0)  # padded steps may hold anything
    stat = (b.to(tl.int64) * L + offs_t) * G + g
    mu = tl.load(mu_ptr + stat, mask=in_t, other=0.0)
    rstd = tl.load(rstd_ptr + stat, mask=in_t, other=0.0)
    K = tl.load(mu_ptr + (b.to(tl.int64) * L + L - 1) * G + g)  # any shift: the last mean
    n_p = tl.load(prefix_ptr + (bg.to(tl.int64) * NBLK + blk) * 4)
    inv_n = 1.0 / tl.maximum(n_p + tl.cumsum(valid.to(tl.float32), axis=0), 1.0)
    xhat = tl.where(live, (x - mu[:, None]) * rstd[:, None], 0.0)
    gx = dy
    if AFFINE:
        gamma = tl.load(w_ptr + g * Dg + tl.arange(0, BLOCK_D), mask=in_d, other=0.0)
        gx = dy * (1.0 + gamma.to(tl.float32)[None, :])
    u = rstd * tl.sum(gx, axis=1) * inv_n
    c = rstd * rstd * tl.sum(gx * xhat, axis=1) * inv_n
    if STATE_GRAD:  # the state after the last step is (μ, σ²) at step L − 1
        last = offs_t == L - 1
        u -= tl.where(last, tl.load(dmean_ptr + bg).to(tl.float32), 0.0) * inv_n
        c -= tl.where(last, 2.0 * tl.load(dvar_ptr + bg).to(tl.float32), 0.0) * inv_n
    p = c * (mu - K)
    return x, dy, gx, xhat, mu, rstd, u, c, p, K, offs, in_t, in_d, live, blk, bg, b, g


@triton.jit
def _bwd_block_sums(
    x_ptr: tl.tensor, dy_ptr: tl.tensor, mask_ptr: tl.tensor, w_ptr: tl.tensor, mu_ptr: tl.tensor,
    rstd_ptr: tl.tensor, prefix_ptr: tl.tensor, dmean_ptr: tl.tensor, dvar_ptr: tl.tensor,
    sums_ptr: tl.tensor, dw_ptr: tl.tensor, db_ptr: tl.tensor, L: tl.tensor, D: tl.tensor,
    Dg: tl.tensor, G: tl.tensor, NBLK: tl.tensor,
    HAS_MASK: tl.constexpr, AFFINE: tl.constexpr, STATE_GRAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
) -> None:  # fmt: skip
    _, dy, _, xhat, _, _, u, c, p, _, _, _, in_d, _, blk, bg, b, g = _bwd_step_terms(
        x_ptr, dy_ptr, mask_ptr, w_ptr, mu_ptr, rstd_ptr, prefix_ptr, dmean_ptr, dvar_ptr,
        L, D, Dg, G, NBLK, HAS_MASK, AFFINE, STATE_GRAD, BLOCK_T, BLOCK_D,
    )  # fmt: skip
    base = sums_ptr + (bg.to(tl.int64) * NBLK + blk) * 3
    tl.store(base, tl.sum(u, axis=0))
    tl.store(base + 1, tl.sum(c, axis=0))
    tl.store(base + 2, tl.sum(p, axis=0))
    if AFFINE:  # this block's share of dγ and dβ, summed over blocks and batch outside
        part = (b.to(tl.int64) * NBLK + blk) * D + g * Dg + tl.arange(0, BLOCK_D)
        tl.store(dw_ptr + part, tl.sum(dy * xhat, axis=0), mask=in_d)
        tl.store(db_ptr + part, tl.sum(dy, axis=0), mask=in_d)


@triton.jit
def _bwd_scan_blocks(
    sums_ptr: tl.tensor,
    suffix_ptr: tl.tensor,
    total_ptr: tl.tensor,
    NBLK: tl.tensor,
    CHUNK: tl.constexpr,
) -> None:
    """What the blocks after each block add to (u, c, p): `CHUNK` blocks at a time from the
    end, a tree scan within the chunk from the running totals, which are compensated."""
    bg = tl.program_id(0)
    row = bg.to(tl.int64) * NBLK
    lane = tl.arange(0, 4)
    hi = tl.zeros((4,), tl.float32)
    lo = tl.zeros((4,), tl.float32)
    tl.store(suffix_ptr + (row + NBLK - 1) * 3 + lane, hi, mask=lane < 3)
    for i in range(0, tl.cdiv(NBLK, CHUNK)):
        j = (tl.cdiv(NBLK, CHUNK) - 1 - i) * CHUNK + tl.arange(0, CHUNK)
        in_j = j < NBLK
        prev = (j >= 1) & in_j
        for q in tl.static_range(3):
            val = tl.load(sums_ptr + (row + j) * 3 + q, mask=in_j, other=0.0)
            carry = tl.sum(tl.where(lane == q, hi + lo, 0.0), axis=0)
            after = carry + tl.cumsum(val, axis=0, reverse=True)  # what block j − 1 sees
            tl.store(suffix_ptr + (row + j - 1) * 3 + q, after, mask=prev)
        part = tl.load(
            sums_ptr + (row + j[:, None]) * 3 + lane[None, :],
            mask=in_j[:, None] & (lane[None, :] < 3), other=0.0,
        )  # fmt: skip
        hi, lo = _two_sum(hi, lo, tl.sum(part, axis=0))
    tl.store(total_ptr + bg * 3 + lane, hi + lo, mask=lane < 3)


@triton.jit
def _bwd_dx(
    x_ptr: tl.tensor, dy_ptr: tl.tensor, mask_ptr: tl.tensor, w_ptr: tl.tensor, mu_ptr: tl.tensor,
    rstd_ptr: tl.tensor, prefix_ptr: tl.tensor, dmean_ptr: tl.tensor, dvar_ptr: tl.tensor,
    suffix_ptr: tl.tensor, dx_ptr: tl.tensor, L: tl.tensor, D: tl.tensor, Dg: tl.tensor,
    G: tl.tensor, NBLK: tl.tensor,
    HAS_MASK: tl.constexpr, AFFINE: tl.constexpr, STATE_GRAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
) -> None:  # fmt: skip
    x, _, gx, _, mu, rstd, u, c, p, K, offs, in_t, in_d, live, blk, bg, _, _ = _bwd_step_terms(
        x_ptr, dy_ptr, mask_ptr, w_ptr, mu_ptr, rstd_ptr, prefix_ptr, dmean_ptr, dvar_ptr,
        L, D, Dg, G, NBLK, HAS_MASK, AFFINE, STATE_GRAD, BLOCK_T, BLOCK_D,
    )  # fmt: skip
    base = suffix_ptr + (bg.to(tl.int64) * NBLK + blk) * 3
    U = tl.load(base) + tl.cumsum(u, axis=0, reverse=True)
    C = tl.load(base + 1) + tl.cumsum(c, axis=0, reverse=True)
    P = tl.load(base + 2) + tl.cumsum(p, axis=0, reverse=True)
    # Σ_{t≥i} c_t (x − μ_t) = (x − μ_i)·C_i + ((μ_i − K)·C_i − P_i)
    corr = U + (mu - K) * C - P
    dx = gx * rstd[:, None] - ((x - mu[:, None]) * C[:, None] + corr[:, None]) / Dg
    dx = tl.where(live, dx, 0.0)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=in_t[:, None] & in_d[None, :])


def _f32(make: Callable[..., Tensor], like: Tensor, *shape: int) -> Tensor:
    """A float32 buffer on `like`'s device (`make`: torch.empty or torch.zeros)."""
    return make(*shape, dtype=torch.float32, device=like.device)


#: Blocks per step of the scans over blocks (pass 2, forward and backward).
CHUNK = 128

#: Features per tile (steps × the group's features) when the steps per block are not given.
TILE = 4096


def _blocks(L: int, Dg: int, block_t: int | None) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, number of blocks): tiles of about `TILE` features."""
    block_d = triton.next_power_of_2(Dg)
    if block_t is None:
        block_t = max(16, min(1024, TILE // block_d))
    elif block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"timestep_norm: block_t={block_t} must be a power of two")
    return block_t, block_d, max(1, triton.cdiv(L, block_t))  # one block even when L = 0


class _TimestepNormFn(torch.autograd.Function):
    """y and the state after the last step, (μ, σ²), with a Triton backward.

    Backward, for one (batch, group) with k = D/G features and w_i = 1 at real steps. With
    n_t = c₀ + Σ_{i≤t} w_i, A_t = c₀μ₀ + Σ_{i≤t} w_i m_i and Q_t = c₀(σ₀² + μ₀²) + Σ_{i≤t} w_i q_i
    (m_i, q_i the step's mean of x and of x²): μ_t = A_t/n_t, σ²_t = Q_t/n_t − μ_t²,
    r_t = (σ²_t + ε)^(−1/2), x̂_t = (x_t − μ_t) r_t. With g_t = dy_t ⊙ (1 + γ) at real steps,

        ∂ℒ/∂μ_t = −r_t Σ_j g_tj (+ the incoming gradient of the state's mean at t = L−1)
        ∂ℒ/∂σ²_t = −r_t² Σ_j g_tj x̂_tj / 2 (+ the state's variance gradient at t = L−1)

    and, through μ_t = A_t/n_t and σ²_t = Q_t/n_t − (A_t/n_t)²,

        ∂ℒ/∂A_t = −u_t + μ_t c_t,   ∂ℒ/∂Q_t = −c_t/2,   u_t = −(∂ℒ/∂μ_t)/n_t,
                                                       c_t = −2(∂ℒ/∂σ²_t)/n_t.

    A_t and Q_t are prefix sums, so step i receives the suffix sums over t ≥ i (a reverse-time
    scan): ∂ℒ/∂m_i = w_i Σ_{t≥i}(−u_t + μ_t c_t), ∂ℒ/∂q_i = −w_i Σ_{t≥i} c_t/2, and with
    ∂m_i/∂x_ij = 1/k, ∂q_i/∂x_ij = 2x_ij/k,

        ∂ℒ/∂x_ij = w_i [g_ij r_i − (U_i + Σ_{t≥i} c_t (x_ij − μ_t)) / k],
        U_i = Σ_{t≥i} u_t,  Σ_{t≥i} c_t (x_ij − μ_t) = (x_ij − μ_i) C_i + (μ_i − K) C_i − P_i,

    C_i = Σ_{t≥i} c_t, P_i = Σ_{t≥i} c_t (μ_t − K), K any constant (the last mean: the terms stay
    O(σ) instead of O(μ)). The same three passes as the forward run these scans backwards in time
    (block sums, a compensated scan of the block sums, then within each block). The carried state
    enters like one more step of weight c₀: ∂ℒ/∂μ₀ = −c₀ (U₀ + (μ₀ − K) C₀ − P₀) and
    ∂ℒ/∂σ₀² = −c₀ C₀ / 2 (U₀, C₀, P₀ the sums over the whole segment); with nothing seen at all
    the state passes through. dγ = Σ dy ⊙ x̂ and dβ = Σ dy over real steps.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, mask: Tensor | None,
        count: Tensor, mean0: Tensor, var0: Tensor, num_groups: int, eps: float,
        block_t: int | None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        B, L, D = x.shape
        G = num_groups
        Dg = D // G
        BLOCK_T, BLOCK_D, nblk = _blocks(L, Dg, block_t)
        stats = _f32(torch.empty, x, B * G, nblk, 3)
        prefix = _f32(torch.empty, x, B * G, nblk, 4)
        mean_out = _f32(torch.empty, x, B, G)
        var_out = _f32(torch.empty, x, B, G)
        y = torch.empty_like(x)
        mu = _f32(torch.empty, x, B, L, G)
        rstd = _f32(torch.empty, x, B, L, G)
        affine = weight is not None
        mask_arg = mask if mask is not None else x  # never read without a mask
        w_arg = weight if weight is not None else x
        b_arg = bias if bias is not None else x
        meta = dict(BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, HAS_MASK=mask is not None, **LAUNCH_OPTIONS)
        _fwd_block_stats[(nblk * B * G,)](x, mask_arg, stats, L, D, Dg, G, nblk, **meta)
        _fwd_scan_blocks[(B * G,)](
            stats, prefix, count, mean0, var0, mean_out, var_out, G, nblk, CHUNK=CHUNK,
            **LAUNCH_OPTIONS,
        )  # fmt: skip
        if L > 0:
            _fwd_normalize[(nblk * B * G,)](
                x, mask_arg, w_arg, b_arg, prefix, y, mu, rstd, L, D, Dg, G, nblk, eps,
                AFFINE=affine, **meta,
            )  # fmt: skip
        ctx.save_for_backward(x, weight, bias, mask, count, mean0, var0, mu, rstd, prefix)
        ctx.shape = (B, L, D, G, BLOCK_T, BLOCK_D, nblk)
        return y, mean_out, var_out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dy: Tensor, dmean: Tensor | None, dvar: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        x, weight, bias, mask, count, mean0, var0, mu, rstd, prefix = ctx.saved_tensors
        B, L, D, G, BLOCK_T, BLOCK_D, nblk = ctx.shape
        Dg = D // G
        state_grad = dmean is not None or dvar is not None
        dmean = (dmean if dmean is not None else _f32(torch.zeros, x, B, G)).contiguous()
        dvar = (dvar if dvar is not None else _f32(torch.zeros, x, B, G)).contiguous()
        dy = dy.contiguous()
        affine = weight is not None
        sums = _f32(torch.zeros, x, B * G, nblk, 3)  # stays 0 when L = 0
        suffix = _f32(torch.empty, x, B * G, nblk, 3)
        total = _f32(torch.empty, x, B * G, 3)
        dw_part = _f32(torch.empty, x, B, nblk, D) if affine else sums
        db_part = _f32(torch.empty, x, B, nblk, D) if affine else sums
        dx = torch.empty_like(x)
        args = (
            x, dy, mask if mask is not None else x, weight if affine else x, mu, rstd, prefix,
            dmean, dvar,
        )  # fmt: skip
        meta = dict(
            HAS_MASK=mask is not None, AFFINE=affine, STATE_GRAD=state_grad,
            BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, **LAUNCH_OPTIONS,
        )  # fmt: skip
        if L > 0:
            _bwd_block_sums[(nblk * B * G,)](
                *args, sums, dw_part, db_part, L, D, Dg, G, nblk, **meta
            )
        _bwd_scan_blocks[(B * G,)](sums, suffix, total, nblk, CHUNK=CHUNK, **LAUNCH_OPTIONS)
        if L > 0:
            _bwd_dx[(nblk * B * G,)](*args, suffix, dx, L, D, Dg, G, nblk, **meta)
        dw = db = dmean0 = dvar0 = None
        if affine and ctx.needs_input_grad[1]:
            dw = dw_part.sum(dim=(0, 1)).to(weight.dtype)
        if affine and ctx.needs_input_grad[2]:
            db = db_part.sum(dim=(0, 1)).to(bias.dtype)
        if ctx.needs_input_grad[5] or ctx.needs_input_grad[6]:
            c0 = count.to(torch.float32).unsqueeze(-1)  # (B, 1)
            U, C, P = total.view(B, G, 3).unbind(-1)
            K = mu[:, -1] if L > 0 else _f32(torch.zeros, x, B, G)
            m0 = torch.where(c0 > 0, mean0.float(), 0.0)
            dmean0 = -c0 * (U + (m0 - K) * C - P)
            dvar0 = -c0 * C / 2
            # Nothing seen at all (count 0, no real step): the carried state passes through.
            # An empty segment, too (no step L − 1 to take the state's gradient).
            unseen = (c0 + (mask.sum(1, keepdim=True) if mask is not None else L)) == 0
            unseen = unseen | (L == 0)
            dmean0 = torch.where(unseen, dmean, dmean0).to(mean0.dtype)
            dvar0 = torch.where(unseen, dvar, dvar0).to(var0.dtype)
        return dx, dw, db, None, None, dmean0, dvar0, None, None, None


def timestep_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mask: Tensor | None,
    count: Tensor | None,
    mean: Tensor | None,
    var: Tensor | None,
    num_groups: int,
    eps: float,
    block_t: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`TimestepNorm` on the GPU: x (B, L, D) float32/bf16/fp16, mask (B, L) True at real steps
    (or None), the carried count (B,) int64, mean and var (B, G) (None for a fresh start).

    Returns y (B, L, D) in x's dtype and the mean and variance (B, G) float32 after the last
    step (the carried ones where nothing was seen); `block_t` sets the steps per block (tests).
    """
    B, L, D = x.shape
    G = num_groups
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"timestep_norm kernel: x must be float32, bf16 or fp16, got {x.dtype}")
    if D % G:
        raise ValueError(f"timestep_norm kernel: D={D} must be a multiple of num_groups={G}")
    if mask is not None and mask.shape != (B, L):
        raise ValueError(f"timestep_norm kernel: mask must be (B, L) = {(B, L)}, got "
                         f"{tuple(mask.shape)}")  # fmt: skip
    if count is None or mean is None or var is None:
        count = torch.zeros(B, dtype=torch.int64, device=x.device)
        mean = torch.zeros(B, G, dtype=torch.float32, device=x.device)
        var = torch.ones(B, G, dtype=torch.float32, device=x.device)
    elif count.shape != (B,) or mean.shape != (B, G) or var.shape != (B, G):
        raise ValueError(
            f"timestep_norm kernel: the state must be count (B,), mean and var (B, G) = "
            f"{(B, G)}, got {tuple(count.shape)}, {tuple(mean.shape)}, {tuple(var.shape)}"
        )
    m8 = None if mask is None else mask.to(torch.int8).contiguous()
    y, mean_out, var_out = _TimestepNormFn.apply(
        x.contiguous(), weight, bias, m8, count.contiguous(), mean.contiguous(),
        var.contiguous(), G, eps, block_t,
    )  # fmt: skip
    return y, mean_out, var_out
