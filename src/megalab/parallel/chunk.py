"""Chunk (sequence) parallelism: one sequence spread over the ranks of a group, along time.

Megalodon §3.5: the cp ranks of a chunk-parallel group each take a contiguous slice
[r·L/cp, (r+1)·L/cp) of every sequence. Rank r runs its slice from the state rank r − 1 ended
with, and sends the state it ends with to rank r + 1; in backward the gradient of that state
travels the other way. Nothing else crosses ranks, so 2 ranks compute exactly what 1 rank
computes on the whole sequence (tested on CPU with gloo), each holding the activations of its
slice only.

The state is exchanged per carried sub-module (per layer), at the moment the layer runs, so
the forward is a wavefront: rank r's layer l waits for rank r − 1's layer l only, as in the
authors' code. The hook a backbone implements is one method of `Backbone`,

    carried_modules() -> list[nn.Module] | None

the sub-modules that carry state along time, in order (None, the default: the model cannot run
chunk-parallel); each is called as `m(x, mask, state, ...)` (state third, or `state=`) and
returns `(y, new_state)`: Mega's and Llama's blocks, S4D's (causal) blocks, and for Megalodon
its blocks (CEMA state and timestep-norm statistics) plus the final timestep norm. Whatever the
state holds is exchanged: Mega's EMA state (and the keys and values of a chunk left open at a
slice boundary, so slices need not start on chunk boundaries); a full-attention model's
key/value prefix (exact, but it grows along the ranks: chunk parallelism pays off for chunked
attention, whose state is small).

Transport: `torch.distributed` point-to-point (`isend`/`recv`) on the group's own process
group; per layer a small header (the state's structure, shapes and dtypes, as JSON: no
pickling) and then its tensors. Autograd functions carry the gradients back: the sender adds a
zero scalar from its send op to the layer's output so that the op's backward runs (and receives
the gradient from the next rank) when the gradient reaches that layer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megalab.models.base import Backbone, BackboneOutput, BackboneProtocol
from megalab.nn.state import map_leaves, pack_state, unpack_state

_TENSOR = "\x00tensor:"
_DTYPES = {
    str(t): t
    for t in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
              torch.complex128, torch.int64, torch.int32, torch.bool, torch.uint8)
}  # fmt: skip

#: A forward pre-hook with keyword arguments: the new (args, kwargs), or None to keep them.
_PreHook = Callable[
    [nn.Module, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]] | None
]
#: A forward hook with keyword arguments on a carried module: its new (y, state), or None.
_PostHook = Callable[
    [nn.Module, tuple[Any, ...], dict[str, Any], tuple[Tensor, Any]], tuple[Tensor, Any] | None
]


# ------------------------------------------------------------------------- state <-> tensors
def flatten_state(state: Any) -> tuple[str, list[Tensor]]:
    """(JSON header, tensors) of a nested state; the header holds its structure (as `pack_state`
    writes it, tensors replaced by markers), shapes and dtypes."""
    tensors: list[Tensor] = []

    def mark(leaf: Any) -> Any:
        if isinstance(leaf, Tensor):
            tensors.append(leaf)
            return f"{_TENSOR}{len(tensors) - 1}"
        return leaf

    marked = map_leaves(state, mark)
    meta = [[list(t.shape), str(t.dtype)] for t in tensors]
    return json.dumps({"state": pack_state(marked), "tensors": meta}), tensors


def unflatten_state(header: str, tensors: list[Tensor]) -> Any:
    """The state of `flatten_state`'s header with `tensors` put back in place."""

    def fill(leaf: Any) -> Any:
        if isinstance(leaf, str) and leaf.startswith(_TENSOR):
            return tensors[int(leaf[len(_TENSOR) :])]
        return leaf

    return map_leaves(unpack_state(json.loads(header)["state"]), fill)


