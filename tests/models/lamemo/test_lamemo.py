"""LaMemo invariants beyond the golden data: without look-ahead it is Transformer-XL, the
interpolation is an online-softmax merge (App. A), the look-ahead never sees past the first
current token, gradients stop where the code stops them, parameter counts (Tables 1-2), the
v₋ initialisation, the α the model reports, and its ablation switches."""

from __future__ import annotations

import pytest
import torch

from megalab.models.lamemo.model import LaMemo, LaMemoConfig, interpolation_weight
from megalab.models.transformer_xl.model import TransformerXLConfig
from megalab.nn.adaptive_xl import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from megalab.tasks.language_modeling import LanguageModelingTask

DT = torch.float64
TINY = dict(d_model=16, num_layers=2, num_heads=2, head_dim=8, ffn_dim=32)


def tiny(**kw) -> LaMemo:
    torch.manual_seed(0)
    model = LaMemoConfig(**TINY, **kw).build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.to(DT).eval()


def stream(model, x, segments):
    state = model.initial_state(x.shape[0], x)
    ys, s = [], 0
    for n in segments:
        out = model(x[:, s : s + n], state=state)
        ys.append(out.y)
        state, s = out.state, s + n
    return torch.cat(ys, 1), state


def test_without_look_ahead_it_is_transformer_xl() -> None:
    """Table 3's "w/o look-ahead" keeps each memory row's causal context: the refreshed memory
    is XL's cached hidden states, so with the same weights every output equals XL's, also with
    a memory shorter than the stream."""
    lamemo = tiny(mem_len=8, look_ahead=False)
    xl = TransformerXLConfig(**TINY, mem_len=8).build().to(DT).eval()
    state = {k: v for k, v in lamemo.state_dict().items() if k != "v_future"}
    xl.load_state_dict(state)
    x = torch.randn(2, 23, 16, dtype=DT)
    with torch.no_grad():
        a, _ = stream(lamemo, x, [6, 6, 1, 1, 9])
        b, _ = stream(xl, x, [6, 6, 1, 1, 9])
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_interpolation_is_an_online_softmax_merge() -> None:
    """App. A: with the same query, α·C_past + (1 − α)·C_future (α from the two log-sum-exps,
    ε = 0) is one softmax over past ∪ future keys."""
    torch.manual_seed(1)
    s_past, s_future = torch.randn(3, 5, dtype=DT), torch.randn(3, 4, dtype=DT)
    v_past, v_future = torch.randn(5, 7, dtype=DT), torch.randn(4, 7, dtype=DT)
    c_past = torch.softmax(s_past, -1) @ v_past
    c_future = torch.softmax(s_future, -1) @ v_future
    alpha = interpolation_weight(s_past.logsumexp(-1), s_future.logsumexp(-1), 0.0)
    merged = alpha[:, None] * c_past + (1 - alpha[:, None]) * c_future
    union = torch.softmax(torch.cat([s_past, s_future], -1), -1) @ torch.cat([v_past, v_future])
    torch.testing.assert_close(merged, union, rtol=1e-12, atol=1e-12)


def test_look_ahead_stops_at_the_first_current_token() -> None:
    """The memory is refreshed by the first token of the segment only: the outputs of a segment
    and the next memory ignore all later tokens (no leakage through the refreshed memory)."""
    model = tiny(mem_len=6)
    x = torch.randn(1, 12, 16, dtype=DT)
    with torch.no_grad():
        _, state = stream(model, x, [6])
        out, details = model.forward_details(x[:, 6:], state=state)
        x2 = x.clone()
        x2[:, 7:] = torch.randn_like(x2[:, 7:])
        out2, details2 = model.forward_details(x2[:, 6:], state=state)
    torch.testing.assert_close(details[1]["mem_out"], details2[1]["mem_out"], rtol=0, atol=0)
    torch.testing.assert_close(out.y[:, :1], out2.y[:, :1], rtol=0, atol=0)
    # Each memory row attends strictly to its right, within the window ending at row m.
    probs = details[0]["attn_prob_mem"][0, 0]
    assert probs.shape == (6, 6)
    # Column c is key c + 1 of [memory; segment]: row i sees c >= i, the last column always.
    assert torch.count_nonzero(probs.tril(-1)) == 0 and (probs[:, -1] > 0).all()


