"""Several linear maps of one input as one matrix product.

A block that projects the same input several times (Llama's Q and K; Megalodon's W_z, W_γ
and W_h1 of X''; a gated FFN's fc1 and fc3) pays a GEMM, a weight cast under autocast and, in
the backward, two GEMMs and a sum per projection, and then the sum of the input's gradients.
`joint_linear` runs them as one: the weights are joined for the call (the parameters stay
separate modules, so state dicts, initialisation, converters and optimizer groups are
unchanged), one GEMM reads the input once, and the backward is one GEMM for the input's
gradient and one for the joined weight's: 12 fewer kernel launches per Llama block step and
25 per Megalodon block step (docs/gpu.md, "Kernel launches without a GPU").

Projections are joined on CUDA only, where each product and cast is a kernel launch. On the
CPU, where a launch costs nothing, the joined product measured 0.98-1.0× the speed of the
separate ones (the extra copies of the joined weight and gradient), so there the layers run
as they are; `joined_on("cpu")` joins there too (tests, the CPU launch count).

Only plain `nn.Linear` modules without hooks are joined; anything else (a LoRA or float8
subclass, a module hook) is called as itself, so that nothing it adds is skipped. Memory: the
outputs are views of one tensor, which autograd keeps whole while it keeps any of them, and under
autocast the joined product keeps one low-precision copy of the input where separate ones keep
one each. Llama joins Q and K (the rotation keeps neither) but not V (the attention keeps it);
a gated FFN's two outputs are both kept; Megalodon's three share X''.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module

_JOINED_DEVICE_TYPES = {"cuda"}


@contextmanager
def joined_on(*device_types: str) -> Iterator[None]:
    """Join the projections on these device types too, inside the block."""
    added = set(device_types) - _JOINED_DEVICE_TYPES
    _JOINED_DEVICE_TYPES.update(added)
    try:
        yield
    finally:
        _JOINED_DEVICE_TYPES.difference_update(added)


def _joinable(x: Tensor, layers: tuple[nn.Linear, ...]) -> bool:
    """On a joining device: plain linears, all with or all without bias, and no hook."""
    if x.device.type not in _JOINED_DEVICE_TYPES:
        return False
    if len(layers) < 2 or any(type(lin) is not nn.Linear for lin in layers):
        return False
    if len({lin.bias is None for lin in layers}) != 1:
        return False
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return False
    return not any(lin._forward_hooks or lin._forward_pre_hooks for lin in layers)


def joint_linear(x: Tensor, *layers: nn.Linear) -> tuple[Tensor, ...]:
    """(layer(x) for layer in layers), as one matrix product where the device and layers allow.

    The outputs are views of one tensor (non-contiguous along the last axis); each equals its
    layer's own output up to the rounding of a differently blocked product.
    """
    if not _joinable(x, layers):
        return tuple(lin(x) for lin in layers)
    weight = torch.cat([lin.weight for lin in layers])
    bias = None if layers[0].bias is None else torch.cat([lin.bias for lin in layers])
    y = F.linear(x, weight, bias)
    return y.split([lin.out_features for lin in layers], dim=-1)
