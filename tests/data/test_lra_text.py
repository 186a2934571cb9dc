"""LRA Text (IMDB bytes): vocabulary, lengths, splits, sources, and clear errors without data."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megalab.data.download import DatasetMissingError
from megalab.data.lra.release import LRAFormatError
from megalab.data.lra.text import (
    BYTE_OFFSET,
    CLS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    IMDBDataModule,
    byte_vocab,
    encode_bytes,
)
from megalab.testing.lra_text import SIZES, reviews

OFFLINE_VARS = ("MEGALAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


@pytest.fixture
def imdb_dir(fixture_data_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the IMDB fixture (tests below write caches and break files)."""
    out = tmp_path / "imdb"
    shutil.copytree(fixture_data_dir / "lra" / "imdb" / "plain_text", out / "plain_text")
    return out


def hub_copy(imdb_dir: Path):  # -> datasets.DatasetDict
    """The fixture as the `DatasetDict` that `datasets.load_dataset` returns."""
    import datasets

    files = {s: str(imdb_dir / "plain_text" / f"{s}-00000-of-00001.parquet") for s in SIZES}
    return datasets.DatasetDict({s: datasets.Dataset.from_parquet(f) for s, f in files.items()})


def same_tokens(a: object, b: object) -> bool:
    return np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))  # type: ignore[attr-defined]


def decode(ids: np.ndarray) -> bytes:
    ids = np.asarray(ids)
    return bytes((ids[(ids >= BYTE_OFFSET) & (ids < CLS_ID)] - BYTE_OFFSET).tolist())


def test_vocabulary_and_encoding() -> None:
    vocab = byte_vocab()
    assert len(vocab) == VOCAB_SIZE == 261
    assert vocab[:4] == ["<s>", "<pad>", "</s>", "<unk>"] and vocab[-1] == "<CLS>"
    assert (PAD_ID, EOS_ID, CLS_ID) == (1, 2, 260)
    ids = encode_bytes("é!".encode(), max_len=10)
    assert ids.tolist() == [0xC3 + 4, 0xA9 + 4, ord("!") + 4, EOS_ID]
    long = encode_bytes(b"x" * 5000, max_len=4001)
    assert len(long) == 4001 and long[-1] == EOS_ID and (long[:-1] == ord("x") + 4).all()
    cls = encode_bytes(b"x" * 5000, max_len=4002, prepend_cls=True)
    assert len(cls) == 4002 and cls[0] == CLS_ID and cls[-1] == EOS_ID
    assert encode_bytes(b"abc", 3, append_eos=False).tolist() == [101, 102, 103]
    with pytest.raises(ValueError, match="no room"):
        encode_bytes(b"abc", 2, append_eos=True, prepend_cls=True)


def test_datamodule_tokens_lengths_and_default_validation(imdb_dir: Path) -> None:
    dm = IMDBDataModule(imdb_dir, batch_size=4, eval_batch_size=8)
    dm.prepare_data()
    dm.setup()
    train, val, test = (dm.datasets[s] for s in ("train", "val", "test"))
    assert (len(train), len(test)) == (SIZES["train"], SIZES["test"])
    assert val is test  # LRA/S4/Mega: validate on the test set
    texts, labels = reviews("train", SIZES["train"])
    for i in (0, 1, 5):
        item = train[i]
        ids = item["inputs"].numpy()
        raw = texts[i].encode("utf-8")
        assert ids[-1] == EOS_ID and len(ids) == min(len(raw), 4000) + 1
        assert decode(ids) == raw[:4000]
        assert item["targets"] == labels[i]
    assert len(texts[0].encode()) > 4000 and len(train[0]["inputs"]) == 4001
    assert int(train.tokens.max()) < VOCAB_SIZE and int(train.tokens.min()) >= 0
    batch = next(iter(dm.val_dataloader()))
    assert not batch["inputs"].is_floating_point()
    assert batch["mask"].shape == batch["inputs"].shape
    assert (batch["inputs"][~batch["mask"]] == PAD_ID).all()
    assert (batch["inputs"][batch["mask"]] != PAD_ID).all()
    assert dm.spec.vocab_size == 261 and dm.spec.num_classes == 2 and dm.spec.max_len == 4001


