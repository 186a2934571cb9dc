"""Mega's gated cross-attention: the decoder's attention to the encoder output (MT only).

The authors' `GatedCrossAttention` (facebookresearch/mega, `fairseq/modules/
gated_cross_attention.py`; the paper does not describe it). For decoder states X ∈ R^{T×d}
(normalised first when pre-norm) and encoder outputs M ∈ R^{S×d}:

    [φ | γ | Q] = X W_q + b_q          φ ∈ R^{T×d}, γ ∈ R^{T×d}, Q ∈ R^{T×z}
    φ = sigmoid(φ)                      update gate
    γ = SiLU(γ)                         reset gate
    K = M W_k + b_k                     ∈ R^{S×z}   (no scale/offset, no activation)
    V = act(M W_v + b_v)                ∈ R^{S×d}   (width d, not the MAGA's v)
    A = f(Q Kᵀ / τ + b_rel)             ∈ R^{T×S}
    Ĥ = act((A V ⊙ γ) W_h + b_h)        ∈ R^{T×d}
    Y = X + φ ⊙ (Ĥ − X)                 gated residual on the un-normalised input

with f and τ as in the self-attention (`megalab.nn.attention`): softmax with τ = √z (run in at
least float32, like the code), padded keys −inf; or laplace / relu2 with τ = the number of
non-padded encoder keys (S without a mask), weights multiplied by the key mask and not
normalised. b_rel[i, j] is the relative position bias between target position i and source
position j ('simple': w[M − 1 + j − i], one table of size 2M − 1 with M = max(max source,
max target positions); 'rotary': ⟨R_i a, R_j b⟩). Post-norm normalises Y. Dropouts as in the
code: `dropout` on Ĥ, `hidden_dropout` on V, `attention_dropout` on A. Linears are
N(0, 0.02) with zero bias.

The code's positions are the raw indices of the (padded) tensors. Its translation task pads
sources on the left (fairseq's default), so the bias a target token sees depends on how much
padding its batch added before the source: we keep that behaviour (positions are tensor
indices), and right-padded sources give the unpadded sentence's positions.

Incremental decoding: the keys and values of the encoder output are computed once
(`memory_cache`) and reused at every step; `query_offset` is the position of the first query
(the number of target tokens already decoded), as the code's `prev_num_steps`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.kernels.attention_functions import (
    check_attention_function,
    key_counts,
    laplace,
    relu2,
)
from megalab.models.mega.model import MegaConfig
from megalab.nn.attention import (
    SimpleRelativePositionalBias,
    relative_position_bias,
)
from megalab.nn.ffn import get_activation
from megalab.nn.norms import SequenceNorm
from megalab.nn.state import register_state


@register_state
class CrossAttentionCache(NamedTuple):
    """Keys (B, S, z), values (B, S, d) and key validity (B, S) (or None) of an encoder output.

    Computed once per source batch; beam search reorders it with `select_state`.
    """

    key: Tensor
    value: Tensor
    valid: Tensor | None


class GatedCrossAttention(nn.Module):
    """Mega's decoder-to-encoder attention with update and reset gates, (B, T, D) tensors.

    Built from the decoder's `MegaConfig`, as the MAGA layer beside it: d_model d (decoder
    states, encoder outputs, V and Ĥ), z_dim z (Q and K, softmax scale z^-½),
    attention_activation, rel_pos_bias, norm_type and prenorm (normalise the query input, or
    the output), dropout (on Ĥ), attention_dropout (on A), hidden_dropout (on V) and activation
    (for V and Ĥ). `max_positions` is M of the 'simple' table: the longest source or target
    (the code uses max(max_source_positions, max_target_positions)).
    """

    def __init__(self, cfg: MegaConfig, max_positions: int) -> None:
        super().__init__()
        check_attention_function(cfg.attention_activation)
        d_model, z_dim = cfg.d_model, cfg.z_dim
        self.d_model, self.z_dim = d_model, z_dim
        self.attention_activation = cfg.attention_activation
        self.prenorm = cfg.prenorm
        self.act = get_activation(cfg.activation)
        self.norm = SequenceNorm(cfg.norm_type, d_model)
        self.k_proj = nn.Linear(d_model, z_dim)
        self.v_proj = nn.Linear(d_model, d_model)
        self.q_proj = nn.Linear(d_model, 2 * d_model + z_dim)
        self.h_proj = nn.Linear(d_model, d_model)
        self.rel_pos_bias = relative_position_bias(cfg.rel_pos_bias, max_positions, z_dim)
        self.dropout = nn.Dropout(cfg.dropout)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)
        self.attention_dropout = cfg.attention_dropout
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The authors' init: every linear N(0, 0.02), zero bias."""
        for lin in (self.k_proj, self.v_proj, self.q_proj, self.h_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=0.02)
            nn.init.zeros_(lin.bias)

    @property
    def max_len(self) -> int | None:
        """The longest source or target the 'simple' bias covers (None: unbounded)."""
        if isinstance(self.rel_pos_bias, SimpleRelativePositionalBias):
            return self.rel_pos_bias.max_positions
        return None

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, z_dim={self.z_dim}, "
            f"attention_activation={self.attention_activation!r}, prenorm={self.prenorm}"
        )

    def memory_cache(
        self, memory: Tensor, memory_mask: Tensor | None = None
    ) -> CrossAttentionCache:
        """K = M W_k + b_k and V = act(M W_v + b_v) of encoder outputs (B, S, D), once."""
        return CrossAttentionCache(self.k_proj(memory), self.act(self.v_proj(memory)), memory_mask)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | CrossAttentionCache,
        memory_mask: Tensor | None = None,
        query_offset: int = 0,
    ) -> Tensor:
        """Y (B, T, D) for decoder states x (B, T, D).

        Args:
            x: decoder states; query t sits at target position `query_offset + t`.
            memory: encoder outputs (B, S, D), or their `memory_cache`.
            memory_mask: (B, S) bool, True at real source tokens (ignored with a cache, which
                carries its own).
            query_offset: target tokens before x (incremental decoding).
        """
        cache = memory if isinstance(memory, CrossAttentionCache) else None
        if cache is None:
            cache = self.memory_cache(memory, memory_mask)  # type: ignore[arg-type]
        K, V, valid = cache
        T, S = x.shape[1], K.shape[1]
        limit = self.max_len
        if limit is not None and max(query_offset + T, S) > limit:
            raise ValueError(
                f"cross-attention over {query_offset + T} target and {S} source positions "
                f"exceeds the 'simple' relative position bias size {limit}: raise "
                "max_source_positions/max_target_positions or shorten the input"
            )
        D, Z = self.d_model, self.z_dim
        residual = x
        X = self.norm(x) if self.prenorm else x
        phi, gamma, Q = torch.split(self.q_proj(X), [D, D, Z], dim=-1)
        phi = torch.sigmoid(phi)  # update gate
        gamma = F.silu(gamma)  # reset gate
        V = self.hidden_dropout(V)
        O = self._attend(Q, K, V, valid, query_offset)  # noqa: E741
        H_hat = self.dropout(self.act(self.h_proj(O * gamma)))
        Y = residual + phi * (H_hat - residual)
        if not self.prenorm:
            Y = self.norm(Y)
        return Y

    def _attend(self, Q: Tensor, K: Tensor, V: Tensor, valid: Tensor | None, offset: int) -> Tensor:
        """A V with A = f(Q Kᵀ / τ + b_rel): Q (B, T, z), K (B, S, z), V (B, S, d)."""
        T, S = Q.shape[1], K.shape[1]
        bias = self.rel_pos_bias(T, S, offset)  # (T, S): target i + offset, source j
        p = self.attention_dropout if self.training else 0.0
        if self.attention_activation == "softmax":
            attn_mask = bias.to(Q.dtype).expand(Q.shape[0], T, S)
            if valid is not None:
                # A source whose keys are all padding (never produced by the data) would be all
                # −inf; leave it unmasked rather than return NaN.
                key_ok = valid | ~valid.any(dim=-1, keepdim=True)
                attn_mask = attn_mask.masked_fill(~key_ok.unsqueeze(1), float("-inf"))
            cdt = torch.promote_types(Q.dtype, torch.float32)
            logits = (Q.to(cdt) * self.z_dim**-0.5) @ K.to(cdt).transpose(1, 2) + attn_mask
            attn = torch.softmax(logits, dim=-1)
        else:
            n = key_counts(0, T, S, False, valid, Q.dtype, Q.device)  # τ: the real sources
            logits = (Q @ K.transpose(1, 2)) / n + bias.to(Q.dtype)
            cdt = torch.promote_types(logits.dtype, torch.float32)
            logits = logits.to(cdt)
            attn = laplace(logits) if self.attention_activation == "laplace" else relu2(logits)
            if valid is not None:
                attn = attn * valid.unsqueeze(1).to(attn.dtype)
        attn = F.dropout(attn.to(V.dtype), p=p, training=self.training)
        return attn @ V
