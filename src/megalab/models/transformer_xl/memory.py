"""What Transformer-XL and LaMemo share around their relative attention, written once.

Both models (`megalab.models.transformer_xl`, `megalab.models.lamemo`) are the XL code's
`MemTransformerLM` between the embedding and the softmax: a stack of post-LN layers, each a
`RelativeMultiHeadAttention` sub-layer and a ReLU FFN, global biases u, v, the fixed sinusoid
table of relative distances (dropped out), and dropout(h_L) as the output. They differ only in
what a layer does with its memory and in what they carry between segments; each model file keeps
exactly that. Shared here:

- `RelativeMemoryConfig`: the options of both (sizes, dropout, memory lengths, same_length,
  clamp_len, init) and their checks;
- `relative_sublayers`: one layer's attention and FFN sub-layers;
- `RelativeMemoryBackbone`: the parameters around the layers, the code's initialisation, the
  memory length in use (`eval_mem_len` in evaluation), the set-up of a segment (input checks,
  causal mask, distance table) and its output;
- the checks of a carried memory stream (padding only at the end of a row, no tokens after it).

Their layers do not run in the shared stack (`megalab.models.stack`): what they carry is not a
state each layer updates by itself. Transformer-XL's memory is every layer's input (the layer
below's output) of the last `mem_len` positions, cut after the pass with `ext_len`; LaMemo's
layer ℓ + 1 takes the memory that layer ℓ refreshed, handed down the stack within the pass.
Each model's loop says exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from megalab.models.base import Backbone, BackboneConfig, BackboneOutput
from megalab.nn.ffn import NormalizedFFN
from megalab.nn.relative_attention import (
    RelativeMultiHeadAttention,
    SinusoidPositions,
    at_least_float32,
    causal_mask,
    relative_distances,
)
from megalab.utils.options import check_options, option, rate


@dataclass(frozen=True)
class RelativeMemoryConfig(BackboneConfig):
    """The options Transformer-XL and LaMemo share, each with its range and meaning."""

    model_name: ClassVar[str] = "this model"

    d_model: int = option(410, ge=1, doc="D, the feature width")
    num_layers: int = option(16, ge=1, doc="number of layers")
    num_heads: int = option(10, ge=1, doc="H, the attention heads")
    head_dim: int | None = option(None, doc="d_head (None: D / H)")
    ffn_dim: int = option(2100, doc="d_inner, the FFN hidden width")
    dropout: float = rate(
        0.1, doc="on the positions table, after W_o, inside the FFN and on the output"
    )
    attention_dropout: float = rate(0.0, doc="on the attention probabilities (dropatt)")
    pre_lnorm: bool = option(
        False, doc="pre-LN layers (the code's option; off in every paper configuration)"
    )
    mem_len: int = option(150, ge=0, doc="memory length in training (0: no memory)")
    eval_mem_len: int | None = option(None, ge=0, doc="memory length in evaluation (None: mem_len)")
    same_length: bool = option(False, doc="every query sees the same number (mem_len) of keys")
    clamp_len: int = option(-1, doc="cap on relative distances (<= 0: none)")
    init_std: float = option(0.02, doc="scale of the initialisation")
    causal: bool = option(True, doc="always true (a language model)")

    def __post_init__(self) -> None:
        check_options(self)
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}: set "
                "head_dim explicitly"
            )
        if self.same_length and min(self.mem_len, self.eval_mem_len or self.mem_len) < 1:
            raise ValueError(
                "same_length limits every query to mem_len keys: it needs mem_len >= 1"
            )
        if not self.causal:
            raise ValueError(f"{self.model_name} is a causal language model: causal must be true")

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads


def relative_sublayers(
    cfg: RelativeMemoryConfig,
) -> tuple[RelativeMultiHeadAttention, NormalizedFFN]:
    """One layer's sub-layers: relative attention with its residual + LayerNorm, and the
    position-wise FFN (ReLU, dropout after the activation and after W_2), post-LN as the code
    (`pre_lnorm` moves both norms before their sub-layer)."""
    attn = RelativeMultiHeadAttention(
        cfg.d_model,
        cfg.num_heads,
        cfg.d_head,
        dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout,
        pre_lnorm=cfg.pre_lnorm,
    )
    ffn = NormalizedFFN(
        cfg.d_model,
        cfg.ffn_dim,
        dropout=cfg.dropout,
        hidden_dropout=cfg.dropout,
        activation="relu",
        norm_type="layernorm",
        prenorm=cfg.pre_lnorm,
    )
    return attn, ffn


def init_xl_parameters(module: nn.Module, std: float) -> None:
    """The XL trainer's `weights_init` on one module tree: Linear N(0, std) with zero bias,
    LayerNorm weight N(1, std) with zero bias (embeddings and softmax live in the task)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, 1.0, std)
            nn.init.zeros_(m.bias)


def check_trailing_padding(mask: Tensor | None, model: str) -> Tensor | None:
    """The mask if it only pads the end of each row (None when nothing is padded); else a
    ValueError that says what the memory models support."""
    if mask is None or bool(mask.all()):
        return None
    lengths = mask.sum(1, keepdim=True)
    if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device) < lengths):
        raise ValueError(
            f"{model} takes padding only at the end of a row (mask True then False): its "
            "memory is a contiguous stream. Left-pad nothing; split batches of streams that "
            "start at different times"
        )
    return mask


