"""Transformer baseline backbone (Vaswani et al. 2017) on `scaled_dot_product_attention`.

Encoder (bidirectional) or decoder-only (causal), pre- or post-norm, with sinusoidal, learned
or no absolute positions. It follows the backbone contract (`megalab.models.base`):
(B, L, D) -> (B, L, D), mask True at real tokens, no carried state (it keeps no memory).

Two options reproduce the Mega authors' fairseq LRA Transformer (`TransformerLRAEncoder`):
`embed_norm=True` is its `encoder_normalize_before` (a LayerNorm on the input embeddings, in
front of post-norm layers), and `init="bert"` its `apply_bert_init`.

It keeps its own layer loop instead of the shared stack (`megalab.models.stack`): its layers
take one attention mask, built once for all of them from the padding and causality, not the
token mask, and carry no state; its input step adds absolute positions, so a segment could not
be continued by a later one anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.models.base import Backbone, BackboneConfig, BackboneOutput
from megalab.nn.activation_checkpoint import checkpoint_block
from megalab.nn.embedding import INITS, init_bert_params
from megalab.nn.masking import zero_pads
from megalab.nn.positions import sinusoid_frequencies, sinusoid_table
from megalab.nn.regularization import DropPath, drop_path_rates
from megalab.utils.options import check_options, option, rate

POSITIONS = ("sinusoidal", "learned", "none")
ACTIVATIONS = ("gelu", "relu", "silu")


@dataclass(frozen=True)
class TransformerConfig(BackboneConfig):
    """Every option of a `Transformer`, each with its range and meaning."""

    d_model: int = option(256, ge=1, doc="D, the feature width")
    num_layers: int = option(4, ge=1, doc="number of layers")
    num_heads: int = option(4, ge=1, doc="H, the attention heads (D / H per head)")
    ffn_dim: int = option(1024, doc="the FFN hidden width")
    dropout: float = rate(0.1, doc="on the embeddings, each branch output (attention and FFN)")
    attention_dropout: float = rate(0.0, doc="on the attention weights")
    activation_dropout: float = rate(0.0, doc="on the FFN hidden layer")
    activation: str = option("gelu", choices=ACTIVATIONS, doc="of the FFN")
    prenorm: bool = option(True, doc="pre-norm layers plus a final LayerNorm, or post-norm")
    positions: str = option(
        "sinusoidal", choices=POSITIONS, doc="absolute positions added to the input"
    )
    max_len: int | None = option(None, doc="rows of the learned position table")
    causal: bool = option(False, doc="decoder-only language model (True) or encoder (False)")
    share_layers: bool = option(
        False, doc="one layer's weights at every depth (the LRA ListOps baseline's tied layers)"
    )
    drop_path: float = option(
        0.0, doc="stochastic depth of the last layer, linear over depth (DeiT)"
    )
    embed_norm: bool = option(
        False, doc="a LayerNorm on the embeddings after the positions (encoder_normalize_before)"
    )
    init: str = option(
        "default", choices=INITS, doc="'bert': fairseq's init_bert_params on every Linear"
    )
    checkpoint_activations: bool = option(
        False, doc="recompute each layer in the backward: less memory, ~1/3 more compute"
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.positions == "learned" and not self.max_len:
            raise ValueError("learned positions need `max_len` (the longest input length)")
        if self.share_layers and self.drop_path > 0:
            raise ValueError("drop_path needs one module per layer: set share_layers=false")

    def build(self) -> Transformer:
        """The `Transformer` this config describes."""
        return Transformer(self)


def sinusoidal_positions(
    length: int,
    d_model: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The fixed sin/cos table of Vaswani et al.: (L, D), sin on even and cos on odd channels.

    ω_k = exp(−2k ln(10000)/D), in float32 as tensor2tensor computes it.
    """
    position = torch.arange(length, device=device, dtype=torch.float32)
    inv_freq = sinusoid_frequencies((d_model + 1) // 2, d_model / 2, form="exp", device=device)
    table = sinusoid_table(position, inv_freq, interleave=True, width=d_model)
    return table.to(dtype) if dtype is not None else table


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection and PyTorch SDPA."""

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: Tensor, attn_mask: Tensor | None, causal: bool) -> Tensor:
        """x (B, L, D); attn_mask (B, 1, L, L) bool, True where a query may attend a key."""
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, self.head_dim).unbind(dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal and attn_mask is None,
        )
        return self.out(o.transpose(1, 2).reshape(B, L, D))


class TransformerLayer(nn.Module):
    """Self-attention + position-wise FFN, each with a residual (optionally with stochastic
    depth) and a pre- or post-norm."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        ffn_dim: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation_dropout: float = 0.0,
        activation: str = "gelu",
        prenorm: bool = True,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        self.attn = MultiHeadSelfAttention(d_model, num_heads, attention_dropout)
        self.drop_path = DropPath(drop_path)
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.attn_norm = nn.LayerNorm(d_model)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation_dropout = nn.Dropout(activation_dropout)
        self.activation = getattr(F, activation)
        self.prenorm = prenorm

    def forward(self, x: Tensor, attn_mask: Tensor | None, causal: bool) -> Tensor:
        h = self.attn_norm(x) if self.prenorm else x
        x = x + self.drop_path(self.dropout(self.attn(h, attn_mask, causal)))
        if not self.prenorm:
            x = self.attn_norm(x)
        h = self.ffn_norm(x) if self.prenorm else x
        h = self.fc2(self.activation_dropout(self.activation(self.fc1(h))))
        x = x + self.drop_path(self.dropout(h))
        if not self.prenorm:
            x = self.ffn_norm(x)
        return x


class Transformer(Backbone):
    """A stack of Transformer layers; `causal=True` makes it a decoder-only language model.

    `embed_norm` adds a LayerNorm on the embeddings after the positions are added and before
    the embedding dropout. `init="bert"` redraws every Linear weight and the learned position
    table from N(0, 0.02) with zero biases (fairseq's `init_bert_params`); norms keep (1, 0).
    `checkpoint_activations` keeps only each layer's input for the backward and recomputes the
    layer (`megalab.nn.activation_checkpoint`): less memory, about a third more compute, same
    results.
    """

    config: TransformerConfig
    block_class = TransformerLayer

    def __init__(self, config: TransformerConfig | None = None) -> None:
        super().__init__(cfg := config or TransformerConfig())
        self.positions = cfg.positions
        self.checkpoint_activations = cfg.checkpoint_activations
        learned = cfg.positions == "learned"
        self._max_len = cfg.max_len if learned else None
        self.pos_embedding = (
            nn.Embedding(cfg.max_len, cfg.d_model) if learned and cfg.max_len else None
        )
        if self.pos_embedding is not None:
            nn.init.normal_(self.pos_embedding.weight, std=0.02)

        def make(rate: float) -> TransformerLayer:
            return TransformerLayer(
                cfg.d_model,
                cfg.num_heads,
                cfg.ffn_dim,
                cfg.dropout,
                cfg.attention_dropout,
                cfg.activation_dropout,
                cfg.activation,
                cfg.prenorm,
                drop_path=rate,
            )

        # Stochastic depth grows linearly over depth (DeiT); weight sharing across depth is the
        # LRA ListOps baseline's tied layers.
        rates = drop_path_rates(cfg.drop_path, cfg.num_layers)
        shared = make(0.0) if cfg.share_layers else None
        self.layers = nn.ModuleList(
            [shared if shared is not None else make(rates[i]) for i in range(cfg.num_layers)]
        )
        self.final_norm = nn.LayerNorm(cfg.d_model) if cfg.prenorm else None
        self.embed_norm = nn.LayerNorm(cfg.d_model) if cfg.embed_norm else None
        self.dropout = nn.Dropout(cfg.dropout)
        if cfg.init == "bert":
            # After every submodule exists, as fairseq applies it once the model is built.
            self.apply(init_bert_params)

    @property
    def max_len(self) -> int | None:
        """Longest input the model accepts (None: unlimited)."""
        return self._max_len

    def length_advice(self) -> str:
        return " (its learned position table): raise `model.backbone.max_len` or truncate the data"

    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, state: None = None
    ) -> BackboneOutput:
        """x (B, L, D), mask (B, L) True at real tokens -> y (B, L, D); no state."""
        self.check_input(x, mask)
        B, L, _ = x.shape
        if self.positions == "sinusoidal":
            x = x + sinusoidal_positions(L, self.d_model, x.device, x.dtype)
        elif self.pos_embedding is not None:
            x = x + self.pos_embedding.weight[:L].to(x.dtype)
        # fairseq's TransformerLRAEncoder.forward: embed_scale -> + positions ->
        # emb_layer_norm -> dropout, so the norm sees the positions and precedes the dropout.
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.dropout(x)
        attn_mask = None
        if mask is not None and not bool(mask.all()):
            allowed = mask[:, None, None, :].expand(B, 1, L, L)
            if self.causal:
                allowed = allowed & torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
            # Every query may see itself, so padded queries never produce NaN rows.
            attn_mask = allowed | torch.eye(L, dtype=torch.bool, device=x.device)
        for layer in self.layers:
            x = checkpoint_block(
                layer, x, attn_mask, self.causal, enabled=self.checkpoint_activations
            )
        if self.final_norm is not None:
            x = self.final_norm(x)
        x = zero_pads(x, mask)
        return BackboneOutput(x)
