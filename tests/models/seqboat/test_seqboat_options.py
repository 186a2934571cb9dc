"""SeqBoat options of the authors' code, each against that code's formulas in float64.

`ref_local` and `ref_global` re-derive the authors' attention on the (packed) sequence from
the reference notes (seqboat-code.md §1.5, Mega's `element_attention`): pad to a multiple of W,
look-around blocks filled with −1 outside the sequence, the exact window and key masks with
the fill *replacing* the score (−5e4 for softmax, 0 for relu² and laplace), laplace
½(1 + erf((x − μ)/(σ√2))) with μ = 0.707107, σ = 0.282095; globally the weights times the key
(and causal) mask, relu²/laplace dividing Q by the valid-key count (i + 1 causal). `ref_unit`
re-derives the unit's forward (§1.2) on top of them: the code's compression rule (density
threshold 1 in local mode, 0.9 in full mode), compress by scatter into slot a·cumsum(a),
extract by gather, the confidence scaling, and with `--always-act` no configurator at all: the
GAU output is added at every position, pads included. They share only the EMA and the linear
maps with megalab's layer, and are compared at every position, pads included.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import seqboat_case
import torch
import torch.nn.functional as F
from seqboat_case import DT

import golden
from golden import prefixed
from megalab.models.seqboat.convert import (
    UNIT_OPTIONS,
    convert_unit,
    seqboat_kwargs_from_fairseq,
    seqboat_lm_kwargs_from_fairseq,
    unit_kwargs_from_reference,
)
from megalab.models.seqboat.model import SeqBoatConfig, SeqBoatLayer
from megalab.models.seqboat.sma import CompressedAttention, GumbelSoftmaxRouter

BASE = {**seqboat_case.BASE, "max_positions": 12}


def ref_laplace(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf((x - 0.707107) / (0.282095 * math.sqrt(2.0))))


def ref_bias(weight: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The 'simple' bias of every (query i, key j) pair: w[P − 1 + pos_j − pos_i], edges kept."""
    P = (weight.numel() + 1) // 2
    off = pos.unsqueeze(-2) - pos.unsqueeze(-1)
    return weight[(off + P - 1).clamp(0, 2 * P - 2)]


