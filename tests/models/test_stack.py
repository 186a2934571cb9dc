"""The shared stack of blocks (`megalab.models.stack`): what `run_stack` promises on its own.

Per-layer state threaded in order (a stream equals one pass), padded positions zeroed at the
input and the output, blocks called as they are (wrapped by activation checkpointing or any
wrapper module), checkpointing that recomputes without changing results, and what blocks return
beyond their state handed back.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from megalab.models import MegaConfig
from megalab.models.stack import run_stack
from megalab.nn.masking import zero_pads


class RunningSum(nn.Module):
    """A toy carried block: y_t = w ⊙ x_t + s + Σ_{u≤t} x_u, new s = s + Σ_t x_t (s: (B, D)).

    It records the input and the state it was called with, so tests can see what it got.
    """

    def __init__(self, d: int, scale: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((d,), scale, dtype=torch.float64))
        self.calls: list[tuple[Tensor, Tensor | None, dict[str, Any]]] = []

    def initial_state(self, batch_size: int, like: Tensor) -> Tensor:
        return like.new_zeros(batch_size, like.shape[-1])

    def forward(
        self, x: Tensor, mask: Tensor | None = None, state: Tensor | None = None, **kwargs: Any
    ) -> tuple[Tensor, Tensor | None, str]:
        self.calls.append((x.detach().clone(), state, kwargs))
        start = 0 if state is None else state.unsqueeze(1)
        y = self.w * x + start + x.cumsum(dim=1)
        new_state = None if state is None else state + x.sum(dim=1)
        return y, new_state, f"report of {self.w[0].item():g}"


class Forwarding(nn.Module):
    """A wrapper as FSDP or a checkpoint wrapper makes: the block inside, called through."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def _blocks(n: int = 3, d: int = 4) -> nn.ModuleList:
    return nn.ModuleList(RunningSum(d, scale=0.5 + i) for i in range(n))


def _inputs(B: int = 2, L: int = 6, d: int = 4) -> tuple[Tensor, Tensor]:
    torch.manual_seed(0)
    x = torch.randn(B, L, d, dtype=torch.float64)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, -2:] = False
    return x, mask


def test_each_block_gets_its_own_state_and_returns_it_in_order() -> None:
    blocks = _blocks()
    x, _ = _inputs()
    states = [torch.full((2, 4), float(10 * i), dtype=torch.float64) for i in range(3)]
    out = run_stack(blocks, x, None, states)
    assert out.states is not None and len(out.states) == 3
    h = x
    for i, block in enumerate(blocks):
        (seen_x, seen_state, _), = block.calls  # fmt: skip
        assert seen_state is states[i]
        torch.testing.assert_close(seen_x, h, rtol=0, atol=0)
        torch.testing.assert_close(out.states[i], states[i] + h.sum(dim=1), rtol=0, atol=0)
        h = block.w * h + states[i].unsqueeze(1) + h.cumsum(dim=1)
    torch.testing.assert_close(out.y, h, rtol=0, atol=0)


def test_stateless_pass_gives_no_state() -> None:
    blocks = _blocks()
    x, _ = _inputs()
    out = run_stack(blocks, x)
    assert out.states is None
    assert all(call[1] is None for block in blocks for call in block.calls)


