"""Text splits of a Hugging Face Hub dataset: local Hub-style parquet shards, or the Hub.

Local copies keep the Hub's layout below the dataset's folder (what `huggingface-cli download
<repo> --repo-type dataset --local-dir <folder>` writes), e.g.
`wikitext-103-v1/train-00000-of-00002.parquet` or `data/validation-00000-of-00001.parquet` or
the parquet converter's `default/test/0000.parquet`: a file belongs to a split when the split's
name is one of its folder names or a `-`/`_`/`.`-separated part of its file name. Without local
files the splits are read with `datasets.load_dataset` (online only).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megalab.data.download import DatasetMissingError, _missing_message, is_offline

log = logging.getLogger(__name__)

#: Our split names -> the Hub's (and accepted aliases in file names).
HUB_SPLITS = {"train": ("train",), "val": ("validation", "valid"), "test": ("test",)}


def _belongs(rel: Path, names: Sequence[str]) -> bool:
    if any(part in names for part in rel.parts[:-1]):
        return True
    return any(tok in names for tok in re.split(r"[-_.]", rel.name))


class HubTextSource:
    """Rows of the `train`/`val`/`test` splits with the given columns.

    Args:
        dataset: name used in messages (e.g. "WikiText-103").
        local_dir: folder searched (recursively) for Hub-style parquet shards.
        hub_name, hub_config, revision: the Hub dataset read when there are no local shards.
        columns: the columns every row must have (the first is the text).
        how: extra instructions for the "data missing" message.
    """

    def __init__(
        self,
        dataset: str,
        local_dir: Path,
        hub_name: str,
        hub_config: str | None,
        columns: Sequence[str],
        revision: str | None = None,
        how: str = "",
    ) -> None:
        self.dataset, self.local_dir = dataset, Path(local_dir)
        self.hub_name, self.hub_config, self.revision = hub_name, hub_config, revision
        self.columns = tuple(columns)
        self.how = how
        self._hub: dict[str, Any] = {}

    # -- local shards ---------------------------------------------------------------------------
    def local_files(self, split: str) -> list[Path]:
        if not self.local_dir.is_dir():
            return []
        names = HUB_SPLITS[split]
        files = sorted(self.local_dir.rglob("*.parquet"))
        return [f for f in files if _belongs(f.relative_to(self.local_dir), names)]

    def has_local(self) -> bool:
        return all(self.local_files(s) for s in HUB_SPLITS)

    def _check_columns(self, path: Path) -> None:
        import pyarrow.parquet as pq

        try:
            names = pq.ParquetFile(path).schema_arrow.names
        except Exception as e:
            raise ValueError(
                f"{self.dataset}: cannot read {path} as parquet ({e}); the file is damaged or "
                "not a parquet file: delete it and download it again"
            ) from e
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise ValueError(
                f"{self.dataset}: {path} has no column {missing[0]!r} (columns: {names}); "
                f"expected the Hub's columns {list(self.columns)}"
            )

    # -- the Hub --------------------------------------------------------------------------------
    def _missing(self, reason: str) -> DatasetMissingError:
        rev = f" --revision {self.revision}" if self.revision else ""
        pattern = f"{self.hub_config}/*" if self.hub_config else "*.parquet"
        how = (
            f"Download the parquet files of the Hub dataset {self.hub_name}, e.g.\n"
            f"  huggingface-cli download {self.hub_name} --repo-type dataset{rev} "
            f"--include '{pattern}' --local-dir {self.local_dir}\n"
            f"so that {self.local_dir} holds train/validation/test parquet shards (Hub layout), "
            "or run the same command online (unset HF_HUB_OFFLINE/MEGALAB_OFFLINE) to read "
            "them from the Hub."
        )
        if self.how:
            how += "\n" + self.how
        missing = [self.local_dir / f"{HUB_SPLITS[s][0]}-*.parquet" for s in HUB_SPLITS]
        return DatasetMissingError(
            _missing_message(
                dataset=self.dataset,
                missing=missing,
                how=how,
                url=f"https://huggingface.co/datasets/{self.hub_name}",
                reason=reason,
            )
        )

    def _hub_split(self, split: str) -> Any:
        if split in self._hub:
            return self._hub[split]
        if is_offline():
            raise self._missing("no local parquet shards, and offline mode is on")
        import datasets

        hub_split = HUB_SPLITS[split][0]
        try:
            ds = datasets.load_dataset(
                self.hub_name, self.hub_config, split=hub_split, revision=self.revision
            )
        except Exception as e:  # scripts are no longer run: fall back to the parquet export
            if self.revision is None and "script" in str(e).lower():
                log.info("%s: reading the parquet export refs/convert/parquet", self.hub_name)
                ds = datasets.load_dataset(
                    self.hub_name,
                    self.hub_config,
                    split=hub_split,
                    revision="refs/convert/parquet",
                )
            elif isinstance(e, (ConnectionError, OSError)) or "connect" in str(e).lower():
                raise self._missing(f"cannot reach the Hub ({e})") from e
            else:
                raise
        missing = [c for c in self.columns if c not in ds.column_names]
        if missing:
            raise ValueError(
                f"{self.dataset}: the Hub dataset {self.hub_name} has no column {missing[0]!r} "
                f"(columns: {ds.column_names})"
            )
        self._hub[split] = ds
        return ds

    # -- reading --------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What the prepared cache is keyed on: the local files (names, sizes) or the Hub id."""
        if self.has_local():
            return {
                s: [
                    [f.relative_to(self.local_dir).as_posix(), f.stat().st_size]
                    for f in self.local_files(s)
                ]
                for s in HUB_SPLITS
            }
        return {"hub": self.hub_name, "config": self.hub_config, "revision": self.revision}

    def num_rows(self, split: str) -> int:
        if self.has_local():
            import pyarrow.parquet as pq

            return sum(pq.ParquetFile(f).metadata.num_rows for f in self.local_files(split))
        return len(self._hub_split(split))

    def rows(self, split: str, batch_size: int = 64) -> Iterator[dict[str, Any]]:
        """Yield the rows of `split` (dicts of the requested columns), in order."""
        if self.has_local():
            import pyarrow.parquet as pq

            for path in self.local_files(split):
                self._check_columns(path)
                for batch in pq.ParquetFile(path).iter_batches(
                    batch_size=batch_size, columns=list(self.columns)
                ):
                    yield from batch.to_pylist()
            return
        ds = self._hub_split(split).select_columns(list(self.columns))
        for i in range(0, len(ds), batch_size):
            chunk = ds[i : i + batch_size]
            for j in range(len(chunk[self.columns[0]])):
                yield {c: chunk[c][j] for c in self.columns}

    def texts(self, split: str, batch_size: int = 64) -> Iterator[str]:
        column = self.columns[0]
        for row in self.rows(split, batch_size):
            text = row[column]
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise ValueError(
                    f"{self.dataset}: column {column!r} of the {split} split holds "
                    f"{type(text).__name__}, not text"
                )
            yield text

    def require(self) -> None:
        """Raise `DatasetMissingError` now when there is neither a local copy nor the Hub."""
        if self.has_local():
            return
        partial = {s: len(self.local_files(s)) for s in HUB_SPLITS}
        if any(partial.values()):
            absent = [HUB_SPLITS[s][0] for s, n in partial.items() if not n]
            raise self._missing(f"local parquet shards found, but none for {', '.join(absent)}")
        if is_offline():
            raise self._missing("no local parquet shards, and offline mode is on")
