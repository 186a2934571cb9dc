"""The golden cases of every model on CUDA: float32 at the golden READMEs' float32 tolerances,
and a bf16-autocast bound (finite outputs, relative error within 5e-2).

The float32 runs are the golden modules' own tests, run unchanged inside `golden.on_device`
(every case loaded on the device, every module built there): Megalodon's float32 tests (outputs
1e-5, gradients 5e-5 relative), SeqBoat's `_fp32` files (rtol = atol = 1e-4), LaMemo's float32
file (atol 2e-5, rtol 1e-5). Mega's and Transformer-XL's files are float64 only: their cases run
in float32 against the reference outputs at the READMEs' float32 tolerances (Mega: e ≤ 5e-5;
LaMemo's README, which covers the XL cases: atol 2e-5, rtol 1e-5). The float64 tests and their
tolerances stay in the golden modules. Each check runs on the CPU too (default suite): that
keeps the device plumbing and the float32 and bf16 paths tested where no GPU is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import test_lamemo_golden as lamemo
import test_mega_golden as mega
import test_megalodon_golden as megalodon
import test_seqboat_golden as seqboat
import torch

import golden
import xl_golden
from golden import prefixed, rel_err

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]
MEGA_FP32_TOL = 5e-5  # mega README §5: a float32 implementation against output / grad.*
# bf16 autocast (float32 weights): a sanity bound, not an exactness check, on the whole tensor's
# relative error ‖y − ref‖ / ‖ref‖. bf16 keeps 8 bits of mantissa (rounding 2^-9 ≈ 2e-3 per
# operation); on the CPU the cases stay within 2e-2. Not the max-entry measure: one SeqBoat gate
# near its decision margin flips under bf16 and moves a few entries by 8e-2 of the maximum.
BF16_TOL = 5e-2


# -- float32 ---------------------------------------------------------------------------------
def err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """`rel_err` in float64 (an all-zero reference gradient then gives 0, not 0/0)."""
    return rel_err(a.double(), ref.double())


def mega_module_fp32(name: str) -> None:
    """A Mega module case in float32 against the reference's float32-cast outputs and grads."""
    d = golden.as_float32(mega.load_case(name))
    module, convert = mega.build(d, torch.float32)
    x = mega.to_batch_first(d["input"]).clone().requires_grad_(True)
    y, _ = module(x, mega.mask_from_padding_mask(d.get("padding_mask")))
    y_tf = y.transpose(0, 1)
    assert err(y_tf, d["output"]) <= MEGA_FP32_TOL
    (y_tf * d["grad_weight"]).sum().backward()
    assert err(x.grad.transpose(0, 1), d["grad.input"]) <= MEGA_FP32_TOL
    ref = convert({k: v for k, v in prefixed(d, "grad.").items() if k != "input"})
    for pname, p in module.named_parameters():
        assert err(p.grad, ref[pname]) <= MEGA_FP32_TOL, pname


def mega_lra_fp32(name: str) -> None:
    d = golden.as_float32(mega.load_case(name))
    task, convert, cfg = mega.build_lra(d, torch.float32)
    inputs = d["input"]
    mask = inputs != cfg["padding_idx"] if cfg["args"]["input_type"] == "text" else None
    logits = task(inputs, mask)
    assert err(logits, d["output"]) <= MEGA_FP32_TOL
    (logits * d["grad_weight"]).sum().backward()
    ref = convert({k: v for k, v in prefixed(d, "grad.").items() if k != "input"})
    for pname, p in task.named_parameters():
        assert err(p.grad, ref[pname]) <= MEGA_FP32_TOL, pname


def xl_fp32(name: str) -> None:
    """A Transformer-XL float64 case in float32, at the float32 file's tolerance."""
    d = golden.as_float32(xl_golden.load(name))
    runs = xl_golden.run_case(d)
    for k, run in enumerate(runs):
        xl_golden.check_segment(d, k, run, lamemo=False)
    xl_golden.check_gradients(d, runs)


