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
memory (the data then re-feeds them as extended context); `pre_lnorm` normalises before each
sub-layer instead of after. `eval_mem_len` is the memory length in evaluation (the code's
evaluation rebuilds the model with another `mem_len`; LaMemo's Fig. 5 evaluates a model trained
with 150 at 64 … 640).

Initialisation is the code's `weights_init`: linears N(0, 0.02) with zero biases, LayerNorm
weights N(1, 0.02) with zero biases, u and v N(0, 0.02).

Padding: the contract's `mask` may only mark trailing positions of a row (the end of a stream,
as the last evaluation segment); padded outputs are zero. A stream whose row was padded has
ended: passing its state on with more real tokens in that row raises an error, since they would
attend to the padded positions kept in memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from megalab.models.base import Backbone, BackboneOutput
from megalab.models.state import register_state
from megalab.nn.ffn import NormalizedFFN
from megalab.nn.relative_attention import (
    RelativeMultiHeadAttention,
    SinusoidPositions,
    at_least_float32,
    causal_mask,
    relative_distances,
    update_memory,
)


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
class TransformerXLConfig:
    """Every option of `TransformerXL` (its keyword arguments; see its docstring)."""

    d_model: int = 410
    num_layers: int = 16
    num_heads: int = 10
    head_dim: int | None = None
    ffn_dim: int = 2100
    dropout: float = 0.1
    attention_dropout: float = 0.0
    pre_lnorm: bool = False
    mem_len: int = 150
    eval_mem_len: int | None = None
    ext_len: int = 0
    same_length: bool = False
    clamp_len: int = -1
    init_std: float = 0.02
    causal: bool = field(default=True)

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}: set "
                "head_dim explicitly"
            )
        if self.mem_len < 0 or (self.eval_mem_len is not None and self.eval_mem_len < 0):
            raise ValueError("mem_len and eval_mem_len must be >= 0")
        if self.ext_len < 0:
            raise ValueError(f"ext_len must be >= 0, got {self.ext_len}")
        if self.same_length and min(self.mem_len, self.eval_mem_len or self.mem_len) < 1:
            raise ValueError(
                "same_length limits every query to mem_len keys: it needs mem_len >= 1"
            )
        if not self.causal:
            raise ValueError("Transformer-XL is a causal language model: causal must be true")

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads


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


class XLLayer(nn.Module):
    """One XL decoder layer: relative multi-head attention over [memory; segment], then the
    position-wise FFN (ReLU, dropout after the activation and after W_2), both post-LN."""

    def __init__(self, cfg: TransformerXLConfig) -> None:
        super().__init__()
        self.attn = RelativeMultiHeadAttention(
            cfg.d_model,
            cfg.num_heads,
            cfg.d_head,
            dropout=cfg.dropout,
            attention_dropout=cfg.attention_dropout,
            pre_lnorm=cfg.pre_lnorm,
        )
        self.ffn = NormalizedFFN(
            cfg.d_model,
            cfg.ffn_dim,
            dropout=cfg.dropout,
            hidden_dropout=cfg.dropout,
            activation="relu",
            norm_type="layernorm",
            prenorm=cfg.pre_lnorm,
        )

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


