"""SeqBoat's sparse modular activation (`megalab.models.seqboat.sma`): which tokens each layer
attends to.

The latent configurators (routers) decide per token whether the attention module is active;
`plan_packing` / `pack` / `unpack` gather the active tokens into a compact batch for the
attention and scatter its output back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


# ------------------------------------------------------------------------- compress / extract
@dataclass
class Packing:
    """Where the activated tokens of each row go in the compressed sequence.

    rank:   (B, L) int64, 1-based slot of each activated token in its row, 0 for skipped ones
            (the code's `a · cumsum(a)`).
    source: (B, L') int64, the original position of each packed slot (0 at invalid slots).
    valid:  (B, L') bool, slot s of row b holds a token (s < number of activated tokens).
    packed: False for the code's no-compression branch: slots are the original positions,
            `valid` is the activation mask and `source` is arange(L).
    active: (B, L) bool, the activation decisions.
    """

    rank: Tensor
    source: Tensor
    valid: Tensor
    packed: bool
    active: Tensor

    @property
    def length(self) -> int:
        """L', the length of the compressed sequence."""
        return self.source.shape[1]


def plan_packing(active: Tensor, compress: bool = True, most: int | None = None) -> Packing:
    """The packing of the activation mask `active` (B, L) bool.

    `compress=False` is the code's no-compression branch (the GAU runs over all L positions with
    the skipped tokens masked). With `compress=True` the length is L' = max_b Σ_t a_bt, at least
    1 (a single invalid slot when nothing is active, as the code); `most`, that maximum where the
    caller has read it already (each read waits for the GPU).
    """
    B, L = active.shape
    rank = torch.cumsum(active, dim=1) * active
    if not compress:
        source = torch.arange(L, device=active.device).expand(B, L)
        return Packing(rank, source, active, False, active)
    counts = active.sum(dim=1)
    if most is None:
        most = int(counts.max()) if L else 0
    length = max(most, 1)
    # source[b, s] = t for the token of rank s + 1 (one scatter of B·L integers).
    table = torch.zeros(B, length + 1, dtype=torch.long, device=active.device)
    table.scatter_(1, rank, torch.arange(L, device=active.device).expand(B, L))
    source = table[:, 1:]
    valid = torch.arange(length, device=active.device) < counts.unsqueeze(1)
    return Packing(rank, source, valid, True, active)


def _take(x: Tensor, index: Tensor, keep: Tensor) -> Tensor:
    """x (B, T, ...) gathered along time at index (B, S), zeroed where `keep` (B, S) is False."""
    idx = index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    out = x.gather(1, idx)
    return out * keep.reshape(*keep.shape, *([1] * (x.dim() - 2))).to(out.dtype)


class _Pack(torch.autograd.Function):
    """x (B, L, ...) -> (B, L', ...): the activated tokens, left-aligned in original order."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, source: Tensor, valid: Tensor, rank: Tensor) -> Tensor:
        ctx.save_for_backward(rank)
        return _take(x, source, valid)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (rank,) = ctx.saved_tensors
        return _take(grad, (rank - 1).clamp(min=0), rank > 0), None, None, None


class _Unpack(torch.autograd.Function):
    """y (B, L', ...) -> (B, L, ...): each activated token gets its slot, skipped ones 0."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, source: Tensor, valid: Tensor, rank: Tensor) -> Tensor:
        ctx.save_for_backward(source, valid)
        return _take(y, (rank - 1).clamp(min=0), rank > 0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        source, valid = ctx.saved_tensors
        return _take(grad, source, valid), None, None, None


def pack(x: Tensor, plan: Packing) -> Tensor:
    """Compress (B, L, ...) to (B, L', ...); invalid slots are zero (the code's compress)."""
    if not plan.packed:
        return x
    return _Pack.apply(x, plan.source, plan.valid, plan.rank)


def unpack(y: Tensor, plan: Packing) -> Tensor:
    """Extract (B, L', ...) back to (B, L, ...); skipped tokens get 0 (the code's extract)."""
    if not plan.packed:
        return y * plan.active.reshape(*plan.active.shape, *([1] * (y.dim() - 2))).to(y.dtype)
    return _Unpack.apply(y, plan.source, plan.valid, plan.rank)


# --------------------------------------------------------------------- latent configurators
class Routing(NamedTuple):
    """A configurator's output: decisions a (B, L) bool, confidences c (B, L) (0 where a is
    False) and, for the 2-way routers, the probabilities (B, L, 2) [skip, activate]."""

    active: Tensor
    confidence: Tensor
    probs: Tensor | None


class Router(nn.Module):
    """A configurator: `forward(h, u, valid, act_bias) -> Routing` from the hidden states h and
    its `n_logits` logits u per token (columns of the unit's `hx_proj`; 0: it scores h itself)."""

    n_logits: int

    @property
    def tau(self) -> Tensor | None:
        """The temperature the configurator reports per layer (None: it has none)."""
        return None

    def forward(self, h: Tensor, u: Tensor, valid: Tensor, act_bias: float = 0.0) -> Routing:
        raise NotImplementedError


class _TemperedRouter(Router):
    """A router with a learned temperature τ = exp(θ), one θ per layer, θ₀ = log(α√d)
    (code: `q_router.temp`, in log space, decayed by the optimizer like every parameter)."""

    def __init__(self, d_model: int, init_temp_scale: float = 1.0) -> None:
        super().__init__()
        if init_temp_scale <= 0:
            raise ValueError(f"init_temp_scale must be positive, got {init_temp_scale}")
        self.init_temp_scale = init_temp_scale
        self.log_tau = nn.Parameter(torch.full((1,), math.log(init_temp_scale * d_model**0.5)))

    @property
    def tau(self) -> Tensor:
        return self.log_tau.detach().exp().squeeze(0)


class TemperedSoftmaxRouter(_TemperedRouter):
    """The paper's configurator: p = softmax([u_skip + b_act, u_act] / τ), a = argmax, c = max p.

    τ as `_TemperedRouter`. The softmax runs in at least float32.
    """

    n_logits = 2

    def forward(self, h: Tensor, u: Tensor, valid: Tensor, act_bias: float = 0.0) -> Routing:
        cdt = torch.promote_types(u.dtype, torch.float32)
        shift = u.new_tensor([act_bias, 0.0], dtype=cdt)
        probs = torch.softmax((u.to(cdt) + shift) / self.log_tau.to(cdt).exp(), dim=-1)
        active = (probs[..., 1] > probs[..., 0]) & valid
        # c = max p on activated tokens (= p_act there), the code's q_probs.
        return Routing(active, probs[..., 1] * active, probs)


class GumbelSoftmaxRouter(Router):
    """Gumbel-softmax configurator (SeqBoat App. A.4, the Table 7 ablation).

    Training: p' = softmax(([u_skip + b_act, u_act] + G) / τ'), G ~ Gumbel(0, 1) per logit, with
    τ' = max(τ₀ · decay^T, τ_min) annealed over the training forward passes T (paper: τ₀ = 2,
    decay 0.999995, τ_min = 0.5; the code's unused schedule instead reaches 0.5 at half of
    `--max-update`); a = argmax p', c = max p'. Evaluation: the hard decision argmax u and c = 1.
    T is a buffer (`step`), saved with the model, counting training forward passes (optimizer
    steps times gradient-accumulation micro-batches).

    `hard=True` is the straight-through mode of the code's `LatentConfigurator(hard=True)`,
    i.e. `F.gumbel_softmax(hard=True)`: y = onehot(argmax p') − sg(p') + p', then
    (c, a) = max(y) as the unit takes them, so c is 1 in the forward pass (up to rounding of
    1 − p' + p') and its gradient is that of p' at the chosen option.
    """

    n_logits = 2
    step: Tensor  # registered buffer

    def __init__(
        self,
        tau_start: float = 2.0,
        tau_min: float = 0.5,
        decay: float = 0.999995,
        hard: bool = False,
    ) -> None:
        super().__init__()
        self.tau_start, self.tau_min, self.decay = tau_start, tau_min, decay
        self.hard = hard
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    @property
    def tau(self) -> Tensor:
        t = self.tau_start * self.decay ** float(self.step)
        return torch.tensor(max(t, self.tau_min))

    def forward(self, h: Tensor, u: Tensor, valid: Tensor, act_bias: float = 0.0) -> Routing:
        cdt = torch.promote_types(u.dtype, torch.float32)
        logits = u.to(cdt) + u.new_tensor([act_bias, 0.0], dtype=cdt)
        if not self.training:
            active = (logits[..., 1] > logits[..., 0]) & valid
            return Routing(active, active.to(cdt), None)
        tau = float(self.tau)
        with torch.no_grad():
            self.step += 1
        gumbel = -torch.empty_like(logits).exponential_().log()
        probs = torch.softmax((logits + gumbel) / tau, dim=-1)
        if self.hard:
            index = probs.argmax(dim=-1, keepdim=True)
            y_hard = torch.zeros_like(probs).scatter_(-1, index, 1.0)
            probs = y_hard - probs.detach() + probs
            c, choice = probs.max(dim=-1)
            active = (choice == 1) & valid
            return Routing(active, c * active, probs)
        active = (probs[..., 1] > probs[..., 0]) & valid
        return Routing(active, probs[..., 1] * active, probs)


class SigmoidRouter(_TemperedRouter):
    """The "-Sigmoid" ablation (Table 8): p = sigmoid((u − b_act) / τ), a = p > ½, c = p.

    One logit per token; τ as the tempered softmax (learned, θ₀ = log(α√d)). Equivalent to the
    2-way softmax with u = u_act − u_skip, but parameterised by a single weight vector.
    """

    n_logits = 1

    def forward(self, h: Tensor, u: Tensor, valid: Tensor, act_bias: float = 0.0) -> Routing:
        cdt = torch.promote_types(u.dtype, torch.float32)
        p = torch.sigmoid((u[..., 0].to(cdt) - act_bias) / self.log_tau.to(cdt).exp())
        active = (p > 0.5) & valid
        return Routing(active, p * active, torch.stack([1 - p, p], dim=-1))


class XMoERouter(Router):
    """The "-MoE" ablation (Table 8): X-MoE top-1 routing (Chi et al. 2022) between a module
    that outputs zero (expert 0) and the GAU (expert 1), without a load-balancing loss.

    As torchscale's `Top1Gate(use_xmoe=True)`: the token is projected to 16 dimensions without
    bias, scored against two expert embeddings (orthogonal init, gain 0.32) normalised to unit
    length (the token projection is not normalised, as that code), p = softmax of the scores in
    float32, a = argmax, c = max p. The expert embeddings are rescaled to norm 1.5 before each
    training pass (no gradient), as that code. `b_act` shifts the zero expert's score.
    """

    n_logits = 0

    def __init__(self, d_model: int, dim: int = 16) -> None:
        super().__init__()
        self.reduction = nn.Linear(d_model, dim, bias=False)
        self.experts = nn.Parameter(torch.empty(2, dim))
        nn.init.orthogonal_(self.experts, gain=0.32)

    def forward(self, h: Tensor, u: Tensor, valid: Tensor, act_bias: float = 0.0) -> Routing:
        if self.training:
            with torch.no_grad():
                self.experts.mul_(1.5 / self.experts.norm(dim=1, keepdim=True))
        cdt = torch.promote_types(h.dtype, torch.float32)
        e = F.normalize(self.experts.to(cdt), p=2.0, dim=1, eps=1e-4)
        scores = self.reduction(h).to(cdt) @ e.T + h.new_tensor([act_bias, 0.0], dtype=cdt)
        probs = torch.softmax(scores, dim=-1)
        active = (probs[..., 1] > probs[..., 0]) & valid
        return Routing(active, probs[..., 1] * active, probs)


ROUTERS = ("softmax", "gumbel", "sigmoid", "xmoe", "none")


def build_router(
    kind: str,
    d_model: int,
    init_temp_scale: float = 1.0,
    gumbel_tau: tuple[float, float, float] = (2.0, 0.5, 0.999995),
    gumbel_hard: bool = False,
) -> Router | None:
    """The configurator called `kind` (None for "none": the GAU always runs)."""
    if kind == "softmax":
        return TemperedSoftmaxRouter(d_model, init_temp_scale)
    if kind == "gumbel":
        return GumbelSoftmaxRouter(*gumbel_tau, hard=gumbel_hard)
    if kind == "sigmoid":
        return SigmoidRouter(d_model, init_temp_scale)
    if kind == "xmoe":
        return XMoERouter(d_model)
    if kind == "none":
        return None
    raise ValueError(f"unknown router {kind!r}; allowed values: {', '.join(ROUTERS)}")
