"""Speech Commands SC10: classes, the two protocols, the sklearn-equivalent split, statistics,
independence from listing order, and clear errors for malformed or missing data."""

from __future__ import annotations

import os
import random
import tarfile
import wave
from pathlib import Path

import numpy as np
import pytest

from megalab.data.download import DatasetMissingError
from megalab.data.speech_commands import (
    ARCHIVE_NAME,
    ARCHIVE_URL,
    CLASSES,
    RAW_DIRNAME,
    SpeechCommandsDataModule,
    SpeechCommandsFormatError,
    mega_split,
    stratified_split,
)
from megalab.testing.speech_commands import (
    EXTRA_WORD,
    FULL_PER_WORD,
    SHORT_LENGTH,
    write_tree,
    write_wav,
)

N_FULL = 10 * FULL_PER_WORD


def make_tree(root: Path, **kwargs) -> Path:
    """A fixture tree in `root/speech_commands_v0.02`; returns the DataModule's data_dir."""
    write_tree(root / RAW_DIRNAME, **kwargs)
    return root


def module(data_dir: Path, **kwargs) -> SpeechCommandsDataModule:
    dm = SpeechCommandsDataModule(data_dir, batch_size=4, **kwargs)
    dm.prepare_data()
    dm.setup()
    return dm


def split_files(dm: SpeechCommandsDataModule) -> dict[str, list[str]]:
    cache = dm.cache_path()
    names = (cache / "files.txt").read_text().split()
    return {s: [names[r] for r in ds.rows] for s, ds in dm.datasets.items()}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("sc"))


# --------------------------------------------------------------------------- split
def test_stratified_split_reproduces_sklearn() -> None:
    """Golden indices from scikit-learn 1.9: train_test_split(arange(40), train_size=0.7,
    random_state=0, stratify=y), then the rest with train_size=0.5, random_state=1."""
    y = np.array([0, 1, 2, 3, 0, 1, 3, 3, 2, 0, 1, 3, 0, 2, 3, 1, 0, 3, 2, 1,
                  2, 0, 1, 3, 2, 0, 1, 3, 2, 1, 0, 3, 3, 2, 1, 0, 2, 1, 0, 3])  # fmt: skip
    parts = mega_split(y)
    assert parts["train"].tolist() == [1, 20, 23, 6, 17, 8, 30, 22, 25, 4, 18, 27, 13, 34, 7,
                                       16, 37, 38, 10, 39, 5, 35, 9, 15, 24, 3, 11, 2]  # fmt: skip
    assert parts["val"].tolist() == [33, 12, 19, 36, 32, 14]
    assert parts["test"].tolist() == [21, 31, 29, 0, 26, 28]


def test_stratified_split_against_installed_sklearn() -> None:
    from sklearn import model_selection as sklearn_split  # a dev dependency, not a runtime one

    rng = np.random.RandomState(0)
    for _ in range(20):
        y = rng.randint(0, rng.randint(2, 8), size=rng.randint(30, 200))
        if np.bincount(y).min() < 2:
            continue
        a, b = sklearn_split.train_test_split(
            np.arange(len(y)), train_size=0.7, random_state=3, stratify=y
        )
        c, d = stratified_split(y, 0.7, 3)
        assert np.array_equal(a, c) and np.array_equal(b, d)


def test_split_sizes_for_the_real_count() -> None:
    """34,975 clips give the published 24,482 / 5,246 / 5,247."""
    y = np.repeat(np.arange(10), [3500] * 9 + [34_975 - 9 * 3500])
    parts = mega_split(y)
    assert [len(parts[s]) for s in ("train", "val", "test")] == [24_482, 5_246, 5_247]


def test_stratified_split_rejects_singleton_class() -> None:
    with pytest.raises(ValueError, match="at least 2 examples per class"):
        stratified_split([0, 0, 0, 1, 2, 2], 0.5, 0)


# --------------------------------------------------------------------------- mega protocol
def test_classes_and_labels(tree: Path) -> None:
    assert CLASSES == ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
    dm = module(tree)
    assert dm.num_classes == 10 and dm.spec.d_input == 1 and dm.spec.vocab_size is None
    files = split_files(dm)
    every = [f for fs in files.values() for f in fs]
    assert not any(f.startswith((EXTRA_WORD, "_background_noise_")) for f in every)
    for split, ds in dm.datasets.items():
        for f, label in zip(files[split], ds.labels):
            assert CLASSES[label] == f.split("/")[0]


