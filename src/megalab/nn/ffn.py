"""The normalized feed-forward sub-layer of Mega and Megalodon (the code's
`NormalizedFeedForwardNetwork`), and the plain gated FFN.

    Y = R + DropPath(dropout(fc2(hidden_dropout(act(fc1 X̂) [⊙ fc3 X̂]))))
    X̂ = Norm(X) if pre-norm else X;  post-norm: Y ← Norm(Y)

R is the un-normalised input X, or the residual the block passes (Megalodon's two-hop
residual: Y = X + FFN(Ŷ)). fc3 exists for the gated (SwiGLU) variant only. Linears are
initialised N(0, 0.02), bias 0, unless a model overrides `reset_parameters`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.nn.linear import joint_linear
from megalab.nn.norms import SequenceNorm
from megalab.nn.regularization import DropPath


def gelu_accurate(x: Tensor) -> Tensor:
    """fairseq's `gelu_accurate`, the tanh approximation of GELU, written as fairseq writes it:
    0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (its `gelu_fast` is the same function)."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_accurate": gelu_accurate,
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[Tensor], Tensor]:
    """The activation function called `name` (silu, gelu, gelu_accurate or relu)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown activation {name!r}; allowed values: {', '.join(ACTIVATIONS)}"
        ) from None


class _SiLUGate(torch.autograd.Function):
    """SiLU(a) ⊙ b, keeping a and b only: SiLU(a) is recomputed in the backward instead of kept
    (a third less FFN activation memory), with autograd's own operations, so the gradients are
    autograd's bit for bit (tests/nn/test_ffn.py)."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        if torch.is_grad_enabled():  # a backward differentiated again: differentiable operations
            s = torch.sigmoid(a)
            grad_a = grad * b * (s * (1 + a * (1 - s))) if need_a else None
            return grad_a, grad * (a * s) if need_b else None
        # autograd's order: ∂SiLU(a) = grad·b in SiLU(a)'s dtype, then SiLU's own backward
        grad_a = torch.ops.aten.silu_backward((grad * b).to(a.dtype), a) if need_a else None
        return grad_a, grad * F.silu(a) if need_b else None


def gated(act: Callable[[Tensor], Tensor], a: Tensor, b: Tensor) -> Tensor:
    """act(a) ⊙ b, the gated linear unit's product; for SiLU (SwiGLU) without keeping SiLU(a) for
    the backward."""
    if (
        act is F.silu
        and torch.is_grad_enabled()
        and (a.requires_grad or b.requires_grad)
        and not torch.compiler.is_compiling()  # the compiler plans the memory itself
    ):
        out: Tensor = _SiLUGate.apply(a, b)
        return out
    return act(a) * b


class NormalizedFFN(nn.Module):
    """fc1 → act (⊙ fc3) → hidden dropout → fc2 → dropout → DropPath → + residual, with a
    pre- or post-norm.

    Args:
        d_model: model width d.
        ffn_dim: hidden width d_FFN.
        dropout: on the output of fc2 (the code's `--dropout`).
        hidden_dropout: on act(fc1(x)) (the code's activation/`--act-dropout`).
        activation: silu in every Mega config.
        norm_type: see `megalab.nn.norms.NORM_TYPES`.
        prenorm: normalise the input (True) or the output (False).
        norm_affine: whether the norm learns its gain and bias (False: the code's
            `affine=False` norms).
        norm: a norm module to use instead of `SequenceNorm(norm_type, ...)` (Megalodon's
            plus-one LayerNorm); it is stored as `norm` either way.
        gated: add the linear branch fc3 (SwiGLU with SiLU).
        bias: biases on the linears.
        drop_path: stochastic-depth rate on the branch, before the residual (0: none).
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        dropout: float = 0.0,
        hidden_dropout: float = 0.0,
        activation: str = "silu",
        norm_type: str = "layernorm",
        prenorm: bool = True,
        norm_affine: bool = True,
        norm: nn.Module | None = None,
        gated: bool = False,
        bias: bool = True,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        self.prenorm = prenorm
        self.act = get_activation(activation)
        self.norm = (
            norm if norm is not None else SequenceNorm(norm_type, d_model, affine=norm_affine)
        )
        self.fc1 = nn.Linear(d_model, ffn_dim, bias=bias)
        self.fc2 = nn.Linear(ffn_dim, d_model, bias=bias)
        self.fc3 = nn.Linear(d_model, ffn_dim, bias=bias) if gated else None
        self.dropout = nn.Dropout(dropout)
        self.hidden_dropout = nn.Dropout(hidden_dropout)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else None
        self.reset_parameters()

    def linears(self) -> list[nn.Linear]:
        """fc1, fc2 and (gated) fc3, in that order."""
        return [lin for lin in (self.fc1, self.fc2, self.fc3) if lin is not None]

    def reset_parameters(self) -> None:
        """The authors' init: weights N(0, 0.02), biases 0."""
        for lin in self.linears():
            nn.init.normal_(lin.weight, mean=0.0, std=0.02)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """(B, L, D) -> (B, L, D); `residual` defaults to x (the un-normalised input)."""
        if residual is None:
            residual = x
        if self.prenorm:
            x = self.norm(x)
        if self.fc3 is not None:
            h1, h3 = joint_linear(x, self.fc1, self.fc3)
            h = gated(self.act, h1, h3)
        else:
            h = self.act(self.fc1(x))
        out = self.dropout(self.fc2(self.hidden_dropout(h)))
        if self.drop_path is not None:
            out = self.drop_path(out)
        x = out + residual
        if not self.prenorm:
            x = self.norm(x)
        return x


class GatedFFN(nn.Module):
    """Gated linear unit FFN (Shazeer 2020): fc2(dropout(act(fc1 x) ⊙ fc3 x)); SwiGLU with SiLU.

    The position-wise part only (no norm, no residual): Megalodon's and Llama's blocks place
    those themselves. Names follow Megalodon's code (fc1 gate input, fc3 linear branch, fc2
    out); Llama's w1/w3/w2 (HF gate_proj/up_proj/down_proj) map onto fc1/fc3/fc2.

    Args:
        d_model: model width.  ffn_dim: hidden width.
        activation: silu (SwiGLU), gelu (GeGLU) or relu (ReGLU).
        bias: biases on the three linears (none in Megalodon and Llama).
        hidden_dropout: on the gated hidden layer.
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        activation: str = "silu",
        bias: bool = False,
        hidden_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.act = get_activation(activation)
        self.fc1 = nn.Linear(d_model, ffn_dim, bias=bias)
        self.fc3 = nn.Linear(d_model, ffn_dim, bias=bias)
        self.fc2 = nn.Linear(ffn_dim, d_model, bias=bias)
        self.hidden_dropout = nn.Dropout(hidden_dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(..., D) -> (..., D)."""
        h1, h3 = joint_linear(x, self.fc1, self.fc3)
        return self.fc2(self.hidden_dropout(gated(self.act, h1, h3)))
