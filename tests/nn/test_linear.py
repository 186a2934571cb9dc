"""`joint_linear`: several projections of one input as one product, equal to the layers' own.

The joined product runs on CUDA; here `joined_on("cpu")` takes the same path on the CPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from megalab.models.llama.model import Llama, LlamaConfig
from megalab.models.megalodon.model import Megalodon, MegalodonConfig
from megalab.nn.linear import joined_on, joint_linear


def _layers(bias: bool, dtype: torch.dtype = torch.float64) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(6, n, bias=bias, dtype=dtype) for n in (3, 5, 6)]


def _outputs_and_grads(
    layers: list[nn.Linear], x: torch.Tensor, joint: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    for p in [x, *(p for lin in layers for p in lin.parameters())]:
        p.grad = None
    with joined_on("cpu"):
        ys = joint_linear(x, *layers) if joint else tuple(lin(x) for lin in layers)
    sum(((i + 1) * y.sin()).sum() for i, y in enumerate(ys)).backward()
    grads = [x.grad, *(p.grad for lin in layers for p in lin.parameters())]
    return [y.detach() for y in ys], [g for g in grads if g is not None]


@pytest.mark.parametrize("bias", [True, False])
def test_joint_equals_separate_outputs_and_gradients(bias: bool) -> None:
    layers = _layers(bias)
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    ys, gs = _outputs_and_grads(layers, x, joint=True)
    ys_ref, gs_ref = _outputs_and_grads(layers, x, joint=False)
    assert [y.shape for y in ys] == [(2, 4, 3), (2, 4, 5), (2, 4, 6)]
    assert len(gs) == len(gs_ref) == 1 + len(layers) * (2 if bias else 1)
    for a, b in zip([*ys, *gs], [*ys_ref, *gs_ref]):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_joint_under_bf16_autocast_matches_the_layers() -> None:
    layers = _layers(True, torch.float32)
    x = torch.randn(3, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16), joined_on("cpu"):
        ys = joint_linear(x, *layers)
        refs = [lin(x) for lin in layers]
    for y, ref in zip(ys, refs):
        assert y.dtype == ref.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_one_product_for_plain_layers() -> None:
    """The joined call runs one matrix product; the outputs are views of it."""
    layers = _layers(True)
    x = torch.randn(2, 6, dtype=torch.float64)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof, joined_on("cpu"):
        ys = joint_linear(x, *layers)
    products = [e for e in prof.events() if e.name in ("aten::addmm", "aten::mm")]
    assert len(products) == 1
    assert all(y._base is not None for y in ys)


def test_the_cpu_runs_the_layers_as_they_are_outside_joined_on() -> None:
    layers = _layers(True)
    x = torch.randn(2, 6, dtype=torch.float64)
    for y, lin in zip(joint_linear(x, *layers), layers):
        assert y._base is None
        assert torch.equal(y, lin(x))
    with joined_on("cpu"):
        assert joint_linear(x, *layers)[0]._base is not None
    assert joint_linear(x, *layers)[0]._base is None  # restored on leaving


class _Scaled(nn.Linear):
    """A subclass whose forward adds something (as a LoRA or float8 linear would)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_subclasses_hooks_and_mixed_biases_are_called_as_themselves() -> None:
    x = torch.randn(2, 6, dtype=torch.float64)
    plain, other = _layers(True)[:2]
    stack = contextlib.ExitStack()
    stack.enter_context(joined_on("cpu"))
    scaled = _Scaled(6, 4, dtype=torch.float64)
    torch.testing.assert_close(joint_linear(x, plain, scaled)[1], scaled(x))
    torch.testing.assert_close(joint_linear(x, plain, scaled)[1], 2 * nn.Linear.forward(scaled, x))

    calls: list[str] = []
    handle = other.register_forward_hook(lambda *_: calls.append("hook"))
    joint_linear(x, plain, other)
    handle.remove()
    assert calls == ["hook"]

    global_calls: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(lambda *_: global_calls.append("hook"))
    joint_linear(x, plain, other)
    handle.remove()
    assert global_calls == ["hook", "hook"]

    no_bias = nn.Linear(6, 2, bias=False, dtype=torch.float64)
    y0, y1 = joint_linear(x, plain, no_bias)
    torch.testing.assert_close(y1, no_bias(x))
    assert y0._base is None  # called separately
    stack.close()


@pytest.mark.parametrize("name", ["llama", "megalodon", "megalodon_swiglu"])
def test_blocks_joined_equal_blocks_separate(name: str) -> None:
    """The models that join projections give the same outputs and gradients either way."""
    torch.manual_seed(0)
    if name == "llama":
        model: nn.Module = Llama(LlamaConfig(d_model=32, num_layers=2, num_heads=4, ffn_dim=48))
    else:
        cfg = MegalodonConfig(
            d_model=32, num_layers=2, z_dim=16, v_dim=32, num_heads=2, ffn_dim=48,
            chunk_size=8, norm_groups=4, swiglu=name.endswith("swiglu"),
        )  # fmt: skip
        model = Megalodon(cfg)
    model = model.double()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 11:] = False

    products: dict[bool, int] = {}

    def run(joined: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        joining = joined_on("cpu") if joined else contextlib.nullcontext()
        with torch.profiler.profile(activities=activities) as prof, joining:
            y = model(x, mask).y
        products[joined] = sum(e.name in ("aten::addmm", "aten::mm") for e in prof.events())
        (y.sin() * mask[..., None]).sum().backward()
        return [y.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]

    joined, separate = run(True), run(False)
    per_block = {"llama": 2, "megalodon": 2, "megalodon_swiglu": 3}[name]  # products saved
    assert products[False] - products[True] == 2 * per_block
    assert len(joined) == len(separate) == 1 + len(list(model.parameters()))
    for a, b in zip(joined, separate):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