def test_streaming_segments_equals_one_pass() -> None:
    blocks = _blocks()
    x, _ = _inputs(L=9)
    whole = run_stack(blocks, x, None, [b.initial_state(2, x) for b in blocks])
    states: list[Any] | None = [b.initial_state(2, x) for b in blocks]
    ys = []
    for part in x.split([4, 1, 4], dim=1):
        out = run_stack(blocks, part, None, states)
        ys.append(out.y)
        states = out.states
    torch.testing.assert_close(torch.cat(ys, dim=1), whole.y, rtol=1e-12, atol=1e-12)
    assert states is not None and whole.states is not None
    for mine, theirs in zip(states, whole.states, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_padded_positions_are_zeroed_at_input_and_output() -> None:
    blocks = _blocks()
    x, mask = _inputs()
    x = x.clone()
    x[1, -2:] = 1e6  # whatever sits at padded positions must not reach a block
    out = run_stack(blocks, x, mask, final=lambda h: h + 1.0)  # a final step nonzero at pads
    first_input = blocks[0].calls[0][0]
    assert torch.equal(first_input[1, -2:], torch.zeros_like(first_input[1, -2:]))
    assert torch.equal(out.y[1, -2:], torch.zeros_like(out.y[1, -2:]))
    torch.testing.assert_close(out.y[0], run_stack(blocks, x[:1]).y[0] + 1.0)
    assert torch.equal(zero_pads(x, None), x)


def test_input_dropout_before_the_mask_and_kwargs_and_extras_reach_each_block() -> None:
    blocks = _blocks()
    x, mask = _inputs()
    out = run_stack(blocks, x, mask, input_dropout=lambda h: 2.0 * h, offset=7)
    torch.testing.assert_close(blocks[0].calls[0][0], zero_pads(2.0 * x, mask))
    assert all(block.calls[0][2] == {"offset": 7} for block in blocks)
    assert out.extras == [("report of 0.5",), ("report of 1.5",), ("report of 2.5",)]


@pytest.mark.parametrize("wrap", [Forwarding, checkpoint_wrapper])
def test_wrapped_blocks_run_as_they_are(wrap: Any) -> None:
    blocks = _blocks()
    x, mask = _inputs()
    states = [b.initial_state(2, x) for b in blocks]
    plain = run_stack(blocks, x, mask, states)
    wrapped = nn.ModuleList(wrap(b) for b in blocks)
    out = run_stack(wrapped, x, mask, states)
    assert all(len(b.calls) == 2 for b in blocks)  # every inner block ran once more
    torch.testing.assert_close(out.y, plain.y, rtol=0, atol=0)
    assert out.states is not None and plain.states is not None
    for a, b in zip(out.states, plain.states, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpointing_recomputes_blocks_with_the_same_gradients() -> None:
    blocks = _blocks()
    x, mask = _inputs()
    grads = []
    for checkpoint in (False, True):
        for block in blocks:
            block.calls.clear()
            block.w.grad = None
        out = run_stack(blocks, x, mask, checkpoint=checkpoint)
        out.y.square().sum().backward()
        # recomputed in the backward: each block ran twice with checkpointing, once without
        assert all(len(block.calls) == (2 if checkpoint else 1) for block in blocks)
        grads.append([block.w.grad.clone() for block in blocks if block.w.grad is not None])
    for plain, checkpointed in zip(*grads, strict=True):
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)


def test_a_state_for_another_number_of_layers_is_refused() -> None:
    blocks = _blocks()
    x, _ = _inputs()
    with pytest.raises(ValueError, match="the state holds 2 layers, the model has 3"):
        run_stack(blocks, x, None, [b.initial_state(2, x) for b in list(blocks)[:2]])


def test_a_model_on_the_stack_streams_with_wrapped_blocks() -> None:
    """Mega with each block behind activation checkpointing's wrapper (as
    `apply_activation_checkpointing` leaves it): one pass, its gradients and a stream in two
    segments agree with the plain model (the backbone hands `self.layers` to the stack as they
    are)."""
    torch.manual_seed(0)
    kw = dict(d_model=16, num_layers=2, z_dim=8, v_dim=16, ffn_dim=16, ema_dim=4, chunk_size=4)
    model = MegaConfig(causal=True, **kw).build().double()  # type: ignore[arg-type]
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, -3:] = False
    reference = model(x, mask).y
    reference.square().sum().backward()
    plain_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    model.layers = nn.ModuleList(checkpoint_wrapper(b) for b in model.layers)
    y = model(x, mask).y
    torch.testing.assert_close(y, reference, rtol=0, atol=0)
    y.square().sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(plain_grads)
    for g, plain in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(g, plain, rtol=1e-12, atol=1e-14)
    state = model.initial_state(2, x)
    first = model(x[:, :6], mask[:, :6], state)
    second = model(x[:, 6:], mask[:, 6:], first.state)
    torch.testing.assert_close(torch.cat([first.y, second.y], 1), reference)
    assert torch.equal(reference[0, -3:], torch.zeros_like(reference[0, -3:]))
