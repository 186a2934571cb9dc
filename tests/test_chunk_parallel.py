"""Chunk parallelism: 2 gloo ranks, each on half of every sequence and exchanging only the
carried state (forward) and its gradient (backward), give the loss and the gradients of 1 rank
on the whole sequence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from causal_models import build_lm
from megalab.parallel.chunk import flatten_state, unflatten_state
from parallel_worker import batch, loss_and_grads, run

CASES = [
    # Mega-chunk (c = 8): slices of 16 start on chunk boundaries, only EMA states cross.
    ("mega", "causal_softmax_rotary", 32),
    # Slices of 14: the keys/values of the chunk open at the boundary cross as well.
    ("mega", "causal_laplace_postnorm", 28),
    # Full attention (no chunks): the whole key/value prefix crosses.
    ("mega", "causal_relu2_full_scalenorm", 24),
    # Llama: its key/value cache is the state (grouped-query attention).
    ("llama", "causal_gqa_maxlen", 32),
]


def test_two_gloo_ranks_equal_one_rank_on_the_whole_sequence(tmp_path: Path) -> None:
    mp.spawn(run, args=(2, str(tmp_path / "init"), str(tmp_path), CASES), nprocs=2, join=True)
    for name, variant, length in CASES:
        got = torch.load(tmp_path / f"{name}-{variant}-{length}.pt", weights_only=True)
        task = build_lm(name, variant).train()
        inputs, targets = batch(length)
        loss, grads = loss_and_grads(task, inputs, targets, targets.numel())
        torch.testing.assert_close(got["loss"], loss, rtol=1e-10, atol=1e-12)
        assert set(got["grads"]) == set(grads)
        for n, g in grads.items():
            torch.testing.assert_close(got["grads"][n], g, rtol=1e-9, atol=1e-12, msg=n)


def test_state_headers_round_trip_without_pickling() -> None:
    task = build_lm("mega", "causal_softmax_rotary")
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    state = task.backbone(x, None, task.backbone.initial_state(2, x)).state
    header, tensors = flatten_state(state)
    assert "MegaState" in header and len(tensors) == 2 * 3  # EMA state, keys, values per layer
    back = unflatten_state(header, tensors)
    assert type(back) is type(state)
    torch.testing.assert_close(back.layers[1].kv.key, state.layers[1].kv.key)
    with pytest.raises(ValueError, match="unknown state class"):
        unflatten_state(header.replace("MegaState", "Evil"), tensors)


def test_trainer_option_trains_like_one_process(fixture_data_dir: Path, tmp_path: Path) -> None:
    """`trainer=chunk_parallel_cpu` (2 gloo processes, one group) trains Mega-chunk on the
    halves of each window and logs the losses of a single process on the whole windows."""
    import json

    from conftest import FAST, run_cli

    def read_metrics(run_dir: Path) -> dict:
        return json.loads((run_dir / "metrics.json").read_text())

    common = [
        *FAST,
        "data=enwik8", "data.sha256=null", "data.valid_size=3000", "data.test_size=3000",
        "data.sampler=random", "data.max_len=32", "data.batch_size=4", "data.eval_batch_size=2",
        "data.eval_max_len=30", "model=mega", "task=language_modeling", "task.carry_state=false",
        "model.d_model=16", "model.backbone.num_layers=2", "model.backbone.z_dim=8",
        "model.backbone.v_dim=16", "model.backbone.ffn_dim=16", "model.backbone.causal=true",
        "model.backbone.prenorm=true", "model.backbone.chunk_size=8",
        "model.backbone.rel_pos_bias=rotary", "model.backbone.dropout=0.0",
        "model.encoder.dropout=0.0", "trainer.max_steps=2", "trainer.limit_val_batches=2",
        f"paths.data_dir={fixture_data_dir}",
    ]  # fmt: skip
    records = {}
    for trainer in ("cpu", "chunk_parallel_cpu"):
        out = tmp_path / trainer
        proc = run_cli("-m", "megalab.train", *common, f"trainer={trainer}",
                       f"hydra.run.dir={out}")  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        records[trainer] = read_metrics(out)
    one, two = records["cpu"], records["chunk_parallel_cpu"]
    assert two["global_step"] == 2
    for key in ("train/loss_step", "val/loss", "test/loss"):
        assert abs(one["metrics"][key] - two["metrics"][key]) < 1e-4, key
