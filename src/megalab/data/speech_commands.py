"""Speech Commands SC10 (Warden 2018, v0.02) as raw 16 kHz waveforms: reader, splits, DataModule.

The ten words yes, no, up, down, left, right, on, off, stop, go (label = index in that list, as
the Mega and S4 code) become `(L=16000, C=1)` float sequences. Two protocols:

- `mega` (Mega/S4/CKConv): only clips of exactly 16000 samples (34,975 in v0.02), split 70/15/15
  by a stratified shuffle with fixed seeds. :func:`stratified_split` reproduces sklearn's
  ``train_test_split(train_size=0.7, random_state=0, stratify=y)`` and the following 50/50 split
  with ``random_state=1`` index for index (same NumPy ``RandomState`` calls); the file list is
  sorted per class, so unlike the original `os.listdir` order the split is the same everywhere.
- `official`: the archive's `validation_list.txt`/`testing_list.txt`, every other clip for
  training; clips shorter than 16000 samples are zero-padded at the end.

Normalisation uses training-split statistics only: `per_step` (the code's behaviour: the raw
tensor is N x 1 x 16000 and its `normalise_data` iterates over the last axis, i.e. one mean/std
per time step), `global` (one scalar mean/std) or `none`; x <- (x - mean) / (std + eps), with
the unbiased std of `torch.std`.

`resolution` k keeps every k-th sample after normalisation (S4's `sr`: k = 2 is 8 kHz), giving
sequences of ceil(16000 / k) steps.

`prepare_data` downloads and extracts the archive (only the needed folders) and stores every clip
once as a memory-mapped int16 matrix keyed by its parameters and the file set
(:func:`megalab.data.cache.cache_dir`); `build_datasets` computes the split and the statistics.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from megalab.data import download as dl
from megalab.data.archives import extract
from megalab.data.base import SequenceDataModule
from megalab.data.cache import cache_dir, check_npy, check_range, mark_prepared, prepared
from megalab.utils.errors import UserError

log = logging.getLogger(__name__)

CLASSES = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
ARCHIVE_URL = "http://download.tensorflow.org/data/speech_commands_v0.02.tar.gz"
ARCHIVE_SHA256 = "af14739ee7dc311471de98f5f9d2c9191b18aedfe957f4a6ff791c709868ff58"
ARCHIVE_NAME = "speech_commands_v0.02.tar.gz"
RAW_DIRNAME = "speech_commands_v0.02"
LIST_FILES = ("validation_list.txt", "testing_list.txt")
SAMPLE_RATE = 16_000
CLIP_LENGTH = 16_000
#: Full-length clips of the ten words in v0.02 (asserted by the S4/Mega code).
MEGA_NUM_CLIPS = 34_975
PROTOCOLS = ("mega", "official")
NORMALIZATIONS = ("per_step", "global", "none")
SPLITS = ("train", "val", "test")
_CACHE_VERSION = 1


class SpeechCommandsFormatError(UserError, ValueError):
    """A Speech Commands file or split that cannot be used; the message names it."""


# ---------------------------------------------------------------------------------------------
# Stratified split (sklearn-equivalent)
# ---------------------------------------------------------------------------------------------
def _approximate_mode(counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """Per-class draws closest to proportional, ties broken at random (sklearn's helper)."""
    continuous = counts / counts.sum() * n_draws
    floored = np.floor(continuous)
    need = int(n_draws - floored.sum())
    if need > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need)
            inds = rng.choice(inds, size=add_now, replace=False)
            floored[inds] += 1
            need -= add_now
            if need == 0:
                break
    return floored.astype(int)


