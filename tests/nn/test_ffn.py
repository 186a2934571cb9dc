"""Normalized FFN: fc1 → act (⊙ fc3) → hidden dropout → fc2 → dropout → DropPath → + residual."""

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


def test_gated_two_hop_form_is_megalodons_ffn() -> None:
    """Megalodon's FFN: X + fc2(SiLU(fc1 u) ⊙ fc3 u), u = Norm(Ŷ), no biases."""
    from megalab.nn.norms import PlusOneLayerNorm

    torch.manual_seed(0)
    ffn = NormalizedFFN(8, 12, norm=PlusOneLayerNorm(8), gated=True, bias=False).to(DT)
    assert list(ffn.state_dict()) == ["norm.weight", "norm.bias", "fc1.weight", "fc2.weight",
                                      "fc3.weight"]  # fmt: skip
    with torch.no_grad():
        for p in ffn.parameters():
            p.normal_()
    y, x = torch.randn(2, 2, 5, 8, dtype=DT)
    u = ffn.norm(y)
    expected = x + ffn.fc2(F.silu(ffn.fc1(u)) * ffn.fc3(u))
    torch.testing.assert_close(ffn(y, residual=x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("prenorm", [True, False])
def test_drop_path_acts_on_the_branch_before_the_residual(prenorm: bool) -> None:
    torch.manual_seed(0)
    ffn = NormalizedFFN(8, 12, prenorm=prenorm, drop_path=1.0).to(DT).train()
    x = torch.randn(2, 5, 8, dtype=DT)
    expected = x if prenorm else ffn.norm(x)
    torch.testing.assert_close(ffn(x), expected, rtol=0, atol=0)
    plain = NormalizedFFN(8, 12, prenorm=prenorm).to(DT)
    plain.load_state_dict(ffn.state_dict(), strict=True)
    torch.testing.assert_close(ffn.eval()(x), plain.eval()(x), rtol=0, atol=0)
