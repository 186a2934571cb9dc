"""Transformer encoder-decoder for translation (Vaswani et al. 2017): the XFM rows of Mega Table 6.

The Mega authors' baseline is fairseq's `transformer_wmt_en_de` (Transformer-base) trained with
the settings of Mega Table 10 (column XFM-Base). This module follows that fairseq code (the
v0.10 modules of the authors' fork, `fairseq/models/transformer.py`,
`fairseq/modules/transformer_layer.py`, `multihead_attention.py`):

    x = dropout(√d · E[tokens] + P[positions])
    encoder layer:  x = LN(x + dropout(SelfAttn(x)));             x = LN(x + dropout(FFN(x)))
    decoder layer:  x = LN(x + dropout(CausalSelfAttn(x)));
                    x = LN(x + dropout(Attn(x, encoder output)));  x = LN(x + dropout(FFN(x)))
    FFN(x) = fc2(activation_dropout(relu(fc1(x))))

(post-norm; `prenorm=True` is fairseq's `--*-normalize-before`, which then ends both stacks with
a LayerNorm). Positions are fairseq's sinusoids: for position p and k < d/2,
P[p] = [sin(p·ω_k) | cos(p·ω_k)] with ω_k = 10000^{−k/(d/2 − 1)} (halves, not interleaved, and
d/2 − 1 in the exponent, unlike `megalab.models.transformer.sinusoidal_positions`), counted from
`pad_id + 1` at the first real token of each sentence, so left- and right-padded sources get
the same positions; padded positions get zeros. Initialisation as fairseq: embeddings
N(0, d^-½) with a zero padding row; attention q/k/v weights Xavier-uniform with gain 1/√2,
output projections Xavier-uniform with zero bias (other biases and the FFN linears keep
PyTorch's default, as fairseq's `nn.Linear`); one table is shared by source, target and output
projection (`--share-all-embeddings`). Attention runs on `scaled_dot_product_attention`.

Incremental decoding caches each decoder layer's self-attention keys/values (B, H, T, d/H) and
the encoder's cross-attention keys/values, computed once; every tensor holds the batch in dim 0.
Both stacks keep their own loops instead of the shared stack (`megalab.models.stack`): an
encoder layer returns features only (no state, fairseq's layer), and a decoder layer takes the
encoder's keys/values in place of the token mask and, in `step`, its cache after them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.models.mega.translation import mt_embedding
from megalab.models.seq2seq import EncoderDecoder, EncoderDecoderConfig, EncoderOut
from megalab.nn.attention import KVCache
from megalab.nn.ffn import get_activation
from megalab.nn.masking import zero_pads
from megalab.nn.positions import sinusoid_frequencies, sinusoid_table
from megalab.nn.state import register_state
from megalab.utils.options import option, rate


def fairseq_sinusoidal_positions(positions: Tensor, d_model: int) -> Tensor:
    """fairseq's `SinusoidalPositionalEmbedding` rows for integer positions (...,) -> (..., d).

    [sin(p ω_k) | cos(p ω_k)], ω_k = exp(−k log(10000) / (d/2 − 1)), k < d/2; a zero column is
    appended for odd d. Computed in float32 like fairseq's table.
    """
    half = d_model // 2
    freq = sinusoid_frequencies(half, half - 1, form="exp", device=positions.device)
    return sinusoid_table(positions.to(torch.float32), freq, width=d_model)


class MultiheadAttention(nn.Module):
    """fairseq's `MultiheadAttention` (separate q/k/v/out projections) on SDPA."""

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        # fairseq: q/k/v Xavier-uniform with gain 1/√2 (their biases keep nn.Linear's init),
        # the output projection Xavier-uniform with zero bias.
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(lin.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def heads(self, x: Tensor) -> Tensor:
        """(B, L, D) -> (B, H, L, D/H)."""
        B, L, _ = x.shape
        return x.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, H, S, D/H) of `memory` (B, S, D)."""
        return self.heads(self.k_proj(memory)), self.heads(self.v_proj(memory))

    def attend(
        self, x: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, causal: bool
    ) -> Tensor:
        """Queries from x (B, T, D) over keys/values (B, H, S, D/H); key_mask (B, S) True at
        real keys; `causal` aligns the queries with the last T keys."""
        B, T, D = x.shape
        q = self.heads(self.q_proj(x))
        mask = None
        if key_mask is not None:
            mask = key_mask[:, None, None, :]
        if causal and T > 1:
            S = k.shape[2]
            tri = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
            mask = tri if mask is None else mask & tri
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out_proj(o.transpose(1, 2).reshape(B, T, D))


class _FFN(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, activation: str, activation_dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.act = get_activation(activation)
        self.activation_dropout = nn.Dropout(activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation_dropout(self.act(self.fc1(x))))


class _Sublayer(nn.Module):
    """x + dropout(f(x)) with a post- (or pre-) LayerNorm: fairseq's residual blocks."""

    def __init__(self, d_model: int, dropout: float, prenorm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.prenorm = prenorm

    def pre(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.prenorm else x

    def post(self, residual: Tensor, y: Tensor) -> Tensor:
        x = residual + self.dropout(y)
        return x if self.prenorm else self.norm(x)


@dataclass(frozen=True)
class LayerSpec:
    """What every encoder and decoder layer is built from: widths, dropouts, norm placement."""

    d_model: int
    num_heads: int
    ffn_dim: int
    dropout: float
    attention_dropout: float
    activation_dropout: float
    activation: str
    prenorm: bool

    def attention(self) -> MultiheadAttention:
        return MultiheadAttention(self.d_model, self.num_heads, self.attention_dropout)

    def sublayer(self) -> _Sublayer:
        return _Sublayer(self.d_model, self.dropout, self.prenorm)

    def ffn(self) -> _FFN:
        return _FFN(self.d_model, self.ffn_dim, self.activation, self.activation_dropout)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.self_attn = spec.attention()
        self.attn_block = spec.sublayer()
        self.ffn = spec.ffn()
        self.ffn_block = spec.sublayer()

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        h = self.attn_block.pre(x)
        k, v = self.self_attn.project_kv(h)
        x = self.attn_block.post(x, self.self_attn.attend(h, k, v, mask, causal=False))
        return self.ffn_block.post(x, self.ffn(self.ffn_block.pre(x)))


class TransformerDecoderLayer(nn.Module):
    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.self_attn = spec.attention()
        self.self_attn_block = spec.sublayer()
        self.encoder_attn = spec.attention()
        self.encoder_attn_block = spec.sublayer()
        self.ffn = spec.ffn()
        self.ffn_block = spec.sublayer()

    def forward(
        self, x: Tensor, cross: KVCache, cache: KVCache | None = None
    ) -> tuple[Tensor, KVCache]:
        """x (B, T, D) -> (B, T, D) and the self-attention keys/values so far."""
        h = self.self_attn_block.pre(x)
        k, v = self.self_attn.project_kv(h)
        if cache is not None:
            k, v = torch.cat([cache.key, k], dim=2), torch.cat([cache.value, v], dim=2)
        y = self.self_attn.attend(h, k, v, None, causal=True)
        x = self.self_attn_block.post(x, y)
        h = self.encoder_attn_block.pre(x)
        y = self.encoder_attn.attend(h, cross.key, cross.value, cross.valid, causal=False)
        x = self.encoder_attn_block.post(x, y)
        x = self.ffn_block.post(x, self.ffn(self.ffn_block.pre(x)))
        return x, KVCache(k, v, None)


@register_state
@dataclass
class TransformerDecoderState:
    """Per decoder layer: self-attention keys/values so far and the encoder's keys/values."""

    self_attn: list[KVCache]
    cross: list[KVCache]
    position: int


@dataclass(frozen=True)
class TransformerEncoderDecoderConfig(EncoderDecoderConfig):
    """Every option of the Transformer encoder-decoder: the shared ones (`EncoderDecoderConfig`;
    `dropout` acts on the embeddings, the attention outputs and the FFN outputs) and its own.
    The defaults are fairseq's `transformer_wmt_en_de` (Transformer-base)."""

    num_heads: int = option(8, ge=1, doc="attention heads (a divisor of d_model)")
    ffn_dim: int = option(2048, ge=1, doc="the FFN hidden width")
    attention_dropout: float = rate(0.0, doc="on the attention weights")
    activation_dropout: float = rate(0.0, doc="on the FFN hidden layer")
    activation: str = option("relu", doc="of the FFN hidden layer (fairseq's default relu)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}"
            )

    def layer_spec(self) -> LayerSpec:
        """What every encoder and decoder layer is built from."""
        return LayerSpec(self.d_model, self.num_heads, self.ffn_dim, self.dropout,
                         self.attention_dropout, self.activation_dropout, self.activation,
                         self.prenorm)  # fmt: skip

    def build(self) -> TransformerEncoderDecoder:
        """The `TransformerEncoderDecoder` this config describes."""
        return TransformerEncoderDecoder(self)


class TransformerEncoderDecoder(EncoderDecoder):
    """fairseq's Transformer for translation, built from its `TransformerEncoderDecoderConfig`
    (whose fields document the options; the defaults are `transformer_wmt_en_de`)."""

    config: TransformerEncoderDecoderConfig

    def __init__(self, config: TransformerEncoderDecoderConfig) -> None:
        super().__init__(config)
        spec = config.layer_spec()
        d_model, vocab_size, pad_id = config.d_model, config.vocab_size, config.pad_id
        self.embed_src = mt_embedding(vocab_size, d_model, pad_id, dropout=0.0)
        self.embed_tgt = (
            self.embed_src
            if config.share_all_embeddings
            else mt_embedding(vocab_size, d_model, pad_id, dropout=0.0)
        )
        self.dropout = nn.Dropout(config.dropout)
        self.encoder_layers = nn.ModuleList(
            TransformerEncoderLayer(spec) for _ in range(config.encoder_layers)
        )
        self.decoder_layers = nn.ModuleList(
            TransformerDecoderLayer(spec) for _ in range(config.decoder_layers)
        )
        self.encoder_norm = nn.LayerNorm(d_model) if config.prenorm else None
        self.decoder_norm = nn.LayerNorm(d_model) if config.prenorm else None

    def _embed(self, embed: nn.Module, tokens: Tensor, mask: Tensor | None, start: int) -> Tensor:
        """√d E[tokens] + P[positions] then dropout; positions from pad_id + 1 + `start`."""
        x = embed(tokens, mask)
        real = mask if mask is not None else torch.ones_like(tokens, dtype=torch.bool)
        positions = (real.cumsum(dim=1) + start) * real + self.pad_id
        pos = fairseq_sinusoidal_positions(positions, self.d_model).to(x.dtype)
        return self.dropout(x + pos * real.unsqueeze(-1).to(x.dtype))

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> EncoderOut:
        self.check_lengths(src_len=src.shape[1])
        x = self._embed(self.embed_src, src, src_mask, 0)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        x = zero_pads(x, src_mask)
        return EncoderOut(x, src_mask)

    @property
    def layers(self) -> list[TransformerDecoderLayer]:
        """The decoder layers."""
        return [cast(TransformerDecoderLayer, layer) for layer in self.decoder_layers]

    def _cross(self, enc: EncoderOut) -> list[KVCache]:
        caches = []
        for layer in self.layers:
            k, v = layer.encoder_attn.project_kv(enc.memory)
            caches.append(KVCache(k, v, enc.mask))
        return caches

    def _output(self, x: Tensor) -> Tensor:
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return F.linear(x, self.embed_tgt.embedding.weight)

    def decode(self, tgt_in: Tensor, tgt_mask: Tensor | None, enc: EncoderOut) -> Tensor:
        self.check_lengths(tgt_len=tgt_in.shape[1])
        x = self._embed(self.embed_tgt, tgt_in, tgt_mask, 0)
        for layer, cross in zip(self.layers, self._cross(enc)):
            x, _ = layer(x, cross)
        return self._output(x)

    def initial_state(self, enc: EncoderOut) -> TransformerDecoderState:
        B, H = enc.memory.shape[0], self.layers[0].self_attn.num_heads
        empty = enc.memory.new_zeros(B, H, 0, self.d_model // H)
        return TransformerDecoderState(
            [KVCache(empty, empty, None) for _ in self.layers], self._cross(enc), 0
        )

    def step(
        self, tokens: Tensor, state: TransformerDecoderState
    ) -> tuple[Tensor, TransformerDecoderState]:
        self.check_lengths(tgt_len=state.position + tokens.shape[1])
        x = self._embed(self.embed_tgt, tokens, None, state.position)
        caches = []
        for layer, cache, cross in zip(self.layers, state.self_attn, state.cross):
            x, new = layer(x, cross, cache)
            caches.append(new)
        return self._output(x), replace(
            state, self_attn=caches, position=state.position + tokens.shape[1]
        )
