"""The FFT convolution with a hand-written backward: exact against autograd, and lean."""

from __future__ import annotations

import pytest
import torch

from megalab.nn.ema_kernel import fft_conv
from megalab.nn.fft_conv import fft_conv_lean, rfft_lean


def _case(n: int, masked: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 7, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    mask = (torch.rand(3, 1, 7, generator=g) > 0.3).double() if masked else None
    return x, k, mask


@pytest.mark.parametrize("n", [11, 16, 17])  # the shortest valid size, even and odd
@pytest.mark.parametrize("masked", [False, True])
def test_gradients_match_autograd_and_gradcheck(n: int, masked: bool) -> None:
    x, k, mask = _case(n, masked)

    def lean(x, k):
        return fft_conv_lean(x, torch.fft.rfft(k, n=n), n, mask)

    def reference(x, k):
        return fft_conv(x if mask is None else x * mask, torch.fft.rfft(k, n=n), n)

    y, y_ref = lean(x, k), reference(x, k)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-13)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, k), g)
    grads_ref = torch.autograd.grad(y_ref, (x, k), g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lean, (x, k))
    # The backward is not differentiable: a second derivative fails loudly, never silently.
    (gx,) = torch.autograd.grad(lean(x, k).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad"):
        gx.sum().backward()


def test_linear_convolution_of_a_two_sided_kernel() -> None:
    """A kernel with negative lags (the bidirectional EMA's conj spectrum) needs no more room."""
    L, K = 9, 9
    n = L + K - 1
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, L, dtype=torch.float64, generator=g)
    fwd, bwd = (torch.randn(3, K, dtype=torch.float64, generator=g) for _ in range(2))
    spec = torch.fft.rfft(fwd, n=n) + torch.fft.rfft(bwd, n=n).conj()
    y = fft_conv_lean(x, spec, n)
    direct = torch.zeros_like(x)
    for t in range(L):
        for m in range(K):
            if t - m >= 0:
                direct[..., t] += fwd[:, m] * x[..., t - m]
            if t + m < L:
                direct[..., t] += bwd[:, m] * x[..., t + m]
    torch.testing.assert_close(y, direct, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [16, 17])
def test_rfft_lean_is_rfft_with_its_gradient(n: int) -> None:
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(rfft_lean(x, n), torch.fft.rfft(x, n=n))

    def f(x):
        return torch.view_as_real(rfft_lean(x, n))

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


def _saved_bytes(fn, exclude: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the tensors autograd keeps for fn's backward, outside `exclude`'s storages."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    return sum(v for p, v in seen.items() if p not in skip)


def test_keeps_half_of_what_autograd_keeps() -> None:
    """Autograd keeps the input spectrum and the zero-padded input; we keep the spectrum."""
    B, D, L = 2, 8, 64
    n = 2 * L
    x = (torch.randn(B, L, D, requires_grad=True) * 1).transpose(1, 2)
    spec = torch.randn(D, n // 2 + 1, dtype=torch.complex64, requires_grad=True) * 1
    spectrum = B * D * (n // 2 + 1) * 8
    ours = _saved_bytes(lambda: fft_conv_lean(x, spec, n), (x, spec))
    autograd = _saved_bytes(lambda: fft_conv(x, spec, n), (x, spec))
    assert ours == spectrum
    assert autograd >= 2 * spectrum - 1024


def test_rejects_a_short_fft() -> None:
    with pytest.raises(ValueError, match="shorter than the input length"):
        fft_conv_lean(torch.zeros(1, 2, 8), torch.zeros(2, 3, dtype=torch.complex64), 4)
