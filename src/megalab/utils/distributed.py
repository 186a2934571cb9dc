"""Helpers for multi-process strategies."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy


def size_wrap_policy(min_num_params: int = 100_000) -> Callable[..., bool]:
    """FSDP auto-wrap policy: every submodule with at least `min_num_params` parameters becomes
    its own shard unit (for the models here: each backbone layer)."""
    return functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)


def slurm_environment(auto_requeue: bool = True, requeue_signal: str = "SIGUSR1") -> Any:
    """Lightning's SLURM cluster environment, with the requeue signal given by name."""
    import signal

    from lightning.pytorch.plugins.environments import SLURMEnvironment

    sig = getattr(signal, requeue_signal, None)
    if not isinstance(sig, signal.Signals):
        raise ValueError(f"unknown signal {requeue_signal!r} (e.g. SIGUSR1)")
    return SLURMEnvironment(auto_requeue=auto_requeue, requeue_signal=sig)


def is_rank_zero() -> bool:
    """Whether this process is global rank zero (the only process, outside DDP and FSDP): the
    rank Lightning sets from the launcher's environment and again when the processes join."""
    from lightning.pytorch.utilities import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def gather_from_ranks(obj: Any) -> list[Any]:
    """`obj` from every process, in rank order (a one-element list without distributed training).

    Collective: every process must call it (checkpoint hooks run on all of them).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]
