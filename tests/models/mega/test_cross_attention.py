"""Gated cross-attention vs the authors' computation, rebuilt from the reference notes.

No golden tensors cover the MT decoder's `GatedCrossAttention`, so the reference here is the
code's computation written out step by step in float64 from `docs/reference/mega-code.md` §1.9 and
§1.3, in the code's own layout: time-first tensors, padding masks True at padding, the authors'
parameter names (converted to ours by `megalab.models.mega.convert.convert_gated_cross_attention`),
the 'simple' bias built by the code's pad-and-tile construction over max(target, source)
positions and sliced to [target, source], softmax with τ = √z and −inf on padded keys,
laplace/relu2 divided by the number of non-padded keys and multiplied by the key mask, the
incremental path that reads one bias row per step (`pidx`). Outputs and every gradient must
agree to 1e-12 (relative, or absolute for gradients below 1).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from golden import rel_err
from megalab.models.mega.convert import convert_gated_cross_attention
from megalab.models.mega.cross_attention import GatedCrossAttention
from megalab.models.mega.model import MegaConfig

D, Z, M = 16, 8, 24  # d_model, z_dim, bias table size (max positions)
TOL = 1e-12


def code_simple_bias(w: torch.Tensor, max_positions: int, seq_len: int) -> torch.Tensor:
    """The code's `SimpleRelativePositionalBias(seq_len)`: its pad/tile/slice construction."""
    b = w[max_positions - seq_len : max_positions + seq_len - 1]
    t = F.pad(b, (0, seq_len))
    t = torch.tile(t, (seq_len,))[:-seq_len]
    t = t.view(seq_len, 3 * seq_len - 2)
    r = (2 * seq_len - 1) // 2
    return t[:, r : t.size(1) - r]


def code_laplace(x: torch.Tensor) -> torch.Tensor:
    """The code's `utils.laplace` with its rounded μ = 0.707107 and σ = 0.282095."""
    return 0.5 * (1.0 + torch.erf((x - 0.707107) / (0.282095 * math.sqrt(2.0))))


