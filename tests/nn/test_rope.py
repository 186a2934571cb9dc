"""RoPE's rotation with its hand-written backward against autograd through the same formula."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from megalab.nn.rope import InvFreq, RotaryEmbedding, apply_rope, rope_inv_freq


def autograd_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, interleaved: bool) -> Tensor:
    """The rotation as plain tensor operations, differentiated by autograd (the reference)."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    angle = positions.to(cdt).unsqueeze(-1) * inv_freq.to(cdt)
    cos, sin = torch.cos(angle), torch.sin(angle)
    xf = x.to(cdt)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def _value_and_grad(fn, x: Tensor, *args) -> tuple[Tensor, Tensor]:
    x = x.detach().clone().requires_grad_()
    y = fn(x, *args)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    (gx,) = torch.autograd.grad(y, x, g)
    return y, gx


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions_shape", [(7, 1), (2, 7, 1), (1, 7, 3)])
def test_outputs_and_gradients_equal_autograd_bit_for_bit(
    interleaved: bool, dtype: torch.dtype, positions_shape: tuple[int, ...]
) -> None:
    """Forward and backward are the reference's products and sums: equal to the bit, including
    where the positions broadcast over heads or batch (x (2, 7, 3, 8))."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, 8, generator=g, dtype=torch.float64).to(dtype)
    positions = torch.randint(0, 50, positions_shape, generator=g)
    inv_freq = rope_inv_freq(8, 10000.0, torch.promote_types(dtype, torch.float32))
    y, gx = _value_and_grad(apply_rope, x, positions, inv_freq, interleaved)
    y_ref, gx_ref = _value_and_grad(autograd_rope, x, positions, inv_freq, interleaved)
    assert y.dtype == gx.dtype == dtype
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)


def test_a_smaller_input_broadcast_against_the_angles_gets_its_summed_gradient() -> None:
    """x (1, 1, 8) rotated at 5 positions: its gradient sums over them, as autograd's does."""
    x = torch.randn(1, 1, 8, dtype=torch.float64)
    positions = torch.arange(5).view(5, 1)
    inv_freq = rope_inv_freq(8, 10000.0, torch.float64)
    y, gx = _value_and_grad(apply_rope, x, positions, inv_freq, False)
    y_ref, gx_ref = _value_and_grad(autograd_rope, x, positions, inv_freq, False)
    assert y.shape == (5, 1, 8) and gx.shape == x.shape
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-15)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-15)


def test_gradcheck_and_the_pair_of_queries_and_keys() -> None:
    """The backward is the derivative (gradcheck in float64, second order too), and `pair`
    rotates q and k as two calls do."""
    rope = RotaryEmbedding(8, interleaved=True)
    positions = torch.arange(3, 8).view(5, 1)
    x = torch.randn(2, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rope(t, positions), (x,))
    assert torch.autograd.gradgradcheck(lambda t: rope(t, positions), (x,))
    q, k = torch.randn(2, 2, 5, 2, 8, dtype=torch.float64)
    q_rot, k_rot = rope.pair(q, k, positions)
    assert torch.equal(q_rot, rope(q, positions)) and torch.equal(k_rot, rope(k, positions))
    x = torch.randn(2, 5, 2, 8, dtype=torch.float64)  # no gradient: the in-place path
    with torch.no_grad():
        assert torch.equal(rope(x, positions), _rope_with_autograd(rope, x, positions))


def _rope_with_autograd(rope: RotaryEmbedding, x: Tensor, positions: Tensor) -> Tensor:
    inv_freq = rope_inv_freq(rope.dim, rope.base, x.dtype)
    return autograd_rope(x, positions, inv_freq, rope.interleaved)


def test_angles_that_learn_keep_autograds_backward() -> None:
    """Positions that carry a gradient (none of megalab's do) still get it."""
    positions = torch.arange(4, dtype=torch.float64).view(4, 1).requires_grad_()
    inv_freq = rope_inv_freq(8, 10000.0, torch.float64)
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    (gp,) = torch.autograd.grad(apply_rope(x, positions, inv_freq, True).sum(), positions)
    (gp_ref,) = torch.autograd.grad(autograd_rope(x, positions, inv_freq, True).sum(), positions)
    assert torch.equal(gp, gp_ref)


def test_the_frequency_table_is_made_once_per_key_and_serves_training_after_inference() -> None:
    """`InvFreq` keeps one table per (dim, base, dtype, device), equal to `rope_inv_freq`'s; one
    made under inference mode is an ordinary tensor, so a training step can use it after."""
    tables = InvFreq()
    with torch.inference_mode():
        first = tables(8, 10000.0, torch.float32, torch.device("cpu"))
    assert not first.is_inference()
    assert tables(8, 10000.0, torch.float32, torch.device("cpu")) is first
    assert torch.equal(first, rope_inv_freq(8, 10000.0, torch.float32))
    other = tables(8, 500.0, torch.float64, torch.device("cpu"))
    assert other is not first and torch.equal(other, rope_inv_freq(8, 500.0, torch.float64))
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 5, 8)
    with torch.inference_mode():
        rope(x, torch.arange(5))
    x.requires_grad_(True)
    rope(x, torch.arange(5)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
