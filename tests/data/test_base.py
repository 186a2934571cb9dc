"""The shared data path: sharded, resumable sampling and length-sorted evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalab.data.base import ShardedSampler
from megalab.data.lra.listops import ListOpsDataModule
from megalab.models.transformer.model import TransformerConfig


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sampler_shards(world: int) -> None:
    size = 10
    train = [ShardedSampler(size, True, seed=1, rank=r, world_size=world) for r in range(world)]
    shards = [s.indices() for s in train]
    assert len({len(s) for s in shards}) == 1, "every process takes the same number of steps"
    assert set().union(*shards) == set(range(size))
    order = [9, 3, 0, 1, 2, 4, 5, 6, 7, 8]
    for given in (None, order):
        evals = [
            ShardedSampler(size, False, rank=r, world_size=world, order=given) for r in range(world)
        ]
        seen = sorted(i for s in evals for i in s)
        assert seen == list(range(size)), "evaluation sees every example exactly once"
    assert ShardedSampler(size, False, order=order).indices() == order
    with pytest.raises(ValueError, match="permutation"):
        ShardedSampler(size, False, order=[0, 0, 1])


def _listops(root: Path, **kwargs) -> ListOpsDataModule:
    dm = ListOpsDataModule(
        root,
        batch_size=4,
        eval_batch_size=4,
        num_train=8,
        num_val=8,
        num_test=11,
        min_length=5,
        max_length=60,
        max_depth=3,
        max_args=4,
        generator_workers=1,
        **kwargs,
    )
    dm.prepare_data()
    dm.setup()
    return dm


def test_evaluation_is_sorted_by_length_and_predictions_do_not_change(tmp_path: Path) -> None:
    sorted_dm = _listops(tmp_path / "listops")
    plain_dm = _listops(tmp_path / "listops", sort_eval_by_length=False)
    batches = list(sorted_dm.test_dataloader())
    lengths = [int(n) for b in batches for n in b["mask"].sum(1)]
    assert lengths == sorted(lengths, reverse=True)
    plain = list(plain_dm.test_dataloader())
    assert sum(len(b["targets"]) for b in plain) == len(lengths) == 11
    padded = sum(b["mask"].numel() for b in batches)
    assert padded < sum(b["mask"].numel() for b in plain), "sorting saves padding"

    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(sorted_dm.vocab_size, 16),
            "backbone": TransformerConfig(
                d_model=16, num_layers=2, num_heads=2, ffn_dim=32
            ).build(),
        }
    ).eval()

    def predictions(loader_batches: list[dict]) -> list[tuple[int, ...]]:
        """(sequence, target, pooled output rounded) per example, in a canonical order."""
        out = []
        with torch.no_grad():
            for b in loader_batches:
                y = model["backbone"](model["embed"](b["inputs"]), b["mask"]).y
                pooled = (y * b["mask"][..., None]).sum(1) / b["mask"].sum(1, keepdim=True)
                for row, mask, target, p in zip(
                    b["inputs"], b["mask"], b["targets"], pooled, strict=True
                ):
                    out.append((tuple(row[mask].tolist()), int(target), p))
        return sorted(out, key=lambda t: t[0])

    for (seq_a, t_a, p_a), (seq_b, t_b, p_b) in zip(
        predictions(batches), predictions(plain), strict=True
    ):
        assert seq_a == seq_b and t_a == t_b
        torch.testing.assert_close(p_a, p_b, rtol=1e-5, atol=1e-6)


def test_pin_memory_without_a_gpu_pins_nothing_and_says_nothing(
    tmp_path: Path, recwarn: pytest.WarningsRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ImageNet configs pin memory for their GPU copies; on a CPU run that is a no-op that
    torch would warn about at every loader."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    dm = _listops(tmp_path / "listops", pin_memory=True)
    loader = dm.train_dataloader()
    next(iter(loader))
    assert loader.pin_memory is False
    assert not [w for w in recwarn if "pin_memory" in str(w.message)]
