"""Mega encoder-decoder for machine translation (Ma et al., ICLR 2023, §4.3), exact to the code.

The authors' `MegaModel` (facebookresearch/mega, `fairseq/models/mega.py`, archs
`mega_wmt_en_de` and `mega_wmt_en_de_big`), which the paper describes only by its sizes
(Table 10):

    encoder layer:  MAGA (bidirectional EMA, full attention)          -> NFFN
    decoder layer:  MAGA (causal EMA, causal attention) -> gated cross-attention -> NFFN

Each sub-layer is the one of `megalab.models.mega` (MAGA, eqs. 6-15; NFFN, eq. 21) and
`megalab.models.mega.cross_attention` (the gated cross-attention, not in the paper). Token
embeddings are N(0, d^-½) with a zero padding row, scaled by √d, followed by `dropout`; padded
positions are zeroed after the embedding and after the last layer (and the final norm, pre-norm
only). The WMT configuration is post-norm LayerNorm with softmax attention, no chunking, the
'simple' relative position bias (tables of max_source_positions / max_target_positions entries; the
cross-attention's of the larger of the two) and one embedding table shared by the encoder, the
decoder and the output projection (`--share-all-embeddings`). The README passes
`--truncation-length 0`, which the code turns into an empty EMA kernel (an error in the
encoder); like the released checkpoints we read it as no truncation.

Decoding: `step` continues every stream by one or more tokens with the cached EMA state and the
self-attention keys/values of each decoder layer (`MAGAState`, dropped at chunk boundaries when
chunked) and the encoder's cross-attention keys/values, computed once (`CrossAttentionCache`);
the number of target tokens decoded so far positions the cross-attention bias. Every state
tensor holds the batch in dim 0, so beam search reorders it with `select_state`.

The encoder is a `Mega` backbone (the shared stack, `megalab.models.stack`); the decoder keeps
its own loops: each layer also takes its cross-attention keys/values of the encoder output and
the target position, and teacher forcing and `step` thread different things through it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.models.mega.cross_attention import CrossAttentionCache, GatedCrossAttention
from megalab.models.mega.model import (
    MAGAState,
    Mega,
    MegaConfig,
    MovingAverageGatedAttention,
    mega_ffn,
)
from megalab.models.seq2seq import EncoderDecoder, EncoderDecoderConfig, EncoderOut
from megalab.nn.embedding import TokenEmbedding
from megalab.nn.masking import zero_pads
from megalab.nn.norms import SequenceNorm
from megalab.nn.state import register_state
from megalab.utils.options import option, rate


@register_state
@dataclass
class MegaDecoderState:
    """Incremental decoding state: per layer the MAGA state (EMA hidden state, open chunk's
    keys/values) and the encoder's cross-attention keys/values; `position` = tokens decoded."""

    layers: list[MAGAState]
    cross: list[CrossAttentionCache]
    position: int


def mt_embedding(vocab_size: int, d_model: int, pad_id: int, dropout: float) -> TokenEmbedding:
    """fairseq's MT `Embedding`: N(0, d^-½) with a zero padding row, output scaled by √d."""
    emb = TokenEmbedding(vocab_size, d_model, pad_id=pad_id, scale=True, dropout=dropout)
    with torch.no_grad():
        emb.embedding.weight[pad_id].zero_()
    return emb


class MegaDecoderLayer(nn.Module):
    """Causal MAGA, then gated cross-attention to the encoder output, then the NFFN."""

    def __init__(self, cfg: MegaConfig, cross_max_positions: int) -> None:
        super().__init__()
        self.maga = MovingAverageGatedAttention(cfg)
        self.cross_attn = GatedCrossAttention(cfg, cross_max_positions)
        self.ffn = mega_ffn(cfg) if cfg.ffn_dim > 0 else None

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None,
        memory: CrossAttentionCache,
        state: MAGAState | None = None,
        position: int = 0,
    ) -> tuple[Tensor, MAGAState | None]:
        """x (B, T, D) at target positions position.. -> (B, T, D), new MAGA state."""
        x, new_state = self.maga(x, mask, state)
        x = self.cross_attn(x, memory, query_offset=position)
        if self.ffn is not None:
            x = self.ffn(x)
        return x, new_state


