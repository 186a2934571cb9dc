"""SeqBoat: Sparse Modular Activation (Ren et al., NeurIPS 2023), exact to the authors' code.

One SeqBoat layer (§3.3, App. A.2; the code's `SeqBoatUnit`, which calls it "slag"):

    X  = Norm(S) if pre-norm else S
    H  = SiLU(EMA(X̃) + ω ⊙ X)                     MD-EMA, bidirectional in encoders     (2)
    [u | H W + b] = H W_hx + b_hx                   one fused Linear: logits and bypass
    p  = softmax([u_skip + b_act, u_act] / τ),  a = argmax p,  c = a · max p     tempered softmax
    Hᶜ = Compress(H, a)                             the activated tokens, packed
    [Z | G | V] = SiLU(Hᶜ W_mx + b_mx)                                                 (5, 7)
    Q  = κ_q ⊙ Z + μ_q,  K = κ_k ⊙ Z + μ_k          the paper's w_q, b_q / w_k, b_k       (3, 4)
    O  = f(Q Kᵀ / s + B_rel) V                      within the working memory           (6)
    Y  = Extract((G ⊙ O) W_h + b_h, a)                                                  (8)
    S' = SiLU(c ⊙ Y + H W + b + S)                  post-norm: S' ← Norm(S')             (§3.3)

The router logits and the bypass H W + b share one Linear (`hx_proj`), V and the gate G come
from the EMA output (no `v_proj`), there is no update gate and no FFN, and the SiLU wraps the
residual stream in every layer: all as the code. Dropouts as the code: `dropout` on H, on the
GAU output inside the unit (bidirectional) or on H W + b + c ⊙ Y (causal), and on the
embedding; `hidden_dropout` on V; `attention_dropout` on the attention weights. Init as the code:
linears and κ TN(0, 0.02) (truncated at ±2σ), μ = 0, EMA logits TN(0, 0.2), β = ±1 + TN(0, 0.02),
η and ω TN(0, 1), θ_τ = log(α√d).

Where we follow the code rather than the paper (the code wins for exactness): the window counts
*packed* tokens, W on each side (the paper's w = 2W) or W past tokens (causal), and relu² divides
Q by the constant 2W (W causal); the 'simple' bias uses original positions; the EMA kernel is
truncated per task; the router has no Gumbel noise; the code skips packing for the whole batch
when one row is fully active, or in full mode 90% active (`always_compress`, below); pads never
activate but keep the code's deterministic junk inside the stack (ω ⊙ x, the bypass and the
residual see raw pads; without a configurator, `router="none"`, the GAU output too), and only
the backbone output is zeroed there (docs/fidelity.md, "Padded positions").

The backbone is batch-first, `mask` is True at real tokens. A causal SeqBoat streams: the state
holds per layer the EMA state (B, D, h) (with `truncation`: the last K − 1 EMA inputs, so that a
truncated kernel is exact across segments) and the GAU's working memory (the last W activated
tokens' keys, values and positions), so feeding a stream segment by segment gives exactly the
outputs of one pass (the paper's FIFO working memory of §3.3; the authors' code instead re-runs
the unit over a buffer of past EMA outputs).

Variants as configuration (Tables 7-8 and the model names of Table 1): SeqBoat
(`attention="local"`), SeqBoat-full (`attention="full"`), Always Activated (`router="none"`,
full), -local (`router="none"`), -chunk (`router="none", attention="chunk"`), -Gumbel /
-Sigmoid / -MoE (`router`), SSM with S4D (`ssm="s4d"`), -FFN (`ffn_dim > 0`), -{GAU,FFN}
(`ffn_dim > 0, ffn_mode="parallel"`: an FFN beside the GAU with its own configurator, M = 2),
-mem32 / -local32 (`chunk_size`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.models.base import Backbone, BackboneConfig, BackboneOutput
from megalab.models.seqboat.sma import (
    CompressedAttention,
    Packing,
    PositionwiseFFN,
    Router,
    Routing,
    WorkingMemory,
    build_router,
    pack,
    plan_packing,
    sinusoidal_positions,
    trunc_normal_,
    unpack,
)
from megalab.models.stack import run_stack
from megalab.nn.ema import DampedEMA
from megalab.nn.ffn import NormalizedFFN
from megalab.nn.norms import SequenceNorm
from megalab.nn.s4d import S4D
from megalab.nn.state import register_state
from megalab.utils.options import check_options, option, rate

SSMS = ("ema", "s4d")
POSITIONS = ("none", "sinusoidal")
FFN_MODES = ("after", "parallel")


@register_state
@dataclass
class SeqBoatLayerState:
    """Streaming state of one layer: the SSM's (EMA state (B, D, h), or the last K − 1 inputs
    (B, K − 1, D) of a kernel truncated to K taps) and the GAU's working memory."""

    ssm: Tensor
    memory: WorkingMemory


