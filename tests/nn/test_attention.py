"""ChunkedAttention vs an explicit per-chunk implementation of the authors' rules (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from megalab.kernels.attention_functions import laplace
from megalab.nn.attention import (
    ChunkedAttention,
    RotaryRelativePositionalBias,
    SimpleRelativePositionalBias,
)

DT = torch.float64
FUNCS = ["softmax", "laplace", "relu2"]


def make(fn="softmax", chunk=-1, bias="simple", causal=False, z=8, max_positions=64, seed=0):
    torch.manual_seed(seed)
    att = ChunkedAttention(z, chunk, fn, bias, max_positions, causal).to(DT)
    with torch.no_grad():
        for p in att.parameters():
            p.normal_(0.0, 0.5)
    return att


def qkv(B=2, L=21, z=8, v=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, z, generator=g, dtype=DT),
            torch.randn(B, L, z, generator=g, dtype=DT),
            torch.randn(B, L, v, generator=g, dtype=DT))  # fmt: skip


def reference(att: ChunkedAttention, q, k, v, mask):
    """Explicit loop over chunks, written from the authors' description (mega-code.md §1.3)."""
    B, L, z = q.shape
    C = att.chunk_size if 0 < att.chunk_size < L else L
    n_chunks = math.ceil(L / C)
    out = torch.zeros(B, L, v.shape[-1], dtype=DT)
    pad = None if mask is None else ~mask
    if mask is None and L % C:
        pad = torch.zeros(B, L, dtype=torch.bool)  # internal chunk padding enters the mask
    for c in range(n_chunks):
        s, e = c * C, min((c + 1) * C, L)
        n = e - s
        qs, ks, vs = q[:, s:e], k[:, s:e], v[:, s:e]
        # pad the chunk to C with masked keys, as the code's right-padding does
        padc = None if pad is None else torch.ones(B, C, dtype=torch.bool)
        if padc is not None:
            padc[:, :n] = pad[:, s:e]
        kz = torch.zeros(B, C, z, dtype=DT)
        kz[:, :n] = ks
        vz = torch.zeros(B, C, v.shape[-1], dtype=DT)
        vz[:, :n] = vs
        Cc = C if (pad is not None or n == C) else n
        kz, vz = kz[:, :Cc], vz[:, :Cc]
        padc = None if padc is None else padc[:, :Cc]
        bias = torch.empty(Cc, Cc, dtype=DT)
        for i in range(Cc):
            for j in range(Cc):
                bias[i, j] = bias_entry(att, i, j)
        bias = bias[:n]
        tri = torch.ones(Cc, Cc, dtype=torch.bool).tril()[:n]
        if att.attention_activation == "softmax":
            logits = qs @ kz.transpose(1, 2) * z**-0.5 + bias
            if att.causal:
                logits = logits.masked_fill(~tri, float("-inf"))
            if padc is not None:
                keep = padc & ~padc.all(dim=1, keepdim=True)
                logits = logits.masked_fill(keep.unsqueeze(1), float("-inf"))
            w = torch.softmax(logits, dim=-1)
        else:
            if att.causal:
                denom = torch.arange(1, n + 1, dtype=DT).view(1, n, 1)
            elif padc is not None:
                denom = (~padc).sum(1).clamp(min=1).to(DT).view(B, 1, 1)
            else:
                denom = float(Cc)
            logits = qs @ kz.transpose(1, 2) / denom + bias
            f = laplace if att.attention_activation == "laplace" else lambda x: x.relu() ** 2
            w = f(logits)
            if padc is not None:
                w = w * (~padc).unsqueeze(1)
            if att.causal:
                w = w * tri
        out[:, s:e] = w @ vz
    return out


def bias_entry(att: ChunkedAttention, i: int, j: int) -> torch.Tensor:
    rp = att.rel_pos_bias
    if isinstance(rp, SimpleRelativePositionalBias):
        return rp.weight[rp.max_positions - 1 + j - i]
    return rotate(rp.a, i) @ rotate(rp.b, j)


