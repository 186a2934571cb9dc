"""Megalodon's normalized multi-head attention within chunks (Ma et al. 2024, §3.3, eqs. 6-9).

From the shared representation Z (B, L, S), split into H heads of d = S/H, and values V:

    Ẑ = Z / ‖Z‖₂  per head                                                        (6)
    Q = (1 + κ_q) ⊙ Ẑ + μ_q,   K = (1 + κ_k) ⊙ Ẑ + μ_k                           (7, 8)
    O = softmax(R(Q) R(K)ᵀ + causal mask) V      within chunks, no 1/√d           (9)

with κ, μ ∈ R^{2×S} zero at init (plus-1 scales: the logits start as cosine similarities) and R
the rotary embedding (interleaved pairs, base 10⁴; the 7B model uses 10⁵) whose positions
restart at 0 in every chunk. As the authors' code: Ẑ is computed as RMSNorm(z_head) (ε = 1e-5,
no affine, in at least float32) divided by √d, attention runs with scale 1, and it is
block-diagonal: a query sees only keys of its own chunk (a causal model: at or before it);
information crosses chunks only through CEMA and the timestep-norm statistics. Sequences that
are not a multiple of the chunk are padded internally (the code refuses them), and streaming
keeps the keys and values of the open chunk only (`megalab.nn.attention.chunked_attention`),
so any segmentation gives the outputs of one pass. Keys are cached before the rotation and
rotated by their position in the chunk at every use.

Attention dropout is DropKey (App. B.1, the code's fused kernel): in training, logits are set
to −∞ with probability p before the softmax, with no rescaling. A query whose every key is
dropped attends to nothing (zero output), where a plain softmax would give NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.kernels import use_kernel
from megalab.nn.attention import KVCache, chunked_attention
from megalab.nn.rope import InvFreq, apply_rope

__all__ = ["NormalizedAttention"]


class NormalizedAttention(nn.Module):
    """Normalized multi-head chunked attention: (Z (B, L, S), V (B, L, E)) -> O (B, L, E).

    Args:
        z_dim: S, the shared Q/K width (H heads of S/H).  v_dim: E (H heads of E/H).
        num_heads: H.  chunk_size: c > 0, or -1 for full attention.
        rope_base: RoPE base (1e4; the paper's 7B uses 1e5).
        causal: queries see keys at or before them (language models).
        dropout: DropKey rate on the attention logits (training only).
        eps: of the per-head RMS normalisation of Z.
    """

    def __init__(
        self,
        z_dim: int,
        v_dim: int,
        num_heads: int = 1,
        chunk_size: int = -1,
        rope_base: float = 10000.0,
        causal: bool = True,
        dropout: float = 0.0,
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        if num_heads < 1 or z_dim % num_heads or v_dim % num_heads:
            raise ValueError(
                f"z_dim={z_dim} and v_dim={v_dim} must be multiples of num_heads={num_heads}"
            )
        if (z_dim // num_heads) % 2:
            raise ValueError(f"rotary embedding needs an even head width, got z_dim/num_heads="
                             f"{z_dim // num_heads}")  # fmt: skip
        if chunk_size == 0 or chunk_size < -1:
            raise ValueError(f"chunk_size must be positive or -1 (no chunking), got {chunk_size}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"attention dropout must be in [0, 1), got {dropout}")
        self.z_dim, self.v_dim, self.num_heads = z_dim, v_dim, num_heads
        self.head_dim = z_dim // num_heads
        self.chunk_size = chunk_size
        self.rope_base = float(rope_base)
        self.inv_freq = InvFreq()
        self.causal = causal
        self.dropout = dropout
        self.eps = eps
        # κ_q, κ_k (rows 0, 1) and μ_q, μ_k: the code's `gamma` and `beta`, zero at init.
        self.kappa = nn.Parameter(torch.zeros(2, z_dim))
        self.mu = nn.Parameter(torch.zeros(2, z_dim))

    def extra_repr(self) -> str:
        return (
            f"z_dim={self.z_dim}, v_dim={self.v_dim}, num_heads={self.num_heads}, "
            f"chunk_size={self.chunk_size}, rope_base={self.rope_base:g}, causal={self.causal}"
        )

    def queries_keys(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Q and K (B, L, H, d) from Z (B, L, S), before the rotation (eqs. 6-8)."""
        B, L, _ = z.shape
        H, d = self.num_heads, self.head_dim
        zf = z.to(torch.promote_types(z.dtype, torch.float32)).view(B, L, H, d)
        z_hat = zf * torch.rsqrt(zf.square().mean(dim=-1, keepdim=True) + self.eps)
        scale = d**-0.5  # RMSNorm(z)/√d = z/‖z‖ (up to ε)
        kappa = (1.0 + self.kappa.to(zf.dtype)) * scale
        mu = self.mu.to(zf.dtype)
        q = z_hat * kappa[0].view(H, d) + mu[0].view(H, d)
        k = z_hat * kappa[1].view(H, d) + mu[1].view(H, d)
        return q, k

    def forward(
        self,
        z: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        cache: KVCache | None = None,
        return_cache: bool = False,
    ) -> tuple[Tensor, KVCache | None]:
        """O (B, L, E) from Z (B, L, S) and V (B, L, E); mask (B, L) True at real tokens.

        `cache` holds the (unrotated) keys and values of the chunk the previous segment left
        open (causal only); `return_cache` returns the one this segment leaves open.
        """
        if (cache is not None or return_cache) and not self.causal:
            raise ValueError("only causal attention can be streamed with a key/value cache")
        B, L, _ = z.shape
        if (
            z.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and self.kappa.dtype == self.mu.dtype == torch.float32
            and not torch.compiler.is_compiling()
            and use_kernel("qk_norm", z, self.kappa, self.mu)
        ):
            from megalab.kernels.qk_norm import normalized_queries_keys

            H, eps = self.num_heads, self.eps
            q, k = normalized_queries_keys(z, self.kappa, self.mu, H, eps, v.dtype)
        else:
            q, k = self.queries_keys(z)
            q, k = q.to(v.dtype), k.to(v.dtype)
        vh = v.view(B, L, self.num_heads, self.v_dim // self.num_heads)
        o, new_cache = chunked_attention(
            q, k, vh, mask, self.chunk_size, self._attend, cache=cache, return_cache=return_cache
        )
        return o.reshape(B, L, self.v_dim), new_cache

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, q_offset: int
    ) -> Tensor:
        """q (B, K, Cq, H, d), k (B, K, Ck, H, d), v (B, K, Ck, H, e), valid (B, K, Ck); query r
        is at position r + q_offset of its chunk (the rotation's position too).

        On CUDA the Triton kernel runs it (rotary applied before it), or SDPA over value groups
        with `MEGALAB_ATTENTION_GPU=sdpa`; elsewhere SDPA."""
        Cq, Ck = q.shape[2], k.shape[2]
        dev = q.device
        rot = torch.float64 if q.dtype == torch.float64 else torch.float32
        inv_freq = self.inv_freq(self.head_dim, self.rope_base, rot, dev)
        pos_q = torch.arange(q_offset, q_offset + Cq, device=dev).unsqueeze(-1)  # (Cq, 1): heads
        pos_k = torch.arange(Ck, device=dev).unsqueeze(-1)
        B, K = q.shape[:2]
        # SDPA on 4-D (B·K, H, C, d) tensors: chunks are independent batch entries.
        q = apply_rope(q, pos_q, inv_freq, interleaved=True).flatten(0, 1).transpose(1, 2)
        k = apply_rope(k, pos_k, inv_freq, interleaved=True).flatten(0, 1).transpose(1, 2)
        v = v.flatten(0, 1).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        from megalab.kernels import attention as gpu  # Triton is imported on first use

        sdpa: Callable[..., Tensor] = F.scaled_dot_product_attention
        # The GPU paths (`megalab.kernels.attention`) have no DropKey: with it, SDPA runs below.
        if p == 0.0 and gpu.use_attention_kernel(q, k, v):
            if gpu.gpu_path() == "triton":
                dtype = gpu.compute_dtype(q, v)
                o = gpu.flash_attention(
                    q.to(dtype),
                    k.to(dtype),
                    v.to(dtype),
                    scale=1.0,
                    valid=None if valid is None else valid.flatten(0, 1),
                    causal=self.causal,
                    q_offset=q_offset,
                    empty_rows="all",
                )
                return o.transpose(1, 2).unflatten(0, (B, K))
            sdpa = gpu.sdpa_value_groups
        allowed = None
        if valid is not None:
            allowed = valid.flatten(0, 1)[:, None, None, :]  # (B·K, 1, 1, Ck)
        if self.causal:
            causal = torch.arange(Ck, device=dev).unsqueeze(0) <= pos_q  # (Cq, Ck)
            allowed = causal if allowed is None else allowed & causal
        if p == 0.0:
            if allowed is None:
                o = sdpa(q, k, v, scale=1.0)
                return o.transpose(1, 2).unflatten(0, (B, K))
            if valid is None and q_offset == 0 and Cq == Ck:
                o = sdpa(q, k, v, is_causal=True, scale=1.0)
                return o.transpose(1, 2).unflatten(0, (B, K))
        shape = (*q.shape[:-1], Ck)  # (B·K, H, Cq, Ck)
        allowed = torch.ones(shape, dtype=torch.bool, device=dev) if allowed is None else allowed
        alive = None
        if p > 0.0:
            # DropKey: logits at dropped keys become −inf before the softmax, no rescaling.
            kept = allowed & (torch.rand(shape, device=dev) >= p)
            alive = kept.any(dim=-1, keepdim=True)
            allowed = kept | (~alive & allowed)  # no all −inf rows; zeroed below
        # Rows without any allowed key are padded queries (e.g. a chunk of padding): let them
        # attend everywhere so nothing is NaN; their outputs are discarded.
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
        o = sdpa(q, k, v, attn_mask=allowed, scale=1.0)
        if alive is not None:
            o = o * alive.to(o.dtype)
        return o.transpose(1, 2).unflatten(0, (B, K))
