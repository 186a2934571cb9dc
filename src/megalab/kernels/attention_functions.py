"""Mega's attention functions f in O = f(S) V: softmax, laplace and relu² (Mega eq. 16, App. C).

Elementwise PyTorch with no model code, so the attention layers (`megalab.nn.attention`), the
fused CPU path and the Triton kernels (`megalab.kernels`) share one definition of each function
and of laplace's constants.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

ATTENTION_FUNCTIONS = ("softmax", "laplace", "relu2")


def check_attention_function(name: str) -> None:
    """Raise a ValueError naming the choices when `name` is not one of `ATTENTION_FUNCTIONS`."""
    if name not in ATTENTION_FUNCTIONS:
        raise ValueError(
            f"unknown attention_activation {name!r}; allowed values: "
            f"{', '.join(ATTENTION_FUNCTIONS)}"
        )


# The authors' rounded constants for μ = √½ and σ = 1/(2√π).
LAPLACE_MU = 0.707107
LAPLACE_SIGMA = 0.282095


def laplace(x: Tensor, mu: float = LAPLACE_MU, sigma: float = LAPLACE_SIGMA) -> Tensor:
    """Mega's laplace attention function ½(1 + erf((x − μ)/(σ√2))) (eq. 16)."""
    return 0.5 * (1.0 + torch.erf((x - mu) / (sigma * math.sqrt(2.0))))


def relu2(x: Tensor) -> Tensor:
    """relu(x)²."""
    return F.relu(x).square()
