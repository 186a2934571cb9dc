"""Carried state: detach, move, select and save the state a causal backbone streams with.

A state is a nest of tensors in dataclasses, named tuples, lists, tuples and dicts (None, bool,
int, float and str leaves pass through). Tensors hold the batch in dim 0, so `select_state`
reorders or picks streams (beam search) without knowing the model.

Checkpoints store a state as plain containers and CPU tensors (`pack_state`), loadable with
`torch.load(weights_only=True)`. `unpack_state` rebuilds objects only from the classes
registered here with `register_state`: megalab's own state classes. A name found in a
checkpoint is looked up in that allow-list and never imported, so a crafted checkpoint cannot
make loading call anything else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from megalab.utils.errors import UserError
from megalab.utils.moved import current_module

T = TypeVar("T", bound=type)

# "module:qualname" -> class. Filled by `register_state` when a model module is imported.
STATE_CLASSES: dict[str, type] = {}


def state_class_name(cls: type) -> str:
    """The name a class is saved under: "module:qualname"."""
    return f"{cls.__module__}:{cls.__qualname__}"


def state_class(name: str) -> type | None:
    """The registered class saved under `name` ("module:qualname"), also under the module's
    name before it moved (`megalab.utils.moved`); None if there is none."""
    if name in STATE_CLASSES:
        return STATE_CLASSES[name]
    module, _, qualname = name.partition(":")
    return STATE_CLASSES.get(f"{current_module(module)}:{qualname}")


def register_state(cls: T) -> T:
    """Class decorator: allow `unpack_state` to rebuild `cls` (a dataclass or named tuple)."""
    if not (dataclasses.is_dataclass(cls) or _is_namedtuple_type(cls)):
        raise TypeError(f"{cls.__name__} must be a dataclass or a named tuple to be a state")
    STATE_CLASSES[state_class_name(cls)] = cls
    return cls


def _is_namedtuple_type(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


def _fields(obj: Any) -> list[str] | None:
    """Field names of a dataclass instance or named tuple, else None."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return list(obj._fields)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [f.name for f in dataclasses.fields(obj) if f.init]
    return None


def map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply `fn` to every leaf (tensor, str, number, None) of a nested state, keeping its
    structure and classes (dicts, lists, tuples, named tuples, dataclasses)."""
    if isinstance(obj, dict):
        return {k: map_leaves(v, fn) for k, v in obj.items()}
    names = _fields(obj)
    if names is not None:
        values = {n: map_leaves(getattr(obj, n), fn) for n in names}
        if isinstance(obj, tuple):
            return type(obj)(**values)
        return dataclasses.replace(obj, **values)
    if isinstance(obj, list | tuple):
        return type(obj)(map_leaves(v, fn) for v in obj)
    return fn(obj)


def map_state(state: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Apply `fn` to every tensor of a nested state, keeping its structure and classes."""
    return map_leaves(state, lambda leaf: fn(leaf) if isinstance(leaf, Tensor) else leaf)


def detach_state(state: Any) -> Any:
    """The state cut from the autograd graph (carried across optimizer steps: truncated BPTT)."""
    return map_state(state, lambda t: t.detach())


def state_to(state: Any, device: torch.device | str) -> Any:
    """The state with every tensor on `device`."""
    return map_state(state, lambda t: t.to(device))


def select_state(state: Any, index: Tensor) -> Any:
    """Streams `index` of a batched state (dim 0 of every tensor; 0-d tensors are kept)."""
    return map_state(state, lambda t: t.index_select(0, index.to(t.device)) if t.dim() else t)


def pack_state(state: Any) -> Any:
    """A nested state as plain containers and CPU tensors (loadable with `weights_only`)."""
    if state is None or isinstance(state, bool | int | float | str):
        return state
    if isinstance(state, Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {"kind": "dict", "items": [[k, pack_state(v)] for k, v in state.items()]}
    names = _fields(state)
    if names is not None:
        name = state_class_name(type(state))
        if name not in STATE_CLASSES:
            raise TypeError(
                f"cannot save a carried state of class {name}: decorate it with "
                "megalab.nn.state.register_state"
            )
        fields = {n: pack_state(getattr(state, n)) for n in names}
        return {"kind": "object", "class": name, "fields": fields}
    if isinstance(state, list | tuple):
        return {"kind": type(state).__name__, "items": [pack_state(v) for v in state]}
    raise TypeError(f"cannot save a carried state of type {type(state).__name__} in a checkpoint")


class UnsafeStateError(UserError, ValueError):
    """A saved state names a class outside megalab's allow-list of state classes."""


def unpack_state(packed: Any) -> Any:
    """Inverse of `pack_state`; objects only of classes registered with `register_state`."""
    if packed is None or isinstance(packed, bool | int | float | str | Tensor):
        return packed
    if not isinstance(packed, dict) or "kind" not in packed:
        raise ValueError(f"not a saved state: {type(packed).__name__}")
    kind = packed["kind"]
    if kind == "dict":
        return {k: unpack_state(v) for k, v in packed["items"]}
    if kind in ("list", "tuple"):
        items = [unpack_state(v) for v in packed["items"]]
        return items if kind == "list" else tuple(items)
    if kind != "object":
        raise ValueError(f"unknown kind {kind!r} in a saved state")
    name = packed.get("class")
    cls = state_class(name) if isinstance(name, str) else None
    if cls is None:
        raise UnsafeStateError(
            f"refusing to rebuild a saved state of class {name!r}: megalab rebuilds carried "
            f"state only from its own state classes ({', '.join(sorted(STATE_CLASSES))})"
        )
    fields = packed.get("fields")
    if not isinstance(fields, dict):
        raise ValueError(f"a saved {name} state has no fields")
    allowed = (
        set(cast(Any, cls)._fields)
        if _is_namedtuple_type(cls)
        else {f.name for f in dataclasses.fields(cls) if f.init}
    )
    unknown = set(fields) - allowed
    if unknown:
        raise ValueError(f"a saved {name} state has unknown fields {sorted(unknown)}")
    return cls(**{k: unpack_state(v) for k, v in fields.items()})
