"""Find, on the CPU, the tensors that would stay on the host in a GPU run and meet its tensors.

On a GPU, a tensor made by a factory without a device (`torch.zeros(n)`, `torch.arange(L)`,
`torch.tensor(values)`) is made on the CPU; where such a tensor, not a 0-dim scalar, meets a
CUDA tensor in an operation, the run fails with "Expected all tensors to be on the same
device". On the CPU nothing fails, since everything is on the CPU. `HostTensors` marks what a
GPU run would make on the host and reports where it meets the other tensors:

- a factory called without `device=` inside the watched region marks its result;
- an operation whose tensor arguments are all marked marks its results (host arithmetic);
- `.to(device)`, `.to(tensor)` and `.cuda()` unmark (the copy is on the device);
- `unmark(module)` unmarks a module's parameters, buffers and what `Module._apply` moves (as
  `.to(device)` does to a model: torchmetrics' states too), `unmark(batch)` a batch (as
  Lightning's transfer does); what a module holds outside those stays marked.

An operation that takes a marked tensor of one or more dimensions together with an unmarked
one is a meeting, recorded with the megalab source lines of the operation and of the factory.
Indexing with a host index and `copy_` between devices are allowed on CUDA and are not
meetings: they are copies from the host, as `.to(device)` of a marked tensor is. Each is
recorded in `copies`, since on CUDA a copy from host memory waits for the GPU's queue to drain.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

import megalab

# Factories whose result, without `device=`, is on the CPU (the *_like and new_* ones follow
# their argument).
FACTORIES = {
    torch.arange, torch.as_tensor, torch.empty, torch.eye, torch.from_numpy, torch.full,
    torch.linspace, torch.logspace, torch.ones, torch.rand, torch.randint, torch.randn,
    torch.randperm, torch.scalar_tensor, torch.tensor, torch.tril_indices, torch.triu_indices,
    torch.zeros,
}  # fmt: skip
# Operations that take a host tensor beside a CUDA one without failing.
ALLOWED = {"__getitem__", "__setitem__", "index_put_", "copy_"}
# Operations that read only the other tensor's shape: the result stays on the host.
SHAPE_OF = {"expand_as", "view_as", "reshape_as"}
MARK = "_host_tensor_made_at"


SOURCE = str(Path(megalab.__file__).parent)


def _source_line(roots: tuple[str, ...]) -> str | None:
    """The innermost line on the stack of a file under `roots` (None where there is none)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename != __file__ and frame.filename.startswith(roots):
            path = Path(frame.filename)
            root = next(Path(r) for r in roots if frame.filename.startswith(r))
            return f"{path.relative_to(root.parent).as_posix()}:{frame.lineno}: {frame.line}"
    return None


def _mark(t: torch.Tensor, where: str) -> None:
    t.__dict__[MARK] = where


def _marked(t: torch.Tensor) -> str | None:
    return t.__dict__.get(MARK)


def _unmark_one(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        x.__dict__.pop(MARK, None)
    return x


def unmark(obj: Any) -> None:
    """Unmark a module's tensors (what `.to(device)` moves) or every tensor in a batch."""
    if isinstance(obj, nn.Module):
        obj._apply(_unmark_one)
    else:
        tree_map(_unmark_one, obj)


class HostTensors(TorchFunctionMode):
    """The checking mode (module docstring). `watch=True` watches all that runs under it;
    `watch=False` only what runs in `region()` or in functions passed through `wrap`. Only
    factories and meetings in the files under `roots` (megalab's package) count."""

    def __init__(self, watch: bool = True, roots: tuple[str, ...] = (SOURCE,)) -> None:
        super().__init__()
        self.depth = int(watch)
        self.roots = roots
        # "where they met" -> "where the host tensor was made"
        self.meetings: dict[str, str] = {}
        # "where it was copied to the device" -> "where it was made": on CUDA a copy from host
        # memory waits for the GPU's queue to drain (a stream sync)
        self.copies: dict[str, str] = {}

    @contextmanager
    def region(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` run inside the watched region."""

        def watched(*args: Any, **kwargs: Any) -> Any:
            with self.region():
                return fn(*args, **kwargs)

        return watched

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth <= 0:
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        made = [w for w in map(_marked, tensors) if w is not None]
        if func in FACTORIES and kwargs.get("device") is None:
            if func is torch.as_tensor and tensors:  # a tensor passes as it is, with its mark
                where = made[0] if made else None
            else:
                where = _source_line(self.roots)
            if where is not None:
                for r in results:
                    _mark(r, where)
            return out
        name = getattr(func, "__name__", "")
        if name in SHAPE_OF and made and _marked(args[0]) is not None:
            for r in results:
                _mark(r, made[0])
            return out
        if name in ("to", "cuda", "type_as"):
            moved = name in ("cuda", "type_as") or kwargs.get("device") is not None
            moved |= any(isinstance(a, str | torch.device | torch.Tensor) for a in args[1:])
            if moved:
                if _marked(args[0]) is not None:
                    self._record(self.copies, name, str(_marked(args[0])))
                for r in results:
                    _unmark_one(r)
                return out
        if not made:
            return out
        if len(made) == len(tensors):
            for r in results:
                _mark(r, made[0])
            return out
        host = [t for t in tensors if _marked(t) is not None and t.dim() > 0]
        if host:
            found = self.copies if name in ALLOWED else self.meetings
            self._record(found, name, str(_marked(host[0])))
        for r in results:
            _unmark_one(r)
        return out

    def _record(self, found: dict[str, str], name: str, made: str) -> None:
        where = _source_line(self.roots)
        if where is not None:
            found.setdefault(f"{where} ({name})", made)

    def report(self, found: dict[str, str] | None = None) -> str:
        """The meetings (or `found`, e.g. the copies), each with where its host tensor was made."""
        found = self.meetings if found is None else found
        return "\n".join(f"{met}\n    made at {made}" for met, made in found.items())
