"""Archive extraction for the dataset modules, standard library only (``tarfile``, ``zipfile``).

:func:`extract` unpacks ``.tar``/``.tar.gz``/``.tgz``/``.tar.bz2``/``.tar.xz``/``.zip`` archives
and single ``.gz`` files, refusing members that would land outside the destination, and marks
completion so that an interrupted extraction is redone.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from megalab.data.files import short_hash, write_atomic
from megalab.utils.errors import UserError

__all__ = ["UnsafeArchiveError", "extract"]

_COMPLETE = ".complete"  # the suffix of `extract`'s marker, `.<archive name>.complete`


class UnsafeArchiveError(UserError, ValueError):
    """An archive member would be written outside the extraction directory."""


def _archive_kind(archive: Path) -> str:
    name = archive.name.lower()
    for suffix, kind in (
        (".tar.gz", "tar"),
        (".tgz", "tar"),
        (".tar.bz2", "tar"),
        (".tbz2", "tar"),
        (".tar.xz", "tar"),
        (".txz", "tar"),
        (".tar", "tar"),
        (".zip", "zip"),
        (".gz", "gz"),
    ):
        if name.endswith(suffix):
            if kind == "gz" and tarfile.is_tarfile(archive):
                # Some official tarballs are named ``*.gz`` (LRA's ``lra_release.gz``).
                return "tar"
            return kind
    if tarfile.is_tarfile(archive):
        return "tar"
    if zipfile.is_zipfile(archive):
        return "zip"
    raise ValueError(f"Cannot tell the archive type of {archive}")


def _safe_relpath(name: str, archive: Path) -> PurePosixPath:
    """The member's path relative to the destination; raise if it could escape it."""
    norm = name.replace("\\", "/")
    p = PurePosixPath(norm)
    if p.is_absolute() or re.match(r"^[A-Za-z]:", norm) or ".." in p.parts:
        raise UnsafeArchiveError(
            f"Refusing to extract {archive}: member {name!r} would be written outside the "
            f"destination directory."
        )
    parts = [q for q in p.parts if q not in ("", ".")]
    return PurePosixPath(*parts) if parts else PurePosixPath(".")


def _selected(rel: PurePosixPath, members: set[PurePosixPath] | None) -> bool:
    if members is None:
        return True
    return any(rel == m or m in rel.parents for m in members)


def _check_tar_members(tf: tarfile.TarFile, archive: Path) -> list[tarfile.TarInfo]:
    out = []
    for m in tf.getmembers():
        rel = _safe_relpath(m.name, archive)
        if m.issym() or m.islnk():
            target = PurePosixPath(m.linkname.replace("\\", "/"))
            base = rel.parent if m.issym() else PurePosixPath(".")
            joined = target if target.is_absolute() else base / target
            depth = 0
            for part in joined.parts:
                if part == "..":
                    depth -= 1
                elif part not in ("", "."):
                    depth += 1
                if depth < 0:
                    break
            if target.is_absolute() or depth < 0:
                raise UnsafeArchiveError(
                    f"Refusing to extract {archive}: link {m.name!r} -> {m.linkname!r} points "
                    f"outside the destination directory."
                )
        elif not (m.isfile() or m.isdir()):
            raise UnsafeArchiveError(
                f"Refusing to extract {archive}: member {m.name!r} is a device, FIFO or other "
                f"special file."
            )
        out.append(m)
    return out


def _extract_tar(archive: Path, tmp: Path, members: set[PurePosixPath] | None) -> None:
    with tarfile.open(archive, "r:*") as tf:
        chosen = [
            m
            for m in _check_tar_members(tf, archive)
            if _selected(_safe_relpath(m.name, archive), members)
        ]
        kwargs: dict[str, Any] = {}
        if hasattr(tarfile, "data_filter"):
            kwargs["filter"] = "data"
        tf.extractall(tmp, members=chosen, **kwargs)


def _extract_zip(archive: Path, tmp: Path, members: set[PurePosixPath] | None) -> None:
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            rel = _safe_relpath(info.filename, archive)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise UnsafeArchiveError(
                    f"Refusing to extract {archive}: member {info.filename!r} is a symbolic link."
                )
            if not _selected(rel, members):
                continue
            target = tmp / rel
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)


def _extract_gz(archive: Path, tmp: Path) -> None:
    name = archive.name[:-3] if archive.name.lower().endswith(".gz") else archive.name + ".out"
    with gzip.open(archive, "rb") as src, open(tmp / name, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def extract(
    archive: str | os.PathLike[str],
    dest_dir: str | os.PathLike[str],
    *,
    members: Iterable[str] | None = None,
) -> Path:
    """Extract ``archive`` into ``dest_dir`` safely and at most once; return ``dest_dir``.

    Handles ``.tar`` (plain, gzip, bzip2, xz), ``.zip`` and single-file ``.gz``. Members with
    absolute paths or ``..``, links pointing out of the tree and special files are rejected with
    :class:`UnsafeArchiveError` before anything is written. ``members`` restricts extraction to
    the given member paths (a directory selects everything below it).

    The archive is unpacked into a temporary directory inside ``dest_dir``, its top-level
    entries are then moved into place and a ``.<archive name>.complete`` marker is written last;
    an interrupted extraction has no marker and is redone from scratch on the next call.
    """
    archive = Path(archive).expanduser().absolute()
    dest_dir = Path(dest_dir).expanduser().absolute()
    selected = None if members is None else {_safe_relpath(m, archive) for m in members}
    tag = (
        archive.name
        if selected is None
        else archive.name + "-" + short_hash(sorted(map(str, selected)))
    )
    marker = dest_dir / f".{tag}{_COMPLETE}"
    if marker.exists():
        return dest_dir
    if not archive.exists():
        raise FileNotFoundError(f"Archive not found: {archive}")
    kind = _archive_kind(archive)
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest_dir / f".{tag}.extracting"
    _remove(tmp)
    tmp.mkdir()
    try:
        if kind == "tar":
            _extract_tar(archive, tmp, selected)
        elif kind == "zip":
            _extract_zip(archive, tmp, selected)
        else:
            _extract_gz(archive, tmp)
        for entry in sorted(tmp.iterdir()):
            target = dest_dir / entry.name
            _remove(target)  # left over from an interrupted earlier extraction
            os.replace(entry, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_atomic(marker, json.dumps({"archive": str(archive)}) + "\n")
    return dest_dir
