"""LRA Retrieval (AAN): the release's TSV format, byte tokens per document, pairs in batches."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from megalab.data.download import DatasetMissingError
from megalab.data.lra.release import LRAFormatError
from megalab.data.lra.retrieval import AANDataModule, read_pairs
from megalab.data.lra.text import BYTE_OFFSET, CLS_ID, EOS_ID, PAD_ID
from megalab.testing.lra_retrieval import SIZES, rows


@pytest.fixture
def aan_dir(fixture_data_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "lra" / "aan"
    shutil.copytree(fixture_data_dir / "lra" / "aan", out)
    return out


def test_read_pairs_follows_the_release_format(aan_dir: Path) -> None:
    got = list(read_pairs(aan_dir / "new_aan_pairs.eval.tsv"))  # labels written as 0.0 / 1.0
    want = rows("eval", SIZES["eval"])
    assert [g[0] for g in got] == [int(float(r[0])) for r in want]
    assert [g[1] for g in got] == [r[3].encode() for r in want]
    assert [g[2] for g in got] == [r[4].encode() for r in want]


def test_datamodule_pairs_lengths_and_splits(aan_dir: Path) -> None:
    dm = AANDataModule(aan_dir, batch_size=4)
    assert dm.spec.pairwise and dm.spec.vocab_size == 261 and dm.spec.max_len == 4001
    dm.prepare_data()
    dm.setup()
    assert {k: len(v) for k, v in dm.datasets.items()} == {"train": 16, "val": 8, "test": 8}
    want = rows("train", SIZES["train"])
    for i in (0, 3):
        item = dm.datasets["train"][i]
        for key, text in (("inputs", want[i][3]), ("inputs2", want[i][4])):
            ids = item[key].numpy()
            raw = text.encode()
            assert ids[-1] == EOS_ID and len(ids) == min(len(raw), 4000) + 1
            assert bytes((ids[:-1] - BYTE_OFFSET).tolist()) == raw[:4000]
        assert item["targets"] == int(want[i][0])
    assert len(want[0][3].encode()) > 4000  # the first document is truncated
    batch = next(iter(dm.test_dataloader()))
    for key, mask in (("inputs", "mask"), ("inputs2", "mask2")):
        assert batch[mask].shape == batch[key].shape and batch[key].shape[0] == 4
        assert (batch[key][~batch[mask]] == PAD_ID).all()
    # Evaluation takes the pairs longest first (by the longer document), else in file order.
    longest = np.argsort(-dm.datasets["test"].lengths(), kind="stable")[:4]
    test_rows = rows("test", SIZES["test"])
    assert batch["targets"].tolist() == [int(test_rows[i][0]) for i in longest]
    in_order = AANDataModule(aan_dir, batch_size=4, sort_eval_by_length=False)
    in_order.setup()
    batch = next(iter(in_order.test_dataloader()))
    assert batch["targets"].tolist() == [int(r[0]) for r in test_rows[:4]]


def test_prepend_cls_and_cache_per_length(aan_dir: Path) -> None:
    base = AANDataModule(aan_dir)
    dm = AANDataModule(aan_dir, max_len=32, prepend_cls=True)
    assert dm.cache_path() != base.cache_path()
    dm.setup()
    item = dm.datasets["train"][0]
    for key in ("inputs", "inputs2"):
        assert item[key][0] == CLS_ID and item[key][-1] == EOS_ID and len(item[key]) <= 32
    assert dm.datasets["train"].lengths().max() == 32


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("1\tP1\tP2\tonly four fields\n", r"new_aan_pairs.train.tsv:3: expected 5 tab-separated"),
        ("2\tP1\tP2\ta\tb\n", r"new_aan_pairs.train.tsv:3: label 2 is not 0 or 1"),
        ("yes\tP1\tP2\ta\tb\n", r"new_aan_pairs.train.tsv:3: label b'yes' is not a number"),
    ],
)
def test_malformed_lines_name_file_and_line(aan_dir: Path, line: str, error: str) -> None:
    path = aan_dir / "new_aan_pairs.train.tsv"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join([*lines[:2], line, *lines[2:]]))
    with pytest.raises(LRAFormatError, match=error):
        AANDataModule(aan_dir).prepare_data()


def test_missing_files_say_how_to_get_them(tmp_path: Path) -> None:
    dm = AANDataModule(tmp_path / "data" / "lra" / "aan")
    with pytest.raises(DatasetMissingError) as info:
        dm.prepare_data()
    msg = str(info.value)
    assert "new_aan_pairs.train.tsv" in msg and "new_aan_pairs.eval.tsv" in msg
    assert f"megalab-data lra --task retrieval --root {tmp_path / 'data'}" in msg
    assert "lra_release.gz" in msg


def test_batches_are_deterministic(aan_dir: Path) -> None:
    def first_batch() -> np.ndarray:
        dm = AANDataModule(aan_dir, batch_size=4, seed=3)
        dm.setup()
        return next(iter(dm.train_dataloader()))["inputs2"].numpy()

    assert np.array_equal(first_batch(), first_batch())
