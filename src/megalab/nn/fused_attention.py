"""Mega's single-head attention with a learned bias, blockwise over queries, hand-differentiated.

    O = f(S) V,   S = Q Kᵀ / τ + b_rel                          (Mega eq. 11, `attention.py`)

`scaled_dot_product_attention` cannot run this fused on CPU: a bias that needs a gradient sends
it to its math kernel, which materialises the (N, Cq, Ck) logits, weights and their gradients,
and the flash kernel also needs Q, K and V of one width (Mega's v = 2d ≠ z). Here one autograd
function computes the output and every gradient, the bias gradient included, one block of
queries at a time, with the GEMMs (`baddbmm`/`bmm`) large and the elementwise work on a block that
stays in cache:

    softmax:        P = softmax(S),                      dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O))
    laplace/relu2:  A = f(S) ⊙ masks (S = QKᵀ/n + b),    dS = (dO Vᵀ) ⊙ f'(S) ⊙ masks
    dQ = dS K / τ,  dK = dSᵀ Q / τ,  dV = Pᵀ dO,  db = Σ_batch dS

The bias enters as its factors, never as a dense (Cq, Ck) matrix unless given one:
`toeplitz` (Mega's 'simple' bias: b[i, j] = w[M − 1 + j − (i + offset)], gathered per block and
its gradient scattered back into w) or `lowrank` (the 'rotary' bias b = R_a R_bᵀ with the rotated
vectors (Cq, z) and (Ck, z)). With `recompute=True` the backward recomputes each block's weights
from Q and K and the saved log-sum-exp (softmax) instead of keeping them: attention then needs
O(N · block · Ck) memory instead of O(N · Cq · Ck), the flash-attention trade of a third more
GEMM work for linear memory. With `recompute=False` the weights are kept (faster backward).

Masks follow `ChunkedAttention` exactly: softmax masks padded keys with −inf except in a chunk of
padding only, causal rows see keys up to themselves, and a causal row with no valid key keeps its
causal keys; laplace/relu2 multiply the weights by the key mask and the causal mask and divide
QKᵀ by the number of valid keys (or i + 1 under the causal mask, or Ck).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megalab.nn.attention import LAPLACE_MU, LAPLACE_SIGMA, laplace

BIAS_KINDS = ("dense", "toeplitz", "lowrank")
# Elements of one block's (N, block, Ck) logits: 2^24 floats = 64 MB, a few such live at once.
BLOCK_ELEMENTS = 1 << 24


def query_block(n: int, cq: int, ck: int, block_elements: int | None = None) -> int:
    """Queries per block so that one (n, block, ck) tensor holds about `block_elements`
    (default `BLOCK_ELEMENTS`)."""
    elements = BLOCK_ELEMENTS if block_elements is None else block_elements
    return max(1, min(cq, elements // max(1, n * ck)))


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
        block: int,
        recompute: bool,
    ) -> None:
        self.fn, self.causal, self.q_offset, self.scale = fn, causal, q_offset, scale
        self.bias_kind, self.positions, self.block, self.recompute = (
            bias_kind,
            positions,
            block,
            recompute,
        )


def _bias_block(spec: _Spec, b1: Tensor, b2: Tensor | None, i0: int, i1: int, ck: int) -> Tensor:
    """Rows i0:i1 of the (Cq, Ck) bias."""
    if spec.bias_kind == "dense":
        return b1[i0:i1]
    if spec.bias_kind == "lowrank":
        assert b2 is not None
        return b1[i0:i1] @ b2.T
    return b1[_toeplitz_index(spec, i0, i1, ck, b1.device)]


def _toeplitz_index(spec: _Spec, i0: int, i1: int, ck: int, device: torch.device) -> Tensor:
    """w-indices M − 1 + j − (i + offset) of the 'simple' bias for rows i0:i1."""
    rows = torch.arange(i0 + spec.q_offset, i1 + spec.q_offset, device=device)
    return (spec.positions - 1) - rows.unsqueeze(1) + torch.arange(ck, device=device)


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


def _divisor(spec: _Spec, valid: Tensor | None, i0: int, i1: int, ck: int, like: Tensor) -> Any:
    """laplace/relu2: n, the number of keys a row averages over: (rows, 1), (N, 1, 1) or Ck."""
    if spec.causal:
        return torch.arange(i0 + spec.q_offset + 1, i1 + spec.q_offset + 1, dtype=like.dtype,
                            device=like.device).unsqueeze(1)  # fmt: skip
    if valid is not None:
        return valid.sum(dim=-1).clamp(min=1).to(like.dtype)[:, None, None]
    return float(ck)


def _laplace_grad(x: Tensor) -> Tensor:
    """d/dx ½(1 + erf((x − μ)/(σ√2))) = exp(−(x − μ)²/(2σ²)) / (σ√(2π))."""
    return torch.exp(-((x - LAPLACE_MU) ** 2) / (2 * LAPLACE_SIGMA**2)) / (
        LAPLACE_SIGMA * math.sqrt(2 * math.pi)
    )


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
        out = q.new_empty(N, cq, v.shape[-1])
        kT = k.transpose(1, 2)
        keep: list[Tensor] = []
        lse = q.new_empty(N, cq) if spec.fn == "softmax" and spec.recompute else None
        for i0 in range(0, cq, spec.block):
            i1 = min(cq, i0 + spec.block)
            s = _logits(spec, q, kT, b1, b2, i0, i1, ck, valid)
            allowed = _allowed(spec, key_ok, valid, i0, i1, ck, q.device)
            if spec.fn == "softmax":
                s = _mask_fill(s, allowed)
                if lse is not None:
                    lse[:, i0:i1] = torch.logsumexp(s, dim=-1)
                w = torch.softmax(s, dim=-1)
                kept = w  # the backward needs the weights P
            else:
                w = _activate(spec, s, allowed)
                kept = s  # the backward needs the logits (for f') and makes A from them
            if not spec.recompute:
                keep.append(kept)
            out[:, i0:i1] = torch.bmm(w, v)
        ctx.spec = spec
        saved = [] if spec.recompute else keep
        ctx.n_keep = len(saved)
        ctx.save_for_backward(q, k, v, key_ok, valid, b1, b2, out, lse, *saved)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        spec: _Spec = ctx.spec
        q, k, v, key_ok, valid, b1, b2, out, lse, *keep = ctx.saved_tensors
        cq = q.shape[1]
        ck = k.shape[1]
        grad = grad.contiguous()
        kT, vT = k.transpose(1, 2), v.transpose(1, 2)
        dq = torch.empty_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        need_bias = ctx.needs_input_grad[5] or ctx.needs_input_grad[6]
        db1 = torch.zeros_like(b1) if need_bias else None
        db2 = torch.zeros_like(b2) if need_bias and b2 is not None else None
        # softmax: rowsum(dS-free term) D_i = Σ_j P_ij (dO_i · V_j) = dO_i · O_i
        delta = (grad * out).sum(-1, keepdim=True) if spec.fn == "softmax" else None
        for n_block, i0 in enumerate(range(0, cq, spec.block)):
            i1 = min(cq, i0 + spec.block)
            g = grad[:, i0:i1]
            dp = torch.bmm(g, vT)  # dO Vᵀ: (N, rows, Ck)
            allowed = _allowed(spec, key_ok, valid, i0, i1, ck, q.device)
            if spec.fn == "softmax":
                if spec.recompute:
                    p = _mask_fill(_logits(spec, q, kT, b1, b2, i0, i1, ck), allowed)
                    p = p.sub_(lse[:, i0:i1, None]).exp_()
                else:
                    p = keep[n_block]
                dv.baddbmm_(p.transpose(1, 2), g)
                assert delta is not None  # computed above for softmax
                ds = dp.sub_(delta[:, i0:i1]).mul_(p)  # P ⊙ (dP − D)
                assert spec.scale is not None, "softmax has its scale set at the start"
                scale = spec.scale
            else:
                s = keep[n_block] if keep else _logits(spec, q, kT, b1, b2, i0, i1, ck, valid)
                deriv = _laplace_grad(s) if spec.fn == "laplace" else 2 * torch.relu(s)
                dv.baddbmm_(_activate(spec, s, allowed).transpose(1, 2), g)
                ds = dp.mul_(deriv)
                if allowed is not None:
                    ds = ds.masked_fill_(~allowed, 0.0)
                n = _divisor(spec, valid, i0, i1, ck, q)
                scale = 1.0
            if need_bias:
                _bias_grad(spec, ds.sum(0), b1, b2, db1, db2, i0, i1, ck)
            if spec.fn != "softmax":
                ds = ds / n  # ∂S/∂(QKᵀ) = 1/n
            dq[:, i0:i1] = torch.bmm(ds, k).mul_(scale)
            dk.baddbmm_(ds.transpose(1, 2), q[:, i0:i1], alpha=scale)
        return dq, dk, dv, None, None, db1, db2, None


def _logits(
    spec: _Spec,
    q: Tensor,
    kT: Tensor,
    b1: Tensor,
    b2: Tensor | None,
    i0: int,
    i1: int,
    ck: int,
    valid: Tensor | None = None,
) -> Tensor:
    """S for rows i0:i1: QKᵀ·τ⁻¹ + b (softmax) or QKᵀ/n + b (laplace, relu2)."""
    bias = _bias_block(spec, b1, b2, i0, i1, ck).to(q.dtype)
    if spec.fn == "softmax":
        assert spec.scale is not None, "softmax has its scale set at the start"
        return torch.baddbmm(bias, q[:, i0:i1], kT, alpha=spec.scale)
    scores = torch.bmm(q[:, i0:i1], kT)
    return scores.div_(_divisor(spec, valid, i0, i1, ck, q)).add_(bias)


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
        db1.index_add_(0, _toeplitz_index(spec, i0, i1, ck, g.device).flatten(), g.flatten())


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
        recompute: recompute the weights in the backward (O(N · block · Ck) memory) instead of
            keeping them.
        block: queries per block (default: `query_block`).
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
        block or query_block(N, cq, ck),
        recompute,
    )
    return _MegaAttention.apply(q, k, v, key_ok, valid, b1, b2, spec)