class TransformerXL(Backbone):
    """The Transformer-XL backbone (see the module docstring), (B, L, D) -> (B, L, D).

    Args:
        d_model: D.  num_layers: number of layers.  num_heads: H.
        head_dim: d_head (None: D / H).  ffn_dim: d_inner.
        dropout: on the embedding's positions table, after W_o, inside the FFN and on the
            output.  attention_dropout: on the attention probabilities (dropatt).
        pre_lnorm: pre-LN layers (the code's option; off in every paper configuration).
        mem_len: memory length in training (0: no memory).  eval_mem_len: in evaluation
            (None: mem_len).  ext_len: positions per segment kept out of the memory.
        same_length: every query sees the same number (mem_len) of keys.
        clamp_len: cap on relative distances (≤ 0: none).
        init_std: scale of the initialisation.  causal: always true (a language model).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        cfg = TransformerXLConfig(*args, **kwargs)
        self.config = cfg
        self.d_model = cfg.d_model
        self.causal = True
        self.positions = SinusoidPositions(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(XLLayer(cfg) for _ in range(cfg.num_layers))
        # Global content and position biases u, v (the code's r_w_bias, r_r_bias).
        self.u = nn.Parameter(torch.empty(cfg.num_heads, cfg.d_head))
        self.v = nn.Parameter(torch.empty(cfg.num_heads, cfg.d_head))
        self.reset_parameters()

    @classmethod
    def from_config(cls, cfg: TransformerXLConfig) -> TransformerXL:
        return cls(**asdict(cfg))

    def reset_parameters(self) -> None:
        """The XL trainer's initialisation (N(0, init_std) weights and biases u, v)."""
        std = self.config.init_std
        init_xl_parameters(self.layers, std)
        nn.init.normal_(self.u, 0.0, std)
        nn.init.normal_(self.v, 0.0, std)

    # -- memory -------------------------------------------------------------------------------
    @property
    def mem_len(self) -> int:
        """The memory length in use: `eval_mem_len` in evaluation when set, else `mem_len`."""
        cfg = self.config
        if not self.training and cfg.eval_mem_len is not None:
            return cfg.eval_mem_len
        return cfg.mem_len

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
    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, state: XLMemory | None = None
    ) -> BackboneOutput:
        """x (B, L, D) embeddings, mask (B, L) True at real tokens, state = the memory.

        Returns y (B, L, D) (zero at padded positions) and, when a memory was passed, the
        memory for the next segment.
        """
        return self._forward(x, mask, state, None)

    def forward_details(
        self, x: Tensor, mask: Tensor | None = None, state: XLMemory | None = None
    ) -> tuple[BackboneOutput, list[dict[str, Tensor]]]:
        """`forward` plus, per layer, the attention probabilities (B, H, L, K) and the
        sub-layer outputs (`attn_out`, `out`), for analysis and tests against the code."""
        details: list[dict[str, Tensor]] = [{} for _ in self.layers]
        return self._forward(x, mask, state, details), details

    def _forward(
        self,
        x: Tensor,
        mask: Tensor | None,
        state: XLMemory | None,
        details: list[dict[str, Tensor]] | None,
    ) -> BackboneOutput:
        _B, L, D = x.shape
        if self.d_model != D:
            raise ValueError(f"expected inputs of width d_model={self.d_model}, got {D}")
        cfg = self.config
        padded = check_trailing_padding(mask, "Transformer-XL")
        if state is not None:
            if len(state.hidden) != len(self.layers) + 1:
                raise ValueError(
                    f"this memory has {len(state.hidden)} tensors; Transformer-XL with "
                    f"{len(self.layers)} layers carries {len(self.layers) + 1}"
                )
            check_stream_continues(state.ended, padded, L, "Transformer-XL")
        m = self.memory_length(state)
        K = m + L
        masked = causal_mask(L, m, cfg.same_length, self.mem_len, device=x.device)
        distances = relative_distances(
            K, clamp_len=cfg.clamp_len, device=x.device, dtype=at_least_float32(x).dtype
        )
        table = self.drop(self.positions(distances).to(x.dtype))
        hids = [x]
        h = x
        for i, layer in enumerate(self.layers):
            memory = None if state is None or m == 0 else state.hidden[i]
            h = layer(
                h, memory, table, self.u, self.v, masked, None if details is None else details[i]
            )
            hids.append(h)
        y = self.drop(h)
        if padded is not None:
            y = y * padded.unsqueeze(-1).to(y.dtype)
        new_state = None
        if state is not None:
            mem_len = self.mem_len
            new_state = XLMemory(
                [
                    update_memory(old, new, mem_len, cfg.ext_len)
                    for old, new in zip(state.hidden, hids)
                ],
                ended_after(state.ended, padded),
            )
        return BackboneOutput(y, new_state)