def test_mega_protocol_keeps_full_length_clips_and_stratifies(tree: Path) -> None:
    dm = module(tree, protocol="mega")
    sizes = {s: len(ds) for s, ds in dm.datasets.items()}
    assert sizes == {"train": 56, "val": 12, "test": 12}  # floor(0.7 * 80), then 12 / 12
    files = split_files(dm)
    every = [f for fs in files.values() for f in fs]
    assert len(set(every)) == len(every) == N_FULL  # disjoint and complete
    cache = dm.cache_path()
    lengths = np.load(cache / "lengths.npy")
    for ds in dm.datasets.values():
        assert (lengths[ds.rows] == 16_000).all()
    for split, ds in dm.datasets.items():  # each class in proportion, within one clip
        counts = np.bincount(ds.labels, minlength=10)
        expected = sizes[split] / 10
        assert (np.abs(counts - expected) < 1).all(), (split, counts)
    item = dm.datasets["train"][0]
    assert item["inputs"].shape == (16_000, 1) and item["inputs"].dtype.is_floating_point


def test_split_does_not_depend_on_directory_order(tmp_path: Path, monkeypatch) -> None:
    a = make_tree(tmp_path / "a")
    b = make_tree(tmp_path / "b")
    dm_a = module(a)
    real_listdir = os.listdir

    def shuffled(path="."):
        names = real_listdir(path)
        random.Random(str(path)).shuffle(names)
        return names[::-1]

    monkeypatch.setattr(os, "listdir", shuffled)
    dm_b = module(b)
    assert split_files(dm_a) == split_files(dm_b)
    for split in ("train", "val", "test"):
        x_a, x_b = dm_a.datasets[split][3]["inputs"], dm_b.datasets[split][3]["inputs"]
        assert np.array_equal(x_a.numpy(), x_b.numpy())


def test_normalisation_statistics_come_from_train_only(tree: Path) -> None:
    dm = module(tree, normalization="per_step")
    waves = np.load(dm.cache_path() / "waves.npy")
    train = waves[dm.datasets["train"].rows].astype(np.float64) / 32768
    every = waves[np.concatenate([ds.rows for ds in dm.datasets.values()])] / 32768
    np.testing.assert_allclose(dm.stats["mean"], train.mean(0), atol=1e-12)
    np.testing.assert_allclose(dm.stats["std"], train.std(0, ddof=1), rtol=1e-9)
    assert not np.allclose(dm.stats["mean"], every.mean(0))
    x = dm.datasets["val"][0]["inputs"][:, 0].numpy()
    row = dm.datasets["val"].rows[0]
    expected = (waves[row] / 32768 - train.mean(0)) / (train.std(0, ddof=1) + 1e-5)
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-5)

    g = module(tree, normalization="global")
    assert g.stats["mean"].shape == (1,)
    np.testing.assert_allclose(g.stats["std"][0], train.std(ddof=1), rtol=1e-9)


def test_resolution_subsamples_normalised_clips(tree: Path) -> None:
    full = module(tree)
    half = module(tree, resolution=2, max_len=8000)
    x, y = full.datasets["test"][5]["inputs"], half.datasets["test"][5]["inputs"]
    assert y.shape == (8000, 1)
    assert np.array_equal(x[::2].numpy(), y.numpy())
    with pytest.raises(ValueError, match=r"max_len = ceil\(clip_length / resolution\)"):
        SpeechCommandsDataModule(tree, resolution=2)


# --------------------------------------------------------------------------- official protocol
def test_official_protocol_uses_the_lists_and_pads(tree: Path) -> None:
    dm = module(tree, protocol="official")
    raw = tree / RAW_DIRNAME
    files = split_files(dm)
    val_list = set((raw / "validation_list.txt").read_text().split())
    test_list = set((raw / "testing_list.txt").read_text().split())
    in_sc10 = lambda names: {n for n in names if n.split("/")[0] in CLASSES}  # noqa: E731
    assert set(files["val"]) == in_sc10(val_list)
    assert set(files["test"]) == in_sc10(test_list)
    assert not set(files["train"]) & (val_list | test_list)
    every = [f for fs in files.values() for f in fs]
    assert len(every) == N_FULL + 3  # the short clips are kept
    waves = np.load(dm.cache_path() / "waves.npy")
    lengths = np.load(dm.cache_path() / "lengths.npy")
    short = np.flatnonzero(lengths == SHORT_LENGTH)
    assert len(short) == 3 and (waves[short, SHORT_LENGTH:] == 0).all()
    assert (waves[short, :SHORT_LENGTH] != 0).any()
    split_of_short = [s for s, ds in dm.datasets.items() for r in ds.rows if r in short]
    assert len(split_of_short) == 3
    for ds in dm.datasets.values():
        assert ds[0]["inputs"].shape == (16_000, 1)