def ref_local(q, k, v, keep, bias, W: int, causal: bool, act: str) -> torch.Tensor:
    """The code's look-around local attention: q already scaled; bias (B, n, n) or None."""
    B, n, _ = q.shape
    nb = -(-n // W)
    pad = nb * W - n
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    keep = torch.cat([keep, keep.new_zeros(B, pad)], dim=1)
    t = torch.arange(nb * W)
    back, fwd = 1, 0 if causal else 1

    def look_around(x: torch.Tensor, fill: float) -> torch.Tensor:  # (B, nb, W, ...) blocks
        xb = x.unflatten(1, (nb, W))
        dims = (0, 0) * (xb.dim() - 2)
        xp = F.pad(xb, (*dims, back, fwd), value=fill)
        return torch.cat([xp[:, i : i + nb] for i in range(back + fwd + 1)], dim=2)

    bk, bv = look_around(k, -1.0), look_around(v, -1.0)
    bt = look_around(t.unsqueeze(0), -1)[0]  # (nb, n_look·W) key index, −1 outside
    bkeep = look_around(keep.to(q.dtype), 0.0).bool()
    qt = t.view(nb, W, 1)
    kt = bt.unsqueeze(1)
    sim = q.unflatten(1, (nb, W)) @ bk.transpose(-1, -2)
    if bias is not None:
        bp = F.pad(bias, (0, pad, 0, pad))
        kidx = kt.clamp(min=0).expand(nb, W, -1).reshape(1, nb * W, -1)
        bb = bp.gather(2, kidx.expand(B, -1, -1))
        sim = sim + bb.unflatten(1, (nb, W))
    if causal:
        out_of_window = (kt > qt) | (qt > kt + W)
    else:
        out_of_window = ((kt - W) > qt) | (qt > kt + W)
    masked = out_of_window | (kt == -1) | ~bkeep.unsqueeze(2)
    fill = -5e4 if act == "softmax" else 0.0
    sim = sim.masked_fill(masked, fill)
    if act == "softmax":
        attn = torch.softmax(sim, dim=-1)
    elif act == "relu2":
        attn = F.relu(sim).square()
    else:
        attn = ref_laplace(sim)
    return (attn @ bv).flatten(1, 2)[:, :n]


def ref_global(q, k, v, keep, bias, causal: bool, act: str) -> torch.Tensor:
    """The code's global attention over the whole (packed) sequence; q not yet scaled."""
    n = q.shape[1]
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    if act == "softmax":
        s = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
        s = s + (bias if bias is not None else 0.0)
        if causal:
            s = s.masked_fill(~tril, float("-inf"))
        row_empty = ~keep.any(dim=-1, keepdim=True)
        s = s.masked_fill((~keep & ~row_empty).unsqueeze(1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v
    if causal:
        lengths = torch.arange(1, n + 1, dtype=q.dtype).view(1, n, 1)
    else:
        lengths = keep.sum(-1).clamp(min=1).to(q.dtype).view(-1, 1, 1)
    s = (q / lengths) @ k.transpose(-1, -2) + (bias if bias is not None else 0.0)
    w = F.relu(s).square() if act == "relu2" else ref_laplace(s)
    w = w * keep.unsqueeze(1)
    if causal:
        w = w * tril
    return w @ v


def ref_norm(layer: SeqBoatLayer, x: torch.Tensor) -> torch.Tensor:
    """The layer's norm from its formula (affine or not), statistics as the code's."""
    norm = layer.norm.norm
    kind = layer.norm.norm_type
    w = getattr(norm, "weight", None)
    if kind == "layernorm":
        return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, 1e-5)
    if kind == "scalenorm":
        g = norm.scalar if norm.scalar is not None else 1.0
        return g * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5)
    if kind == "rmsnorm":
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5)
        return y * w if w is not None else y
    if norm.training:  # statistics over batch × time, pads included
        mean, var = x.mean(dim=(0, 1)), x.var(dim=(0, 1), unbiased=False)
    else:
        mean, var = norm.running_mean, norm.running_var
    y = (x - mean) * torch.rsqrt(var + 1e-5)
    return y * w + norm.bias if w is not None else y


def compress(x: torch.Tensor, index: torch.Tensor, max_sl: int) -> torch.Tensor:
    """The code's compress: scatter into slot `index` of L' + 1 zero slots, drop slot 0."""
    shape = (x.shape[0], max_sl + 1, *x.shape[2:])
    idx = index.view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    out = torch.zeros(shape, dtype=x.dtype).scatter(1, idx, x)
    return out[:, 1:] if max_sl > 0 else 0 * out


