"""Flash-style Triton attention for Mega and Megalodon: O = f(S) V with S = Q Kᵀ τ⁻¹ + b.

The PyTorch code stays the reference and the CPU path (`megalab.nn.attention`,
`megalab.nn.fused_attention`, `megalab.models.megalodon.normalized_attention`); this kernel runs
where `megalab.kernels.use_kernel("attention", q, k, v)` chooses it (CUDA, or forced under Triton's
interpreter in tests). Q/K are narrow (Mega's z = d/4) and V wide (up to 2d): the value columns
are tiled, every program recomputing S for its value tile, so no program holds a whole value row.

Forward, one program per (query block, batch·head, value tile), looping over key blocks:

    softmax:        online softmax (running row max m and sum l), O = Σ_j exp(S_ij − m_i) V_j / l_i;
                    only the row log-sum-exp lse = m + log l is kept for the backward
    laplace/relu2:  no normaliser: O = Σ_j f(S_ij) V_j directly, block by block

Backward (FlashAttention-2: nothing but Q, K, V, O, dO and lse is read; P is recomputed):

    P = exp(S − lse) (softmax) or f(S) (laplace/relu2), masked
    dP = dO Vᵀ (a loop over the value tiles),  D = rowsum(dO ⊙ O)
    dS = P ⊙ (dP − D) (softmax) or dP ⊙ f'(S) (laplace/relu2), masked
    dV = Pᵀ dO,  dK = dSᵀ Q τ⁻¹,  dQ = dS K τ⁻¹,  dw[M − 1 + j − i] += Σ_batch dS_ij

in three kernels: dV (per key block and value tile), dK with the bias gradient (per key block;
the Toeplitz weights' gradient accumulated along diagonals with atomic adds) and dQ (per query
block). All accumulation is in float32; inputs are float32 (IEEE products, or TF32 where PyTorch
allows it for matmuls) or bf16/fp16.

Masks follow the reference exactly. Padded keys (`valid` False) and, with `causal`, keys after
the query are excluded; a softmax row that would have no key left ("empty": no valid key, or
with `causal` none up to the query) keeps its causal keys (`empty_rows="causal"`, Mega, where
the code leaves a chunk of padding unmasked) or every key (`empty_rows="all"`, Megalodon's
padded queries, whose outputs are discarded). laplace/relu2 multiply the weights by the masks.

Mega's learned biases: the 'simple' Toeplitz bias b[i, j] = w[M − 1 + j − (i + offset)] is read
from w in the kernel; the 'rotary' bias b = R_a R_bᵀ is an inner product, so it enters as extra
Q/K columns ([Q τ⁻¹ | R_a] [K | R_b]ᵀ), its gradient by autograd. laplace/relu2 divide QKᵀ by the
row's key count n; Q is divided by n before the kernel
(`megalab.nn.attention.ChunkedAttention._attend_kernel`).

`sdpa_value_groups` is the alternative GPU path for softmax: `scaled_dot_product_attention` on
value-column groups of at most 256 (PyTorch's flash and cuDNN kernels refuse wider value heads),
selected with `MEGALAB_ATTENTION_GPU=sdpa`; the Triton kernel is the default. Which is faster
has to be measured on a GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from megalab.kernels import LAUNCH_OPTIONS, use_kernel

try:
    import triton  # type: ignore[import-untyped]
except ImportError:  # the reference path needs no Triton (`use_kernel` is then False)
    triton = None
else:
    from megalab.kernels import attention_jit as jit

__all__ = [
    "FUNCTIONS",
    "GPU_PATHS",
    "flash_attention",
    "gpu_path",
    "sdpa_value_groups",
    "use_attention_kernel",
]

FUNCTIONS = ("softmax", "laplace", "relu2")
EMPTY_ROWS = ("causal", "all")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: GPU attention paths for softmax: the Triton kernel, or SDPA over value-column groups.
GPU_PATHS = ("triton", "sdpa")
#: Widest value group `sdpa_value_groups` gives one SDPA call (flash/cuDNN's head-width limit).
SDPA_VALUE_GROUP = 256


def gpu_path() -> str:
    """The GPU path for softmax attention, from `MEGALAB_ATTENTION_GPU` (default "triton")."""
    path = os.environ.get("MEGALAB_ATTENTION_GPU", "triton").strip() or "triton"
    if path not in GPU_PATHS:
        raise ValueError(
            f"MEGALAB_ATTENTION_GPU={path!r} is not a GPU attention path: use one of {GPU_PATHS}"
        )
    return path


def sdpa_value_groups(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    group: int = SDPA_VALUE_GROUP,
) -> Tensor:
    """`scaled_dot_product_attention` (no dropout) with the values cut into column groups of at
    most `group`, one call each, concatenated: every call has a head width flash/cuDNN accept.

    The weights are recomputed per group (one more QKᵀ per group); a learned bias enters as the
    float `attn_mask`, with its gradient.
    """
    if v.shape[-1] <= group:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale
        )
    outs = [
        F.scaled_dot_product_attention(
            q, k, vg, attn_mask=attn_mask, is_causal=is_causal, scale=scale
        )
        for vg in v.split(group, dim=-1)
    ]
    return torch.cat(outs, dim=-1)


class _Spec:
    """The non-tensor settings of one call (kept on the autograd context)."""

    def __init__(
        self,
        fn: str,
        scale: float,
        causal: bool,
        q_offset: int,
        positions: int,
        empty_rows: str,
        has_bias: bool,
        has_valid: bool,
        z: int,
        e: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.fn, self.scale, self.causal, self.q_offset = fn, scale, causal, q_offset
        self.positions, self.has_bias, self.has_valid = positions, has_bias, has_valid
        self.empty_causal = empty_rows == "causal"
        interp = device.type != "cuda"
        fp32 = dtype == torch.float32
        # Small tiles in the interpreter (its cost grows with the tile). On GPU, untuned first
        # choices (speed not yet measured) that fit shared memory, by the bytes of a Q/K row and
        # a value-tile row: compiled for sm_90, 64-row blocks take 114 KB in bf16 at z = 256,
        # 32-row blocks 143 KB in float32 at z = 256, 16-row blocks 118 KB in float32 at z = 512
        # (the 'rotary' bias's extra columns); 8 warps for wide tiles.
        self.block_z = max(16, triton.next_power_of_2(z))
        self.block_e = min(32 if interp else 128, max(16, triton.next_power_of_2(e)))
        row_bytes = dtype.itemsize * (self.block_z + self.block_e)
        rows = 64 if row_bytes <= 768 else (32 if row_bytes <= 1536 else 16)
        self.block_m = self.block_n = 16 if interp else rows
        self.num_warps = 8 if max(self.block_z, self.block_e) >= 128 else 4
        tf32 = fp32 and not interp and torch.backends.cuda.matmul.allow_tf32
        # float32 products in IEEE unless PyTorch allows TF32 for matmuls (bf16/fp16: tensor cores)
        self.precision = "ieee" if fp32 and not tf32 else "tf32"
        self.upcast = interp and not fp32
        # Causal rows see no key after themselves, except Megalodon's empty rows (every key).
        self.bounded = causal and (self.empty_causal or not has_valid or fn != "softmax")

    def meta(self) -> dict[str, Any]:
        return {
            "FN": FUNCTIONS.index(self.fn),
            "HAS_BIAS": self.has_bias,
            "HAS_VALID": self.has_valid,
            "CAUSAL": self.causal,
            "EMPTY_CAUSAL": self.empty_causal,
            "BOUNDED": self.bounded,
            "PRECISION": self.precision,
            "UPCAST": self.upcast,
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_Z": self.block_z,
            "BLOCK_E": self.block_e,
            "num_warps": self.num_warps,
            **LAUNCH_OPTIONS,
        }


def _strides(t: Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _dense(t: Tensor) -> Tensor:
    """`t` if its elements fill its memory without gaps or overlap (any dimension order, as
    Megalodon's transposed heads), else a contiguous copy: the gradients are written with the
    input's strides."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        if stride != expected:
            return t.contiguous()
        expected *= size
    return t


def _like(t: Tensor) -> Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        w: Tensor | None,
        valid: Tensor | None,
        first: Tensor | None,
        spec: _Spec,
    ) -> Tensor:
        N, H, Cq, Z = q.shape
        Ck, E = k.shape[2], v.shape[3]
        o = v.new_empty(N, H, Cq, E)
        lse = q.new_empty(N * H, Cq, dtype=torch.float32) if spec.fn == "softmax" else None
        dummy = q.new_empty(1, dtype=torch.float32)
        # batch·head on the first grid axis (up to 2³¹ − 1 programs; the others take 65,535)
        grid = (N * H, triton.cdiv(Cq, spec.block_m), triton.cdiv(E, spec.block_e))
        jit.fwd_kernel[grid](
            q, k, v, dummy if w is None else w, dummy if valid is None else valid,
            dummy if first is None else first, o, dummy if lse is None else lse,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            0 if valid is None else valid.stride(0), H, Cq, Ck, Z, E, spec.q_offset,
            spec.positions, spec.scale, **spec.meta(),
        )  # fmt: skip
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, w, valid, first, o, lse)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        spec: _Spec = ctx.spec
        q, k, v, w, valid, first, o, lse = ctx.saved_tensors
        N, H, Cq, Z = q.shape
        Ck, E = k.shape[2], v.shape[3]
        do = grad.contiguous()
        dq, dk, dv = _like(q), _like(k), _like(v)  # the strides of q, k, v (dense)
        dummy = q.new_empty(1, dtype=torch.float32)
        need_bias = w is not None and ctx.needs_input_grad[3]
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_bias else None
        delta = None
        if spec.fn == "softmax":  # D_i = rowsum(dO_i ⊙ O_i)
            delta = (do.float() * o.float()).sum(-1).reshape(N * H, Cq)
        tensors = (
            dummy if w is None else w,
            dummy if valid is None else valid,
            dummy if first is None else first,
            dummy if lse is None else lse,
        )
        sizes = (0 if valid is None else valid.stride(0), H, Cq, Ck, Z, E, spec.q_offset,
                 spec.positions, spec.scale)  # fmt: skip
        meta = spec.meta()
        grid_n = triton.cdiv(Ck, spec.block_n)
        jit.bwd_dv_kernel[(N * H, grid_n, triton.cdiv(E, spec.block_e))](
            q, k, *tensors, do, dv, *_strides(q), *_strides(k), *_strides(do), *_strides(dv),
            *sizes, **meta,
        )  # fmt: skip
        jit.bwd_dk_kernel[(N * H, grid_n)](
            q, k, v, *tensors, dummy if delta is None else delta, do, dk,
            dummy if dw is None else dw, *_strides(q), *_strides(k), *_strides(v),
            *_strides(do), *sizes, **meta,
        )  # fmt: skip
        jit.bwd_dq_kernel[(N * H, triton.cdiv(Cq, spec.block_m))](
            q, k, v, *tensors, dummy if delta is None else delta, do, dq, *_strides(q),
            *_strides(k), *_strides(v), *_strides(do), *sizes, **meta,
        )  # fmt: skip
        db = None if dw is None or w is None else dw.to(w.dtype)
        return dq, dk, dv, db, None, None, None


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    fn: str = "softmax",
    scale: float = 1.0,
    bias: Tensor | None = None,
    positions: int = 0,
    valid: Tensor | None = None,
    causal: bool = False,
    q_offset: int = 0,
    empty_rows: str = "causal",
) -> Tensor:
    """O = f(Q Kᵀ · scale + b) V on the Triton kernel, for (N, H, Cq, z) queries.

    Args:
        q, k: (N, H, Cq, z), (N, H, Ck, z); v: (N, H, Ck, E), all of one dtype (float32, bf16
            or fp16) on one device; any strides.
        fn: softmax | laplace | relu2 (laplace/relu2 take no normaliser: scale Q beforehand).
        bias: Mega's 'simple' weights w (2M − 1,), b[i, j] = w[M − 1 + j − (i + q_offset)],
            with `positions` = M; shared by every sample and head.
        valid: (N, Ck) bool, True at real keys (None: all real); shared by the heads.
        causal: query r sees keys up to r + q_offset.
        empty_rows: the keys of a softmax row with none left by the masks: "causal" (Mega) or
            "all" (Megalodon).
    """
    if fn not in FUNCTIONS:
        raise ValueError(f"unknown attention function {fn!r}; allowed values: {FUNCTIONS}")
    if empty_rows not in EMPTY_ROWS:
        raise ValueError(f"empty_rows must be one of {EMPTY_ROWS}, got {empty_rows!r}")
    if triton is None:
        raise RuntimeError("the Triton attention kernel needs the `triton` package (gpu extra)")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (N, H, C, width), got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    N, H, Cq, Z = q.shape
    Ck = k.shape[2]
    if k.shape != (N, H, Ck, Z) or v.shape[:3] != (N, H, Ck):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} disagree: k must be "
            "(N, H, Ck, z) like q, and v (N, H, Ck, E)"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise ValueError(
            f"q, k, v must share one dtype of {DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != 2 * positions - 1:
            raise ValueError(
                f"the 'simple' bias must be (2M − 1,) with M = positions = {positions}, got "
                f"{tuple(bias.shape)}"
            )
        if positions < Ck or positions < q_offset + Cq:
            raise ValueError(
                f"{Ck} keys / query positions up to {q_offset + Cq} exceed the {positions} "
                "positions of the 'simple' bias: increase max_positions or chunk_size"
            )
    first = None
    if valid is not None:
        if valid.shape != (N, Ck):
            raise ValueError(f"valid must be (N, Ck) = {(N, Ck)}, got {tuple(valid.shape)}")
        valid = valid.to(torch.bool)
        any_valid = valid.any(dim=-1)
        first = torch.where(any_valid, valid.to(torch.int8).argmax(dim=-1), Ck).to(torch.int32)
        valid = valid.to(torch.int8).contiguous()
    spec = _Spec(
        fn, float(scale), causal, q_offset, positions, empty_rows, bias is not None,
        valid is not None, Z, v.shape[3], q.device, q.dtype,
    )  # fmt: skip
    if bias is not None:
        bias = bias.contiguous()
    q, k, v = _dense(q), _dense(k), _dense(v)
    out: Tensor = _FlashAttention.apply(q, k, v, bias, valid, first, spec)
    return out


def compute_dtype(q: Tensor, v: Tensor) -> torch.dtype:
    """The kernel's input dtype: autocast's where it is on, else the promotion of q's and v's."""
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return torch.promote_types(q.dtype, v.dtype)


def use_attention_kernel(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether attention on q, k, v runs on a GPU path (`kernels.use_kernel("attention", ...)`
    and a dtype the kernel takes; float64 keeps the reference)."""
    return use_kernel("attention", q, k, v) and compute_dtype(q, v) in DTYPES
