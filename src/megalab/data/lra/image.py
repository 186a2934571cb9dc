"""LRA Image: CIFAR-10 classified from its 1024 grayscale pixels in row-major order.

Source: the Hugging Face Hub dataset ``uoft-cs/cifar10`` (columns ``img``, a PNG stored as the
Hub's image struct ``{bytes, path}``, and ``label``, 0-9; train 50K, test 10K), read from a local
Hub-style copy (``<data_dir>/plain_text/{train,test}-*.parquet`` or a ``save_to_disk`` folder)
or fetched with ``datasets.load_dataset`` when online (``megalab-data cifar10``).

Protocol (the Mega code's ``data_process.py``, identical to S4's):

- grayscale with PIL's ``convert("L")`` (ITU-R 601-2 luma, what torchvision's ``Grayscale``
  calls), pixels in row-major order: a ``(1024, 1)`` float sequence per image;
- validation is 10% of the training set: ``random_split(train, [45000, 5000],
  generator=torch.Generator().manual_seed(42))``, reproduced exactly
  (:func:`random_split_indices`); test is the official 10K test set;
- normalisation ``(x / 255 - mean) / std`` with Mega's mean 0.48 and std 0.24 (S4 uses
  122.6/255 and 61/255; both are settings). Mega's script wrote ``int(x * 255)`` of the float
  pixels, which gives back every byte exactly, so reading the bytes directly changes nothing.

Decoded pixels are prepared once (rank 0) as a ``uint8`` array under
``<data_dir>/prepared/cifar10/<hash>``; normalisation is applied on the fly, so changing it
does not re-prepare.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from megalab.data.cache import (
    CacheError,
    cache_dir,
    check_npy,
    check_range,
    mark_prepared,
    rebuild_hint,
)
from megalab.data.hub import HubDataset
from megalab.data.lra import release
from megalab.data.lra.hub import LRAHubDataModule, hub_columns
from megalab.data.lra.release import LRAFormatError

log = logging.getLogger(__name__)

HUB_ID = "uoft-cs/cifar10"
NUM_CLASSES = 10
SIDE = 32
MEAN, STD = 0.48, 0.24
_CACHE_VERSION = 1


def hub_dataset(data_dir: str | Path, hub_id: str = HUB_ID) -> HubDataset:
    """CIFAR-10's train and test splits (``img``, ``label``) in ``<data_dir>/plain_text/``."""
    return release.hub_dataset(
        "LRA Image (CIFAR-10)", hub_id, data_dir, ("img", "label"), "cifar10"
    )


def random_split_indices(n: int, lengths: Sequence[int], seed: int) -> list[np.ndarray]:
    """The index sets of ``random_split(range(n), lengths, Generator().manual_seed(seed))``.

    ``torch.utils.data.random_split`` itself draws them, so a split here is the same as in any
    code that calls it with the same sizes, order and seed (Mega's and S4's data scripts).
    """
    if sum(lengths) != n:
        raise ValueError(f"split lengths {list(lengths)} do not add up to {n}")
    subsets = torch.utils.data.random_split(
        # torch types the first argument as a Dataset; random_split needs only len().
        cast(Any, range(n)),
        list(lengths),
        generator=torch.Generator().manual_seed(seed),
    )
    return [np.asarray(s.indices, dtype=np.int64) for s in subsets]


