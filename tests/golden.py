"""Golden data produced by the authors' implementations: where it is, and how to compare.

The golden directory is `$MEGALAB_GOLDEN_DIR`, else `../shared/golden` beside the checkout
(`<repo>/../shared/golden`); each model has a subfolder (`mega`, `seqboat`, `megalodon`, `lamemo`)
with a README describing its cases. Without the data a golden test skips, except under
`MEGALAB_REQUIRE_GOLDEN=1` (set by `.ci/run`), where it fails.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def golden_dir(model: str) -> Path | None:
    """The golden folder of `model`, or None when no candidate exists."""
    candidates = [
        os.environ.get("MEGALAB_GOLDEN_DIR"),
        REPO.parent / "shared" / "golden",
    ]
    for c in candidates:
        if c and (Path(c) / model).is_dir():
            return Path(c) / model
    return None


def load_case(model: str, name: str) -> dict[str, Any]:
    """One golden file as a dict (`torch.load(weights_only=True)`); skips or fails if absent."""
    folder = golden_dir(model)
    if folder is None:
        msg = (
            f"{model} golden data not found: set MEGALAB_GOLDEN_DIR or provide ../shared/golden "
            "next to the repository"
        )
        if os.environ.get("MEGALAB_REQUIRE_GOLDEN") == "1":  # CI: a skipped golden test fails
            pytest.fail(msg)
        pytest.skip(msg)
    path = folder / f"{name}.pt"
    assert path.is_file(), f"golden file missing: {path}"
    return torch.load(path, weights_only=True, map_location=_device)


# The device the golden tests run on (`on_device`); None: where the files were saved (the CPU).
_device: torch.device | None = None


@contextlib.contextmanager
def on_device(device: str | torch.device) -> Iterator[None]:
    """Run golden tests on `device`, unchanged: every case loads its tensors there, and what a
    test builds without naming a device (modules, masks) is built there too."""
    global _device
    previous = _device
    _device = torch.device(device)
    try:
        with torch.device(_device):
            yield
    finally:
        _device = previous


def as_float32(d: dict[str, Any]) -> dict[str, Any]:
    """A float64 case as a float32 one: its floating tensors rounded to float32, `dtype` set."""
    out = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
           for k, v in d.items()}  # fmt: skip
    out["dtype"] = "float32"
    return out


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """e = max|a − ref| / max|ref| (shapes must agree)."""
    assert a.shape == ref.shape, (a.shape, ref.shape)
    scale = ref.abs().max().clamp_min(1e-300)
    return ((a.to(ref.dtype) - ref).abs().max() / scale).item()


def prefixed(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Entries of `d` under `prefix`, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in d.items() if k.startswith(prefix)}


def parameter_grads(
    d: dict[str, Any], convert: Callable[[dict[str, Any]], dict[str, Any]], prefix: str = "grad."
) -> dict[str, Any]:
    """The reference's parameter gradients under `prefix` (the input's left out), in our names."""
    return convert({k: v for k, v in prefixed(d, prefix).items() if k != "input"})


def assert_grads_match(
    params: dict[str, torch.Tensor],
    ref: dict[str, Any],
    check: Callable[[str, torch.Tensor, Any], None],
) -> None:
    """Every parameter has a reference gradient and a gradient of its own, and
    `check(name, grad, reference)` holds for each (it asserts the model's tolerance)."""
    assert set(ref) == set(params), "every parameter must have a reference gradient"
    for name, p in params.items():
        assert p.grad is not None, name
        check(name, p.grad, ref[name])


def lra_encoder_and_head(d: dict[str, Any]) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    """(encoder, head, fairseq args, case config) of the authors' `LRAModel`, which Mega's and
    SeqBoat's share: a token or pixel embedding and a one-layer classifier on mean pooling."""
    import json

    from megalab.nn.embedding import FeatureEmbedding, TokenEmbedding
    from megalab.nn.heads import ClassificationHead

    cfg = json.loads(d["config"])
    args = cfg["args"]
    assert args["sen_rep_type"] == "mp" and args["classifier_layers"] == 1
    D = args["encoder_embed_dim"]
    encoder: Any
    if args["input_type"] == "text":
        encoder = TokenEmbedding(cfg["vocab_size"], D, pad_id=cfg["padding_idx"])
    else:
        encoder = FeatureEmbedding(1, D, init="mega")
    head = ClassificationHead(
        args["classifier_in_dim"], args["classifier_out_dim"], args["sentence_class_num"],
        dropout=args["dropout"], activation=args["classifier_activation_fn"],
    )  # fmt: skip
    return encoder, head, args, cfg
