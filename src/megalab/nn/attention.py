"""Mega's chunked single-head attention, attention functions and relative position biases.

    O = f(Q Kᵀ / τ + b_rel) V                         (Mega, eq. 11)

computed independently inside chunks of length c (Mega-chunk, §3.5), with f, τ and masking
exactly as in the authors' code (facebookresearch/mega):

- `softmax`: τ = √z (the Q/K width, not d); additive −inf masks on padded keys, except in a
  chunk whose keys are all padding, which the code leaves unmasked; the causal mask is additive.
  Runs on `scaled_dot_product_attention`.
- `laplace` / `relu2`: τ = the number of non-padded keys of the chunk (clamped ≥ 1), or i + 1
  for query i under a causal mask (this overrides the padding count), or the chunk length
  without a mask; masks multiply the weights; rows are NOT normalised.
  laplace(x) = ½(1 + erf((x − μ)/(σ√2))), μ = √½, σ = 1/(2√π): the paper's App. C matches relu²
  at x = √½ (the paper text's "x = √2" cannot hold, since relu²(√2) = 2 ∉ (0, 1)). We use the
  code's rounded constants 0.707107 and 0.282095.
- b_rel is added after scaling. `simple`: a learned scalar per signed offset,
  b[i, j] = w[M − 1 + j − i], M = chunk size (or `max_positions` without chunking).
  `rotary`: b[i, j] = ⟨R_i a, R_j b⟩ for two learned vectors a, b ∈ R^z rotated RoPE-style
  (half-split pairs, θ_k = 10000^{−k/(z/2)}); an input-independent bias, NOT RoPE on Q/K.

Chunks (`chunked_attention`, shared with the multi-head models): a length that is not a
multiple of c is padded internally (masked keys) and sliced back; a sequence no longer than c is
one chunk; `chunk_size=-1` is full attention. With a causal mask
each chunk has its own causal mask: nothing attends across chunks (information crosses them only
through the EMA). Streaming keeps the keys/values of the current, incomplete chunk and drops them
at each chunk boundary, as the code's incremental decoding does.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.kernels.attention_functions import (
    check_attention_function,
    key_counts,
    laplace,
    relu2,
)
from megalab.nn.positions import sinusoid_frequencies
from megalab.nn.rope import apply_rope
from megalab.nn.state import register_state

REL_POS_BIASES = ("simple", "rotary")
# Chunks of at most this many keys keep their attention weights for the backward (B·L·c floats,
# like one activation of width c); longer spans recompute them (`ChunkedAttention.recompute`).
# A rule by memory: keeping costs 4·c bytes per token and layer in float32, 2 KB at 512 keys
# (about an eighth of what a d = 128 Mega block keeps per token), 4 KB at 1K (+25%) for ~5% of
# layer speed (docs/benchmarks.md).
KEEP_WEIGHTS_SPAN = 512


class RelativeBiasTable(nn.Module):
    """A learned bias by relative offset δ ∈ (−M, M): w[M − 1 + δ], w ∈ R^{2M−1}."""

    def __init__(self, max_positions: int) -> None:
        super().__init__()
        if max_positions <= 0:
            raise ValueError(f"max_positions must be positive, got {max_positions}")
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.empty(2 * max_positions - 1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """w ~ N(0, 0.02)."""
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class SimpleRelativePositionalBias(RelativeBiasTable):
    """b[i, j] = w[M − 1 + j − i] with a learned w ∈ R^{2M−1} (init N(0, 0.02))."""

    def check(self, k_len: int) -> None:
        """Raise when `k_len` keys exceed the table."""
        if k_len > self.max_positions:
            raise ValueError(
                f"attention span {k_len} exceeds the 'simple' relative position bias size "
                f"{self.max_positions}: increase max_positions (no chunking) or chunk_size, or "
                "use rel_pos_bias='rotary'"
            )

    def factors(self, q_len: int, k_len: int, q_offset: int = 0) -> tuple[str, Tensor, None]:
        """The bias as `megalab.nn.fused_attention` takes it: the Toeplitz weights w."""
        self.check(k_len)
        return "toeplitz", self.weight, None

    def forward(self, q_len: int, k_len: int, q_offset: int = 0) -> Tensor:
        """(q_len, k_len) bias; query r sits at key position r + q_offset."""
        M = self.max_positions
        self.check(k_len)
        dev = self.weight.device
        i = torch.arange(q_offset, q_offset + q_len, device=dev)
        j = torch.arange(k_len, device=dev)
        return self.weight[M - 1 + j.unsqueeze(0) - i.unsqueeze(1)]


class RotaryRelativePositionalBias(nn.Module):
    """b[i, j] = ⟨R_i a, R_j b⟩ with learned a, b ∈ R^z (init N(0, 0.02)); any length."""

    def __init__(self, z_dim: int) -> None:
        super().__init__()
        if z_dim % 2:
            raise ValueError(f"the rotary bias needs an even z_dim, got {z_dim}")
        self.z_dim = z_dim
        self.a = nn.Parameter(torch.empty(z_dim))
        self.b = nn.Parameter(torch.empty(z_dim))
        nn.init.normal_(self.a, mean=0.0, std=0.02)
        nn.init.normal_(self.b, mean=0.0, std=0.02)

    def _rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """R_p x for every position p: (P, z), half-split pairs (x1 | x2)."""
        half = self.z_dim // 2
        inv_freq = sinusoid_frequencies(
            half, half, form="exp", dtype=positions.dtype, device=x.device
        )
        return apply_rope(x.to(positions.dtype), positions, inv_freq, interleaved=False)

    def factors(self, q_len: int, k_len: int, q_offset: int = 0) -> tuple[str, Tensor, Tensor]:
        """The bias as the product R_a R_bᵀ of the rotated vectors (q_len, z) and (k_len, z)."""
        # Sin/cos tables in at least float32 (the code builds them in float32).
        dtype = torch.promote_types(self.a.dtype, torch.float32)
        dev = self.a.device
        i = torch.arange(q_offset, q_offset + q_len, device=dev, dtype=dtype)
        j = torch.arange(k_len, device=dev, dtype=dtype)
        return "lowrank", self._rotate(self.a, i), self._rotate(self.b, j)

    def forward(self, q_len: int, k_len: int, q_offset: int = 0) -> Tensor:
        """(q_len, k_len) bias; query r sits at key position r + q_offset."""
        _, r_a, r_b = self.factors(q_len, k_len, q_offset)
        return (r_a @ r_b.T).to(self.a.dtype)


@register_state
class KVCache(NamedTuple):
    """Keys (B, T, z), values (B, T, v) and key validity (B, T) (or None) of the open chunk."""

    key: Tensor
    value: Tensor
    valid: Tensor | None


def relative_position_bias(
    kind: str, max_positions: int, z_dim: int
) -> SimpleRelativePositionalBias | RotaryRelativePositionalBias:
    """Mega's relative position bias: a learned table over `max_positions` offsets ("simple")
    or rotary embeddings of width `z_dim` ("rotary")."""
    if kind == "simple":
        return SimpleRelativePositionalBias(max_positions)
    if kind == "rotary":
        return RotaryRelativePositionalBias(z_dim)
    raise ValueError(f"unknown rel_pos_bias {kind!r}; allowed values: {', '.join(REL_POS_BIASES)}")


class ChunkedAttention(nn.Module):
    """Single-head attention within chunks, with Mega's attention functions and biases.

    Args:
        z_dim: width of Q and K (the softmax scale is z^-½).
        chunk_size: c > 0 for chunked attention, -1 for full attention.
        attention_activation: one of `ATTENTION_FUNCTIONS`.
        rel_pos_bias: one of `REL_POS_BIASES`.
        max_positions: size M of the 'simple' bias without chunking (with chunking M = c).
        causal: each query sees only keys at or before it (within its chunk).
        dropout: dropout on the attention weights.
        recompute: how the fused kernel (`megalab.nn.fused_attention`, used for float32/64
            without attention dropout) treats the weights in the backward: True recomputes
            them (memory linear in the span), False keeps them, None (default) keeps them for
            chunks of at most `KEEP_WEIGHTS_SPAN` keys and recomputes them for longer spans.
    """

    def __init__(
        self,
        z_dim: int,
        chunk_size: int = -1,
        attention_activation: str = "softmax",
        rel_pos_bias: str = "simple",
        max_positions: int = 1024,
        causal: bool = False,
        dropout: float = 0.0,
        recompute: bool | None = None,
    ) -> None:
        super().__init__()
        check_attention_function(attention_activation)
        if chunk_size == 0 or chunk_size < -1:
            raise ValueError(f"chunk_size must be positive or -1 (no chunking), got {chunk_size}")
        self.z_dim = z_dim
        self.chunk_size = chunk_size
        self.attention_activation = attention_activation
        self.causal = causal
        self.dropout = dropout
        self.recompute = recompute
        M = chunk_size if chunk_size > 0 else max_positions  # offsets within a chunk
        self.rel_pos_bias = relative_position_bias(rel_pos_bias, M, z_dim)

    @property
    def max_len(self) -> int | None:
        """Longest attention span (None if unlimited): the simple bias's size without chunking."""
        if self.chunk_size <= 0 and isinstance(self.rel_pos_bias, SimpleRelativePositionalBias):
            return self.rel_pos_bias.max_positions
        return None

    def extra_repr(self) -> str:
        return (
            f"z_dim={self.z_dim}, chunk_size={self.chunk_size}, "
            f"attention_activation={self.attention_activation!r}, causal={self.causal}"
        )

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        cache: KVCache | None = None,
        return_cache: bool = False,
    ) -> tuple[Tensor, KVCache | None]:
        """O = f(QKᵀ/τ + b_rel)V within chunks.

        Args:
            q, k: (B, L, z); v: (B, L, v).
            mask: (B, L) bool, True at real tokens.
            cache: keys/values of the open chunk from the previous segment (causal only); the
                new positions continue that chunk.
            return_cache: return the keys/values of the chunk left open after this segment.

        Returns:
            (O of shape (B, L, v), the new cache or None).
        """
        if (cache is not None or return_cache) and not self.causal:
            raise ValueError("only causal attention can be streamed with a key/value cache")
        return chunked_attention(
            q, k, v, mask, self.chunk_size, self._attend, cache=cache, return_cache=return_cache
        )

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, q_offset: int
    ) -> Tensor:
        """q (B, K, Cq, z), k (B, K, Ck, z), v (B, K, Ck, v), valid (B, K, Ck); query r is at
        key position r + q_offset of its chunk.

        On CUDA the Triton kernel computes it (`megalab.kernels.attention`; SDPA over value
        groups for softmax with `MEGALAB_ATTENTION_GPU=sdpa`). Elsewhere the fused kernel does
        (with the bias gradient) unless attention dropout is active or autocast / half precision
        is on: those take `_attend_unfused`.
        """
        dropout = self.training and self.dropout > 0
        from megalab.kernels import attention as gpu  # imports this module

        # The GPU paths have no attention dropout: with it, the reference paths run.
        if not dropout and gpu.use_attention_kernel(q, k, v):
            if self.attention_activation == "softmax" and gpu.gpu_path() == "sdpa":
                return self._attend_unfused(q, k, v, valid, q_offset, value_groups=True)
            return self._attend_kernel(q, k, v, valid, q_offset)
        half = q.dtype not in (torch.float32, torch.float64)
        if dropout or half or torch.is_autocast_enabled(q.device.type):
            return self._attend_unfused(q, k, v, valid, q_offset)
        from megalab.nn.fused_attention import mega_attention  # imports this module

        B, K, Cq = q.shape[:3]
        Ck = k.shape[2]
        recompute = self.recompute
        if recompute is None:
            recompute = Ck > KEEP_WEIGHTS_SPAN
        kind, b1, b2 = self.rel_pos_bias.factors(Cq, Ck, q_offset)
        positions = self.bias_positions
        o = mega_attention(
            q.reshape(B * K, Cq, -1),
            k.reshape(B * K, Ck, -1),
            v.reshape(B * K, Ck, -1),
            (kind, b1, b2),
            fn=self.attention_activation,
            valid=None if valid is None else valid.reshape(B * K, Ck),
            causal=self.causal,
            q_offset=q_offset,
            scale=self.z_dim**-0.5,
            positions=positions,
            recompute=recompute,
        )
        return o.view(B, K, Cq, -1)

    @property
    def bias_positions(self) -> int:
        """M, the offsets of the 'simple' bias table (0 for 'rotary', which has no table)."""
        bias = self.rel_pos_bias
        return bias.max_positions if isinstance(bias, SimpleRelativePositionalBias) else 0

    def _attend_kernel(
        self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, q_offset: int
    ) -> Tensor:
        """`_attend` on the Triton kernel (`megalab.kernels.attention.flash_attention`), in the
        dtype of the inputs (under autocast, its dtype).

        The kernel reads the 'simple' bias itself. Q is scaled beforehand by τ⁻¹ (z^-½ under
        softmax, 1/n with n the row's key count under laplace/relu2), and the 'rotary' bias
        b = R_a R_bᵀ enters as extra Q/K columns: ⟨Q_i, K_j⟩ + ⟨R_a,i, R_b,j⟩ =
        ⟨[Q_i | R_a,i], [K_j | R_b,j]⟩.
        """
        from megalab.kernels import attention as gpu

        B, K, Cq, z = q.shape
        Ck = k.shape[2]
        N = B * K
        dtype = gpu.compute_dtype(q, v)
        q = q.reshape(N, Cq, z).to(dtype)
        k = k.reshape(N, Ck, z).to(dtype)
        v = v.reshape(N, Ck, -1).to(dtype)
        valid = None if valid is None else valid.reshape(N, Ck)
        if self.attention_activation == "softmax":
            q = q * self.z_dim**-0.5
        else:
            n = key_counts(q_offset, q_offset + Cq, Ck, self.causal, valid, torch.float32, q.device)
            q = q / n if isinstance(n, float) else (q.float() / n).to(dtype)
        kind, b1, b2 = self.rel_pos_bias.factors(Cq, Ck, q_offset)
        w = None
        if kind == "toeplitz":
            w = b1
        else:  # "lowrank"
            assert b2 is not None
            q = torch.cat([q, b1.to(dtype).expand(N, Cq, -1)], dim=-1)
            k = torch.cat([k, b2.to(dtype).expand(N, Ck, -1)], dim=-1)
        o = gpu.flash_attention(
            q.unsqueeze(1),
            k.unsqueeze(1),
            v.unsqueeze(1),
            fn=self.attention_activation,
            scale=1.0,
            bias=w,
            positions=self.bias_positions,
            valid=valid,
            causal=self.causal,
            q_offset=q_offset,
            empty_rows="causal",
        )
        return o.view(B, K, Cq, -1)

    def _attend_unfused(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        valid: Tensor | None,
        q_offset: int,
        value_groups: bool = False,
    ) -> Tensor:
        """`_attend` from PyTorch ops (SDPA's math kernel for softmax): attention dropout and
        half precision; with `value_groups` (no dropout), softmax as SDPA calls over value groups
        of at most 256 columns (`megalab.kernels.attention.sdpa_value_groups`)."""
        Cq, Ck = q.shape[2], k.shape[2]
        bias = self.rel_pos_bias(Cq, Ck, q_offset)  # (Cq, Ck)
        causal = None
        if self.causal:
            pos_q = torch.arange(q_offset, q_offset + Cq, device=q.device)
            causal = torch.arange(Ck, device=q.device).unsqueeze(0) <= pos_q.unsqueeze(1)
        p = self.dropout if self.training else 0.0
        if self.attention_activation == "softmax":
            allowed = None
            if valid is not None:
                # The code leaves a chunk whose keys are all padding unmasked.
                key_ok = valid | ~valid.any(dim=-1, keepdim=True)
                allowed = key_ok.unsqueeze(-2)  # (B, K, 1, Ck)
            if causal is not None:
                allowed = causal if allowed is None else allowed & causal
                if valid is not None:
                    # A row whose keys up to the query are all padding (possible only with left
                    # padding) would be all −inf (NaN in the code): keep its causal keys instead.
                    allowed = allowed | (~allowed.any(dim=-1, keepdim=True) & causal)
            attn_mask = bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))
            if value_groups:
                from megalab.kernels.attention import sdpa_value_groups

                return sdpa_value_groups(
                    q, k, v, attn_mask=attn_mask.to(q.dtype), scale=self.z_dim**-0.5
                )
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask.to(q.dtype), dropout_p=p, scale=self.z_dim**-0.5
            )
        # laplace / relu2: τ = #non-padded keys (or i + 1 under a causal mask), no row sums.
        scores = q @ k.transpose(-1, -2)
        n = key_counts(
            q_offset, q_offset + Cq, Ck, causal is not None, valid, scores.dtype, q.device
        )
        logits = (scores / n + bias).to(torch.promote_types(scores.dtype, torch.float32))
        attn = laplace(logits) if self.attention_activation == "laplace" else relu2(logits)
        if valid is not None:
            attn = attn * valid.unsqueeze(-2)
        if causal is not None:
            attn = attn * causal
        attn = F.dropout(attn.to(v.dtype), p=p, training=self.training)
        return attn @ v


