"""LRA Pathfinder (32x32) and Path-X (128x128): are the two dots joined by one dashed path?

Files are the LRA release's (``megalab-data lra --task pathfinder|pathx``) or our generator's
(``megalab-data pathfinder``, :mod:`megalab.data.lra.pathfinder_gen`), in the same layout::

    <data_dir>/pathfinder{32,128}/curv_contour_length_14/metadata/<n>.npy
    <data_dir>/pathfinder{32,128}/curv_contour_length_14/imgs/<n>/sample_<i>.png

Despite the suffix, each metadata file is text, one image per line with space-separated fields
``imgs/<n> sample_<i>.png <i> <label> ...``: directory, file name, and the label at index 3.

Protocol (the Mega code's ``data_process.py``, identical to S4's):

- only the hardest difficulty, ``curv_contour_length_14``;
- samples in order: metadata files sorted by their integer name, lines in file order, minus
  the release's one known-empty image (``pathfinder32/curv_baseline/imgs/0/sample_172.png``,
  a difficulty we do not read; the blacklist is configurable);
- split 80/10/10 with ``random_split(data, [n - 2k, k, k], Generator().manual_seed(42))``
  where ``k = int(0.1 n)``: reproduced exactly, so the release gives the same train/val/test
  membership as those scripts (~160K/20K/20K);
- pixels as PIL grayscale, row-major, ``(x / 255 - 0.5) / 0.5`` in [-1, 1] (mean and std are
  settings); a ``(1024, 1)`` or ``(16384, 1)`` float sequence per image.

Malformed data fails early with the file (and line): a metadata line with too few fields, a
label that is not 0/1, a line pointing to a missing image, a truncated or unreadable PNG, an
image of the wrong size.

Without the files, ``generate_if_missing: true`` runs our generator for ``generator_samples``
images first (offline; the default is off, since the benchmark's size is 200K images). Decoded
pixels are prepared once (rank 0) as a ``uint8`` array under ``<data_dir>/prepared/``
(200 MB for Pathfinder, 3.3 GB for Path-X at the release's size), keyed by the metadata files.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from megalab.data.base import SequenceDataModule
from megalab.data.cache import cache_dir, fresh_cache, mark_prepared, prepared
from megalab.data.download import require_files
from megalab.data.lra.image import PixelSequences, load_pixels, random_split_indices
from megalab.data.lra.release import (
    RELEASE_PAGE,
    LRAFormatError,
    binary_label,
    data_root_of,
    release_how,
)

log = logging.getLogger(__name__)

DIFFICULTY = "curv_contour_length_14"
BLACKLIST = ("pathfinder32/curv_baseline/imgs/0/sample_172.png",)
NUM_CLASSES = 2
MEAN, STD = 0.5, 0.5
_CACHE_VERSION = 1


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def difficulty_dir(data_dir: str | os.PathLike[str], resolution: int, difficulty: str) -> Path:
    """``<data_dir>/pathfinder<resolution>/<difficulty>``."""
    return Path(data_dir).expanduser() / f"pathfinder{resolution}" / difficulty


def metadata_files(folder: Path) -> list[Path]:
    """``metadata/*.npy`` sorted by their integer names (the order the reference scripts use)."""
    files = list((folder / "metadata").glob("*.npy"))
    bad = [f for f in files if not re.fullmatch(r"\d+", f.stem)]
    if bad:
        raise LRAFormatError(
            f"{bad[0]}: metadata files are named <integer>.npy (the release's layout)"
        )
    return sorted(files, key=lambda f: int(f.stem))


def read_metadata(
    data_dir: str | os.PathLike[str],
    resolution: int,
    difficulty: str = DIFFICULTY,
    blacklist: Iterable[str] = BLACKLIST,
) -> list[tuple[Path, int]]:
    """``(image path, label)`` of every sample, in the reference order; checks every line."""
    folder = difficulty_dir(data_dir, resolution, difficulty)
    skip = set(blacklist)
    samples: list[tuple[Path, int]] = []
    for meta in metadata_files(folder):
        with meta.open() as f:
            for lineno, line in enumerate(f, start=1):
                fields = line.split()
                if not fields:
                    continue
                if len(fields) < 4:
                    raise LRAFormatError(
                        f"{meta}:{lineno}: expected at least 4 space-separated fields "
                        f"(directory, file, index, label), got {len(fields)}"
                    )
                label = binary_label(fields[3], f"{meta}:{lineno}")
                rel = Path(difficulty) / fields[0] / fields[1]
                if f"pathfinder{resolution}/{rel.as_posix()}" in skip:
                    continue
                path = folder.parent / rel
                if not path.is_file():
                    raise LRAFormatError(f"{meta}:{lineno}: image {path} does not exist")
                samples.append((path, label))
    return samples


def load_gray(path: Path, resolution: int) -> np.ndarray:
    """One image as row-major ``uint8`` grayscale; unreadable or wrong-size files fail loudly."""
    try:
        with Image.open(path) as im:
            im.load()
            gray = im.convert("L")
    except (OSError, SyntaxError, ValueError) as e:
        raise LRAFormatError(
            f"{path}: cannot read the image ({e}); the file is truncated or corrupt: extract "
            "or generate it again"
        ) from None
    if gray.size != (resolution, resolution):
        raise LRAFormatError(
            f"{path}: image is {gray.size[0]}x{gray.size[1]}, expected {resolution}x{resolution}"
        )
    return np.asarray(gray, dtype=np.uint8).reshape(-1)


class PathfinderDataModule(SequenceDataModule):
    """LRA Pathfinder (``resolution: 32``) and Path-X (``resolution: 128``)."""

    def __init__(
        self,
        data_dir: str | Path,
        resolution: int = 32,
        max_len: int | None = None,
        difficulty: str = DIFFICULTY,
        mean: float = MEAN,
        std: float = STD,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        split_seed: int = 42,
        blacklist: Iterable[str] = BLACKLIST,
        generate_if_missing: bool = False,
        generator_samples: int = 200_000,
        generator_seed: int = 0,
        generator_workers: int | None = None,
        progress: bool = True,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("d_input", 1)
        kwargs.setdefault("num_classes", NUM_CLASSES)
        length = resolution * resolution
        super().__init__(data_dir=data_dir, max_len=max_len or length, **kwargs)
        if self.max_len != length:
            raise ValueError(
                f"Pathfinder at {resolution}x{resolution} has {length} pixels; config says "
                f"max_len={self.max_len}"
            )
        if self.spec.d_input != 1 or self.spec.vocab_size is not None:
            raise ValueError("Pathfinder inputs are real-valued with d_input=1 (no vocab_size)")
        if self.spec.num_classes != NUM_CLASSES:
            raise ValueError(f"Pathfinder has 2 classes, config says {self.num_classes}")
        if val_fraction < 0 or test_fraction < 0 or val_fraction + test_fraction >= 1:
            raise ValueError(f"bad split fractions val={val_fraction}, test={test_fraction}")
        self.resolution, self.difficulty = resolution, difficulty
        self.mean, self.std = mean, std
        self.val_fraction, self.test_fraction, self.split_seed = (
            val_fraction,
            test_fraction,
            split_seed,
        )
        self.blacklist = tuple(blacklist)
        self.generate_if_missing = generate_if_missing
        self.generator_samples = generator_samples
        self.generator_seed = generator_seed
        self.generator_workers = generator_workers
        self.progress = progress

    @property
    def folder(self) -> Path:
        return difficulty_dir(self.data_dir, self.resolution, self.difficulty)

    def _has_metadata(self) -> bool:
        return (self.folder / "metadata").is_dir() and any((self.folder / "metadata").glob("*.npy"))

    def _generate(self) -> None:
        from megalab.data.lra.pathfinder_gen import generate_pathfinder

        m = re.fullmatch(r"curv_contour_length_(\d+)", self.difficulty)
        if m is None:
            raise ValueError(f"cannot generate difficulty {self.difficulty!r}")
        done = _read_json(self.folder / ".complete")
        if done and (done.get("num_samples"), done.get("seed")) == (
            self.generator_samples,
            self.generator_seed,
        ):
            return  # already generated with these settings
        log.info(
            "generating %d Pathfinder images (%dx%d) in %s",
            self.generator_samples,
            self.resolution,
            self.resolution,
            self.folder,
        )
        generate_pathfinder(
            self.data_dir,
            resolution=self.resolution,
            contour_length=int(m.group(1)),
            num_samples=self.generator_samples,
            seed=self.generator_seed,
            workers=self.generator_workers,
            progress=self.progress,
        )

    def _require(self) -> None:
        meta = self.folder / "metadata"
        if self._has_metadata():
            return
        task = "pathx" if self.resolution == 128 else "pathfinder"
        root = data_root_of(self.data_dir, 1)
        how = (
            release_how(task, root) + "\n"
            "or generate images offline with our generator:\n"
            f"  megalab-data pathfinder --resolution {self.resolution} --num-samples 200000 "
            f"--out {self.data_dir}\n"
            "or let training generate them on first use: data.generate_if_missing=true "
            "data.generator_samples=2000 (a small set for trying things out)."
        )
        require_files(
            [meta / "0.npy"],
            dataset=f"LRA {'Path-X' if task == 'pathx' else 'Pathfinder'} "
            f"({self.resolution}x{self.resolution}, {self.difficulty})",
            how=how,
            url=RELEASE_PAGE,
            data_dir=self.data_dir,
        )

    def cache_path(self) -> Path:
        sources = [
            [f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in metadata_files(self.folder)
        ]
        params = {
            "resolution": self.resolution,
            "difficulty": self.difficulty,
            "blacklist": sorted(self.blacklist),
            "folder": str(self.folder.absolute()),
            "metadata": sources,
        }
        return cache_dir(
            self.cache_root, f"pathfinder{self.resolution}", params, version=_CACHE_VERSION
        )

    def prepare_data(self) -> None:
        ours = (self.folder / ".generator.json").exists()
        if self.generate_if_missing and (ours or not self._has_metadata()):
            self._generate()  # returns at once when our finished data has these parameters
        self._require()
        cache = self.cache_path()
        if prepared(cache):
            return
        fresh_cache(cache)
        samples = read_metadata(self.data_dir, self.resolution, self.difficulty, self.blacklist)
        if not samples:
            raise LRAFormatError(f"{self.folder / 'metadata'}: the metadata lists no images")
        length = self.resolution * self.resolution
        tmp = cache / "pixels.tmp.npy"
        pixels = np.lib.format.open_memmap(
            tmp, mode="w+", dtype=np.uint8, shape=(len(samples), length)
        )
        bar = tqdm(
            samples,
            desc=f"pathfinder{self.resolution}",
            unit="img",
            disable=not (self.progress and sys.stderr.isatty()),
            leave=False,
        )
        for i, (path, _) in enumerate(bar):
            pixels[i] = load_gray(path, self.resolution)
        pixels.flush()
        del pixels
        os.replace(tmp, cache / "pixels.npy")
        np.save(cache / "labels.npy", np.asarray([y for _, y in samples], dtype=np.int64))
        mark_prepared(cache, {"samples": len(samples)}, sources=metadata_files(self.folder))
        log.info("Pathfinder pixels prepared in %s (%d images)", cache, len(samples))

    def split_sizes(self, n: int) -> list[int]:
        """``[train, val, test]`` as the reference scripts: val/test ``int(fraction * n)``."""
        val, test = int(self.val_fraction * n), int(self.test_fraction * n)
        return [n - val - test, val, test]

    def build_datasets(self) -> dict[str, PixelSequences]:
        if not self._has_metadata():
            self.prepare_data()
        cache = self.cache_path()
        if not prepared(cache):
            self.prepare_data()
        pixels, labels = load_pixels(cache, "", 2, self.resolution)
        parts = random_split_indices(len(labels), self.split_sizes(len(labels)), self.split_seed)
        return {
            split: PixelSequences(pixels, labels, self.mean, self.std, idx)
            for split, idx in zip(("train", "val", "test"), parts)
        }