def ref_unit(layer: SeqBoatLayer, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """The authors' `SeqBoatUnit.forward` (eval, 'simple' bias on original positions);
    pad (B, L) True at padding, as the code's mask."""
    att = layer.attention
    D, Z, E = layer.d_model, layer.z_dim, layer.v_dim
    B, L, _ = x.shape
    X = ref_norm(layer, x) if layer.prenorm else x
    H, _ = layer.ssm(X, ~pad)
    hu = layer.hx_proj(H)
    tick = torch.arange(1, L + 1).expand(B, L)
    keep = ~pad
    compressed = False
    if layer.router is not None:
        u, hx = torch.split(hu, [2, D], dim=-1)
        tau = layer.router.log_tau.exp()
        px = torch.softmax((u + torch.tensor([layer.act_bias, 0.0], dtype=DT)) / tau, dim=-1)
        q_p, q_ind = px.max(dim=-1)
        a = (q_ind == 1) & ~pad
        q_probs = q_p * a
        max_sl = int(a.sum(-1).max())
        threshold = 1.0 if att.mode == "local" else 0.9
        compressed = max_sl / L < threshold
        keep = a
        if compressed:
            index = a.long() * torch.cumsum(a.long(), dim=-1)
            H = compress(H, index, max_sl)
            tick = compress(tick, index, max_sl)
            keep = compress(a, index, max_sl).bool()
    else:
        hx = hu
    zrv = F.silu(layer.mx_proj(H))
    z, r, v = torch.split(zrv, [Z, E, E], dim=-1)
    q = z * layer.kappa[0] + layer.mu[0]
    k = z * layer.kappa[1] + layer.mu[1]
    bias = None
    if att.rel_pos_bias is not None:
        bias = ref_bias(att.rel_pos_bias.weight, tick)
    act = att.attention_activation
    if att.mode == "local":
        W = att.chunk_size
        scale = Z**-0.5 if act == "softmax" else 1.0 / (W if att.causal else 2 * W)
        h = ref_local(q * scale, k, v, keep, bias, W, att.causal, act)
    else:
        h = ref_global(q, k, v, keep, bias, att.causal, act)
    h = layer.h_proj(h * r)
    if layer.router is not None:
        if compressed:
            h = F.pad(h, (0, 0, 1, 0)).gather(1, index.unsqueeze(-1).expand(-1, -1, D))
        h = h * q_probs.unsqueeze(-1)
    out = F.silu(hx + h + x)
    return out if layer.prenorm else ref_norm(layer, out)


def make_layer(seed: int = 0, **kw) -> SeqBoatLayer:
    return seqboat_case.make_layer(seed, base=BASE, **kw)


def data(B: int = 3, L: int = 23, lengths=(23, 17, 5), seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, BASE["d_model"], generator=g, dtype=DT)
    mask = torch.arange(L) < torch.tensor(lengths).unsqueeze(1)
    return x, mask


# ------------------------------------------------------------------------ attention functions
@pytest.mark.parametrize("act", ["softmax", "relu2", "laplace"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_local_attention_is_the_codes_look_around_at_every_query(act: str, causal: bool) -> None:
    """Every query, including those whose window holds no key (uniform softmax over the
    look-around, −1 outside the sequence) and laplace's weight on masked slots."""
    torch.manual_seed(0)
    B, n, Z, E, W = 3, 11, 8, 5, 3
    att = CompressedAttention(Z, "local", W, act, "simple", max_positions=6, causal=causal)
    att = att.to(DT)
    with torch.no_grad():
        att.rel_pos_bias.weight.normal_()
    q, k = torch.randn(B, n, Z, dtype=DT), torch.randn(B, n, Z, dtype=DT)
    v = torch.randn(B, n, E, dtype=DT)
    keep = torch.zeros(B, n, dtype=torch.bool)
    keep[0, :] = True
    keep[1, [0, 1, 9]] = True  # some windows hold no key
    pos = torch.sort(torch.randperm(30)[:n]).values.expand(B, n)  # original positions
    out, _, _ = att(q, k, v, keep, pos)
    scale = Z**-0.5 if act == "softmax" else 1.0 / (W if causal else 2 * W)
    ref = ref_local(q * scale, k, v, keep, ref_bias(att.rel_pos_bias.weight, pos), W, causal, act)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if act == "softmax":  # row 2 has no key at all: the mean over its look-around slots
        first = torch.cat([-torch.ones(W, E, dtype=DT), v[2, :W], v[2, W : 2 * W]][: 3 - causal])
        torch.testing.assert_close(out[2, 0], first.mean(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("act", ["softmax", "relu2", "laplace"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_global_attention_is_the_codes_masked_weights(act: str, causal: bool) -> None:
    torch.manual_seed(1)
    B, n, Z, E = 3, 9, 8, 5
    att = CompressedAttention(Z, "full", 4, act, "simple", max_positions=5, causal=causal)
    att = att.to(DT)
    with torch.no_grad():
        att.rel_pos_bias.weight.normal_()
    q, k = torch.randn(B, n, Z, dtype=DT), torch.randn(B, n, Z, dtype=DT)
    v = torch.randn(B, n, E, dtype=DT)
    keep = torch.arange(n) < torch.tensor([9, 6, 2]).unsqueeze(1)
    pos = torch.arange(n).expand(B, n) * 2
    out, _, _ = att(q, k, v, keep, pos)
    ref = ref_global(q, k, v, keep, ref_bias(att.rel_pos_bias.weight, pos), causal, act)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_laplace_in_local_mode_refuses_to_stream() -> None:
    att = CompressedAttention(8, "local", 3, "laplace", causal=True).to(DT)
    q = torch.randn(1, 4, 8, dtype=DT)
    with pytest.raises(ValueError, match="laplace in local mode"):
        att(q, q, q, torch.ones(1, 4, dtype=torch.bool), torch.arange(4)[None], None, True)


# --------------------------------------------------------------------------------- the unit
UNIT_VARIANTS = {
    "laplace_local": {"attention_activation": "laplace"},
    "laplace_local_causal_prenorm": {"attention_activation": "laplace", "causal": True,
                                     "prenorm": True, "always_compress": False},
    "laplace_full": {"attention_activation": "laplace", "attention": "full"},
    "laplace_full_causal": {"attention_activation": "laplace", "attention": "full",
                            "causal": True, "always_compress": False},
    "relu2_full_causal": {"attention_activation": "relu2", "attention": "full", "causal": True,
                          "always_compress": False},
    "always_act_local_softmax": {"router": "none"},
    "always_act_local_laplace": {"router": "none", "attention_activation": "laplace"},
    "always_act_full_relu2_causal": {"router": "none", "attention": "full", "causal": True,
                                     "attention_activation": "relu2"},
    "layernorm_no_affine": {"norm_affine": False},
    "scalenorm_no_affine_prenorm": {"norm_type": "scalenorm", "norm_affine": False,
                                    "prenorm": True},
    "batchnorm_no_affine_always_act": {"norm_type": "batchnorm", "norm_affine": False,
                                       "router": "none", "prenorm": True},
}  # fmt: skip


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("act_bias", [-0.4, -50.0], ids=["partial", "all"])
@pytest.mark.parametrize("variant", list(UNIT_VARIANTS))
def test_unit_equals_the_codes_forward_at_every_position(
    variant: str, act_bias: float, train: bool
) -> None:
    """In training mode (no dropout) batch norm's statistics include the pad outputs."""
    layer = make_layer(**UNIT_VARIANTS[variant]).train(train)
    layer.act_bias = act_bias
    x, mask = data()
    with torch.no_grad():
        y, _, report = layer(x, mask, details=True)
        ref = ref_unit(layer, x, ~mask)
    if act_bias == -0.4 and layer.router is not None:
        assert 0 < report.details["active"].sum() < mask.sum(), "must be partly active"
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)


def test_always_activated_gau_writes_its_output_at_pads() -> None:
    """`--always-act`: the pad positions carry the GAU output, so they differ from the bypass
    alone (and enter batch-norm statistics as the code's do)."""
    layer = make_layer(router="none")
    x, mask = data()
    with torch.no_grad():
        y, _, _ = layer(x, mask)
        H, _ = layer.ssm(x, mask)
        bypass_only = layer.norm(F.silu(layer.hx_proj(H) + x))
    assert (y - bypass_only)[~mask].abs().amin(dim=-1).min() > 0


def test_norm_affine_false_has_no_norm_parameters() -> None:
    for norm_type in ("layernorm", "scalenorm", "rmsnorm", "batchnorm"):
        layer = make_layer(norm_type=norm_type, norm_affine=False)
        assert not [n for n, _ in layer.named_parameters() if n.startswith("norm.")]
    names = [n for n, _ in make_layer(norm_type="scalenorm").named_parameters()]
    assert [n for n in names if n.startswith("norm.")] == ["norm.norm.scalar"]


# ------------------------------------------------------------------------ Gumbel straight-through
@pytest.mark.parametrize("act_bias", [0.0, 0.7])
def test_hard_gumbel_router_is_the_codes_gumbel_softmax_hard(act_bias: float) -> None:
    """Training: (c, a) = max of F.gumbel_softmax(u + [b, 0], τ', hard=True) on the same noise;
    c is 1 forward and carries the soft probability's gradient; evaluation: c = 1, argmax u."""
    router = GumbelSoftmaxRouter(tau_start=1.3, hard=True).train()
    g = torch.Generator().manual_seed(0)
    u = torch.randn(4, 9, 2, generator=g, dtype=DT, requires_grad=True)
    valid = torch.ones(4, 9, dtype=torch.bool)
    valid[3, 6:] = False
    w = torch.randn(4, 9, generator=g, dtype=DT)
    tau = float(router.tau)
    torch.manual_seed(11)
    routing = router(None, u, valid, act_bias)
    (grad,) = torch.autograd.grad((routing.confidence * w).sum(), u)

    u_ref = u.detach().clone().requires_grad_(True)
    torch.manual_seed(11)
    y = F.gumbel_softmax(u_ref + torch.tensor([act_bias, 0.0], dtype=DT), tau=tau, hard=True)
    q_p, q_ind = y.max(dim=-1)
    a = (q_ind == 1) & valid
    (grad_ref,) = torch.autograd.grad((q_p * a * w).sum(), u_ref)
    assert torch.equal(routing.active, a)
    assert 0 < a.sum() < valid.sum()
    torch.testing.assert_close(routing.confidence, (q_p * a).detach(), rtol=0, atol=0)
    torch.testing.assert_close(routing.confidence[a], torch.ones(int(a.sum()), dtype=DT))
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)
    assert grad.abs().sum() > 0

    router.eval()
    r_eval = router(None, u.detach(), valid, act_bias)
    logits = u.detach() + torch.tensor([act_bias, 0.0], dtype=DT)
    assert torch.equal(r_eval.active, (logits[..., 1] > logits[..., 0]) & valid)
    assert torch.equal(r_eval.confidence, r_eval.active.to(DT))


def test_hard_gumbel_layer_trains_and_is_refused_for_other_routers() -> None:
    model = (
        SeqBoatConfig(**{**BASE, "router": "gumbel", "gumbel_hard": True}).build().to(DT).train()
    )
    x, mask = data()
    y = model(x, mask).y
    y.square().sum().backward()
    assert model.layers[0].layer.hx_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="gumbel_hard"):
        SeqBoatConfig(router="softmax", gumbel_hard=True)


@pytest.mark.parametrize("act", ["relu2", "laplace"])
def test_full_mode_packs_only_below_the_codes_density_threshold(act: str) -> None:
    """Row 0 activates 21 of its 23 tokens (≥ 0.9): the code does not pack, so causal relu² and
    laplace divide by the original index + 1; packing anyway (always_compress) differs."""
    layer = make_layer(attention="full", causal=True, attention_activation=act,
                       always_compress=False)  # fmt: skip
    x, mask = data()
    with torch.no_grad():
        H, _ = layer.ssm(x, mask)
        u = layer.hx_proj(H)[..., :2]
        margin = u[..., 1] - u[..., 0]
        layer.act_bias = float(margin[0].sort().values[1])  # skip the two lowest of row 0
        y, _, report = layer(x, mask, details=True)
        ref = ref_unit(layer, x, ~mask)
        layer.compress_always = True
        y_packed, _, _ = layer(x, mask)
    assert int(report.details["active"][0].sum()) == 21 and not report.details["packed"]
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    assert (y - y_packed)[mask].abs().max() > 1e-6


# ----------------------------------------------------------------- options of the authors' code
def golden_ctor() -> dict:
    return json.loads(golden.load_case("seqboat", "layer_bidirectional")["config"])["ctor"]


def golden_lra_args() -> dict:
    return json.loads(golden.load_case("seqboat", "encoder")["config"])["args"]


ENWIK8_ARGS = {  # slag_lm_enwik8_base_v2 with the README command (seqboat-code.md §2.3)
    "decoder_embed_dim": 616, "decoder_input_dim": 616, "decoder_layers": 14,
    "decoder_z_dim": 128, "decoder_hidden_dim": 1232, "decoder_n_dim": 16,
    "decoder_ffn_embed_dim": -1, "decoder_chunk_size": 1024, "truncation_length": 2048,
    "rel_pos_bias": "rotary", "attention_activation_fn": "softmax", "activation_fn": "silu",
    "max_target_positions": 10384, "normalization_type": "layernorm", "normalize_before": True,
    "no_affine_final_norm": True, "share_decoder_input_output_embed": True,
    "init_temp_scale": 1.0, "local_pos": False, "dropout": 0.15, "attention_dropout": 0.0,
    "hidden_dropout": 0.0, "activation_dropout": 0.0, "feature_dropout": False,
    "normalize_embedding": False, "no_scale_embedding": False, "adaptive_input": False,
    "adaptive_softmax_cutoff": None, "tie_adaptive_weights": False, "decoder_embed_path": None,
    "report_ema_alpha": False, "write_out_alpha": False,
}  # fmt: skip


def test_unit_options_map_onto_the_config() -> None:
    ctor = {**golden_ctor(), "norm_affine": False, "attention_activation": "laplace",
            "always_act": True, "bidirectional": False}  # fmt: skip
    kw = unit_kwargs_from_reference(ctor)
    assert set(ctor) == set(UNIT_OPTIONS)
    assert kw["norm_affine"] is False and kw["router"] == "none" and kw["causal"] is True
    assert kw["attention_activation"] == "laplace" and kw["attention"] == "local"
    SeqBoatLayer(SeqBoatConfig(**kw))
    full = unit_kwargs_from_reference({**golden_ctor(), "chunk_size": -1, "local_pos": True})
    assert full["attention"] == "full" and full["local_pos"] is False  # the code ignores it
    assert not full["always_compress"]
    always = unit_kwargs_from_reference({**golden_ctor(), "chunk_size": -1,
                                         "density_threshold": 2.0})  # fmt: skip
    assert always["always_compress"] is True
    with pytest.raises(ValueError, match=re.escape("density_threshold=0.5")):
        unit_kwargs_from_reference({**golden_ctor(), "chunk_size": -1, "density_threshold": 0.5})


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("window_size", 4, "unknown SeqBoatUnit option"),
        ("activation", "gelu", "activation='gelu'"),
        ("feature_dropout", True, "feature_dropout=True"),
        ("rel_pos_bias", "t5", "rel_pos_bias='t5'"),
    ],
)
def test_unsupported_unit_options_are_refused_by_name(option, value, match) -> None:
    with pytest.raises(ValueError, match=match):
        unit_kwargs_from_reference({**golden_ctor(), option: value})


def test_a_unit_without_norm_affine_loads_the_codes_weights() -> None:
    d = golden.load_case("seqboat", "layer_bidirectional")
    sd = {k: v for k, v in prefixed(d, "state_dict.").items() if not k.startswith("norm.")}
    kw = unit_kwargs_from_reference({**golden_ctor(), "norm_affine": False})
    layer = SeqBoatLayer(SeqBoatConfig(**kw)).to(DT)
    layer.load_state_dict(convert_unit(sd), strict=True)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("layer_type", "mega"), ("activation_fn", "gelu"), ("feature_dropout", True),
        ("normalize_embedding", True), ("rel_pos_bias", "t5"), ("encoder_layerdrop", 0.1),
        ("quant_noise_pq", 0.1), ("use_p", True), ("sen_rep_type", "cls"),
        ("classifier_layers", 2), ("classifier_activation_fn", "relu"),
        ("apply_bert_init", True),
    ],
)  # fmt: skip
def test_unsupported_lra_options_are_refused_by_name(option: str, value) -> None:
    args = golden_lra_args()
    seqboat_kwargs_from_fairseq(args)
    with pytest.raises(ValueError, match=re.escape(f"{option}={value!r}")):
        seqboat_kwargs_from_fairseq({**args, option: value})


