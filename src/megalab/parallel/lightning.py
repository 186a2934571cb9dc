"""Chunk parallelism as a Lightning strategy: `trainer=chunk_parallel` (GPUs) or
`trainer=chunk_parallel_cpu` (2 CPU processes, gloo).

`ChunkParallelStrategy` is Lightning's DDP with a second axis: the world's processes form
groups of `chunk_parallel_size` consecutive ranks (global rank = dp_rank · cp + cp_rank). The
ranks of a group read the same rows of data (the DataModule shards by data-parallel rank,
`data_parallel_rank_and_size`), each takes its contiguous slice of every sequence
(`megalab.parallel.chunk`), and the backbone exchanges its carried state with the neighbours.
Each rank's loss is its slice's summed NLL over the group's token count, times cp: DDP's mean of
the gradients over all dp · cp processes is then exactly the data-parallel mean of the
whole-sequence gradients. Language modelling on training batches that each start from a fresh
state (`data.sampler=random`, or `task.carry_state=false`), as the authors train; with
`task.carry_state=true` the evaluation streams carry their state and run whole on every rank
(`use_chunk_parallel`).
"""

from __future__ import annotations

import logging
from typing import Any, cast

from lightning.pytorch.strategies import DDPStrategy

from megalab.models.base import Backbone
from megalab.nn.adaptive import BandedParameters
from megalab.parallel.chunk import ChunkParallel, new_chunk_parallel
from megalab.tasks.language_modeling import LanguageModelingTask

log = logging.getLogger(__name__)


def find_unused_data_dependent_parameters(strategy: Any, task: Any) -> None:
    """Turn DDP's unused-parameter search on for a model with data-dependent parameters.

    A band of an adaptive input or softmax that has no token in a rank's batch (or, chunk
    parallel, in its slice of the sequence) leaves its parameters out of that rank's graph; DDP
    then stops with "parameters that were not used" unless it looks for them (the other ranks'
    gradients are averaged with this rank's zero: still the whole batch's gradient). Any module
    of the task may say so: a backbone declares it (`Backbone.data_dependent_parameters`), the
    adaptive encoders and heads are `BandedParameters`. Models without such parameters keep the
    faster setting.
    """
    if not isinstance(strategy, DDPStrategy) or strategy._ddp_kwargs.get("find_unused_parameters"):
        return
    if any(
        isinstance(m, Backbone | BandedParameters) and m.data_dependent_parameters
        for m in task.modules()
    ):
        log.info(
            "%s uses some parameters only for some tokens (adaptive input/softmax bands): DDP "
            "looks for unused parameters",
            type(task).__name__,
        )
        strategy._ddp_kwargs["find_unused_parameters"] = True


class ChunkParallelStrategy(DDPStrategy):
    """DDP over groups of `chunk_parallel_size` ranks that split every sequence along time."""

    strategy_name = "chunk_parallel"

    def __init__(self, chunk_parallel_size: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if chunk_parallel_size < 1:
            raise ValueError(f"chunk_parallel_size must be >= 1, got {chunk_parallel_size}")
        self.chunk_parallel_size = chunk_parallel_size
        self.chunk: ChunkParallel | None = None

    @property
    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """(rank, size) of the data-parallel axis: what the DataModule shards rows by."""
        cp = self.chunk_parallel_size
        return self.global_rank // cp, max(1, self.world_size // cp)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        self.chunk = new_chunk_parallel(self.chunk_parallel_size, self._process_group_backend)

    def check(self, task: Any, datamodule: Any = None) -> None:
        """Raise if `task` cannot train chunk-parallel (megalab.cli.train calls it before any
        process starts): a language model whose training batches start from a fresh state."""
        if not isinstance(task, LanguageModelingTask):
            raise TypeError(
                f"chunk parallelism splits the sequences of a language model; "
                f"{type(task).__name__} is not one (use task=language_modeling, or "
                "trainer=ddp / model_parallel for this task)"
            )
        backbone = task.backbone
        if backbone.carried_modules() is None:
            raise TypeError(
                f"{type(backbone).__name__} cannot run chunk-parallel: it has no "
                "carried_modules() (the sub-modules that carry state along time; Mega, "
                "Megalodon and Llama have them); use trainer=ddp for it"
            )
        task.check_chunk_parallel(datamodule)
        find_unused_data_dependent_parameters(self, task)

    def setup(self, trainer: Any) -> None:
        task = self.lightning_module
        self.check(task, getattr(trainer, "datamodule", None))
        assert self.chunk is not None
        cast(LanguageModelingTask, task).use_chunk_parallel(self.chunk)  # `check` made sure
        super().setup(trainer)
