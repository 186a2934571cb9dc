"""SeqBoat vs the authors' code: every golden case in `<shared>/golden/seqboat/` (its README).

Each case comes twice: `NAME.pt`, the reference run in float64 (its float32 casts lifted), and
`NAME_fp32.pt`, the reference exactly as written in float32. We load the weights through
`megalab.models.seqboat.convert`, run our modules in the file's dtype and compare with
`torch.testing.assert_close` at the README's tolerances (float64: rtol 1e-9, atol 1e-10;
float32: 1e-4): the output at every position (pads included: our layer keeps the reference's
deterministic pad values inside the stack), the gradient of the input and of every parameter,
the gate decisions and ranks exactly, the router logits and probabilities, the confidences,
the EMA output and the packed attention output on its valid slots. Where the golden data is
found, and when a missing one fails: `tests/golden.py`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import golden
from golden import prefixed
from megalab.models.seqboat.convert import (
    convert_lra_model,
    convert_unit,
    mask_from_padding_mask,
    seqboat_kwargs_from_fairseq,
    to_batch_first,
    unit_kwargs_from_reference,
)
from megalab.models.seqboat.model import SeqBoatConfig, SeqBoatLayer
from megalab.nn.heads import pool

UNIT_CASES = [
    "layer_bidirectional",
    "layer_causal",
    "layer_causal_relu2",
    "layer_softmax",
    "layer_local_pos",
    "layer_all_active",
    "layer_none_active",
    "layer_no_compress_mixed",
]
ENCODER_CASES = ["encoder", "encoder_image"]
FLAVOURS = {"": {"rtol": 1e-9, "atol": 1e-10}, "_fp32": {"rtol": 1e-4, "atol": 1e-4}}


def load_case(name: str) -> dict[str, Any]:
    return golden.load_case("seqboat", name)


def close(actual: torch.Tensor, expected: torch.Tensor, tol: dict, what: str) -> None:
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


def build_unit(d: dict[str, Any]) -> SeqBoatLayer:
    """Our layer for a unit case, with the converted reference weights, in the file's dtype."""
    cfg = json.loads(d["config"])
    layer = SeqBoatLayer(SeqBoatConfig(**unit_kwargs_from_reference(cfg["ctor"])))
    layer = layer.to(torch.float64 if d["dtype"] == "float64" else torch.float32)
    layer.load_state_dict(convert_unit(prefixed(d, "state_dict.")), strict=True)
    layer.act_bias = float(d["act_bias"])
    return layer.eval()


def check_routing(details: dict, d: dict, prefix: str, tol: dict) -> None:
    """Gates and ranks exactly; logits, probabilities, confidences, EMA and packed attention."""
    assert torch.equal(details["active"], d[prefix + "gate"]), "gate decisions differ"
    assert torch.equal(details["rank"], d[prefix + "gate_rank"]), "gate ranks differ"
    assert details["packed"] == d[prefix + "compressed"]
    assert details["length"] == max(d[prefix + "max_sl"], 1)
    close(details["confidence"], d[prefix + "q_probs"], tol, "q_probs")
    close(details["logits"], d[prefix + "inter.router_logits"], tol, "router logits")
    close(details["probs"], d[prefix + "inter.router_probs"], tol, "router probs")
    close(details["ssm_out"], F.silu(to_batch_first(d[prefix + "inter.ema_out"])), tol, "EMA")
    ref = d[prefix + "inter.attn_out"]
    ours = details["attn_out"]
    assert ours.shape == ref.shape
    if details["packed"]:
        # Valid packed slots: s < number of activated tokens of the row.
        keep = torch.arange(ref.shape[1]) < d[prefix + "gate"].sum(1, keepdim=True)
    else:
        keep = d[prefix + "gate"]  # no compression: activated positions only
    close(ours[keep], ref[keep], tol, "packed attention output")


