"""The fused, blockwise attention kernel against the unfused PyTorch form (float64)."""

from __future__ import annotations

import itertools

import pytest
import torch

from megalab.nn import fused_attention
from megalab.nn.attention import ChunkedAttention
from megalab.nn.fused_attention import block_shape, mega_attention

DT = torch.float64
CASES = list(
    itertools.product(["softmax", "laplace", "relu2"], ["simple", "rotary"], [False, True])
)


def _module(fn: str, bias: str, causal: bool, span: int) -> ChunkedAttention:
    torch.manual_seed(0)
    att = ChunkedAttention(6, -1, fn, bias, max_positions=span, causal=causal).to(DT)
    with torch.no_grad():
        for p in att.parameters():
            p.normal_(0.0, 0.5)
    return att


def _inputs(N: int, cq: int, ck: int, padded: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, cq, 6, generator=g, dtype=DT, requires_grad=True)
    k = torch.randn(N, ck, 6, generator=g, dtype=DT, requires_grad=True)
    v = torch.randn(N, ck, 5, generator=g, dtype=DT, requires_grad=True)
    valid = None
    if padded:
        valid = torch.rand(N, ck, generator=g) > 0.3
        valid[0] = False  # a chunk of padding only (softmax leaves it unmasked)
        valid[1, :3] = False  # left padding: causal rows that see no valid key
        valid[2, -2:] = False
    return q, k, v, valid


def _fused(att, q, k, v, valid, q_offset, recompute, block):
    kind, b1, b2 = att.rel_pos_bias.factors(q.shape[1], k.shape[1], q_offset)
    return mega_attention(
        q, k, v, (kind, b1, b2), fn=att.attention_activation, valid=valid, causal=att.causal,
        q_offset=q_offset, scale=6**-0.5, positions=getattr(att.rel_pos_bias, "max_positions", 0),
        recompute=recompute, block=block,
    )  # fmt: skip


def _unfused(att, q, k, v, valid, q_offset):
    o = att._attend_unfused(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1),
        None if valid is None else valid.unsqueeze(1), q_offset,
    )  # fmt: skip
    return o.squeeze(1)


@pytest.mark.parametrize(("fn", "bias", "causal"), CASES)
@pytest.mark.parametrize("recompute", [True, False])
def test_outputs_and_every_gradient_match_the_unfused_form(fn, bias, causal, recompute):
    for padded, q_offset in [(False, 0), (True, 0), (True, 3)]:
        att = _module(fn, bias, causal, span=12)
        ck = 12
        cq = ck - q_offset  # streaming: the queries continue a chunk of q_offset cached keys
        q, k, v, valid = _inputs(4, cq, ck, padded)
        params = list(att.parameters())
        want = _unfused(att, q, k, v, valid, q_offset)
        g = torch.randn_like(want)
        grads_want = torch.autograd.grad(want, [q, k, v, *params], g)
        got = _fused(att, q, k, v, valid, q_offset, recompute, block=4)  # 3 blocks of queries
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(got, [q, k, v, *params], g)
        for name, a, b in zip(["q", "k", "v", *[n for n, _ in att.named_parameters()]],
                              grads, grads_want):  # fmt: skip
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize(("fn", "bias", "causal"), CASES)
@pytest.mark.parametrize("recompute", [True, False])
def test_blocks_of_several_samples_match_the_unfused_form(monkeypatch, fn, bias, causal, recompute):
    """Short spans run several samples per block (chunks): 4 samples in blocks of 3 and 1."""
    monkeypatch.setattr(fused_attention, "BLOCK_ELEMENTS", 3 * 12 * 12)
    att = _module(fn, bias, causal, span=12)
    q, k, v, valid = _inputs(4, 12, 12, padded=True)
    params = list(att.parameters())
    want = _unfused(att, q, k, v, valid, 0)
    g = torch.randn_like(want)
    grads_want = torch.autograd.grad(want, [q, k, v, *params], g)
    got = _fused(att, q, k, v, valid, 0, recompute, block=None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, [q, k, v, *params], g), grads_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fn", ["softmax", "laplace", "relu2"])
def test_gradcheck(fn):
    att = _module(fn, "simple", causal=True, span=5)
    q, k, v, valid = _inputs(3, 5, 5, padded=True)
    w = att.rel_pos_bias.weight

    def f(q, k, v, w):
        return mega_attention(q, k, v, ("toeplitz", w, None), fn=fn, valid=valid, causal=True,
                              positions=5, block=2)  # fmt: skip

    assert torch.autograd.gradcheck(f, (q, k, v, w))


def test_recompute_keeps_memory_linear_in_the_span():
    """With recompute, what the backward keeps does not grow with Cq·Ck: no weights are kept."""

    def saved(recompute: bool, L: int) -> int:
        att = _module("softmax", "simple", False, span=L)
        q, k, v, _ = _inputs(2, L, L, padded=False)
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _fused(att, q, k, v, None, 0, recompute, block=8)
        return sum(seen.values())

    per_token = [saved(True, L) / L for L in (64, 256)]
    assert per_token[1] < 1.1 * per_token[0]  # linear: the same bytes per token
    assert saved(False, 256) > 10 * saved(True, 256)  # kept weights: 2 x 256 x 256 doubles


