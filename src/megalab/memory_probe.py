"""The probes of the memory plan (`megalab.memory`, step 1): one forward of a task on a
synthetic batch, measuring what autograd saves for the backward (training) or the peak bytes
of the live tensors (evaluation, without autograd)."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Probe", "probe", "synthetic_batch"]


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensors that operations return and that are still referenced.

    Exact for a forward without autograd (no tensor is then held outside Python): a storage is
    counted from the operation that creates it until the last Python tensor on it is freed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.total = 0
        self.peak = 0

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.total -= nbytes

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if not isinstance(t, Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if key not in self.refs:
                self.refs[key] = 0
                self.total += nbytes
                self.peak = max(self.peak, self.total)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key, nbytes)
        return out


@dataclass
class Probe:
    """One forward of `examples` examples: bytes kept for the backward (training) or the peak
    bytes of live tensors (evaluation, without autograd)."""

    examples: int
    saved: int
    peak: int


def synthetic_batch(
    task: nn.Module, data: Any, examples: int, device: torch.device, length: int | None = None
) -> dict:
    """A batch of `examples` examples of `length` tokens (default: the data's longest length),
    in the task's format."""
    from megalab.tasks.classification import RetrievalTask
    from megalab.tasks.language_modeling import LanguageModelingTask

    L = int(length or data.max_len)
    g = torch.Generator().manual_seed(0)

    def inputs() -> Tensor:
        if data.get("d_input"):
            return torch.randn(examples, L, int(data.d_input), generator=g).to(device)
        return torch.randint(0, int(data.vocab_size), (examples, L), generator=g).to(device)

    mask = torch.ones(examples, L, dtype=torch.bool, device=device)
    batch: dict[str, Any] = {"inputs": inputs(), "mask": mask}
    if isinstance(task, LanguageModelingTask):
        batch["targets"] = torch.randint(0, int(data.vocab_size), (examples, L), generator=g)
        batch["targets"] = batch["targets"].to(device)
        batch["reset"] = True  # a new stream: no state carried from a previous probe
    else:
        batch["targets"] = torch.randint(0, int(data.num_classes), (examples,), generator=g)
        batch["targets"] = batch["targets"].to(device)
    if isinstance(task, RetrievalTask):
        batch["inputs2"], batch["mask2"] = inputs(), mask.clone()
    return batch


def _loss(task: nn.Module, batch: dict) -> Tensor:
    step = getattr(task, "_step", None)
    if step is not None:
        return step(batch, "train")
    encode: Any = getattr(task, "encode")  # noqa: B009 (a task's method; nn.Module's stubs type it as a Tensor)
    return encode(batch["inputs"], batch.get("mask")).y.float().pow(2).mean()


def probe(
    task: nn.Module,
    data: Any,
    examples: int,
    train: bool,
    device: torch.device,
    length: int | None = None,
) -> Probe:
    """Run one forward of the task on a synthetic batch and measure it (see module docs):
    with autograd in training mode (what is saved), or without it in eval mode (peak bytes)."""
    batch = synthetic_batch(task, data, examples, device, length)
    params = {p.untyped_storage().data_ptr() for p in task.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in task.buffers()}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        # A detached alias: it keeps the storage alive as autograd would (no address is reused
        # while the graph lives), but not `t` itself. Returning `t` makes a reference cycle
        # through C++ (t -> its grad_fn -> the saved t) that Python's collector cannot see:
        # the whole graph, with the model copy's parameters, stayed alive after every probe.
        return t.detach()

    task.train(train)
    live = _LiveBytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `self.log` without a trainer
        if train:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                _loss(task, batch)
        else:
            with torch.no_grad(), live:
                _loss(task, batch)
    return Probe(examples, sum(saved.values()), live.peak)