@register_state
@dataclass
class SeqBoatState:
    """Streaming state of a causal `SeqBoat`: one `SeqBoatLayerState` per layer and the number of
    tokens consumed (the original position of the next token)."""

    layers: list[SeqBoatLayerState]
    offset: int = 0


@dataclass(frozen=True)
class SeqBoatConfig(BackboneConfig):
    """Every option of a SeqBoat backbone, each with its range and meaning."""

    d_model: int = option(128, ge=1, doc="d_m, the feature width")
    num_layers: int = option(4, ge=1, doc="N, the number of layers")
    z_dim: int = option(64, ge=1, doc="d_z, the Q/K width")
    v_dim: int = option(256, ge=1, doc="d_v, the value/gate width")
    ema_dim: int = option(
        16,
        ge=0,
        doc="h, the EMA dimension (N of S4D)",
        note=" (0 removes the EMA: the h = 0 ablation)",
    )
    ssm: str = option("ema", choices=SSMS, doc="'ema' (MD-EMA) | 's4d' (Table 7's SSM with S4D)")
    truncation: int | None = option(None, doc="EMA kernel length (None: the whole sequence)")
    attention: str = option(
        "local", doc="'local' (working memory; SeqBoat) | 'full' (SeqBoat-full) | 'chunk'"
    )
    # The paper's working memory is w = 2W bidirectional, W causal.
    chunk_size: int = option(
        128,
        ge=1,
        also={-1: "no chunking"},
        doc="W, the one-sided window in packed tokens (the code's --chunk-size), or the chunk",
    )
    # Local laplace cannot stream: its masked look-around slots depend on block alignment.
    attention_activation: str = option("softmax", doc="softmax | relu2 | laplace")
    rel_pos_bias: str = option(
        "simple", doc="simple | rotary (RoPE on Q, K at original positions) | none"
    )
    local_pos: bool = option(
        False, doc="the 'simple' bias on offsets in the compressed sequence (Text, SC)"
    )
    max_positions: int = option(
        1024, doc="P of the 'simple' bias on original positions (edges replicated beyond)"
    )
    positions: str = option(
        "none",
        choices=POSITIONS,
        doc="'sinusoidal': the code's --add-apos, [sin | cos] times a learned scalar (d^-1/2)",
    )
    norm_type: str = option(
        "layernorm", doc="layernorm | scalenorm | rmsnorm | batchnorm | syncbatchnorm"
    )
    norm_affine: bool = option(True, doc="whether each layer's norm is affine (the unit's)")
    prenorm: bool = option(False, doc="pre-norm layers plus a final norm, or post-norm")
    final_norm_affine: bool = option(True, doc="whether the final (pre-norm) norm is affine")
    causal: bool = option(False, doc="decoder (True) or encoder (False)")
    # 'none': the GAU runs on every token (Always Activated, -local, -chunk); as the code's
    # --always-act, its output is added at padded positions too.
    router: str = option("softmax", doc="softmax (tempered) | gumbel | sigmoid | xmoe | none")
    init_temp_scale: float = option(1.0, doc="α, τ₀ = α√d")
    act_bias: float = option(
        0.0, doc="added to the skip logit (the code's --act-bias; > 0 favours sparsity)"
    )
    gumbel_tau: tuple[float, float, float] = option(
        (2.0, 0.5, 0.999995),
        doc="(τ'₀, τ'_min, decay per step) of the Gumbel router (paper: 2, 0.5, 0.999995)",
    )
    gumbel_hard: bool = option(
        False, doc="the Gumbel router's straight-through mode (the code's hard=True)"
    )
    # The code skips packing for the whole batch when one row activates all its L tokens (its
    # local window then counts original positions for the other rows), and in full mode when
    # one row activates 90% of them (only causal relu²/laplace, which divide by the query's
    # index + 1, see the difference). False follows the code; True always packs (rows
    # independent of their batch; a single-row batch is identical either way); None: False
    # for encoders, True for decoders, whose stream must equal one pass (the code's LM runs one
    # sequence per GPU, where both are the same).
    always_compress: bool | None = option(
        None, doc="pack even a fully activated row (None: for decoders only)"
    )
    ffn_dim: int = option(
        0, doc="> 0 adds an FFN (SeqBoat-FFN / {GAU,FFN})", note=" (<= 0: no FFN)"
    )
    ffn_mode: str = option(
        "after",
        choices=FFN_MODES,
        doc="'after' (Mega's normalized FFN after each layer) | 'parallel' (beside the GAU)",
    )
    dropout: float = rate(0.0, doc="on H, the GAU or layer branch and the FFN output")
    attention_dropout: float = rate(0.0, doc="on the attention weights")
    hidden_dropout: float = rate(0.0, doc="on V")
    activation_dropout: float = rate(0.0, doc="on the FFN hidden layer")
    input_dropout: float = rate(
        0.0, doc="on the input after the absolute positions (the code's embedding dropout)"
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.ffn_mode == "parallel" and self.ffn_dim <= 0:
            raise ValueError("ffn_mode='parallel' (SeqBoat-{GAU,FFN}) needs ffn_dim > 0")
        if self.ffn_mode == "parallel" and self.router == "none":
            raise ValueError(
                "ffn_mode='parallel' activates the FFN with its own configurator: it needs a "
                "router (router='none' always runs the GAU; use ffn_mode='after' for an FFN)"
            )
        if len(self.gumbel_tau) != 3:
            raise ValueError("gumbel_tau is (initial τ', minimum τ', decay per step)")
        if self.gumbel_hard and self.router != "gumbel":
            raise ValueError(
                f"gumbel_hard is the straight-through mode of router='gumbel'; router="
                f"{self.router!r} has no such mode (set router='gumbel' or gumbel_hard=False)"
            )

    @property
    def compress_always(self) -> bool:
        """Whether a full row still packs (see `SeqBoat`): by default decoders do."""
        return self.causal if self.always_compress is None else self.always_compress

    def build(self) -> SeqBoat:
        """The `SeqBoat` this config describes."""
        return SeqBoat(self)


@dataclass
class LayerReport:
    """What one layer reports: activation fraction, τ and mean attention span (scalars), and
    with `details` the per-token routing and the packed attention output (golden tests,
    analysis)."""

    activation: Tensor
    tau: Tensor | None
    span: Tensor
    ffn_activation: Tensor | None = None
    details: dict[str, Any] = field(default_factory=dict)


def _gumbel_tau(cfg: SeqBoatConfig) -> tuple[float, float, float]:
    """The Gumbel-softmax temperature schedule (start, end, decay): three numbers (checked)."""
    return cast("tuple[float, float, float]", tuple(cfg.gumbel_tau))


class SeqBoatLayer(nn.Module):
    """One SeqBoat layer (the code's `SeqBoatUnit`) on (B, L, D) tensors; see the module docstring.

    Parameter names: `norm`, `ssm` (DampedEMA: the code's `move`), `hx_proj`, `router.log_tau`
    (the code's `q_router.temp`), `mx_proj`, `kappa`/`mu` (the code's `gamma`/`beta`),
    `attention.rel_pos_bias.weight`, `h_proj`; `megalab.models.seqboat.convert` maps the code's
    names.
    """

    def __init__(self, cfg: SeqBoatConfig) -> None:
        super().__init__()
        D, Z, E = cfg.d_model, cfg.z_dim, cfg.v_dim
        self.d_model, self.z_dim, self.v_dim = D, Z, E
        self.prenorm = cfg.prenorm
        self.causal = cfg.causal
        self.act_bias = cfg.act_bias
        self.compress_always = cfg.compress_always
        self.norm = SequenceNorm(cfg.norm_type, D, affine=cfg.norm_affine)
        self.ssm: DampedEMA | S4D
        if cfg.ssm == "ema":
            self.ssm = DampedEMA(D, cfg.ema_dim, bidirectional=not cfg.causal,
                                 truncation=cfg.truncation)  # fmt: skip
        else:
            self.ssm = S4D(D, cfg.ema_dim, bidirectional=not cfg.causal, truncation=cfg.truncation)
        self.router = build_router(
            cfg.router, D, cfg.init_temp_scale, _gumbel_tau(cfg), cfg.gumbel_hard
        )
        n_logits = _n_logits(self.router)
        self.ffn_router: Router | None = None
        self.ffn: PositionwiseFFN | None = None
        if cfg.ffn_mode == "parallel":
            # SeqBoat-{GAU,FFN}: the FFN beside the GAU, with its own decisions (M = 2).
            self.ffn_router = build_router(
                cfg.router, D, cfg.init_temp_scale, _gumbel_tau(cfg), cfg.gumbel_hard
            )
            self.ffn = PositionwiseFFN(D, cfg.ffn_dim, cfg.activation_dropout)
        self.n_logits = n_logits
        n_ffn_logits = _n_logits(self.ffn_router)
        self.hx_proj = nn.Linear(D, n_logits + n_ffn_logits + D)
        self.mx_proj = nn.Linear(D, Z + 2 * E)
        self.h_proj = nn.Linear(E, D)
        self.kappa = nn.Parameter(torch.empty(2, Z))
        self.mu = nn.Parameter(torch.empty(2, Z))
        self.attention = CompressedAttention(
            Z,
            mode=cfg.attention,
            chunk_size=cfg.chunk_size,
            attention_activation=cfg.attention_activation,
            rel_pos_bias=cfg.rel_pos_bias,
            local_pos=cfg.local_pos,
            max_positions=cfg.max_positions,
            causal=cfg.causal,
            dropout=cfg.attention_dropout,
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The code's init: TN(0, 0.02) linears and κ, zero biases and μ; the EMA's TN init."""
        for lin in (self.hx_proj, self.mx_proj, self.h_proj):
            trunc_normal_(lin.weight, 0.02)
            nn.init.zeros_(lin.bias)
        trunc_normal_(self.kappa, 0.02)
        nn.init.zeros_(self.mu)
        if isinstance(self.ssm, DampedEMA):
            with torch.no_grad():
                # seqboat's exponential_moving_average.py: truncated normals (±2σ).
                trunc_normal_(self.ssm.alpha, 0.2)
                trunc_normal_(self.ssm.delta, 0.2)
                trunc_normal_(self.ssm.beta, 0.02).add_(self.ssm.beta_signs())
                trunc_normal_(self.ssm.eta, 1.0)
                trunc_normal_(self.ssm.omega, 1.0)
            self.ssm._spectrum.clear()

    # ------------------------------------------------------------------------------- streaming
    def initial_state(self, batch_size: int, like: Tensor) -> SeqBoatLayerState:
        """An empty streaming state (zero EMA state or zero input buffer, empty memory)."""
        B, D = batch_size, self.d_model
        trunc = self.ssm.truncation
        ssm = (
            like.new_zeros(B, trunc - 1, D) if trunc is not None
            else self.ssm.initial_state(B, like)
        )  # fmt: skip
        return SeqBoatLayerState(ssm, self.attention.empty_memory(B, like, self.v_dim))

    def _ssm(
        self, X: Tensor, mask: Tensor | None, state: Tensor | None, want_state: bool
    ) -> tuple[Tensor, Tensor | None]:
        """H = SiLU(EMA(X̃) + ω ⊙ X), continuing a stream when `state` is given.

        A truncated kernel (K taps) streams exactly by convolving [last K − 1 inputs, X]; an
        untruncated one carries the EMA's recurrent state.
        """
        trunc = self.ssm.truncation
        if not want_state or trunc is None:
            return self.ssm(X, mask, state, return_state=want_state)
        B, L, D = X.shape
        T = trunc - 1
        buffer = state if state is not None else X.new_zeros(B, T, D)
        m = torch.ones(B, L, dtype=torch.bool, device=X.device) if mask is None else mask
        ones = torch.ones(B, T, dtype=torch.bool, device=X.device)
        H, _ = self.ssm(torch.cat([buffer, X], 1), torch.cat([ones, m], 1))
        X_tilde = X * m.unsqueeze(-1).to(X.dtype)
        new_buffer = torch.cat([buffer, X_tilde], 1)[:, L:] if T else buffer
        return H[:, T:], new_buffer

    # --------------------------------------------------------------------------------- forward
    def _route(self, H: Tensor, u: Tensor, valid: Tensor, router: Router | None) -> Routing:
        if router is None:
            return Routing(valid, valid.to(H.dtype), None)
        return router(H, u, valid, self.act_bias)

    def _plan(self, routing: Routing, streaming: bool, always: bool) -> Packing:
        """Pack unless the code's rule says not to: it packs when L' / L is below a density
        threshold, 1 in local mode (no packing when a row is fully active, L' = L) and 0.9 in
        full mode, for the whole batch; a configurator-free GAU never packs."""
        a = routing.active
        if streaming:  # a stream's memory holds packed tokens: always pack
            return plan_packing(a, compress=True)
        if always:
            return plan_packing(a, compress=False)
        if self.compress_always or self.attention.mode == "chunk" or not a.shape[1]:
            return plan_packing(a, compress=True)
        threshold = 1.0 if self.attention.mode == "local" else 0.9
        most = int(a.sum(dim=1).max())
        return plan_packing(a, compress=most / a.shape[1] < threshold, most=most)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        state: SeqBoatLayerState | None = None,
        return_state: bool = False,
        offset: int = 0,
        details: bool = False,
    ) -> tuple[Tensor, SeqBoatLayerState | None, LayerReport]:
        """x (B, L, D), mask (B, L) True at real tokens -> (S', new state or None, report).

        `offset` is the original position of x's first token (streams); `details` adds the
        routing tensors and the packed attention output to the report.
        """
        D, Z, E = self.d_model, self.z_dim, self.v_dim
        B, L, _ = x.shape
        want_state = return_state or state is not None
        if want_state and not self.causal:
            raise ValueError("a bidirectional SeqBoat layer sees future tokens and cannot stream")
        valid = torch.ones(B, L, dtype=torch.bool, device=x.device) if mask is None else mask
        residual = x
        X = self.norm(x) if self.prenorm else x
        H, ssm_state = self._ssm(X, mask, None if state is None else state.ssm, want_state)
        H = self.dropout(H)
        n, nf = self.n_logits, _n_logits(self.ffn_router)
        u, u_ffn, hx = torch.split(self.hx_proj(H), [n, nf, D], dim=-1)
        routing = self._route(H, u, valid, self.router)
        plan = self._plan(routing, want_state, always=self.router is None)

        # GAU on the compressed sequence.
        Hc = pack(H, plan)
        Zc, G, Vc = torch.split(F.silu(self.mx_proj(Hc)), [Z, E, E], dim=-1)
        Vc = self.hidden_dropout(Vc)
        Q = Zc * self.kappa[0] + self.mu[0]
        K = Zc * self.kappa[1] + self.mu[1]
        pos = plan.source + offset
        O, memory, (span_sum, span_n) = self.attention(  # noqa: E741
            Q, K, Vc, plan.valid, pos, None if state is None else state.memory,
            return_memory=want_state,
        )  # fmt: skip
        Yc = self.h_proj(O * G)
        if not self.causal:
            Yc = self.dropout(Yc)
        if self.router is None and not plan.packed:
            # The code's always-activated GAU (`--always-act`) adds its output at every
            # position, pads included (it has no confidence to scale by).
            Y = Yc
        else:
            Y = unpack(Yc, plan) * routing.confidence.unsqueeze(-1).to(Yc.dtype)
        branch = hx + Y
        ffn_activation = None
        if self.ffn is not None:
            r_ffn = self._route(H, u_ffn, valid, self.ffn_router)
            p_ffn = plan_packing(r_ffn.active, compress=True)
            Yf = unpack(self.ffn(pack(H, p_ffn)), p_ffn)
            branch = branch + Yf * r_ffn.confidence.unsqueeze(-1).to(Yf.dtype)
            ffn_activation = _fraction(r_ffn.active, valid)
        out = F.silu(self.dropout(branch) + residual if self.causal else branch + residual)
        if not self.prenorm:
            out = self.norm(out)

        report = LayerReport(
            activation=_fraction(routing.active, valid),
            tau=None if self.router is None else self.router.tau,
            span=(span_sum / span_n.clamp(min=1)).to(torch.float32),
            ffn_activation=ffn_activation,
        )
        if details:
            report.details = {
                "active": routing.active,
                "rank": plan.rank,
                "confidence": routing.confidence,
                "probs": routing.probs,
                "logits": u,
                "ssm_out": H,
                "attn_out": O,
                "valid": plan.valid,
                "packed": plan.packed,
                "length": plan.length,
            }
        new_state = None
        if want_state:  # the SSM returned its state, since one was asked for
            new_state = SeqBoatLayerState(cast(Tensor, ssm_state), memory)
        return out, new_state, report


def _n_logits(router: Router | None) -> int:
    """The columns of `hx_proj` a configurator reads (none without one)."""
    return 0 if router is None else router.n_logits


def _fraction(active: Tensor, valid: Tensor) -> Tensor:
    """Activated share of the real tokens (float32, no gradient)."""
    with torch.no_grad():
        return (active.sum() / valid.sum().clamp(min=1)).to(torch.float32)


class SeqBoatBlock(nn.Module):
    """A SeqBoat layer, followed by Mega's normalized FFN for SeqBoat-FFN (`ffn_mode="after"`)."""

    def __init__(self, cfg: SeqBoatConfig) -> None:
        super().__init__()
        self.layer = SeqBoatLayer(cfg)
        self.ffn: NormalizedFFN | None = None
        if cfg.ffn_dim > 0 and cfg.ffn_mode == "after":
            self.ffn = NormalizedFFN(
                cfg.d_model,
                cfg.ffn_dim,
                dropout=cfg.dropout,
                hidden_dropout=cfg.activation_dropout,
                activation="silu",
                norm_type=cfg.norm_type,
                prenorm=cfg.prenorm,
            )

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        state: SeqBoatLayerState | None = None,
        return_state: bool = False,
        offset: int = 0,
        details: bool = False,
    ) -> tuple[Tensor, SeqBoatLayerState | None, LayerReport]:
        x, state, report = self.layer(x, mask, state, return_state, offset, details)
        if self.ffn is not None:
            x = self.ffn(x)
        return x, state, report


class SeqBoat(Backbone):
    """The SeqBoat backbone: a stack of `SeqBoatBlock`s, (B, L, D) -> (B, L, D).

    Encoder (`causal=False`: bidirectional EMA, bidirectional window; classification, two-tower
    retrieval) or causal decoder (`causal=True`: causal EMA and window; language modelling with
    streaming). Pre-norm adds a final norm (`final_norm_affine=False`: the LM's non-affine one).
    `aux` reports per layer (num_layers,) `activation` (share of real tokens that activate the
    GAU), `tau` (the configurator's temperature, when it has one), `attention_span` (mean
    distance in original positions from a query to the other keys it attends, over activated
    queries: the paper's Fig. 6 measure) and, for SeqBoat-{GAU,FFN}, `ffn_activation`.
    """

    config: SeqBoatConfig
    block_class = SeqBoatBlock

    def __init__(self, config: SeqBoatConfig | None = None) -> None:
        super().__init__(cfg := config or SeqBoatConfig())
        self.layers = nn.ModuleList(SeqBoatBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = (
            SequenceNorm(cfg.norm_type, cfg.d_model, affine=cfg.final_norm_affine)
            if cfg.prenorm
            else None
        )
        self.pos_scale: nn.Parameter | None = None
        if cfg.positions == "sinusoidal":
            self.pos_scale = nn.Parameter(torch.full((1,), cfg.d_model**-0.5))
        self.input_dropout = nn.Dropout(cfg.input_dropout)

    def initial_state(self, batch_size: int, like: Tensor) -> SeqBoatState:
        """An empty streaming state (causal models)."""
        self.check_streamable()
        blocks = [cast(SeqBoatBlock, b) for b in self.layers]
        return SeqBoatState([b.layer.initial_state(batch_size, like) for b in blocks], 0)

    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, state: SeqBoatState | None = None
    ) -> BackboneOutput:
        """x (B, L, D), mask (B, L) True at real tokens, state from the previous segment.

        Returns y (B, L, D), zero at padded positions, the state for the next segment (only when
        one was passed), and the per-layer statistics in `aux`.
        """
        return self.forward_with_reports(x, mask, state)[0]

    def forward_with_reports(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        state: SeqBoatState | None = None,
        details: bool = False,
    ) -> tuple[BackboneOutput, list[LayerReport]]:
        """`forward`, plus each layer's `LayerReport` (with `details`: the routing decisions,
        confidences and packed attention outputs, for analysis such as the paper's Fig. 4).
        After the absolute positions the blocks run in the shared stack (`megalab.models.stack`),
        each returning its report beside its state."""
        self.check_input(x, mask, state)
        offset = 0 if state is None else int(state.offset)
        if self.pos_scale is not None:
            pe = sinusoidal_positions(x.shape[1], self.d_model, x, offset)
            x = x + (self.pos_scale * pe).to(x.dtype)
        out = run_stack(
            self.layers,
            x,
            mask,
            None if state is None else state.layers,
            input_dropout=self.input_dropout,
            final=self.final_norm,
            return_state=state is not None,
            offset=offset,
            details=details,
        )
        x = out.y
        reports = [cast(LayerReport, extra[0]) for extra in out.extras]
        aux: dict[str, Tensor] = {
            "activation": torch.stack([r.activation for r in reports]),
            "attention_span": torch.stack([r.span for r in reports]),
        }
        if reports[0].tau is not None:
            aux["tau"] = torch.stack([cast(Tensor, r.tau).to(torch.float32) for r in reports])
        if reports[0].ffn_activation is not None:
            aux["ffn_activation"] = torch.stack([cast(Tensor, r.ffn_activation) for r in reports])
        new_state = None if out.states is None else SeqBoatState(out.states, offset + x.shape[1])
        return BackboneOutput(x, new_state, aux), reports
