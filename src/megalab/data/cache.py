"""Prepared-data caches: where they live, when they are finished, and that they stay intact.

A prepared cache is `<data_dir>/prepared/<name>/<hash>/`: `cache_dir` hashes the preprocessing
parameters, so changing one re-prepares; `mark_prepared` writes the completion marker last, and
`prepared` tells a finished cache from a half-written one. A prepared cache is trusted by
training for months. Its completion marker (`.complete`) records, besides what the dataset
module wrote there, the size and SHA-256 of every file of the cache and of the source files it
was prepared from (`record_integrity`). Then:

- Every load checks the cheap invariants: the files are there with their recorded sizes (a
  truncated file would fail deep in `mmap`), `.npy` headers parse with the expected dtype, token
  ids and labels are in range (`check_npy`, `check_range`, called by the dataset modules).
- The first load verifies the full checksums of the cache and its sources, once: it records the
  files' status (size, times, inode) in `.verified`, and verifies again only when a file's
  status changes, which any write does (an in-place edit that restores the size and mtime still
  changes the ctime). The log says when this one-time cost is paid.
- `megalab-data verify --root <data root>` verifies every cache below a root in full.
- Sources are recorded by their path relative to the cache folder (with the absolute path
  beside it): a data root moved or copied elsewhere checks the moved files, not the old place.

Problems raise `CacheError` with the file, what is wrong, and how to rebuild the cache.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from megalab.data.files import file_digest, json_default, short_hash, write_atomic
from megalab.utils.errors import UserError

log = logging.getLogger(__name__)

MARKER = ".complete"
STAMP = ".verified"
_SKIP = {MARKER, STAMP, "params.json"}
INTEGRITY_KEY = "integrity"
#: Bumped when the layout of prepared caches changes, so old caches are not reused.
CACHE_FORMAT_VERSION = 1


class CacheError(UserError, RuntimeError):
    """A prepared cache (or the source it came from) is damaged or changed."""


def rebuild_hint(cache: Path) -> str:
    return (
        f"Delete {cache} and run again: it is rebuilt from the source files "
        f"(`megalab-data verify --root <data root>` checks every cache)"
    )


# -- where prepared data lives ------------------------------------------------------------------
# Where prepared caches may be written: anywhere (None), or only below one folder. Evaluation
# writes nothing outside its output folder (`caches_written_under`): a cache the data folder
# lacks is prepared below the output folder instead, and a finished one is read in place
# without writing its verification stamp there.
_WRITE_ROOT: Path | None = None


@contextlib.contextmanager
def caches_written_under(folder: str | os.PathLike[str]) -> Iterator[Path]:
    """Within this context prepared caches are written only below `<folder>/prepared`."""
    global _WRITE_ROOT
    before = _WRITE_ROOT
    _WRITE_ROOT = Path(folder).expanduser().absolute() / "prepared"
    try:
        yield _WRITE_ROOT
    finally:
        _WRITE_ROOT = before


def may_write(path: str | os.PathLike[str]) -> bool:
    """Whether a cache folder may be written to (`caches_written_under`)."""
    return _WRITE_ROOT is None or Path(path).absolute().is_relative_to(_WRITE_ROOT)


def cache_dir(
    root: str | os.PathLike[str], name: str, params: Mapping[str, Any], *, version: int = 0
) -> Path:
    """Directory ``<root>/<name>/<hash>`` for data prepared with ``params``; created if needed.

    The hash covers the JSON form of ``params`` (keys sorted), :data:`CACHE_FORMAT_VERSION` and
    the dataset's own ``version``, so changing any preprocessing parameter (or the on-disk
    format) selects a fresh directory. ``params.json`` inside records the parameters for
    humans. Use :func:`prepared` / :func:`mark_prepared` to know whether preparation finished.
    """
    key = {"format": CACHE_FORMAT_VERSION, "version": version, "params": dict(params)}
    path = Path(root).expanduser().absolute() / name / short_hash(key)
    if not may_write(path):
        if (path / MARKER).is_file():
            return path  # finished: read in place, nothing written there
        assert _WRITE_ROOT is not None
        path = _WRITE_ROOT / name / short_hash(key)
        if not path.exists():  # said once: the folder is made below
            log.info(
                "preparing %s data under %s (the data folder is not written)", name, path.parent
            )
    path.mkdir(parents=True, exist_ok=True)
    text = json.dumps(key, sort_keys=True, indent=2, default=json_default) + "\n"
    pfile = path / "params.json"
    if not pfile.exists() or pfile.read_text() != text:
        write_atomic(pfile, text)
    return path


def prepared(path: str | os.PathLike[str]) -> bool:
    """Whether :func:`mark_prepared` was called on ``path`` (the preparation finished).

    A finished cache is checked on the way (:func:`check_cache`: sizes every time, checksums
    once and after any change); a damaged one raises :class:`CacheError` saying how to rebuild
    it.
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        return False
    check_cache(path)
    return True


