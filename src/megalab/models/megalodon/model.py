"""Megalodon (Ma et al. 2024), exact to the authors' code (XuezheMax/megalodon at cff8ba5).

One block is a gated-attention sub-layer and a feed-forward sub-layer, pre-norm, with the
two-hop residual (eq. 11): both add back the block input X.

    X̂  = TimestepNorm(X)                    causal group norm, cumulative over the sequence  (4)
    X' = CEMA(X̂)                            complex EMA over the whole sequence, + ω ⊙ X̂     (5)
    X'' = RMSNorm(X')                        plus-1 scale; in the code only, not the paper
    Z  = X'' W_z + b_z                       no SiLU                                           (6)
    Q, K = (1 + κ) ⊙ Z/‖Z‖ + μ per head      normalized attention                           (7, 8)
    V  = SiLU(X̂ W_v + b_v)                   from X̂, not from the CEMA path
    Γ  = SiLU(X'' W_γ + b_γ)                 gate (the code's `wr`)
    O  = softmax(RoPE(Q) RoPE(K)ᵀ) V         per head, within chunks, no 1/√d              (9)
    Ŷ  = X + X'' W_h1 + b_h1 + (Γ ⊙ O) W_h2  no update gate, no SiLU (Mega's eq. 20 had one)
    Y  = X + FFN(LayerNorm(Ŷ))               two-hop residual: X, not Ŷ                     (11)
    FFN(u) = W_2 (SiLU(u W_1) ⊙ u W_3)       SwiGLU (mega1.3B_pg19, mega7.3B), else W_2 SiLU(u W_1)

Every norm scale is "plus 1" (γ = 0 at init, applied as 1 + γ; App. B.2), ε = 1e-5. Where the
paper and the code differ we follow the code (docs/reference/megalodon-code.md §4): the extra
RMSNorm on the CEMA output, no SiLU on H, Z normalised per head, the real CEMA input coefficient.
After the last block the backbone ends with a final TimestepNorm (the code's `MegaOutputLayer` norm,
with its own carried statistics); the LM head (no bias, untied except `mega1.3B_pg19`) is the
task's. Initialisation as the code: every linear kaiming-normal with a = √5 (std 1/√(3·fan_in),
its `init_mode='he'`), biases and all norm scales and offsets zero; CEMA as `ComplexEMA`.
Dropouts as the code: `hidden_dropout` on X'' and on Γ ⊙ O and on the FFN hidden layer,
`dropout` on the two branch outputs, `attention_dropout` as DropKey.

A causal model streams (`initial_state`): each layer carries its timestep-norm statistics, its
CEMA state h (B, D, N) and the keys/values of the open attention chunk, and the final norm its
statistics; feeding any segmentation of a sequence (segments of any length, chunk boundaries
inside them or not) gives the outputs of one pass, which the authors' code allows only for
segments shorter than the chunk or multiples of it. Lengths that are not a multiple of the
chunk are padded inside attention. The stream's statistics are never truncated by the model;
the code's long-document evaluation re-estimates them over the last 6 chunks every 8 chunks,
which `megalab.long_context` offers as an option (`norm_refresh_after`, off by default) through
`refresh_norm_state`. Chunk parallelism passes each block's state and the final norm's
statistics (and their gradients) between ranks (`carried_modules`).

The classifier variant (`causal=False`, the paper's LRA, Speech Commands and ImageNet models;
no code was released for it) replaces every TimestepNorm by a group norm over the whole sequence
(`SequenceGroupNorm`, "standard group normalization", §4.5), runs CEMA bidirectionally (Mega's
encoder EMA: a second kernel set backwards in time) and attention without the causal mask.
`drop_path` (stochastic depth on both branches, linear over depth) serves the ImageNet recipe.

Padding (mask False) is excluded from every statistic, CEMA input and attention key, so real
outputs do not depend on it; padded outputs are zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch.nn.functional as F
from torch import Tensor, nn

from megalab.models.base import Backbone, BackboneConfig, BackboneOutput
from megalab.models.megalodon.cema import CEMAState, ComplexEMA
from megalab.models.megalodon.normalized_attention import NormalizedAttention
from megalab.models.megalodon.timestep_norm import (
    SequenceGroupNorm,
    TimestepNorm,
    TimestepNormState,
)
from megalab.models.stack import run_stack
from megalab.nn.attention import KVCache
from megalab.nn.ffn import NormalizedFFN, gated
from megalab.nn.linear import joint_linear
from megalab.nn.norms import PlusOneLayerNorm, PlusOneRMSNorm
from megalab.nn.regularization import DropPath, drop_path_rates
from megalab.nn.state import register_state
from megalab.utils.options import check_options, option, rate

NORM_TYPES = ("timestep", "group")


@register_state
@dataclass
class MegalodonLayerState:
    """What one causal layer carries: timestep-norm statistics, CEMA state, open-chunk KV."""

    norm: TimestepNormState
    cema: CEMAState
    kv: KVCache


@register_state
@dataclass
class MegalodonState:
    """Streaming state of a causal `Megalodon`: one state per layer and the final norm's
    statistics; batch is dim 0 throughout (`megalab.nn.state` detaches, moves, selects and
    saves it)."""

    layers: list[MegalodonLayerState]
    final_norm: TimestepNormState


@dataclass(frozen=True)
class MegalodonConfig(BackboneConfig):
    """Every option of a Megalodon backbone, each with its range and meaning."""

    d_model: int = option(1024, ge=1, doc="D, the feature width")
    num_layers: int = option(8, ge=1, doc="number of blocks")
    z_dim: int = option(256, ge=1, doc="S, the shared Q/K width")
    v_dim: int = option(2048, ge=1, doc="E, the value width")
    num_heads: int = option(1, ge=1, doc="H (S/H and E/H per head)")
    ffn_dim: int = option(2048, ge=1, doc="F, the FFN hidden width")
    swiglu: bool = option(False, doc="SwiGLU FFN (fc1, fc3, fc2) instead of SiLU(fc1) -> fc2")
    cema_dim: int = option(16, doc="N, CEMA state dimensions per channel")
    chunk_size: int = option(
        2048, ge=1, also={-1: "no chunking"}, doc="attention chunk c (-1: full attention)"
    )
    norm_groups: int = option(32, doc="G of the timestep/group norms")
    norm_eps: float = option(1e-5, doc="ε of every norm")
    # A learned mean and log-variance worth c₀ steps (`megalab.models.megalodon.timestep_norm`).
    norm_prior_count: int = option(
        0, doc="c₀ > 0: the timestep norms' learnable prior (the code's); 0 (every preset): none"
    )
    norm_type: str | None = option(
        None, choices=NORM_TYPES, doc="timestep | group (None: timestep if causal, else group)"
    )
    rope_base: float = option(10000.0, doc="RoPE base (1e4; the paper's 7B: 1e5)")
    causal: bool = option(True, doc="decoder (True) or encoder (False)")
    dropout: float = rate(0.0, doc="on both branch outputs")
    attention_dropout: float = rate(0.0, doc="the DropKey rate")
    hidden_dropout: float = rate(0.0, doc="on X'', on Γ ⊙ O and on the FFN hidden layer")
    drop_path: float = option(
        0.0, doc="stochastic depth of the last block (block i of n: drop_path · i / (n − 1))"
    )

    def __post_init__(self) -> None:
        check_options(self)
        norm = self.resolved_norm_type
        if self.causal and norm == "group":
            raise ValueError(
                "norm_type='group' takes its statistics over the whole sequence, so a causal "
                "model would see the future: use norm_type='timestep' with causal=True"
            )
        if self.norm_prior_count and norm != "timestep":
            raise ValueError(
                "norm_prior_count is the learned prior of the timestep norm; the group norm has "
                "none (use norm_type='timestep' or norm_prior_count=0)"
            )
        if self.d_model % self.norm_groups:
            raise ValueError(
                f"d_model={self.d_model} must be a multiple of norm_groups={self.norm_groups}"
            )

    @property
    def resolved_norm_type(self) -> str:
        """TimestepNorm for causal models, group norm for classifiers unless set."""
        if self.norm_type is not None:
            return self.norm_type
        return "timestep" if self.causal else "group"

    def build(self) -> Megalodon:
        """The `Megalodon` this config describes."""
        return Megalodon(self)


def _he_init(linear: nn.Linear) -> None:
    """The code's `init_mode='he'`: kaiming-normal with a = √5 (std 1/√(3·fan_in)), bias 0."""
    nn.init.kaiming_normal_(linear.weight, a=math.sqrt(5.0))
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def _norm(cfg: MegalodonConfig) -> TimestepNorm | SequenceGroupNorm:
    if cfg.resolved_norm_type == "timestep":
        return TimestepNorm(
            cfg.d_model, cfg.norm_groups, eps=cfg.norm_eps, prior_count=cfg.norm_prior_count
        )
    return SequenceGroupNorm(cfg.d_model, cfg.norm_groups, eps=cfg.norm_eps)


