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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_silu_gate_is_autograds_bit_for_bit_and_keeps_less(dtype: torch.dtype) -> None:
    """SwiGLU's product without SiLU(a) among the saved tensors: outputs and gradients equal
    autograd's through F.silu(a) * b exactly."""
    from megalab.nn.ffn import gated

    g = torch.Generator().manual_seed(0)
    a, b, grad = (torch.randn(3, 7, 16, generator=g).to(dtype) for _ in range(3))

    def run(fn) -> tuple[list[torch.Tensor], int]:
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        kept: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            out = fn(x, y)
        out.backward(grad)
        storages = {t.untyped_storage().data_ptr() for t in kept}
        return [out.detach(), x.grad, y.grad], len(storages)

    ours, kept = run(lambda x, y: gated(F.silu, x, y))
    reference, kept_reference = run(lambda x, y: F.silu(x) * y)
    for o, r in zip(ours, reference):
        assert o.dtype == dtype and torch.equal(o, r)
    assert (kept, kept_reference) == (2, 3)  # a and b; autograd also keeps SiLU(a)


def test_silu_gate_with_mixed_dtypes_is_autograds_bit_for_bit() -> None:
    """A bf16 gate input and a float32 other factor (type promotion in the product)."""
    from megalab.nn.ffn import gated

    g = torch.Generator().manual_seed(2)
    a = torch.randn(5, 9, generator=g).bfloat16()
    b, grad = torch.randn(5, 9, generator=g), torch.randn(5, 9, generator=g)
    runs = []
    for fn in (lambda x, y: gated(F.silu, x, y), lambda x, y: F.silu(x) * y):
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = fn(x, y)
        out.backward(grad)
        runs.append([out, x.grad, y.grad])
    for ours, reference in zip(*runs):
        assert ours.dtype == reference.dtype and torch.equal(ours, reference)


def test_silu_gate_differentiates_twice() -> None:
    from megalab.nn.ffn import gated

    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(4, 5, generator=g, dtype=DT, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda x, y: gated(F.silu, x, y), (a, b))
    assert torch.autograd.gradgradcheck(lambda x, y: gated(F.silu, x, y), (a, b))
    # one input without a gradient, and other activations, as before
    only_b = gated(F.silu, a.detach(), b)
    only_b.sum().backward()
    assert torch.equal(b.grad, F.silu(a.detach()))
    assert torch.equal(gated(F.gelu, a, b), F.gelu(a) * b)


def test_gated_ffns_match_their_formula() -> None:
    from megalab.nn.ffn import GatedFFN

    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=DT, requires_grad=True)
    glu = GatedFFN(8, 12).to(DT)
    y = glu(x)
    assert torch.equal(y, glu.fc2(F.silu(glu.fc1(x)) * glu.fc3(x)))
    ffn = NormalizedFFN(8, 12, gated=True).to(DT)
    h = ffn.norm(x)
    assert torch.allclose(ffn(x), x + ffn.fc2(F.silu(ffn.fc1(h)) * ffn.fc3(h)), rtol=0, atol=1e-15)
    (y.sum() + ffn(x).sum()).backward()
    assert x.grad is not None and all(p.grad is not None for p in glu.parameters())
