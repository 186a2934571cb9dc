"""Complex EMA (`megalab.models.megalodon.cema`): FFT convolution = the recurrence, streaming =
one pass, the authors' init, memory of the kernel construction, bf16 autocast. The authors'
numbers are in tests/models/megalodon/test_megalodon_golden.py."""

from __future__ import annotations

import math

import pytest
import torch
from megalodon_segments import run_segments

from megalab.models.megalodon.cema import CEMAState, ComplexEMA
from megalab.nn.ema_kernel import naive_recurrence

DT = torch.float64


def cema(D: int = 6, N: int = 4, bidirectional: bool = False, seed: int = 0) -> ComplexEMA:
    torch.manual_seed(seed)
    m = ComplexEMA(D, N, bidirectional=bidirectional).to(DT)
    with torch.no_grad():  # away from the init: a non-zero Im(η), spread decays
        m.eta.normal_()
        m.alpha.normal_(0.0, 1.0)
        m.delta.normal_(0.0, 1.0)
    return m


def naive(m: ComplexEMA, x: torch.Tensor, h0: torch.Tensor | None = None, rows=slice(None)):
    """The recurrence h_t = α x_t + q h_{t−1}, y_t = Re Σ η h_t, as a loop (x (B, L, D))."""
    p, eta, log_q = m.coefficients(DT)
    y, h = naive_recurrence(x.transpose(1, 2), p[rows], eta[rows], log_q[rows], h0)
    return y.real.transpose(1, 2), h


def test_fft_equals_recurrence_with_and_without_state() -> None:
    m = cema()
    x = torch.randn(3, 45, 6, dtype=DT)
    h0 = torch.randn(3, 6, 4, dtype=torch.complex128)
    for state in (None, CEMAState(h0)):
        y, new = m(x, state=state, return_state=True)
        ref, h = naive(m, x, None if state is None else h0)
        torch.testing.assert_close(y, ref + m.omega * x, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(new.h, h, rtol=1e-12, atol=1e-12)


def test_bidirectional_is_forward_plus_reversed_backward() -> None:
    m = cema(bidirectional=True)
    x = torch.randn(2, 30, 6, dtype=DT)
    fwd, _ = naive(m, x, rows=slice(0, 6))
    bwd, _ = naive(m, x.flip(1), rows=slice(6, 12))
    y, _ = m(x)
    torch.testing.assert_close(y, fwd + bwd.flip(1) + m.omega * x, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="cannot be streamed"):
        m(x, state=CEMAState(torch.zeros(2, 6, 4, dtype=torch.complex128)))


@pytest.mark.parametrize("segments", [[1] * 20, [7, 1, 12], [20]])
def test_streaming_equals_one_pass(segments: list[int]) -> None:
    m = cema().eval()
    x = torch.randn(2, 20, 6, dtype=DT)
    mask = torch.arange(20) < torch.tensor([[20], [13]])
    full, last = m(x, mask, return_state=True)
    streamed, state = run_segments(m, x, mask, m.initial_state(2, x), segments)
    torch.testing.assert_close(streamed, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.h, last.h, rtol=1e-12, atol=1e-12)


def test_gradients_with_a_carried_state_and_batch() -> None:
    """The authors' CUDA backward once mixed up the state of batch 0 for B = 2..8: check the
    gradients w.r.t. the decay and h0 at B = 3 against the recurrence's autograd."""
    m = cema()
    x = torch.randn(3, 17, 6, dtype=DT)
    h0 = torch.randn(3, 6, 4, dtype=torch.complex128, requires_grad=True)
    y, new = m(x, state=CEMAState(h0))
    loss = y.square().sum() + torch.view_as_real(new.h).square().sum()
    grads = torch.autograd.grad(loss, [m.alpha, m.delta, m.theta, h0])
    ref_y, ref_h = naive(m, x, h0)
    ref_loss = (ref_y + m.omega * x).square().sum() + torch.view_as_real(ref_h).square().sum()
    ref = torch.autograd.grad(ref_loss, [m.alpha, m.delta, m.theta, h0])
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_gradcheck() -> None:
    m = cema(D=3, N=2)
    x = torch.randn(2, 9, 3, dtype=DT, requires_grad=True)
    h0 = torch.randn(2, 3, 2, dtype=torch.complex128, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, h: m(a, state=CEMAState(h))[0], (x, h0))


def test_authors_init() -> None:
    D, N = 64, 16
    torch.manual_seed(3)
    m = ComplexEMA(D, N)
    base = torch.sigmoid(m.theta.double())
    expected = torch.exp(-torch.arange(1, D + 1, dtype=DT) * math.log(D) / D)
    torch.testing.assert_close(base.sort().values, expected.sort().values)
    assert not torch.equal(base, expected)  # randomly permuted over the channels
    assert (m.eta[..., 1] == 0).all() and 0.8 < m.eta[..., 0].std() < 1.2
    assert m.omega.abs().max() <= 1.0 and 0.15 < m.omega.std() < 0.35
    assert 0.15 < m.alpha.std() < 0.25 and 0.15 < m.delta.std() < 0.25
    # |q| < 1 and θ_n = n·(2π/N)·σ(ϑ): harmonics of one base angle per channel.
    _, _, log_q = m.coefficients(DT)
    assert (log_q.real < 0).all()
    torch.testing.assert_close(log_q.imag / log_q.imag[:, :1], torch.arange(1.0, N + 1, dtype=DT)
                               .expand(D, N))  # fmt: skip


def test_kernel_never_saves_a_full_power_tensor() -> None:
    """Autograd keeps O(D·N·√L) of the kernel construction, never a (D, N, L) tensor."""
    D, N, L = 8, 16, 4096
    m = ComplexEMA(D, N)
    x = torch.randn(1, L, D)
    largest = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal largest
        if t.dim() == 3 and t.shape[:2] == (D, N):
            largest = max(largest, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x)[0].sum().backward()
    assert 0 < largest <= D * N * 2 * (math.isqrt(L) + 1)


def test_bf16_autocast_computes_in_float32() -> None:
    m = cema().float()
    x = torch.randn(2, 64, 6)
    ref, _ = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, state = m(x.bfloat16(), return_state=True)
    assert y.dtype == torch.bfloat16 and state.h.dtype == torch.complex64
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


def test_eval_spectrum_cache_is_reused_and_never_stale() -> None:
    """Streaming evaluation reuses the kernel spectrum until a parameter changes."""
    cema = ComplexEMA(6, 4, bidirectional=True).double().eval()
    x = torch.randn(2, 13, 6, dtype=torch.float64)
    with torch.no_grad():
        y1, _ = cema(x)
        key = cema._spectrum.key
        y2, _ = cema(x)
        assert key is not None and cema._spectrum.key is key and torch.equal(y1, y2)
        cema.eta.mul_(2.0)  # an in-place update invalidates the cached spectrum
        y3, _ = cema(x)
        assert cema._spectrum.key != key
        cema.train()
        y4, _ = cema(x)
        assert cema._spectrum.key is None
    assert torch.allclose(y3, y4) and not torch.allclose(y1, y3)
    cema.eval()
    for _ in range(2):  # autograd on: nothing cached, two backward passes work
        y, _ = cema(x)
        y.sum().backward()
    assert cema._spectrum.key is None