def rotate(x: torch.Tensor, pos: int) -> torch.Tensor:
    """RoPE rotation of x by pos·θ_k on half-split pairs, via complex numbers."""
    half = x.shape[0] // 2
    theta = 10000.0 ** (-torch.arange(half, dtype=DT) / half)
    c = torch.complex(x[:half], x[half:]) * torch.exp(1j * pos * theta)
    return torch.cat([c.real, c.imag])


@pytest.mark.parametrize("fn", FUNCS)
@pytest.mark.parametrize("chunk", [-1, 4, 5, 30])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_explicit_reference(fn: str, chunk: int, causal: bool) -> None:
    att = make(fn, chunk, "simple" if chunk != 5 else "rotary", causal)
    q, k, v = qkv()
    mask = torch.arange(21) < torch.tensor([21, 13]).unsqueeze(1)
    for m in (None, mask):
        with torch.no_grad():
            out, _ = att(q, k, v, m)
            ref = reference(att, q, k, v, m)
        real = torch.ones(2, 21, dtype=torch.bool) if m is None else m
        assert torch.allclose(out[real], ref[real], rtol=1e-10, atol=1e-12)


def test_all_padding_chunk_is_left_unmasked_in_softmax() -> None:
    att = make("softmax", 4)
    q, k, v = qkv(L=12)
    mask = torch.arange(12) < torch.tensor([12, 6]).unsqueeze(1)  # chunk 2 of row 1: all pads
    with torch.no_grad():
        out, _ = att(q, k, v, mask)
        ref = reference(att, q, k, v, mask)
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)  # pad positions included
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("fn", FUNCS)
def test_no_nan_when_a_causal_row_sees_only_padding(fn: str) -> None:
    att = make(fn, 6, causal=True)
    q, k, v = qkv(L=12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    out, _ = att(q, k, v, mask)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("fn", FUNCS)
@pytest.mark.parametrize("causal", [False, True])
def test_chunk_covering_the_sequence_equals_full_attention(fn: str, causal: bool) -> None:
    full = make(fn, -1, "rotary", causal)
    chunked = make(fn, 32, "rotary", causal)
    chunked.load_state_dict(full.state_dict())
    q, k, v = qkv()
    mask = torch.arange(21) < torch.tensor([21, 13]).unsqueeze(1)
    with torch.no_grad():
        for m in (None, mask):
            assert torch.allclose(full(q, k, v, m)[0], chunked(q, k, v, m)[0], rtol=1e-12)


def test_simple_bias_index_rule_and_limit() -> None:
    rp = SimpleRelativePositionalBias(6).to(DT)
    b = rp(4, 6, q_offset=2)
    for r in range(4):
        for j in range(6):
            assert b[r, j] == rp.weight[5 + j - (r + 2)]
    with pytest.raises(ValueError, match="max_positions"):
        rp(7, 7)


def test_rotary_bias_is_a_function_of_offset_only() -> None:
    torch.manual_seed(0)
    rp = RotaryRelativePositionalBias(8).to(DT)
    with torch.no_grad():
        rp.a.normal_()
        rp.b.normal_()
        b = rp(9, 9)
        assert torch.allclose(b[3, 5], rotate(rp.a, 3) @ rotate(rp.b, 5))
        for d in range(-8, 9):
            diag = torch.diagonal(b, offset=d)
            assert torch.allclose(diag, diag[0].expand_as(diag), rtol=1e-12)
        assert torch.allclose(rp(3, 9, q_offset=6), b[6:])


def test_laplace_constants() -> None:
    mu, sigma = math.sqrt(0.5), 1 / (2 * math.sqrt(math.pi))
    x = torch.tensor([mu], dtype=DT, requires_grad=True)
    y = laplace(x)
    y.backward()
    # matches relu² in value (½) and slope (√2) at x = √½, up to the code's rounded constants
    assert abs(y.item() - 0.5) < 1e-6 and abs(x.grad.item() - math.sqrt(2)) < 1e-5
    assert abs(0.707107 - mu) < 1e-6 and abs(0.282095 - sigma) < 1e-6


@pytest.mark.parametrize("fn", FUNCS)
@pytest.mark.parametrize("chunk", [-1, 4, 6])
def test_streaming_with_cache_equals_full_pass(fn: str, chunk: int) -> None:
    att = make(fn, chunk, "simple", causal=True)
    q, k, v = qkv(L=23)
    mask = torch.arange(23) < torch.tensor([23, 15]).unsqueeze(1)
    with torch.no_grad():
        full, _ = att(q, k, v, mask)
        for segments in ([1] * 23, [5, 1, 7, 2, 8], [4, 4, 15]):
            cache, outs, s = None, [], 0
            for n in segments:
                sl = slice(s, s + n)
                o, cache = att(q[:, sl], k[:, sl], v[:, sl], mask[:, sl], cache, True)
                outs.append(o)
                s += n
                expected = s if chunk < 0 else s % chunk
                assert cache.key.shape[1] == expected  # dropped at every chunk boundary
            assert torch.allclose(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fn", FUNCS)
@pytest.mark.parametrize("causal", [False, True])
def test_padding_invariance(fn: str, causal: bool) -> None:
    """Real positions ignore pad values and the amount of padding, incl. chunk padding."""
    att = make(fn, 4, "simple", causal)
    q, k, v = qkv(B=1, L=10)
    mask = torch.ones(1, 10, dtype=torch.bool)
    with torch.no_grad():
        base, _ = att(q, k, v, mask)
        for extra in (1, 3, 6):
            q2, k2, v2 = (torch.cat([t, 9 * torch.randn(1, extra, t.shape[-1], dtype=DT)], 1)
                          for t in (q, k, v))  # fmt: skip
            m2 = torch.cat([mask, torch.zeros(1, extra, dtype=torch.bool)], 1)
            out, _ = att(q2, k2, v2, m2)
            assert torch.allclose(out[:, :10], base, rtol=1e-12, atol=1e-13)


def test_causality() -> None:
    for fn in FUNCS:
        att = make(fn, 5, "rotary", causal=True)
        q, k, v = qkv(L=17)
        with torch.no_grad():
            base, _ = att(q, k, v)
            q2, k2, v2 = q.clone(), k.clone(), v.clone()
            for t in (q2, k2, v2):
                t[:, 9:] = torch.randn_like(t[:, 9:])
            out, _ = att(q2, k2, v2)
        assert torch.allclose(out[:, :9], base[:, :9], rtol=1e-12)


def test_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="softmax, laplace, relu2"):
        ChunkedAttention(8, attention_activation="gelu")
    with pytest.raises(ValueError, match="simple, rotary"):
        ChunkedAttention(8, rel_pos_bias="t5")
    att = ChunkedAttention(8, chunk_size=-1, max_positions=8)
    q, k, v = qkv(L=9)
    with pytest.raises(ValueError, match="max_positions"):
        att(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="causal"):
        att(q.float()[:, :4], k.float()[:, :4], v.float()[:, :4], return_cache=True)


def test_gradients_and_bf16_autocast() -> None:
    for fn in FUNCS:
        att = ChunkedAttention(8, 4, fn, "simple", causal=False)
        q, k, v = (t.float().requires_grad_() for t in qkv(L=10))
        mask = torch.arange(10) < torch.tensor([10, 7]).unsqueeze(1)
        out, _ = att(q, k, v, mask)
        out.sum().backward()
        assert att.rel_pos_bias.weight.grad is not None
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ob, _ = att(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
        assert torch.isfinite(ob).all() and (ob.float() - out).abs().max() < 0.2