class MegalodonAttention(nn.Module):
    """The gated-attention sub-layer (the code's `MovingAverageGatedAttention`): X -> Ŷ.

    `drop_path` is this layer's stochastic-depth rate on its branch.
    """

    def __init__(self, cfg: MegalodonConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        D, S, E = cfg.d_model, cfg.z_dim, cfg.v_dim
        self.norm = _norm(cfg)
        self.cema = ComplexEMA(D, cfg.cema_dim, bidirectional=not cfg.causal)
        self.cema_norm = PlusOneRMSNorm(D, eps=cfg.norm_eps)
        self.wz = nn.Linear(D, S)
        self.wv = nn.Linear(D, E)
        self.wr = nn.Linear(D, E)
        self.wh1 = nn.Linear(D, D)
        self.wh2 = nn.Linear(E, D, bias=False)
        self.attention = NormalizedAttention(
            S,
            E,
            num_heads=cfg.num_heads,
            chunk_size=cfg.chunk_size,
            rope_base=cfg.rope_base,
            causal=cfg.causal,
            dropout=cfg.attention_dropout,
            eps=cfg.norm_eps,
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The code's init: linears kaiming-normal (a = √5) with zero biases."""
        for lin in (self.wz, self.wv, self.wr, self.wh1, self.wh2):
            _he_init(lin)

    def initial_state(self, batch_size: int, like: Tensor) -> MegalodonLayerState:
        """Empty statistics, a zero CEMA state and an empty key/value cache."""
        att = self.attention
        H = att.num_heads
        kv = KVCache(like.new_zeros(batch_size, 0, H, att.head_dim),
                     like.new_zeros(batch_size, 0, H, att.v_dim // H), None)  # fmt: skip
        norm = self.norm
        if not isinstance(norm, TimestepNorm):
            raise ValueError("only a TimestepNorm model carries a streaming state")
        return MegalodonLayerState(
            norm.initial_state(batch_size, like), self.cema.initial_state(batch_size, like), kv
        )

    def forward(
        self, x: Tensor, mask: Tensor | None = None, state: MegalodonLayerState | None = None
    ) -> tuple[Tensor, MegalodonLayerState | None]:
        """x (B, L, D), mask (B, L) True at real tokens -> (Ŷ (B, L, D), new state or None)."""
        X_hat, norm_state = self.norm(x, mask, None if state is None else state.norm)
        X_prime, cema_state = self.cema(X_hat, mask, None if state is None else state.cema)
        X2 = self.hidden_dropout(self.cema_norm(X_prime))  # X'': RMSNorm on the CEMA output
        # the three products of X'' as one GEMM: one bf16 copy of X'' kept under autocast, where
        # separate projections would keep one each (worth the unkept H1 the joined output holds)
        Z, R, H1 = joint_linear(X2, self.wz, self.wr, self.wh1)
        V = F.silu(self.wv(X_hat))
        O, kv = self.attention(  # noqa: E741
            Z, V, mask, None if state is None else state.kv, return_cache=state is not None
        )
        Gamma_O = gated(F.silu, R, O)  # Γ ⊙ O, Γ = SiLU(R) recomputed in the backward, not kept
        H = self.dropout(H1 + self.wh2(self.hidden_dropout(Gamma_O)))
        if self.drop_path is not None:
            H = self.drop_path(H)
        if state is None:
            return x + H, None
        return x + H, MegalodonLayerState(norm_state, cema_state, kv)


class NormalizedFeedForward(NormalizedFFN):
    """The FFN sub-layer (the code's `NormalizedFeedForwardNetwork`): LayerNorm (plus-1) ->
    SwiGLU or SiLU MLP (no biases) -> + the residual the block passes (its input X):
    `forward(y, residual=x)` gives X + FFN(LayerNorm(Ŷ)), the two-hop residual."""

    def __init__(self, cfg: MegalodonConfig, drop_path: float = 0.0) -> None:
        super().__init__(
            cfg.d_model,
            cfg.ffn_dim,
            dropout=cfg.dropout,
            hidden_dropout=cfg.hidden_dropout,
            activation="silu",
            norm=PlusOneLayerNorm(cfg.d_model, eps=cfg.norm_eps),
            gated=cfg.swiglu,
            bias=False,
            drop_path=drop_path,
        )

    def reset_parameters(self) -> None:
        """The code's init: kaiming-normal (a = √5) linears."""
        for lin in self.linears():
            _he_init(lin)


class MegalodonBlock(nn.Module):
    """One Megalodon layer: Ŷ = X + Attn(X), Y = X + FFN(Ŷ) (the code's `MegaBlock`)."""

    def __init__(self, cfg: MegalodonConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        self.attn = MegalodonAttention(cfg, drop_path=drop_path)
        self.ffn = NormalizedFeedForward(cfg, drop_path=drop_path)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, state: MegalodonLayerState | None = None
    ) -> tuple[Tensor, MegalodonLayerState | None]:
        y, state = self.attn(x, mask, state)
        return self.ffn(y, residual=x), state


class Megalodon(Backbone):
    """The Megalodon backbone: blocks and a final norm, (B, L, D) -> (B, L, D).

    Causal language model (`causal=True`: TimestepNorm, causal CEMA and attention, streaming
    state) or classifier encoder (`causal=False`: group norm over the sequence, bidirectional
    CEMA, unmasked attention). The code's presets are configs: `model=megalodon/mega7.3B` etc.
    """

    config: MegalodonConfig
    block_class = MegalodonBlock

    def __init__(self, config: MegalodonConfig | None = None) -> None:
        super().__init__(cfg := config or MegalodonConfig())
        rates = drop_path_rates(cfg.drop_path, cfg.num_layers)
        self.layers = nn.ModuleList(MegalodonBlock(cfg, drop_path=r) for r in rates)
        self.final_norm = _norm(cfg)

    def initial_state(self, batch_size: int, like: Tensor) -> MegalodonState:
        """The start of a stream: empty statistics, zero CEMA states, empty KV caches."""
        self.check_streamable()  # a causal Megalodon has timestep norms (its config checks)
        return MegalodonState(
            [
                cast(MegalodonBlock, layer).attn.initial_state(batch_size, like)
                for layer in self.layers
            ],
            cast(TimestepNorm, self.final_norm).initial_state(batch_size, like),
        )

    def carried_modules(self) -> list[nn.Module]:
        """The sub-modules that carry state along time, in order (chunk parallelism hook,
        `megalab.parallel.chunk`): the blocks (each `m(x, mask, state) -> (y, state)` with its
        timestep-norm statistics, CEMA state h and open-chunk keys/values) and the final
        timestep norm (its statistics). What crosses a rank boundary is exactly what the
        authors' chunk parallelism sends (the CEMA h and the norm statistics), plus the keys and
        values of a chunk left open at the boundary when a slice does not end on one."""
        self.initial_state(1, next(self.parameters()))  # raises for a bidirectional model
        return [*self.layers, self.final_norm]

    def refresh_norm_state(self, state: MegalodonState, fresh: MegalodonState) -> MegalodonState:
        """`state` with every timestep-norm statistic (each layer's and the final norm's)
        replaced by `fresh`'s; CEMA states and key/value caches are kept.

        The authors' long-document evaluation (`inference.py`, TRUNCATE_CHUNKS = 8: once the
        statistics cover 8 chunks they are re-estimated by a pass over the last 6 chunks from a
        fresh state and swapped into every layer's cache and the final norm; not in the paper,
        docs/reference/megalodon-code.md §4.10). `megalab.long_context.score_stream` runs the fresh
        pass (`norm_refresh_after`, `norm_refresh_window`; off by default) and calls this.
        """
        if not isinstance(state, MegalodonState) or not isinstance(fresh, MegalodonState):
            raise TypeError(
                "refresh_norm_state takes two MegalodonState (the carried state and the state "
                f"of a fresh pass), got {type(state).__name__} and {type(fresh).__name__}"
            )
        if len(state.layers) != len(fresh.layers):
            raise ValueError(
                f"the fresh state has {len(fresh.layers)} layers, the carried one "
                f"{len(state.layers)}: both must come from this model"
            )
        layers = [
            MegalodonLayerState(new.norm, old.cema, old.kv)
            for old, new in zip(state.layers, fresh.layers, strict=True)
        ]
        return MegalodonState(layers, fresh.final_norm)

    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, state: MegalodonState | None = None
    ) -> BackboneOutput:
        """x (B, L, D), mask (B, L) bool True at real tokens, state from the previous segment.

        Returns y (B, L, D) with zeros at padded positions and, when a state was passed, the
        state to pass with the next segment. The blocks and the final norm run in the shared
        stack (`megalab.models.stack`).
        """
        self.check_input(x, mask, state)
        # The final norm carries statistics of its own: it runs as the last carried module.
        states = None if state is None else [*state.layers, state.final_norm]
        out = run_stack([*self.layers, self.final_norm], x, mask, states)
        if out.states is None:
            return BackboneOutput(out.y)
        return BackboneOutput(out.y, MegalodonState(out.states[:-1], out.states[-1]))
