"""Mega: Moving Average Equipped Gated Attention (Ma et al., ICLR 2023), exact to the authors' code.

One Mega block is a MAGA sub-layer (eqs. 6-15) followed by a normalized FFN (eq. 21):

    X' = SiLU(EMA(X) + ω ⊙ X)          EMA sub-layer (the code adds ω and SiLU to eq. 6)
    Z  = SiLU(X' W_z + b_z)                                                     (7)
    Q  = κ_q ⊙ Z + μ_q,  K = κ_k ⊙ Z + μ_k                                    (8, 9)
    V  = act(X W_v + b_v)                     from X (the normed input), not X' (10)
    O  = f(Q Kᵀ / τ + b_rel) V                within chunks                     (11)
    γ  = SiLU(X' W_γ + b_γ)                   reset gate                        (12)
    φ  = sigmoid(X' W_φ + b_φ)                update gate                       (13)
    Ĥ  = act(X' W_h + (γ ⊙ O) U_h + b_h)                                        (14)
    Y  = φ ⊙ Ĥ + (1 − φ) ⊙ X                  X un-normalised                   (15)

W_φ, W_z, W_γ and W_h form one fused projection (`mx_proj`) of X', split as [φ | Z, γ | X'W_h]
like the code. Pre-norm normalises the inputs of V and the EMA only, and the backbone then ends
with a final norm; post-norm normalises Y. Dropouts as in the code: `dropout` on X', on Ĥ and on
the FFN output; `hidden_dropout` on V; `attention_dropout` on the attention weights;
`activation_dropout` on the FFN hidden layer. Every linear is N(0, 0.02) with zero bias; κ is
N(0, 0.02) and μ is 0.

The backbone is batch-first, `mask` is True at real tokens, and padded outputs are zeroed.
A causal model streams: `state` holds per layer the EMA hidden state (B, D, h) and the keys,
values (and key mask) of the chunk still open, which is dropped at every chunk boundary as in
the code's incremental decoding; feeding a sequence segment by segment gives the outputs of one
pass (with `truncation` set, only while the whole stream fits in the truncation window, since
streaming uses the exact recurrence as the code does).

Options of the authors' ImageNet model (mega-image repo, `VisionMEGA`), all off by default:
`ema_shift` (the backward EMA starts at x_{t+1}, see `megalab.nn.ema`), `drop_path`
(stochastic depth on both sub-layers, linear over depth), `positions="learned"` (a learned
absolute position table added to the input) and `output_proj` (SiLU(Linear(D, D)) after the
final norm, before pooling). Following that code, DropPath acts on Ĥ *before* the gated
residual: Y = X + φ ⊙ (DropPath(Ĥ) − X), so a dropped MAGA gives (1 − φ) ⊙ X, not X; on the
FFN it acts on the branch before its plain residual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.models.base import Backbone, BackboneConfig, BackboneOutput
from megalab.models.stack import run_stack
from megalab.nn.attention import ChunkedAttention, KVCache
from megalab.nn.carried import CarriedLayer
from megalab.nn.ema import DampedEMA
from megalab.nn.ffn import NormalizedFFN, get_activation
from megalab.nn.norms import SequenceNorm
from megalab.nn.regularization import DropPath, drop_path_rates
from megalab.nn.state import register_state
from megalab.utils.options import check_options, option, rate

POSITIONS = ("none", "learned")


@register_state
@dataclass
class MAGAState:
    """Streaming state of one MAGA layer: EMA hidden state (B, D, h) and the open chunk's KV."""

    ema: Tensor
    kv: KVCache | None


@register_state
@dataclass
class MegaState:
    """Streaming state of a causal `Mega`: one `MAGAState` per layer; batch is dim 0 throughout.

    `megalab.nn.state` detaches, moves, selects (beam search) and saves it.
    """

    layers: list[MAGAState]


