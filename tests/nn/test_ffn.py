"""Normalized FFN: fc1 → act → hidden dropout → fc2 → dropout → + residual, pre/post norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalab.nn.ffn import NormalizedFFN, get_activation

DT = torch.float64


@pytest.mark.parametrize("prenorm", [True, False])
def test_formula(prenorm: bool) -> None:
    torch.manual_seed(0)
    ffn = NormalizedFFN(8, 12, norm_type="layernorm", prenorm=prenorm).to(DT)
    with torch.no_grad():
        for p in ffn.parameters():
            p.normal_()
    x = torch.randn(2, 5, 8, dtype=DT)
    h = ffn.norm(x) if prenorm else x
    y = x + ffn.fc2(F.silu(ffn.fc1(h)))
    if not prenorm:
        y = ffn.norm(y)
    assert torch.allclose(ffn(x), y)


def test_init_and_dropout_placement() -> None:
    torch.manual_seed(0)
    ffn = NormalizedFFN(64, 256, dropout=0.5, hidden_dropout=0.5)
    assert abs(ffn.fc1.weight.std().item() - 0.02) < 2e-3
    assert ffn.fc1.bias.abs().sum() == 0 and ffn.fc2.bias.abs().sum() == 0
    x = torch.randn(2, 3, 64)
    ffn.eval()
    assert torch.equal(ffn(x), ffn(x))
    ffn.train()
    assert not torch.equal(ffn(x), ffn(x))


def test_unknown_activation() -> None:
    with pytest.raises(ValueError, match="silu, gelu, gelu_accurate, relu"):
        get_activation("swish")
