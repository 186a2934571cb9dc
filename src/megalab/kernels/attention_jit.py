"""The `@triton.jit` programs of the attention kernel: the forward and the three backward kernels
(dV, dK with the bias gradient, dQ), with the score, weight and gradient helpers they share.

`megalab.kernels.attention` launches them (its docstring has the algorithm) and imports this
module only where Triton is installed.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from megalab.kernels.attention_functions import LAPLACE_MU, LAPLACE_SIGMA

# Compile-time constants of the kernels (Triton reads globals only as constexpr).
_MU = tl.constexpr(LAPLACE_MU)
_SIGMA = tl.constexpr(LAPLACE_SIGMA)


@triton.jit
def _mm(a: tl.tensor, b: tl.tensor, PRECISION: tl.constexpr, UPCAST: tl.constexpr) -> tl.tensor:
    """a @ b accumulated in float32; with UPCAST (bf16/fp16 in the interpreter, whose
    half-precision `tl.dot` gives wrong sums in Triton 3.9) on float32 copies of a and b."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _tile(
    X: tl.tensor, n: tl.tensor, h: tl.tensor, rows: tl.tensor, cols: tl.tensor, s_n: tl.tensor,
    s_h: tl.tensor, s_r: tl.tensor, s_c: tl.tensor, R: tl.tensor, C: tl.tensor,
) -> tuple[tl.tensor, tl.tensor]:  # fmt: skip
    """The pointers of tile (rows, cols) of head (n, h) in an (N, H, R, C) tensor with strides
    (s_n, s_h, s_r, s_c), and which of them lie inside it. The head's offset is taken in int64:
    past 2³¹ elements (values of 256K tokens × 8192) an int32 product wraps around."""
    head = n.to(tl.int64) * s_n + h.to(tl.int64) * s_h
    ptrs = X + head + rows[:, None] * s_r + cols[None, :] * s_c
    return ptrs, (rows[:, None] < R) & (cols[None, :] < C)


@triton.jit
def _load_tile(
    X: tl.tensor, n: tl.tensor, h: tl.tensor, rows: tl.tensor, cols: tl.tensor, s_n: tl.tensor,
    s_h: tl.tensor, s_r: tl.tensor, s_c: tl.tensor, R: tl.tensor, C: tl.tensor,
) -> tl.tensor:  # fmt: skip
    """A `_tile`, zero outside the tensor."""
    ptrs, inside = _tile(X, n, h, rows, cols, s_n, s_h, s_r, s_c, R, C)
    return tl.load(ptrs, mask=inside, other=0.0)


@triton.jit
def _store_tile(
    X: tl.tensor, value: tl.tensor, n: tl.tensor, h: tl.tensor, rows: tl.tensor, cols: tl.tensor,
    s_n: tl.tensor, s_h: tl.tensor, s_r: tl.tensor, s_c: tl.tensor, R: tl.tensor, C: tl.tensor,
) -> None:  # fmt: skip
    """Write `value` (float32) to a `_tile` in X's dtype."""
    ptrs, inside = _tile(X, n, h, rows, cols, s_n, s_h, s_r, s_c, R, C)
    tl.store(ptrs, value.to(X.dtype.element_ty), mask=inside)


@triton.jit
def _keys_end(
    pid_m: tl.tensor, Ck: tl.tensor, q_offset: tl.tensor, BOUNDED: tl.constexpr,
    BLOCK_M: tl.constexpr,
) -> tl.tensor:  # fmt: skip
    """The end of the keys query block pid_m sees: all, or (BOUNDED: no row sees a key after
    its own position) up to its last row's position."""
    hi = Ck
    if BOUNDED:
        hi = tl.minimum(Ck, (pid_m + 1) * BLOCK_M + q_offset)
    return hi


