"""The carried-state calling convention: one `forward`, the layers' `advance`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from megalab.models.llama.model import LlamaAttention, LlamaBlock, LlamaConfig
from megalab.models.mega.model import MegaConfig, MovingAverageGatedAttention
from megalab.models.megalodon.cema import ComplexEMA
from megalab.models.s4d.model import S4DBlock, S4DConfig
from megalab.nn.attention import KVCache
from megalab.nn.carried import CarriedLayer
from megalab.nn.ema import DampedEMA
from megalab.nn.s4d import S4D

B, L, D = 2, 5, 8


class Recorder(CarriedLayer[int]):
    """Returns x and a count of segments seen, recording what `advance` was asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Tensor | None, int | None, bool]] = []

    def advance(
        self, x: Tensor, mask: Tensor | None, state: int | None, want_state: bool
    ) -> tuple[Tensor, int | None]:
        self.calls.append((mask, state, want_state))
        return x, ((state or 0) + 1 if want_state else None)


def test_forward_wants_a_state_when_one_is_passed_or_asked_for() -> None:
    layer, x, mask = Recorder(), torch.zeros(B, L, D), torch.ones(B, L, dtype=torch.bool)
    assert layer(x)[1] is None
    assert layer(x, mask, None, True)[1] == 1
    assert layer(x, state=3)[1] == 4
    assert layer(x=x, mask=mask, state=3, return_state=True)[1] == 4
    assert [want for _, _, want in layer.calls] == [False, True, True, True]
    assert layer.calls[1][0] is mask and layer.calls[2][0] is None


def test_a_layer_without_advance_says_so() -> None:
    with pytest.raises(NotImplementedError, match="advance"):
        CarriedLayer()(torch.zeros(B, L, D))


LLAMA = LlamaConfig(d_model=D, num_layers=1, num_heads=2, ffn_dim=16)


def _initial(layer: Any, like: Tensor) -> Any:
    return layer.initial_state(B, like)


def _llama_cache(layer: Any, like: Tensor) -> KVCache:
    """One layer's empty cache, as the Llama backbone starts a stream."""
    return LLAMA.build().initial_state(B, like).layers[0]


# name -> (the layer, its empty state for a batch like x)
LAYERS: dict[str, tuple[Callable[[], CarriedLayer[Any]], Callable[[Any, Tensor], Any]]] = {
    "DampedEMA": (lambda: DampedEMA(D, 4), _initial),
    "S4D": (lambda: S4D(D, 4), _initial),
    "ComplexEMA": (lambda: ComplexEMA(D, 4), _initial),
    "S4DBlock": (
        lambda: S4DBlock(S4DConfig(d_model=D, state_dim=4, bidirectional=False)),
        _initial,
    ),
    "MAGA": (
        lambda: MovingAverageGatedAttention(
            MegaConfig(d_model=D, z_dim=4, v_dim=8, ema_dim=2, chunk_size=2, causal=True)
        ),
        _initial,
    ),
    "LlamaAttention": (lambda: LlamaAttention(LLAMA), _llama_cache),
    "LlamaBlock": (lambda: LlamaBlock(LLAMA), _llama_cache),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_streaming_layers_share_the_call(name: str) -> None:
    """Each layer is a `CarriedLayer`: no state unless one is wanted, a state in gets its
    successor back, and two segments equal one pass."""
    build, empty = LAYERS[name]
    torch.manual_seed(0)
    layer = build().double().eval()
    assert isinstance(layer, CarriedLayer)
    x = torch.randn(B, L, D, dtype=torch.float64)
    y, none = layer(x)
    assert none is None
    y_started, started = layer(x, return_state=True)
    assert started is not None
    torch.testing.assert_close(y_started, y, rtol=1e-12, atol=1e-12)
    y1, s1 = layer(x[:, :3], None, empty(layer, x))
    assert s1 is not None
    y2, s2 = layer(x[:, 3:], state=s1)
    assert s2 is not None
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, rtol=1e-10, atol=1e-10)


BIDIRECTIONAL: dict[str, Callable[[], CarriedLayer[Any]]] = {
    "DampedEMA": lambda: DampedEMA(D, 4, bidirectional=True),
    "S4D": lambda: S4D(D, 4, bidirectional=True),
    "ComplexEMA": lambda: ComplexEMA(D, 4, bidirectional=True),
    "S4DBlock": lambda: S4DBlock(S4DConfig(d_model=D, state_dim=4, bidirectional=True)),
    "MAGA": lambda: MovingAverageGatedAttention(
        MegaConfig(d_model=D, z_dim=4, v_dim=8, ema_dim=2, causal=False)
    ),
    "LlamaAttention": lambda: LlamaAttention(LlamaConfig(d_model=D, num_heads=2, causal=False)),
}


@pytest.mark.parametrize("name", sorted(BIDIRECTIONAL))
def test_bidirectional_layers_refuse_a_state(name: str) -> None:
    torch.manual_seed(0)
    layer, x = BIDIRECTIONAL[name]().eval(), torch.randn(B, L, D)
    assert layer(x)[1] is None
    with pytest.raises(ValueError, match="sees future tokens and cannot be streamed"):
        layer(x, return_state=True)
