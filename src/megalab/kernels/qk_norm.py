"""Triton kernel for Megalodon's normalized queries and keys
(`megalab.models.megalodon.normalized_attention.NormalizedAttention.queries_keys`).

From the shared representation Z (rows, S) in H heads of width d = S/H, per row and head,

    Ẑ = Z · r,  r = 1/√(mean(Z²) + ε)            the code's RMSNorm of a head, in float32
    Q = Ẑ ⊙ κ'_q + μ_q,  K = Ẑ ⊙ κ'_k + μ_k,    κ' = (1 + κ)/√d                     (eqs. 6-8)

written in the attention's dtype, one launch, where the PyTorch code (the reference and the CPU
path) runs a cast, the mean square, the root, the products, the two affine maps and two casts.
Backward, one launch and one sum: ∂Ẑ = ∂Q ⊙ κ'_q + ∂K ⊙ κ'_k, ∂Z = r (∂Ẑ − Ẑ mean(∂Ẑ ⊙ Ẑ)), with
r recomputed from Z (nothing but Z is kept), and each program's partial sums of ∂κ and ∂μ over
its rows, which a sum over programs finishes.
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from torch import Tensor
from torch.autograd.function import once_differentiable

from megalab.kernels import LAUNCH_OPTIONS

__all__ = ["normalized_queries_keys"]

_MAX_PROGRAMS = 512  # row programs of the backward: partial sums (programs, 4, S) stay small


@triton.jit
def _queries_keys_kernel(
    z_ptr: tl.tensor,  # (R, S), rows `stride_z` apart, any float dtype
    kappa_ptr: tl.tensor,  # (2, S) float32
    mu_ptr: tl.tensor,  # (2, S) float32 (read in the forward)
    q_ptr: tl.tensor,  # (R, S) contiguous: Q (forward, written), ∂Q (backward, read)
    k_ptr: tl.tensor,  # (R, S) contiguous: K (forward, written), ∂K (backward, read)
    dz_ptr: tl.tensor,  # (R, S) contiguous, Z's dtype (backward, written)
    part_ptr: tl.tensor,  # (programs, 4, S) float32: Σ ∂Q Ẑ/√d, Σ ∂K Ẑ/√d, Σ ∂Q, Σ ∂K (backward)
    R: tl.tensor,
    S: tl.tensor,
    d: tl.tensor,
    stride_z: tl.tensor,
    eps: tl.tensor,
    scale: tl.tensor,
    BACKWARD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    """One head's columns (program axis 1) of the row blocks pid, pid + programs, ..."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    c_ok = tl.arange(0, BLOCK_D) < d
    cols = tl.program_id(1) * d + tl.arange(0, BLOCK_D)
    kappa_q = (1.0 + tl.load(kappa_ptr + cols, mask=c_ok, other=0.0)) * scale
    kappa_k = (1.0 + tl.load(kappa_ptr + S + cols, mask=c_ok, other=0.0)) * scale
    mu_q = tl.load(mu_ptr + cols, mask=c_ok, other=0.0)
    mu_k = tl.load(mu_ptr + S + cols, mask=c_ok, other=0.0)
    sum_q_z = tl.zeros((BLOCK_D,), dtype=tl.float32)
    sum_k_z = tl.zeros((BLOCK_D,), dtype=tl.float32)
    sum_q = tl.zeros((BLOCK_D,), dtype=tl.float32)
    sum_k = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(pid * BLOCK_R, R, programs * BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R).to(tl.int64)
        ok = (rows < R)[:, None] & c_ok[None, :]
        z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=ok, other=0.0)
        z = z.to(tl.float32)
        r = tl.rsqrt(tl.sum(z * z, axis=1) / d + eps)
        z_hat = z * r[:, None]
        offsets = rows[:, None] * S + cols[None, :]
        if BACKWARD:
            dq = tl.load(q_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
            dk = tl.load(k_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
            dz_hat = dq * kappa_q[None, :] + dk * kappa_k[None, :]
            proj = tl.sum(dz_hat * z_hat, axis=1) / d
            dz = r[:, None] * (dz_hat - z_hat * proj[:, None])
            tl.store(dz_ptr + offsets, dz.to(dz_ptr.dtype.element_ty), mask=ok)
            sum_q_z += tl.sum(dq * z_hat, axis=0)
            sum_k_z += tl.sum(dk * z_hat, axis=0)
            sum_q += tl.sum(dq, axis=0)
            sum_k += tl.sum(dk, axis=0)
        else:
            q = z_hat * kappa_q[None, :] + mu_q[None, :]
            k = z_hat * kappa_k[None, :] + mu_k[None, :]
            tl.store(q_ptr + offsets, q.to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(k_ptr + offsets, k.to(k_ptr.dtype.element_ty), mask=ok)
    if BACKWARD:
        base = part_ptr + pid.to(tl.int64) * 4 * S + cols
        tl.store(base, sum_q_z * scale, mask=c_ok)
        tl.store(base + S, sum_k_z * scale, mask=c_ok)
        tl.store(base + 2 * S, sum_q, mask=c_ok)
        tl.store(base + 3 * S, sum_k, mask=c_ok)


def _blocks(d: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D): a head's columns in one tile, about 4,096 elements a tile."""
    block_d = triton.next_power_of_2(d)
    return max(1, min(64, 4096 // block_d)), block_d


class _QueriesKeys(torch.autograd.Function):
    """(Q, K) from Z, κ, μ in one launch; keeps Z (and κ) only."""

    @staticmethod
    def forward(
        ctx: Any,
        z: Tensor,
        kappa: Tensor,
        mu: Tensor,
        num_heads: int,
        eps: float,
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        S = z.shape[-1]
        rows = z.reshape(-1, S)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        R, d = rows.shape[0], S // num_heads
        q = torch.empty(R, S, device=z.device, dtype=dtype)
        k = torch.empty_like(q)
        block_r, block_d = _blocks(d)
        if R:
            _queries_keys_kernel[(triton.cdiv(R, block_r), num_heads)](
                rows, kappa, mu, q, k, q, q, R, S, d, rows.stride(0), eps, d**-0.5,
                BACKWARD=False, BLOCK_R=block_r, BLOCK_D=block_d, **LAUNCH_OPTIONS,
            )  # fmt: skip
        ctx.save_for_backward(rows, kappa)
        ctx.num_heads, ctx.eps, ctx.shape = num_heads, eps, z.shape
        shape = (*z.shape[:-1], num_heads, d)
        return q.view(shape), k.view(shape)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_q: Tensor | None, grad_k: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        rows, kappa = ctx.saved_tensors
        R, S = rows.shape
        H = ctx.num_heads
        d = S // H
        dq = torch.zeros(R, S, device=rows.device) if grad_q is None else grad_q.reshape(R, S)
        dk = torch.zeros(R, S, device=rows.device) if grad_k is None else grad_k.reshape(R, S)
        dq, dk = dq.contiguous(), dk.contiguous()
        dz = torch.empty(R, S, device=rows.device, dtype=rows.dtype)
        block_r, block_d = _blocks(d)
        programs = max(1, min(triton.cdiv(R, block_r), _MAX_PROGRAMS))
        part = torch.empty(programs, 4, S, device=rows.device, dtype=torch.float32)
        _queries_keys_kernel[(programs, H)](
            rows, kappa, kappa, dq, dk, dz, part, R, S, d, rows.stride(0), ctx.eps, d**-0.5,
            BACKWARD=True, BLOCK_R=block_r, BLOCK_D=block_d, **LAUNCH_OPTIONS,
        )  # fmt: skip
        sums = part.sum(0)
        return dz.view(ctx.shape), sums[:2], sums[2:], None, None, None


def normalized_queries_keys(
    z: Tensor, kappa: Tensor, mu: Tensor, num_heads: int, eps: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Q, K (..., H, d) in `dtype` from Z (..., S) of float32, bf16 or fp16 and float32 (2, S)
    κ, μ, as `NormalizedAttention.queries_keys` followed by the cast to `dtype`."""
    if z.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"the Triton queries/keys take float32, bf16 or fp16 Z, got {z.dtype}; use "
            "NormalizedAttention.queries_keys for other dtypes"
        )
    if kappa.dtype != torch.float32 or mu.dtype != torch.float32:
        raise ValueError(f"κ and μ must be float32, got {kappa.dtype} and {mu.dtype}")
    out: tuple[Tensor, Tensor] = _QueriesKeys.apply(
        z, kappa.contiguous(), mu.contiguous(), num_heads, eps, dtype
    )
    return out