@dataclass(frozen=True)
class MegaEncoderDecoderConfig(EncoderDecoderConfig):
    """Every option of the Mega encoder-decoder: the shared ones (`EncoderDecoderConfig`) and
    the Mega layers' (as `MegaConfig`'s). The defaults are the authors' `mega_wmt_en_de`;
    `mega_wmt_en_de_big` is d_model 1024, z_dim 256, v_dim = ffn_dim 2048 (dropout 0.3).
    """

    z_dim: int = option(128, ge=1, doc="z, the shared Q/K width (--encoder-z-dim)")
    v_dim: int = option(1024, ge=1, doc="v, the value width (--encoder-hidden-dim)")
    ffn_dim: int = option(1024, doc="d_FFN (<= 0: no FFN)", note=" (<= 0: no FFN)")
    ema_dim: int = option(
        16, ge=0, doc="h, the EMA expansion (--encoder-n-dim)", note=" (0 removes the EMA)"
    )
    encoder_chunk_size: int = option(
        -1, ge=1, also={-1: "no chunking"}, doc="the encoder's attention chunk (-1: full, as MT)"
    )
    decoder_chunk_size: int = option(
        -1, ge=1, also={-1: "no chunking"}, doc="the decoder's attention chunk (-1: full, as MT)"
    )
    truncation: int | None = option(
        None,
        doc="EMA kernel length (None: untruncated; the README's --truncation-length 0 is read "
        "as None, see the module docstring)",
    )
    attention_activation: str = option(
        "softmax", doc="softmax | laplace | relu2 (Table 6: Mega-softmax, Mega-laplace)"
    )
    rel_pos_bias: str = option(
        "simple",
        doc="simple | rotary; the 'simple' tables have max_source_positions / "
        "max_target_positions entries, the cross-attention's the larger of the two",
    )
    norm_type: str = option(
        "layernorm",
        doc="layernorm | scalenorm | rmsnorm | batchnorm | syncbatchnorm (WMT: layernorm)",
    )
    attention_dropout: float = rate(0.1, doc="on the attention weights")
    hidden_dropout: float = rate(0.1, doc="on V (--hidden-dropout)")
    activation_dropout: float = rate(0.1, doc="on the FFN hidden layer (--activation-dropout)")
    activation: str = option("silu", doc="for V, Ĥ and the FFN: silu | gelu | gelu_accurate | relu")
    share_decoder_input_output_embed: bool = option(
        True,
        doc="tie the output projection to the target embedding (implied by "
        "share_all_embeddings); otherwise a Linear N(0, d^-½) without bias",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.stack_config(causal=False)  # the layers' own checks, before anything is built
        self.stack_config(causal=True)

    def stack_config(self, causal: bool) -> MegaConfig:
        """The `MegaConfig` of the encoder's layers (`causal=False`: bidirectional EMA) or of the
        decoder's MAGA and NFFN (`causal=True`)."""
        return MegaConfig(
            d_model=self.d_model,
            num_layers=self.decoder_layers if causal else self.encoder_layers,
            z_dim=self.z_dim,
            v_dim=self.v_dim,
            ffn_dim=self.ffn_dim,
            ema_dim=self.ema_dim,
            chunk_size=self.decoder_chunk_size if causal else self.encoder_chunk_size,
            truncation=self.truncation,
            attention_activation=self.attention_activation,
            rel_pos_bias=self.rel_pos_bias,
            max_positions=self.max_target_positions if causal else self.max_source_positions,
            norm_type=self.norm_type,
            prenorm=self.prenorm,
            causal=causal,
            dropout=self.dropout,
            attention_dropout=self.attention_dropout,
            hidden_dropout=self.hidden_dropout,
            activation_dropout=self.activation_dropout,
            activation=self.activation,
        )

    def build(self) -> MegaEncoderDecoder:
        """The `MegaEncoderDecoder` this config describes."""
        return MegaEncoderDecoder(self)


class MegaEncoderDecoder(EncoderDecoder):
    """The Mega encoder-decoder, built from its `MegaEncoderDecoderConfig` (whose fields
    document the options; the defaults are `mega_wmt_en_de`). `dropout` also acts on the
    embeddings; `share_all_embeddings` needs a joint vocabulary."""

    config: MegaEncoderDecoderConfig

    def __init__(self, config: MegaEncoderDecoderConfig) -> None:
        super().__init__(config)
        d_model = config.d_model
        self.encoder_config = config.stack_config(causal=False)
        self.decoder_config = config.stack_config(causal=True)
        self.embed_src = mt_embedding(config.vocab_size, d_model, config.pad_id, config.dropout)
        self.embed_tgt = (
            self.embed_src
            if config.share_all_embeddings
            else mt_embedding(config.vocab_size, d_model, config.pad_id, config.dropout)
        )
        self.encoder = Mega(self.encoder_config)
        cross_max = max(config.max_source_positions, config.max_target_positions)
        self.decoder_layers = nn.ModuleList(
            MegaDecoderLayer(self.decoder_config, cross_max) for _ in range(config.decoder_layers)
        )
        self.decoder_final_norm = (
            SequenceNorm(config.norm_type, d_model) if config.prenorm else None
        )
        self.tied_output = config.share_all_embeddings or config.share_decoder_input_output_embed
        self.output_proj: nn.Linear | None = None
        if not self.tied_output:
            self.output_proj = nn.Linear(d_model, config.vocab_size, bias=False)
            nn.init.normal_(self.output_proj.weight, mean=0.0, std=d_model**-0.5)

    # -- encoder --------------------------------------------------------------------------------
    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> EncoderOut:
        """Source ids (B, S) -> encoder outputs (B, S, D), zero at padded positions."""
        self.check_lengths(src_len=src.shape[1])
        x = self.embed_src(src, src_mask)
        return EncoderOut(self.encoder(x, src_mask).y, src_mask)

    # -- decoder --------------------------------------------------------------------------------
    def output_layer(self, x: Tensor) -> Tensor:
        """Features (..., D) -> logits (..., V)."""
        if self.output_proj is not None:
            return self.output_proj(x)
        return F.linear(x, self.embed_tgt.embedding.weight)

    def _decoder_out(self, x: Tensor, mask: Tensor | None) -> Tensor:
        if self.decoder_final_norm is not None:
            x = self.decoder_final_norm(x)
        x = zero_pads(x, mask)
        return self.output_layer(x)

    @property
    def layers(self) -> list[MegaDecoderLayer]:
        """The decoder layers."""
        return [cast(MegaDecoderLayer, layer) for layer in self.decoder_layers]

    def decode(self, tgt_in: Tensor, tgt_mask: Tensor | None, enc: EncoderOut) -> Tensor:
        """Teacher forcing: decoder inputs (B, T) -> logits (B, T, V)."""
        self.check_lengths(tgt_len=tgt_in.shape[1])
        x = self.embed_tgt(tgt_in, tgt_mask)
        for layer in self.layers:
            memory = layer.cross_attn.memory_cache(enc.memory, enc.mask)
            x, _ = layer(x, tgt_mask, memory)
        return self._decoder_out(x, tgt_mask)

    def initial_state(self, enc: EncoderOut) -> MegaDecoderState:
        """Empty decoder state with the encoder's cross-attention keys/values computed once."""
        B = enc.memory.shape[0]
        return MegaDecoderState(
            [layer.maga.initial_state(B, enc.memory) for layer in self.layers],
            [layer.cross_attn.memory_cache(enc.memory, enc.mask) for layer in self.layers],
            0,
        )

    def step(self, tokens: Tensor, state: MegaDecoderState) -> tuple[Tensor, MegaDecoderState]:
        """Continue every stream by tokens (B, L): logits (B, L, V) and the new state."""
        self.check_lengths(tgt_len=state.position + tokens.shape[1])
        x = self.embed_tgt(tokens)
        new_layers: list[MAGAState] = []
        for layer, maga_state, memory in zip(self.layers, state.layers, state.cross):
            x, new = layer(x, None, memory, maga_state, state.position)
            assert new is not None
            new_layers.append(new)
        logits = self._decoder_out(x, None)
        return logits, replace(state, layers=new_layers, position=state.position + tokens.shape[1])

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, pad_id={self.pad_id}, tied_output={self.tied_output}"
