"""SeqBoat invariants in float64, against a per-row re-derivation of the layer.

`naive_layer` recomputes a SeqBoat layer row by row with dense masks (a Python loop over the
batch, the activated tokens picked with `nonzero`, the window as an explicit |i − j| mask on
packed indices): it shares only the EMA and the linear maps with our batched implementation
(look-around blocks, gather-based packing), so agreeing with it checks the packing, the window,
the positions and the scaling of every attention mode. Then: all-active SMA is the dense GAU
with the same window scaled by c; none active gives an attention branch of exactly 0; the
code's no-compression branch couples the batch and `always_compress` removes that; pack and
unpack are inverse gathers with exact gradients; the configurator ablations decide as their
formulas say; parameter counts are the code's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from seqboat_case import BASE, DT, make_layer

import golden
from megalab.models.seqboat.convert import mask_from_padding_mask, to_batch_first
from megalab.models.seqboat.model import SeqBoatConfig, SeqBoatLayer
from megalab.models.seqboat.sma import (
    GumbelSoftmaxRouter,
    SigmoidRouter,
    XMoERouter,
    pack,
    plan_packing,
    unpack,
)
from megalab.nn.rope import apply_rope, rope_inv_freq


def data(B: int = 3, L: int = 23, lengths=(23, 17, 9), seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, BASE["d_model"], generator=g, dtype=DT)
    mask = torch.arange(L) < torch.tensor(lengths).unsqueeze(1)
    return x, mask


def naive_layer(layer: SeqBoatLayer, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The layer re-derived row by row with dense masks (bidirectional or causal)."""
    att = layer.attention
    D, Z, E = layer.d_model, layer.z_dim, layer.v_dim
    X = layer.norm(x) if layer.prenorm else x
    H, _ = layer.ssm(X, mask)
    u, hx = torch.split(layer.hx_proj(H), [layer.n_logits, D], dim=-1)
    if layer.router is None:
        active, conf = mask.clone(), mask.to(DT)
    else:
        tau = layer.router.log_tau.exp()
        p = torch.softmax((u + torch.tensor([layer.act_bias, 0.0], dtype=DT)) / tau, dim=-1)
        active = (p[..., 1] > p[..., 0]) & mask
        conf = p[..., 1] * active
    # The code's rule: pack while L' / L is below 1 (local mode: no packing when a row is fully
    # active) or 0.9 (full mode), unless always_compress.
    density = float(active.sum(1).max()) / x.shape[1]
    threshold = 1.0 if att.mode == "local" else 0.9
    packed = layer.compress_always or att.mode == "chunk" or density < threshold
    if layer.router is None:
        packed = False
    Y = torch.zeros_like(x)
    for b in range(x.shape[0]):
        idx = active[b].nonzero().flatten() if packed else torch.arange(x.shape[1])
        key_ok = torch.ones(len(idx), dtype=torch.bool) if packed else active[b]
        if len(idx) == 0:
            continue
        Zc, G, V = torch.split(F.silu(layer.mx_proj(H[b, idx])), [Z, E, E], dim=-1)
        Q = Zc * layer.kappa[0] + layer.mu[0]
        K = Zc * layer.kappa[1] + layer.mu[1]
        pos = idx
        if att.rotary:
            inv = rope_inv_freq(Z, 10000.0, DT)
            Q, K = apply_rope(Q, pos, inv, True), apply_rope(K, pos, inv, True)
        n = len(idx)
        i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        allowed = key_ok.unsqueeze(0).expand(n, n).clone()
        if att.causal:
            allowed &= j <= i
        W = att.chunk_size
        if att.mode == "local":
            allowed &= (i - j).abs() <= W
        elif att.mode == "chunk":
            allowed &= i // W == j // W
        bias = torch.zeros(n, n, dtype=DT)
        if att.rel_pos_bias is not None:
            P = att.rel_pos_bias.max_positions
            off = (j - i + W) if att.local_pos else (pos.unsqueeze(0) - pos.unsqueeze(1))
            bias = att.rel_pos_bias.weight[(off + P - 1).clamp(0, 2 * P - 2)]
        if att.attention_activation == "softmax":
            s = Q @ K.T * Z**-0.5 + bias
            A = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
            A = torch.nan_to_num(A)
        else:
            if att.mode == "local":
                scale = W if att.causal else 2 * W
            elif att.mode == "full" and att.causal:
                scale = (i + 1).to(DT)  # the code's causal mask row sum
            else:
                scale = allowed.sum(-1, keepdim=True).clamp(min=1).to(DT)
            A = F.relu((Q / scale) @ K.T + bias).square() * allowed
        Yc = layer.h_proj((A @ V) * G)
        Y[b, idx] = Yc * active[b, idx].unsqueeze(-1).to(DT)
    out = F.silu(hx + Y * conf.unsqueeze(-1) + x)
    return layer.norm(out) if not layer.prenorm else out


