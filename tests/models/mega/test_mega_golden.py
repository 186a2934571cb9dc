"""Mega vs the authors' code: every golden case in `<shared>/golden/mega/` (see its README).

Each file holds the reference weights, inputs, outputs and gradients computed by the authors'
modules in float64. We load the weights through `megalab.models.mega.convert`, run our modules in
float64 and compare with e = max|ours − ref| / max|ref| per tensor:

- against `output` / `grad.*` / `incremental*` (the reference with its four float32 casts):
  e ≤ 2e-5;
- against `pure64.*` (the same runs entirely in float64, which is what we compute): e ≤ 1e-10.

Outputs are compared at every position, padded ones included: we reproduce the reference's pad
behaviour too (ω ⊙ x on the unmasked input; softmax leaves an all-padding chunk unmasked).
Where the golden data is found, and when a missing one fails: `tests/golden.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

import golden
from golden import prefixed, rel_err
from megalab.models.mega.convert import (
    convert_ema,
    convert_encoder_layer,
    convert_lra_model,
    convert_maga,
    maga_config_from_reference,
    mask_from_padding_mask,
    mega_kwargs_from_fairseq,
    to_batch_first,
)
from megalab.models.mega.model import MegaBlock, MegaConfig, MovingAverageGatedAttention
from megalab.nn.ema import DampedEMA

REF_TOL = 2e-5
PURE64_TOL = 1e-10


MODULE_CASES = [
    "ema_bidirectional",
    "ema_bidirectional_padded",
    "ema_causal",
    "ema_causal_padded",
    "ema_truncated",
    "ema_truncated_causal",
    "maga_softmax_full",
    "maga_softmax_full_rotary_postnorm",
    "maga_softmax_chunk",
    "maga_laplace_chunk",
    "maga_laplace_chunk_rotary_postnorm",
    "maga_laplace_short_chunk",
    "maga_relu2",
    "maga_relu2_chunk_rotary",
    "maga_causal_softmax_chunk",
    "maga_causal_softmax_full",
    "maga_causal_laplace_chunk",
    "encoder_layer_layernorm",
    "encoder_layer_scalenorm",
    "encoder_layer_rmsnorm_prenorm",
    "encoder_layer_batchnorm_prenorm",
]


def load_case(name: str) -> dict:
    return golden.load_case("mega", name)


def build(d: dict, dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, Callable]:
    """Our module for a golden case, with the converted reference weights, in `dtype`."""
    cfg = json.loads(d["config"])
    kw = cfg["kwargs"]
    if d["class"] == "MultiHeadEMA":
        module = DampedEMA(kw["embed_dim"], kw["ndim"], kw["bidirectional"], kw["truncation"])
        convert = convert_ema
    elif d["class"] == "MovingAverageGatedAttention":
        module = MovingAverageGatedAttention(maga_config_from_reference(kw))
        convert = convert_maga
    elif d["class"] == "MegaSentenceEncoderLayer":
        module = MegaBlock(maga_config_from_reference(kw))
        convert = convert_encoder_layer
    else:
        raise AssertionError(d["class"])
    module = module.to(dtype)
    module.load_state_dict(convert(prefixed(d, "state_dict.")), strict=True)
    return module.eval(), convert


@pytest.mark.parametrize("name", MODULE_CASES)
def test_golden_forward_and_gradients(name: str) -> None:
    d = load_case(name)
    module, convert = build(d)
    x = to_batch_first(d["input"]).clone().requires_grad_(True)
    mask = mask_from_padding_mask(d.get("padding_mask"))
    y, _ = module(x, mask)
    y_tf = y.transpose(0, 1)  # back to the reference's time-first layout
    assert rel_err(y_tf, d["output"]) <= REF_TOL
    assert rel_err(y_tf, d["pure64.output"]) <= PURE64_TOL

    loss = (y_tf * d["grad_weight"]).sum()
    assert abs(loss.item() - d["pure64.loss"]) <= PURE64_TOL * max(1.0, abs(d["pure64.loss"]))
    loss.backward()
    assert rel_err(x.grad.transpose(0, 1), d["grad.input"]) <= REF_TOL
    assert rel_err(x.grad.transpose(0, 1), d["pure64.grad.input"]) <= PURE64_TOL

    assert_parameter_grads(dict(module.named_parameters()), d, convert)


@pytest.mark.parametrize("name", [c for c in MODULE_CASES if c.startswith("ema_")])
def test_golden_ema_kernel(name: str) -> None:
    d = load_case(name)
    module, _ = build(d)
    ref = d["aux.kernel"]
    with torch.no_grad():
        assert rel_err(module.kernel(ref.shape[1]), ref) <= 1e-12


@pytest.mark.parametrize("name", [c for c in MODULE_CASES if c.startswith("maga_")])
def test_golden_rel_pos_bias(name: str) -> None:
    d = load_case(name)
    module, _ = build(d)
    ref = d["aux.rel_pos_bias"]
    with torch.no_grad():
        bias = module.attention.rel_pos_bias(ref.shape[0], ref.shape[1])
    # The reference builds rotary sin/cos tables in float32 (README §5); we use float64.
    assert rel_err(bias, ref) <= REF_TOL


def test_golden_ema_streaming() -> None:
    """`ema_causal`: one token at a time, and segments [5, 1, 12, 8, 11], with carried state."""
    d = load_case("ema_causal")
    module, _ = build(d)
    x = to_batch_first(d["input"])
    for key in ("incremental0", "incremental1"):
        segments = d[f"{key}.segment_lengths"].tolist()
        state = module.initial_state(x.shape[0], x)
        outs, start = [], 0
        with torch.no_grad():
            for n in segments:
                y, state = module(x[:, start : start + n], state=state)
                outs.append(y)
                start += n
        assert start == x.shape[1]
        assert rel_err(torch.cat(outs, 1).transpose(0, 1), d[f"{key}.output"]) <= REF_TOL
        assert rel_err(torch.cat(outs, 1).transpose(0, 1), d["pure64.output"]) <= PURE64_TOL
        assert rel_err(state, d[f"{key}.final_state"]) <= REF_TOL


@pytest.mark.parametrize("name", [c for c in MODULE_CASES if c.startswith("maga_causal")])
def test_golden_maga_token_by_token(name: str) -> None:
    """Token-by-token decoding with a carried EMA state and a KV cache dropped per chunk."""
    d = load_case(name)
    module, _ = build(d)
    x = to_batch_first(d["input"])
    state = module.initial_state(x.shape[0], x)
    outs = []
    with torch.no_grad():
        for t in range(x.shape[1]):
            y, state = module(x[:, t : t + 1], None, state)
            outs.append(y)
    y = torch.cat(outs, 1).transpose(0, 1)
    assert rel_err(y, d["incremental.output"]) <= REF_TOL
    assert rel_err(y, d["pure64.output"]) <= PURE64_TOL


# ------------------------------------------------------------------------------------------ LRA
LRA_CASES = ["lra_encoder", "lra_encoder_image"]


def assert_parameter_grads(params: dict[str, torch.Tensor], d: dict, convert: Callable) -> None:
    """Every parameter has a gradient, close to the reference's and to its pure-float64 run's."""
    pure_grads = golden.parameter_grads(d, convert, "pure64.grad.")

    def check(pname: str, grad: torch.Tensor, ref: torch.Tensor) -> None:
        assert rel_err(grad, ref) <= REF_TOL, pname
        assert rel_err(grad, pure_grads[pname]) <= PURE64_TOL, pname

    golden.assert_grads_match(params, golden.parameter_grads(d, convert), check)


def build_lra(d: dict, dtype: torch.dtype = torch.float64):
    """The authors' LRAModel as our ClassificationTask(encoder, Mega, head), in `dtype`."""
    # Imported here: the task module pulls in Lightning, which the module cases do not need.
    from megalab.tasks.classification import ClassificationTask

    encoder, head, args, cfg = golden.lra_encoder_and_head(d)
    task = ClassificationTask(
        encoder, MegaConfig(**mega_kwargs_from_fairseq(args)).build(), head,
        num_classes=args["sentence_class_num"], pooling="mean",
    )  # fmt: skip
    task = task.to(dtype)
    task.load_state_dict(convert_lra_model(prefixed(d, "state_dict.")), strict=True)
    return task.eval(), convert_lra_model, cfg


