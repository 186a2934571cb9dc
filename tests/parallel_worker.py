"""A chunk-parallel rank for tests/test_chunk_parallel.py (spawned processes import it)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from causal_models import VOCAB, build_lm
from megalab.parallel.chunk import new_chunk_parallel


def batch(length: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, length + 1), generator=torch.Generator().manual_seed(5))
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(task, inputs, targets, total: int) -> tuple[torch.Tensor, dict]:
    """Σ NLL / total tokens and the parameter gradients of one forward + backward."""
    task.zero_grad()
    logits = task.head.proj(task(inputs).y)  # float64 (the head's nll works in float32)
    loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum") / total
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in task.named_parameters()}


def run(rank: int, world: int, init_file: str, out_dir: str, cases: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        cp = new_chunk_parallel(world)
        for name, variant, length in cases:
            task = build_lm(name, variant).train()
            inputs, targets = batch(length)
            with cp.attach(task.backbone):
                loss, grads = loss_and_grads(
                    task, cp.slice(inputs), cp.slice(targets), targets.numel()
                )
            cp.wait()
            dist.all_reduce(loss, group=cp.group)  # the group's loss: Σ of the slices'
            for g in grads.values():
                dist.all_reduce(g, group=cp.group)
            if rank == 0:
                torch.save({"loss": loss, "grads": grads},
                           Path(out_dir) / f"{name}-{variant}-{length}.pt")  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()
