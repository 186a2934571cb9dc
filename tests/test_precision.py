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
from megalab.train import train

MODELS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
FP32_OPS = ("_fft_r2c", "_fft_c2r", "_fft_c2c", "native_layer_norm", "rsqrt", "native_batch_norm")
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
    causal = bool(compose_cfg(*base).model.backbone.get("causal", False))
    return [*base, *(LM if causal else [])]


@pytest.mark.parametrize("model", MODELS)
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
