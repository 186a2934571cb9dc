"""S4D baseline: the S4 repository's residual block around a diagonal state space layer.

S4D (Gu et al., "On the Parameterization and Initialization of Diagonal State Space Models",
NeurIPS 2022) with the residual block the S4 repository (state-spaces/s4) trains on LRA and
Speech Commands (docs/reference/s4-code.md). One block, on x (B, L, D):

    z = Norm(x)                        pre-norm (post-norm: z = x)
    u = 𝒦 * z̃ + D ⊙ z                  the S4D layer, per channel (z̃: padded positions zeroed)
    v = Dropout(GELU(u))
    w = (v W_a + b_a) ⊙ σ(v W_b + b_b)   GLU output linear (the repository's `final_act: glu`)
    y = x + Dropout(w)                 post-norm: y = Norm(x + Dropout(w))

and a pre-norm stack ends with a final Norm. Norm is BatchNorm (statistics over batch × time)
or LayerNorm. The kernel 𝒦 of channel d is the zero-order-hold discretisation of
x'(t) = A x(t) + B u(t), y = Re(C x) with B = 1 over N/2 complex modes (conjugate pairs):

    𝒦[d, l] = 2 Re( Σ_n C_{d,n} · (exp(Δ_d A_{d,n}) − 1) / A_{d,n} · exp(Δ_d A_{d,n})^l )

(`megalab.nn.s4d.S4D`, shared with SeqBoat's S4D ablation). S4D-Lin initialisation:
A = −½ + iπn, log Δ ~ U(log Δ_min, log Δ_max), C ~ CN(0, 1), D ~ N(0, 1). The output linear is
PyTorch's default Linear init (as the repository's Conv1d with kernel size 1).

Bidirectional (an encoder): a second kernel 𝒦_bwd runs backwards in time starting at the next
token, as the repository's convolution with the flipped second channel:

    u_t = Σ_{m≥0} 𝒦[m] z̃_{t−m} + Σ_{m≥0} 𝒦_bwd[m] z̃_{t+1+m} + D ⊙ z_t

Where this differs from the repository: the backward direction has its own A and Δ besides its
C (the repository shares A and Δ between directions); the repository's LRA configs use the
NPLR S4 kernel, this baseline its diagonal S4D form. Unidirectional (`bidirectional=False`) the
model is causal and streams: the state is each layer's (B, D, N/2) complex SSM state, and
segment by segment equals one pass (with pre- or post-norm BatchNorm in eval mode only, whose
statistics are then fixed).

Dropout: `dropout` after the GELU and on the block's output, each with its own mask; with
`dropout_tied` one mask per sequence and channel, shared over time (the repository's DropoutNd).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.models.base import Backbone, BackboneConfig, BackboneOutput
from megalab.models.stack import run_stack
from megalab.nn.carried import CarriedLayer
from megalab.nn.norms import SequenceNorm
from megalab.nn.s4d import S4D
from megalab.nn.state import register_state
from megalab.utils.options import check_options, option, rate

NORM_TYPES = ("batchnorm", "layernorm")


@register_state
@dataclass
class S4DState:
    """Streaming state of a causal `S4DBackbone`: one (B, D, N/2) complex SSM state per layer."""

    layers: list[Tensor]


@dataclass(frozen=True)
class S4DConfig(BackboneConfig):
    """Every option of an S4D backbone (the object `S4DBackbone` takes), each with its range and
    meaning; built once and handed to the blocks."""

    d_model: int = option(256, ge=1, doc="D, the feature width (the repository's d_model, H)")
    num_layers: int = option(6, ge=1, doc="number of blocks")
    state_dim: int = option(
        64, doc="N, the real SSM state size per channel (N/2 complex modes; d_state)"
    )
    bidirectional: bool = option(
        True, doc="a backward kernel as well (encoders); False: causal, and streams"
    )
    norm_type: str = option("batchnorm", choices=NORM_TYPES, doc="batchnorm | layernorm")
    prenorm: bool = option(
        True,
        doc="normalise each block's input and add a final norm (True), or each block's output",
    )
    dropout: float = rate(
        0.0, doc="after the GELU and on the block output (the repository's model dropout)"
    )
    dropout_tied: bool = option(
        False, doc="one dropout mask per sequence and channel, shared over time"
    )
    dt_min: float = option(1e-3, gt=0.0, doc="smallest initial step size Δ (log-uniform)")
    dt_max: float = option(1e-1, gt=0.0, doc="largest initial step size Δ (log-uniform)")

    def __post_init__(self) -> None:
        check_options(self)
        if self.state_dim < 2 or self.state_dim % 2:
            raise ValueError(
                f"state_dim is N, the real state size of N/2 conjugate pairs: set an even "
                f"state_dim >= 2, got {self.state_dim}"
            )
        if not self.dt_min <= self.dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")

    @property
    def causal(self) -> bool:
        """Without the backward kernel S4D is causal, and streams."""
        return not self.bidirectional

    def build(self) -> S4DBackbone:
        """The `S4DBackbone` this config describes."""
        return S4DBackbone(self)


class TiedDropout(nn.Dropout):
    """Dropout on (B, L, D) with one mask per (batch, channel) shared over time when `tied`
    (the S4 repository's DropoutNd), else ordinary dropout. An `nn.Dropout` (rate `p`), so
    code that finds dropout modules by type (the contract suite switches them off) sees it."""

    def __init__(self, p: float, tied: bool) -> None:
        super().__init__(p)
        self.tied = tied

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if not self.tied:
            return F.dropout(x, self.p, training=True)
        keep = torch.rand(x.shape[0], 1, x.shape[2], device=x.device) >= self.p
        return x * keep.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, tied={self.tied}"


class S4DBlock(CarriedLayer[Tensor]):
    """One residual block (see the module docstring): Norm, S4D, GELU, dropout, GLU, residual."""

    def __init__(self, cfg: S4DConfig) -> None:
        super().__init__()
        self.causal = cfg.causal
        D = cfg.d_model
        self.prenorm = cfg.prenorm
        self.norm = SequenceNorm(cfg.norm_type, D)
        self.ssm = S4D(
            D,
            cfg.state_dim,
            bidirectional=cfg.bidirectional,
            dt_min=cfg.dt_min,
            dt_max=cfg.dt_max,
            shift=cfg.bidirectional,
            silu=False,
        )
        self.dropout = TiedDropout(cfg.dropout, cfg.dropout_tied)
        self.output_linear = nn.Linear(D, 2 * D)  # [W_a | W_b] of the GLU
        self.out_dropout = TiedDropout(cfg.dropout, cfg.dropout_tied)

    def initial_state(self, batch_size: int, like: Tensor) -> Tensor:
        """A zero (B, D, N/2) complex SSM state."""
        return self.ssm.initial_state(batch_size, like)

    def advance(
        self, x: Tensor, mask: Tensor | None, state: Tensor | None, want_state: bool
    ) -> tuple[Tensor, Tensor | None]:
        """y = x + Dropout(GLU(Dropout(GELU(S4D(z))))), z = Norm(x) (post-norm: z = x and y is
        normalised); the state is the S4D layer's (B, D, N/2) complex SSM state."""
        z = self.norm(x) if self.prenorm else x
        u, new_state = self.ssm(z, mask, state, return_state=want_state)
        v = self.dropout(F.gelu(u))
        w = F.glu(self.output_linear(v), dim=-1)
        y = x + self.out_dropout(w)
        if not self.prenorm:
            y = self.norm(y)
        return y, new_state


class S4DBackbone(Backbone):
    """A stack of `S4DBlock`s, (B, L, D) -> (B, L, D); pre-norm stacks end with a final norm."""

    config: S4DConfig
    block_class = S4DBlock
    causal_option = "bidirectional=False"

    def __init__(self, config: S4DConfig | None = None) -> None:
        super().__init__(cfg := config or S4DConfig())
        self.layers = nn.ModuleList(S4DBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = SequenceNorm(cfg.norm_type, cfg.d_model) if cfg.prenorm else None

    def initial_state(self, batch_size: int, like: Tensor) -> S4DState | None:
        """Zero SSM states for a stream (causal only); None for a bidirectional model."""
        if not self.causal:
            return None
        blocks = cast(list[S4DBlock], list(self.layers))
        return S4DState([blk.initial_state(batch_size, like) for blk in blocks])

    def carried_modules(self) -> list[nn.Module] | None:
        """The blocks, each carrying its SSM state (chunk parallelism); None when bidirectional."""
        return list(self.layers) if self.causal else None

    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, state: S4DState | None = None
    ) -> BackboneOutput:
        """x (B, L, D), mask (B, L) True at real tokens, state from the previous segment.

        Returns y (B, L, D), zero at padded positions, and (when a state is passed) the state
        to pass with the next segment. The blocks and the final norm run in the shared stack
        (`megalab.models.stack`).
        """
        self.check_input(x, mask, state)
        out = run_stack(
            self.layers, x, mask, None if state is None else state.layers, final=self.final_norm
        )
        return BackboneOutput(out.y, None if out.states is None else S4DState(out.states))
