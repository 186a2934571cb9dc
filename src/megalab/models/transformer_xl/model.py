"""Transformer-XL (Dai et al., ACL 2019), exact to its PyTorch code as LaMemo's code base has it.

The model is the XL code's `MemTransformerLM` with `attn_type=0` between the embedding and the
softmax (those are `megalab.nn.adaptive_xl`): a stack of post-LN layers

    X̃_ℓ   = [sg(M_ℓ); h_ℓ]                      memory of layer ℓ, then the segment (eq. 5)
    A     = softmax_causal(((q + u)ᵀ k + (q + v)ᵀ W_R R_{i−j}) / √d_head)    (eq. 6)
    h'_ℓ  = LN(h_ℓ + dropout(W_o A V))
    h_ℓ+1 = LN(h'_ℓ + dropout(W_2 dropout(ReLU(W_1 h'_ℓ + b_1)) + b_2))

with u, v shared by all layers and R the fixed sinusoid table (dropout applied to it, as the
code does), see `megalab.nn.relative_attention`. The input x is the dropped-out, √d-scaled
embedding; the output is dropout(h_L).

The memory (`XLMemory`, the carried state) holds, per layer, the hidden states that entered
it over the last `mem_len` positions (L + 1 tensors, the embeddings first), detached: each
segment appends its own and keeps rows [end − mem_len, end) with end = m + max(0, L − ext_len),
the code's `_update_mems`. A stream starts from `initial_state` (empty memory); without a
state a segment is processed alone. With `mem_len` = 0 there is no memory at all
(`initial_state` is None): the "Transformer+RPE" baseline of the LaMemo paper.

Options as in the code: `clamp_len` > 0 caps relative distances; `same_length` makes every
query see `mem_len` keys; `ext_len` keeps the last `ext_len` positions of a segment out of the
memory (the data re-feeds them as extended context: `data.ext_len`); `pre_lnorm` normalises
before each sub-layer instead of after. `eval_mem_len` is the memory length in evaluation (the
code's evaluation rebuilds the model with another `mem_len`; LaMemo's Fig. 5 evaluates a model
trained with 150 at 64 … 640).

Initialisation is the code's `weights_init`: linears N(0, 0.02) with zero biases, LayerNorm
weights N(1, 0.02) with zero biases, u and v N(0, 0.02). What XL shares with LaMemo (options,
sub-layers, segment set-up, output, initialisation) is `megalab.models.transformer_xl.memory`.

Padding: the contract's `mask` may only mark trailing positions of a row (the end of a stream,
as the last evaluation segment); padded outputs are zero. A stream whose row was padded has
ended: passing its state on with more real tokens in that row raises an error, since they would
attend to the padded positions kept in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from megalab.models.base import BackboneOutput
from megalab.models.transformer_xl.memory import (
    RelativeMemoryBackbone,
    RelativeMemoryConfig,
    ended_after,
    relative_sublayers,
)
from megalab.nn.relative_attention import update_memory
from megalab.nn.state import register_state
from megalab.utils.options import option


@register_state
@dataclass
class XLMemory:
    """Transformer-XL's memory: the inputs of every layer over the last `mem_len` positions.

    `hidden[0]` holds the (dropped-out) embeddings, `hidden[ℓ + 1]` the output of layer ℓ,
    each (B, m, D); `ended` (B,) marks streams that reached padding (no more tokens may follow).
    """

    hidden: list[Tensor]
    ended: Tensor


@dataclass(frozen=True)
class TransformerXLConfig(RelativeMemoryConfig):
    """Every option of `TransformerXL`, each with its range and meaning:
    those of `RelativeMemoryConfig` and `ext_len`."""

    model_name = "Transformer-XL"

    ext_len: int = option(0, ge=0, doc="positions per segment kept out of the memory")

    def build(self) -> TransformerXL:
        """The `TransformerXL` this config describes."""
        return TransformerXL(self)


class XLLayer(nn.Module):
    """One XL decoder layer: relative multi-head attention over [memory; segment], then the
    position-wise FFN (ReLU, dropout after the activation and after W_2), both post-LN."""

    def __init__(self, cfg: TransformerXLConfig) -> None:
        super().__init__()
        self.attn, self.ffn = relative_sublayers(cfg)

    def forward(
        self,
        h: Tensor,
        memory: Tensor | None,
        table: Tensor,
        u: Tensor,
        v: Tensor,
        masked: Tensor,
        details: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """h (B, L, D), memory (B, m, D) or None, table (K, D) -> (B, L, D)."""
        m = 0 if memory is None else memory.shape[1]
        cat = h if m == 0 else torch.cat([memory, h], dim=1)  # type: ignore[list-item]
        q, k, v_ = self.attn.project(cat, queries_from=m)
        r = self.attn.project_positions(table)
        ctx, _, probs = self.attn.attend(q, k, v_, r, u, v, masked)
        out = self.attn.output(h, ctx)
        y = self.ffn(out)
        if details is not None:
            details.update(attn_prob=probs, attn_out=out, out=y)
        return y


class TransformerXL(RelativeMemoryBackbone):
    """The Transformer-XL backbone (see the module docstring), (B, L, D) -> (B, L, D)."""

    config: TransformerXLConfig
    block_class = XLLayer

    def __init__(self, config: TransformerXLConfig | None = None) -> None:
        super().__init__(config or TransformerXLConfig(), XLLayer)
        self.reset_parameters()

    # -- memory -------------------------------------------------------------------------------
    @property
    def ext_len(self) -> int:
        """Positions at the end of each segment kept out of the memory: the next segment
        re-reads them as extended context (`data.ext_len`, which must be equal)."""
        return self.config.ext_len

    def initial_state(self, batch_size: int, like: Tensor) -> XLMemory | None:
        """An empty memory (None without memory: mem_len 0, the Transformer+RPE baseline)."""
        if self.mem_len == 0:
            return None
        empty = like.new_zeros(batch_size, 0, self.d_model)
        return XLMemory(
            [empty] * (len(self.layers) + 1),
            torch.zeros(batch_size, dtype=torch.bool, device=like.device),
        )

    def memory_length(self, state: XLMemory | None) -> int:
        """Rows m currently in a memory."""
        return 0 if state is None else state.hidden[0].shape[1]

    # -- forward ------------------------------------------------------------------------------
    def _forward(
        self,
        x: Tensor,
        mask: Tensor | None,
        state: XLMemory | None,
        details: list[dict[str, Tensor]] | None,
    ) -> BackboneOutput:
        if state is not None and len(state.hidden) != len(self.layers) + 1:
            raise ValueError(
                f"this memory has {len(state.hidden)} tensors; Transformer-XL with "
                f"{len(self.layers)} layers carries {len(self.layers) + 1}"
            )
        padded, m, masked, table = self.segment(
            x, mask, state, None if state is None else state.ended
        )
        hids = [x]
        h = x
        for i, layer in enumerate(self.layers):
            memory = None if state is None or m == 0 else state.hidden[i]
            h = layer(
                h, memory, table, self.u, self.v, masked, None if details is None else details[i]
            )
            hids.append(h)
        y = self.output(h, padded)
        new_state = None
        if state is not None:
            mem_len, ext_len = self.mem_len, self.config.ext_len
            new_state = XLMemory(
                [update_memory(old, new, mem_len, ext_len) for old, new in zip(state.hidden, hids)],
                ended_after(state.ended, padded),
            )
        return BackboneOutput(y, new_state)