def test_gradients_flow_through_the_refresh_and_alpha_but_not_the_carried_state() -> None:
    model = tiny(mem_len=6)
    x = torch.randn(1, 12, 16, dtype=DT)
    _, state = stream(model, x, [6])
    assert all(not t.requires_grad for t in [state.embeddings, *state.contexts])
    model.zero_grad()
    model(x[:, 6:], state=state).y.sum().backward()
    assert model.v_future.grad is not None and model.v_future.grad.abs().sum() > 0
    # No memory yet: the look-ahead bias gets nothing.
    model.zero_grad()
    model(x[:, :6], state=model.initial_state(1, x)).y.sum().backward()
    assert model.v_future.grad is None


def test_alpha_reported_per_layer() -> None:
    model = tiny(mem_len=6)
    x = torch.randn(2, 12, 16, dtype=DT)
    with torch.no_grad():
        out = model(x[:, :6], state=model.initial_state(2, x))
        assert out.aux == {}
        out = model(x[:, 6:], state=out.state)
    assert (
        out.aux["alpha"].shape == (2,) and ((out.aux["alpha"] > 0) & (out.aux["alpha"] < 1)).all()
    )


def test_ablations() -> None:
    x = torch.randn(1, 12, 16, dtype=DT)
    no_interp = tiny(mem_len=6, interpolation=False)
    with torch.no_grad():
        _, state = stream(no_interp, x, [6])
        _, det = no_interp.forward_details(x[:, 6:], state=state)
    assert (det[0]["alpha"] == 0).all()
    xl_rpe = tiny(mem_len=6, rpe="xl")
    assert xl_rpe.v_future is None
    with torch.no_grad():
        y, _ = stream(xl_rpe, x, [6, 6])
    assert torch.isfinite(y).all()
    with pytest.raises(ValueError, match="unknown rpe"):
        LaMemoConfig(**TINY, rpe="absolute").build()


def test_v_future_keeps_its_xavier_initialisation() -> None:
    torch.manual_seed(0)
    model = LaMemoConfig(d_model=410, num_layers=1, num_heads=10, head_dim=41, ffn_dim=8).build()
    bound = (6 / (10 + 41)) ** 0.5  # xavier_uniform on (H, d): ±0.343
    assert model.v_future.abs().max() <= bound and model.v_future.abs().max() > 0.3
    assert model.u.std() < 0.03 and model.v.std() < 0.03  # N(0, 0.02)


def count(vocab: int, **kw) -> int:
    with torch.device("meta"):
        task = LanguageModelingTask(
            AdaptiveEmbedding(vocab, kw["d_model"]),
            LaMemoConfig(**kw).build(),
            ProjectedAdaptiveLogSoftmax(kw["d_model"], vocab),
            tie_weights=True,
        )
    return sum(p.numel() for p in task.parameters())


def test_parameter_counts() -> None:
    """Table 1: 151M on WikiText-103 (267,735 words); the character-level models (Table 2, no
    count printed; docs/reference/lamemo-paper.md §2): ≈41.06M on enwik8 (204 symbols in XL's
    vocabulary) and ≈40.97M on text8 (27)."""
    wt103 = dict(d_model=410, num_layers=16, num_heads=10, head_dim=41, ffn_dim=2100)
    char = dict(d_model=512, num_layers=12, num_heads=8, head_dim=64, ffn_dim=2048)
    assert round(count(267735, **wt103) / 1e6, 1) == 151.1
    assert round(count(204, **char) / 1e6, 2) == 41.06
    assert round(count(27, **char) / 1e6, 2) == 40.97
    # v₋ is the only parameter LaMemo adds to Transformer-XL: 410 on WikiText-103.
    with torch.device("meta"):
        extra = sum(p.numel() for p in LaMemoConfig(**wt103).build().parameters()) - sum(
            p.numel() for p in TransformerXLConfig(**wt103).build().parameters()
        )
    assert extra == 410
