"""Transformer-XL's relative multi-head attention (Dai et al. 2019), shared by XL and LaMemo.

With queries from the current segment h (L rows) and keys/values from the memory and the
segment, X̃ = [sg(M); h] (K = m + L rows), the score of query i and key j is (XL eq. 6)

    A_ij = (q_i + u)ᵀ k_j  +  (q_i + v)ᵀ W_R R_{i−j}                     (a + c, b + d)

scaled by 1/√d_head, with u and v global biases shared by all layers, R the fixed sinusoid
table [sin(d·ω) | cos(d·ω)] of the distance d (not interleaved, as the code), W_R one
bias-free projection per layer (the code's `r_net`). The position term is computed for the
distances K−1, …, 0 of a table row by row and moved into place by the relative shift
(`rel_shift`, XL's appendix B). `clamp_len` > 0 caps every distance. The causal mask lets
query i see keys j ≤ m + i; `same_length` also hides keys further than `mem_len` back, so
every query sees the same number of keys.

LaMemo's look-ahead attention (Ji et al. 2022, eq. 9) reuses the same projections: memory
row i attends to the window of the last min(m, L) rows of X̃ that ends at the first current
token, strictly to its right, with the future distances 1…m (`rel_shift_future`).

Everything is batch-first: (B, T, H, d_head) heads, (B, H, L, K) scores. Scores are masked,
normalised and log-sum-exp'ed in at least float32 (the code does the same for masking and
its normalisers), so bf16 autocast keeps exact softmax statistics.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.nn.positions import sinusoid_frequencies, sinusoid_table


def at_least_float32(x: Tensor) -> Tensor:
    """`x` in float32 when it is a lower precision, unchanged in float32/float64.

    The authors' code calls `.float()` on scores and normalisers; in float64 that would round
    them to float32, which the golden data's float64 runs explicitly avoid.
    """
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class SinusoidPositions(nn.Module):
    """The fixed sinusoid table of a distance sequence: [sin(d·ω_k) | cos(d·ω_k)], (P, D).

    ω_k = 1 / 10000^(2k/D), computed in float32 as the code does (its buffer `inv_freq`;
    converting the module to float64 keeps those float32 values, which the golden data
    relies on).
    """

    inv_freq: Tensor  # registered buffer

    def __init__(self, d_model: int) -> None:
        super().__init__()
        if d_model % 2:
            raise ValueError(f"the sinusoid table needs an even d_model, got {d_model}")
        self.d_model = d_model
        inv_freq = sinusoid_frequencies(d_model // 2, d_model / 2)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, distances: Tensor) -> Tensor:
        """(P,) distances -> (P, D) table, in the dtype of `distances`."""
        return sinusoid_table(distances, self.inv_freq.to(distances.dtype))


def relative_distances(
    klen: int,
    future: int = 0,
    future_sign: int = 1,
    clamp_len: int = -1,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Distances K−1, …, 0 of the causal keys, then `future` look-ahead distances.

    LaMemo's disentangled encoding appends 1, …, m (`future_sign=+1`); its ablation with XL's
    encoding appends −1, …, −m (`future_sign=−1`). `clamp_len` > 0 caps every distance (the
    look-ahead ones included, as the code does).
    """
    seq = torch.arange(klen - 1, -1, -1.0, device=device, dtype=dtype)
    if future > 0:
        fut = torch.arange(1, future + 1, device=device, dtype=dtype) * future_sign
        seq = torch.cat([seq, fut])
    if clamp_len > 0:
        seq = seq.clamp(max=clamp_len)
    return seq


def rel_shift(x: Tensor) -> Tensor:
    """XL's relative shift on (..., L, K) position scores computed for distances K−1 … 0.

    Returns y with y[i, j] = x[i, j + L − 1 − i] for j ≤ i + K − L, i.e. the score of the
    distance (K − L) + i − j between query i (at key position K − L + i) and key j; entries
    right of that are shifted-in garbage that the causal mask removes.
    """
    *lead, L, K = x.shape
    padded = F.pad(x, (1, 0))  # a zero column on the left
    return padded.view(*lead, K + 1, L)[..., 1:, :].reshape(*lead, L, K)


def rel_shift_future(x: Tensor) -> Tensor:
    """LaMemo's look-ahead shift on (..., m, m) scores computed for distances 1 … m.

    Returns y with y[i, j] = x[i, j − i] for j ≥ i: column j is the key at position j + 1 of
    [memory; segment], at distance j + 1 − i from memory row i. Entries left of the diagonal
    are garbage that the look-ahead mask removes.
    """
    *lead, m, n = x.shape
    padded = F.pad(x, (0, 1))  # a zero column on the right
    return padded.view(*lead, n + 1, m)[..., :-1, :].reshape(*lead, m, n)


