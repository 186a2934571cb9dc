"""TimestepNorm and the classifiers' group norm (`megalab.models.megalodon.timestep_norm`): the
cumulative statistics of eq. 4 against a direct loop (any padding), gradients, streaming = one pass,
stability over 1M steps, and GroupNorm against `torch.nn.GroupNorm`. The authors' numbers are
in tests/models/megalodon/test_megalodon_golden.py."""

from __future__ import annotations

import pytest
import torch
from megalodon_segments import run_segments

from megalab.models.megalodon.timestep_norm import (
    SequenceGroupNorm,
    TimestepNorm,
    TimestepNormState,
)

DT = torch.float64


def norm(D: int = 8, G: int = 2, cls=TimestepNorm):
    torch.manual_seed(0)
    m = cls(D, G).to(DT)
    with torch.no_grad():
        m.weight.normal_(0.0, 0.3)
        m.bias.normal_(0.0, 0.3)
    return m


def direct(m: TimestepNorm, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 4 literally: statistics over every feature of the group at every real step <= t."""
    B, L, D = x.shape
    G = m.num_groups
    y = torch.zeros_like(x)
    for b in range(B):
        for t in range(L):
            if not mask[b, t]:
                continue
            seen = x[b, : t + 1][mask[b, : t + 1]].view(-1, G, D // G)  # (steps, G, D/G)
            mu = seen.mean(dim=(0, 2))
            var = seen.var(dim=(0, 2), unbiased=False)
            xn = (x[b, t].view(G, -1) - mu[:, None]) / torch.sqrt(var[:, None] + m.eps)
            y[b, t] = xn.reshape(D) * (1 + m.weight) + m.bias
    return y


MASKS = {
    "none": [[1] * 12, [1] * 12],
    "right": [[1] * 12, [1] * 7 + [0] * 5],
    "left_and_middle": [[0, 0] + [1] * 10, [1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1]],
}


@pytest.mark.parametrize("pads", list(MASKS))
def test_matches_eq4_with_any_padding(pads: str) -> None:
    m = norm()
    x = 3.0 + torch.randn(2, 12, 8, dtype=DT)
    mask = torch.tensor(MASKS[pads], dtype=torch.bool)
    y, _ = m(x, mask)
    torch.testing.assert_close(y, direct(m, x, mask), rtol=1e-12, atol=1e-12)
    assert (y[~mask] == 0).all()


def test_gradients_with_padding_in_the_middle_and_a_carried_state() -> None:
    """Where the authors' CPU backward is wrong (pads followed by real steps), ours is exact."""
    m = norm(D=4, G=2)
    x = torch.randn(2, 7, 4, dtype=DT, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    mean = torch.randn(2, 2, dtype=DT, requires_grad=True)
    var = torch.rand(2, 2, dtype=DT, requires_grad=True)
    count = torch.tensor([3, 0])

    def f(x, mean, var):
        y, s = m(x, mask, TimestepNormState(count, mean, var + 0.5))
        return y, s.mean, s.var

    assert torch.autograd.gradcheck(f, (x, mean, var))


@pytest.mark.parametrize("segments", [[1] * 16, [5, 1, 10], [16]])
def test_streaming_equals_one_pass(segments: list[int]) -> None:
    m = norm()
    x = torch.randn(2, 16, 8, dtype=DT)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 3:6] = False
    full, last = m(x, mask, m.initial_state(2, x))
    streamed, state = run_segments(m, x, mask, m.initial_state(2, x), segments)
    torch.testing.assert_close(streamed, full, rtol=1e-12, atol=1e-12)
    assert torch.equal(state.count, torch.tensor([16, 13]))
    torch.testing.assert_close(state.mean, last.mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.var, last.var, rtol=1e-12, atol=1e-12)


def test_stable_over_a_million_steps_in_float32() -> None:
    """1M steps of data with mean 1000 and std 1 in float32: the statistics stay within 1e-5 of
    float64's (the plain E[x²] − E[x]² in float32 loses every digit of the variance here)."""
    L, D, G = 1_000_000, 4, 2
    g = torch.Generator().manual_seed(0)
    spread = torch.linspace(0.5, 2.0, L, dtype=DT)[:, None]  # a drifting variance
    x64 = 1000.0 + torch.randn(1, L, D, generator=g, dtype=DT) * spread
    m = TimestepNorm(D, G)
    with torch.no_grad():
        state = m.initial_state(1, x64.float())
        y, state = m(x64.float(), state=state)
    xg = x64.view(1, L, G, D // G)
    n = torch.arange(1, L + 1, dtype=DT).view(1, L, 1)
    mean = xg.sum(-1).cumsum(1) / (n * D // G)
    # float64 references: the final state is the statistics of the whole sequence (two-pass)
    ref_mean = mean[:, -1]
    ref_var = xg.reshape(1, L, G, -1).permute(0, 2, 1, 3).reshape(1, G, -1).var(-1, unbiased=False)
    assert ((state.mean.double() - ref_mean).abs() / ref_mean.abs()).max() < 1e-7
    assert ((state.var.double() - ref_var).abs() / ref_var).max() < 1e-5
    # outputs at a few positions against the direct formula in float64
    for t in (0, 1, 999, 123_456, L - 1):
        seen = xg[0, : t + 1].permute(1, 0, 2).reshape(G, -1)
        ref = (xg[0, t] - seen.mean(-1, keepdim=True)) / torch.sqrt(
            seen.var(-1, unbiased=False, keepdim=True) + m.eps
        )
        assert (y[0, t].double().view(G, -1) - ref).abs().max() < 1e-3, t
    x32 = x64.float().view(1, L, G, -1)
    ex2 = x32.square().mean(-1).cumsum(1)[:, -1] / L
    naive32 = ex2 - (x32.mean(-1).cumsum(1)[:, -1] / L).square()
    assert ((naive32.double() - ref_var).abs() / ref_var).max() > 1e-2


def test_group_norm_matches_torch_and_ignores_padding() -> None:
    m = norm(cls=SequenceGroupNorm)
    x = torch.randn(2, 11, 8, dtype=DT)
    ref = torch.nn.GroupNorm(2, 8, eps=m.eps).to(DT)
    with torch.no_grad():
        ref.weight.copy_(1 + m.weight)
        ref.bias.copy_(m.bias)
    y, state = m(x)
    assert state is None
    torch.testing.assert_close(y, ref(x.transpose(1, 2)).transpose(1, 2))
    padded = torch.cat([x, 9 * torch.randn(2, 4, 8, dtype=DT)], 1)
    padded[1, -1] = float("nan")
    mask = torch.arange(15) < 11
    yp, _ = m(padded, mask.expand(2, 15))
    torch.testing.assert_close(yp[:, :11], y)
    assert (yp[:, 11:] == 0).all()
    with pytest.raises(ValueError, match="cannot be streamed"):
        m(x, state=TimestepNormState(torch.zeros(2), torch.zeros(2, 2), torch.ones(2, 2)))


def test_groups_must_divide_the_features() -> None:
    with pytest.raises(ValueError, match="multiple of num_groups"):
        TimestepNorm(10, 4)