def test_lm_options_map_onto_a_causal_seqboat() -> None:
    kw = seqboat_lm_kwargs_from_fairseq(ENWIK8_ARGS)
    assert kw["causal"] and kw["prenorm"] and kw["final_norm_affine"] is False
    assert (kw["attention"], kw["chunk_size"], kw["rel_pos_bias"]) == ("local", 1024, "rotary")
    assert (kw["max_positions"], kw["truncation"], kw["ffn_dim"]) == (10384, 2048, 0)
    assert kw["input_dropout"] == kw["dropout"] == 0.15
    small = {**kw, "d_model": 16, "z_dim": 8, "v_dim": 32, "num_layers": 1, "chunk_size": 4}
    SeqBoatConfig(**small).build()


@pytest.mark.parametrize(
    ("option", "value"),
    [("adaptive_input", True), ("adaptive_softmax_cutoff", "20000,60000"),
     ("decoder_input_dim", 512), ("decoder_embed_path", "emb.txt"),
     ("activation_fn", "gelu"), ("rel_pos_bias", "t5"), ("feature_dropout", True),
     ("normalize_embedding", True), ("tie_adaptive_weights", True)],
)  # fmt: skip
def test_unsupported_lm_options_are_refused_by_name(option: str, value) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{option}={value!r}")):
        seqboat_lm_kwargs_from_fairseq({**ENWIK8_ARGS, option: value})
