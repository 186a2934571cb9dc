"""Helpers for multi-process strategies."""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy


def size_wrap_policy(min_num_params: int = 100_000) -> Callable[..., bool]:
    """FSDP auto-wrap policy: every submodule with at least `min_num_params` parameters becomes
    its own shard unit (for the models here: each backbone layer)."""
    return functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