class PixelSequences(Dataset):
    """Images stored as ``uint8`` rows (N, H*W); items are normalised ``(H*W, 1)`` floats.

    ``indices`` selects a subset (a split) without copying the pixel array, which may be a
    memory map shared by every split.
    """

    def __init__(
        self,
        pixels: np.ndarray,
        labels: np.ndarray,
        mean: float,
        std: float,
        indices: np.ndarray | None = None,
    ) -> None:
        if len(pixels) != len(labels):
            raise ValueError(f"{len(pixels)} images but {len(labels)} labels")
        if std <= 0:
            raise ValueError(f"std must be positive, got {std}")
        self.pixels, self.labels = pixels, labels
        self.mean, self.std = float(mean), float(std)
        self.indices = np.arange(len(labels)) if indices is None else np.asarray(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        j = int(self.indices[i])
        x = torch.from_numpy(np.asarray(self.pixels[j], dtype=np.float32))
        x = (x / 255.0 - self.mean) / self.std
        return {"inputs": x.unsqueeze(-1), "targets": int(self.labels[j])}


def load_pixels(
    cache: Path, prefix: str, num_classes: int, side: int = SIDE
) -> tuple[np.ndarray, np.ndarray]:
    """``<prefix>.pixels.npy`` (memory-mapped) and ``<prefix>.labels.npy`` of a prepared cache,
    after the cheap checks: headers, one label per image, labels below ``num_classes``."""

    pixels_path = cache / f"{prefix}.pixels.npy" if prefix else cache / "pixels.npy"
    labels_path = cache / f"{prefix}.labels.npy" if prefix else cache / "labels.npy"
    check_npy(pixels_path, np.uint8, 2, cache)
    check_npy(labels_path, np.int64, 1, cache)
    pixels = np.load(pixels_path, mmap_mode="r")
    labels = np.load(labels_path)
    if pixels.shape[1] != side * side or len(pixels) != len(labels):
        raise CacheError(
            f"{pixels_path} holds {pixels.shape} pixels for {len(labels)} labels, not "
            f"({len(labels)}, {side * side}). {rebuild_hint(cache)}"
        )
    check_range(labels, 0, num_classes, "label", labels_path, cache)
    return pixels, labels


def decode_gray(data: bytes, side: int, where: str) -> np.ndarray:
    """PNG/JPEG bytes -> row-major ``uint8`` luma of a ``side x side`` image."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            gray = im.convert("L")
    except (OSError, SyntaxError, ValueError) as e:
        raise LRAFormatError(f"{where}: cannot decode the image ({e})") from None
    if gray.size != (side, side):
        raise LRAFormatError(f"{where}: image is {gray.size[0]}x{gray.size[1]}, not {side}x{side}")
    return np.asarray(gray, dtype=np.uint8).reshape(-1)


class CIFAR10DataModule(LRAHubDataModule):
    """LRA Image: 10-way classification of grayscale CIFAR-10 as 1024-pixel sequences.

    Takes `LRAHubDataModule`'s arguments and the pixel normalisation (`mean`, `std`)."""

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int = SIDE * SIDE,
        mean: float = MEAN,
        std: float = STD,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("d_input", 1)
        kwargs.setdefault("num_classes", NUM_CLASSES)
        kwargs.setdefault("hub_id", HUB_ID)
        super().__init__(data_dir=data_dir, max_len=max_len, **kwargs)
        if max_len != SIDE * SIDE:
            raise ValueError(f"LRA Image has {SIDE * SIDE} pixels per image, config says {max_len}")
        if self.spec.d_input != 1 or self.spec.vocab_size is not None:
            raise ValueError("LRA Image inputs are real-valued with d_input=1 (no vocab_size)")
        if self.spec.num_classes != NUM_CLASSES:
            raise ValueError(f"CIFAR-10 has {NUM_CLASSES} classes, config says {self.num_classes}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        self.mean, self.std = mean, std
        self.source = hub_dataset(self.data_dir, self.hub_id)

    def cache_path(self) -> Path:
        params = {"dataset": self.hub_id, "sources": self.source.fingerprint()}
        return cache_dir(self.cache_root, "cifar10", params, version=_CACHE_VERSION)

    def prepare_data(self) -> None:
        cache = self.cache_to_prepare()
        if cache is None:
            return
        sizes = {}
        for split, images, labels in hub_columns(self.source, "img"):
            pixels = np.empty((len(images), SIDE * SIDE), dtype=np.uint8)
            for i, (img, y) in enumerate(zip(images, labels)):
                where = f"{self.data_dir} ({split}, row {i})"
                if not isinstance(y, int) or not 0 <= y < NUM_CLASSES:
                    raise LRAFormatError(f"{where}: label {y!r} is not a class id 0-9")
                data = img.get("bytes") if isinstance(img, dict) else None
                if data is None and isinstance(img, dict) and img.get("path"):
                    data = Path(img["path"]).read_bytes()
                if data is None:
                    raise LRAFormatError(f"{where}: the image struct has neither bytes nor path")
                pixels[i] = decode_gray(data, SIDE, where)
            np.save(cache / f"{split}.pixels.npy", pixels)
            np.save(cache / f"{split}.labels.npy", np.asarray(labels, dtype=np.int64))
            sizes[split] = len(labels)
        mark_prepared(cache, {"sizes": sizes}, sources=self.source.source_files())
        log.info("CIFAR-10 pixels prepared in %s (%s)", cache, sizes)

    def build_datasets(self) -> dict[str, PixelSequences]:
        cache = self.prepared_cache()
        train_px, train_y = load_pixels(cache, "train", NUM_CLASSES)
        n = len(train_y)
        n_train = int(n * (1.0 - self.val_fraction))
        tr, va = random_split_indices(n, [n_train, n - n_train], self.split_seed)
        test_px, test_y = load_pixels(cache, "test", NUM_CLASSES)
        return {
            "train": PixelSequences(train_px, train_y, self.mean, self.std, tr),
            "val": PixelSequences(train_px, train_y, self.mean, self.std, va),
            "test": PixelSequences(test_px, test_y, self.mean, self.std),
        }