# --------------------------------------------------------------------------- malformed data
def test_unreadable_wav_names_the_file(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    bad = root / RAW_DIRNAME / "up" / "ffff0000_nohash_0.wav"
    bad.write_bytes(b"RIFF\x00\x00 not a wave file")
    with pytest.raises(SpeechCommandsFormatError, match=r"ffff0000_nohash_0\.wav.*cannot read"):
        SpeechCommandsDataModule(root).prepare_data()


def test_wrong_sample_rate_names_the_file(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    bad = root / RAW_DIRNAME / "go" / "eeee0000_nohash_0.wav"
    write_wav(bad, np.zeros(8000, dtype=np.int16), rate=8000)
    with wave.open(str(bad)) as f:
        assert f.getframerate() == 8000
    with pytest.raises(SpeechCommandsFormatError, match=r"eeee0000_nohash_0.wav: sample rate 8000"):
        SpeechCommandsDataModule(root).prepare_data()


def test_empty_official_split_is_an_error(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    (root / RAW_DIRNAME / "testing_list.txt").write_text("bed/0000000a_nohash_0.wav\n")
    dm = SpeechCommandsDataModule(root, protocol="official")
    dm.prepare_data()
    with pytest.raises(SpeechCommandsFormatError, match=r"test split .* empty.*testing_list.txt"):
        dm.setup()


def test_too_few_full_length_clips_is_an_error(tmp_path: Path) -> None:
    root = make_tree(tmp_path, full_per_word=1, short_words={})
    dm = SpeechCommandsDataModule(root)
    dm.prepare_data()
    with pytest.raises(SpeechCommandsFormatError, match="cannot split the 10 full-length"):
        dm.setup()


def test_missing_word_folder_is_an_error(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    for f in (root / RAW_DIRNAME / "left").iterdir():
        f.unlink()
    with pytest.raises(SpeechCommandsFormatError, match=r"left holds no \.wav files"):
        SpeechCommandsDataModule(root).prepare_data()


def test_bad_settings_fail_early(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="protocol"):
        SpeechCommandsDataModule(tmp_path, protocol="kaggle")
    with pytest.raises(ValueError, match="num_classes"):
        SpeechCommandsDataModule(tmp_path, num_classes=35)
    with pytest.raises(ValueError, match="normalization"):
        SpeechCommandsDataModule(tmp_path, normalization="minmax")


# --------------------------------------------------------------------------- missing data
def test_offline_without_data_names_the_archive_and_data_dir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEGALAB_OFFLINE", "1")
    dm = SpeechCommandsDataModule(tmp_path / "speech_commands")
    with pytest.raises(DatasetMissingError) as info:
        dm.prepare_data()
    msg = str(info.value)
    assert ARCHIVE_URL in msg and str(tmp_path / "speech_commands" / ARCHIVE_NAME) in msg
    assert "paths.data_dir" in msg


def test_no_download_and_no_data_explains(tmp_path: Path) -> None:
    dm = SpeechCommandsDataModule(tmp_path, download=False)
    with pytest.raises(DatasetMissingError, match="megalab-data sc10"):
        dm.prepare_data()
    with pytest.raises(DatasetMissingError, match=r"paths\.data_dir"):
        dm.setup()


def test_archive_from_a_local_mirror_is_downloaded_and_extracted(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src") / RAW_DIRNAME
    mirror = tmp_path / "mirror" / ARCHIVE_NAME
    mirror.parent.mkdir()
    with tarfile.open(mirror, "w:gz") as tf:  # the real archive has no top-level folder
        for p in sorted(src.rglob("*")):
            tf.add(p, arcname="./" + p.relative_to(src).as_posix(), recursive=False)
    data_dir = tmp_path / "data"
    dm = module(data_dir, url=mirror.as_uri(), sha256=None)
    assert (data_dir / ARCHIVE_NAME).exists()
    assert not (data_dir / RAW_DIRNAME / "_background_noise_").exists()  # only what SC10 needs
    assert {s: len(ds) for s, ds in dm.datasets.items()} == {"train": 56, "val": 12, "test": 12}


def test_cli_prepares_and_reports(tmp_path: Path, capsys) -> None:
    from megalab.cli.data import main

    make_tree(tmp_path / "speech_commands")
    assert main(["sc10", "--root", str(tmp_path), "--protocol", "official"]) == 0
    out = capsys.readouterr().out
    assert "official" in out and "train" in out
