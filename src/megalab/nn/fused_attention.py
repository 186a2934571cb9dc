"""Mega's single-head attention with a learned bias, blockwise over queries, hand-differentiated.

    O = f(S) V,   S = Q Kᵀ / τ + b_rel                          (Mega eq. 11, `attention.py`)

`scaled_dot_product_attention` cannot run this fused on CPU: a bias that needs a gradient sends
it to its math kernel, which materialises the (N, Cq, Ck) logits, weights and their gradients,
and the flash kernel also needs Q, K and V of one width (Mega's v = 2d ≠ z). Here one autograd
function computes the output and every gradient, the bias gradient included, one block at a time
(whole chunks of several samples, or rows of one sample for long spans: `block_shape`), with
the GEMMs large and the elementwise work in place on a block of a few MB (the bias enters the
logits' GEMM as its input, τ⁻¹ scales Q once, dS is computed in dP's buffer). In float32 on
CPU, blocks of one sample run their GEMMs on oneDNN rather than MKL (`ONEDNN`, below):

    softmax:        P = softmax(S),                      dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O))
    laplace/relu2:  A = f(S) ⊙ masks (S = QKᵀ/n + b),    dS = (dO Vᵀ) ⊙ f'(S) ⊙ masks
    dQ = dS K / τ,  dK = dSᵀ Q / τ,  dV = Pᵀ dO,  db = Σ_batch dS

The bias enters as its factors, never as a dense (Cq, Ck) matrix unless given one:
`toeplitz` (Mega's 'simple' bias: b[i, j] = w[M − 1 + j − (i + offset)], gathered per block and
its gradient scattered back into w) or `lowrank` (the 'rotary' bias b = R_a R_bᵀ with the rotated
vectors (Cq, z) and (Ck, z)). With `recompute=True` the backward recomputes each block's weights
from Q and K and the saved log-sum-exp (softmax) instead of keeping them: attention then needs
O(block) memory instead of O(N · Cq · Ck), the flash-attention trade of one more QKᵀ GEMM and
exponential pass for linear memory. With `recompute=False` the weights are kept (faster
backward).

Masks follow `ChunkedAttention` exactly: softmax masks padded keys with −inf except in a chunk of
padding only, causal rows see keys up to themselves, and a causal row with no valid key keeps its
causal keys; laplace/relu2 multiply the weights by the key mask and the causal mask and divide
QKᵀ by the number of valid keys (or i + 1 under the causal mask, or Ck).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megalab.kernels.attention_functions import LAPLACE_MU, LAPLACE_SIGMA, key_counts, laplace

BIAS_KINDS = ("dense", "toeplitz", "lowrank")
# Elements of one block's (samples, rows, Ck) logits: 2^20 floats = 4 MiB in float32. Whole
# samples up to 1K x 1K keys, blocks of 2^20 / Ck rows beyond (256 rows at 4K keys); chunks run
# many samples per block. Measured on the 2-core development machine (Mega's full attention
# alone, fwd + bwd, z = 64, v = 256, CPU time): against one block of all samples (2^24 elements,
# 64 MB at 4K), 1.07x (recompute) / 1.0x (keep) at 1K (B = 8) and 1.34x / 1.14x at 4K (B = 2);
# 2^18 or 2^19 were 5-10% slower at 1K: the GEMMs over a block's rows (dV, dK) want many rows.
# On MKL alone it loses at 2K (B = 4): 0.95x / 0.94x against one block of all four samples.
BLOCK_ELEMENTS = 1 << 20


def block_shape(
    n: int, cq: int, ck: int, block: int | None = None, block_elements: int | None = None
) -> tuple[int, int]:
    """(samples, queries) of one block: about `block_elements` (default `BLOCK_ELEMENTS`) logits.

    A span whose (Cq, Ck) logits exceed the budget runs one sample at a time in blocks of rows;
    a shorter one (chunks) runs whole chunks, several samples per block. `block` fixes the rows.
    """
    elements = BLOCK_ELEMENTS if block_elements is None else block_elements
    rows = block if block is not None else elements // max(1, ck)
    rows = max(1, min(cq, rows))
    if rows < cq:
        return 1, rows
    return max(1, min(n, elements // max(1, cq * ck))), cq


class _Spec:
    """The non-tensor settings of one call (kept on the autograd context)."""

    def __init__(
        self,
        fn: str,
        causal: bool,
        q_offset: int,
        scale: float | None,
        bias_kind: str,
        positions: int,
        block: tuple[int, int],
        recompute: bool,
    ) -> None:
        self.fn, self.causal, self.q_offset, self.scale = fn, causal, q_offset, scale
        self.bias_kind, self.positions, self.recompute = bias_kind, positions, recompute
        self.samples, self.block = block

    def blocks(self, n: int, cq: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """Row blocks (i0, i1), each with its sample blocks (n0, n1)."""
        samples = [(n0, min(n, n0 + self.samples)) for n0 in range(0, n, self.samples)]
        return [(i0, min(cq, i0 + self.block), samples) for i0 in range(0, cq, self.block)]


def _bias_block(spec: _Spec, b1: Tensor, b2: Tensor | None, i0: int, i1: int, ck: int) -> Tensor:
    """Rows i0:i1 of the (Cq, Ck) bias."""
    if spec.bias_kind == "dense":
        return b1[i0:i1]
    if spec.bias_kind == "lowrank":
        assert b2 is not None
        return b1[i0:i1] @ b2.T
    return _toeplitz_windows(spec, b1, i0, i1, ck).flip(0)


def _toeplitz_start(spec: _Spec, i1: int) -> int:
    """w-index M − 1 − (i + offset) of b[i, 0] for the last row i = i1 − 1 of a block."""
    start = spec.positions - 1 - (i1 - 1 + spec.q_offset)
    if start < 0:
        raise ValueError(
            f"query position {i1 - 1 + spec.q_offset} is beyond the {spec.positions} positions "
            "of the 'simple' bias: increase max_positions or chunk_size"
        )
    return start


def _toeplitz_windows(spec: _Spec, w: Tensor, i0: int, i1: int, ck: int) -> Tensor:
    """Rows i0:i1 of the 'simple' bias b[i, j] = w[M − 1 + j − (i + offset)], last row first.

    Row i is the window of `ck` weights starting at M − 1 − (i + offset); the windows of a
    block are consecutive, so they are one strided view of w (no index tensor, unlike a gather
    with (rows, Ck) int64 indices, which cost more than the softmax at 1K keys).
    """
    start = _toeplitz_start(spec, i1)
    return w.unfold(0, ck, 1)[start : start + i1 - i0]


def _diagonal_sums(g: Tensor) -> Tensor:
    """s[t] = Σ_{r + j = t} g[r, j] for g (R, C): the R + C − 1 anti-diagonal sums.

    Skewing: with each row padded by R zeros, the flat buffer read with rows of C + R − 1
    elements shifts row r right by r, so anti-diagonals become columns.
    """
    R, C = g.shape
    skewed = torch.nn.functional.pad(g, (0, R)).flatten()[: R * (C + R - 1)]
    return skewed.view(R, C + R - 1).sum(0)


def _allowed(
    spec: _Spec,
    key_ok: Tensor | None,
    valid: Tensor | None,
    i0: int,
    i1: int,
    ck: int,
    device: torch.device,
) -> Tensor | None:
    """Which keys rows i0:i1 may see: (N or 1, rows, Ck) bool, or None for all of them."""
    causal = None
    if spec.causal:
        rows = torch.arange(i0 + spec.q_offset, i1 + spec.q_offset, device=device)
        causal = torch.arange(ck, device=device) <= rows.unsqueeze(1)
    if spec.fn == "softmax":
        allowed = None if key_ok is None else key_ok.unsqueeze(1)
        if causal is not None:
            allowed = causal.unsqueeze(0) if allowed is None else allowed & causal
            if key_ok is not None:
                # A causal row whose keys up to itself are all padding keeps its causal keys.
                allowed = allowed | (~allowed.any(dim=-1, keepdim=True) & causal)
        return allowed
    allowed = None if valid is None else valid.unsqueeze(1)
    if causal is not None:
        allowed = causal.unsqueeze(0) if allowed is None else allowed & causal
    return allowed


def _divisor(
    spec: _Spec, valid: Tensor | None, i0: int, i1: int, ck: int, like: Tensor
) -> Tensor | float:
    """laplace/relu2: n, the number of keys a row averages over: (rows, 1), (N, 1, 1) or Ck."""
    start = i0 + spec.q_offset
    return key_counts(start, i1 + spec.q_offset, ck, spec.causal, valid, like.dtype, like.device)


def _laplace_grad(x: Tensor) -> Tensor:
    """d/dx ½(1 + erf((x − μ)/(σ√2))) = exp(−(x − μ)²/(2σ²)) / (σ√(2π))."""
    return torch.exp(-((x - LAPLACE_MU) ** 2) / (2 * LAPLACE_SIGMA**2)) / (
        LAPLACE_SIGMA * math.sqrt(2 * math.pi)
    )


def _sl(t: Tensor | None, n0: int, n1: int) -> Tensor | None:
    return None if t is None else t[n0:n1]


def _scratch(buf: Tensor, shape: tuple[int, int, int]) -> Tensor:
    """A (samples, rows, Ck) view at the start of a flat block-sized buffer."""
    return buf[: shape[0] * shape[1] * shape[2]].view(shape)


def _onednn_linear() -> Any:
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return None


_LINEAR = _onednn_linear()
# Blocks of one sample in float32 on CPU run their GEMMs on oneDNN (`mkldnn._linear_pointwise`,
# IEEE float32, any operand strides) instead of `bmm` (MKL): on the AMD development machine MKL
# runs its AVX2 kernels at ~100 GFLOP/s on one core, oneDNN its AVX-512 kernels at 180-250
# GFLOP/s on the attention's shapes (docs/benchmarks.md). Off with MEGALAB_ONEDNN_ATTENTION=0 or
# `torch.backends.mkldnn.flags(enabled=False)`; float64 (no oneDNN kernel) and chunks (many small
# samples per block) use `bmm`.
ONEDNN = os.environ.get("MEGALAB_ONEDNN_ATTENTION", "1") != "0"
# ... and only for blocks of at least this many logits (64 rows x 1K keys): oneDNN compiles and
# caches a kernel per GEMM shape (~0.6 MB each, up to its primitive cache's 1,024), which pays
# for itself on training-sized blocks but would make token-by-token decoding, whose key count
# changes every step, 4x slower and grow the process by ~0.5 GB over 600 steps (measured).
ONEDNN_MIN_ELEMENTS = 1 << 16


def _use_onednn(t: Tensor, samples: int, rows: int, ck: int) -> bool:
    return (
        ONEDNN
        and samples == 1
        and rows * ck >= ONEDNN_MIN_ELEMENTS
        and _LINEAR is not None
        and t.dtype == torch.float32
        and t.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and bool(torch.backends.mkldnn.enabled)
    )


def _mm(a: Tensor, b: Tensor, dnn: bool, out: Tensor | None = None) -> Tensor:
    """a @ b for (n, M, K) and (n, K, N) of any strides (into `out` when given); n = 1 with
    oneDNN."""
    if not dnn:
        return torch.bmm(a, b, out=out)
    r = _LINEAR(a[0], b[0].T, None, "none", [], "").unsqueeze(0)  # x Wᵀ with W = bᵀ
    return r if out is None else out.copy_(r)


def _mm_add_(c: Tensor, a: Tensor, b: Tensor, dnn: bool) -> None:
    """c += a @ b."""
    if dnn:
        c.add_(_mm(a, b, dnn))
    else:
        c.baddbmm_(a, b)


class _MegaAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_ok: Tensor | None,
        valid: Tensor | None,
        b1: Tensor,
        b2: Tensor | None,
        spec: _Spec,
    ) -> Tensor:
        N, cq, _ = q.shape
        ck = k.shape[1]
        softmax = spec.fn == "softmax"
        dnn = _use_onednn(q, spec.samples, spec.block, k.shape[1])
        out = q.new_empty(N, cq, v.shape[-1])
        qs = _scaled_queries(spec, q)
        kT = k.transpose(1, 2)
        # Kept for the backward: the weights P (softmax) or the logits S (laplace/relu2, for f'),
        # written block by block; or, recomputing, the log-sum-exp of every softmax row.
        keep = None if spec.recompute else q.new_empty(N, cq, ck)
        lse = q.new_empty(N, cq) if softmax and spec.recompute else None
        buf_s = q.new_empty(spec.samples * spec.block * ck)
        buf_p = q.new_empty(spec.samples * spec.block * ck) if softmax else None
        for i0, i1, samples in spec.blocks(N, cq):
            bias = _bias_block(spec, b1, b2, i0, i1, ck).to(q.dtype)
            for n0, n1 in samples:
                shape = (n1 - n0, i1 - i0, ck)
                kept = None if keep is None else keep[n0:n1, i0:i1]
                sbuf = _scratch(buf_s, shape) if softmax or kept is None else kept
                s = _logits(spec, qs, kT, bias, n0, n1, i0, i1, _sl(valid, n0, n1), dnn, sbuf)
                allowed = _allowed(spec, _sl(key_ok, n0, n1), _sl(valid, n0, n1), i0, i1, ck,
                                   q.device)  # fmt: skip
                if softmax:
                    s = _mask_fill(s, allowed)
                    assert buf_p is not None
                    w = torch.softmax(s, dim=-1, out=_scratch(buf_p, shape) if kept is None
                                      else kept)  # fmt: skip
                    if lse is not None:
                        # log Σ_j exp(S_ij) = max_j S_ij − log max_j P_ij: two cheap row maxima
                        # instead of a second exponential pass (every row has a key it may see).
                        lse[n0:n1, i0:i1] = s.amax(dim=-1).sub_(w.amax(dim=-1).log_())
                else:
                    w = _activate(spec, s, allowed)  # the logits s stay for f' (kept or not)
                _mm(w, v[n0:n1], dnn, out=out[n0:n1, i0:i1])
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, key_ok, valid, b1, b2, out, lse, keep)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        spec: _Spec = ctx.spec
        q, k, v, key_ok, valid, b1, b2, out, lse, keep = ctx.saved_tensors
        N, cq, _ = q.shape
        ck = k.shape[1]
        softmax = spec.fn == "softmax"
        dnn = _use_onednn(q, spec.samples, spec.block, k.shape[1])
        grad = grad.contiguous()
        qs = _scaled_queries(spec, q)
        kT, vT = k.transpose(1, 2), v.transpose(1, 2)
        dq = torch.empty_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        need_bias = ctx.needs_input_grad[5] or ctx.needs_input_grad[6]
        db1 = torch.zeros_like(b1) if need_bias else None
        db2 = torch.zeros_like(b2) if need_bias and b2 is not None else None
        # softmax: rowsum(dS-free term) D_i = Σ_j P_ij (dO_i · V_j) = dO_i · O_i
        delta = (grad * out).sum(-1, keepdim=True) if softmax else None
        tau_inv = spec.scale if softmax and spec.scale is not None else 1.0
        buf_dp = q.new_empty(spec.samples * spec.block * ck)
        buf_s = q.new_empty(spec.samples * spec.block * ck) if keep is None else None
        for i0, i1, samples in spec.blocks(N, cq):
            bias = None
            if keep is None:
                bias = _bias_block(spec, b1, b2, i0, i1, ck).to(q.dtype)
            # Σ_samples dS of these rows: the bias gradient
            ds_sum = q.new_zeros(i1 - i0, ck) if need_bias else None
            for n0, n1 in samples:
                shape = (n1 - n0, i1 - i0, ck)
                g = grad[n0:n1, i0:i1]
                dp = _mm(g, vT[n0:n1], dnn, None if dnn else _scratch(buf_dp, shape))  # dO Vᵀ
                val = _sl(valid, n0, n1)
                allowed = _allowed(spec, _sl(key_ok, n0, n1), val, i0, i1, ck, q.device)
                if keep is None:
                    assert bias is not None and buf_s is not None
                    s = _logits(spec, qs, kT, bias, n0, n1, i0, i1, val, dnn,
                                _scratch(buf_s, shape))  # fmt: skip
                else:
                    s = keep[n0:n1, i0:i1]
                if softmax:
                    if keep is None:
                        assert lse is not None  # recomputing: P = exp(S − lse)
                        p = _mask_fill(s, allowed).sub_(lse[n0:n1, i0:i1, None]).exp_()
                    else:
                        p = s
                    _mm_add_(dv[n0:n1], p.transpose(1, 2), g, dnn)
                    assert delta is not None  # computed above for softmax
                    ds = dp.sub_(delta[n0:n1, i0:i1]).mul_(p)  # P ⊙ (dP − D)
                else:
                    deriv = _laplace_grad(s) if spec.fn == "laplace" else 2 * torch.relu(s)
                    _mm_add_(dv[n0:n1], _activate(spec, s, allowed).transpose(1, 2), g, dnn)
                    ds = dp.mul_(deriv)
                    if allowed is not None:
                        ds = ds.masked_fill_(~allowed, 0.0)
                if ds_sum is not None:
                    ds_sum.add_(ds[0] if n1 - n0 == 1 else ds.sum(0))
                if not softmax:
                    ds = ds.div_(_divisor(spec, val, i0, i1, ck, q))  # ∂S/∂(QKᵀ) = 1/n
                # dQ = dS K τ⁻¹; dK = dSᵀ Q τ⁻¹ = dSᵀ (Q τ⁻¹)
                dq_blk = _mm(ds, k[n0:n1], dnn, out=dq[n0:n1, i0:i1])
                if tau_inv != 1.0:
                    dq_blk.mul_(tau_inv)
                _mm_add_(dk[n0:n1], ds.transpose(1, 2), qs[n0:n1, i0:i1], dnn)
            if ds_sum is not None:
                _bias_grad(spec, ds_sum, b1, b2, db1, db2, i0, i1, ck)
        return dq, dk, dv, None, None, db1, db2, None


def _scaled_queries(spec: _Spec, q: Tensor) -> Tensor:
    """Q τ⁻¹ for softmax (the scale applied once, not on every block of logits), else Q."""
    if spec.fn != "softmax" or spec.scale == 1.0:
        return q
    assert spec.scale is not None, "softmax has its scale set at the start"
    return q * spec.scale


def _logits(
    spec: _Spec,
    qs: Tensor,
    kT: Tensor,
    bias: Tensor,
    n0: int,
    n1: int,
    i0: int,
    i1: int,
    valid: Tensor | None,
    dnn: bool,
    out: Tensor,
) -> Tensor:
    """S for samples n0:n1, rows i0:i1: (Q τ⁻¹) Kᵀ + b (softmax; the bias enters the GEMM, so
    adding it costs no pass) or QKᵀ/n + b (laplace, relu2; `valid` of n0:n1). Into `out`, except
    softmax logits from oneDNN (a new tensor: its binary post-op adds the bias)."""
    if spec.fn == "softmax":
        if dnn:
            assert _LINEAR is not None
            r = _LINEAR.binary(qs[n0, i0:i1], bias.contiguous(), kT[n0].T, None, "add")
            return r.unsqueeze(0)
        return torch.baddbmm(bias, qs[n0:n1, i0:i1], kT[n0:n1], out=out)
    scores = _mm(qs[n0:n1, i0:i1], kT[n0:n1], dnn, out=out)
    return scores.div_(_divisor(spec, valid, i0, i1, kT.shape[-1], qs)).add_(bias)


def _mask_fill(s: Tensor, allowed: Tensor | None) -> Tensor:
    return s if allowed is None else s.masked_fill_(~allowed, float("-inf"))


def _activate(spec: _Spec, s: Tensor, allowed: Tensor | None) -> Tensor:
    a = laplace(s) if spec.fn == "laplace" else torch.relu(s).square_()
    return a if allowed is None else a.masked_fill_(~allowed, 0.0)


def _bias_grad(
    spec: _Spec,
    g: Tensor,
    b1: Tensor,
    b2: Tensor | None,
    db1: Tensor | None,
    db2: Tensor | None,
    i0: int,
    i1: int,
    ck: int,
) -> None:
    """Accumulate the gradient of rows i0:i1 of the bias, g (rows, Ck), into its factors."""
    assert db1 is not None
    g = g.to(b1.dtype)
    if spec.bias_kind == "dense":
        db1[i0:i1] += g
    elif spec.bias_kind == "lowrank":
        assert b2 is not None and db2 is not None
        db1[i0:i1] += g @ b2
        db2 += g.T @ b1[i0:i1]
    else:
        # b[i, j] = w[start + (i1 − 1 − i) + j]: rows last first, the anti-diagonal r + j = t
        # of the flipped block is w[start + t].
        start = _toeplitz_start(spec, i1)
        db1[start : start + (i1 - i0) + ck - 1] += _diagonal_sums(g.flip(0))


def mega_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: tuple[str, Tensor, Tensor | None],
    fn: str = "softmax",
    valid: Tensor | None = None,
    causal: bool = False,
    q_offset: int = 0,
    scale: float | None = None,
    positions: int = 0,
    recompute: bool = True,
    block: int | None = None,
) -> Tensor:
    """Mega's attention O = f(QKᵀ/τ + b) V for (N, Cq, z) queries against (N, Ck, z) keys.

    Args:
        q, k: (N, Cq, z), (N, Ck, z); v: (N, Ck, E) (N: batch × chunks).
        bias: ("dense", (Cq, Ck), None), ("toeplitz", w (2M − 1,), None) with `positions` = M,
            or ("lowrank", R_a (Cq, r), R_b (Ck, r)).
        fn: softmax | laplace | relu2.
        valid: (N, Ck) bool, True at real keys (None: all real).
        causal: query r sees keys up to r + q_offset.
        scale: softmax's 1/τ (default z^-½).
        recompute: recompute the weights in the backward (memory of one block) instead of
            keeping them.
        block: queries per block (default: `block_shape`, about `BLOCK_ELEMENTS` logits).
    """
    kind, b1, b2 = bias
    if kind not in BIAS_KINDS:
        raise ValueError(f"unknown bias kind {kind!r}; choose one of {BIAS_KINDS}")
    if kind == "toeplitz" and positions <= 0:
        raise ValueError("a 'toeplitz' bias needs `positions` (M of the 2M − 1 weights)")
    N, cq, z = q.shape
    ck = k.shape[1]
    key_ok = None
    if valid is not None:
        # softmax: a chunk whose keys are all padding is left unmasked (the authors' code)
        key_ok = valid | ~valid.any(dim=-1, keepdim=True)
    spec = _Spec(
        fn,
        causal,
        q_offset,
        z**-0.5 if scale is None else scale,
        kind,
        positions,
        block_shape(N, cq, ck, block),
        recompute,
    )
    return _MegaAttention.apply(q, k, v, key_ok, valid, b1, b2, spec)
