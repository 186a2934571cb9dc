"""Megalodon vs the authors' code: every golden case in `<shared>/golden/megalodon/` (its README).

The cases hold the official modules' weights, inputs, outputs and gradients in float32 (plain
keys) and the same runs in float64 (`fp64.*`). We load the weights through
`megalab.models.megalodon.convert`, run our modules in both precisions and compare with
e = max|ours − ref| / max|ref| per tensor: float32 outputs and states within 1e-5, gradients
within 5e-5 (the README's suggested checks); float64 everything within 1e-10; integer counts
exactly. Where the golden data is found, and when a missing one fails: `tests/golden.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

import golden
from golden import prefixed, rel_err
from megalab.models.megalodon.cema import CEMAState, ComplexEMA
from megalab.models.megalodon.convert import (
    convert_block,
    convert_cema,
    convert_cema_state,
    convert_lm,
    convert_timestep_norm,
    megalodon_kwargs_from_reference,
)
from megalab.models.megalodon.model import MegalodonBlock, MegalodonConfig
from megalab.models.megalodon.timestep_norm import TimestepNorm, TimestepNormState

OUT_TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
GRAD_TOL = {torch.float32: 5e-5, torch.float64: 1e-10}
DTYPES = [torch.float32, torch.float64]
IDS = ["fp32", "fp64"]


def within(tol: float) -> Callable[[str, torch.Tensor, torch.Tensor], None]:
    """A gradient check: relative error at most `tol`."""

    def check(name: str, grad: torch.Tensor, ref: torch.Tensor) -> None:
        assert rel_err(grad, ref) <= tol, name

    return check


def load_case(name: str) -> dict:
    return golden.load_case("megalodon", name)


def key(dtype: torch.dtype, name: str) -> str:
    """The golden key of `name` for a run in `dtype` (float64 keys add `fp64.`)."""
    return f"fp64.{name}" if dtype == torch.float64 else name


def params_of(d: dict, prefix: str) -> dict:
    """Parameter entries under `prefix` (inputs such as `x` left out)."""
    return {k: v for k, v in prefixed(d, prefix).items() if k not in ("x", "hx")}


# ------------------------------------------------------------------------------------- CEMA
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("variant", ["no_hx", "with_hx"])
def test_cema(dtype: torch.dtype, variant: str) -> None:
    """Output, last state and every gradient, from zero and from a carried state (B = 2)."""
    d = load_case("cema")
    cfg = json.loads(d["config"])
    cema = ComplexEMA(cfg["embed_dim"], cfg["ndim"]).to(dtype).eval()
    cema.load_state_dict(
        {k: v.to(dtype) for k, v in convert_cema(prefixed(d, "state_dict.")).items()}
    )
    x = d["input.x"].to(dtype).transpose(1, 2).clone().requires_grad_(True)  # (B, L, D)
    hx = d["input.hx"].to(dtype).clone().requires_grad_(True)
    state = CEMAState(convert_cema_state(hx)) if variant == "with_hx" else None
    y, new = cema(x, state=state, return_state=True)
    y = y.transpose(1, 2)  # back to the code's (B, D, L)
    h = torch.view_as_real(new.h)
    tol, gtol = OUT_TOL[dtype], GRAD_TOL[dtype]
    assert rel_err(y, d[key(dtype, f"{variant}.output.y")]) <= tol
    assert rel_err(h, d[key(dtype, f"{variant}.output.h")]) <= tol
    loss = (y * d["grad_weight.y"].to(dtype)).sum() + (h * d["grad_weight.h"].to(dtype)).sum()
    loss.backward()
    assert rel_err(x.grad.transpose(1, 2), d[key(dtype, f"{variant}.grad.x")]) <= gtol
    if variant == "with_hx":
        assert rel_err(hx.grad, d[key(dtype, f"{variant}.grad.hx")]) <= gtol
    ref = convert_cema(params_of(d, key(dtype, f"{variant}.grad.")))
    assert set(ref) == {n for n, _ in cema.named_parameters()}
    for name, p in cema.named_parameters():
        assert rel_err(p.grad, ref[name]) <= gtol, name


# ---------------------------------------------------------------------------- TimestepNorm
def _timestep_norm(d: dict, dtype: torch.dtype) -> TimestepNorm:
    cfg = json.loads(d["config"])
    norm = TimestepNorm(cfg["num_features"], cfg["num_groups"], eps=cfg["eps"]).to(dtype)
    sd = convert_timestep_norm(prefixed(d, "state_dict."))
    norm.load_state_dict({k: v.to(dtype) for k, v in sd.items()})
    return norm


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_timestep_norm(dtype: torch.dtype) -> None:
    """Carried prior state (counts 7, 0, 12), right padding, outputs, new state, gradients."""
    d = load_case("timestep_norm")
    norm = _timestep_norm(d, dtype)
    x = d["input.x"].to(dtype).clone().requires_grad_(True)
    prev_mean = d["input.prev_mean"].to(dtype).clone().requires_grad_(True)
    prev_var = d["input.prev_var"].to(dtype).clone().requires_grad_(True)
    state = TimestepNormState(d["input.prev_count"], prev_mean, prev_var)
    y, new = norm(x, ~d["input.padding_mask"], state)
    tol, gtol = OUT_TOL[dtype], GRAD_TOL[dtype]
    assert rel_err(y, d[key(dtype, "output.y")]) <= tol
    assert rel_err(new.mean, d[key(dtype, "output.mean")]) <= tol
    assert rel_err(new.var, d[key(dtype, "output.var")]) <= tol
    assert torch.equal(new.count, d[key(dtype, "output.count")])
    loss = sum((t * d[f"grad_weight.{n}"].to(dtype)).sum()
               for n, t in (("y", y), ("mean", new.mean), ("var", new.var)))  # fmt: skip
    loss.backward()
    assert rel_err(x.grad, d[key(dtype, "grad.x")]) <= gtol
    assert rel_err(prev_mean.grad, d[key(dtype, "grad.prev_mean")]) <= gtol
    assert rel_err(prev_var.grad, d[key(dtype, "grad.prev_var")]) <= gtol
    assert rel_err(norm.weight.grad, d[key(dtype, "grad.weight")]) <= gtol
    assert rel_err(norm.bias.grad, d[key(dtype, "grad.bias")]) <= gtol


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_timestep_norm_midpad_forward(dtype: torch.dtype) -> None:
    """Pads at the start and in the middle (forward only: the code's CPU backward is wrong
    there, README caveats; tests/models/megalodon/test_timestep_norm.py checks our gradients)."""
    d = load_case("timestep_norm")
    norm = _timestep_norm(d, dtype)
    state = TimestepNormState(
        d["input.prev_count"], d["input.prev_mean"].to(dtype), d["input.prev_var"].to(dtype)
    )
    with torch.no_grad():
        y, new = norm(d["input.x"].to(dtype), ~d["input.midpad_padding_mask"], state)
    tol = OUT_TOL[dtype]
    assert rel_err(y, d[key(dtype, "midpad.output.y")]) <= tol
    assert rel_err(new.mean, d[key(dtype, "midpad.output.mean")]) <= tol
    assert rel_err(new.var, d[key(dtype, "midpad.output.var")]) <= tol
    assert torch.equal(new.count, d[key(dtype, "midpad.output.count")])


# ------------------------------------------------------------------------------------ layer
def _block(d: dict, dtype: torch.dtype) -> MegalodonBlock:
    kw = megalodon_kwargs_from_reference(json.loads(d["config"])["ModelConf"])
    block = MegalodonBlock(MegalodonConfig(**kw)).to(dtype).eval()
    sd = convert_block(params_of(d, "state_dict."))
    block.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    return block


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_layer_forward_and_gradients(dtype: torch.dtype) -> None:
    """One MegaBlock over 37 tokens with chunk 8: four full chunks and a 5-token one, in one
    call (the code needed 32 tokens and then 5 with its cache; the function is the same)."""
    d = load_case("layer")
    block = _block(d, dtype)
    x = d["input.x"].to(dtype).clone().requires_grad_(True)
    y, _ = block(x)
    assert rel_err(y, d[key(dtype, "output.y")]) <= OUT_TOL[dtype]
    (y * d["grad_weight.y"].to(dtype)).sum().backward()
    gtol = GRAD_TOL[dtype]
    assert rel_err(x.grad, d[key(dtype, "grad.x")]) <= gtol
    ref = convert_block(params_of(d, key(dtype, "grad.")))
    golden.assert_grads_match(dict(block.named_parameters()), ref, within(gtol))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_layer_cache_path(dtype: torch.dtype) -> None:
    """The code's own way through 37 tokens: 32 with an empty state, then 5 carrying the
    timestep-norm statistics, the CEMA state and the KV cache (whose 5 tokens stay open)."""
    d = load_case("layer")
    block = _block(d, dtype)
    x = d["input.x"].to(dtype)
    with torch.no_grad():
        state = block.attn.initial_state(x.shape[0], x)
        y1, state = block(x[:, :32], state=state)
        assert state.kv.key.shape[1] == 0  # 32 tokens close four chunks of 8
        y2, state = block(x[:, 32:], state=state)
    assert state.kv.key.shape[1] == 5 and torch.equal(state.norm.count, torch.tensor([37, 37]))
    assert rel_err(torch.cat([y1, y2], 1), d[key(dtype, "output.y")]) <= OUT_TOL[dtype]


# ------------------------------------------------------------------------------------ model
def _lm(d: dict, dtype: torch.dtype):
    """The authors' 2-layer LM as our LanguageModelingTask (encoder, Megalodon, LM head)."""
    from megalab.nn.embedding import SequenceEncoder
    from megalab.tasks.language_modeling import LanguageModelingTask, LinearLMHead

    conf = json.loads(d["config"])["ModelConf"]
    kw = megalodon_kwargs_from_reference(conf)
    D, V = kw["d_model"], conf["vocab_size"]
    encoder = SequenceEncoder(D, vocab_size=V, token_scale=conf["scale_emb"])
    task = LanguageModelingTask(
        encoder, MegalodonConfig(**kw).build(), LinearLMHead(D, V), tie_weights=conf["share_emb"]
    )
    sd = convert_lm(params_of(d, "state_dict."), rope_base=conf["rope_base"])
    task.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    return task.to(dtype).eval()


