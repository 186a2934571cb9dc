"""An FSDP2 rank for tests/test_fsdp2.py (spawned processes import it)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from causal_models import build_lm
from megalab.parallel.fsdp2 import shard_blocks
from parallel_worker import batch, loss_and_grads


def run(rank: int, world: int, init_file: str, out_dir: str, cases: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
        for name, variant, length, checkpointing in cases:
            task = build_lm(name, variant).train()
            units = shard_blocks(task, mesh, activation_checkpointing=checkpointing)
            inputs, targets = batch(length, rows=2 * world)
            rows = slice(rank * 2, rank * 2 + 2)  # this rank's half of the batch
            loss, grads = loss_and_grads(task, inputs[rows], targets[rows], targets[rows].numel())
            # FSDP2 reduce-scatters the mean of the ranks' gradients; gather the full tensors
            full = {n: g.full_tensor() if hasattr(g, "full_tensor") else g
                    for n, g in grads.items()}  # fmt: skip
            dist.all_reduce(loss)
            if rank == 0:
                torch.save({"loss": loss / world, "grads": full, "units": units},
                           Path(out_dir) / f"{name}-{variant}-{checkpointing}.pt")  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()
