"""Activation checkpointing of one block: keep its input, recompute its inside in the backward.

A backbone with `checkpoint_activations=True` calls each block through `checkpoint_block`, so the
autograd graph keeps only the blocks' inputs (one (B, L, D) tensor each) and every block runs its
forward twice: memory per layer drops from all the block's activations to one of its inputs, for
about a third more compute. Dropout masks are the same in both runs (the RNG state is replayed),
and BatchNorm's running statistics are updated once, by the first run: the recomputation restores
them, so a checkpointed model trains exactly like the plain one (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _running_stats(module: nn.Module) -> list[torch.Tensor]:
    return [
        t
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        for t in (m.running_mean, m.running_var, m.num_batches_tracked)
        if t is not None
    ]


def checkpoint_block(
    block: nn.Module | Callable[..., Any], *args: Any, enabled: bool = True, **kwargs: Any
) -> Any:
    """`block(*args, **kwargs)`, checkpointed when enabled, training and autograd is on."""
    module = block if isinstance(block, nn.Module) else None
    training = module.training if module is not None else True
    if not (enabled and training and torch.is_grad_enabled()):
        return block(*args, **kwargs)
    calls = [0]

    def run(*inner: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1 or module is None:
            return block(*inner, **kwargs)
        # The recomputation: BatchNorm normalises with the same batch statistics, but its
        # running averages were already updated by the first run.
        stats = [(t, t.clone()) for t in _running_stats(module)]
        try:  # also when the recomputation stops early (once it has what the backward needs)
            return block(*inner, **kwargs)
        finally:
            with torch.no_grad():
                for t, saved in stats:
                    t.copy_(saved)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
