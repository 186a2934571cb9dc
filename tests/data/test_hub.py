"""`megalab.data.hub`: local layouts, split aliases, save_to_disk, checks, messages, fetching."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megalab.data.download import DatasetMissingError
from megalab.data.hub import HubDataset, HubFormatError

OFFLINE_VARS = ("MEGALAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
ROWS = {"train": ["a", "b", "c"], "validation": ["v"], "test": ["t", "u"]}


def write(path: Path, texts: list[str], **extra: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts, **extra}), path)
    return path


def source(local_dir: Path, **kwargs) -> HubDataset:
    return HubDataset(name="Toy", repo="org/toy", local_dir=local_dir, columns=("text",), **kwargs)


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    "layout",
    [
        "{split}-00000-of-00001.parquet",  # flat
        "data/{split}-00000-of-00001.parquet",  # the Hub's default
        "plain_text/{split}-00000-of-00001.parquet",  # a config folder (IMDB, CIFAR-10)
        "default/{split}/0000.parquet",  # the parquet export (refs/convert/parquet)
        "nested/deeper/{split}_shard.parquet",
    ],
)
def test_local_layouts(tmp_path: Path, layout: str) -> None:
    for split, texts in ROWS.items():
        write(tmp_path / layout.format(split=split), texts)
    src = source(tmp_path)
    assert src.is_local()
    for split, hub in (("train", "train"), ("val", "validation"), ("test", "test")):
        assert [f.relative_to(tmp_path).as_posix() for f in src.files(split)] == [
            layout.format(split=hub)
        ]
        assert src.table(split).column("text").to_pylist() == ROWS[hub]
        assert list(src.texts(split, batch_size=2)) == ROWS[hub]
        assert src.num_rows(split) == len(ROWS[hub])


def test_shards_in_order_split_aliases_and_ignored_files(tmp_path: Path) -> None:
    cfg = tmp_path / "wikitext-103-v1"
    write(cfg / "train-00001-of-00002.parquet", ["c"])
    write(cfg / "train-00000-of-00002.parquet", ["a", "b"])
    write(cfg / "valid-00000-of-00001.parquet", ["v"])  # alias of validation
    write(cfg / "test-00000-of-00001.parquet", [None, "t"])
    write(tmp_path / "prepared" / "train-00000-of-00001.parquet", ["cache"])  # not a source
    write(cfg / ".cache" / "test-00000-of-00001.parquet", ["hidden"])  # download metadata
    src = source(cfg)
    assert [f.name for f in src.files("train")] == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    assert list(src.texts("train")) == ["a", "b", "c"]
    assert list(src.texts("val")) == ["v"]
    assert list(src.rows("test")) == [{"text": None}, {"text": "t"}]
    assert list(src.texts("test")) == ["", "t"]  # a null text is empty
    assert not source(tmp_path / "prepared").is_local()
    two = source(cfg, splits=("train", "test"))
    assert two.is_local() and [f.name for f in two.files("test")] == ["test-00000-of-00001.parquet"]


def test_save_to_disk_copy(tmp_path: Path) -> None:
    import datasets

    saved = tmp_path / "saved"
    dd = datasets.DatasetDict(
        {s: datasets.Dataset.from_dict({"text": t, "extra": [0] * len(t)}) for s, t in ROWS.items()}
    )
    dd.save_to_disk(str(saved))
    src = source(saved)
    assert src.saved() and src.is_local() and src.files("train") == []
    src.require(download=False)  # nothing to fetch
    assert src.table("val").column_names == ["text"]
    assert src.table("val").column("text").to_pylist() == ["v"]
    assert list(src.texts("train", batch_size=2)) == ROWS["train"]
    assert src.num_rows("test") == 2
    assert any(name.endswith("dataset_dict.json") for name, _, _ in src.fingerprint())
    with pytest.raises(HubFormatError, match=r"saved dataset has no 'train' split"):
        datasets.DatasetDict({"test": dd["test"]}).save_to_disk(str(tmp_path / "only_test"))
        source(tmp_path / "only_test").table("train")
    with pytest.raises(HubFormatError, match=r"missing column\(s\) \['body'\]"):
        HubDataset("Toy", "org/toy", saved, columns=("text", "body")).table("train")


def test_missing_column_names_the_file_and_its_columns(tmp_path: Path) -> None:
    class ToyFormatError(ValueError):
        pass

    for split in ROWS:
        write(tmp_path / f"{split}-00000-of-00001.parquet", ROWS[split])
    bad = write(tmp_path / "test-00000-of-00001.parquet", ["t"], label=[1])
    src = HubDataset(
        "Toy", "org/toy", tmp_path, columns=("body", "label"), format_error=ToyFormatError
    )
    with pytest.raises(ToyFormatError) as err:
        src.table("test")
    message = str(err.value)
    assert f"{bad}: missing column(s) ['body']" in message
    assert "has no column 'body'" in message and "['text', 'label']" in message
    assert "org/toy" in message
    bad.write_bytes(b"not parquet")
    with pytest.raises(HubFormatError, match=r"cannot read .* as parquet"):
        list(source(tmp_path).rows("test"))


def test_offline_message_names_dataset_url_paths_and_commands(tmp_path: Path) -> None:
    cfg = tmp_path / "wikitext" / "wikitext-103-v1"
    src = source(cfg, config="wikitext-103-v1", fetch_dir=".", command="megalab-data toy")
    with pytest.raises(DatasetMissingError) as err:
        src.require()  # the test suite runs offline
    message = str(err.value)
    assert "Dataset 'Toy' is not available" in message and "offline mode" in message
    assert "https://huggingface.co/datasets/org/toy" in message
    for name in ("train", "validation", "test"):
        assert f"  - {cfg / f'{name}-00000-of-00001.parquet'}\n" in message
    assert "`megalab-data toy`" in message
    assert (
        "huggingface-cli download org/toy --repo-type dataset --include 'wikitext-103-v1/*' "
        f"--local-dir {tmp_path / 'wikitext'}\n" in message
    )
    assert err.value.__cause__ is None and err.value.__suppress_context__

    write(cfg / "train-00000-of-00001.parquet", ["a"])
    with pytest.raises(DatasetMissingError) as err:
        src.require()
    message = str(err.value)
    assert "found for train but none for validation, test" in message
    assert str(cfg / "train-00000-of-00001.parquet") not in message
    with pytest.raises(DatasetMissingError, match=r"data\.download=false"):
        src.require(download=False)
    with pytest.raises(DatasetMissingError, match="no local copy of the validation split"):
        src.table("val")


def test_fingerprint_follows_the_files(tmp_path: Path) -> None:
    for split in ROWS:
        write(tmp_path / "data" / f"{split}-00000-of-00001.parquet", ROWS[split])
    src = source(tmp_path)
    first = src.fingerprint()
    assert [row[0] for row in first] == [
        "data/train-00000-of-00001.parquet",
        "data/validation-00000-of-00001.parquet",
        "data/test-00000-of-00001.parquet",
    ]
    assert src.fingerprint() == first
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "cache.bin").write_bytes(b"x")
    assert src.fingerprint() == first  # prepared caches are not sources
    path = write(tmp_path / "data" / "test-00000-of-00001.parquet", ["t", "changed"])
    changed = src.fingerprint()
    assert changed != first
    stat = path.stat()  # same size, other time: still a change
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert src.fingerprint() != changed
    write(tmp_path / "data" / "test-00001-of-00001.parquet", ["more"])
    assert len(src.fingerprint()) == 4


def test_fetch_whole_dataset_to_local_parquet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, online: None
) -> None:
    import datasets

    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        hub = {"train": ROWS["train"], "valid": ROWS["validation"], "test": ROWS["test"]}
        hub["unsupervised"] = ["u"]
        return datasets.DatasetDict(
            {s: datasets.Dataset.from_dict({"text": t}) for s, t in hub.items()}
        )

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    src = source(tmp_path / "toy", fetch_dir="plain_text")
    src.require(cache_dir=tmp_path / "hf")
    assert calls == [(("org/toy",), {"cache_dir": str(tmp_path / "hf")})]
    assert sorted(p.name for p in (tmp_path / "toy" / "plain_text").iterdir()) == [
        "test-00000-of-00001.parquet",
        "train-00000-of-00001.parquet",
        "validation-00000-of-00001.parquet",  # the Hub's `valid`, under our file name
    ]
    assert list(src.texts("val")) == ROWS["validation"]

    # Later runs read the local files: offline, and without calling the Hub.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src.require()
    assert len(calls) == 1

    # Only the missing split is fetched; the others stay as they are.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    (tmp_path / "toy" / "plain_text" / "test-00000-of-00001.parquet").unlink()
    kept = [f.stat().st_mtime_ns for s in ("train", "val") for f in src.files(s)]
    src.require()
    assert len(calls) == 2
    assert [f.stat().st_mtime_ns for s in ("train", "val") for f in src.files(s)] == kept
    assert list(src.texts("test")) == ROWS["test"]


def test_fetch_split_by_split_with_config_revision_and_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, online: None
) -> None:
    import datasets

    calls = []

    def load_dataset(name, config, split, revision=None):
        calls.append((name, config, split, revision))
        if revision is None:
            raise RuntimeError("Dataset scripts are no longer supported, but found toy.py")
        return datasets.Dataset.from_dict({"text": ROWS[split]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    src = source(tmp_path / "toy", config="cfg", load_per_split=True)
    src.require()
    assert ("org/toy", "cfg", "validation", "refs/convert/parquet") in calls
    assert {c[2] for c in calls} == {"train", "validation", "test"}
    assert (tmp_path / "toy" / "data" / "validation-00000-of-00001.parquet").is_file()
    assert list(src.texts("val")) == ROWS["validation"]

    def no_text(name, config, split, revision=None):
        return datasets.Dataset.from_dict({"body": ["x"]})

    monkeypatch.setattr(datasets, "load_dataset", no_text)
    other = source(tmp_path / "other", config="cfg", revision="main", load_per_split=True)
    with pytest.raises(HubFormatError, match=r"org/toy \(train\): missing column\(s\) \['text'\]"):
        other.require()
    assert not list((tmp_path / "other").rglob("*.parquet"))  # nothing half-fetched

    def unreachable(*args, **kwargs):
        raise ConnectionError("cannot reach huggingface.co")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DatasetMissingError) as err:
        source(tmp_path / "nowhere").require()
    assert "fetching from the Hub failed: ConnectionError: cannot reach" in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__