FP32 = torch.float32
FLOAT32: list[Any] = [
    *[pytest.param(megalodon.test_cema, {"dtype": FP32, "variant": v}, id=f"megalodon-cema-{v}")
      for v in ("no_hx", "with_hx")],
    pytest.param(megalodon.test_timestep_norm, {"dtype": FP32}, id="megalodon-timestep_norm"),
    pytest.param(megalodon.test_layer_forward_and_gradients, {"dtype": FP32},
                 id="megalodon-layer"),
    pytest.param(megalodon.test_layer_cache_path, {"dtype": FP32}, id="megalodon-layer_cache"),
    pytest.param(megalodon.test_model_logits_and_gradients, {"dtype": FP32},
                 id="megalodon-model"),
    *[pytest.param(megalodon.test_model_streaming, {"dtype": FP32, "pattern": p},
                   id=f"megalodon-streaming-{p}") for p in ("halves", "mixed")],
    *[pytest.param(seqboat.test_golden_unit, {"name": n, "flavour": "_fp32"}, id=f"seqboat-{n}")
      for n in seqboat.UNIT_CASES],
    *[pytest.param(seqboat.test_golden_lra_encoder, {"name": n, "flavour": "_fp32"},
                   id=f"seqboat-{n}") for n in seqboat.ENCODER_CASES],
    pytest.param(lamemo.test_golden_segments_and_gradients, {"name": "lamemo_3segments_fp32"},
                 id="lamemo-3segments_fp32"),
    *[pytest.param(mega_module_fp32, {"name": n}, id=f"mega-{n}") for n in mega.MODULE_CASES],
    *[pytest.param(mega_lra_fp32, {"name": n}, id=f"mega-{n}") for n in mega.LRA_CASES],
    *[pytest.param(xl_fp32, {"name": n}, id=f"xl-{n}") for n in ("txl_3segments",
                                                                  "txl_mem_eq_seg")],
]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("check", "kwargs"), FLOAT32)
def test_golden_float32(device: str, check: Callable[..., None], kwargs: dict) -> None:
    with golden.on_device(device):
        check(**kwargs)


# -- bf16 autocast ---------------------------------------------------------------------------
def norm_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a − ref‖ / ‖ref‖, in float64."""
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def _bf16_bound(device: str, forward: Callable[[], torch.Tensor], ref: torch.Tensor) -> None:
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        y = forward()
    assert torch.isfinite(y).all()
    assert norm_err(y, ref) <= BF16_TOL


def megalodon_bf16(device: str) -> None:
    d = megalodon.load_case("model_chunked_stream")
    task = megalodon._lm(d, torch.float32)
    _bf16_bound(device, lambda: megalodon._logits(task, d["input.tokens"])[0],
                d["output.logits"])  # fmt: skip


def mega_bf16(device: str) -> None:
    d = golden.as_float32(mega.load_case("lra_encoder"))
    task, _, cfg = mega.build_lra(d, torch.float32)
    mask = d["input"] != cfg["padding_idx"]
    _bf16_bound(device, lambda: task(d["input"], mask), d["output"])


def seqboat_bf16(device: str) -> None:
    d = seqboat.load_case("layer_causal_fp32")
    layer = seqboat.build_unit(d)
    x = seqboat.to_batch_first(d["input"])
    mask = seqboat.mask_from_padding_mask(d.get("padding_mask"))
    _bf16_bound(device, lambda: layer(x, mask)[0].transpose(0, 1), d["output"])


def xl_bf16(name: str) -> Callable[[str], None]:
    def check(device: str) -> None:
        d = golden.as_float32(xl_golden.load(name))
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            runs = xl_golden.run_case(d)
        for k, run in enumerate(runs):
            assert torch.isfinite(run.logits).all()
            assert norm_err(run.logits, d[f"seg{k}.logits"]) <= BF16_TOL

    return check


BF16 = [
    pytest.param(megalodon_bf16, id="megalodon"),
    pytest.param(mega_bf16, id="mega"),
    pytest.param(seqboat_bf16, id="seqboat"),
    pytest.param(xl_bf16("lamemo_3segments"), id="lamemo"),
    pytest.param(xl_bf16("txl_3segments"), id="transformer_xl"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check", BF16)
def test_golden_bf16_autocast_stays_close(device: str, check: Callable[[str], None]) -> None:
    with golden.on_device(device):
        check(device)
