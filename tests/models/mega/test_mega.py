"""Mega-specific invariants in float64 (the shared contract suite covers streaming, causality,
padding, state round trips, compile and bf16 for every model: test_backbone_contract.py)."""

from __future__ import annotations

import pytest
import torch

from megalab.models.mega.model import Mega, MegaConfig, MegaState
from megalab.nn.state import detach_state, select_state

DT = torch.float64
D = 16


def make(seed: int = 0, **kw) -> Mega:
    """A small Mega with every parameter perturbed away from the (near-trivial) init."""
    cfg = dict(d_model=D, num_layers=2, z_dim=8, v_dim=24, ffn_dim=20, ema_dim=4, max_positions=64)
    cfg.update(kw)
    torch.manual_seed(seed)
    model = MegaConfig(**cfg).build().to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def data(B=2, L=37, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, D, generator=g, dtype=DT)


def test_a_stream_starts_from_the_initial_state() -> None:
    model = make(causal=True, chunk_size=8)
    x = data()
    with torch.no_grad():
        full = model(x).y
        assert model(x).state is None  # no state in: a stateless pass, no state out
        out1 = model(x[:, :13], state=model.initial_state(2, x))
        out2 = model(x[:, 13:], state=out1.state)
        y1, y2, state = out1.y, out2.y, out2.state
    assert torch.allclose(torch.cat([y1, y2], 1), full, rtol=1e-10, atol=1e-12)
    assert all(t.shape[0] == 2 for layer in state.layers for t in (layer.ema, *layer.kv[:2]))
    assert state.layers[0].kv.key.shape[1] == 37 % 8


@pytest.mark.parametrize("causal", [False, True])
def test_chunk_covering_the_sequence_equals_full_attention(causal: bool) -> None:
    full = make(chunk_size=-1, rel_pos_bias="rotary", causal=causal)
    chunked = make(chunk_size=64, rel_pos_bias="rotary", causal=causal)
    chunked.load_state_dict(full.state_dict())
    x = data()
    with torch.no_grad():
        assert torch.allclose(full(x).y, chunked(x).y, rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_ema_dim_zero_runs_and_trains(causal: bool) -> None:
    model = make(ema_dim=0, chunk_size=8, causal=causal).train()
    x = data().requires_grad_()
    y = model(x).y
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert model.layers[0].maga.ema.omega.grad is not None


@pytest.mark.parametrize("cfg", [dict(), dict(causal=True, chunk_size=8, rel_pos_bias="rotary")])
def test_gradients_reach_every_parameter(cfg: dict) -> None:
    model = make(**cfg).train()
    x = data().requires_grad_()
    mask = torch.arange(37) < torch.tensor([37, 30]).unsqueeze(1)
    y = model(x, mask).y
    (y * torch.randn_like(y)).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_state_helpers_and_bidirectional_errors() -> None:
    model = make(causal=True, chunk_size=8)
    x = data()
    state = model(x[:, :11], state=model.initial_state(2, x)).state
    assert isinstance(state, MegaState)
    picked = select_state(state, torch.tensor([1, 1, 0]))
    assert picked.layers[0].ema.shape[0] == 3
    assert torch.equal(picked.layers[1].kv.key[2], state.layers[1].kv.key[0])
    assert not detach_state(state).layers[0].ema.requires_grad
    encoder = make()
    with pytest.raises(ValueError, match="causal=True"):
        encoder.initial_state(2, x)


def test_authors_init() -> None:
    torch.manual_seed(0)
    model = MegaConfig(
        d_model=64, num_layers=1, z_dim=32, v_dim=128, ffn_dim=128, ema_dim=16
    ).build()
    maga = model.layers[0].maga
    for lin in (maga.v_proj, maga.mx_proj, maga.h_proj, model.layers[0].ffn.fc1):
        assert abs(lin.weight.std().item() - 0.02) < 2e-3 and lin.bias.abs().sum() == 0
    assert abs(maga.kappa.std().item() - 0.02) < 5e-3 and maga.mu.abs().sum() == 0
    ema = maga.ema
    assert ema.alpha.shape == (128, 16)  # bidirectional: two kernel sets
    pattern = torch.tensor([1.0, -1.0] * 8)
    assert (ema.beta - pattern).abs().max() < 0.15
    assert abs(ema.alpha.std().item() - 0.2) < 0.02 and abs(ema.eta.std().item() - 1) < 0.1
    assert abs(maga.attention.rel_pos_bias.weight.std().item() - 0.02) < 3e-3


def test_dropouts_are_active_only_in_training() -> None:
    model = make(dropout=0.3, attention_dropout=0.3, hidden_dropout=0.3, activation_dropout=0.3)
    x = data()
    with torch.no_grad():
        assert torch.equal(model(x).y, model(x).y)
        model.train()
        assert not torch.equal(model(x).y, model(x).y)