def _is_float(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


# ---------------------------------------------------------------------------- autograd ops
class _SendState(torch.autograd.Function):
    """Forward: send tensors to the next rank. Backward: receive their gradients from it."""

    @staticmethod
    def forward(ctx: Any, link: ChunkParallel, tag: int, *tensors: Tensor) -> Tensor:  # type: ignore[override]
        ctx.link, ctx.tag = link, tag
        ctx.meta = [(t.shape, t.dtype, t.device, _is_float(t)) for t in tensors]
        link._isend_tensors([t.detach() for t in tensors], link.next_rank, tag)
        return torch.zeros((), device=tensors[0].device if tensors else None)

    @staticmethod
    def backward(ctx: Any, _grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        floats = [(s, d, dev) for s, d, dev, f in ctx.meta if f]
        received = ctx.link._recv_tensors(floats, ctx.link.next_rank, ctx.tag + 1)
        it = iter(received)
        grads = [next(it) if f else None for _, _, _, f in ctx.meta]
        return (None, None, *grads)


class _RecvState(torch.autograd.Function):
    """Forward: receive tensors from the previous rank. Backward: send their gradients back."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, link: ChunkParallel, tag: int, meta: list, anchor: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.link, ctx.tag = link, tag
        tensors = link._recv_tensors(meta, link.prev_rank, tag)
        ctx.meta = [(t.shape, t.dtype, t.device, _is_float(t)) for t in tensors]
        ctx.mark_non_differentiable(*[t for t in tensors if not _is_float(t)])
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, None, None, None]:  # type: ignore[override]
        out = []
        for g, (shape, dtype, device, is_float) in zip(grads, ctx.meta):
            if is_float:
                out.append(torch.zeros(shape, dtype=dtype, device=device) if g is None else g)
        ctx.link._isend_tensors([g.contiguous() for g in out], ctx.link.prev_rank, ctx.tag + 1)
        return None, None, None, None


# ---------------------------------------------------------------------------- the exchange
class ChunkParallel:
    """The state exchange of one rank in a chunk-parallel group.

    Args:
        ranks: the global ranks of the group, in time order (rank i takes slice i).
        group: the process group used for the exchange (None: the default group).
    """

    def __init__(self, ranks: list[int], group: Any = None) -> None:
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not in its chunk-parallel group {ranks}")
        self.ranks, self.group = list(ranks), group
        self.index = ranks.index(me)
        self.size = len(ranks)
        self.prev_rank = ranks[self.index - 1] if self.index > 0 else None
        self.next_rank = ranks[self.index + 1] if self.index < self.size - 1 else None
        self._pending: list[tuple[Any, list[Tensor]]] = []
        self._anchor: Tensor | None = None
        self.active = True  # False: the hooks stand aside (see `paused`)

    # -- slices ---------------------------------------------------------------------------------
    def bounds(self, length: int) -> tuple[int, int]:
        """This rank's slice [a, b) of a sequence of `length` positions."""
        if length % self.size:
            raise ValueError(
                f"a sequence of {length} positions cannot be split evenly over "
                f"{self.size} chunk-parallel ranks: use a length divisible by {self.size}"
            )
        step = length // self.size
        return self.index * step, (self.index + 1) * step

    def slice(self, t: Tensor, dim: int = 1) -> Tensor:
        a, b = self.bounds(t.shape[dim])
        return t.narrow(dim, a, b - a)

    # -- transport ------------------------------------------------------------------------------
    def _isend_tensors(self, tensors: list[Tensor], dst: int | None, tag: int) -> None:
        for i, t in enumerate(tensors):
            t = t.contiguous()
            work = dist.isend(t, dst, group=self.group, tag=tag * 64 + i)
            self._pending.append((work, [t]))

    def _recv_tensors(self, meta: list, src: int | None, tag: int) -> list[Tensor]:
        out = []
        for i, (shape, dtype, device, *_rest) in enumerate(meta):
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, src, group=self.group, tag=tag * 64 + i)
            out.append(t)
        return out

    def _send_header(self, header: str, tag: int, device: torch.device) -> None:
        # On the state's device: NCCL moves CUDA tensors only.
        data = torch.tensor(list(header.encode()), dtype=torch.uint8, device=device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        self._isend_tensors([size, data], self.next_rank, tag)

    def _recv_header(self, tag: int, device: torch.device) -> str:
        n = torch.empty(1, dtype=torch.int64, device=device)
        dist.recv(n, self.prev_rank, group=self.group, tag=tag * 64)
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
        dist.recv(data, self.prev_rank, group=self.group, tag=tag * 64 + 1)
        return bytes(data.cpu().tolist()).decode()

    def wait(self) -> None:
        """Complete the sends still in flight (called before each forward and after backward)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    # -- exchange at one carried module ---------------------------------------------------------
    def receive_state(self, layer: int, like: Tensor) -> Any:
        """The state rank − 1 ended layer `layer` with (autograd-linked to its sender)."""
        tag = 4 * layer
        header = self._recv_header(tag, like.device)
        meta = [
            (torch.Size(shape), _DTYPES[dtype], like.device)
            for shape, dtype in json.loads(header)["tensors"]
        ]
        if torch.is_grad_enabled():
            if self._anchor is None:
                self._anchor = torch.zeros((), requires_grad=True)
            tensors = list(_RecvState.apply(self, tag + 2, meta, self._anchor))
        else:
            tensors = self._recv_tensors(meta, self.prev_rank, tag + 2)
        return unflatten_state(header, tensors)

    def send_state(self, layer: int, state: Any, y: Tensor) -> Tensor:
        """Send layer `layer`'s final state to rank + 1; returns y (linked to the send op)."""
        tag = 4 * layer
        header, tensors = flatten_state(state)
        self._send_header(header, tag, y.device)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            token = _SendState.apply(self, tag + 2, *tensors)
            return y + token.to(y.dtype)
        self._isend_tensors([t.detach() for t in tensors], self.next_rank, tag + 2)
        return y

    # -- hooks on a backbone --------------------------------------------------------------------
    @contextmanager
    def paused(self) -> Iterator[None]:
        """Inside the block the installed hooks do nothing: every rank runs the whole sequence
        on its own (evaluation that carries state from segment to segment)."""
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    @contextmanager
    def attach(self, backbone: Backbone) -> Iterator[None]:
        """Run `backbone` chunk-parallel inside the block (see `install`)."""
        handles = self.install(backbone)
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def install(self, backbone: Backbone) -> list[Any]:
        """Hooks that make every forward of `backbone` exchange state with the neighbours:
        a stateless call (state=None) runs from the initial state and returns no state; each
        carried module receives its incoming state from rank − 1 and sends its final state to
        rank + 1. Returns the hook handles."""
        carried = backbone.carried_modules()
        if carried is None:
            raise TypeError(
                f"{type(backbone).__name__} cannot run chunk-parallel: it has no "
                "carried_modules() (the sub-modules that carry state along time)"
            )
        modules = list(carried)
        link = self
        stateless: list[bool] = []

        def backbone_pre(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            if not link.active:
                return None
            link.wait()
            new_args, kwargs = list(args), dict(kwargs)
            x = new_args[0] if new_args else kwargs["x"]
            state = new_args[2] if len(new_args) > 2 else kwargs.get("state")
            stateless.append(state is None)
            if state is None:
                state = cast(BackboneProtocol, module).initial_state(x.shape[0], x)
                if len(new_args) > 2:
                    new_args[2] = state
                else:
                    kwargs["state"] = state
            return tuple(new_args), kwargs

        def backbone_post(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: BackboneOutput
        ) -> BackboneOutput | None:
            if not link.active:
                return None
            if stateless.pop():
                return BackboneOutput(out.y, None, out.aux)
            return out

        def layer_pre(index: int) -> _PreHook:
            def hook(
                module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
                if link.prev_rank is None or not link.active:
                    return None
                new_args, kwargs = list(args), dict(kwargs)
                x = new_args[0] if new_args else kwargs["x"]
                state = link.receive_state(index, x)
                if len(new_args) > 2:
                    new_args[2] = state
                else:
                    kwargs["state"] = state
                return tuple(new_args), kwargs

            return hook

        def layer_post(index: int) -> _PostHook:
            def hook(
                module: nn.Module,
                args: tuple[Any, ...],
                kwargs: dict[str, Any],
                out: tuple[Tensor, Any],
            ) -> tuple[Tensor, Any] | None:
                if link.next_rank is None or not link.active:
                    return None
                y, state = out
                return link.send_state(index, state, y), state

            return hook

        handles = [
            backbone.register_forward_pre_hook(backbone_pre, with_kwargs=True),
            backbone.register_forward_hook(backbone_post, with_kwargs=True),
        ]
        for i, m in enumerate(modules):
            handles.append(m.register_forward_pre_hook(layer_pre(i), with_kwargs=True))
            handles.append(m.register_forward_hook(layer_post(i), with_kwargs=True))
        return handles


def new_chunk_parallel(size: int, backend: str | None = None) -> ChunkParallel:
    """Build every chunk-parallel group of an initialised world (call on all ranks, same
    order): groups of `size` consecutive ranks, global rank = dp_rank · size + cp_rank (the
    authors' layout without tensor parallelism); returns this rank's exchange."""
    world, me = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(
            f"chunk_parallel_size={size} must divide the number of processes ({world})"
        )
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks, backend=backend)
        if me in ranks:
            mine = ChunkParallel(ranks, group)
    assert mine is not None
    return mine
