"""Sinusoids of positions: the frequencies ω_k = base^(−k/s) and the sin/cos table of p·ω_k.

Every fixed sinusoid in megalab (absolute position tables, the Transformer-XL distance table,
RoPE angles, Mega's rotary bias) is built from these two functions. The models differ only in
parameters, each kept as its authors' code computes it, so that the bits match:

- `form`: "power" computes 1 / base^(k/s) (PyTorch/Hugging Face `inv_freq`), "exp" computes
  exp(k · (−ln base / s)) (fairseq, tensor2tensor); the two round differently.
- the scale s: d/2 for the usual base^(−2k/d), d/2 − 1 in fairseq's tables.
- the dtypes: the power in float64 then cast (RoPE), or everything in float32 (fairseq, XL).
- the layout: halves [sin | cos] or interleaved (sin, cos) pairs, cut or zero-padded to a width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

FORMS = ("power", "exp")


def sinusoid_frequencies(
    count: int,
    scale: float,
    *,
    base: float = 10000.0,
    form: str = "power",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    power_dtype: torch.dtype | None = None,
) -> Tensor:
    """ω_k = base^(−k/scale) for k < count, (count,) in `dtype`.

    `form="power"`: 1 / base^(k/scale), the power taken in `power_dtype` (default `dtype`) and
    cast to `dtype` before the reciprocal. `form="exp"`: exp(k · (−ln base / scale)) in `dtype`.
    With scale = d/2, k/scale rounds exactly as 2k/d does (the same quotient), so tables written
    as `arange(0, d, 2) / d` are reproduced bit for bit.
    """
    if form == "power":
        k = torch.arange(count, device=device, dtype=power_dtype or dtype)
        return 1.0 / (base ** (k / scale)).to(dtype)
    if form == "exp":
        k = torch.arange(count, device=device, dtype=dtype)
        return torch.exp(k * (-math.log(base) / scale))
    raise ValueError(f"unknown sinusoid form {form!r}; allowed values: {', '.join(FORMS)}")


def sinusoid_table(
    positions: Tensor, frequencies: Tensor, *, interleave: bool = False, width: int | None = None
) -> Tensor:
    """The sin/cos of positions·ω: (...,) positions and (n,) ω -> (..., 2n) (or `width`).

    Halves [sin(p·ω) | cos(p·ω)] by default, (sin, cos) pairs with `interleave`. With `width`,
    the table is cut to its first `width` channels or padded with zero channels to it. Computed
    in the dtype the two inputs promote to.
    """
    angle = positions.unsqueeze(-1) * frequencies
    sin, cos = torch.sin(angle), torch.cos(angle)
    if interleave:
        table = torch.stack([sin, cos], dim=-1).flatten(-2)
    else:
        table = torch.cat([sin, cos], dim=-1)
    if width is not None:
        extra = width - table.shape[-1]
        table = table[..., :width] if extra < 0 else F.pad(table, (0, extra)) if extra else table
    return table
