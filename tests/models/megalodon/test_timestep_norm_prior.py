"""TimestepNorm's learnable prior (the authors' `prior_count > 0`) in float64 against the code's
sequential Welford merge started from (prior_count, prior_mean, exp(prior_logv)), and its
checkpoint mapping."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from megalab.models.megalodon.convert import convert_timestep_norm
from megalab.models.megalodon.model import MegalodonConfig
from megalab.models.megalodon.timestep_norm import TimestepNorm

DT = torch.float64
B, L, D, G = 2, 9, 12, 3
EPS = 1e-5


def reference(
    x: Tensor, mask: Tensor, count: int, mean0: Tensor, var0: Tensor, w: Tensor, b: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The code's TimestepNorm: per step, the group mean m and population variance v merge into
    (c, μ, σ²) by c' = c + 1, μ' = μ + (m − μ)/c', σ'² = (c/c')σ² + v/c' + (c/c'²)(m − μ)²;
    y = (x − μ)/√(σ² + ε)·(1 + w) + b, and a padded step outputs 0 and changes nothing."""
    xg = x.view(B, L, G, D // G)
    m_all = xg.mean(-1)
    v_all = xg.var(-1, unbiased=False)
    c = torch.full((B, 1), float(count), dtype=DT)
    mu = mean0.expand(B, G)
    var = var0.expand(B, G)
    ys = []
    for t in range(L):
        real = mask[:, t : t + 1]
        m, v = m_all[:, t], v_all[:, t]
        c1 = c + 1
        mu1 = mu + (m - mu) / c1
        var1 = c / c1 * var + v / c1 + c / c1.square() * (m - mu).square()
        c = torch.where(real, c1, c)
        mu = torch.where(real, mu1, mu)
        var = torch.where(real, var1, var)
        y = (xg[:, t] - mu.unsqueeze(-1)) / torch.sqrt(var + EPS).unsqueeze(-1)
        y = y.reshape(B, D) * (1 + w) + b
        ys.append(torch.where(real, y, torch.zeros_like(y)))
    return torch.stack(ys, 1), c.squeeze(1), mu, var


def make(prior_count: int, seed: int = 0) -> TimestepNorm:
    torch.manual_seed(seed)
    norm = TimestepNorm(D, G, prior_count=prior_count).to(DT)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return norm


def inputs() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = 2.0 + 1.5 * torch.randn(B, L, D, generator=g, dtype=DT)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 3] = mask[1, 7:] = False
    return x, mask


@pytest.mark.parametrize("prior_count", [1, 4])
def test_prior_starts_the_statistics_as_in_the_code(prior_count: int) -> None:
    norm = make(prior_count)
    assert norm.prior_mean is not None and norm.prior_logv is not None
    x, mask = inputs()
    x.requires_grad_(True)
    y, state = norm(x, mask)
    assert state is None  # a stateless pass returns no state, from the prior as from count 0
    mean0, var0 = norm.prior_mean, norm.prior_logv.exp()
    want, *_ = reference(x, mask, prior_count, mean0, var0, norm.weight, norm.bias)
    assert torch.allclose(y, want, atol=1e-12, rtol=0)
    # Gradients reach the prior mean and log-variance exactly as through the code's formulas.
    g = torch.randn_like(y)
    ours = torch.autograd.grad((y * g).sum(), [x, norm.prior_mean, norm.prior_logv])
    theirs = torch.autograd.grad((want * g).sum(), [x, norm.prior_mean, norm.prior_logv])
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)
    assert ours[1].abs().sum() > 0 and ours[2].abs().sum() > 0


def test_prior_streams_from_the_initial_state() -> None:
    norm = make(3)
    x, mask = inputs()
    with torch.no_grad():
        full, _ = norm(x, mask)
        state = norm.initial_state(B, x)
        assert state.count.tolist() == [3, 3]
        y1, state = norm(x[:, :4], mask[:, :4], state)
        y2, state = norm(x[:, 4:], mask[:, 4:], state)
        assert torch.allclose(torch.cat([y1, y2], 1), full, atol=1e-12, rtol=0)
        assert norm.prior_mean is not None and norm.prior_logv is not None
        _, count, mean, var = reference(
            x, mask, 3, norm.prior_mean, norm.prior_logv.exp(), norm.weight, norm.bias
        )
        assert state is not None and torch.equal(state.count, count.long())
        assert torch.allclose(state.mean, mean, atol=1e-12) and torch.allclose(state.var, var)


def test_count_zero_is_unchanged() -> None:
    """No prior: no extra parameters or buffers, and statistics from the first real step."""
    norm = make(0)
    assert set(norm.state_dict()) == {"weight", "bias"} and norm.prior_count is None
    x, mask = inputs()
    with torch.no_grad():
        y, _ = norm(x, mask)
        want, *_ = reference(x, mask, 0, torch.zeros(G, dtype=DT), torch.ones(G, dtype=DT),
                             norm.weight, norm.bias)  # fmt: skip
        assert torch.allclose(y, want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="prior_count must be >= 0"):
        TimestepNorm(D, G, prior_count=-1)


def test_checkpoint_prior_converts_and_loads_strictly() -> None:
    theirs = {
        "weight": torch.randn(D, dtype=DT), "bias": torch.randn(D, dtype=DT),
        "prior_count": torch.tensor(5), "prior_mean": torch.randn(G, dtype=DT),
        "prior_logv": torch.randn(G, dtype=DT),
    }  # fmt: skip
    sd = convert_timestep_norm(theirs)
    norm = TimestepNorm(D, G, prior_count=5).to(DT)
    norm.load_state_dict(sd, strict=True)
    assert norm.prior_count is not None and int(norm.prior_count) == 5
    assert norm.prior_mean is not None and torch.equal(norm.prior_mean, theirs["prior_mean"])
    # A model built without the prior cannot silently drop it.
    with pytest.raises(RuntimeError, match="prior_mean"):
        TimestepNorm(D, G).to(DT).load_state_dict(sd, strict=True)
    # At count 0 the code's prior buffers are unused and dropped.
    unused = theirs | {"prior_count": torch.tensor(0)}
    assert set(convert_timestep_norm(unused)) == {"weight", "bias"}
    with pytest.raises(KeyError, match="unexpected TimestepNorm entry 'prior'"):
        convert_timestep_norm(theirs | {"prior": torch.zeros(1)})


def test_megalodon_norm_prior_count() -> None:
    kw = dict(d_model=D, num_layers=1, z_dim=8, v_dim=12, ffn_dim=16, cema_dim=2, chunk_size=4,
              norm_groups=G)  # fmt: skip
    model = MegalodonConfig(**kw, norm_prior_count=2).build()
    counts = [int(b) for n, b in model.named_buffers() if n.endswith("prior_count")]
    assert counts == [2, 2]  # the block's norm and the final norm
    with pytest.raises(ValueError, match="norm_prior_count is the learned prior"):
        MegalodonConfig(**kw, causal=False, norm_prior_count=2)
