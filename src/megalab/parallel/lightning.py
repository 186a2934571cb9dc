"""Chunk parallelism as a Lightning strategy: `trainer=chunk_parallel` (GPUs) or
`trainer=chunk_parallel_cpu` (2 CPU processes, gloo).

`ChunkParallelStrategy` is Lightning's DDP with a second axis: the world's processes form
groups of `chunk_parallel_size` consecutive ranks (global rank = dp_rank · cp + cp_rank). The
ranks of a group read the same rows of data (the DataModule shards by data-parallel rank,
`data_parallel_rank_and_size`), each takes its contiguous slice of every sequence
(`megalab.parallel.chunk`), and the backbone exchanges its carried state with the neighbours.
Each rank's loss is its slice's summed NLL over the group's token count, times cp: DDP's mean of
the gradients over all dp · cp processes is then exactly the data-parallel mean of the
whole-sequence gradients. Language modelling with stateless batches only (each batch starts
its streams afresh: `task.carry_state=false`), as the authors train.
"""

from __future__ import annotations

from typing import Any, cast

from lightning.pytorch.strategies import DDPStrategy

from megalab.parallel.chunk import ChunkParallel, new_chunk_parallel


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

    def setup(self, trainer: Any) -> None:
        task = self.lightning_module
        if not hasattr(task, "use_chunk_parallel"):
            raise TypeError(
                f"chunk parallelism splits the sequences of a language model; "
                f"{type(task).__name__} is not one (use task=language_modeling)"
            )
        assert self.chunk is not None
        cast(Any, task).use_chunk_parallel(self.chunk)  # checked with hasattr above
        super().setup(trainer)