def check_stream_continues(ended: Tensor, mask: Tensor | None, length: int, model: str) -> None:
    """Fail when a stream that reached padding gets more real tokens."""
    if not bool(ended.any()):
        return
    more = torch.ones_like(ended) if mask is None else mask.any(1)
    if bool((ended & more).any()):
        raise ValueError(
            f"a {model} stream that ended in padding received {length} more token(s): its "
            "memory holds the padded positions. Start the stream afresh from initial_state"
        )


def ended_after(ended: Tensor, mask: Tensor | None) -> Tensor:
    """Streams that have reached padding once this segment is done."""
    return ended if mask is None else ended | ~mask[:, -1]


class Segment(NamedTuple):
    """One segment's set-up: the padding mask (None: nothing padded), the memory rows m, the
    causal mask (L, m + L) and the dropped-out sinusoid table of the distances."""

    padded: Tensor | None
    m: int
    masked: Tensor
    table: Tensor


class RelativeMemoryBackbone(Backbone):
    """Base of Transformer-XL and LaMemo: the layers built by `layer(cfg)`, the global content
    and position biases u, v (the code's r_w_bias, r_r_bias; shared by all layers), the sinusoid
    table and the model's dropout. Subclasses implement `memory_length`, `initial_state` and
    `_forward` on top of `segment` and `output`."""

    config: RelativeMemoryConfig

    def __init__(self, cfg: RelativeMemoryConfig, layer: Any) -> None:
        super().__init__(cfg)
        self.positions = SinusoidPositions(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(layer(cfg) for _ in range(cfg.num_layers))
        self.u = nn.Parameter(torch.empty(cfg.num_heads, cfg.d_head))
        self.v = nn.Parameter(torch.empty(cfg.num_heads, cfg.d_head))

    def reset_parameters(self) -> None:
        """The XL trainer's initialisation: N(0, init_std) weights, biases u and v."""
        std = self.config.init_std
        init_xl_parameters(self.layers, std)
        nn.init.normal_(self.u, 0.0, std)
        nn.init.normal_(self.v, 0.0, std)

    @property
    def mem_len(self) -> int:
        """The memory length in use: `eval_mem_len` in evaluation when set, else `mem_len`."""
        cfg = self.config
        if not self.training and cfg.eval_mem_len is not None:
            return cfg.eval_mem_len
        return cfg.mem_len

    def memory_length(self, state: Any) -> int:
        """Rows m currently in a memory."""
        raise NotImplementedError

    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, state: Any = None
    ) -> BackboneOutput:
        """x (B, L, D) embeddings, mask (B, L) True at real tokens, state = the memory.

        Returns y (B, L, D) (zero at padded positions) and, when a memory was passed, the
        memory for the next segment.
        """
        return self._forward(x, mask, state, None)

    def forward_details(
        self, x: Tensor, mask: Tensor | None = None, state: Any = None
    ) -> tuple[BackboneOutput, list[dict[str, Tensor]]]:
        """`forward` plus, per layer, the attention probabilities and sub-layer outputs, for
        analysis and tests against the code."""
        details: list[dict[str, Tensor]] = [{} for _ in self.layers]
        return self._forward(x, mask, state, details), details

    def _forward(
        self,
        x: Tensor,
        mask: Tensor | None,
        state: Any,
        details: list[dict[str, Tensor]] | None,
    ) -> BackboneOutput:
        raise NotImplementedError

    def segment(
        self,
        x: Tensor,
        mask: Tensor | None,
        state: Any,
        ended: Tensor | None,
        future_sign: int = 0,
    ) -> Segment:
        """Check a segment x (B, L, D) and set it up: its causal mask over the m memory rows
        and itself (`same_length` as the code), and the sinusoid table of the distances
        m + L − 1, …, 0, then (`future_sign` ±1, LaMemo) the look-ahead distances ±1, …, ±m,
        all capped by `clamp_len`, dropped out as the code does."""
        self.check_input(x, mask, state)
        L = x.shape[1]
        cfg = self.config
        name = cfg.model_name
        padded = check_trailing_padding(mask, name)
        if ended is not None:
            check_stream_continues(ended, padded, L, name)
        m = self.memory_length(state)
        masked = causal_mask(L, m, cfg.same_length, self.mem_len, device=x.device)
        distances = relative_distances(
            m + L,
            future=m if future_sign else 0,
            future_sign=future_sign or 1,
            clamp_len=cfg.clamp_len,
            device=x.device,
            dtype=at_least_float32(x).dtype,
        )
        table = self.drop(self.positions(distances).to(x.dtype))
        return Segment(padded, m, masked, table)

    def output(self, h: Tensor, padded: Tensor | None) -> Tensor:
        """dropout(h_L), zero at padded positions."""
        y = self.drop(h)
        if padded is not None:
            y = y * padded.unsqueeze(-1).to(y.dtype)
        return y
