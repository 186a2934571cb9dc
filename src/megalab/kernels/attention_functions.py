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


def key_counts(
    q_start: int,
    q_end: int,
    num_keys: int,
    causal: bool,
    valid: Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor | float:
    """n, the number of keys each query averages over under laplace and relu² (their τ, in
    place of softmax's √z; App. C): a causal query at position i (q_start ≤ i < q_end) sees
    i + 1 keys, (q_end − q_start, 1); otherwise the real keys of each row of `valid` (N, Ck),
    (N, 1, 1); otherwise all `num_keys`."""
    if causal:
        return torch.arange(q_start + 1, q_end + 1, device=device).unsqueeze(1).to(dtype)
    if valid is not None:
        return valid.sum(dim=-1).clamp(min=1).to(dtype)[..., None, None]
    return float(num_keys)
