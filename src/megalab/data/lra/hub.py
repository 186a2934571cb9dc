"""The LRA tasks read from a Hugging Face Hub dataset of train and test splits (Text: IMDB,
Image: CIFAR-10): their shared settings, and fetching the source before the token cache is
prepared (the cache key depends on the fetched files)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from megalab.data.base import SequenceDataModule
from megalab.data.cache import fresh_cache, prepared
from megalab.data.hub import HubDataset


def refresh_hub_cache(
    source: HubDataset, cache_path: Callable[[], Path], download: bool, hf_cache_dir: str | None
) -> Path | None:
    """Fetch a Hub source where needed, then find its cache folder (the key depends on the
    fetched files): None when it is prepared, else the folder, emptied for a rebuild."""
    source.require(download=download, cache_dir=hf_cache_dir)
    cache = cache_path()
    if prepared(cache):
        return None
    fresh_cache(cache)
    return cache


def hub_columns(source: HubDataset, column: str) -> Iterator[tuple[str, list[Any], list[Any]]]:
    """(split, the split's `column` values, its labels) for each split of a Hub source."""
    for split in source.splits:
        table = source.table(split)
        yield split, table.column(column).to_pylist(), table.column("label").to_pylist()


class LRAHubDataModule(SequenceDataModule):
    """The LRA tasks prepared from a Hub dataset of train and test splits (Text, Image).

    Args (besides the `SequenceDataModule` ones):
        val_fraction, split_seed: the part of the training split held out for validation and
            the seed of its draw.
        hub_id: the Hub dataset, read from `data_dir` (each task defaults to its own).
        download: fetch missing files from the Hub when online.  hf_cache_dir: the `datasets`
            cache used for it.

    Subclasses set `source` (the `HubDataset` of `hub_id`) and key `cache_path` by its
    fingerprint, which fetching changes."""

    source: HubDataset

    def __init__(
        self,
        *args: Any,
        val_fraction: float = 0.1,
        split_seed: int = 42,
        hub_id: str,
        download: bool = True,
        hf_cache_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.val_fraction, self.split_seed = val_fraction, split_seed
        self.hub_id, self.download, self.hf_cache_dir = hub_id, download, hf_cache_dir

    def cache_path(self) -> Path:
        """The prepared cache of the current source files and settings."""
        raise NotImplementedError

    def cache_to_prepare(self) -> Path | None:
        """Fetch the source where needed; None when its cache is prepared, else the cache
        folder, emptied for the preparation."""
        return refresh_hub_cache(self.source, self.cache_path, self.download, self.hf_cache_dir)

    def prepared_cache(self) -> Path:
        """The prepared cache, preparing it first when needed."""
        cache = self.cache_path()
        if not prepared(cache):
            self.prepare_data()  # may fetch the sources, which changes the cache key
            cache = self.cache_path()
        return cache
