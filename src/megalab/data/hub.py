"""Datasets from the Hugging Face Hub, read from a local Hub-style copy (fetched when missing).

One :class:`HubDataset` describes a Hub dataset (repository, config, revision, required columns,
splits) and the folder that holds its local copy. The copy is either

- parquet shards in the Hub's layout anywhere below the folder (what `huggingface-cli download
  <repo> --repo-type dataset --local-dir <folder>` writes), e.g. `plain_text/train-00000-of-
  00001.parquet`, `wikitext-103-v1/validation-00000-of-00001.parquet` or the parquet export's
  `default/test/0000.parquet`: a file belongs to a split when one of the split's Hub names
  (`validation` or `valid` for our `val`) is one of its folder names or a `-`/`_`/`.`-separated
  part of its file name; or
- a `DatasetDict.save_to_disk` folder (`dataset_dict.json` in the folder itself).

When a split is missing, :meth:`HubDataset.require` fetches it with `datasets.load_dataset`
(online only) and writes it as Hub-style parquet below the folder, so later runs read it locally
and work offline. Offline, with downloads off, or when the Hub cannot be reached, it raises
:class:`~megalab.data.download.DatasetMissingError` naming the dataset, its URL, the exact files
to put where and the commands that fetch them. :meth:`HubDataset.fingerprint` (names, sizes and
modification times of the local files) keys prepared caches on the source data.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalab.data.download import DatasetMissingError, _missing_message, is_offline
from megalab.utils.errors import UserError

log = logging.getLogger(__name__)

__all__ = [
    "HUB_SPLIT_NAMES",
    "HubDataset",
    "HubFormatError",
    "belongs_to_split",
    "file_fingerprint",
    "is_source_file",
]

#: Our split names -> the Hub's name first, then aliases accepted in local copies.
HUB_SPLIT_NAMES: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "val": ("validation", "valid"),
    "test": ("test",),
}
#: The revision holding the Hub's parquet export, read when a repository has only a script.
PARQUET_EXPORT = "refs/convert/parquet"
_SAVED_MARKER = "dataset_dict.json"  # written by DatasetDict.save_to_disk
# The Hub clients' loggers: each retry of a request warns twice (the error, "Retrying in ..."),
# which buries the one message that says what to do.
_CLIENT_LOGGERS = ("huggingface_hub", "datasets", "fsspec")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.messages.append(record.getMessage())


@contextlib.contextmanager
def quiet_hub_client() -> Iterator[list[str]]:
    """Keep the warnings of `datasets`/`huggingface_hub` (a retried request warns on every
    attempt) off the console while a Hub call runs; yields the list they are collected in, for
    one summary line (`client_summary`) in the error that follows. They are logged at DEBUG."""
    collect = _Collect()
    saved = []
    for name in _CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate))
        logger.handlers = [collect]
        logger.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield collect.messages
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate
        collect.messages += [str(w.message) for w in caught]
        for message in collect.messages:
            log.debug("Hub client: %s", message)


def client_summary(messages: Sequence[str]) -> str:
    """The Hub client's warnings in one line: how often it retried, and the distinct errors."""
    retries = sum(1 for m in messages if m.startswith("Retrying in"))
    errors = list(dict.fromkeys(m for m in messages if not m.startswith("Retrying in")))
    parts = [f"the Hub client retried {retries} time(s)"] if retries else []
    if errors:
        parts.append(
            errors[0] + (f" (and {len(errors) - 1} other warning(s))" if errors[1:] else "")
        )
    return "; ".join(parts)


_PREPARED = "prepared"  # default cache folder inside a dataset's folder, never source data


class HubFormatError(UserError, ValueError):
    """A copy of a Hub dataset that lacks a split or a column; the message names the file."""


def belongs_to_split(rel: Path, names: Sequence[str]) -> bool:
    """Whether a file at `rel` (below a dataset's folder) is of the split named `names`: one of
    them is a folder name on its path or a `-`/`_`/`.`-separated part of its file name."""
    if any(part in names for part in rel.parts[:-1]):
        return True
    return any(tok in names for tok in re.split(r"[-_.]", rel.name))


