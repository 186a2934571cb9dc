"""Fused GPU kernels written in Triton, each beside the PyTorch code it replaces.

The PyTorch code stays the reference and the CPU path: a kernel runs only where it is chosen,

- automatically, when Triton is importable, every tensor it touches is on CUDA and the kernel is
  switched on (all are by default);
- on the CPU, only inside `forced(...)` and under Triton's interpreter (`TRITON_INTERPRET=1`, set
  before Triton is imported): that is how the test suite checks every kernel without a GPU.

Switches, for a run or a test: `MEGALAB_KERNELS=0` turns every kernel off, `MEGALAB_KERNELS=
timestep_norm,ema` turns on only those, `MEGALAB_KERNELS=-attention` all but those; in Python,
`with megalab.kernels.disabled("attention"): ...`. An unknown name is refused with the list.

Parameters of `@triton.jit` functions are annotated `tl.constexpr` or `tl.tensor`, nothing else:
Triton reads these annotations (`int` or `float` would fix an argument's type, torch's `Tensor`
fails to compile), and `tl.tensor` leaves the compiled kernels as they were unannotated
(tests/kernels/test_annotations.py).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

__all__ = [
    "KERNELS",
    "LAUNCH_OPTIONS",
    "disabled",
    "enabled",
    "forced",
    "interpreting",
    "triton_available",
    "use_kernel",
]

#: Every fused kernel megalab has, by the name its switch takes.
KERNELS: tuple[str, ...] = ("timestep_norm", "ema", "attention", "qk_norm")

#: Compile options every kernel launch passes (`kernel[grid](..., **LAUNCH_OPTIONS)`). Floating-
#: point fusion (FMA contraction) is pinned on: it was Triton's default up to 3.9, the kernels were
#: checked and measured with it, and Triton 3.10 turns the default off (3.9 warns at every first
#: compile). Pinned, the compiled code does not change with the installed Triton's default.
LAUNCH_OPTIONS: dict[str, bool] = {"enable_fp_fusion": True}

_disabled: set[str] = set()
_forced: set[str] = set()


# Looked up once, at import: a plain constant is what `torch.compile` traces best.
_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """True when the `triton` package can be imported (the `gpu` extra installs it)."""
    return _TRITON


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check(names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernel name(s) {unknown}: megalab's kernels are {list(KERNELS)}")


def _env_switch() -> set[str]:
    """The kernels `MEGALAB_KERNELS` turns on (all when unset)."""
    raw = os.environ.get("MEGALAB_KERNELS", "").strip()
    if raw in ("", "1", "auto", "on"):
        return set(KERNELS)
    if raw in ("0", "off", "none"):
        return set()
    items = tuple(s.strip() for s in raw.split(",") if s.strip())
    _check(tuple(s.lstrip("-") for s in items))
    if all(s.startswith("-") for s in items):
        return set(KERNELS) - {s[1:] for s in items}
    if any(s.startswith("-") for s in items):
        raise ValueError(
            f"MEGALAB_KERNELS={raw!r} mixes names to keep and names to drop: give either "
            "'a,b' (only these) or '-a,-b' (all but these)"
        )
    return set(items)


def enabled(name: str) -> bool:
    """Whether kernel `name` is switched on (environment and `disabled` together)."""
    _check((name,))
    return name in _env_switch() and name not in _disabled


def use_kernel(name: str, *tensors: torch.Tensor) -> bool:
    """Whether to run kernel `name` on `tensors` instead of its PyTorch reference."""
    if not enabled(name) or not triton_available():
        return False
    if name in _forced and interpreting():
        return True
    return bool(tensors) and all(t.is_cuda for t in tensors)


@contextmanager
def _added(names: tuple[str, ...], switches: set[str]) -> Iterator[None]:
    """The named kernels (all when none is named) in `switches` for the block, as before after."""
    names = names or KERNELS
    _check(names)
    before = set(switches)
    switches.update(names)
    try:
        yield
    finally:
        switches.clear()
        switches.update(before)


def disabled(*names: str) -> AbstractContextManager[None]:
    """Run the PyTorch reference instead of the named kernels (all when none is named)."""
    return _added(names, _disabled)


def forced(*names: str) -> AbstractContextManager[None]:
    """Run the named kernels on CPU tensors too, under Triton's interpreter (tests only).

    Outside the interpreter this changes nothing: Triton cannot compile for the CPU.
    """
    return _added(names, _forced)