@pytest.mark.parametrize("flavour", list(FLAVOURS), ids=["float64", "fp32"])
@pytest.mark.parametrize("name", UNIT_CASES)
def test_golden_unit(name: str, flavour: str) -> None:
    d = load_case(name + flavour)
    tol = FLAVOURS[flavour]
    layer = build_unit(d)
    x = to_batch_first(d["input"]).clone().requires_grad_(True)
    mask = mask_from_padding_mask(d.get("padding_mask"))
    y, _, report = layer(x, mask, details=True)
    y_tf = y.transpose(0, 1)  # back to the reference's time-first layout
    close(y_tf, d["output"], tol, "output")
    check_routing(report.details, d, "", tol)

    (y_tf * d["grad_weight"]).sum().backward()
    close(x.grad.transpose(0, 1), d["grad.input"], tol, "grad.input")
    check_parameter_grads(dict(layer.named_parameters()), d, convert_unit, tol)


def test_golden_none_active_attention_grads_are_zero() -> None:
    """L' = 0: the attention branch contributes exactly 0 and its parameters (and τ) get a zero
    gradient, not None (the code keeps one invalid slot, so data-parallel ranks agree)."""
    d = load_case("layer_none_active")
    layer = build_unit(d)
    x = to_batch_first(d["input"]).clone().requires_grad_(True)
    y, _, report = layer(x, mask_from_padding_mask(d.get("padding_mask")), details=True)
    assert not report.details["active"].any()
    (y.transpose(0, 1) * d["grad_weight"]).sum().backward()
    for name in ("mx_proj.weight", "h_proj.weight", "kappa", "mu", "router.log_tau",
                 "attention.rel_pos_bias.weight"):  # fmt: skip
        grad = dict(layer.named_parameters())[name].grad
        assert grad is not None and torch.count_nonzero(grad) == 0, name


def check_parameter_grads(
    params: dict[str, torch.Tensor], d: dict[str, Any], convert: Any, tol: dict
) -> None:
    """Every parameter has a gradient, within `tol` of the reference's."""
    golden.assert_grads_match(
        params, golden.parameter_grads(d, convert), lambda n, g, r: close(g, r, tol, f"grad of {n}")
    )


def build_lra(d: dict[str, Any]):
    """The authors' LRAModel as our ClassificationTask(encoder, SeqBoat, head)."""
    from megalab.tasks.classification import ClassificationTask

    encoder, head, args, cfg = golden.lra_encoder_and_head(d)
    backbone = SeqBoatConfig(**seqboat_kwargs_from_fairseq(args)).build()
    task = ClassificationTask(encoder, backbone, head, num_classes=args["sentence_class_num"],
                              pooling="mean")  # fmt: skip
    task = task.to(torch.float64 if d["dtype"] == "float64" else torch.float32)
    task.load_state_dict(convert_lra_model(prefixed(d, "state_dict.")), strict=True)
    return task.eval(), cfg


@pytest.mark.parametrize("flavour", list(FLAVOURS), ids=["float64", "fp32"])
@pytest.mark.parametrize("name", ENCODER_CASES)
def test_golden_lra_encoder(name: str, flavour: str) -> None:
    d = load_case(name + flavour)
    tol = FLAVOURS[flavour]
    task, cfg = build_lra(d)
    inputs = d["input"]
    text = cfg["args"]["input_type"] == "text"
    if text:
        mask = inputs != cfg["padding_idx"]
        assert torch.equal(mask.sum(1), d["src_lengths"])  # mean-pool divisor: real tokens
    else:
        mask = None
        inputs = inputs.clone().requires_grad_(True)

    layer_out: list[torch.Tensor] = []
    hooks = [
        blk.register_forward_hook(lambda m, i, o: layer_out.append(o[0]))
        for blk in task.backbone.layers
    ]
    try:
        x = task.encoder(inputs, mask)
        out, reports = task.backbone.forward_with_reports(x, mask, details=True)
    finally:
        for h in hooks:
            h.remove()
    logits = task.head(pool(out.y, mask, "mean"))
    close(logits, d["output"], tol, "logits")
    close(task(inputs, mask), d["output"], tol, "logits (task forward)")
    for i, report in enumerate(reports):
        check_routing(report.details, d, f"layer{i}.", tol)
        # The stack keeps the reference's junk at pads: compare every position.
        close(layer_out[i].transpose(0, 1), d[f"layer{i}.output"], tol, f"layer {i} output")

    (logits * d["grad_weight"]).sum().backward()
    if not text:
        close(inputs.grad, d["grad.input"], tol, "grad.input")
    check_parameter_grads(dict(task.named_parameters()), d, convert_lra_model, tol)