def stratified_split(
    labels: Sequence[int] | np.ndarray, train_size: float, random_state: int
) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, rest) of a stratified shuffle split, in sklearn's order.

    Equivalent to ``sklearn.model_selection.train_test_split(np.arange(n), train_size=...,
    random_state=..., shuffle=True, stratify=labels)``: n_train = floor(train_size * n), the
    same per-class allocation and tie-breaking, and the same sequence of ``RandomState`` draws,
    so the returned index arrays are identical (checked against scikit-learn 1.9).
    """
    y = np.asarray(labels)
    n = len(y)
    n_train = int(np.floor(train_size * n))
    n_test = n - n_train
    classes, y_idx, counts = np.unique(y, return_inverse=True, return_counts=True)
    if len(classes) and counts.min() < 2:
        raise ValueError(
            f"stratified split needs at least 2 examples per class; classes "
            f"{classes[counts < 2].tolist()} have fewer"
        )
    if n_train < len(classes) or n_test < len(classes):
        raise ValueError(
            f"stratified split of {n} examples into {n_train}/{n_test} cannot hold each of "
            f"the {len(classes)} classes on both sides"
        )
    class_indices = np.split(np.argsort(y_idx, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(random_state)
    n_i = _approximate_mode(counts, n_train, rng)
    t_i = _approximate_mode(counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i in range(len(classes)):
        perm = class_indices[i].take(rng.permutation(counts[i]), mode="clip")
        train.extend(perm[: n_i[i]])
        test.extend(perm[n_i[i] : n_i[i] + t_i[i]])
    return rng.permutation(np.asarray(train, dtype=np.int64)), rng.permutation(
        np.asarray(test, dtype=np.int64)
    )


def mega_split(labels: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """The S4/Mega 70/15/15 split: (0.7, seed 0), then the rest 50/50 with seed 1."""
    y = np.asarray(labels)
    train, rest = stratified_split(y, 0.7, random_state=0)
    val, test = stratified_split(y[rest], 0.5, random_state=1)
    return {"train": train, "val": rest[val], "test": rest[test]}


# ---------------------------------------------------------------------------------------------
# Reading the archive's tree
# ---------------------------------------------------------------------------------------------
def list_clips(raw_dir: str | Path, classes: Sequence[str] = CLASSES) -> list[tuple[str, int]]:
    """(`word/file.wav`, label) for every WAV of the given words, sorted by name within a word.

    Sorting makes the order (and so the split) independent of the file system's listing order.
    """
    raw_dir = Path(raw_dir)
    out: list[tuple[str, int]] = []
    for label, word in enumerate(classes):
        folder = raw_dir / word
        if not folder.is_dir():
            raise SpeechCommandsFormatError(
                f"{folder} is missing: the Speech Commands tree must hold one folder per word "
                f"({', '.join(classes)}); re-extract {ARCHIVE_NAME} into {raw_dir}"
            )
        names = sorted(n for n in os.listdir(folder) if n.lower().endswith(".wav"))
        if not names:
            raise SpeechCommandsFormatError(f"{folder} holds no .wav files")
        out.extend((f"{word}/{name}", label) for name in names)
    return out


def read_wav(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A mono 16-bit WAV as int16 samples; errors name the file and what is wrong with it."""
    import soundfile as sf

    try:
        data, rate = sf.read(str(path), dtype="int16", always_2d=True)
    except Exception as e:  # libsndfile's errors: not audio, truncated, unknown format
        raise SpeechCommandsFormatError(
            f"{path}: cannot read it as a WAV file ({e}); the file is damaged or not audio. "
            "Delete it or re-extract the archive"
        ) from e
    if rate != sample_rate:
        raise SpeechCommandsFormatError(
            f"{path}: sample rate {rate} Hz, expected {sample_rate} Hz (Speech Commands clips "
            "are 16 kHz); resample the file or remove it"
        )
    if data.shape[1] != 1:
        raise SpeechCommandsFormatError(f"{path}: {data.shape[1]} channels, expected mono")
    return data[:, 0]


def files_digest(raw_dir: str | Path, clips: Sequence[tuple[str, int]]) -> str:
    """A digest of the clip list (names, labels, sizes): a changed file set re-prepares."""
    h = hashlib.sha256()
    for rel, label in clips:
        size = (Path(raw_dir) / rel).stat().st_size
        h.update(f"{rel}\t{label}\t{size}\n".encode())
    return h.hexdigest()[:16]


def write_waveform_cache(
    raw_dir: str | Path,
    out_dir: str | Path,
    clips: Sequence[tuple[str, int]],
    clip_length: int = CLIP_LENGTH,
    sample_rate: int = SAMPLE_RATE,
) -> None:
    """Store every clip as a row of `waves.npy` (int16, zero-padded to `clip_length`).

    `lengths.npy` keeps each clip's true length (the `mega` protocol keeps only full-length
    clips), `labels.npy` the labels and `files.txt` the relative paths, one per row.
    """
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    n = len(clips)
    waves = np.lib.format.open_memmap(
        out_dir / "waves.npy", mode="w+", dtype=np.int16, shape=(n, clip_length)
    )
    lengths = np.zeros(n, dtype=np.int64)
    for i, (rel, _) in enumerate(clips):
        x = read_wav(raw_dir / rel, sample_rate)
        lengths[i] = len(x)
        k = min(len(x), clip_length)
        waves[i, :k] = x[:k]
        waves[i, k:] = 0
    waves.flush()
    del waves
    np.save(out_dir / "lengths.npy", lengths)
    np.save(out_dir / "labels.npy", np.asarray([label for _, label in clips], dtype=np.int64))
    (out_dir / "files.txt").write_text("".join(f"{rel}\n" for rel, _ in clips))