def mark_prepared(
    path: str | os.PathLike[str],
    info: Mapping[str, Any] | None = None,
    *,
    sources: Iterable[str | os.PathLike[str]] = (),
    checksums: bool = True,
) -> None:
    """Write the completion marker of ``path``; call it last, after every file is written.

    With ``checksums`` the marker also records the size and SHA-256 of every file in ``path``
    and of the ``sources`` it was prepared from (module doc).
    """
    path = Path(path)
    body = dict(info or {})
    if checksums:
        body[INTEGRITY_KEY] = record_integrity(path, sources)
        write_stamp(path, body[INTEGRITY_KEY])
    write_atomic(path / MARKER, json.dumps(body, sort_keys=True, default=json_default) + "\n")


# -- integrity ----------------------------------------------------------------------------------
def _files(cache: Path) -> list[Path]:
    return sorted(
        p
        for p in cache.rglob("*")
        if p.is_file() and p.name not in _SKIP and not p.name.startswith(".")
    )


def _digest(path: Path) -> str:
    return file_digest(path, "sha256")


def _status(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def record_integrity(cache: Path, sources: Iterable[str | os.PathLike[str]] = ()) -> dict[str, Any]:
    """Sizes and SHA-256 of the cache's files and its sources, for the completion marker."""
    files = {
        str(p.relative_to(cache)): {"size": p.stat().st_size, "sha256": _digest(p)}
        for p in _files(cache)
    }
    srcs = {}
    for s in sources:
        p = Path(s).expanduser().absolute()
        if p.is_file():
            srcs[_source_key(cache, p)] = {
                "size": p.stat().st_size,
                "sha256": _digest(p),
                "absolute": str(p),
            }
    return {"files": files, "sources": srcs}


def _source_key(cache: Path, source: Path) -> str:
    """A source's key in the marker: its path relative to the cache folder, which moves with
    the data root the cache lives in."""
    try:
        return Path(os.path.relpath(source, cache.absolute())).as_posix()
    except ValueError:  # another drive (Windows): only the absolute path can name it
        return str(source)


def _locate_source(cache: Path, key: str, entry: Mapping[str, Any]) -> Path | None:
    """Where a recorded source is now: relative to the cache (a moved data root), else at its
    recorded absolute path (a cache kept elsewhere, or a marker keyed by absolute paths, as
    earlier versions wrote); None when it is gone (a source removed after preparing)."""
    # Lexical, as the key was made (os.path.relpath): the folders named need not exist.
    for candidate in (os.path.normpath(cache.absolute() / key), entry.get("absolute")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def write_stamp(cache: Path, integrity: Mapping[str, Any]) -> None:
    """Record the status of every checked file: later loads skip the full checksums."""
    if not may_write(cache):  # read in place by evaluation: verified again next time
        return
    status = {}
    for rel in integrity.get("files", {}):
        status[rel] = _status(cache / rel)
    for key, entry in integrity.get("sources", {}).items():
        found = _locate_source(cache, key, entry)
        if found is not None:
            status[key] = _status(found)
    write_atomic(cache / STAMP, json.dumps(status, sort_keys=True) + "\n")


def read_marker(cache: Path) -> dict[str, Any]:
    try:
        return json.loads((cache / MARKER).read_text() or "{}")
    except (OSError, ValueError):
        raise CacheError(
            f"the completion marker {cache / MARKER} is unreadable. {rebuild_hint(cache)}"
        ) from None


def check_cache(cache: str | os.PathLike[str], full: bool = False) -> bool:
    """Check a prepared cache (module doc); True when checksums were verified now.

    `full` verifies every checksum whatever the stamp says (`megalab-data verify`).
    """
    cache = Path(cache)
    integrity = read_marker(cache).get(INTEGRITY_KEY)
    if not integrity:
        return False  # prepared by an earlier version: nothing recorded to check against
    files: dict[str, dict[str, Any]] = integrity.get("files", {})
    sources: dict[str, dict[str, Any]] = integrity.get("sources", {})
    for rel, want in files.items():
        path = cache / rel
        if not path.is_file():
            raise CacheError(f"{path} is missing from the prepared cache. {rebuild_hint(cache)}")
        size = path.stat().st_size
        if size != want["size"]:
            raise CacheError(
                f"{path} has {size:,} bytes, {want['size']:,} when it was prepared (truncated "
                f"or overwritten). {rebuild_hint(cache)}"
            )
    try:
        stamp = json.loads((cache / STAMP).read_text())
    except (OSError, ValueError):
        stamp = {}
    changed = [rel for rel in files if full or stamp.get(rel) != _status(cache / rel)]
    located = {key: _locate_source(cache, key, entry) for key, entry in sources.items()}
    changed_sources = [
        key
        for key, found in located.items()
        if found is not None and (full or stamp.get(key) != _status(found))
    ]
    if not changed and not changed_sources:
        return False
    total = sum(files[r]["size"] for r in changed) + sum(
        sources[s]["size"] for s in changed_sources
    )
    log.info(
        "verifying the checksums of %s (%.1f MB; done once, and again only if its files change)",
        cache,
        total / 1e6,
    )
    for rel in changed:
        got = _digest(cache / rel)
        if got != files[rel]["sha256"]:
            raise CacheError(
                f"{cache / rel} is corrupt: its SHA-256 differs from the one recorded when the "
                f"cache was prepared ({files[rel]['sha256'][:16]}... vs {got[:16]}...). "
                f"{rebuild_hint(cache)}"
            )
    for key in changed_sources:
        src = located[key]
        assert src is not None  # only located sources are checked
        got = _digest(src)
        if got != sources[key]["sha256"]:
            raise CacheError(
                f"the source file {src} changed since the cache {cache} was prepared from it "
                "(its SHA-256 differs): the cache holds the old content. If the new file is "
                f"right, delete {cache} to rebuild the cache from it; otherwise restore the "
                "original file"
            )
    write_stamp(cache, integrity)
    return True


def verify_all(root: str | os.PathLike[str]) -> tuple[list[Path], list[str]]:
    """Fully verify every prepared cache below `root`: (caches checked, problems)."""
    checked, problems = [], []
    for marker in sorted(Path(root).rglob(MARKER)):
        cache = marker.parent
        if not (cache / "params.json").is_file():
            continue  # not a prepared cache (e.g. a generated dataset's own marker)
        try:
            check_cache(cache, full=True)
            check_arrays(cache)
        except CacheError as err:
            problems.append(str(err))
        checked.append(cache)
    return checked, problems


# -- cheap invariants ----------------------------------------------------------------------------
def check_npy(
    path: Path, dtype: Any = None, ndim: int | None = None, cache: Path | None = None
) -> None:
    """The `.npy` header of `path` parses (with `dtype`/`ndim` when given) and fits its size."""
    cache = cache or path.parent
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, found = np.lib.format.read_array_header_1_0(f)
            else:
                shape, _, found = np.lib.format.read_array_header_2_0(f)
            offset = f.tell()
    except (OSError, ValueError) as err:
        raise CacheError(
            f"{path} does not start with a valid .npy header ({err}). {rebuild_hint(cache)}"
        ) from None
    if np.dtype(found).hasobject:  # np.load(allow_pickle=False) would fail with numpy's error
        raise CacheError(
            f"{path} holds Python objects (dtype {found}), which megalab never writes nor loads "
            f"(unpickling them could run code): the file was replaced. {rebuild_hint(cache)}"
        )
    if dtype is not None and np.dtype(found) != np.dtype(dtype):
        raise CacheError(f"{path} holds {found}, not {np.dtype(dtype)}. {rebuild_hint(cache)}")
    if ndim is not None and len(shape) != ndim:
        raise CacheError(f"{path} has shape {shape}, not {ndim}-D. {rebuild_hint(cache)}")
    need = offset + int(np.prod(shape, dtype=np.int64)) * np.dtype(found).itemsize
    size = path.stat().st_size
    if size < need:
        raise CacheError(
            f"{path} is truncated: its header announces {need:,} bytes, the file has {size:,}. "
            f"{rebuild_hint(cache)}"
        )


def check_range(
    values: np.ndarray, lo: int, hi: int, what: str, path: Path, cache: Path | None = None
) -> None:
    """Every value in [lo, hi): token ids below the vocabulary, labels below the classes."""
    if values.size == 0:
        return
    vmin, vmax = int(values.min()), int(values.max())
    if vmin < lo or vmax >= hi:
        bad = vmin if vmin < lo else vmax
        raise CacheError(
            f"{path} holds {what} {bad}, outside [{lo}, {hi}): the file is corrupt or was "
            f"prepared with other settings. {rebuild_hint(cache or path.parent)}"
        )


def check_offsets(offsets: np.ndarray, total: int, path: Path, cache: Path | None = None) -> None:
    """Offsets start at 0, never decrease, and end at the token count."""
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != total or (np.diff(offsets) < 0).any():
        raise CacheError(
            f"{path} does not index the {total:,} tokens beside it (offsets must rise from 0 to "
            f"the token count). {rebuild_hint(cache or path.parent)}"
        )


def check_tokens(
    tokens: np.ndarray,
    offsets: np.ndarray,
    vocab_size: int | None,
    tokens_path: Path,
    offsets_path: Path,
    cache: Path | None = None,
) -> None:
    """Flat token sequences: `offsets` index `tokens` (`check_offsets`), and the token ids are
    below `vocab_size` when one is given (`check_range`)."""
    check_offsets(offsets, len(tokens), offsets_path, cache)
    if vocab_size is not None:
        check_range(tokens, 0, vocab_size, "token id", tokens_path, cache)


def check_arrays(cache: Path) -> None:
    """The `.npy` headers of every array in a cache parse and fit their files."""
    for path in sorted(cache.glob("*.npy")):
        check_npy(path, cache=cache)


def fresh_cache(cache: Path) -> None:
    """Empty a cache directory left half-written by an interrupted preparation."""
    for p in cache.iterdir():
        if p.name != "params.json":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
