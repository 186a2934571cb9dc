"""Sequence norms: formulas, batch × time statistics, the norm-type factory."""

from __future__ import annotations

import pytest
import torch

from megalab.nn.norms import NORM_TYPES, SequenceNorm

DT = torch.float64


def test_layernorm() -> None:
    x = torch.randn(2, 5, 8, dtype=DT)
    norm = SequenceNorm("layernorm", 8).to(DT)
    ref = (x - x.mean(-1, keepdim=True)) / torch.sqrt(
        x.var(-1, unbiased=False, keepdim=True) + 1e-5
    )
    assert torch.allclose(norm(x), ref)


def test_scalenorm_is_rms_based_with_one_scalar() -> None:
    x = torch.randn(2, 5, 8, dtype=DT)
    norm = SequenceNorm("scalenorm", 8).to(DT)
    assert [p.shape for p in norm.parameters()] == [torch.Size([1])]
    with torch.no_grad():
        norm.norm.scalar.fill_(1.7)
    ref = 1.7 * x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(norm(x), ref)


def test_rmsnorm() -> None:
    x = torch.randn(2, 5, 8, dtype=DT)
    norm = SequenceNorm("rmsnorm", 8).to(DT)
    with torch.no_grad():
        norm.norm.weight.normal_()
    ref = norm.norm.weight * x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(norm(x), ref)
    assert sum(p.numel() for p in SequenceNorm("rmsnorm", 8, affine=False).parameters()) == 0


@pytest.mark.parametrize("norm_type", ["batchnorm", "syncbatchnorm"])
def test_batchnorm_statistics_over_batch_and_time(norm_type: str) -> None:
    x = torch.randn(3, 7, 4, dtype=DT) * 2 + 1
    norm = SequenceNorm(norm_type, 4).to(DT).train()
    y = norm(x)
    flat = x.reshape(-1, 4)
    ref = (x - flat.mean(0)) / torch.sqrt(flat.var(0, unbiased=False) + 1e-5)
    assert torch.allclose(y, ref)
    assert torch.allclose(norm.norm.running_mean, 0.1 * flat.mean(0))
    norm.eval()
    ref_eval = (x - norm.norm.running_mean) / torch.sqrt(norm.norm.running_var + 1e-5)
    assert torch.allclose(norm(x), ref_eval)


def test_eps_is_1e_5_everywhere() -> None:
    for t in NORM_TYPES:
        assert SequenceNorm(t, 4).norm.eps == 1e-5


def test_non_affine_layernorm_has_no_parameters() -> None:
    assert not list(SequenceNorm("layernorm", 8, affine=False).parameters())


def test_unknown_norm_type_lists_allowed_values() -> None:
    with pytest.raises(ValueError, match="layernorm, scalenorm, rmsnorm, batchnorm, syncbatchnorm"):
        SequenceNorm("groupnorm", 8)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_bf16_autocast_and_gradients(norm_type: str) -> None:
    norm = SequenceNorm(norm_type, 8)
    x = torch.randn(2, 5, 8, requires_grad=True)
    norm(x).square().sum().backward()
    assert torch.isfinite(x.grad).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x.bfloat16())
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
