"""The shared sinusoids reproduce, bit for bit, each formula the models were written with."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megalab.models.seqboat.sma import sinusoidal_positions as seqboat_positions
from megalab.models.transformer.model import sinusoidal_positions as transformer_positions
from megalab.models.transformer.translation import fairseq_sinusoidal_positions
from megalab.nn.attention import RotaryRelativePositionalBias
from megalab.nn.positions import sinusoid_frequencies, sinusoid_table
from megalab.nn.relative_attention import SinusoidPositions
from megalab.nn.rope import rope_inv_freq

WIDTHS = [2, 7, 8, 63, 64, 130]
DTYPES = [torch.float32, torch.float64]


def exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("d", WIDTHS)
def test_transformer_table_is_the_interleaved_tensor2tensor_formula(d: int) -> None:
    L = 50
    position = torch.arange(L, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    old = torch.zeros(L, d, dtype=torch.float32)
    old[:, 0::2] = torch.sin(position * inv_freq)
    old[:, 1::2] = torch.cos(position * inv_freq)[:, : d // 2]
    exact(transformer_positions(L, d), old)
    exact(transformer_positions(L, d, dtype=torch.float64), old.double())


@pytest.mark.parametrize("d", [4, 7, 8, 64, 130])
def test_fairseq_table_is_fairseqs_formula(d: int) -> None:
    positions = torch.tensor([[2, 3, 4, 1], [2, 3, 5, 9]])
    half = d // 2
    scale = math.log(10000.0) / (half - 1)
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -scale)
    angle = positions.to(torch.float32).unsqueeze(-1) * freq
    old = torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)
    if d % 2:
        old = F.pad(old, (0, 1))
    exact(fairseq_sinusoidal_positions(positions, d), old)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", WIDTHS)
def test_seqboat_table_is_the_codes_formula(d: int, dtype: torch.dtype) -> None:
    like = torch.zeros(1, dtype=dtype)
    L, offset = 33, 5
    half = d // 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).to(dtype)
    t = torch.arange(offset, offset + L, dtype=dtype)
    angle = t.unsqueeze(1) * inv_freq[:half].unsqueeze(0)
    old = torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)
    if d % 2:
        old = F.pad(old, (0, 1))
    exact(seqboat_positions(L, d, like, offset), old)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [2, 8, 64, 130])
def test_transformer_xl_distance_table_is_the_codes_formula(d: int, dtype: torch.dtype) -> None:
    inv_freq = 1.0 / (10000 ** (torch.arange(0.0, d, 2.0, dtype=torch.float32) / d))
    distances = torch.arange(40.0, -1.0, -1.0, dtype=dtype)
    inp = torch.outer(distances, inv_freq.to(dtype))
    old = torch.cat([inp.sin(), inp.cos()], dim=-1)
    module = SinusoidPositions(d)
    exact(module.inv_freq, inv_freq)
    exact(module(distances), old)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [2, 7, 16, 64, 128])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_rope_frequencies_are_the_float64_power_formula(
    dim: int, base: float, dtype: torch.dtype
) -> None:
    old = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).to(dtype)
    exact(rope_inv_freq(dim, base, dtype), old)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("z", [2, 8, 64])
def test_rotary_bias_rotation_is_the_codes_formula(z: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    bias = RotaryRelativePositionalBias(z).to(dtype)
    half = z // 2
    positions = torch.arange(3, 40, dtype=dtype)
    inv_freq = torch.exp(torch.arange(half, dtype=dtype) * (-math.log(10000.0) / half))
    angle = positions.unsqueeze(1) * inv_freq.unsqueeze(0)
    sin, cos = torch.sin(angle), torch.cos(angle)
    x1, x2 = bias.a.detach().chunk(2)
    old = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=1)
    exact(bias._rotate(bias.a.detach(), positions), old)


def test_power_and_exp_forms_agree_in_value_and_width_pads_or_cuts() -> None:
    power = sinusoid_frequencies(32, 32.0, dtype=torch.float64)
    expo = sinusoid_frequencies(32, 32.0, form="exp", dtype=torch.float64)
    torch.testing.assert_close(power, expo, rtol=1e-12, atol=0)
    exact(power[:2], torch.tensor([1.0, 10000.0 ** (-1 / 32)], dtype=torch.float64))
    p = torch.arange(5.0, dtype=torch.float64)
    table = sinusoid_table(p, power[:3])
    exact(table[:, :3], torch.sin(p[:, None] * power[:3]))
    exact(table[:, 3:], torch.cos(p[:, None] * power[:3]))
    inter = sinusoid_table(p, power[:3], interleave=True, width=5)
    exact(inter, torch.stack([table[:, :3], table[:, 3:]], -1).flatten(-2)[:, :5])
    padded = sinusoid_table(p, power[:3], width=7)
    exact(padded[:, 6], torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown sinusoid form"):
        sinusoid_frequencies(4, 2.0, form="log")
