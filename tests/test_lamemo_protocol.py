"""The training protocol of the LaMemo/Transformer-XL papers: XL's per-row roll of the training
streams, the memory reset at each epoch start, and the code's halved loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megalab.data.lm.stream import StreamBatches, TokenStream
from megalab.models.lamemo import LaMemo
from megalab.nn.adaptive_xl import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from megalab.tasks.language_modeling import LanguageModelingTask


def test_rows_roll_within_themselves() -> None:
    stream = TokenStream(np.arange(101, dtype=np.int64), name="train")
    batches = StreamBatches(stream, rows_per_device=4, seq_len=10, roll="rows", seed=3)
    assert batches.row_len == 25
    for epoch in (0, 1):
        segs = [batches[(epoch, i)] for i in range(len(batches))]
        inputs = torch.cat([s["inputs"] for s in segs], 1)
        targets = torch.cat([s["targets"] for s in segs], 1)
        assert segs[0]["reset"] and not segs[1]["reset"]  # the memory restarts every epoch
        torch.testing.assert_close(targets, inputs + 1)  # pairs stay adjacent tokens
        for r in range(4):
            row = inputs[r].numpy()
            assert sorted(row) == list(range(25 * r, 25 * r + 25))  # the row keeps its part
            shift = row[0] - 25 * r
            assert list(row) == [25 * r + (shift + j) % 25 for j in range(25)]
    first = [batches[(e, 0)]["inputs"][:, 0].tolist() for e in range(4)]
    assert len({tuple(f) for f in first}) > 1  # new rotations every epoch
    assert batches[(2, 1)]["inputs"].tolist() == batches[(2, 1)]["inputs"].tolist()
    with pytest.raises(ValueError, match="unknown roll"):
        StreamBatches(stream, 4, 10, roll="tokens")


def test_loss_scale_halves_the_optimised_loss_not_the_logged_one() -> None:
    torch.manual_seed(0)

    def task(scale: float) -> LanguageModelingTask:
        torch.manual_seed(0)
        return LanguageModelingTask(
            AdaptiveEmbedding(20, 16),
            LaMemo(
                d_model=16, num_layers=1, num_heads=2, head_dim=8, ffn_dim=8, mem_len=4, dropout=0.0
            ),
            ProjectedAdaptiveLogSoftmax(16, 20),
            tie_weights=True,
            carry_state=True,
            loss_scale=scale,
        )

    batch = {"inputs": torch.randint(0, 20, (2, 6)), "targets": torch.randint(0, 20, (2, 6))}
    full, half = task(1.0), task(0.5)
    a, b = full._step(batch, "train"), half._step(batch, "train")
    torch.testing.assert_close(b, 0.5 * a)
    with pytest.raises(ValueError, match="loss_scale"):
        task(0.0)
