"""Running a module in evaluation mode for a while, and giving it back as it was."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Concatenate, ParamSpec, TypeVar

from torch import nn

M = TypeVar("M", bound=nn.Module)
P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def evaluating(module: nn.Module) -> Iterator[nn.Module]:
    """`module` in evaluation mode (no dropout) inside the block; afterwards each sub-module's
    own `training` flag is restored, so a sampler or a scorer called from a training loop
    leaves training as it found it (a sub-module the caller had frozen in eval stays so)."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in flags:
            m.training = training


def in_evaluation_mode(fn: Callable[Concatenate[M, P], R]) -> Callable[Concatenate[M, P], R]:
    """Run `fn(module, ...)` with its first argument `evaluating`."""

    @functools.wraps(fn)
    def wrapper(module: M, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with evaluating(module):
            return fn(module, *args, **kwargs)

    return wrapper
