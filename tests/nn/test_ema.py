"""DampedEMA invariants in float64: FFT path == naive recurrence / direct sums, streaming."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalab.nn.ema import DampedEMA
from megalab.nn.ema_kernel import log_decay, next_fast_len, vandermonde_apply

DT = torch.float64


def make_ema(d=6, h=4, bidirectional=False, truncation=None, seed=0) -> DampedEMA:
    torch.manual_seed(seed)
    ema = DampedEMA(d, h, bidirectional=bidirectional, truncation=truncation).to(DT)
    with torch.no_grad():  # spread the decays so long and short memories are both exercised
        ema.alpha.normal_(0.0, 1.0)
        ema.delta.normal_(0.0, 1.0)
    return ema


def naive_kernel(ema: DampedEMA, length: int) -> torch.Tensor:
    """𝒦[c, l] = Σ_n η_n/√h · α_n β_n · q_n^l with q^l = exp(l log(1 − αδ)), as in the code."""
    a, d = torch.sigmoid(ema.alpha), torch.sigmoid(ema.delta)
    q = 1 - a * d
    powers = torch.exp(torch.arange(length, dtype=DT) * torch.log(q).unsqueeze(-1))
    return torch.einsum("cnl,cn->cl", (a * ema.beta).unsqueeze(-1) * powers, ema.eta * ema.scale)


def recurrence(ema: DampedEMA, x: torch.Tensor, rows: slice, h0=None):
    """h_t = αβ x_t + q h_{t−1}, y_t = Σ η h_t/√h over x (B, L, D); returns (y, h_L)."""
    a, d = torch.sigmoid(ema.alpha[rows]), torch.sigmoid(ema.delta[rows])
    q, w_in, w_out = 1 - a * d, a * ema.beta[rows], ema.eta[rows] * ema.scale
    B, L, D = x.shape
    h = torch.zeros(B, D, ema.ema_dim, dtype=DT) if h0 is None else h0
    ys = []
    for t in range(L):
        h = w_in * x[:, t].unsqueeze(-1) + q * h
        ys.append((h * w_out).sum(-1))
    return torch.stack(ys, 1), h


def direct_sum(k: torch.Tensor, x: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """y_t = Σ_{m<K} k[m] x_{t∓m} (k: (D, K), x: (B, L, D))."""
    L = x.shape[1]
    y = torch.zeros_like(x)
    for m in range(k.shape[1]):
        if backward:
            y[:, : L - m] += k[:, m] * x[:, m:]
        else:
            y[:, m:] += k[:, m] * x[:, : L - m]
    return y


def masked(x, mask):
    return x if mask is None else x * mask.unsqueeze(-1)


@pytest.mark.parametrize("length", [1, 2, 3, 7, 16, 37, 100])
def test_blocked_kernel_equals_naive_vandermonde(length: int) -> None:
    ema = make_ema(d=5, h=3)
    with torch.no_grad():
        assert torch.allclose(ema.kernel(length), naive_kernel(ema, length), rtol=1e-12, atol=1e-14)


def test_vandermonde_offset_and_batch() -> None:
    torch.manual_seed(0)
    log_q = -torch.rand(4, 3, dtype=DT)
    coef = torch.randn(2, 4, 3, dtype=DT)
    out = vandermonde_apply(coef, log_q, 11, offset=1)
    ref = torch.einsum(
        "bdn,dnl->bdl", coef, torch.exp(torch.arange(1, 12, dtype=DT) * log_q[..., None])
    )
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-14)


def test_log_decay_is_exact_and_stable() -> None:
    a = torch.linspace(-8, 8, 33, dtype=DT)
    d = torch.linspace(8, -8, 33, dtype=DT)
    ref = torch.log(1 - torch.sigmoid(a) * torch.sigmoid(d))
    assert torch.allclose(log_decay(a, d), ref, rtol=1e-12)
    # Saturated logits: 1 − σσ rounds to 0 in float32, the stable form stays finite.
    big = torch.tensor([40.0, 90.0], dtype=torch.float32, requires_grad=True)
    out = log_decay(big, big)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(big.grad).all()


def test_next_fast_len() -> None:
    for n in [1, 2, 7, 37, 73, 1000, 2047, 4097]:
        m = next_fast_len(n)
        assert m >= n
        r = m
        for p in (2, 3, 5):
            while r % p == 0:
                r //= p
        assert r == 1


@pytest.mark.parametrize("with_mask", [False, True])
def test_causal_fft_equals_recurrence(with_mask: bool) -> None:
    ema = make_ema()
    torch.manual_seed(1)
    x = torch.randn(3, 29, 6, dtype=DT)
    mask = torch.arange(29) < torch.tensor([29, 20, 5]).unsqueeze(1) if with_mask else None
    with torch.no_grad():
        y, _ = ema(x, mask)
        ref, _ = recurrence(ema, masked(x, mask), slice(0, 6))
    assert torch.allclose(y, F.silu(ref + ema.omega * x), rtol=1e-10, atol=1e-12)


def test_bidirectional_fft_equals_two_recurrences() -> None:
    """Forward and backward recurrences, both including the current token (lag 0)."""
    ema = make_ema(bidirectional=True)
    torch.manual_seed(2)
    x = torch.randn(2, 31, 6, dtype=DT)
    mask = torch.arange(31) < torch.tensor([31, 17]).unsqueeze(1)
    with torch.no_grad():
        y, _ = ema(x, mask)
        xm = masked(x, mask)
        fwd, _ = recurrence(ema, xm, slice(0, 6))
        bwd, _ = recurrence(ema, xm.flip(1), slice(6, 12))
    assert torch.allclose(y, F.silu(fwd + bwd.flip(1) + ema.omega * x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("truncation", [1, 5, 40])
def test_truncated_fft_equals_direct_sum(bidirectional: bool, truncation: int) -> None:
    ema = make_ema(bidirectional=bidirectional, truncation=truncation)
    torch.manual_seed(3)
    x = torch.randn(2, 23, 6, dtype=DT)
    mask = torch.arange(23) < torch.tensor([23, 11]).unsqueeze(1)
    with torch.no_grad():
        y, _ = ema(x, mask)
        K = min(truncation, 23)
        k = naive_kernel(ema, K)
        xm = masked(x, mask)
        ref = direct_sum(k[:6], xm)
        if bidirectional:
            ref = ref + direct_sum(k[6:], xm, backward=True)
    assert torch.allclose(y, F.silu(ref + ema.omega * x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("segments", [[1] * 19, [5, 1, 7, 6], [19], [2, 17]])
def test_streaming_segments_equal_full_pass(segments: list[int]) -> None:
    ema = make_ema(h=3)
    torch.manual_seed(4)
    x = torch.randn(2, 19, 6, dtype=DT)
    mask = torch.arange(19) < torch.tensor([19, 12]).unsqueeze(1)
    with torch.no_grad():
        full, _ = ema(x, mask)
        _, h_ref = recurrence(ema, masked(x, mask), slice(0, 6))
        state, outs, s = ema.initial_state(2, x), [], 0
        for n in segments:
            y, state = ema(x[:, s : s + n], mask[:, s : s + n], state)
            outs.append(y)
            s += n
    assert torch.allclose(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-12)
    assert torch.allclose(state, h_ref, rtol=1e-10, atol=1e-12)


def test_return_state_without_incoming_state() -> None:
    ema = make_ema()
    x = torch.randn(2, 9, 6, dtype=DT)
    with torch.no_grad():
        y, h = ema(x, return_state=True)
        _, h_ref = recurrence(ema, x, slice(0, 6))
        y2, _ = ema(x)
    assert torch.allclose(h, h_ref, rtol=1e-10, atol=1e-12)
    assert torch.allclose(y, y2)


def test_step_is_the_recurrence() -> None:
    ema = make_ema()
    x = torch.randn(2, 6, dtype=DT)
    h0 = torch.randn(2, 6, 4, dtype=DT)
    with torch.no_grad():
        y, h = ema.step(x, h0)
        ref, h_ref = recurrence(ema, x.unsqueeze(1), slice(0, 6), h0)
    assert torch.allclose(h, h_ref) and torch.allclose(y, F.silu(ref[:, 0] + ema.omega * x))


def test_streaming_uses_exact_recurrence_even_when_truncated() -> None:
    """Like the authors' code: the stateful path ignores truncation."""
    ema = make_ema(truncation=3)
    x = torch.randn(1, 12, 6, dtype=DT)
    with torch.no_grad():
        y, _ = ema(x, state=ema.initial_state(1, x))
        ref, _ = recurrence(ema, x, slice(0, 6))
    assert torch.allclose(y, F.silu(ref + ema.omega * x), rtol=1e-10, atol=1e-12)