def reference(
    p: dict[str, torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    activation: str,
    prenorm: bool,
    pidx: int | None = None,
) -> torch.Tensor:
    """The code's GatedCrossAttention.forward, time-first: query (T, B, D), key (S, B, D)."""

    def norm(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (D,), p["norm.norm.weight"], p["norm.norm.bias"], eps=1e-5)

    q = norm(query) if prenorm else query
    base = F.linear(q, p["q_proj.weight"], p["q_proj.bias"])  # L2 x B x (2D + S)
    u, r, q = torch.split(base, [D, D, Z], dim=-1)
    u, r = torch.sigmoid(u), F.silu(r)
    k = F.linear(key, p["k_proj.weight"], p["k_proj.bias"])
    v = F.silu(F.linear(key, p["v_proj.weight"], p["v_proj.bias"]))
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # B x L x .
    bsz, clen, _ = k.shape
    slen = q.size(1) if pidx is None else pidx + 1
    bias = code_simple_bias(p["rel_pos_bias.rel_pos_bias"], M, max(slen, clen))[:, :clen]
    bias = bias[pidx] if pidx is not None else bias[:slen]
    if activation == "softmax":
        qk = torch.bmm(q * Z**-0.5, k.transpose(1, 2)) + bias
        if key_padding_mask is not None:
            qk = qk.masked_fill(key_padding_mask.unsqueeze(1), float("-inf"))
        attn = torch.softmax(qk, dim=-1)
    else:
        if key_padding_mask is not None:
            inverse = 1.0 - key_padding_mask.to(q.dtype)
            lengths = inverse.sum(-1).view(bsz, 1, 1)
        else:
            inverse, lengths = None, clen
        qk = torch.bmm(q, k.transpose(1, 2)) / lengths + bias
        attn = code_laplace(qk) if activation == "laplace" else F.relu(qk) ** 2
        if inverse is not None:
            attn = attn * inverse.unsqueeze(1)
    h = torch.bmm(attn, v).transpose(0, 1)
    h = F.silu(F.linear(h * r, p["h_proj.weight"], p["h_proj.bias"]))
    out = query + u * (h - query)
    return out if prenorm else norm(out)


def code_params(seed: int) -> dict[str, torch.Tensor]:
    """Random weights under the authors' names (non-trivial, unlike their init)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * std
        return t.requires_grad_(True)

    return {
        "q_proj.weight": randn(2 * D + Z, D, std=D**-0.5),
        "q_proj.bias": randn(2 * D + Z, std=0.2),
        "k_proj.weight": randn(Z, D, std=D**-0.5),
        "k_proj.bias": randn(Z, std=0.2),
        "v_proj.weight": randn(D, D, std=D**-0.5),
        "v_proj.bias": randn(D, std=0.2),
        "h_proj.weight": randn(D, D, std=D**-0.5),
        "h_proj.bias": randn(D, std=0.2),
        "norm.norm.weight": (1 + randn(D, std=0.2)).detach().requires_grad_(True),
        "norm.norm.bias": randn(D, std=0.2),
        "rel_pos_bias.rel_pos_bias": randn(2 * M - 1, std=0.5),
    }


def ours(activation: str, prenorm: bool, params: dict[str, torch.Tensor]) -> GatedCrossAttention:
    cfg = MegaConfig(d_model=D, z_dim=Z, attention_activation=activation, prenorm=prenorm)
    module = GatedCrossAttention(cfg, max_positions=M).double()
    state = {k: v.detach().clone() for k, v in convert_gated_cross_attention(params).items()}
    module.load_state_dict(state, strict=True)
    return module.eval()


def inputs(padding: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Query (T=7, B=3, D), key (S=11, B, D) time-first, and the key padding mask (pad=True)."""
    g = torch.Generator().manual_seed(7)
    query = torch.randn(7, 3, D, generator=g, dtype=torch.float64, requires_grad=True)
    key = torch.randn(11, 3, D, generator=g, dtype=torch.float64, requires_grad=True)
    if padding == "none":
        return query, key, None
    lengths = torch.tensor([11, 8, 3])
    pos = torch.arange(11)
    if padding == "right":
        pad = pos.unsqueeze(0) >= lengths.unsqueeze(1)
    else:  # fairseq's left-padded sources
        pad = pos.unsqueeze(0) < (11 - lengths).unsqueeze(1)
    return query, key, pad


CASES = [
    (act, prenorm, padding)
    for act in ("softmax", "laplace", "relu2")
    for prenorm, padding in ((False, "right"), (True, "left"), (False, "none"))
]


@pytest.mark.parametrize(("activation", "prenorm", "padding"), CASES)
def test_matches_the_code_maths_forward_and_gradients(
    activation: str, prenorm: bool, padding: str
) -> None:
    params = code_params(0)
    module = ours(activation, prenorm, params)
    query, key, pad = inputs(padding)
    ref = reference(params, query, key, pad, activation, prenorm)
    out = module(
        query.transpose(0, 1), key.transpose(0, 1), None if pad is None else ~pad
    ).transpose(0, 1)
    assert rel_err(out, ref) < TOL
    # Gradients of the same weighted sum, for the inputs and every parameter.
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * w).sum(), [query, key, *params.values()])
    our_params = dict(module.named_parameters())
    our_grads = torch.autograd.grad((out * w).sum(), [query, key, *our_params.values()])
    assert rel_err(our_grads[0], ref_grads[0]) < TOL
    assert rel_err(our_grads[1], ref_grads[1]) < TOL
    mapped = convert_gated_cross_attention(dict(zip(params, ref_grads[2:])))
    assert set(mapped) == set(our_params)
    for (name, g), ref_g in zip(zip(our_params, our_grads[2:]), (mapped[n] for n in our_params)):
        # Softmax ignores k_proj's bias (a constant per query row): its gradient is 0 up to
        # rounding, so gradients are compared relative to max(|ref|, 1).
        assert (g - ref_g).abs().max() <= TOL * max(ref_g.abs().max().item(), 1.0), name


@pytest.mark.parametrize("activation", ["softmax", "laplace"])
def test_incremental_steps_read_one_bias_row_per_target_position(activation: str) -> None:
    """The code's incremental path (pidx = steps so far) == our query_offset, step by step."""
    params = code_params(1)
    module = ours(activation, False, params)
    query, key, pad = inputs("left")
    cache = module.memory_cache(key.transpose(0, 1), ~pad)
    with torch.no_grad():
        for t in range(query.shape[0]):
            ref = reference(params, query[t : t + 1], key, pad, activation, False, pidx=t)
            out = module(query[t : t + 1].transpose(0, 1), cache, query_offset=t)
            assert rel_err(out.transpose(0, 1), ref) < TOL
            full = module(query.transpose(0, 1), key.transpose(0, 1), ~pad)[:, t : t + 1]
            assert rel_err(out, full) < TOL


def test_bias_positions_are_tensor_indices() -> None:
    """Left padding shifts the source positions the target sees (as in the code); right
    padding leaves the unpadded sentence's bias, so right-padded outputs match an unpadded
    batch of one."""
    params = code_params(2)
    module = ours("softmax", False, params)
    query, key, pad = inputs("right")
    x, mem = query.transpose(0, 1).detach(), key.transpose(0, 1).detach()
    with torch.no_grad():
        padded = module(x, mem, ~pad)
        alone = module(x[1:2], mem[1:2, :8])
    assert rel_err(padded[1:2], alone) < TOL


def test_too_long_for_the_bias_table_fails_clearly() -> None:
    module = GatedCrossAttention(MegaConfig(d_model=D, z_dim=Z), max_positions=4)
    with pytest.raises(ValueError, match="relative position bias size 4"):
        module(torch.randn(1, 5, D), torch.randn(1, 3, D))