def test_prepend_cls_max_len_and_cache_keys(imdb_dir: Path) -> None:
    a = IMDBDataModule(imdb_dir)
    b = IMDBDataModule(imdb_dir, max_len=64, prepend_cls=True)
    assert a.cache_path() != b.cache_path()  # another length re-prepares
    b.prepare_data()
    b.setup()
    lengths = b.datasets["train"].lengths()
    assert lengths.max() == 64
    item = b.datasets["train"][0]["inputs"]
    assert item[0] == CLS_ID and item[-1] == EOS_ID
    again = IMDBDataModule(imdb_dir, max_len=64, prepend_cls=True)
    assert again.cache_path() == b.cache_path()
    again.setup()
    assert np.array_equal(
        np.asarray(again.datasets["test"].tokens), np.asarray(b.datasets["test"].tokens)
    )


def test_holdout_validation_is_seeded_and_disjoint(imdb_dir: Path) -> None:
    def split(seed: int) -> tuple[list[int], list[int]]:
        dm = IMDBDataModule(imdb_dir, val_source="train", val_fraction=0.25, split_seed=seed)
        dm.setup()
        return dm.datasets["train"].indices, dm.datasets["val"].indices

    tr, va = split(42)
    assert len(va) == 6 and len(tr) == 18 and not set(tr) & set(va)
    assert split(42) == (tr, va)
    assert split(7) != (tr, va)


def test_save_to_disk_source(imdb_dir: Path, tmp_path: Path) -> None:
    dd = hub_copy(imdb_dir)
    saved = tmp_path / "saved"
    dd.save_to_disk(str(saved))
    dm = IMDBDataModule(saved)
    dm.prepare_data()
    dm.setup()
    ref = IMDBDataModule(imdb_dir)
    ref.setup()
    assert np.array_equal(
        np.asarray(dm.datasets["train"].tokens), np.asarray(ref.datasets["train"].tokens)
    )


def test_missing_column_and_bad_label(imdb_dir: Path) -> None:
    path = next((imdb_dir / "plain_text").glob("test-*.parquet"))
    table = pq.read_table(path)
    pq.write_table(table.rename_columns(["review", "label"]), path)
    with pytest.raises(
        LRAFormatError, match=r"test-00000-of-00001.parquet: missing column\(s\) \['text'\]"
    ):
        IMDBDataModule(imdb_dir).prepare_data()
    bad = pa.table({"text": ["fine"], "label": pa.array([-1], pa.int64())})
    pq.write_table(bad, path)
    with pytest.raises(LRAFormatError, match="row 0 has label -1"):
        IMDBDataModule(imdb_dir).prepare_data()


def test_offline_without_data_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dm = IMDBDataModule(tmp_path / "lra" / "imdb")
    with pytest.raises(DatasetMissingError) as info:
        dm.prepare_data()
    msg = str(info.value)
    assert "stanfordnlp/imdb" in msg and "megalab-data imdb" in msg
    assert str(tmp_path / "lra" / "imdb" / "plain_text" / "train-00000-of-00001.parquet") in msg
    assert "offline" in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(DatasetMissingError, match="download=false"):
        IMDBDataModule(tmp_path / "other", download=False).prepare_data()


def test_online_fetch_stores_hub_parquet(
    imdb_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    for var in OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    calls = []

    def fake_load_dataset(name: str, cache_dir: str | None = None) -> datasets.DatasetDict:
        calls.append((name, cache_dir))
        return hub_copy(imdb_dir)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    target = tmp_path / "fetched"
    dm = IMDBDataModule(target, hf_cache_dir=str(tmp_path / "hf"))
    dm.prepare_data()
    assert calls == [("stanfordnlp/imdb", str(tmp_path / "hf"))]
    assert (target / "plain_text" / "train-00000-of-00001.parquet").is_file()
    dm.setup()
    assert len(dm.datasets["train"]) == SIZES["train"]

    def unreachable(name: str, cache_dir: str | None = None) -> None:
        raise ConnectionError("Couldn't reach 'stanfordnlp/imdb' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DatasetMissingError, match="fetching from the Hub failed: ConnectionError"):
        IMDBDataModule(tmp_path / "nowhere").prepare_data()


def test_hub_settings_and_their_defaults(tmp_path: Path) -> None:
    dm = IMDBDataModule(tmp_path)
    assert dm.hub_id == dm.source.repo == "stanfordnlp/imdb" and dm.val_source == "test"
    assert (dm.val_fraction, dm.split_seed, dm.download, dm.hf_cache_dir) == (0.1, 42, True, None)
    other = IMDBDataModule(tmp_path, 64, hub_id="me/imdb", download=False, val_fraction=2.0)
    assert (other.max_len, other.source.repo, other.download) == (64, "me/imdb", False)
    assert other.val_fraction == 2.0, "checked only when validation is held out of train"
