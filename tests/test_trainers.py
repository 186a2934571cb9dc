"""Trainer configs: every one composes; multi-process strategies are built from config."""

from __future__ import annotations

import hydra
import pytest
import torch

from conftest import CONFIG_DIR
from megalab.cli.train import train

TRAINERS = sorted(p.stem for p in (CONFIG_DIR / "trainer").glob("*.yaml"))


@pytest.mark.parametrize("name", TRAINERS)
def test_trainer_config_composes(compose_cfg, name: str) -> None:
    cfg = compose_cfg(f"trainer={name}", fast=False)
    assert cfg.trainer._target_ == "lightning.pytorch.trainer.Trainer"
    if "strategy" in cfg.trainer:
        strategy = hydra.utils.instantiate(cfg.trainer.strategy)
        assert type(strategy).__name__ in (
            "DDPStrategy",
            "FSDPStrategy",
            "ChunkParallelStrategy",
            "BlockShardedStrategy",
        )


def test_fsdp_wraps_each_large_layer(compose_cfg) -> None:
    cfg = compose_cfg("trainer=fsdp", "model=mega", fast=False)
    policy = hydra.utils.instantiate(cfg.trainer.strategy.auto_wrap_policy)
    block = torch.nn.Linear(400, 400)
    assert policy(block, recurse=False, nonwrapped_numel=160_400)
    assert not policy(torch.nn.Linear(4, 4), recurse=False, nonwrapped_numel=20)


@pytest.mark.gpu
@pytest.mark.parametrize("trainer", ["gpu", "fsdp"])
def test_gpu_trainers_run_two_steps(compose_cfg, trainer: str) -> None:
    cfg = compose_cfg(
        f"trainer={trainer}",
        "trainer.devices=1",
        "trainer.max_steps=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "trainer.precision=bf16-mixed",
        "model=mega",
        "data.batch_size=4",
    )
    assert train(cfg)["global_step"] == 2


def test_fsdp_blocks_wraps_and_checkpoints_every_block(compose_cfg) -> None:
    from megalab.models.llama.model import LlamaBlock
    from megalab.models.mega.model import MegaBlock

    cfg = compose_cfg("trainer=fsdp_blocks", "model=llama_7b", fast=False)
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert {LlamaBlock, MegaBlock} <= hydra.utils.instantiate(cfg.trainer.strategy.auto_wrap_policy)
    assert strategy._activation_checkpointing_kwargs  # a policy is set
    assert cfg.trainer.precision == "bf16-mixed"


@pytest.mark.gpu
def test_fsdp_blocks_trains_a_llama_two_steps(compose_cfg) -> None:
    """One GPU: every LlamaBlock an FSDP unit with activation checkpointing."""
    cfg = compose_cfg(
        "trainer=fsdp_blocks", "trainer.devices=1", "trainer.max_steps=2",
        "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "model=llama",
        "model.backbone.num_layers=2", "data.batch_size=4",
    )  # fmt: skip
    assert train(cfg)["global_step"] == 2


@pytest.fixture
def process_group(tmp_path):
    """A one-process gloo group, as in one rank: FSDP wraps CPU modules inside one."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_clipping_by_norm_goes_through_the_fsdp_root(
    compose_cfg, process_group, strategy: str
) -> None:
    """Lightning's FSDP precision refuses clipping by norm, which the experiments set: under
    FSDP the task clips through the sharded root's `clip_grad_norm_` (its norm spans every
    rank's shards); elsewhere Lightning's own clipping runs. The root is a real FSDP module (one
    CPU rank, gloo); its gradients end with norm 0.25."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    task = hydra.utils.instantiate(compose_cfg("model=mega").task)
    root = FullyShardedDataParallel(  # one rank holds the one shard
        torch.nn.Linear(8, 8),
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy.NO_SHARD,
    )
    (100 * root(torch.ones(2, 8))).sum().backward()
    built = FSDPStrategy() if strategy == "fsdp" else DDPStrategy()
    built.model = root
    precision = SimpleNamespace(clip_gradients=lambda opt, val, alg: calls.append((val, alg)))
    calls: list[tuple] = []
    task._trainer = SimpleNamespace(  # type: ignore[assignment]
        strategy=built,
        precision_plugin=precision,
        gradient_clip_val=0.25,
        gradient_clip_algorithm="norm",
    )
    task.configure_gradient_clipping(torch.optim.SGD(task.parameters()), 0.25, "norm")
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in root.parameters()]))
    if strategy == "fsdp":
        assert not calls and float(norm) == pytest.approx(0.25, rel=1e-4)
    else:
        assert float(norm) > 1 and [(v, str(a.value)) for v, a in calls] == [(0.25, "norm")]
    task._trainer = None
