"""Activation checkpointing per block: the same training, less kept for the backward."""

from __future__ import annotations

import pytest
import torch

from megalab.models.mega.model import MegaConfig
from megalab.models.transformer.model import TransformerConfig
from megalab.nn.activation_checkpoint import checkpoint_block

MEGA = dict(d_model=16, num_layers=2, z_dim=8, v_dim=24, ffn_dim=20, ema_dim=4, chunk_size=8,
            max_positions=32, dropout=0.2, attention_dropout=0.1, hidden_dropout=0.1)  # fmt: skip
TRANSFORMER = dict(d_model=16, num_layers=2, num_heads=2, ffn_dim=32, dropout=0.2, max_len=64)


def _build(kind: str, checkpoint: bool, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "transformer":
        return TransformerConfig(
            **{**TRANSFORMER, **extra}, checkpoint_activations=checkpoint
        ).build()
    return MegaConfig(**{**MEGA, **extra}, checkpoint_activations=checkpoint).build().double()


def _step(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor):
    torch.manual_seed(123)  # the same dropout masks for both models
    out = model(x, mask=mask).y
    loss = (out**2).sum()
    grads = torch.autograd.grad(loss, [x, *model.parameters()])
    return out.detach(), grads


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("mega", {}),
        ("mega", {"causal": True, "rel_pos_bias": "rotary", "norm_type": "batchnorm"}),
        ("mega", {"chunk_size": -1, "attention_activation": "laplace", "prenorm": False}),
        ("transformer", {}),
    ],
)
def test_same_outputs_gradients_and_running_statistics(kind: str, extra: dict) -> None:
    plain, ckpt = _build(kind, False, **extra), _build(kind, True, **extra)
    dtype = next(plain.parameters()).dtype
    x = torch.randn(3, 20, 16, dtype=dtype, requires_grad=True)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[1, 15:] = False
    plain.train(), ckpt.train()
    y0, g0 = _step(plain, x, mask)
    y1, g1 = _step(ckpt, x, mask)
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-12)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # BatchNorm's running averages moved once, as without checkpointing
    for (name, a), b in zip(ckpt.named_buffers(), plain.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(v for k, v in seen.items() if k not in params)


def test_keeps_only_the_block_inputs() -> None:
    plain, ckpt = _build("mega", False), _build("mega", True)
    x = torch.randn(2, 64, 16, dtype=torch.float64, requires_grad=True)
    kept, full = _saved_bytes(ckpt, x), _saved_bytes(plain, x)
    # one (B, L, D) input per block, and what the final norm outside the blocks keeps
    assert kept <= 3 * x.numel() * 8 + 4096
    assert full > 10 * kept


def test_inactive_in_eval_and_without_autograd() -> None:
    calls = []

    def block(x):
        calls.append(torch.is_grad_enabled())
        return x * x

    x = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        checkpoint_block(block, x)
    assert calls == [False]
    y = checkpoint_block(block, x)
    y.sum().backward()  # the recomputation calls the block again
    assert len(calls) == 3 and torch.equal(x.grad, 2 * x.detach())
