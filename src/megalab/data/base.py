"""The DataModule contract every dataset follows.

A batch is a dict: `inputs` (B, L) int64 tokens or (B, L, C) float features, `targets`, and
`mask` (B, L) bool, True at real tokens. Pairwise data (retrieval) adds `inputs2`/`mask2`.
Each DataModule declares a small `DataSpec` (vocabulary or input width, classes, maximum
length) that model configs interpolate from `${data.*}`; `setup` checks the data against it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from megalab.utils.errors import UserError


@dataclass(frozen=True)
class DataSpec:
    """What a model needs to know about its data."""

    max_len: int
    vocab_size: int | None = None
    d_input: int | None = None
    num_classes: int | None = None
    pad_id: int | None = None
    pairwise: bool = False


class TokenSequences(Dataset):
    """Variable-length token sequences stored flat (one int array + offsets) with labels.

    Flat storage keeps 100K-sequence datasets in a few contiguous (optionally memory-mapped)
    arrays instead of 100K small tensors.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        offsets: np.ndarray,
        labels: np.ndarray,
        tokens2: np.ndarray | None = None,
        offsets2: np.ndarray | None = None,
    ) -> None:
        if len(offsets) != len(labels) + 1:
            raise ValueError("offsets must have one more entry than labels")
        self.tokens, self.offsets, self.labels = tokens, offsets, labels
        self.tokens2, self.offsets2 = tokens2, offsets2
        # Sequences cut to the maximum length when they were read (0: none).
        self.truncated = 0

    def __len__(self) -> int:
        return len(self.labels)

    def lengths(self) -> np.ndarray:
        """Length of every sequence (the longer document for pairs)."""
        lengths = np.diff(self.offsets)
        if self.offsets2 is not None:
            lengths = np.maximum(lengths, np.diff(self.offsets2))
        return lengths

    def __getitem__(self, i: int) -> dict[str, Any]:
        a, b = self.offsets[i], self.offsets[i + 1]
        item: dict[str, Any] = {
            "inputs": torch.from_numpy(np.asarray(self.tokens[a:b], dtype=np.int64))
        }
        if self.tokens2 is not None:
            assert self.offsets2 is not None, "pairs need offsets2"
            a2, b2 = self.offsets2[i], self.offsets2[i + 1]
            item["inputs2"] = torch.from_numpy(np.asarray(self.tokens2[a2:b2], dtype=np.int64))
        item["targets"] = int(self.labels[i])
        return item


def cached_sequences(
    cache_root: str | Path,
    name: str,
    params: dict[str, Any],
    build: Callable[[], TokenSequences],
    *,
    sources: Sequence[str | Path] = (),
    vocab_size: int | None = None,
    num_classes: int | None = None,
) -> TokenSequences:
    """Load prepared token sequences from a cache keyed by `params`, or build and store them.

    The arrays are saved as .npy files and memory-mapped on load, so a 100K-document split is
    tokenised once and then opens instantly in every process. The cache records checksums of
    its files and of `sources` (`megalab.data.cache`); a load checks the headers, the offsets,
    and that token ids are below `vocab_size` and labels below `num_classes`.
    """
    from megalab.data import cache

    path = cache.cache_dir(cache_root, name, params)
    names = ("tokens", "offsets", "labels", "tokens2", "offsets2")
    if not cache.prepared(path):
        ds = build()
        for key in names:
            value = getattr(ds, key)
            if value is not None:
                np.save(path / f"{key}.npy", np.asarray(value))
        info = {"sequences": len(ds), "truncated": int(ds.truncated)}
        cache.mark_prepared(path, info, sources=sources)
        return ds
    arrays: dict[str, Any] = {}
    for key in names:
        file = path / f"{key}.npy"
        if file.exists():
            cache.check_npy(file, ndim=1, cache=path)
            arrays[key] = np.load(file, mmap_mode="r")
        else:
            arrays[key] = None
    for tokens, offsets in (("tokens", "offsets"), ("tokens2", "offsets2")):
        if arrays[tokens] is not None:
            cache.check_tokens(
                arrays[tokens],
                arrays[offsets],
                vocab_size,
                path / f"{tokens}.npy",
                path / f"{offsets}.npy",
                path,
            )
    if num_classes is not None:
        cache.check_range(arrays["labels"], 0, num_classes, "label", path / "labels.npy", path)
    ds = TokenSequences(**arrays)
    ds.truncated = int(cache.read_marker(path).get("truncated", 0))
    return ds


class TruncationError(UserError, ValueError):
    """Inputs longer than `data.max_len` that the settings do not allow to cut."""


def check_truncation(
    dataset: str, truncated: dict[str, int], sizes: dict[str, int], max_len: int, allow: bool
) -> None:
    """Report sequences cut to `max_len`: a warning with `allow` (`data.truncate=true`), else
    `TruncationError`, since a cut input can change its label (a ListOps expression loses
    operands) and silently lowers the accuracy."""
    total = sum(truncated.values())
    if total == 0:
        return
    per_split = ", ".join(f"{n:,} of {sizes.get(s, 0):,} in {s}" for s, n in truncated.items() if n)
    message = f"{dataset}: {per_split} are longer than data.max_len={max_len}"
    if not allow:
        raise TruncationError(
            f"{message}. Raise data.max_len to fit them, or set data.truncate=true to cut them "
            "to that length"
        )
    logging.getLogger(__name__).warning("%s: cut to that length (data.truncate=true)", message)