def causal_mask(
    qlen: int,
    mlen: int,
    same_length: bool = False,
    mem_len: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """(L, K) bool, True where query i must not see key j: j > m + i (the future) and, with
    `same_length`, keys more than `mem_len` positions back (as XL's `dec_attn_mask`)."""
    ones = torch.ones(qlen, qlen + mlen, dtype=torch.bool, device=device)
    masked = torch.triu(ones, diagonal=1 + mlen)
    if same_length:
        mask_len = qlen + mlen - mem_len
        shift = qlen - mask_len if mask_len > 0 else qlen
        masked = masked | torch.tril(ones, diagonal=-shift)
    return masked


def look_ahead_window(mlen: int, qlen: int) -> tuple[int, int]:
    """[start, stop) rows of [memory; segment] that memory rows attend to: the last
    min(m, L) rows ending at the first current token (row m), never row 0."""
    return max(mlen - qlen + 1, 1), mlen + 1


def look_ahead_mask(mlen: int, qlen: int, device: torch.device | str | None = None) -> Tensor:
    """(m, w) bool, True where memory row i must not see window column c: keys at or left of i
    (strictly-right attention; the last column, the first current token, is always seen)."""
    w = min(mlen, qlen)
    ones = torch.ones(mlen, mlen, dtype=torch.bool, device=device)
    return ~torch.triu(ones)[:, mlen - w :]


def relative_scores(
    q: Tensor, k: Tensor, r: Tensor, u: Tensor, v: Tensor, scale: float, future: bool = False
) -> Tensor:
    """Scaled scores (B, H, Lq, Lk) of queries q (B, Lq, H, d) on keys k (B, Lk, H, d).

    r (P, H, d) holds W_R R for the distance table (K−1 … 0 for the causal scores, 1 … m for
    the look-ahead ones, `future=True`); u and v are the content and position biases (H, d).
    """
    qh = q.transpose(1, 2)
    ac = torch.matmul(qh + u.unsqueeze(1), k.permute(0, 2, 3, 1))
    bd = torch.matmul(qh + v.unsqueeze(1), r.permute(1, 2, 0))
    if future:
        bd = rel_shift_future(bd)[..., bd.shape[-1] - k.shape[1] :]
    else:
        bd = rel_shift(bd)
    return (ac + bd) * scale


def masked_softmax(
    scores: Tensor, masked: Tensor | None, dropout: nn.Module, like: Tensor, need_lse: bool
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Softmax over the last axis with `masked` (broadcast) removed, in at least float32.

    Returns (probabilities after dropout in the dtype of `like`, log-sum-exp of the masked
    scores or None, probabilities before dropout for analysis).
    """
    s = at_least_float32(scores)
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    probs = torch.softmax(s, dim=-1)
    lse = torch.logsumexp(s, dim=-1) if need_lse else None
    return dropout(probs).to(like.dtype), lse, probs


class RelativeMultiHeadAttention(nn.Module):
    """The projections of XL's relative attention and its residual + LayerNorm.

    `qkv` is W_q, W_k^E and W_v as one bias-free (3·H·d_head, D) map (the XL code's
    `qkv_net`; LaMemo's `q_net` and `kv_net` stacked), `r_proj` W_k^R (`r_net`), `o_proj` W_o
    (`o_net`), `norm` the LayerNorm of the attention sub-layer (post-LN by default:
    LN(h + dropout(W_o ctx)); `pre_lnorm` normalises the inputs of the projections instead and
    keeps the plain residual). Attention probabilities go through `attention_dropout`
    (dropatt), W_o ctx through `dropout`.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        pre_lnorm: bool = False,
    ) -> None:
        super().__init__()
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
        inner = num_heads * head_dim
        self.qkv = nn.Linear(d_model, 3 * inner, bias=False)
        self.r_proj = nn.Linear(d_model, inner, bias=False)
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        self.norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(attention_dropout)
        self.scale = 1.0 / math.sqrt(head_dim)
        self.pre_lnorm = pre_lnorm

    def heads(self, x: Tensor) -> Tensor:
        """(B, T, H·d) -> (B, T, H, d)."""
        return x.view(*x.shape[:-1], self.num_heads, self.head_dim)

    def project_positions(self, table: Tensor) -> Tensor:
        """W_k^R R: (P, D) sinusoid table -> (P, H, d)."""
        return self.heads(self.r_proj(table))

    def project(self, x: Tensor, queries_from: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """Heads (B, T, H, d) of Q (rows `queries_from:` only), K and V of x (B, T, D)."""
        inner = self.num_heads * self.head_dim
        if self.pre_lnorm:
            x = self.norm(x)
        w = self.qkv.weight
        q = F.linear(x[:, queries_from:], w[:inner])
        k, v = F.linear(x, w[inner:]).chunk(2, dim=-1)
        return self.heads(q), self.heads(k), self.heads(v)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        r: Tensor,
        u: Tensor,
        pos_bias: Tensor,
        masked: Tensor | None,
        future: bool = False,
        need_lse: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Relative attention of q on (k, v): (context (B, Lq, H, d), log-normaliser
        (B, Lq, H) or None, probabilities (B, H, Lq, Lk) before dropout)."""
        scores = relative_scores(q, k, r, u, pos_bias, self.scale, future=future)
        probs, lse, raw = masked_softmax(scores, masked, self.dropatt, v, need_lse)
        ctx = torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2)
        if lse is not None:
            lse = lse.transpose(1, 2)
        return ctx, lse, raw

    def output(self, residual: Tensor, ctx: Tensor) -> Tensor:
        """LN(residual + dropout(W_o ctx)) (post-LN), or the plain residual sum (pre-LN)."""
        out = self.drop(self.o_proj(ctx.reshape(*ctx.shape[:-2], -1)))
        return residual + out if self.pre_lnorm else self.norm(residual + out)


def update_memory(old: Tensor | None, new: Tensor, mem_len: int, drop_last: int = 0) -> Tensor:
    """XL's memory rule: rows [end − mem_len, end) of [old; new] (batch-first, dim 1), detached,
    with end = m + max(0, L − drop_last); `drop_last` is `ext_len`, the tokens the next
    segment re-reads as extended context."""
    cat = new if old is None or old.shape[1] == 0 else torch.cat([old, new], dim=1)
    mlen = cat.shape[1] - new.shape[1]
    end = mlen + max(0, new.shape[1] - drop_last)
    begin = max(0, end - mem_len)
    return cat[:, begin:end].detach()