VARIANTS = {
    "local_softmax": {},
    "local_relu2_prenorm": {"attention_activation": "relu2", "prenorm": True},
    "local_pos_scalenorm": {"local_pos": True, "norm_type": "scalenorm", "truncation": 7},
    "local_always_compress": {"always_compress": True},
    "causal_rotary": {"causal": True, "rel_pos_bias": "rotary"},
    "causal_relu2_local_pos": {
        "causal": True,
        "attention_activation": "relu2",
        "local_pos": True,
    },
    "chunk_relu2": {"attention": "chunk", "chunk_size": 4, "attention_activation": "relu2"},
    "chunk_causal_local_pos": {
        "attention": "chunk",
        "chunk_size": 4,
        "causal": True,
        "local_pos": True,
    },
    "full_softmax": {"attention": "full", "max_positions": 10},
    "full_causal_relu2": {"attention": "full", "causal": True, "attention_activation": "relu2"},
    "always_active_local": {"router": "none"},
}


@pytest.mark.parametrize("act_bias", [-0.4, -50.0, 50.0], ids=["partial", "all", "none"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layer_equals_per_row_rederivation(variant: str, act_bias: float) -> None:
    layer = make_layer(**VARIANTS[variant])
    layer.act_bias = act_bias
    x, mask = data()
    with torch.no_grad():
        y, _, report = layer(x, mask, details=True)
        ref = naive_layer(layer, x, mask)
    if act_bias == -0.4 and layer.router is not None:
        a = report.details["active"]
        assert 0 < a.sum() < mask.sum(), "the partial case must be partly active"
    torch.testing.assert_close(y[mask], ref[mask], rtol=1e-10, atol=1e-10)


def test_all_active_sma_is_the_dense_gau_with_the_same_window() -> None:
    """Every real token active: the output is that of the always-active GAU, with c ⊙ Y."""
    sma = make_layer(seed=4, attention_activation="relu2")
    dense = make_layer(seed=4, attention_activation="relu2", router="none")
    sd = {k: v for k, v in sma.state_dict().items() if "router" not in k}
    sd["hx_proj.weight"], sd["hx_proj.bias"] = sd["hx_proj.weight"][2:], sd["hx_proj.bias"][2:]
    dense.load_state_dict(sd, strict=True)
    sma.act_bias = -50.0
    x, mask = data()
    with torch.no_grad():
        _, _, rs = sma(x, mask, details=True)
        _, _, rd = dense(x, mask, details=True)
    assert torch.equal(rs.details["active"], mask)
    # Same packed attention output on every real token (rows are right-padded).
    Os, Od = rs.details["attn_out"], rd.details["attn_out"]
    torch.testing.assert_close(Os[rs.details["valid"]], Od[:, : Os.shape[1]][rs.details["valid"]],
                               rtol=1e-12, atol=1e-12)  # fmt: skip


def test_none_active_gives_an_attention_branch_of_exactly_zero() -> None:
    layer = make_layer(seed=5)
    layer.act_bias = 50.0
    x, mask = data()
    with torch.no_grad():
        y, _, report = layer(x, mask)
        H, _ = layer.ssm(x, mask)
        hx = layer.hx_proj(H)[..., 2:]
    assert report.activation == 0
    assert torch.equal(y, layer.norm(F.silu(hx + x)))


def test_the_no_compression_branch_couples_the_batch() -> None:
    """`layer_no_compress_mixed`: row 0 fully active makes the code skip packing for rows 1-2;
    with always_compress rows 1-2 are packed and equal their own batch (README §6, quirk 3)."""
    from test_seqboat_golden import build_unit

    d = golden.load_case("seqboat", "layer_no_compress_mixed")
    layer = build_unit(d)
    x = to_batch_first(d["input"])
    mask = mask_from_padding_mask(d.get("padding_mask"))
    with torch.no_grad():
        coupled, _, r0 = layer(x, mask, details=True)
        layer.compress_always = True
        packed, _, r1 = layer(x, mask, details=True)
        alone, _, r2 = layer(x[1:], None if mask is None else mask[1:], details=True)
    assert not r0.details["packed"] and r1.details["packed"] and r2.details["packed"]
    torch.testing.assert_close(coupled[0], packed[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(packed[1:], alone, rtol=1e-12, atol=1e-12)
    m = mask[1:] if mask is not None else torch.ones(2, x.shape[1], dtype=torch.bool)
    assert (coupled[1:] - packed[1:])[m].abs().max() > 1e-3


def test_pack_and_unpack_are_inverse_gathers_with_exact_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    active = torch.rand(4, 13, generator=g) < 0.4
    active[2] = False  # an empty row
    plan = plan_packing(active)
    assert plan.length == int(active.sum(1).max())
    x = torch.randn(4, 13, 5, generator=g, dtype=DT, requires_grad=True)
    packed = pack(x, plan)
    for b in range(4):
        idx = active[b].nonzero().flatten()
        assert torch.equal(packed[b, : len(idx)], x[b, idx])
        assert (packed[b, len(idx) :] == 0).all()
    back = unpack(packed, plan)
    assert torch.equal(back, x * active.unsqueeze(-1))
    assert torch.autograd.gradcheck(lambda t: unpack(pack(t, plan) * 2.0, plan), (x,))
    assert torch.autograd.gradcheck(lambda t: pack(t, plan), (x,))
    y = torch.randn(4, plan.length, 5, generator=g, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: unpack(t, plan), (y,))
    nothing = plan_packing(torch.zeros(2, 6, dtype=torch.bool))
    assert nothing.length == 1 and not nothing.valid.any()  # L' = 0 keeps one invalid slot


def test_aux_reports_activation_tau_and_span() -> None:
    torch.manual_seed(0)
    model = SeqBoatConfig(**{**BASE, "num_layers": 2, "init_temp_scale": 0.5}).build().to(DT).eval()
    x, mask = data()
    with torch.no_grad():
        out, reports = model.forward_with_reports(x, mask, details=True)
    for i, r in enumerate(reports):
        a = r.details["active"]
        assert out.aux["activation"][i] == pytest.approx(float(a.sum() / mask.sum()), abs=1e-6)
    assert torch.allclose(out.aux["tau"], torch.full((2,), 0.5 * 16**0.5))
    # Always active, no padding: a sliding window of W = 3 on both sides has spans
    # (1 + 2 + 3) / 3 = 2 in the middle, from a brute-force count at the edges.
    model = SeqBoatConfig(**{**BASE, "router": "none"}).build().to(DT).eval()
    L, W = 11, 3
    with torch.no_grad():
        span = model(torch.randn(1, L, 16, dtype=DT)).aux["attention_span"][0]
    spans = []
    for i in range(L):
        d = [abs(i - j) for j in range(max(0, i - W), min(L, i + W + 1)) if j != i]
        spans.append(sum(d) / len(d))
    assert float(span) == pytest.approx(sum(spans) / L, abs=1e-6)


def test_tempered_softmax_temperature_changes_confidence_not_decisions() -> None:
    layer = make_layer(seed=6)
    x, mask = data()
    with torch.no_grad():
        _, _, r1 = layer(x, mask, details=True)
        layer.router.log_tau.add_(1.3)
        _, _, r2 = layer(x, mask, details=True)
    assert torch.equal(r1.details["active"], r2.details["active"])
    assert not torch.allclose(r1.details["confidence"], r2.details["confidence"])


def test_gumbel_router_anneals_and_decides_by_argmax_in_eval() -> None:
    router = GumbelSoftmaxRouter(2.0, 0.5, 0.9)
    u = torch.randn(2, 50, 2, dtype=DT)
    valid = torch.ones(2, 50, dtype=torch.bool)
    router.eval()
    r = router(None, u, valid, 0.3)
    assert torch.equal(r.active, u[..., 1] > u[..., 0] + 0.3)
    assert torch.equal(r.confidence, r.active.to(DT))
    router.train()
    torch.manual_seed(0)
    r = router(None, u, valid, 0.0)
    assert int(router.step) == 1 and float(router.tau) == pytest.approx(2.0 * 0.9)
    assert (r.confidence[r.active] >= 0.5).all() and (r.confidence[~r.active] == 0).all()
    router.step.fill_(10_000)
    assert float(router.tau) == 0.5  # floored at tau_min


def test_sigmoid_and_xmoe_routers() -> None:
    u = torch.randn(3, 20, 1, dtype=DT)
    valid = torch.ones(3, 20, dtype=torch.bool)
    s = SigmoidRouter(16, 0.5).to(DT)
    r = s(None, u, valid, 0.2)
    p = torch.sigmoid((u[..., 0] - 0.2) / (0.5 * 4))
    assert torch.equal(r.active, p > 0.5)
    torch.testing.assert_close(r.confidence, p * r.active)
    x = XMoERouter(16).to(DT).eval()
    h = torch.randn(3, 20, 16, dtype=DT)
    r = x(h, u[..., :0], valid, 0.0)
    e = F.normalize(x.experts, dim=1)
    scores = x.reduction(h) @ e.T
    assert torch.equal(r.active, scores[..., 1] > scores[..., 0])
    x.train()
    x(h, u[..., :0], valid, 0.0)
    torch.testing.assert_close(x.experts.norm(dim=1), torch.full((2,), 1.5, dtype=DT))


@pytest.mark.parametrize(
    "kw",
    [
        {"router": "gumbel"},
        {"router": "sigmoid"},
        {"router": "xmoe"},
        {"ssm": "s4d"},
        {"ffn_dim": 32},
        {"ffn_dim": 32, "ffn_mode": "parallel"},
        {"attention": "chunk", "chunk_size": 8, "router": "none"},
    ],
    ids=["gumbel", "sigmoid", "xmoe", "s4d", "ffn", "gau_ffn", "chunk"],
)
def test_ablation_variants_train(kw: dict) -> None:
    """Every Table 7-8 variant trains: finite output, a gradient on every parameter that the
    step reaches, and its statistics in aux."""
    torch.manual_seed(0)
    model = SeqBoatConfig(**{**BASE, "num_layers": 2, "act_bias": -0.2, **kw}).build().train()
    x, mask = data()
    out = model(x.float(), mask)
    out.y.square().mean().backward()
    assert torch.isfinite(out.y).all()
    assert {"activation", "attention_span"} <= set(out.aux)
    if kw.get("ffn_mode") == "parallel":
        assert "ffn_activation" in out.aux
    grads = [p.grad for p in model.parameters()]
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in grads) > len(grads) // 2


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_parameter_count_sc10() -> None:
    """SC10 (Table 2): the code's config (8 layers, d 60, d_z 30, d_v 120, h 16, bidirectional
    EMA, local-pos table 2·384 − 1, batch-norm pre-norm, classifier 60 → 120 → 10, pixel
    embedding and position scale) has 298,841 parameters; the paper reports 293K."""
    from megalab.nn.embedding import FeatureEmbedding
    from megalab.nn.heads import ClassificationHead

    backbone = SeqBoatConfig(d_model=60, num_layers=8, z_dim=30, v_dim=120, ema_dim=16,
                             chunk_size=128, attention_activation="relu2", local_pos=True,
                             positions="sinusoidal", norm_type="batchnorm", prenorm=True,
                             truncation=4000).build()  # fmt: skip
    total = (
        _count(backbone) + _count(FeatureEmbedding(1, 60)) + _count(ClassificationHead(60, 120, 10))
    )
    assert total == 298_841


def test_parameter_count_enwik8() -> None:
    """enwik8 (Table 3/5: 39M): 14 layers of d 616 hold 38,946,362 parameters; with the fairseq
    dictionary of enwik8 (204 symbols) the tied embedding makes 39.07M, with the 256 byte values
    of our data 39.10M."""
    backbone = SeqBoatConfig(d_model=616, num_layers=14, z_dim=128, v_dim=1232, ema_dim=16,
                             chunk_size=1024, rel_pos_bias="rotary", prenorm=True,
                             final_norm_affine=False, causal=True,
                             truncation=2048).build()  # fmt: skip
    n = _count(backbone)
    assert n == 38_946_362
    assert round((n + 204 * 616) / 1e6, 2) == 39.07
    assert math.isclose((n + 256 * 616) / 1e6, 39.10, abs_tol=0.005)


@pytest.mark.parametrize(
    "kw",
    [
        {"attention": "full", "max_positions": 10},
        {"attention": "full", "causal": True, "attention_activation": "relu2"},
        {"attention": "full", "causal": True, "rel_pos_bias": "rotary"},
    ],
    ids=["bidirectional_softmax", "causal_relu2", "causal_rotary"],
)
def test_full_attention_in_query_blocks_equals_one_block(monkeypatch, kw: dict) -> None:
    """SeqBoat-full runs its queries in recomputed blocks when (B, L', L') is large (Path-X):
    outputs, gradients and the span statistic equal the one-block pass. (A stream's steps are
    one block each; the contract suite checks streaming.)"""
    import megalab.models.seqboat.sma as sma

    layer = make_layer(seed=8, **kw)
    layer.act_bias = -0.4
    x, mask = data()

    def run(elements: int):
        monkeypatch.setattr(sma, "DENSE_BLOCK_ELEMENTS", elements)
        xi = x.clone().requires_grad_(True)
        y, _, rep = layer(xi, mask, details=True)
        grads = torch.autograd.grad(
            (y * mask.unsqueeze(-1)).square().sum(), [xi, *layer.parameters()]
        )
        return y.detach(), rep, grads

    y1, r1, g1 = run(1 << 24)
    y2, r2, g2 = run(3 * 23 * 2)  # 2 queries per block: 12 blocks
    assert 0 < r1.details["active"].sum() < mask.sum()
    torch.testing.assert_close(y2, y1, rtol=1e-12, atol=1e-12)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(r2.span, r1.span, rtol=1e-6, atol=0)