def file_key(path: Path) -> dict[str, Any]:
    """What identifies a source file's content for caching: path, size and mtime."""
    stat = path.stat()
    return {"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def pad_stack(seqs: Sequence[Tensor], pad_value: float | int = 0) -> tuple[Tensor, Tensor]:
    """Right-pad sequences (L_i, ...) to (B, L_max, ...); return them and the (B, L) mask."""
    length = max(int(s.shape[0]) for s in seqs)
    out = seqs[0].new_full((len(seqs), length, *seqs[0].shape[1:]), pad_value)
    mask = torch.zeros(len(seqs), length, dtype=torch.bool)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
        mask[i, : s.shape[0]] = True
    return out, mask


class SequenceCollator:
    """Collates dict items into a padded batch (`inputs`, `mask`, `targets`, pairs)."""

    def __init__(self, pad_id: int | float = 0) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Tensor]:
        batch: dict[str, Tensor] = {}
        batch["inputs"], batch["mask"] = pad_stack([it["inputs"] for it in items], self.pad_id)
        if "inputs2" in items[0]:
            batch["inputs2"], batch["mask2"] = pad_stack(
                [it["inputs2"] for it in items], self.pad_id
            )
        targets = [it["targets"] for it in items]
        batch["targets"] = (
            torch.stack(targets) if isinstance(targets[0], Tensor) else torch.tensor(targets)
        )
        return batch


class ShardedSampler(Sampler[int]):
    """Indices of one process's shard, a pure function of (seed, epoch, rank).

    Training shards are shuffled per epoch and padded (by wrapping around) to equal length so
    every process takes the same number of steps; evaluation shards are disjoint and together
    cover the split exactly once, in `order` when one is given (e.g. by length). `skip` drops
    the first indices of the current epoch when a run resumes mid-epoch.
    """

    def __init__(
        self,
        size: int,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        order: Sequence[int] | None = None,
    ) -> None:
        if order is not None and sorted(order) != list(range(size)):
            raise ValueError(f"order must be a permutation of range({size})")
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.order = None if order is None else list(order)
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + 7919 * self.epoch)
            order = torch.randperm(self.size, generator=g).tolist()
            per_rank = -(-self.size // self.world_size)
            order += order[: per_rank * self.world_size - self.size]
        else:
            order = self.order if self.order is not None else list(range(self.size))
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.skip :])

    def __len__(self) -> int:
        return len(self.indices())