def test_chunked_attention_uses_the_fused_kernel_and_falls_back_for_dropout():
    att = ChunkedAttention(6, 4, "softmax", "simple", causal=False, dropout=0.5).to(DT)
    q, k, v, _ = _inputs(2, 10, 10, padded=False)
    att.eval()
    torch.testing.assert_close(att(q, k, v)[0].sum(), att(q, k, v)[0].sum())
    fused = att(q, k, v)[0]
    # the same through the unfused form
    from megalab.nn.attention import chunked_attention

    unfused = chunked_attention(q, k, v, None, 4, att._attend_unfused)[0]
    torch.testing.assert_close(fused, unfused, rtol=1e-12, atol=1e-12)
    att.train()  # attention dropout active: the unfused form (dropout needs its own mask)
    assert att(q, k, v)[0].shape == fused.shape


def test_block_shape_bounds_the_block_tensor():
    # a long span: one sample at a time, rows of about the budget
    assert block_shape(4, 4096, 4096, block_elements=1 << 18) == (1, 64)
    assert block_shape(8, 1024, 1024, block_elements=1 << 18) == (1, 256)
    assert block_shape(64, 2001, 2001, block_elements=1 << 18) == (1, 131)
    # chunks: whole chunks, several samples per block
    assert block_shape(64, 128, 128, block_elements=1 << 18) == (16, 128)
    assert block_shape(3, 10, 10) == (3, 10)
    # a fixed number of rows
    assert block_shape(4, 12, 12, block=4) == (1, 4)
    assert block_shape(4, 12, 12, block=100, block_elements=300) == (2, 12)
    with pytest.raises(ValueError, match="unknown bias kind"):
        mega_attention(*_inputs(1, 2, 2, False)[:3], ("full", torch.zeros(2, 2), None))


@pytest.mark.skipif(fused_attention._LINEAR is None, reason="this torch build has no oneDNN")
@pytest.mark.parametrize(("fn", "bias", "causal"), CASES)
@pytest.mark.parametrize("recompute", [True, False])
def test_float32_blocks_on_onednn_match_float64(monkeypatch, fn, bias, causal, recompute):
    """float32 blocks of one sample run their GEMMs on oneDNN: within float32 rounding of the
    float64 unfused form, and of the float32 `bmm` path (oneDNN switched off)."""
    calls = []

    def counted(*args):
        calls.append(1)
        return linear(*args)

    linear = fused_attention._LINEAR
    counting = type("Counting", (), {"__call__": staticmethod(counted),
                                     "binary": staticmethod(linear.binary)})()  # fmt: skip
    att = _module(fn, bias, causal, span=12)
    q, k, v, valid = _inputs(4, 12, 12, padded=True)
    want = _unfused(att, q, k, v, valid, 0)
    g = torch.randn_like(want)
    grads_want = torch.autograd.grad(want, [q, k, v, *att.parameters()], g)
    att32 = att.float()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    results = []
    for onednn in (True, False):
        monkeypatch.setattr(fused_attention, "_LINEAR", counting if onednn else linear)
        monkeypatch.setattr(fused_attention, "ONEDNN", onednn)
        monkeypatch.setattr(fused_attention, "ONEDNN_MIN_ELEMENTS", 0)  # small blocks here
        got = _fused(att32, q32, k32, v32, valid, 0, recompute, block=4)
        grads = torch.autograd.grad(got, [q32, k32, v32, *att32.parameters()], g.float())
        for a, b in zip((got, *grads), (want, *grads_want)):
            torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5)
        results.append((got, *grads))
        assert bool(calls) == onednn  # the GEMMs of the forward and the backward
        calls.clear()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_small_blocks_and_float64_keep_bmm(monkeypatch):
    """Decoding (one query row) and float64 do not use oneDNN (a kernel compiled per shape)."""
    calls = []
    monkeypatch.setattr(fused_attention, "_LINEAR", lambda *args: calls.append(1))
    monkeypatch.setattr(fused_attention, "ONEDNN", True)
    att = _module("softmax", "simple", True, span=12).float()
    q, k, v, _ = (t.detach().float() if t is not None else t for t in _inputs(2, 12, 12, False))
    for t in range(1, 12):  # one query against t keys, as in token-by-token decoding
        _fused(att, q[:, t - 1 : t], k[:, :t], v[:, :t], None, t - 1, True, block=None)
    assert not calls
    att64 = _module("softmax", "simple", True, span=12)
    q, k, v, _ = _inputs(2, 12, 12, False)
    monkeypatch.setattr(fused_attention, "ONEDNN_MIN_ELEMENTS", 0)
    _fused(att64, q, k, v, None, 0, True, block=None)
    assert not calls
