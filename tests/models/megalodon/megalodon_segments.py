"""Streaming a Megalodon layer segment by segment, for the tests that compare it with one pass."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def run_segments(
    m: nn.Module, x: Tensor, mask: Tensor, state: Any, segments: list[int]
) -> tuple[Tensor, Any]:
    """`m(x, mask, state) -> (y, state)` over consecutive `segments` of the time axis, each
    starting from the state the previous one returned: (the outputs joined, the last state)."""
    outs, s = [], 0
    for n in segments:
        y, state = m(x[:, s : s + n], mask[:, s : s + n], state)
        outs.append(y)
        s += n
    return torch.cat(outs, 1), state
