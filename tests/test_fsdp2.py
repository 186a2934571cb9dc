"""FSDP2 per backbone block (`megalab.parallel.fsdp2`, `trainer=model_parallel`): on CPU with
gloo, 2 ranks each on half of the batch give the loss and gradients of 1 rank on the whole
batch, with and without activation checkpointing; the trainer configs build Lightning's
ModelParallelStrategy with the sharding options, and a tensor-parallel mesh is refused."""

from __future__ import annotations

from pathlib import Path

import hydra
import pytest
import torch
import torch.multiprocessing as mp

from causal_models import build_lm
from fsdp2_worker import run
from parallel_worker import batch, loss_and_grads

CASES = [
    ("llama", "causal_gqa_maxlen", 12, False),
    ("llama", "causal_gqa_maxlen", 12, True),
    ("mega", "causal_softmax_rotary", 16, True),
    # Megalodon: complex CEMA parameters, timestep norms, chunked attention with two heads.
    ("megalodon", "chunked_swiglu_two_heads", 16, False),
    ("megalodon", "chunked_swiglu_two_heads", 16, True),
    # SeqBoat (data-dependent packing inside each block), and the memory models' layers, which
    # take the root's position biases u, v as arguments.
    ("seqboat", "causal_softmax_rotary", 16, True),
    ("transformer_xl", "long_memory", 12, True),
    ("lamemo", "xl_rpe_no_interpolation_short_memory", 12, True),
]


def test_two_gloo_ranks_equal_one_rank_on_the_whole_batch(tmp_path: Path) -> None:
    mp.spawn(run, args=(2, str(tmp_path / "init"), str(tmp_path), CASES), nprocs=2, join=True)
    for name, variant, length, checkpointing in CASES:
        got = torch.load(tmp_path / f"{name}-{variant}-{checkpointing}.pt", weights_only=True)
        task = build_lm(name, variant).train()
        assert got["units"] == len(task.backbone.layers)  # one FSDP2 unit per block
        inputs, targets = batch(length, rows=4)
        loss, grads = loss_and_grads(task, inputs, targets, targets.numel())
        torch.testing.assert_close(got["loss"], loss, rtol=1e-10, atol=1e-12)
        # parameter names carry the checkpoint wrapper's prefix when blocks are wrapped
        names = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in got["grads"].items()}
        assert set(names) == set(grads)
        for n, g in grads.items():
            torch.testing.assert_close(names[n], g, rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("trainer", ["model_parallel", "model_parallel_cpu"])
def test_model_parallel_trainers_build_the_strategy(compose_cfg, trainer: str) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    cfg = compose_cfg(f"trainer={trainer}", fast=False)
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, ModelParallelStrategy)
    options = strategy.megalab_shard_options
    assert options["activation_checkpointing"] is (trainer == "model_parallel")
    assert strategy._tensor_parallel_size == 1 and not strategy._save_distributed_checkpoint
    if trainer == "model_parallel_cpu":
        assert cfg.trainer.accelerator == "cpu" and strategy._process_group_backend == "gloo"


def test_tensor_parallel_mesh_and_bad_dtype_are_refused() -> None:
    from megalab.parallel.fsdp2 import _data_parallel_mesh, block_sharded_strategy

    class Mesh:
        mesh_dim_names = ("data_parallel", "tensor_parallel")

        def __getitem__(self, name: str):
            return type("Dim", (), {"size": lambda self: 2})()

    with pytest.raises(ValueError, match="tensor_parallel_size=2: megalab has no tensor"):
        _data_parallel_mesh(Mesh())
    # Refused when the trainer is built, before any process starts, naming what to use instead.
    with pytest.raises(ValueError, match="tensor_parallel_size=4") as err:
        block_sharded_strategy(tensor_parallel_size=4)
    for layout in ("tensor_parallel_size=1", "trainer=model_parallel", "trainer=fsdp_blocks",
                   "trainer=chunk_parallel"):  # fmt: skip
        assert layout in str(err.value)
    with pytest.raises(ValueError, match="unknown dtype 'bf16'"):
        block_sharded_strategy(param_dtype="bf16")


@pytest.mark.slow
def test_model_parallel_cpu_trains_like_one_process(fixture_data_dir: Path, tmp_path: Path) -> None:
    """`trainer=model_parallel_cpu` (2 gloo processes, FSDP2 per block) trains a Llama language
    model (model=llama's defaults at a tiny width) for 2 steps through megalab.cli.train to the
    weights of one process."""
    import json

    from conftest import FAST, run_cli

    common = [
        *FAST,
        "data=enwik8", "data.sha256=null", "data.valid_size=3000", "data.test_size=3000",
        "data.sampler=random", "data.max_len=32", "data.batch_size=4", "data.eval_batch_size=2",
        "data.eval_max_len=32", "model=llama", "task=language_modeling",
        "task.carry_state=false", "model.d_model=16", "model.backbone.num_layers=2",
        "model.backbone.num_heads=2", "trainer.max_steps=2", "trainer.limit_val_batches=2",
        f"paths.data_dir={fixture_data_dir}",
    ]  # fmt: skip
    records = {}
    for trainer in ("cpu", "model_parallel_cpu"):
        out = tmp_path / trainer
        proc = run_cli("-m", "megalab.cli.train", *common, f"trainer={trainer}",
                       f"hydra.run.dir={out}")  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        records[trainer] = json.loads((out / "metrics.json").read_text())
    one, two = records["cpu"], records["model_parallel_cpu"]
    assert two["global_step"] == 2
    # The weights after 2 sharded steps equal one process's: validation and test agree. (The
    # logged training loss is rank 0's, on its half of the batch, so it is not compared.)
    for key in ("val/loss", "test/loss"):
        assert abs(one["metrics"][key] - two["metrics"][key]) < 1e-4, key