def _ones(B: int, L: int, device: torch.device) -> Tensor:
    return torch.ones(B, L, dtype=torch.bool, device=device)


class AttendFn(Protocol):
    """Attention over aligned chunks: q (B, K, Cq, ...), k (B, K, Ck, ...), v (B, K, Ck, ...),
    valid (B, K, Ck) or None -> o (B, K, Cq, ...); query r sits at key position r + q_offset
    of its chunk."""

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, q_offset: int
    ) -> Tensor: ...


def _pad_time(t: Tensor, pad: int, value: float | bool = 0) -> Tensor:
    """Pad dim 1 (time) of a (B, L, ...) tensor with `pad` trailing entries."""
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad), value=value)


def chunked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    chunk_size: int,
    attend: AttendFn,
    cache: KVCache | None = None,
    return_cache: bool = False,
) -> tuple[Tensor, KVCache | None]:
    """Run `attend` within chunks of `chunk_size` (-1: one chunk), streaming with a KV cache.

    q, k, v are (B, L, ...) with any trailing shape (one head: (B, L, z); several: (B, L, H, d)).
    A length that is not a multiple of the chunk is padded internally (masked keys) and sliced
    back. `cache` holds the keys/values of the chunk left open by the previous segment: the
    first new positions complete that chunk (attending to the cache, with `q_offset` = its
    length), the rest start on chunk boundaries. The returned cache holds the chunk left open
    after this segment (everything, without chunking), so any segmentation of a causal stream
    gives the outputs of one pass.
    """
    B, L = q.shape[:2]
    C = chunk_size if chunk_size > 0 else None
    T = cache.key.shape[1] if cache is not None else 0
    if cache is not None and T > 0:
        k_all = torch.cat([cache.key, k], dim=1)
        v_all = torch.cat([cache.value, v], dim=1)
        valid_all = None
        if cache.valid is not None or mask is not None:
            old = cache.valid if cache.valid is not None else _ones(B, T, q.device)
            new = mask if mask is not None else _ones(B, L, q.device)
            valid_all = torch.cat([old, new], dim=1)
        # The first L1 new positions complete the open chunk: they attend to the cache too.
        L1 = L if C is None else min(C - T, L)
        o = attend(
            q[:, :L1].unsqueeze(1),
            k_all[:, : T + L1].unsqueeze(1),
            v_all[:, : T + L1].unsqueeze(1),
            None if valid_all is None else valid_all[:, : T + L1].unsqueeze(1),
            T,
        ).squeeze(1)
        if L1 < L:  # the rest starts on a chunk boundary
            rest = _aligned_chunks(
                q[:, L1:], k[:, L1:], v[:, L1:], None if mask is None else mask[:, L1:], C, attend
            )
            o = torch.cat([o, rest], dim=1)
    else:
        k_all, v_all, valid_all = k, v, mask
        o = _aligned_chunks(q, k, v, mask, C, attend)
    new_cache = None
    if return_cache:
        total = k_all.shape[1]
        keep = total if C is None else total % C
        new_cache = KVCache(
            k_all[:, total - keep :],
            v_all[:, total - keep :],
            None if valid_all is None else valid_all[:, total - keep :],
        )
    return o, new_cache


def _aligned_chunks(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, C: int | None, attend: AttendFn
) -> Tensor:
    """Attention over chunk-aligned positions: pad to a multiple of C, attend, slice back."""
    B, L = q.shape[:2]
    if C is None or L <= C:
        n_chunks, size = 1, L
    else:
        n_chunks, size = -(-L // C), C
        pad = n_chunks * C - L
        if pad:
            q, k, v = (_pad_time(t, pad) for t in (q, k, v))
            valid = mask if mask is not None else _ones(B, L, q.device)
            mask = _pad_time(valid, pad, value=False)
    o = attend(
        q.view(B, n_chunks, size, *q.shape[2:]),
        k.view(B, n_chunks, size, *k.shape[2:]),
        v.view(B, n_chunks, size, *v.shape[2:]),
        None if mask is None else mask.view(B, n_chunks, size),
        0,
    )
    return o.reshape(B, n_chunks * size, *o.shape[3:])[:, :L]
