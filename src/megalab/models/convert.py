"""What every converter shares: safe loading of the authors' checkpoints, layouts, name helpers.

The authors' code is time-first (L, B, D) with padding masks True at padding; megalab is
batch-first with masks True at real tokens: `to_batch_first` and `mask_from_padding_mask` convert
at that boundary (converters and golden tests only).
"""

from __future__ import annotations

import argparse
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor


def _sub(sd: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """Entries of `sd` under `prefix`, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}


def _unknown(kind: str, name: str) -> KeyError:
    return KeyError(f"unexpected {kind} entry {name!r}: not a parameter of the authors' {kind}")


def lra_io_entry(
    name: str, t: Tensor, enc: str, encoder_prefix: str, head_prefix: str
) -> tuple[str, Tensor] | None:
    """Our name and tensor for an entry of the authors' LRA models' input embedding or
    one-layer classifier (Mega's and SeqBoat's `LRAModel` share them); None for other names.

    Tokens: `{enc}embed_tokens.embed.weight` -> `TokenEmbedding`; pixels/audio:
    `{enc}embed_tokens.weight` (D,) and `.bias` -> `FeatureEmbedding`'s (D, 1) `proj`; the
    head: `classifier.0.0.*` -> `fc1`, `sentence_projection_layer.weight` -> `fc2.weight`.
    """
    if name == enc + "embed_tokens.embed.weight":
        return encoder_prefix + "embedding.weight", t
    if name == enc + "embed_tokens.weight":
        return encoder_prefix + "proj.weight", t.reshape(-1, 1)
    if name == enc + "embed_tokens.bias":
        return encoder_prefix + "proj.bias", t
    if name.startswith("classifier.0.0."):
        return head_prefix + "fc1." + name[len("classifier.0.0.") :], t
    if name == "sentence_projection_layer.weight":
        return head_prefix + "fc2.weight", t
    return None


def _checkpoint_safe_globals() -> list[Any]:
    """The non-tensor objects the authors' checkpoints pickle besides plain containers.

    fairseq stores its arguments as an argparse `Namespace`, and numpy scalars (a best loss)
    in its training state. Nothing else is allowed to be rebuilt.
    """
    allowed: list[Any] = [argparse.Namespace, np.dtype]
    # numpy 2's stubs no longer declare np.core (the numpy 1 name): hence the ignore.
    multiarray = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray  # type: ignore[attr-defined]
    allowed.append(multiarray.scalar)
    allowed += [type(np.dtype(t)) for t in ("float64", "float32", "int64", "int32", "bool")]
    return allowed


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """`torch.load` of an authors' checkpoint that rebuilds only tensors, containers, and the
    allow-listed argparse Namespace and numpy scalars (`weights_only=True`): a downloaded file
    cannot run code while it is read."""
    with torch.serialization.safe_globals(_checkpoint_safe_globals()):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"{path}: the checkpoint holds objects other than tensors, containers, an "
                f"argparse Namespace and numpy scalars, which megalab does not load ({err})"
            ) from None


def load_fairseq_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read an official fairseq checkpoint: `{"model": state_dict, "args": dict | None}`."""
    ckpt = load_checkpoint(path)
    if "model" not in ckpt:
        raise ValueError(f"{path}: not a fairseq checkpoint (no 'model' entry)")
    args = ckpt.get("args")
    if args is not None and not isinstance(args, Mapping):
        args = vars(args)
    return {"model": ckpt["model"], "args": args}


def to_batch_first(x: Tensor) -> Tensor:
    """(L, B, ...) time-first tensor -> (B, L, ...)."""
    return x.transpose(0, 1)


def mask_from_padding_mask(padding_mask: Tensor | None) -> Tensor | None:
    """The authors' padding mask (True at padding) -> ours (True at real tokens)."""
    return None if padding_mask is None else ~padding_mask.bool()