@dataclass(frozen=True)
class MegaConfig(BackboneConfig):
    """Every option of a Mega backbone: the object `Mega` takes and hands to its blocks.

    Each option is declared here once with its range and meaning;
    `drop_path` is the rate of the last block, and each block receives its own rate beside this
    config.
    """

    d_model: int = option(128, ge=1, doc="d, the feature width")
    num_layers: int = option(4, ge=1, doc="number of blocks")
    z_dim: int = option(64, ge=1, doc="z, the shared Q/K width")
    v_dim: int = option(256, ge=1, doc="v, the value width")
    ffn_dim: int = option(256, doc="d_FFN (<= 0: no FFN)", note=" (<= 0: no FFN)")
    ema_dim: int = option(
        16, ge=0, doc="h, the EMA expansion", note=" (0 removes the EMA: the h = 0 ablation)"
    )
    chunk_size: int = option(
        -1, ge=1, also={-1: "no chunking"}, doc="attention chunk c (-1: full attention)"
    )
    truncation: int | None = option(None, doc="EMA kernel length (None: no truncation)")
    attention_activation: str = option("softmax", doc="softmax | laplace | relu2")
    rel_pos_bias: str = option("simple", doc="simple | rotary")
    max_positions: int = option(
        1024, doc="size of the 'simple' bias when chunk_size = -1 (the longest input)"
    )
    norm_type: str = option(
        "layernorm", doc="layernorm | scalenorm | rmsnorm | batchnorm | syncbatchnorm"
    )
    prenorm: bool = option(
        True, doc="pre-norm blocks plus a final norm (True) or post-norm blocks (False)"
    )
    final_norm_affine: bool = option(True, doc="whether the final (pre-norm) norm is affine")
    norm_affine: bool = option(
        True, doc="whether the norms of the blocks (MAGA and FFN) are affine (the code's)"
    )
    # One difference remains with batch norm in training on padded text: the code's batch
    # statistics include the pad token's embedding, ours the encoder's zeroed pads.
    embed_norm: bool = option(
        False,
        doc="a `norm_type` norm on the input embeddings (the code's normalize_embedding); "
        "post-norm only",
    )
    # The authors' encoders apply their embedding dropout after that norm: for the same order
    # set this to the encoder's rate and the encoder's `dropout` to 0 (mega_kwargs_from_fairseq).
    embed_dropout: float = rate(0.0, doc="dropout after `embed_norm`")
    causal: bool = option(False, doc="decoder (True) or encoder (False)")
    dropout: float = rate(0.0, doc="on X', Ĥ and the FFN output")
    attention_dropout: float = rate(0.0, doc="on the attention weights")
    hidden_dropout: float = rate(0.0, doc="on V")
    activation_dropout: float = rate(0.0, doc="on the FFN hidden layer")
    activation: str = option("silu", doc="for V, Ĥ and the FFN: silu | gelu | gelu_accurate | relu")
    ema_shift: bool = option(
        False, doc="bidirectional EMAs whose backward kernel starts at x_{t+1} (mega-image)"
    )
    drop_path: float = option(
        0.0,
        doc="stochastic depth of the last block; block i of n gets drop_path · i / (n − 1) "
        "(mega-image)",
    )
    positions: str = option(
        "none",
        choices=POSITIONS,
        doc="'learned': a trunc-normal (max_len, D) table added to the input (mega-image)",
    )
    max_len: int | None = option(None, doc="rows of the learned position table (the input length)")
    output_proj: bool = option(
        False, doc="SiLU(Linear(D, D)) after the final norm (mega-image `out_proj`)"
    )
    checkpoint_activations: bool = option(
        False,
        doc="recompute each block in the backward: one (B, L, D) tensor per layer, ~1/3 more "
        "compute, same results",
    )
    attention_recompute: bool | None = option(
        None,
        doc="recompute the attention weights in the backward (None: for spans over 512 keys)",
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.positions == "learned" and not self.max_len:
            raise ValueError("learned positions need `max_len` (the input length)")
        if self.embed_norm and self.prenorm:
            raise ValueError(
                "embed_norm (the code's normalize_embedding) is for post-norm models only, as in "
                "the authors' code: set prenorm=False or embed_norm=False"
            )
        if self.embed_dropout and not self.embed_norm:
            raise ValueError(
                "embed_dropout only reorders the embedding dropout after embed_norm; without "
                "embed_norm put the dropout in the encoder (its `dropout`)"
            )

    def build(self) -> Mega:
        """The `Mega` this config describes."""
        return Mega(self)


class MovingAverageGatedAttention(CarriedLayer[MAGAState]):
    """The MAGA sub-layer (Mega eqs. 6-15) on (B, L, D) tensors.

    Built from a `MegaConfig` (d_model d, z_dim z, v_dim v, ema_dim h, chunk_size c, ...; its
    fields document them); `drop_path` is this layer's stochastic-depth rate on Ĥ, before the
    gated residual (mega-image).
    """

    def __init__(self, cfg: MegaConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        d_model, z_dim, v_dim = cfg.d_model, cfg.z_dim, cfg.v_dim
        self.d_model, self.z_dim, self.v_dim = d_model, z_dim, v_dim
        self.prenorm = cfg.prenorm
        self.causal = cfg.causal
        self.act = get_activation(cfg.activation)
        self.norm = SequenceNorm(cfg.norm_type, d_model, affine=cfg.norm_affine)
        self.ema = DampedEMA(
            d_model,
            cfg.ema_dim,
            bidirectional=not cfg.causal,
            truncation=cfg.truncation,
            shift=cfg.ema_shift,
        )
        self.v_proj = nn.Linear(d_model, v_dim)
        self.mx_proj = nn.Linear(d_model, z_dim + v_dim + 2 * d_model)
        self.h_proj = nn.Linear(v_dim, d_model)
        # κ_q, κ_k (rows 0, 1) and μ_q, μ_k: per-dimension scale and offset of Z (eqs. 8, 9).
        self.kappa = nn.Parameter(torch.empty(2, z_dim))
        self.mu = nn.Parameter(torch.empty(2, z_dim))
        self.attention = ChunkedAttention(
            z_dim,
            chunk_size=cfg.chunk_size,
            attention_activation=cfg.attention_activation,
            rel_pos_bias=cfg.rel_pos_bias,
            max_positions=cfg.max_positions,
            causal=cfg.causal,
            dropout=cfg.attention_dropout,
            recompute=cfg.attention_recompute,
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The authors' init: linears N(0, 0.02) with zero bias, κ ~ N(0, 0.02), μ = 0."""
        for lin in (self.v_proj, self.mx_proj, self.h_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=0.02)
            nn.init.zeros_(lin.bias)
        nn.init.normal_(self.kappa, mean=0.0, std=0.02)
        nn.init.zeros_(self.mu)

    def initial_state(self, batch_size: int, like: Tensor) -> MAGAState:
        """An empty streaming state (zero EMA state, empty key/value cache)."""
        B = batch_size
        return MAGAState(
            self.ema.initial_state(B, like),
            KVCache(like.new_zeros(B, 0, self.z_dim), like.new_zeros(B, 0, self.v_dim), None),
        )

    def advance(
        self, x: Tensor, mask: Tensor | None, state: MAGAState | None, want_state: bool
    ) -> tuple[Tensor, MAGAState | None]:
        """Y of eqs. 6-15 (see the module docstring); the state is the EMA's hidden state and
        the keys and values of the attention chunk left open."""
        D, S, E = self.d_model, self.z_dim, self.v_dim
        residual = x
        X = self.norm(x) if self.prenorm else x
        V = self.hidden_dropout(self.act(self.v_proj(X)))  # (10)
        X_prime, ema_state = self.ema(  # (6)
            X, mask, None if state is None else state.ema, return_state=want_state
        )
        X_prime = self.dropout(X_prime)
        u, zr, hx = torch.split(self.mx_proj(X_prime), [D, S + E, D], dim=-1)
        phi = torch.sigmoid(u)  # (13) update gate φ
        Z, gamma = torch.split(F.silu(zr), [S, E], dim=-1)  # (7), (12) reset gate γ
        Q = Z * self.kappa[0] + self.mu[0]  # (8)
        K = Z * self.kappa[1] + self.mu[1]  # (9)
        O, kv = self.attention(  # noqa: E741  (11)
            Q, K, V, mask, None if state is None else state.kv, return_cache=want_state
        )
        H_hat = self.dropout(self.act(hx + self.h_proj(O * gamma)))  # (14)
        if self.drop_path is not None:
            # mega-image: stochastic depth on Ĥ inside the gated residual (not on Y − X).
            H_hat = self.drop_path(H_hat)
        Y = residual + phi * (H_hat - residual)  # (15)
        if not self.prenorm:
            Y = self.norm(Y)
        return Y, (MAGAState(ema_state, kv) if want_state else None)


def mega_ffn(cfg: MegaConfig, drop_path: float = 0.0) -> NormalizedFFN:
    """The normalized FFN of a Mega layer (eq. 21), with its stochastic-depth rate."""
    return NormalizedFFN(
        cfg.d_model,
        cfg.ffn_dim,
        dropout=cfg.dropout,
        hidden_dropout=cfg.activation_dropout,
        activation=cfg.activation,
        norm_type=cfg.norm_type,
        prenorm=cfg.prenorm,
        norm_affine=cfg.norm_affine,
        drop_path=drop_path,
    )


class MegaBlock(CarriedLayer[MAGAState]):
    """One Mega layer: MAGA followed by the normalized FFN (skipped when ffn_dim <= 0).

    `drop_path` is this layer's stochastic-depth rate, on both sub-layers (mega-image).
    """

    def __init__(self, cfg: MegaConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        self.causal = cfg.causal
        self.maga = MovingAverageGatedAttention(cfg, drop_path=drop_path)
        self.ffn = mega_ffn(cfg, drop_path) if cfg.ffn_dim > 0 else None

    def advance(
        self, x: Tensor, mask: Tensor | None, state: MAGAState | None, want_state: bool
    ) -> tuple[Tensor, MAGAState | None]:
        """(B, L, D) -> (B, L, D), plus the MAGA streaming state."""
        x, state = self.maga(x, mask, state, want_state)
        if self.ffn is not None:
            x = self.ffn(x)
        return x, state


class Mega(Backbone):
    """The Mega backbone: a stack of `MegaBlock`s, (B, L, D) -> (B, L, D).

    Bidirectional encoder (`causal=False`: bidirectional EMA, no attention mask; classification)
    or causal decoder (`causal=True`: causal EMA and chunk-local causal attention; language
    modelling with streaming state). Pre-norm adds a final norm after the last block
    (`final_norm_affine=False` makes it non-affine, as the authors' LM).

    The authors' ImageNet model (mega-image `VisionMEGA`) is this backbone with
    `ema_shift=True, drop_path=0.2, positions="learned", max_len=196, output_proj=True`
    between a patch `FeatureEmbedding` and mean pooling + a Linear head.
    """

    config: MegaConfig
    block_class = MegaBlock

    def __init__(self, config: MegaConfig | None = None) -> None:
        super().__init__(cfg := config or MegaConfig())
        self.positions = cfg.positions
        self.drop_path_rates = drop_path_rates(cfg.drop_path, cfg.num_layers)
        self.layers = nn.ModuleList(MegaBlock(cfg, drop_path=r) for r in self.drop_path_rates)
        self.final_norm = (
            SequenceNorm(cfg.norm_type, cfg.d_model, affine=cfg.final_norm_affine)
            if cfg.prenorm
            else None
        )
        self.embed_norm = SequenceNorm(cfg.norm_type, cfg.d_model) if cfg.embed_norm else None
        self.embed_dropout = nn.Dropout(cfg.embed_dropout) if cfg.embed_dropout > 0 else None
        self.pos_embed: nn.Parameter | None = None
        if cfg.positions == "learned" and cfg.max_len:
            # timm's trunc_normal_(std=D^-1/2) as mega-image: cut at ±2 absolute (~55σ at D=768).
            self.pos_embed = nn.Parameter(torch.empty(cfg.max_len, cfg.d_model))
            nn.init.trunc_normal_(self.pos_embed, mean=0.0, std=cfg.d_model**-0.5, a=-2.0, b=2.0)
        self.out_proj: nn.Linear | None = None
        if cfg.output_proj:
            self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)
            nn.init.normal_(self.out_proj.weight, mean=0.0, std=0.02)
            nn.init.zeros_(self.out_proj.bias)

    @property
    def max_len(self) -> int | None:
        """Longest input (for a causal stream: total length) the model takes; None: unlimited.

        The smaller of the 'simple' bias limit (full attention) and the position table.
        """
        limits = [] if self.pos_embed is None else [self.pos_embed.shape[0]]
        first = cast(MegaBlock, self.layers[0]) if len(self.layers) else None
        if first is not None and first.maga.attention.max_len is not None:
            limits.append(first.maga.attention.max_len)
        return min(limits) if limits else None

    def state_length(self, state: MegaState) -> int:
        """Tokens of the open chunk (with full attention: the whole stream so far)."""
        if state.layers and state.layers[0].kv is not None:
            return state.layers[0].kv.key.shape[1]
        return 0

    def length_advice(self) -> str:
        if self.pos_embed is not None and self.pos_embed.shape[0] == self.max_len:
            return " (the learned position table): raise max_len or shorten the input"
        return (
            " (max_positions of the 'simple' relative position bias with full attention, "
            "chunk_size=-1): raise max_positions, set chunk_size > 0, or use "
            "rel_pos_bias='rotary'"
        )

    def initial_state(self, batch_size: int, like: Tensor) -> MegaState:
        """An empty streaming state; passing it makes every segment use the exact recurrence."""
        self.check_streamable()
        blocks = cast(list[MegaBlock], list(self.layers))
        return MegaState([blk.maga.initial_state(batch_size, like) for blk in blocks])

    def carried_modules(self) -> list[nn.Module]:
        """The sub-modules that carry state along time, in order (chunk parallelism hook,
        `megalab.parallel.chunk`): the blocks, each called as `m(x, mask, state, ...)` and
        returning `(y, new_state)` (EMA state and the open chunk's keys/values)."""
        self.check_streamable()
        return list(self.layers)

    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, state: MegaState | None = None
    ) -> BackboneOutput:
        """x (B, L, D), mask (B, L) bool True at real tokens, state from the previous segment.

        Returns y (B, L, D) with zeros at padded positions and the state to pass with the next
        segment. A stream starts from `initial_state`; without a state the pass is stateless
        and returns none, which spares the state reduction in stateless training. After the
        input step (positions, `embed_norm`) the blocks run in the shared stack
        (`megalab.models.stack`).
        """
        self.check_input(x, mask, state)
        if self.pos_embed is not None:
            if state is not None:
                raise ValueError(
                    "learned absolute positions are not defined for a streamed input (the "
                    "state does not count the tokens seen); use positions='none' to stream"
                )
            x = x + self.pos_embed[: x.shape[1]].to(x.dtype)
        if self.embed_norm is not None:
            # The code's normalize_embedding: Norm(embedding), then its embedding dropout.
            x = self.embed_norm(x)
        out = run_stack(
            self.layers,
            x,
            mask,
            None if state is None else state.layers,
            input_dropout=self.embed_dropout,
            final=self._output,
            checkpoint=self.config.checkpoint_activations,
            return_state=state is not None,
        )
        return BackboneOutput(out.y, None if out.states is None else MegaState(out.states))

    def _output(self, x: Tensor) -> Tensor:
        """After the last block: the final norm (pre-norm) and mega-image's output projection."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.out_proj is not None:
            x = F.silu(self.out_proj(x))
        return x
