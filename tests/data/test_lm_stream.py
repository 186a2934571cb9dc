"""Language-model streams: contiguity, exact evaluation coverage, DDP shards, offsets, resume."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from megalab.data.base import ResumableDataLoader
from megalab.data.lm.stream import (
    BatchIndexSampler,
    EvalBatches,
    Layout,
    LMStreamDataModule,
    RandomWindowBatches,
    StreamBatches,
    TokenStream,
)


class ArrayLM(LMStreamDataModule):
    """Streams held in memory: token i of a split has id i (so ids are positions)."""

    def __init__(self, sizes: dict[str, int], **kwargs) -> None:
        kwargs.setdefault("vocab_size", max(sizes.values()))
        super().__init__("unused", **kwargs)
        self.sizes = sizes

    def load_streams(self) -> dict[str, TokenStream]:
        return {s: TokenStream(np.arange(n, dtype=np.int64), name=s) for s, n in self.sizes.items()}


def positions(n: int) -> TokenStream:
    return TokenStream(np.arange(n, dtype=np.int64), name="s")


def scored_targets(ds, epoch: int = 0) -> list[int]:
    out: list[int] = []
    for i in range(len(ds)):
        b = ds[(epoch, i)]
        out += b["targets"][b["target_mask"]].tolist()
    return out


@pytest.mark.parametrize("stride", [None, 1, 5, 16])
@pytest.mark.parametrize(("n", "rows", "world"), [(97, 4, 1), (101, 5, 2), (64, 3, 3), (9, 8, 2)])
def test_evaluation_predicts_every_token_exactly_once(n, rows, world, stride) -> None:
    stream = positions(n)
    seen: list[int] = []
    counts = set()
    for rank in range(world):
        ds = EvalBatches(stream, rows, 16, Layout(rank, world), stride=stride)
        counts.add(len(ds))
        seen += scored_targets(ds)
    assert sorted(seen) == list(range(1, n)), "each of the N-1 predictions once"
    assert len(counts) == 1, "every rank runs the same number of evaluation batches"


def test_evaluation_segments_are_contiguous_with_a_padded_partial_tail() -> None:
    ds = EvalBatches(positions(103), rows=4, seq_len=10, layout=Layout())
    batches = [ds[(0, t)] for t in range(len(ds))]
    assert [bool(b["reset"]) for b in batches] == [True] + [False] * (len(batches) - 1)
    for prev, nxt in itertools.pairwise(batches):
        # the next segment starts where the previous one stopped, row by row
        last = prev["inputs"][:, -1]
        assert torch.equal(nxt["inputs"][:, 0][nxt["mask"][:, 0]], (last + 1)[nxt["mask"][:, 0]])
    for b in batches:
        m = b["mask"]
        assert torch.equal(b["targets"][m], b["inputs"][m] + 1)
        assert torch.equal(b["target_mask"], m)
    tail = batches[-1]
    assert tail["inputs"].shape[1] < 10 and not tail["mask"].all()


def test_sliding_windows_score_only_new_tokens_after_full_context() -> None:
    L, S = 12, 4
    ds = EvalBatches(positions(200), rows=3, seq_len=L, layout=Layout(), stride=S)
    for t in range(len(ds)):
        b = ds[(0, t)]
        assert bool(b["reset"]), "windows overlap: each starts afresh"
        for r in range(b["inputs"].shape[0]):
            valid, scored = b["mask"][r], b["target_mask"][r]
            cols = scored.nonzero().squeeze(1)
            if not len(cols):
                continue
            first_target = int(b["targets"][r, cols[0]])
            # context: everything before the new tokens, up to L - S tokens of it
            assert int(cols[0]) == min(L - S, first_target - 1)
            assert len(cols) <= S and bool(valid[: int(cols[-1]) + 1].all())
            # inputs are consecutive positions of the stream
            ins = b["inputs"][r][valid]
            assert torch.equal(ins, torch.arange(int(ins[0]), int(ins[0]) + len(ins)))


def test_training_stream_is_contiguous_across_batches_and_resets_each_epoch() -> None:
    n, L = 1001, 16
    ds = StreamBatches(positions(n), rows_per_device=4, seq_len=L, roll=True, seed=3)
    batches = [ds[(0, i)] for i in range(len(ds))]
    assert [bool(b["reset"]) for b in batches] == [True] + [False] * (len(ds) - 1)
    for prev, nxt in itertools.pairwise(batches):
        assert torch.equal(nxt["inputs"][:, 0], prev["targets"][:, -1])
    rows = torch.cat([b["inputs"] for b in batches], dim=1)
    targets = torch.cat([b["targets"] for b in batches], dim=1)
    assert rows.shape == (4, (n - 1) // 4)
    # each row reads consecutive positions of the stream rotated by the epoch's offset
    assert torch.equal((rows + 1) % n, targets)
    assert torch.equal(rows[:, 1:], (rows[:, :-1] + 1) % n)
    assert torch.equal(rows[1:, 0], (rows[:-1, -1] + 1) % n), "rows follow each other"
    assert int(rows[0, 0]) == ds.offset(0)


def test_random_offset_changes_per_epoch_and_is_reproducible() -> None:
    ds = StreamBatches(positions(10_007), rows_per_device=2, seq_len=8, roll=True, seed=0)
    offsets = [ds.offset(e) for e in range(5)]
    assert len(set(offsets)) == 5
    again = StreamBatches(positions(10_007), rows_per_device=2, seq_len=8, roll=True, seed=0)
    assert torch.equal(again[(3, 7)]["inputs"], ds[(3, 7)]["inputs"])
    fixed = StreamBatches(positions(10_007), rows_per_device=2, seq_len=8, roll=False)
    assert {fixed.offset(e) for e in range(3)} == {0}
    assert int(fixed[(0, 0)]["inputs"][0, 0]) == 0


@pytest.mark.parametrize(("world", "accumulate"), [(1, 1), (2, 1), (3, 2)])
def test_training_shards_are_disjoint_and_cover_the_rows(world: int, accumulate: int) -> None:
    n, rows, L = 2000, 2, 7
    seen: dict[int, int] = {}
    for rank in range(world):
        ds = StreamBatches(positions(n), rows, L, Layout(rank, world, accumulate), roll=False)
        assert len(ds) == ds.segments * accumulate
        for i in range(len(ds)):
            b = ds[(0, i)]
            assert int(b["stream_group"]) == i % accumulate
            for p in b["inputs"].flatten().tolist():
                seen[p] = seen.get(p, 0) + 1
    total_rows = rows * world * accumulate
    row_len = (n - 1) // total_rows
    assert set(seen.values()) == {1}, "no position is read twice"
    assert sorted(seen) == list(range(total_rows * row_len)), "all rows are read"


def test_accumulation_groups_continue_their_own_rows() -> None:
    ds = StreamBatches(positions(500), 2, 5, Layout(0, 1, 2), roll=False)
    b = [ds[(0, i)] for i in range(6)]
    assert [int(x["stream_group"]) for x in b] == [0, 1, 0, 1, 0, 1]
    assert torch.equal(b[2]["inputs"][:, 0], b[0]["targets"][:, -1])
    assert torch.equal(b[3]["inputs"][:, 0], b[1]["targets"][:, -1])
    assert bool(b[0]["reset"]) and bool(b[1]["reset"]) and not bool(b[2]["reset"])


def test_random_windows_variable_length_same_on_every_rank() -> None:
    stream = positions(5000)
    shards = [
        RandomWindowBatches(stream, 2, 12, Layout(r, 2), seed=1, multiples=(1, 3), unit=4)
        for r in range(2)
    ]
    lengths = set()
    for i in range(len(shards[0])):
        a, b = shards[0][(0, i)], shards[1][(0, i)]
        assert a["inputs"].shape == b["inputs"].shape, "ranks agree on the window length"
        width = a["inputs"].shape[1]
        lengths.add(width)
        assert a["inputs"].shape[0] == 2 * (12 // width), "as many tokens per step"
        for x in (a, b):
            assert bool(x["reset"])
            assert torch.equal(x["targets"], x["inputs"] + 1)
            assert torch.equal(x["inputs"][:, 1:], x["inputs"][:, :-1] + 1)
    assert lengths == {4, 8, 12}
    assert torch.equal(shards[0][(2, 5)]["inputs"], shards[0][(2, 5)]["inputs"])
    assert not torch.equal(shards[0][(0, 0)]["inputs"], shards[0][(1, 0)]["inputs"])


def test_resumed_loader_continues_with_the_next_batch() -> None:
    ds = StreamBatches(positions(3000), 3, 10, roll=True, seed=5)
    straight = list(ResumableDataLoader(ds, batch_size=None, sampler=BatchIndexSampler(len(ds))))
    sampler = BatchIndexSampler(len(ds))
    sampler.set_epoch(0)
    resumed = list(ResumableDataLoader(ds, batch_size=None, sampler=sampler, position=lambda: 7))
    assert len(resumed) == len(straight) - 7
    for a, b in zip(straight[7:], resumed):
        assert torch.equal(a["inputs"], b["inputs"]) and bool(a["reset"]) == bool(b["reset"])
    sampler.set_epoch(2)
    sampler.skip = 0
    assert next(iter(sampler)) == (2, 0), "a new epoch starts from its first batch"


def test_datamodule_loaders_batches_and_spec() -> None:
    dm = ArrayLM(
        {"train": 400, "val": 51, "test": 60},
        max_len=8,
        batch_size=4,
        eval_batch_size=3,
        vocab_size=400,
    )
    dm.setup()
    assert dm.spec.max_len == 8 and dm.spec.vocab_size == 400 and dm.spec.num_classes is None
    train = list(dm.train_dataloader())
    assert train[0]["inputs"].shape == (4, 8) and bool(train[0]["reset"])
    assert sorted(scored_targets(dm.batches("val"))) == list(range(1, 51))
    got = []
    for b in dm.test_dataloader():
        got += b["targets"][b["target_mask"]].tolist()
    assert sorted(got) == list(range(1, 60))
    random = ArrayLM(
        {"train": 400, "val": 51, "test": 60},
        max_len=8,
        batch_size=4,
        vocab_size=400,
        sampler="random",
    )
    assert all(bool(b["reset"]) for b in random.train_dataloader())


@pytest.mark.parametrize(
    ("sampler", "kind"), [("stream", StreamBatches), ("random", RandomWindowBatches)]
)
def test_sampler_key_picks_the_training_batches_without_shadowing_the_method(sampler, kind) -> None:
    dm = ArrayLM({"train": 400, "val": 51, "test": 60}, max_len=8, batch_size=4, sampler=sampler)
    assert dm.train_sampling == sampler and isinstance(dm.batches("train"), kind)
    assert callable(dm.sampler), "the config key must not replace SequenceDataModule.sampler()"


def test_clear_errors_for_bad_settings_and_data() -> None:
    with pytest.raises(ValueError, match=r"token id 59.*data.vocab_size=50"):
        ArrayLM({"train": 60, "val": 10, "test": 10}, max_len=4, vocab_size=50).setup()
    with pytest.raises(ValueError, match="val split has 1 token"):
        ArrayLM({"train": 60, "val": 1, "test": 10}, max_len=4, vocab_size=60).setup()
    dm = ArrayLM({"train": 60, "val": 10, "test": 10}, max_len=4, batch_size=3, vocab_size=60)
    with pytest.raises(ValueError, match="not divisible by world_size"):
        dm.batches("train", Layout(0, 2))
    with pytest.raises(ValueError, match="fewer than the 64 rows"):
        ArrayLM(
            {"train": 60, "val": 10, "test": 10}, max_len=4, batch_size=64, vocab_size=60
        ).batches("train")
    with pytest.raises(ValueError, match="eval_batch_size"):
        EvalBatches(positions(50), rows=2, seq_len=4, layout=Layout(0, 3))
    with pytest.raises(ValueError, match="needs sampler=random"):
        ArrayLM({"train": 60}, max_len=4, train_len_multiples=[2, 4], train_len_unit=2)
    with pytest.raises(ValueError, match=r"at most data.max_len"):
        RandomWindowBatches(positions(100), 1, 8, multiples=(2, 4), unit=4)
    # When the data module is built (before a trainer starts its processes), not at training.
    with pytest.raises(ValueError, match=r"train_len_unit=4 must give windows of at most"):
        ArrayLM({"train": 60}, max_len=8, sampler="random", train_len_multiples=[2, 4],
                train_len_unit=4)  # fmt: skip
    with pytest.raises(ValueError, match=r"d_input and data.num_classes"):
        ArrayLM({"train": 60}, max_len=4, num_classes=3)
