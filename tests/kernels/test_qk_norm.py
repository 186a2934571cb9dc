"""The Triton queries/keys of Megalodon's attention (`megalab.kernels.qk_norm`) against
`NormalizedAttention.queries_keys`, the PyTorch reference, under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from megalab import kernels
from megalab.models.megalodon.normalized_attention import NormalizedAttention

from .tiny_models import tiny_megalodon

pytestmark = [
    pytest.mark.skipif(
        not (kernels.triton_available() and (kernels.interpreting() or torch.cuda.is_available())),
        reason="needs Triton (the gpu or dev extra), with CUDA or TRITON_INTERPRET=1",
    ),
    pytest.mark.usefixtures("kernel_device"),  # CUDA tensors when compiled (conftest)
]


def _attention(S: int, H: int, seed: int = 0) -> NormalizedAttention:
    """κ and μ moved off their zero init."""
    att = NormalizedAttention(S, 2 * H, H, chunk_size=-1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        att.kappa.copy_(0.5 * torch.randn(att.kappa.shape, generator=g))
        att.mu.copy_(0.5 * torch.randn(att.mu.shape, generator=g))
    return att


def _run(att: NormalizedAttention, z: Tensor, dtype: torch.dtype, kernel: bool) -> list[Tensor]:
    """Q, K and the gradients of Z, κ, μ for fixed random cotangents."""
    from megalab.kernels.qk_norm import normalized_queries_keys

    att.zero_grad()
    z = z.detach().clone().requires_grad_()
    if kernel:
        with kernels.forced("qk_norm"):
            q, k = normalized_queries_keys(z, att.kappa, att.mu, att.num_heads, att.eps, dtype)
    else:
        q, k = (t.to(dtype) for t in att.queries_keys(z))
    g = torch.Generator().manual_seed(7)
    gq = torch.randn(q.shape, generator=g).to(dtype)
    gk = torch.randn(k.shape, generator=g).to(dtype)
    torch.autograd.backward([q, k], [gq, gk])
    assert z.grad is not None and att.kappa.grad is not None and att.mu.grad is not None
    return [q.detach(), k.detach(), z.grad, att.kappa.grad.clone(), att.mu.grad.clone()]


NAMES = ("q", "k", "dz", "dkappa", "dmu")


def _close(
    got: list[Tensor], want: list[Tensor], rtol: float, atol: float, names: tuple = NAMES
) -> None:
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize(("S", "H", "rows"), [(32, 2, 37), (24, 2, 5), (36, 3, 70), (16, 1, 1)])
def test_queries_keys_and_gradients_float32(S: int, H: int, rows: int) -> None:
    """Head widths 16, 12 (a masked tile) and 8; row counts off the row block."""
    att = _attention(S, H)
    z = torch.randn(2, rows, S, generator=torch.Generator().manual_seed(1))
    _close(_run(att, z, torch.float32, True), _run(att, z, torch.float32, False), 1e-5, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_and_outputs(dtype: torch.dtype) -> None:
    """Z in half precision, Q and K in the attention's half dtype, statistics in float32: Q and
    K within one rounding of the half dtype (the interpreter truncates to bf16 where a GPU
    rounds), the gradients as the float32 statistics allow."""
    att = _attention(32, 2)
    z = torch.randn(2, 19, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    got, want = _run(att, z, dtype, True), _run(att, z, dtype, False)
    eps = torch.finfo(dtype).eps
    _close(got[:2], want[:2], rtol=eps, atol=eps, names=NAMES[:2])
    _close(got[2:], want[2:], rtol=2e-2, atol=2e-2, names=NAMES[2:])


def test_a_strided_z_and_the_backward_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Z as a slice of a wider projection (rows further apart than S), and fewer backward
    programs than row blocks, so each program loops over several."""
    from megalab.kernels import qk_norm

    monkeypatch.setattr(qk_norm, "_MAX_PROGRAMS", 2)
    att = _attention(32, 2)
    wide = torch.randn(3, 50, 80, generator=torch.Generator().manual_seed(2))
    z = wide[..., 8:40]
    assert z.stride(1) == 80
    got, want = _run(att, z, torch.float32, True), _run(att, z, torch.float32, False)
    _close(got, want, 1e-5, 1e-5)


def test_no_rows() -> None:
    att = _attention(32, 2)
    got, want = (_run(att, torch.zeros(2, 0, 32), torch.float32, k) for k in (True, False))
    _close(got, want, 0.0, 0.0)


def test_float64_is_refused_and_left_to_the_reference() -> None:
    from megalab.kernels.qk_norm import normalized_queries_keys

    att = _attention(32, 2)
    with pytest.raises(ValueError, match="float32, bf16 or fp16 Z"):
        normalized_queries_keys(torch.ones(1, 2, 32).double(), att.kappa, att.mu, 2, 1e-5,
                                torch.float64)  # fmt: skip
    att64 = _attention(32, 2).double()
    z = torch.randn(1, 5, 32, dtype=torch.float64)
    v = torch.randn(1, 5, 4, dtype=torch.float64)
    with kernels.forced("qk_norm"):
        o, _ = att64(z, v)  # the reference runs: no error
    assert o.dtype == torch.float64


def test_tiny_megalodon_equals_reference_with_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention module takes the kernel in a whole model: features and every gradient."""
    from megalab.kernels import qk_norm

    calls: list[int] = []
    real = qk_norm.normalized_queries_keys

    def counted(*args: object) -> tuple[Tensor, Tensor]:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(qk_norm, "normalized_queries_keys", counted)
    torch.manual_seed(0)
    model = tiny_megalodon(z_dim=32, v_dim=64, chunk_size=16)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    model.eval()
    x = torch.randn(2, 21, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, -6:] = False

    def run(forced: bool) -> list[Tensor]:
        model.zero_grad()
        with kernels.forced("qk_norm") if forced else kernels.disabled("qk_norm"):
            y = model(x, mask).y
        y.square().mean().backward()
        return [y.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]

    got = run(True)
    assert len(calls) == 2  # one call per layer
    want = run(False)
    assert len(calls) == 2
    assert len(got) == len(want) == 1 + len(list(model.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
