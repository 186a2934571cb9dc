"""What every converter shares: safe loading of the authors' checkpoints, layouts, name helpers.

Mega's, SeqBoat's and Megalodon's layer converters write where the authors' entries go as
tables (exact names and prefixes) read by `rename_entries`; a module made of sub-modules
converts with `convert_module`, stacks with `convert_layers`, and the fairseq `LRAModel` of
Mega and SeqBoat fills in `convert_lra_task` with its layer conversion.

The authors' code is time-first (L, B, D) with padding masks True at padding; megalab is
batch-first with masks True at real tokens: `to_batch_first` and `mask_from_padding_mask` convert
at that boundary (converters and golden tests only).
"""

from __future__ import annotations

import argparse
import pickle
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import torch
from torch import Tensor

LayerConverter: TypeAlias = Callable[[Mapping[str, Tensor], str], dict[str, Tensor]]
"""Converts the layer (or module) under a prefix of the authors' state dict: (sd, prefix) ->
ours."""


def _sub(sd: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """Entries of `sd` under `prefix`, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}


def _unknown(kind: str, name: str) -> KeyError:
    return KeyError(f"unexpected {kind} entry {name!r}: not a parameter of the authors' {kind}")


# -- renaming by table ------------------------------------------------------------------------
# A converter lists where each of the authors' entries goes, by exact name and by prefix, and
# `rename_entries` applies the tables: an entry named in neither raises, so no weight is lost.
EntryRule: TypeAlias = Callable[[str, Tensor], dict[str, Tensor]]
"""An entry that a table converts itself: (the authors' name, tensor) -> our entries (maybe
none); it may check the tensor or raise."""
Target: TypeAlias = str | EntryRule | None
"""Where a table sends an entry: our name (for a prefix, what replaces it), a rule, or None
(dropped: no information, or converted elsewhere)."""


def reshaped(name: str, *shape: int) -> EntryRule:
    """A table target: our `name`, the tensor reshaped to `shape`."""
    return lambda _, t: {name: t.reshape(shape)}


def checked(check: Callable[[Tensor], None]) -> EntryRule:
    """A table target for a buffer megalab recomputes: `check` it, keep nothing."""

    def rule(name: str, t: Tensor) -> dict[str, Tensor]:
        check(t)
        return {}

    return rule


def refused(why: str) -> EntryRule:
    """A table target for weights megalab has no place for: a KeyError naming the entry."""

    def rule(name: str, t: Tensor) -> dict[str, Tensor]:
        raise KeyError(f"{name!r}: {why}")

    return rule


def kept(*prefixes: str) -> dict[str, Target]:
    """A prefix table that keeps the names under each of `prefixes` as they are."""
    return {p: p for p in prefixes}


def _map_entry(
    name: str, t: Tensor, names: Mapping[str, Target], prefixes: Mapping[str, Target]
) -> dict[str, Tensor] | None:
    """Our entries for one of the authors' entries, or None when the tables do not know it.

    An exact name comes first, then the longest prefix that `name` starts with."""
    if name in names:
        target = names[name]
    else:
        matches = [p for p in prefixes if name.startswith(p)]
        if not matches:
            return None
        prefix = max(matches, key=len)
        target = prefixes[prefix]
        if isinstance(target, str):
            target += name[len(prefix) :]
    if target is None:
        return {}
    if isinstance(target, str):
        return {target: t}
    return target(name, t)


def rename_entries(
    sd: Mapping[str, Tensor],
    kind: str,
    names: Mapping[str, Target],
    prefixes: Mapping[str, Target] | None = None,
) -> dict[str, Tensor]:
    """Every entry of `sd` through the tables `names` (exact) and `prefixes` (see `Target`), in
    order; an entry in neither is a KeyError naming the authors' module `kind`."""
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        entries = _map_entry(name, t, names, prefixes or {})
        if entries is None:
            raise _unknown(kind, name)
        out.update(entries)
    return out


def convert_module(
    sd: Mapping[str, Tensor],
    prefix: str,
    kind: str,
    children: Mapping[str, tuple[str, LayerConverter]] | None = None,
    names: Mapping[str, Target] | None = None,
    prefixes: Mapping[str, Target] | None = None,
) -> dict[str, Tensor]:
    """The authors' module `kind` under `prefix` -> our state dict for its counterpart.

    `children` maps each sub-module's prefix in the authors' names to (our prefix, its
    converter), e.g. `{"move.": ("ema.", convert_ema)}`; the children's entries come first, then
    the module's own entries through the tables `names` and `prefixes` (see `rename_entries`).
    Any other entry is a KeyError naming `kind`, so no weight is lost.
    """
    sub = _sub(sd, prefix)
    out: dict[str, Tensor] = {}
    for theirs, (ours, convert) in (children or {}).items():
        out.update({ours + k: v for k, v in convert(sub, theirs).items()})
    own_prefixes: dict[str, Target] = {**(prefixes or {}), **dict.fromkeys(children or {})}
    out.update(rename_entries(sub, kind, names or {}, own_prefixes))
    return out


def layer_ids(sd: Mapping[str, Tensor], prefix: str) -> list[int]:
    """The indices i of the entries `{prefix}{i}.*`, in increasing order."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for k in sd if (m := pattern.match(k))})


def convert_layers(
    sd: Mapping[str, Tensor], prefix: str, convert_layer: LayerConverter, out_prefix: str
) -> dict[str, Tensor]:
    """Each layer `{prefix}{i}.*` of a stack, converted by `convert_layer(sd, f"{prefix}{i}.")`,
    as `{out_prefix}{i}.*`."""
    out: dict[str, Tensor] = {}
    for i in layer_ids(sd, prefix):
        layer = convert_layer(sd, f"{prefix}{i}.")
        out.update({f"{out_prefix}{i}.{k}": v for k, v in layer.items()})
    return out


# -- the authors' fairseq LRAModel (Mega's and SeqBoat's) -------------------------------------
LRA_ENCODER = "encoder.encoder."  # where an LRAModel keeps its encoder's entries


def _lra_io_tables(
    enc: str, encoder_prefix: str, head_prefix: str
) -> tuple[dict[str, Target], dict[str, Target]]:
    """The (names, prefixes) tables of an LRAModel's input embedding and one-layer classifier."""
    names: dict[str, Target] = {
        enc + "embed_tokens.embed.weight": encoder_prefix + "embedding.weight",
        enc + "embed_tokens.weight": reshaped(encoder_prefix + "proj.weight", -1, 1),
        enc + "embed_tokens.bias": encoder_prefix + "proj.bias",
        "sentence_projection_layer.weight": head_prefix + "fc2.weight",
    }
    return names, {"classifier.0.0.": head_prefix + "fc1."}


def lra_io_entry(
    name: str, t: Tensor, enc: str, encoder_prefix: str, head_prefix: str
) -> tuple[str, Tensor] | None:
    """Our name and tensor for an entry of the authors' LRA models' input embedding or
    one-layer classifier (Mega's and SeqBoat's `LRAModel` share them); None for other names.

    Tokens: `{enc}embed_tokens.embed.weight` -> `TokenEmbedding`; pixels/audio:
    `{enc}embed_tokens.weight` (D,) and `.bias` -> `FeatureEmbedding`'s (D, 1) `proj`; the
    head: `classifier.0.0.*` -> `fc1`, `sentence_projection_layer.weight` -> `fc2.weight`.
    """
    entries = _map_entry(name, t, *_lra_io_tables(enc, encoder_prefix, head_prefix))
    return None if entries is None else next(iter(entries.items()))


def convert_lra_task(
    sd: Mapping[str, Tensor],
    convert_layer: LayerConverter,
    encoder_prefix: str,
    backbone_prefix: str,
    head_prefix: str,
    names: Mapping[str, Target],
    prefixes: Mapping[str, Target],
) -> dict[str, Tensor]:
    """An authors' fairseq `LRAModel` -> `ClassificationTask` state dict; the model supplies its
    layer conversion and the tables of its other entries.

    Shared by Mega and SeqBoat: the layers `encoder.encoder.layers.{i}.*` go through
    `convert_layer(sd, prefix)` to `{backbone_prefix}layers.{i}.*`, the input embedding and the
    classifier as `_lra_io_tables` lays out (`lra_io_entry` gives the same mapping one entry at
    a time), the final norm `encoder.encoder.final_norm.norm.*` to
    `{backbone_prefix}final_norm.norm.*`; `names` and `prefixes` (full names, see
    `rename_entries`) add the model's own entries. Any other entry raises.
    """
    enc = LRA_ENCODER
    out = convert_layers(sd, enc + "layers.", convert_layer, backbone_prefix + "layers.")
    io_names, io_prefixes = _lra_io_tables(enc, encoder_prefix, head_prefix)
    common: dict[str, Target] = {
        enc + "layers.": None,  # converted above
        enc + "final_norm.norm.": backbone_prefix + "final_norm.norm.",
    }
    tables = {**io_names, **names}, {**common, **io_prefixes, **prefixes}
    out.update(rename_entries(sd, "LRAModel", *tables))
    return out


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
