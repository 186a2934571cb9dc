"""`trainer.precision=bf16-mixed` for every model config: it trains, its matrix products run in
bf16, and the EMA's FFTs and the norms stay in float32.

Parametrized over `configs/model/*.yaml`, so a model added later is covered: an encoder trains
on ListOps (classification), a causal model on enwik8 (language modelling).
"""

from __future__ import annotations

import math

import hydra
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import CONFIG_DIR
from megalab.cli.train import train

MODELS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
# Size presets of a model config above (same classes and code path, only wider and deeper):
# they train at a small width, in the slow suite; their family runs in the default suite.
PRESETS = {"llama_100m": "llama", "llama_200m": "llama", "llama_1_3b": "llama", "llama_7b": "llama"}
SMALL = ["model.d_model=64", "model.backbone.num_layers=2", "model.backbone.num_heads=4"]
# LaMemo and the Transformer with XL's relative positions share Transformer-XL's relative-memory
# code, which trains under bf16 in the default suite; theirs run in the slow suite (time budget).
SLOW = {*PRESETS, "lamemo", "transformer_rpe"}
CASES = [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in MODELS]
FP32_OPS = ("_fft_r2c", "_fft_c2r", "_fft_c2c", "native_layer_norm", "rsqrt", "native_batch_norm")
# The two largest default configs (Megalodon: the authors' 1024-wide, 8-layer model; Transformer-XL:
# 16 layers of 512) train at a small width and depth here, with every other key as configured
# (the same classes and code path; 15 s and 12 s for their bf16 steps at full size on 2 cores).
NARROW = {
    "megalodon": ["model.d_model=64", "model.backbone.num_layers=2", "model.backbone.z_dim=32",
                  "model.backbone.v_dim=64", "model.backbone.ffn_dim=96",
                  "model.backbone.norm_groups=4"],
    "transformer_xl": ["model.d_model=64", "model.backbone.num_layers=2",
                       "model.backbone.num_heads=4", "model.backbone.head_dim=16",
                       "model.backbone.ffn_dim=128"],
}  # fmt: skip
LM = ["data=enwik8", "task=language_modeling", "data.max_len=64", "data.eval_max_len=64",
      "data.train_len_unit=10", "data.sha256=null", "data.valid_size=3000",
      "data.test_size=3000"]  # fmt: skip


class _Dtypes(TorchDispatchMode):
    """The input dtypes of every operation, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = func.overloadpacket.__name__
        for a in args:
            if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()):
                self.seen.setdefault(name, set()).add(a.dtype)
        return func(*args, **(kwargs or {}))


def _overrides(compose_cfg, model: str) -> list[str]:
    base = [f"model={model}", "trainer.precision=bf16-mixed", "data.batch_size=4"]
    base += SMALL if model in PRESETS else NARROW.get(model, [])
    model_cfg = compose_cfg(*base).model
    causal = bool(model_cfg.backbone.get("causal", False))
    # XL-style models pair their adaptive input with their own output layer (as their
    # experiments do): the task's head is the model's `lm_head`.
    head = ["task.head=${model.lm_head}"] if causal and "lm_head" in model_cfg else []
    return [*base, *(LM + head if causal else [])]


@pytest.mark.parametrize("model", CASES)
def test_bf16_mixed_trains_with_fp32_ffts_and_norms(compose_cfg, model: str) -> None:
    cfg = compose_cfg(*_overrides(compose_cfg, model))
    record = train(cfg)
    assert record["global_step"] == 2
    losses = [v for k, v in record["metrics"].items() if k.endswith("/loss")]
    assert losses and all(v is not None and math.isfinite(v) for v in losses), record["metrics"]

    task = hydra.utils.instantiate(cfg.task).train()
    x = torch.randint(0, int(cfg.data.vocab_size), (2, 48))
    mask = torch.ones(2, 48, dtype=torch.bool)
    mask[1, 40:] = False
    dtypes = _Dtypes()
    with torch.autocast("cpu", dtype=torch.bfloat16), dtypes:
        out = task.encode(x, mask).y
    out.float().sum().backward()
    seen = dtypes.seen
    assert torch.bfloat16 in seen.get("addmm", set()) | seen.get("mm", set()), seen.keys()
    for op in FP32_OPS:
        low = seen.get(op, set()) & {torch.bfloat16, torch.float16}
        assert not low, f"{op} ran in {low} under bf16 autocast"


# The sub-layers that compute in float32 under autocast (each casts its input and turns
# autocast off inside): the EMA family (its FFT convolution and recurrences) and the norms.
def _fp32_modules() -> tuple[type[torch.nn.Module], ...]:
    from megalab.models.megalodon.cema import ComplexEMA
    from megalab.models.megalodon.timestep_norm import SequenceGroupNorm, TimestepNorm
    from megalab.nn.ema import DampedEMA
    from megalab.nn.norms import PlusOneRMSNorm, RMSNorm, ScaleNorm, SequenceNorm
    from megalab.nn.s4d import S4D

    return (DampedEMA, ComplexEMA, S4D, TimestepNorm, SequenceGroupNorm, ScaleNorm, RMSNorm,
            PlusOneRMSNorm, SequenceNorm, torch.nn.LayerNorm)  # fmt: skip


# Arithmetic whose precision matters (a multiplication by a 0/1 padding mask before the cast,
# exact in any dtype, is left out); copies, casts and views are not arithmetic.
NUMERIC_OPS = {"_fft_r2c", "_fft_c2r", "_fft_c2c", "add", "sub", "div", "sum", "mean", "var",
               "var_mean", "rsqrt", "sqrt", "cumsum", "exp", "log", "pow", "mm", "bmm", "addmm",
               "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit"}  # fmt: skip


class _InsideDtypes(TorchDispatchMode):
    """Low-precision inputs of the arithmetic run inside the float32 sub-layers, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.low: dict[str, set[str]] = {}
        self.checked = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = func.overloadpacket.__name__
        if self.depth and name in NUMERIC_OPS:
            self.checked += 1
            for a in (*args, *(kwargs or {}).values()):
                if isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16):
                    self.low.setdefault(name, set()).add(self.where)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model", MODELS)
def test_ema_fft_and_norms_compute_in_fp32_under_bf16(compose_cfg, model: str) -> None:
    """Every operation of the EMA/CEMA/S4D sub-layers and of the norms runs in float32 (or
    complex64) under bf16 autocast, forward and backward, in every model config that has them."""
    cfg = compose_cfg(*_overrides(compose_cfg, model))
    task = hydra.utils.instantiate(cfg.task).train()
    mode = _InsideDtypes()
    mode.where = ""
    kinds = _fp32_modules()
    hooks = []
    for name, module in task.named_modules():
        if isinstance(module, kinds):

            def enter(mod, args, name=name):
                mode.depth += 1
                mode.where = f"{name} ({type(mod).__name__})"

            def leave(mod, args, out):
                mode.depth -= 1

            hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    assert hooks, f"model={model} has no EMA or norm sub-layer: nothing here would be checked"
    x = torch.randint(0, int(cfg.data.vocab_size), (2, 48))
    mask = torch.ones(2, 48, dtype=torch.bool)
    mask[1, 40:] = False
    with torch.autocast("cpu", dtype=torch.bfloat16), mode:
        out = task.encode(x, mask).y
    for h in hooks:
        h.remove()
    out.float().sum().backward()
    assert mode.checked > 0
    assert not mode.low, f"bf16 arithmetic inside float32 sub-layers: {mode.low}"