def test_bidirectional_cannot_stream() -> None:
    ema = make_ema(bidirectional=True)
    x = torch.randn(1, 4, 6, dtype=DT)
    with pytest.raises(ValueError, match="bidirectional"):
        ema(x, return_state=True)


def test_ema_dim_zero_is_silu_of_skip() -> None:
    ema = DampedEMA(6, 0).to(DT)
    x = torch.randn(2, 5, 6, dtype=DT, requires_grad=True)
    y, h = ema(x, return_state=True)
    assert torch.allclose(y, F.silu(ema.omega * x))
    assert h.shape == (2, 6, 0)
    y.sum().backward()
    assert ema.omega.grad is not None and x.grad is not None


@pytest.mark.parametrize("bidirectional", [False, True])
def test_gradients_reach_every_parameter(bidirectional: bool) -> None:
    ema = make_ema(bidirectional=bidirectional, truncation=7)
    x = torch.randn(2, 15, 6, dtype=DT, requires_grad=True)
    y, _ = ema(x)
    (y * torch.randn_like(y)).sum().backward()
    for name, p in ema.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all()


def test_gradcheck_kernel_and_state_paths() -> None:
    ema = make_ema(d=2, h=2, seed=5)
    x = torch.randn(1, 6, 2, dtype=DT, requires_grad=True)
    h0 = torch.randn(1, 2, 2, dtype=DT, requires_grad=True)

    def fn(x, h0):
        y, h = ema(x, state=h0)
        return y, h

    assert torch.autograd.gradcheck(fn, (x, h0))


def test_eval_cache_is_reused_and_never_stale() -> None:
    ema = make_ema(bidirectional=True).eval()
    x = torch.randn(2, 13, 6, dtype=DT)
    with torch.no_grad():
        y1, _ = ema(x)
        key = ema._spectrum.key
        y2, _ = ema(x)
        assert ema._spectrum.key is key and torch.equal(y1, y2)
        ema.eta.mul_(2.0)  # an in-place update invalidates the cached spectrum
        y3, _ = ema(x)
    with torch.no_grad():
        ema.train()
        y4, _ = ema(x)
    assert torch.allclose(y3, y4) and not torch.allclose(y1, y3)
    # With autograd on in eval mode nothing is cached: two backward passes work.
    ema.eval()
    for _ in range(2):
        y, _ = ema(x)
        y.sum().backward()


def test_bf16_autocast_runs_fft_in_float32() -> None:
    ema = DampedEMA(8, 4, bidirectional=True)
    x = torch.randn(2, 33, 8)
    ref, _ = ema(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = ema(x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert (y.float() - ref).abs().max() < 0.1
