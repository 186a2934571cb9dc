"""Mega backbone invariants in float64: streaming, causality, padding, chunking, ablations."""

from __future__ import annotations

import pytest
import torch

from megalab.models.mega import Mega, MegaState

DT = torch.float64
D = 16


def make(seed: int = 0, **kw) -> Mega:
    """A small Mega with every parameter perturbed away from the (near-trivial) init."""
    cfg = dict(d_model=D, num_layers=2, z_dim=8, v_dim=24, ffn_dim=20, ema_dim=4, max_positions=64)
    cfg.update(kw)
    torch.manual_seed(seed)
    model = Mega(**cfg).to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def data(B=2, L=37, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, D, generator=g, dtype=DT)


CAUSAL_CONFIGS = [
    dict(attention_activation="softmax", chunk_size=8, rel_pos_bias="rotary"),
    dict(attention_activation="laplace", chunk_size=8, rel_pos_bias="simple", prenorm=False),
    dict(attention_activation="relu2", chunk_size=-1, rel_pos_bias="simple", norm_type="scalenorm"),
    dict(attention_activation="softmax", chunk_size=-1, rel_pos_bias="rotary", ffn_dim=0),
]


def test_contract_shapes_and_zeroed_pads() -> None:
    model = make(chunk_size=8)
    x = data(L=21)
    mask = torch.arange(21) < torch.tensor([21, 9]).unsqueeze(1)
    y, state = model(x, mask)
    assert y.shape == x.shape and state is None
    assert (y[1, 9:] == 0).all()
    assert model.d_model == D and model.max_len is None
    assert make(chunk_size=-1).max_len == 64
    assert make(chunk_size=-1, rel_pos_bias="rotary").max_len is None


def test_too_long_input_raises_with_advice() -> None:
    model = make(chunk_size=-1, max_positions=16)
    with pytest.raises(ValueError, match=r"max_positions=16.*chunk_size"):
        model(data(L=17))
    causal = make(chunk_size=-1, max_positions=16, causal=True)
    _, state = causal(data(L=10), state=causal.initial_state(2, data(L=10)))
    with pytest.raises(ValueError, match="input length 17"):
        causal(data(L=7), state=state)


@pytest.mark.parametrize("cfg", CAUSAL_CONFIGS)
@pytest.mark.parametrize("segments", [[1] * 11 + [26], [5, 1, 12, 8, 11], [16, 21]])
def test_streaming_equals_one_pass(cfg: dict, segments: list[int]) -> None:
    model = make(causal=True, **cfg)
    x = data()
    mask = torch.arange(37) < torch.tensor([37, 30]).unsqueeze(1)
    for m in (None, mask):
        with torch.no_grad():
            full, _ = model(x, m)
            state, outs, s = model.initial_state(2, x), [], 0
            for n in segments:
                sl = slice(s, s + n)
                y, state = model(x[:, sl], None if m is None else m[:, sl], state)
                outs.append(y)
                s += n
        assert torch.allclose(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-12)


def test_a_stream_starts_from_the_initial_state() -> None:
    model = make(causal=True, chunk_size=8)
    x = data()
    with torch.no_grad():
        full, none = model(x)
        assert none is None  # no state in: a stateless pass, no state out
        y1, state = model(x[:, :13], state=model.initial_state(2, x))
        y2, state = model(x[:, 13:], state=state)
    assert torch.allclose(torch.cat([y1, y2], 1), full, rtol=1e-10, atol=1e-12)
    assert all(t.shape[0] == 2 for layer in state.layers for t in (layer.ema, *layer.kv[:2]))
    assert state.layers[0].kv.key.shape[1] == 37 % 8