def _read_list(path: Path) -> set[str]:
    return {line.strip() for line in path.read_text().splitlines() if line.strip()}


def official_split(raw_dir: str | Path, files: Sequence[str]) -> dict[str, np.ndarray]:
    """Row indices per split from `validation_list.txt`/`testing_list.txt` (rest: train)."""
    raw_dir = Path(raw_dir)
    val_list, test_list = (_read_list(raw_dir / name) for name in LIST_FILES)
    both = val_list & test_list
    if both:
        raise SpeechCommandsFormatError(
            f"{len(both)} clip(s) are in both {LIST_FILES[0]} and {LIST_FILES[1]} in {raw_dir}, "
            f"e.g. {sorted(both)[0]}"
        )
    which = np.array(
        [2 if f in test_list else 1 if f in val_list else 0 for f in files], dtype=np.int64
    )
    return {split: np.flatnonzero(which == k) for k, split in enumerate(SPLITS)}


# ---------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------
class Waveforms(Dataset):
    """Rows of the int16 waveform cache, normalised on access to (L, 1) float32 sequences.

    The memory map is opened lazily in each process (a pickled dataset carries only its path).
    """

    def __init__(
        self,
        path: str | Path,
        rows: np.ndarray,
        labels: np.ndarray,
        mean: np.ndarray,
        std: np.ndarray,
        eps: float,
        amplitude_scale: float = 1.0,
        resolution: int = 1,
    ) -> None:
        self.path = Path(path)
        self.resolution = resolution
        self.rows = np.asarray(rows, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)
        # x = (w / 32768 * scale - mean) / (std + eps) = w * a + b
        denom = np.asarray(std, dtype=np.float64) + eps
        self.a = (amplitude_scale / 32768.0 / denom).astype(np.float32)
        self.b = (-np.asarray(mean, dtype=np.float64) / denom).astype(np.float32)
        if resolution > 1:  # every resolution-th sample, normalised at the full rate (S4's `sr`)
            self.a, self.b = self.a[::resolution], self.b[::resolution]
        self._waves: np.ndarray | None = None

    def waves(self) -> np.ndarray:
        if self._waves is None:
            self._waves = np.load(self.path, mmap_mode="r")
        return self._waves

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_waves": None}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        w = np.asarray(self.waves()[self.rows[i], :: self.resolution], dtype=np.float32)
        x = w * self.a + self.b
        return {"inputs": torch.from_numpy(x).unsqueeze(-1), "targets": int(self.labels[i])}