def file_fingerprint(files: Sequence[Path], root: Path) -> list[list[Any]]:
    """`[path relative to root, size, mtime_ns]` of each file: what keys a prepared cache on its
    source files (moving the folder keeps the key)."""
    out = []
    for f in files:
        stat = f.stat()
        out.append([f.relative_to(root).as_posix(), stat.st_size, stat.st_mtime_ns])
    return out


def is_source_file(rel: Path) -> bool:
    """Not a hidden file (download metadata, temporaries) nor a prepared cache."""
    return not any(p.startswith(".") for p in rel.parts) and rel.parts[0] != _PREPARED


@dataclass(frozen=True)
class HubDataset:
    """A Hugging Face Hub dataset and the folder holding its local copy.

    Args:
        name: what messages call it, e.g. "LRA Text (IMDB)".
        repo: the Hub repository, e.g. "stanfordnlp/imdb".
        local_dir: the folder searched (recursively) for the copy, and fetched into.
        columns: the columns every split must have; readers return these, in this order.
        splits: our split names; the Hub's are looked up in :data:`HUB_SPLIT_NAMES`.
        config, revision: the Hub config and revision fetched (None: the defaults).
        fetch_dir: where below ``local_dir`` fetched splits are written, as
            ``<split>-00000-of-00001.parquet`` (the Hub's own layout, e.g. ``plain_text``).
        command: the project command that fetches it, named in "missing" messages.
        load_per_split: ask ``datasets.load_dataset`` for one split at a time (``split=``, the
            Hub's name) instead of the whole dataset in one call (which also finds an aliased
            split name such as ``valid``).
        format_error: the exception raised for a missing split or column (a family of datasets
            may use its own subclass of ``ValueError``).
    """

    name: str
    repo: str
    local_dir: Path
    columns: tuple[str, ...]
    splits: tuple[str, ...] = ("train", "val", "test")
    config: str | None = None
    revision: str | None = None
    fetch_dir: str = "data"
    command: str | None = None
    load_per_split: bool = False
    format_error: type[ValueError] = HubFormatError

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_dir", Path(self.local_dir).expanduser().absolute())
        object.__setattr__(self, "columns", tuple(self.columns))
        object.__setattr__(self, "splits", tuple(self.splits))

    @property
    def url(self) -> str:
        return f"https://huggingface.co/datasets/{self.repo}"

    def hub_names(self, split: str) -> tuple[str, ...]:
        """The Hub's name of ``split`` first, then the aliases accepted locally."""
        return HUB_SPLIT_NAMES.get(split, (split,))

    # -- the local copy -------------------------------------------------------------------------
    def files(self, split: str) -> list[Path]:
        """The local parquet shards of ``split``, sorted by path."""
        if not self.local_dir.is_dir():
            return []
        names = self.hub_names(split)
        out = []
        for f in sorted(self.local_dir.rglob("*.parquet")):
            rel = f.relative_to(self.local_dir)
            if is_source_file(rel) and belongs_to_split(rel, names):
                out.append(f)
        return out

    def saved(self) -> bool:
        """Whether ``local_dir`` is a ``save_to_disk`` folder."""
        return (self.local_dir / _SAVED_MARKER).is_file()

    def is_local(self) -> bool:
        """Whether every split is on disk (parquet shards, or a ``save_to_disk`` folder)."""
        return self.saved() or all(self.files(s) for s in self.splits)

    def fingerprint(self) -> list[list[Any]]:
        """``[path, size, mtime_ns]`` of every source file, so changed sources re-prepare caches.

        The shards of each split in turn, or every file of a ``save_to_disk`` folder; paths are
        relative to ``local_dir`` (moving the folder keeps the key).
        """
        return file_fingerprint(self.source_files(), self.local_dir)

    def source_files(self) -> list[Path]:
        """Every local source file: the shards of each split in turn, or the files of a
        ``save_to_disk`` folder (what prepared caches record the checksums of)."""
        if all(self.files(s) for s in self.splits):
            return [f for s in self.splits for f in self.files(s)]
        if self.local_dir.is_dir():
            return sorted(
                p
                for p in self.local_dir.rglob("*")
                if p.is_file() and is_source_file(p.relative_to(self.local_dir))
            )
        return []

    # -- fetching -------------------------------------------------------------------------------
    def fetch_path(self, split: str) -> Path:
        """Where :meth:`fetch` writes ``split`` (and where "missing" messages ask for it)."""
        return (
            self.local_dir / self.fetch_dir / f"{self.hub_names(split)[0]}-00000-of-00001.parquet"
        )

    def require(
        self, *, download: bool = True, cache_dir: str | os.PathLike[str] | None = None
    ) -> None:
        """Make sure every split is on disk, fetching the missing ones when allowed and online.

        Offline (``HF_HUB_OFFLINE``/``MEGALAB_OFFLINE``), with ``download=False`` or when the Hub
        cannot be reached, raises :class:`DatasetMissingError` saying what to fetch and where to
        put it; errors from inside ``datasets`` are summarised in that message, not re-raised.
        ``cache_dir`` is the download cache of ``datasets``.
        """
        if self.saved():
            return
        absent = [s for s in self.splits if not self.files(s)]
        if not absent:
            return
        if not download:
            reason = "automatic download is off (data.download=false)"
        elif is_offline():
            reason = "offline mode is on (HF_HUB_OFFLINE / MEGALAB_OFFLINE); unset it to download"
        else:
            log.info("fetching %s from the Hugging Face Hub into %s", self.repo, self.local_dir)
            try:
                with quiet_hub_client() as messages:
                    self.fetch(absent, cache_dir=cache_dir)
                return
            except (HubFormatError, self.format_error):
                raise
            except Exception as e:  # anything from the Hub client means "not available"
                reason = f"fetching from the Hub failed: {type(e).__name__}: {e}"
                if messages:
                    reason += f" ({client_summary(messages)})"
        present = [self.hub_names(s)[0] for s in self.splits if s not in absent]
        if present:
            absent_names = ", ".join(self.hub_names(s)[0] for s in absent)
            reason = (
                f"local shards found for {', '.join(present)} but none for {absent_names}; "
                + reason
            )
        raise self.missing(reason, absent) from None

    def fetch(
        self,
        splits: Sequence[str] | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> list[Path]:
        """Fetch ``splits`` (default: all) with ``datasets.load_dataset`` into :meth:`fetch_path`.

        Each split is checked for the columns, written to a temporary name and then renamed, so
        a file under its final name is complete. Returns the files written.
        """
        wanted = list(self.splits if splits is None else splits)
        whole = None if self.load_per_split else self._load(cache_dir)
        written = []
        for split in wanted:
            if whole is None:
                ds = self._load(cache_dir, split=self.hub_names(split)[0])
            else:
                ds = self._pick_split(whole, split, f"the Hub dataset {self.repo}")
            self._check_columns(ds.column_names, f"the Hub dataset {self.repo} ({split})")
            path = self.fetch_path(split)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            ds.to_parquet(str(tmp))
            os.replace(tmp, path)
            written.append(path)
        return written

    def _load(self, cache_dir: str | os.PathLike[str] | None, split: str | None = None) -> Any:
        """``datasets.load_dataset`` of the repository; the parquet export for script-only ones.

        Only the options that are set are passed (the defaults of ``datasets`` otherwise).
        """
        import datasets

        args = [self.repo] + ([self.config] if self.config else [])
        kwargs: dict[str, Any] = {}
        if split is not None:
            kwargs["split"] = split
        if cache_dir is not None:
            kwargs["cache_dir"] = str(cache_dir)
        if self.revision is not None:
            kwargs["revision"] = self.revision
        try:
            return datasets.load_dataset(*args, **kwargs)
        except Exception as e:  # scripts are no longer run: fall back to the parquet export
            if self.revision is not None or "script" not in str(e).lower():
                raise
            log.info("%s: reading the parquet export %s", self.repo, PARQUET_EXPORT)
            return datasets.load_dataset(*args, **kwargs, revision=PARQUET_EXPORT)

    def missing(
        self, reason: str | None, splits: Sequence[str] | None = None
    ) -> DatasetMissingError:
        """The :class:`DatasetMissingError` for ``splits``: what, why, from where, to which path."""
        splits = list(self.splits if splits is None else splits)
        # A folder named after the config is the Hub's folder of that config: the repository's
        # files then go to its parent.
        root = self.local_dir
        if self.config and root.name == self.config:
            root = root.parent
        include = f"{self.config}/*" if self.config else "*.parquet"
        rev = f" --revision {self.revision}" if self.revision else ""
        hub_names = ", ".join(self.hub_names(s)[0] for s in splits)
        how = []
        if self.command:
            how.append(
                f"Run `{self.command}` while online (it fetches {self.repo} with "
                "`datasets.load_dataset` and writes the files listed above), or"
            )
        how += [
            f"download the Hub's parquet files of {self.repo} ({hub_names} splits), e.g.",
            f"  huggingface-cli download {self.repo} --repo-type dataset{rev} "
            f"--include '{include}' --local-dir {root}",
            f"(shards named `<split>-*.parquet` or in a `<split>/` folder anywhere below "
            f"{self.local_dir} are found; for a repository that holds only a loading script, "
            f"add `--revision {PARQUET_EXPORT}`),",
            f"or put a `save_to_disk` copy of the dataset in {self.local_dir}.",
        ]
        return DatasetMissingError(
            _missing_message(
                dataset=self.name,
                missing=[self.fetch_path(s) for s in splits],
                how="\n".join(how),
                url=self.url,
                reason=reason,
            )
        )

    # -- reading --------------------------------------------------------------------------------
    def _check_columns(self, names: Sequence[str], where: str) -> None:
        missing = [c for c in self.columns if c not in names]
        if missing:
            absent = " or ".join(repr(c) for c in missing)
            raise self.format_error(
                f"{self.name}: {where}: missing column(s) {missing}: it has no column {absent}, "
                f"only {list(names)}. Expected the Hub's {self.repo} data with the columns "
                f"{list(self.columns)}"
            )

    def _check_file(self, path: Path) -> None:
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as e:
            raise self.format_error(
                f"{self.name}: cannot read {path} as parquet ({e}); the file is damaged or not a "
                "parquet file: delete it and download it again"
            ) from e
        self._check_columns(names, str(path))

    def _saved_split(self, split: str) -> Any:
        """One split of the ``save_to_disk`` copy, with the columns only."""
        import datasets

        dd = datasets.load_from_disk(str(self.local_dir))
        ds = self._pick_split(dd, split, f"{self.local_dir}: the saved dataset")
        self._check_columns(ds.column_names, f"{self.local_dir} ({split})")
        return ds.select_columns(list(self.columns))

    def _pick_split(self, dd: Any, split: str, where: str) -> Any:
        """`split` of a DatasetDict under the first of its Hub names that `dd` has."""
        found = [n for n in self.hub_names(split) if n in dd]
        if not found:
            raise self.format_error(
                f"{where} has no {self.hub_names(split)[0]!r} split (it has {list(dd)})"
            )
        return dd[found[0]]

    def _source(self, split: str) -> list[Path] | Any:
        files = self.files(split)
        if files:
            return files
        if self.saved():
            return self._saved_split(split)
        raise self.missing(f"no local copy of the {self.hub_names(split)[0]} split", [split])

    def table(self, split: str) -> Any:
        """The whole of ``split`` as a ``pyarrow.Table`` of :attr:`columns`."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = self._source(split)
        if not isinstance(source, list):
            return source.with_format("arrow")[:]
        tables = []
        for f in source:
            self._check_file(f)
            tables.append(pq.read_table(f, columns=list(self.columns)))
        return pa.concat_tables(tables) if len(tables) > 1 else tables[0]

    def num_rows(self, split: str) -> int:
        source = self._source(split)
        if not isinstance(source, list):
            return len(source)
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in source)

    def rows(self, split: str, batch_size: int = 64) -> Iterator[dict[str, Any]]:
        """Yield the rows of ``split`` (dicts of :attr:`columns`) in order, reading in batches."""
        source = self._source(split)
        if not isinstance(source, list):
            for batch in source.with_format("arrow").iter(batch_size):
                yield from batch.to_pylist()
            return
        import pyarrow.parquet as pq

        for path in source:
            self._check_file(path)
            for batch in pq.ParquetFile(path).iter_batches(
                batch_size=batch_size, columns=list(self.columns)
            ):
                yield from batch.to_pylist()

    def texts(self, split: str, batch_size: int = 64) -> Iterator[str]:
        """The first column of ``split`` as strings (a null is an empty string)."""
        column = self.columns[0]
        for row in self.rows(split, batch_size):
            text = row[column]
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise self.format_error(
                    f"{self.name}: column {column!r} of the {split} split holds "
                    f"{type(text).__name__}, not text"
                )
            yield text