def _logits(task, tokens: torch.Tensor, state=None):
    out = task(tokens, None, state)
    return task.head.proj(out.y), out.state


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_model_logits_and_gradients(dtype: torch.dtype) -> None:
    """Embedding -> 2 blocks (SwiGLU, RoPE base 1e5, 2 heads) -> final TimestepNorm -> head,
    over 32 tokens in chunks of 8: logits and the gradient of every parameter."""
    d = load_case("model_chunked_stream")
    task = _lm(d, dtype)
    logits, _ = _logits(task, d["input.tokens"])
    assert rel_err(logits, d[key(dtype, "output.logits")]) <= OUT_TOL[dtype]
    (logits * d["grad_weight.logits"].to(dtype)).sum().backward()
    ref = convert_lm(params_of(d, key(dtype, "grad.")))
    golden.assert_grads_match(dict(task.named_parameters()), ref, within(GRAD_TOL[dtype]))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("pattern", ["halves", "mixed"])
def test_model_streaming(dtype: torch.dtype, pattern: str) -> None:
    """Segments [0,16)+[16,32) and [0,5)+[5,8)+[8,16)+[16,32) with the carried state: logits
    and every state tensor (norm statistics, CEMA states, final-norm statistics, KV length)."""
    d = load_case("model_chunked_stream")
    task = _lm(d, dtype)
    tokens = d["input.tokens"]
    segments = json.loads(d["config"])["stream_patterns"][pattern]
    state = task.initial_state(tokens.shape[0])
    outs = []
    with torch.no_grad():
        for start, end in segments:
            logits, state = _logits(task, tokens[:, start:end], state)
            outs.append(logits)
    tol = OUT_TOL[dtype]
    prefix = f"stream.{pattern}."
    assert rel_err(torch.cat(outs, 1), d[key(dtype, prefix + "output.logits")]) <= tol
    # Streaming equals the whole-sequence pass (README: 9.5e-7 in float32, 1.8e-15 in float64).
    assert rel_err(torch.cat(outs, 1), d[key(dtype, "output.logits")]) <= tol
    for i, layer in enumerate(state.layers):
        ref = prefixed(d, key(dtype, f"{prefix}state.layers.{i}."))
        assert layer.kv.key.shape[1] == ref["kv_count"] == 0
        assert torch.equal(layer.norm.count, ref["norm_count"])
        assert rel_err(layer.norm.mean, ref["norm_mean"]) <= tol
        assert rel_err(layer.norm.var, ref["norm_var"]) <= tol
        assert rel_err(torch.view_as_real(layer.cema.h), ref["hx"]) <= tol
    ref = prefixed(d, key(dtype, f"{prefix}state.final_norm."))
    assert torch.equal(state.final_norm.count, ref["count"])
    assert rel_err(state.final_norm.mean, ref["mean"]) <= tol
    assert rel_err(state.final_norm.var, ref["var"]) <= tol