@triton.jit
def _queries_start(
    pid_n: tl.tensor, q_offset: tl.tensor, BOUNDED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> tl.tensor:  # fmt: skip
    """Where the queries that see key block pid_n start: 0, or (BOUNDED: no row sees a key
    after its own position) the query block holding the block's first key position."""
    lo = 0
    if BOUNDED:
        lo = (tl.maximum(pid_n * BLOCK_N - q_offset, 0) // BLOCK_M) * BLOCK_M
    return lo


@triton.jit
def _scores(
    q: tl.tensor,
    k: tl.tensor,
    offs_m: tl.tensor,
    offs_n: tl.tensor,
    n: tl.tensor,
    W: tl.tensor,
    VALID: tl.tensor,
    FIRST: tl.tensor,
    stride_valid: tl.tensor,
    Cq: tl.tensor,
    Ck: tl.tensor,
    q_offset: tl.tensor,
    positions: tl.tensor,
    scale: tl.tensor,
    FN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_VALID: tl.constexpr,
    CAUSAL: tl.constexpr,
    EMPTY_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """S (BM, BN) in float32 of a query tile against a key tile, and the keys each row sees."""
    s = _mm(q, tl.trans(k), PRECISION, UPCAST) * scale
    pos = offs_m + q_offset  # the queries' key positions
    in_range = (offs_m[:, None] < Cq) & (offs_n[None, :] < Ck)
    if HAS_BIAS:
        idx = positions - 1 + offs_n[None, :] - pos[:, None]
        s += tl.load(W + idx, mask=in_range, other=0.0).to(tl.float32)
    allowed = in_range
    causal = offs_n[None, :] <= pos[:, None]
    if HAS_VALID:
        key = tl.load(VALID + n * stride_valid + offs_n, mask=offs_n < Ck, other=0) != 0
        if FN == 0:
            first = tl.load(FIRST + n)  # the first valid key (Ck: none)
            if CAUSAL:
                empty = pos < first
            else:
                empty = (offs_m * 0 + first) >= Ck
            allowed = allowed & (key[None, :] | empty[:, None])
            if CAUSAL:
                if EMPTY_CAUSAL:
                    allowed = allowed & causal
                else:
                    allowed = allowed & (causal | empty[:, None])
        else:
            allowed = allowed & key[None, :]
            if CAUSAL:
                allowed = allowed & causal
    elif CAUSAL:
        allowed = allowed & causal
    return s, allowed


@triton.jit
def _activate(s: tl.tensor, FN: tl.constexpr) -> tl.tensor:
    """f(S) for laplace (FN 1) or relu2 (FN 2)."""
    if FN == 1:
        return 0.5 * (1.0 + tl.erf((s - _MU) / (_SIGMA * 1.4142135623730951)))
    r = tl.maximum(s, 0.0)
    return r * r


@triton.jit
def _derivative(s: tl.tensor, FN: tl.constexpr) -> tl.tensor:
    """f'(S): exp(−(S − μ)²/(2σ²)) / (σ√(2π)) (laplace) or 2 relu(S) (relu2)."""
    if FN == 1:
        x = s - _MU
        return tl.exp(-(x * x) / (2.0 * _SIGMA * _SIGMA)) / (_SIGMA * 2.5066282746310002)
    return 2.0 * tl.maximum(s, 0.0)


@triton.jit
def fwd_kernel(
    Q: tl.tensor, K: tl.tensor, V: tl.tensor, W: tl.tensor, VALID: tl.tensor, FIRST: tl.tensor,
    OUT: tl.tensor, LSE: tl.tensor,
    sqn: tl.tensor, sqh: tl.tensor, sqm: tl.tensor, sqz: tl.tensor,
    skn: tl.tensor, skh: tl.tensor, skm: tl.tensor, skz: tl.tensor,
    svn: tl.tensor, svh: tl.tensor, svm: tl.tensor, sve: tl.tensor,
    son: tl.tensor, soh: tl.tensor, som: tl.tensor, soe: tl.tensor,
    stride_valid: tl.tensor, H: tl.tensor, Cq: tl.tensor, Ck: tl.tensor, Z: tl.tensor,
    E: tl.tensor, q_offset: tl.tensor, positions: tl.tensor, scale: tl.tensor,
    FN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_VALID: tl.constexpr,
    CAUSAL: tl.constexpr, EMPTY_CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_Z: tl.constexpr, BLOCK_E: tl.constexpr,
) -> None:  # fmt: skip
    pid_b, pid_m, pid_e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n, h = pid_b // H, pid_b % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_z = tl.arange(0, BLOCK_Z)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    q = _load_tile(Q, n, h, offs_m, offs_z, sqn, sqh, sqm, sqz, Cq, Z)
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start_n in range(0, _keys_end(pid_m, Ck, q_offset, BOUNDED, BLOCK_M), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K, n, h, offs_n, offs_z, skn, skh, skm, skz, Ck, Z)
        v = _load_tile(V, n, h, offs_n, offs_e, svn, svh, svm, sve, Ck, E)
        s, allowed = _scores(
            q, k, offs_m, offs_n, n, W, VALID, FIRST, stride_valid, Cq, Ck, q_offset,
            positions, scale, FN, HAS_BIAS, HAS_VALID, CAUSAL, EMPTY_CAUSAL, PRECISION, UPCAST,
        )  # fmt: skip
        if FN == 0:
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        else:
            p = tl.where(allowed, _activate(s, FN), 0.0)
        acc += _mm(p.to(v.dtype), v, PRECISION, UPCAST)
    if FN == 0:
        l_i = tl.where(l_i > 0.0, l_i, 1.0)  # rows past Cq only
        acc = acc / l_i[:, None]
        if pid_e == 0:
            tl.store(LSE + pid_b * Cq + offs_m, m_i + tl.log(l_i), mask=offs_m < Cq)
    _store_tile(OUT, acc, n, h, offs_m, offs_e, son, soh, som, soe, Cq, E)


@triton.jit
def _weights(
    q: tl.tensor, k: tl.tensor, offs_m: tl.tensor, offs_n: tl.tensor, n: tl.tensor,
    W: tl.tensor, VALID: tl.tensor, FIRST: tl.tensor, LSE: tl.tensor, pid_b: tl.tensor,
    stride_valid: tl.tensor, Cq: tl.tensor, Ck: tl.tensor, q_offset: tl.tensor,
    positions: tl.tensor, scale: tl.tensor, FN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_VALID: tl.constexpr,
    CAUSAL: tl.constexpr, EMPTY_CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:  # fmt: skip
    """The recomputed weights P (softmax: from the saved lse), the logits S and the mask."""
    s, allowed = _scores(
        q, k, offs_m, offs_n, n, W, VALID, FIRST, stride_valid, Cq, Ck, q_offset,
        positions, scale, FN, HAS_BIAS, HAS_VALID, CAUSAL, EMPTY_CAUSAL, PRECISION, UPCAST,
    )  # fmt: skip
    if FN == 0:
        lse = tl.load(LSE + pid_b * Cq + offs_m, mask=offs_m < Cq, other=0.0)
        p = tl.where(allowed, tl.exp(s - lse[:, None]), 0.0)
    else:
        p = tl.where(allowed, _activate(s, FN), 0.0)
    return p, s, allowed


@triton.jit
def bwd_dv_kernel(
    Q: tl.tensor, K: tl.tensor, W: tl.tensor, VALID: tl.tensor, FIRST: tl.tensor,
    LSE: tl.tensor, DO: tl.tensor, DV: tl.tensor,
    sqn: tl.tensor, sqh: tl.tensor, sqm: tl.tensor, sqz: tl.tensor,
    skn: tl.tensor, skh: tl.tensor, skm: tl.tensor, skz: tl.tensor,
    sdn: tl.tensor, sdh: tl.tensor, sdm: tl.tensor, sde: tl.tensor,
    svn: tl.tensor, svh: tl.tensor, svm: tl.tensor, sve: tl.tensor,
    stride_valid: tl.tensor, H: tl.tensor, Cq: tl.tensor, Ck: tl.tensor, Z: tl.tensor,
    E: tl.tensor, q_offset: tl.tensor, positions: tl.tensor, scale: tl.tensor,
    FN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_VALID: tl.constexpr,
    CAUSAL: tl.constexpr, EMPTY_CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_Z: tl.constexpr, BLOCK_E: tl.constexpr,
) -> None:  # fmt: skip
    """dV = Pᵀ dO for one key block and value tile, looping over query blocks."""
    pid_b, pid_n, pid_e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n, h = pid_b // H, pid_b % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_z = tl.arange(0, BLOCK_Z)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    k = _load_tile(K, n, h, offs_n, offs_z, skn, skh, skm, skz, Ck, Z)
    dv = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32)
    for start_m in range(_queries_start(pid_n, q_offset, BOUNDED, BLOCK_M, BLOCK_N), Cq, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(Q, n, h, offs_m, offs_z, sqn, sqh, sqm, sqz, Cq, Z)
        do = _load_tile(DO, n, h, offs_m, offs_e, sdn, sdh, sdm, sde, Cq, E)
        p, _s, _allowed = _weights(
            q, k, offs_m, offs_n, n, W, VALID, FIRST, LSE, pid_b, stride_valid, Cq, Ck,
            q_offset, positions, scale, FN, HAS_BIAS, HAS_VALID, CAUSAL, EMPTY_CAUSAL,
            PRECISION, UPCAST,
        )  # fmt: skip
        dv += _mm(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
    _store_tile(DV, dv, n, h, offs_n, offs_e, svn, svh, svm, sve, Ck, E)


@triton.jit
def _grad_scores(
    q: tl.tensor, k: tl.tensor, offs_m: tl.tensor, offs_n: tl.tensor, n: tl.tensor, h: tl.tensor,
    pid_b: tl.tensor, V: tl.tensor, W: tl.tensor, VALID: tl.tensor, FIRST: tl.tensor,
    LSE: tl.tensor, DELTA: tl.tensor, DO: tl.tensor,
    svn: tl.tensor, svh: tl.tensor, svm: tl.tensor, sve: tl.tensor,
    sdn: tl.tensor, sdh: tl.tensor, sdm: tl.tensor, sde: tl.tensor,
    stride_valid: tl.tensor, Cq: tl.tensor, Ck: tl.tensor, E: tl.tensor, q_offset: tl.tensor,
    positions: tl.tensor, scale: tl.tensor, FN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, EMPTY_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
) -> tl.tensor:  # fmt: skip
    """dS of a (query block, key block) tile: P recomputed (`_weights`), dP = dO Vᵀ over every
    value tile, then the softmax or f' chain rule."""
    p, s, allowed = _weights(
        q, k, offs_m, offs_n, n, W, VALID, FIRST, LSE, pid_b, stride_valid, Cq, Ck, q_offset,
        positions, scale, FN, HAS_BIAS, HAS_VALID, CAUSAL, EMPTY_CAUSAL, PRECISION, UPCAST,
    )  # fmt: skip
    dp = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start_e in range(0, E, BLOCK_E):
        offs_e = start_e + tl.arange(0, BLOCK_E)
        do = _load_tile(DO, n, h, offs_m, offs_e, sdn, sdh, sdm, sde, Cq, E)
        v = _load_tile(V, n, h, offs_n, offs_e, svn, svh, svm, sve, Ck, E)
        dp += _mm(do, tl.trans(v), PRECISION, UPCAST)
    if FN == 0:
        delta = tl.load(DELTA + pid_b * Cq + offs_m, mask=offs_m < Cq, other=0.0)
        return p * (dp - delta[:, None])
    return tl.where(allowed, dp * _derivative(s, FN), 0.0)


@triton.jit
def bwd_dk_kernel(
    Q: tl.tensor, K: tl.tensor, V: tl.tensor, W: tl.tensor, VALID: tl.tensor, FIRST: tl.tensor,
    LSE: tl.tensor, DELTA: tl.tensor, DO: tl.tensor, DK: tl.tensor, DW: tl.tensor,
    sqn: tl.tensor, sqh: tl.tensor, sqm: tl.tensor, sqz: tl.tensor,
    skn: tl.tensor, skh: tl.tensor, skm: tl.tensor, skz: tl.tensor,
    svn: tl.tensor, svh: tl.tensor, svm: tl.tensor, sve: tl.tensor,
    sdn: tl.tensor, sdh: tl.tensor, sdm: tl.tensor, sde: tl.tensor,
    stride_valid: tl.tensor, H: tl.tensor, Cq: tl.tensor, Ck: tl.tensor, Z: tl.tensor,
    E: tl.tensor, q_offset: tl.tensor, positions: tl.tensor, scale: tl.tensor,
    FN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_VALID: tl.constexpr,
    CAUSAL: tl.constexpr, EMPTY_CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_Z: tl.constexpr, BLOCK_E: tl.constexpr,
) -> None:  # fmt: skip
    """dK = dSᵀ Q τ⁻¹ for one key block, and the Toeplitz bias gradient of its tiles."""
    pid_b, pid_n = tl.program_id(0), tl.program_id(1)
    n, h = pid_b // H, pid_b % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_z = tl.arange(0, BLOCK_Z)
    k = _load_tile(K, n, h, offs_n, offs_z, skn, skh, skm, skz, Ck, Z)
    dk = tl.zeros((BLOCK_N, BLOCK_Z), dtype=tl.float32)
    for start_m in range(_queries_start(pid_n, q_offset, BOUNDED, BLOCK_M, BLOCK_N), Cq, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(Q, n, h, offs_m, offs_z, sqn, sqh, sqm, sqz, Cq, Z)
        ds = _grad_scores(
            q, k, offs_m, offs_n, n, h, pid_b, V, W, VALID, FIRST, LSE, DELTA, DO, svn, svh,
            svm, sve, sdn, sdh, sdm, sde, stride_valid, Cq, Ck, E, q_offset, positions, scale,
            FN, HAS_BIAS, HAS_VALID, CAUSAL, EMPTY_CAUSAL, PRECISION, UPCAST, BLOCK_M, BLOCK_N,
            BLOCK_E,
        )  # fmt: skip
        dk += _mm(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
        if HAS_BIAS:  # dw[M − 1 + j − (i + offset)] += dS_ij, along the diagonals
            idx = positions - 1 + offs_n[None, :] - (offs_m + q_offset)[:, None]
            tl.atomic_add(DW + idx, ds, mask=(offs_m[:, None] < Cq) & (offs_n[None, :] < Ck))
    _store_tile(DK, dk * scale, n, h, offs_n, offs_z, skn, skh, skm, skz, Ck, Z)


@triton.jit
def bwd_dq_kernel(
    Q: tl.tensor, K: tl.tensor, V: tl.tensor, W: tl.tensor, VALID: tl.tensor, FIRST: tl.tensor,
    LSE: tl.tensor, DELTA: tl.tensor, DO: tl.tensor, DQ: tl.tensor,
    sqn: tl.tensor, sqh: tl.tensor, sqm: tl.tensor, sqz: tl.tensor,
    skn: tl.tensor, skh: tl.tensor, skm: tl.tensor, skz: tl.tensor,
    svn: tl.tensor, svh: tl.tensor, svm: tl.tensor, sve: tl.tensor,
    sdn: tl.tensor, sdh: tl.tensor, sdm: tl.tensor, sde: tl.tensor,
    stride_valid: tl.tensor, H: tl.tensor, Cq: tl.tensor, Ck: tl.tensor, Z: tl.tensor,
    E: tl.tensor, q_offset: tl.tensor, positions: tl.tensor, scale: tl.tensor,
    FN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_VALID: tl.constexpr,
    CAUSAL: tl.constexpr, EMPTY_CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_Z: tl.constexpr, BLOCK_E: tl.constexpr,
) -> None:  # fmt: skip
    """dQ = dS K τ⁻¹ for one query block, looping over key blocks."""
    pid_b, pid_m = tl.program_id(0), tl.program_id(1)
    n, h = pid_b // H, pid_b % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_z = tl.arange(0, BLOCK_Z)
    q = _load_tile(Q, n, h, offs_m, offs_z, sqn, sqh, sqm, sqz, Cq, Z)
    dq = tl.zeros((BLOCK_M, BLOCK_Z), dtype=tl.float32)
    for start_n in range(0, _keys_end(pid_m, Ck, q_offset, BOUNDED, BLOCK_M), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K, n, h, offs_n, offs_z, skn, skh, skm, skz, Ck, Z)
        ds = _grad_scores(
            q, k, offs_m, offs_n, n, h, pid_b, V, W, VALID, FIRST, LSE, DELTA, DO, svn, svh,
            svm, sve, sdn, sdh, sdm, sde, stride_valid, Cq, Ck, E, q_offset, positions, scale,
            FN, HAS_BIAS, HAS_VALID, CAUSAL, EMPTY_CAUSAL, PRECISION, UPCAST, BLOCK_M, BLOCK_N,
            BLOCK_E,
        )  # fmt: skip
        dq += _mm(ds.to(k.dtype), k, PRECISION, UPCAST)
    _store_tile(DQ, dq * scale, n, h, offs_m, offs_z, sqn, sqh, sqm, sqz, Cq, Z)