class ResumableDataLoader(DataLoader):
    """A DataLoader that resumes mid-epoch where an interrupted run stopped.

    `position()` returns how many batches of the current epoch were already consumed (the
    trainer's restored progress when resuming, 0 otherwise); the sampler skips them, so a
    resumed run sees exactly the data the uninterrupted run would have seen.
    """

    def __init__(
        self, *args: Any, position: Callable[[], int] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.position = position

    def __iter__(self) -> _BaseDataLoaderIter:
        if isinstance(self.sampler, ShardedSampler):
            done = self.position() if self.position is not None else 0
            self.sampler.skip = done * (self.batch_size or 1)
        return super().__iter__()


class SequenceDataModule(L.LightningDataModule):
    """Base DataModule: batch sizing, loaders, and the data spec.

    `batch_size` is the global batch per optimizer step; each process loads
    `batch_size / (world_size * accumulate_grad_batches)` so that changing devices or
    accumulation keeps the effective batch of a paper configuration. Validation and test
    loaders never drop the last batch. With `sort_eval_by_length` they take the examples
    longest first, so a batch pads to about its own length (less compute for variable-length
    data, and an out-of-memory error shows on the first batch); the metrics do not change,
    since every example is still seen once and the models ignore padding. Its training loaders
    resume mid-epoch (`resumed_batches`), which `megalab-train` relies on when it resumes; a
    subclass building its own keeps that with `loader()` or a sampler reading `resumed_batches`.
    """

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 42,
        vocab_size: int | None = None,
        d_input: int | None = None,
        num_classes: int | None = None,
        pad_id: int | None = None,
        pairwise: bool = False,
        drop_last: bool = False,
        cache_root: str | Path | None = None,
        sort_eval_by_length: bool = True,
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir).expanduser()
        # Prepared (tokenised, decoded) arrays live in `<cache_root>/<name>/<hash of the
        # preprocessing settings>`; a read-only data folder can point this elsewhere.
        self.cache_root = (
            Path(cache_root).expanduser() if cache_root else self.data_dir / "prepared"
        )
        self.spec = DataSpec(
            max_len=max_len,
            vocab_size=vocab_size,
            d_input=d_input,
            num_classes=num_classes,
            pad_id=pad_id,
            pairwise=pairwise,
        )
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        # Pinned pages only speed up copies to a GPU; without one torch pins nothing and warns.
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.seed = seed
        self.drop_last = drop_last
        self.sort_eval_by_length = sort_eval_by_length
        # Map-style datasets (sized and indexable; torch's Dataset type declares neither).
        self.datasets: dict[str, Any] = {}

    # -- spec shortcuts -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int | None:
        return self.spec.vocab_size

    @property
    def num_classes(self) -> int | None:
        return self.spec.num_classes

    @property
    def max_len(self) -> int:
        return self.spec.max_len

    # -- hooks for subclasses -------------------------------------------------------------------
    def build_datasets(self) -> Mapping[str, Any]:
        """Return the `train`/`val`/`test` datasets (called once, in `setup`)."""
        raise NotImplementedError

    def collate_fn(self, split: str = "train") -> Callable:
        """The collate function for `split` (a padded-sequence collator by default)."""
        return SequenceCollator(self.spec.pad_id if self.spec.pad_id is not None else 0)

    def tokenizer_files(self) -> dict[str, Path]:
        """The files that turn text into this data's token ids, by the name an exported model
        keeps them under (`megalab-export`); none for bytes, characters, pixels or audio."""
        return {}

    def text_spec(self) -> dict[str, Any] | None:
        """What turns text into this data's token ids (`megalab.data.lm.codec.codec_from_spec`
        builds it from the `tokenizer_files()`), without reading any data: what an export
        records. None: the data is not text."""
        return None

    # -- Lightning ------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if not self.datasets:
            self.datasets = dict(self.build_datasets())
            for split, ds in self.datasets.items():
                if len(ds) == 0:
                    raise ValueError(
                        f"{type(self).__name__}: the {split} split is empty (data in "
                        f"{self.data_dir}); check the files or the split settings"
                    )

    def per_device_batch_size(self, batch_size: int) -> int:
        """Split a global batch over processes and gradient-accumulation steps."""
        world, accumulate = 1, 1
        if self.trainer is not None:
            world = self.rank_and_world()[1]
            accumulate = self.trainer.accumulate_grad_batches
        parts = world * accumulate
        if batch_size % parts:
            raise ValueError(
                f"batch_size={batch_size} is not divisible by world_size x "
                f"accumulate_grad_batches = {world} x {accumulate}; choose a batch size that is"
            )
        return batch_size // parts

    def resumed_batches(self) -> int:
        """Training batches of the current epoch consumed before a resume (0 otherwise)."""
        trainer = self.trainer
        # Lightning internal (2 of 7, hence the `lightning<2.7` bound in pyproject.toml): the fit
        # loop's `restarting` flag and batch progress counters. tests/test_lightning_internals.py
        # fails when Lightning changes what they report on a mid-epoch resume.
        if trainer is None or not trainer.fit_loop.epoch_loop.restarting:
            return 0
        # `processed` counts a batch whose step finished even if the checkpoint was written in
        # on_train_batch_end, before Lightning marked it completed.
        # Lightning annotates `current` with the base tracker; a batch progress has `processed`.
        return trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]

    def rank_and_world(self) -> tuple[int, int]:
        if self.trainer is None:
            return 0, 1
        # Chunk parallelism: the ranks of a group read the same rows (their data-parallel rank).
        dp = getattr(self.trainer.strategy, "data_parallel_rank_and_size", None)
        if dp is not None:
            return dp
        return self.trainer.global_rank, self.trainer.world_size

    def sampler(self, split: str, batch_size: int) -> Sampler[int]:
        """Index sampler of one process for `split` (shuffled per epoch when training).

        The module shards data itself (Lightning's distributed sampler is turned off in the
        trainer configs), so that the order is resumable and evaluation sees every example
        exactly once.
        """
        rank, world = self.rank_and_world()
        dataset = self.datasets[split]
        train = split == "train"
        order = None
        if not train and self.sort_eval_by_length and callable(getattr(dataset, "lengths", None)):
            order = np.argsort(-np.asarray(dataset.lengths()), kind="stable").tolist()
        return ShardedSampler(
            len(dataset), shuffle=train, seed=self.seed, rank=rank, world_size=world, order=order
        )

    def loader(
        self,
        dataset: Dataset,
        *,
        train: bool,
        batch_size: int | None,
        sampler: Sampler,
        collate_fn: Callable | None,
    ) -> ResumableDataLoader:
        """A loader with the module's worker settings, resumable when training."""
        return ResumableDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=self.drop_last if train and batch_size is not None else False,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            collate_fn=collate_fn,
            position=self.resumed_batches if train else None,
            # A private generator: creating loader iterators (worker seeds) must not consume
            # the global RNG that dropout uses, or a resumed run would diverge.
            generator=torch.Generator().manual_seed(self.seed),
        )

    def _loader(self, split: str, train: bool) -> DataLoader:
        if split not in self.datasets:
            self.setup()
        size = self.batch_size if train else (self.eval_batch_size or self.batch_size)
        if train:
            size = self.per_device_batch_size(size)
        return self.loader(
            self.datasets[split],
            train=train,
            batch_size=size,
            sampler=self.sampler(split, size),
            collate_fn=self.collate_fn(split),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", train=False)