@pytest.mark.parametrize("name", LRA_CASES)
def test_golden_lra_model(name: str) -> None:
    d = load_case(name)
    task, convert, cfg = build_lra(d)
    inputs = d["input"]
    text = cfg["args"]["input_type"] == "text"
    if text:
        mask = inputs != cfg["padding_idx"]
        assert torch.equal(mask.sum(1), d["src_lengths"])  # mean-pool divisor: real tokens
    else:
        mask = None
        inputs = inputs.clone().requires_grad_(True)
    logits = task(inputs, mask)
    assert rel_err(logits, d["output"]) <= REF_TOL
    assert rel_err(logits, d["pure64.output"]) <= PURE64_TOL

    # Intermediate tensors: last hidden states (real positions; the reference pads 37 -> 40 with
    # pad tokens, we pad inside attention only) and the pooled representation.
    with torch.no_grad():
        hidden = task.encode(inputs, mask).y
        T = hidden.shape[1]
        assert rel_err(hidden, to_batch_first(d["aux.encoder_last_hidden"])[:, :T]) <= REF_TOL
        assert rel_err(task.features(inputs, mask), d["aux.sentence_rep"]) <= REF_TOL

    loss = (logits * d["grad_weight"]).sum()
    loss.backward()
    if not text:
        assert rel_err(inputs.grad, d["grad.input"]) <= REF_TOL
        assert rel_err(inputs.grad, d["pure64.grad.input"]) <= PURE64_TOL
    assert_parameter_grads(dict(task.named_parameters()), d, convert)