def train_statistics(
    waves: np.ndarray,
    rows: np.ndarray,
    normalization: str,
    amplitude_scale: float = 1.0,
    block: int = 1024,
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and unbiased std of the training rows (float64): per time step or one scalar."""
    L = waves.shape[1]
    if normalization == "none":
        return np.zeros(1), np.ones(1)
    if len(rows) < 2:
        raise SpeechCommandsFormatError("normalisation needs at least 2 training clips")
    total = np.zeros(L)
    total_sq = np.zeros(L)
    order = np.sort(rows)  # sequential reads of the memory map
    for a in range(0, len(order), block):
        x = waves[order[a : a + block]].astype(np.float64) * (amplitude_scale / 32768.0)
        total += x.sum(axis=0)
        total_sq += np.square(x).sum(axis=0)
    n = len(rows)
    if normalization == "global":
        n, total, total_sq = n * L, np.array([total.sum()]), np.array([total_sq.sum()])
    mean = total / n
    var = np.maximum(total_sq - n * mean**2, 0.0) / (n - 1)
    return mean, np.sqrt(var)


# ---------------------------------------------------------------------------------------------
# DataModule
# ---------------------------------------------------------------------------------------------
class SpeechCommandsDataModule(SequenceDataModule):
    """Speech Commands SC10, raw waveforms `(16000, 1)`, `mega` or `official` protocol.

    `clip_length` is the clip length in samples, `resolution` the subsampling step and
    `max_len` = ceil(clip_length / resolution) the sequence length models see.

    Files live under `data_dir`: the archive `speech_commands_v0.02.tar.gz`, its extracted tree
    `speech_commands_v0.02/` (a tree extracted elsewhere can be put there instead) and the
    prepared cache `prepared/`.
    """

    def __init__(
        self,
        data_dir: str | Path,
        protocol: str = "mega",
        max_len: int = CLIP_LENGTH,
        clip_length: int = CLIP_LENGTH,
        resolution: int = 1,
        classes: Sequence[str] = CLASSES,
        normalization: str = "per_step",
        eps: float = 1e-5,
        amplitude_scale: float = 1.0,
        sample_rate: int = SAMPLE_RATE,
        download: bool = True,
        url: str = ARCHIVE_URL,
        sha256: str | None = ARCHIVE_SHA256,
        **kwargs: Any,
    ) -> None:
        classes = tuple(classes)
        kwargs.setdefault("d_input", 1)
        kwargs.setdefault("num_classes", len(classes))
        super().__init__(data_dir=data_dir, max_len=max_len, **kwargs)
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown Speech Commands protocol {protocol!r}; use {PROTOCOLS}")
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"unknown normalization {normalization!r}; use {NORMALIZATIONS}")
        if self.spec.d_input != 1:
            raise ValueError(f"raw Speech Commands has d_input 1, config says {self.spec.d_input}")
        if self.spec.num_classes != len(classes):
            raise ValueError(
                f"{len(classes)} words give {len(classes)} classes, config says num_classes="
                f"{self.spec.num_classes}"
            )
        if self.spec.vocab_size is not None:
            raise ValueError("Speech Commands waveforms are real-valued: set vocab_size: null")
        if resolution < 1 or max_len != -(-clip_length // resolution):
            raise ValueError(
                f"clips of {clip_length} samples at resolution {resolution} are "
                f"{-(-clip_length // max(resolution, 1))} steps long, but max_len={max_len}: set "
                "data.max_len = ceil(clip_length / resolution)"
            )
        self.clip_length = clip_length
        self.resolution = resolution
        self.protocol = protocol
        self.classes = classes
        self.normalization = normalization
        self.eps = eps
        self.amplitude_scale = amplitude_scale
        self.sample_rate = sample_rate
        self.download = download
        self.url = url
        self.sha256 = sha256
        self.stats: dict[str, np.ndarray] = {}

    # -- locations ------------------------------------------------------------------------------
    @property
    def raw_dir(self) -> Path:
        return self.data_dir / RAW_DIRNAME

    @property
    def archive(self) -> Path:
        return self.data_dir / ARCHIVE_NAME

    def _have_tree(self) -> bool:
        needed = [self.raw_dir / w for w in self.classes]
        if self.protocol == "official":
            needed += [self.raw_dir / name for name in LIST_FILES]
        return all(p.exists() for p in needed)

    def cache_path(self, clips: Sequence[tuple[str, int]] | None = None) -> Path:
        """The prepared-cache folder for these parameters and this file set."""
        clips = list_clips(self.raw_dir, self.classes) if clips is None else clips
        params = {
            "classes": list(self.classes),
            "clip_length": self.clip_length,
            "sample_rate": self.sample_rate,
            "files": files_digest(self.raw_dir, clips),
        }
        return cache_dir(self.cache_root, "waveforms", params, version=_CACHE_VERSION)

    # -- Lightning ------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Download and extract the archive if needed, then cache the waveforms (rank 0)."""
        if not self._have_tree():
            self._fetch()
        clips = list_clips(self.raw_dir, self.classes)
        out = self.cache_path(clips)
        if prepared(out):
            return
        log.info("reading %d Speech Commands clips from %s", len(clips), self.raw_dir)
        write_waveform_cache(self.raw_dir, out, clips, self.clip_length, self.sample_rate)
        mark_prepared(out, {"clips": len(clips)})

    def _fetch(self) -> None:
        how = (
            f"Run `megalab-data sc10 --root <data root>` to download and prepare it, or download\n"
            f"{self.url}\nand save it as {self.archive} (it is extracted on first use); an "
            f"already extracted\ntree can be placed at {self.raw_dir} instead."
        )
        if not self.archive.exists():
            if not self.download:
                dl.require_files(
                    [self.archive],
                    dataset="Speech Commands v0.02",
                    how=how,
                    url=self.url,
                    data_dir=self.data_dir,
                )
            dl.download(self.url, self.archive, sha256=self.sha256, dataset="Speech Commands v0.02")
        members = [*self.classes, *LIST_FILES]
        log.info("extracting %s into %s", self.archive, self.raw_dir)
        extract(self.archive, self.raw_dir, members=members)
        if not self._have_tree():
            missing = [m for m in members if not (self.raw_dir / m).exists()]
            raise SpeechCommandsFormatError(
                f"{self.archive} does not contain {', '.join(missing)}: it is not the Speech "
                f"Commands v0.02 archive ({self.url})"
            )

    def build_datasets(self) -> dict[str, Waveforms]:
        if not self._have_tree():
            dl.require_files(
                [self.raw_dir / w for w in self.classes]
                + ([self.raw_dir / n for n in LIST_FILES] if self.protocol == "official" else []),
                dataset="Speech Commands v0.02",
                how=f"Run `megalab-data sc10 --root <data root>` (or the DataModule's "
                f"prepare_data) to download {ARCHIVE_NAME} and extract it into {self.raw_dir}.",
                url=self.url,
                data_dir=self.data_dir,
            )
        clips = list_clips(self.raw_dir, self.classes)
        cache = self.cache_path(clips)
        if not prepared(cache):
            raise FileNotFoundError(
                f"the prepared Speech Commands cache {cache} is missing or incomplete: call "
                f"prepare_data() first, or run `megalab-data sc10 --root {self.data_dir.parent}`"
            )

        check_npy(cache / "waves.npy", np.int16, 2, cache)
        check_npy(cache / "lengths.npy", np.int64, 1, cache)
        check_npy(cache / "labels.npy", np.int64, 1, cache)
        waves = np.load(cache / "waves.npy", mmap_mode="r")
        lengths = np.load(cache / "lengths.npy")
        labels = np.load(cache / "labels.npy")
        check_range(labels, 0, len(self.classes), "label", cache / "labels.npy", cache)
        files = [rel for rel, _ in clips]
        splits = self.split_rows(files, labels, lengths)
        mean, std = train_statistics(
            waves, splits["train"], self.normalization, self.amplitude_scale
        )
        self.stats = {"mean": mean, "std": std}
        return {
            split: Waveforms(
                cache / "waves.npy",
                rows,
                labels[rows],
                mean,
                std,
                self.eps,
                self.amplitude_scale,
                self.resolution,
            )
            for split, rows in splits.items()
        }

    def split_rows(
        self, files: Sequence[str], labels: np.ndarray, lengths: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Cache rows of each split under this module's protocol."""
        L = self.clip_length
        if self.protocol == "mega":
            full = np.flatnonzero(lengths == L)
            if len(full) != MEGA_NUM_CLIPS:
                log.warning(
                    "found %d full-length clips in %s; Speech Commands v0.02 has %d, so this "
                    "split differs from the published one",
                    len(full),
                    self.raw_dir,
                    MEGA_NUM_CLIPS,
                )
            try:
                parts = mega_split(labels[full])
            except ValueError as e:
                raise SpeechCommandsFormatError(
                    f"cannot split the {len(full)} full-length ({L}-sample) clips in "
                    f"{self.raw_dir} 70/15/15 by class: {e}"
                ) from e
            return {split: full[idx] for split, idx in parts.items()}
        long = np.flatnonzero(lengths > L)
        if len(long):
            raise SpeechCommandsFormatError(
                f"{self.raw_dir / files[long[0]]} has {lengths[long[0]]} samples, more than "
                f"the clip length {L} (and {len(long) - 1} more); the official protocol pads "
                "shorter clips but does not cut longer ones"
            )
        parts = official_split(self.raw_dir, files)
        for split, rows in parts.items():
            if len(rows) == 0:
                source = {
                    "train": "the word folders (every clip is in a list)",
                    "val": str(self.raw_dir / LIST_FILES[0]),
                    "test": str(self.raw_dir / LIST_FILES[1]),
                }[split]
                raise SpeechCommandsFormatError(
                    f"the official {split} split of {', '.join(self.classes)} is empty: no clip "
                    f"of these words is assigned to it by {source}"
                )
        return parts
