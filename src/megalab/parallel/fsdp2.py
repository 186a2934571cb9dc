"""FSDP2 (`torch.distributed.fsdp.fully_shard`) per backbone block, for Lightning's
`ModelParallelStrategy` (`trainer=model_parallel`, `model_parallel_cpu`).

Lightning's `ModelParallelStrategy` builds a device mesh (data parallel x tensor parallel) and
leaves the sharding to the module's `configure_model`; the tasks call `shard_blocks` there. Every
backbone block (the `block_class` each backbone declares, collected by
`megalab.models.block_classes`: LlamaBlock, MegaBlock, ...) becomes its own FSDP2
unit, optionally recomputed in the backward (activation checkpointing), then the whole task
(embedding, head, final norm) is the root unit. Parameters, gradients and optimizer
state are sharded over the mesh's data-parallel dimension as DTensors.

Unlike FSDP1 (`FullyShardedDataParallel`, Lightning's `FSDPStrategy`), FSDP2 runs on CPU
processes with gloo, which is how it is tested here (2 ranks equal 1 rank on the whole batch,
tests/test_fsdp2.py). Tensor parallelism (`tensor_parallel_size` > 1) needs a plan per model
(which projections split by columns or rows, attention heads per rank); megalab has none yet, so
`tensor_parallel_size` > 1 is refused when the strategy is built (and a mesh with such a
dimension when the model is sharded), with a message naming the layouts to use instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn


def shard_blocks(
    module: nn.Module,
    mesh: Any,
    activation_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    forward_methods: Sequence[str] = (),
) -> int:
    """`fully_shard` every backbone block of `module`, then `module` itself, over `mesh`'s
    data-parallel dimension; returns the number of block units. `param_dtype` /
    `reduce_dtype`: FSDP2's mixed precision (None: the parameters' dtype);
    `reshard_after_forward`: for the blocks (False keeps them gathered until the backward);
    `forward_methods`: methods of `module` that run its forward as `forward` does (gathering
    and releasing its own parameters around them)."""
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    from megalab.models import block_classes

    dp_mesh = _data_parallel_mesh(mesh)
    classes = tuple(block_classes())
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(module, check_fn=lambda m: isinstance(m, classes))
    units = _blocks(module, classes)
    if not units:
        raise ValueError(
            f"no backbone block in {type(module).__name__} to shard (block classes: "
            f"{', '.join(sorted(c.__name__ for c in classes))}); declare the backbone's "
            "`block_class` (megalab.models.base.Backbone) and export the backbone from "
            "megalab.models"
        )
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)  # fmt: skip
    # The root (embedding, head, final norm) stays gathered from its forward to the end of the
    # backward: the tasks apply the head after the backbone's forward returns.
    fully_shard(module, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
    for name in forward_methods:  # Lightning calls training_step, not forward
        if callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)
    return len(units)


def _blocks(module: nn.Module, classes: tuple[type, ...]) -> list[nn.Module]:
    """The blocks of `module`; a block inside a CheckpointWrapper is represented by the wrapper."""
    units, wrapped = [], set()
    for m in module.modules():
        inner = getattr(m, "_checkpoint_wrapped_module", None)
        if inner is not None and isinstance(inner, classes):
            units.append(m)
            wrapped.add(id(inner))
        elif isinstance(m, classes) and id(m) not in wrapped:
            units.append(m)
    return units


def _no_tensor_parallel(size: Any) -> None:
    """Refuse a tensor-parallel size > 1, saying what shards or splits the work instead."""
    if isinstance(size, int) and size > 1:
        raise ValueError(
            f"tensor_parallel_size={size}: megalab has no tensor-parallel plan for its models "
            "yet (which projections split by columns or rows, attention heads per rank). "
            "Use trainer.strategy.tensor_parallel_size=1: FSDP2 then shards parameters, "
            "gradients and optimizer state over all processes (trainer=model_parallel); or "
            "FSDP1 per block (trainer=fsdp_blocks, GPUs); or, for long sequences of a "
            "language model, chunk parallelism (trainer=chunk_parallel: each process takes a "
            "slice of every sequence). docs/cluster.md lists what each layout supports."
        )


def _data_parallel_mesh(mesh: Any) -> Any:
    names = tuple(mesh.mesh_dim_names or ())
    if "tensor_parallel" in names:
        _no_tensor_parallel(mesh["tensor_parallel"].size())
    return mesh["data_parallel"] if "data_parallel" in names else mesh


class BlockShardedStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy whose "auto" data-parallel size is every process the
    tensor-parallel size leaves (Lightning's own "auto" is the number of nodes)."""

    def setup_environment(self) -> None:
        tp = self._tensor_parallel_size
        if self._data_parallel_size == "auto" and isinstance(tp, int):
            self._data_parallel_size = self.num_nodes * self.num_processes // tp
        super().setup_environment()


def block_sharded_strategy(
    activation_checkpointing: bool = False,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    **kwargs: Any,
) -> Any:
    """`BlockShardedStrategy` (Lightning's `ModelParallelStrategy`; `**kwargs`: data_parallel_size,
    tensor_parallel_size, save_distributed_checkpoint, process_group_backend, timeout) carrying
    the options the task's `configure_model` hands to `shard_blocks` (dtypes by name:
    "bfloat16", "float32")."""
    _no_tensor_parallel(kwargs.get("tensor_parallel_size", 1))  # before any process starts
    strategy = BlockShardedStrategy(**kwargs)
    strategy.megalab_shard_options = {  # type: ignore[attr-defined]
        "activation_checkpointing": activation_checkpointing,
        "param_dtype": _dtype(param_dtype),
        "reduce_dtype": _dtype(reduce_dtype),
    }
    return strategy


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (e.g. bfloat16, float32)")
    return dtype