@pytest.mark.parametrize("cfg", CAUSAL_CONFIGS)
def test_causal_outputs_ignore_later_tokens(cfg: dict) -> None:
    model = make(causal=True, **cfg)
    x = data()
    x2 = x.clone()
    x2[:, 20:] = 5 * torch.randn_like(x2[:, 20:])
    with torch.no_grad():
        assert torch.allclose(model(x)[0][:, :20], model(x2)[0][:, :20], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(attention_activation="softmax", chunk_size=8, norm_type="scalenorm", prenorm=False),
        dict(attention_activation="laplace", chunk_size=8, truncation=6),
        dict(attention_activation="relu2", chunk_size=-1, rel_pos_bias="rotary"),
        dict(attention_activation="laplace", chunk_size=8, causal=True),
        dict(attention_activation="softmax", chunk_size=5, norm_type="batchnorm"),
    ],
)
def test_real_outputs_ignore_padding(cfg: dict) -> None:
    """Pad values and the amount of padding (hence chunk padding) do not reach real tokens."""
    model = make(**cfg)
    x = data(B=1, L=19)
    with torch.no_grad():
        base, _ = model(x, torch.ones(1, 19, dtype=torch.bool))
        for extra in (1, 5, 13):
            x2 = torch.cat([x, 7 * torch.randn(1, extra, D, dtype=DT)], 1)
            m2 = torch.arange(19 + extra).unsqueeze(0) < 19
            y, _ = model(x2, m2)
            assert torch.allclose(y[:, :19], base, rtol=1e-11, atol=1e-12)
            assert (y[:, 19:] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_chunk_covering_the_sequence_equals_full_attention(causal: bool) -> None:
    full = make(chunk_size=-1, rel_pos_bias="rotary", causal=causal)
    chunked = make(chunk_size=64, rel_pos_bias="rotary", causal=causal)
    chunked.load_state_dict(full.state_dict())
    x = data()
    with torch.no_grad():
        assert torch.allclose(full(x)[0], chunked(x)[0], rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_ema_dim_zero_runs_and_trains(causal: bool) -> None:
    model = make(ema_dim=0, chunk_size=8, causal=causal).train()
    x = data().requires_grad_()
    y, _ = model(x)
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert model.layers[0].maga.ema.omega.grad is not None


@pytest.mark.parametrize("cfg", [dict(), dict(causal=True, chunk_size=8, rel_pos_bias="rotary")])
def test_gradients_reach_every_parameter(cfg: dict) -> None:
    model = make(**cfg).train()
    x = data().requires_grad_()
    mask = torch.arange(37) < torch.tensor([37, 30]).unsqueeze(1)
    y, _ = model(x, mask)
    (y * torch.randn_like(y)).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_state_helpers_and_bidirectional_errors() -> None:
    model = make(causal=True, chunk_size=8)
    x = data()
    _, state = model(x[:, :11], state=model.initial_state(2, x))
    assert isinstance(state, MegaState)
    picked = state.index_select(torch.tensor([1, 1, 0]))
    assert picked.layers[0].ema.shape[0] == 3
    assert torch.equal(picked.layers[1].kv.key[2], state.layers[1].kv.key[0])
    assert not any(t.requires_grad for t in (state.detach().layers[0].ema,))
    encoder = make()
    with pytest.raises(ValueError, match="causal=True"):
        encoder.initial_state(2, x)


def test_authors_init() -> None:
    torch.manual_seed(0)
    model = Mega(d_model=64, num_layers=1, z_dim=32, v_dim=128, ffn_dim=128, ema_dim=16)
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
        assert torch.equal(model(x)[0], model(x)[0])
        model.train()
        assert not torch.equal(model(x)[0], model(x)[0])


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_autocast(causal: bool) -> None:
    torch.manual_seed(0)
    model = Mega(D, 2, 8, 24, 20, 4, chunk_size=8, norm_type="batchnorm", causal=causal)
    x = torch.randn(2, 21, D)
    ref, _ = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = model(x)
    y.float().sum().backward()
    assert torch.isfinite(y).all() and (y.float() - ref).abs().max() < 0.25


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_torch_compile(causal: bool) -> None:
    torch.manual_seed(0)
    model = Mega(D, 2, 8, 24, 20, 4, chunk_size=8, causal=causal).train()
    x = torch.randn(2, 20, D)
    mask = torch.arange(20) < torch.tensor([20, 15]).unsqueeze(1)
    ref, _ = model(x, mask)
    compiled = torch.compile(model)
    y, _ = compiled(x, mask)
    y.sum().backward()
    assert torch.allclose(y, ref, atol=1e-5)
