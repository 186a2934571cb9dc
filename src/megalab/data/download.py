"""Downloads, archive extraction and prepared-data caching shared by every dataset.

Everything here uses the standard library only (``urllib``, ``tarfile``, ``zipfile``), so a
dataset can fetch its official files without extra dependencies:

- :func:`download` streams a URL (``http``, ``https`` or ``file``) to ``<dest>.part``, resumes an
  interrupted transfer with a ``Range`` request, verifies SHA-256/MD5 digests and only then
  renames the file to its final name, so a file under the final name is always complete. Beside
  the ``.part`` a sidecar (``<dest>.part.json``) records the URL, size, ETag and Last-Modified
  of what is being fetched: a transfer resumes (``If-Range``) only when they still match, and a
  transfer whose length the server never states is not taken as complete without a checksum.
- :func:`extract` unpacks ``.tar``/``.tar.gz``/``.tgz``/``.tar.bz2``/``.tar.xz``/``.zip`` archives
  and single ``.gz`` files, refusing members that would land outside the destination, and marks
  completion so that an interrupted extraction is redone.
- :class:`DatasetMissingError` and :func:`require_files` turn "the data is not there" into one
  actionable message (what, from where, to which path) instead of a deep library traceback;
  offline mode (``MEGALAB_OFFLINE``/``HF_HUB_OFFLINE``) or a failed connection yields the same.
- :func:`cache_dir`, :func:`prepared` and :func:`mark_prepared` key prepared data on its
  preprocessing parameters, so changing a parameter re-prepares and a half-written cache is
  never mistaken for a finished one.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from http.client import HTTPException
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

__all__ = [
    "CACHE_FORMAT_VERSION",
    "ChecksumError",
    "DatasetMissingError",
    "DownloadError",
    "UnsafeArchiveError",
    "UnverifiableDownloadError",
    "cache_dir",
    "download",
    "extract",
    "file_digest",
    "is_offline",
    "mark_prepared",
    "prepared",
    "require_files",
]

#: Bumped when the layout of prepared caches changes, so old caches are not reused.
CACHE_FORMAT_VERSION = 1

_USER_AGENT = "megalab-data/0.1 (+python-urllib)"
_OFFLINE_VARS = ("MEGALAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
log = logging.getLogger(__name__)
_COMPLETE = ".complete"
_DATA_DIR_HINT = (
    "The data root is the `paths.data_dir` setting; to keep data elsewhere, run with "
    "`paths.data_dir=/your/data/root` and put the files at the same relative paths there."
)


class DatasetMissingError(Exception):
    """The dataset's files are not on disk and cannot be fetched; the message says what to do."""


class DownloadError(RuntimeError):
    """A download failed in a way the user has to look at (HTTP error, bad transfer)."""


class ChecksumError(DownloadError):
    """The downloaded bytes do not have the expected digest."""


class UnverifiableDownloadError(DownloadError):
    """A transfer ended without any way to tell whether it is complete (no size, no checksum)."""


class UnsafeArchiveError(ValueError):
    """An archive member would be written outside the extraction directory."""


# --------------------------------------------------------------------------- offline / messages


def is_offline() -> bool:
    """Whether ``MEGALAB_OFFLINE``, ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` is truthy."""
    for var in _OFFLINE_VARS:
        if os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}:
            return True
    return False


def _missing_message(
    *,
    dataset: str,
    missing: list[Path],
    how: str,
    url: str | None = None,
    data_dir: Path | None = None,
    reason: str | None = None,
) -> str:
    lines = [f"Dataset '{dataset}' is not available: {len(missing)} required file(s) missing:"]
    lines += [f"  - {p}" for p in missing]
    if reason:
        lines.append(f"Reason: {reason}")
    lines.append("How to get it:")
    lines += [f"  {line}" for line in how.strip().splitlines()]
    if url:
        lines.append(f"Official source: {url}")
    lines.append("Put the files exactly at the path(s) listed above.")
    if data_dir is not None:
        lines.append(f"Current data root: {data_dir}")
    lines.append(_DATA_DIR_HINT)
    return "\n".join(lines)


def require_files(
    paths: Iterable[str | os.PathLike[str]],
    *,
    dataset: str,
    how: str,
    url: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Return ``paths`` as :class:`Path` objects, or raise :class:`DatasetMissingError`.

    The error names every missing file, repeats ``how`` (what to download and how to unpack it),
    the official ``url`` when given, and how to point ``paths.data_dir`` elsewhere.
    """
    resolved = [Path(p).expanduser().absolute() for p in paths]
    missing = [p for p in resolved if not p.exists()]
    if missing:
        raise DatasetMissingError(
            _missing_message(
                dataset=dataset,
                missing=missing,
                how=how,
                url=url,
                data_dir=None if data_dir is None else Path(data_dir).expanduser().absolute(),
            )
        )
    return resolved


def _unreachable_error(
    url: str, dest: Path, dataset: str | None, reason: str, offline: bool = False
) -> DatasetMissingError:
    how = (
        f"Download {url}\nand save it as {dest}"
        + ("" if not offline else "\n(or unset MEGALAB_OFFLINE/HF_HUB_OFFLINE to let it download)")
        + "\nthen run the same command again; checksums are verified before the file is used."
    )
    return DatasetMissingError(
        _missing_message(
            dataset=dataset or dest.name,
            missing=[dest],
            how=how,
            url=url,
            reason=reason,
        )
    )


# --------------------------------------------------------------------------- checksums


def file_digest(
    path: str | os.PathLike[str], algorithm: str = "sha256", chunk: int = 1 << 20
) -> str:
    """Hex digest of a file, read in chunks."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _expected_digests(sha256: str | None, md5: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    if sha256:
        out["sha256"] = sha256.strip().lower()
    if md5:
        out["md5"] = md5.strip().lower()
    return out


def _digest_mismatches(path: Path, expected: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """``{algorithm: (expected, actual)}`` for every digest that does not match."""
    bad = {}
    for algo, want in expected.items():
        got = file_digest(path, algo)
        if got != want:
            bad[algo] = (want, got)
    return bad


# --------------------------------------------------------------------------- download


def _progress_bar(total: int | None, initial: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on a terminal, a do-nothing stand-in otherwise."""
    enabled = enabled and sys.stderr.isatty()
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                leave=False,
            )
        except ImportError:  # pragma: no cover - tqdm is a declared dependency
            pass
    return _NoBar()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _RestartError(Exception):
    """Internal: the partial file cannot be resumed; start over from byte 0."""


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
_META_SUFFIX = ".json"  # <dest>.part.json: what the .part holds the first bytes of


def _meta_path(part: Path) -> Path:
    return part.with_name(part.name + _META_SUFFIX)


def _read_meta(part: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads(_meta_path(part).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _write_meta(part: Path, meta: Mapping[str, Any]) -> None:
    path = _meta_path(part)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(meta), sort_keys=True))
    os.replace(tmp, path)


def _drop_part(part: Path) -> None:
    part.unlink(missing_ok=True)
    _meta_path(part).unlink(missing_ok=True)


def _validator(meta: Mapping[str, Any] | None) -> str | None:
    """The ``If-Range`` value for a recorded response: a strong ETag, else Last-Modified."""
    if not meta:
        return None
    etag = meta.get("etag")
    if etag and not str(etag).startswith("W/"):
        return str(etag)
    return meta.get("last_modified") or None


def _response_meta(url: str, headers: Any, total: int | None) -> dict[str, Any]:
    return {
        "url": url,
        "size": total,
        "etag": headers.get("ETag"),
        "last_modified": headers.get("Last-Modified"),
    }


def _open_http(
    url: str, offset: int, timeout: float, meta: Mapping[str, Any] | None = None
) -> tuple[Any, int, int | None]:
    """Open ``url`` from byte ``offset``; return (response, start offset, total size or None).

    A resumed request carries ``If-Range`` with the recorded ETag or Last-Modified, so a server
    whose file changed sends the whole new file (200) instead of the rest of the old one; a 206
    whose validators or total size differ from the recorded ones restarts the file too.
    """
    headers = {"User-Agent": _USER_AGENT, "Accept-Encoding": "identity"}
    if offset > 0:
        headers["Range"] = f"bytes={offset}-"
        validator = _validator(meta)
        if validator:
            headers["If-Range"] = validator
    req = urllib.request.Request(url, headers=headers)
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset > 0:
            # Range not satisfiable: either the part is already complete or it is junk.
            m = re.search(r"\*/(\d+)", e.headers.get("Content-Range", "") or "")
            same = not meta or not _changed(meta, e.headers, int(m.group(1)) if m else None)
            e.close()
            if m and int(m.group(1)) == offset and same:
                return None, offset, offset
            raise _RestartError() from e
        raise
    status = getattr(resp, "status", 200)
    length = resp.headers.get("Content-Length")
    if offset > 0 and status == 206:
        m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", "") or "")
        total = None if not m or m.group(3) == "*" else int(m.group(3))
        if not m or int(m.group(1)) != offset or (meta and _changed(meta, resp.headers, total)):
            resp.close()
            raise _RestartError()
        return resp, offset, total
    # 200 (server ignored Range, the file changed, or a fresh download): the whole file.
    return resp, 0, (int(length) if length is not None else None)


def _changed(meta: Mapping[str, Any], headers: Any, total: int | None) -> bool:
    """Whether a response describes another file than the recorded one."""
    for key, header in (("etag", "ETag"), ("last_modified", "Last-Modified")):
        now = headers.get(header)
        if meta.get(key) and now and now != meta[key]:
            return True
    return meta.get("size") is not None and total is not None and total != meta["size"]


def _head_size(url: str, timeout: float) -> int | None:
    """The size a HEAD request announces (None when it gives none or fails)."""
    req = urllib.request.Request(
        url, method="HEAD", headers={"User-Agent": _USER_AGENT, "Accept-Encoding": "identity"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            length = resp.headers.get("Content-Length")
    except (OSError, HTTPException):
        return None
    try:
        return int(length) if length is not None else None
    except ValueError:
        return None


def _open_file_url(url: str, offset: int) -> tuple[BinaryIO, int, int]:
    path = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
    f = open(path, "rb")  # noqa: SIM115 - closed by the caller
    size = os.fstat(f.fileno()).st_size
    if offset > size:
        f.close()
        raise _RestartError()
    f.seek(offset)
    return f, offset, size


def _transfer(
    url: str,
    part: Path,
    *,
    chunk_size: int,
    timeout: float,
    progress: bool,
    desc: str,
    verified: bool = False,
    size: int | None = None,
) -> bool:
    """Append the rest of ``url`` to ``part``. Returns whether an existing partial was resumed.

    A partial file is resumed only when its sidecar says it holds the start of this URL's
    current file (same ETag/Last-Modified, checked by the server through ``If-Range`` and here),
    or, without validators (or without a sidecar: an older partial file), when a checksum will
    verify the result (``verified``); otherwise it restarts from byte 0. Raises on network
    errors (the partial file is kept for the next attempt) and on a body shorter than its
    announced, recorded (earlier response, HEAD request) or expected (``size``) length; raises
    :class:`UnverifiableDownloadError` when no length is known at all and nothing verifies it.
    """
    meta = _read_meta(part)
    offset = part.stat().st_size if part.exists() else 0
    same_url = meta is None or meta.get("url") == url
    if offset and not (same_url and (_validator(meta) or verified)):
        _drop_part(part)  # bytes of an unknown or unidentifiable file: start over
        meta, offset = None, 0
    total: int | None
    scheme = urllib.parse.urlparse(url).scheme.lower()
    if scheme == "file":
        src, start, total = _open_file_url(url, offset)
        headers: Any = {}
    else:
        src, start, total = _open_http(url, offset, timeout, meta)
        if src is None:  # the partial file already holds the whole body
            return True
        headers = src.headers
    resumed = start > 0
    if not resumed:
        meta = _response_meta(url, headers, total)
        _write_meta(part, meta)
    elif meta is not None and meta.get("size") is None and total is not None:
        _write_meta(part, {**meta, "size": total})
    mode = "ab" if resumed else "wb"
    bar = _progress_bar(total, start, desc, progress)
    received = start
    try:
        with src, open(part, mode) as out:
            if not resumed:
                out.truncate(0)
            while True:
                block = src.read(chunk_size)
                if not block:
                    break
                out.write(block)
                received += len(block)
                bar.update(len(block))
    finally:
        bar.close()
    if total is None:  # no Content-Length: the size recorded earlier, or a HEAD request's
        total = (meta or {}).get("size") or (
            _head_size(url, timeout) if scheme in ("http", "https") else None
        )
        if total is not None and meta is not None:
            _write_meta(part, {**meta, "size": total})
    if total is not None and received != total:
        raise DownloadError(
            f"Transfer of {url} ended after {received} of {total} bytes (connection cut)."
        )
    if size is not None and received != size:
        raise DownloadError(f"Transfer of {url} gave {received} bytes; the file has {size}.")
    if total is None and size is None and not verified:
        raise UnverifiableDownloadError(
            f"Downloaded {received} bytes of {url}, but cannot tell whether that is the whole "
            "file: the server states no length (not even for a HEAD request) and no checksum "
            "or size is known for it."
        )
    return resumed


def _is_local(url: str) -> bool:
    """``file://`` URLs and loopback hosts: local mirrors that offline mode still allows."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme.lower() == "file":
        return True
    return (parsed.hostname or "").lower() in {"localhost", "127.0.0.1", "::1"}


def _is_connection_failure(exc: BaseException) -> bool:
    """URL errors that mean "cannot reach the host" rather than "the server said no"."""
    if isinstance(exc, urllib.error.HTTPError):
        return False
    if isinstance(exc, urllib.error.URLError):
        return True
    return isinstance(exc, (socket.gaierror, ConnectionRefusedError))


def download(
    url: str,
    dest: str | os.PathLike[str],
    *,
    sha256: str | None = None,
    md5: str | None = None,
    size: int | None = None,
    progress: bool = True,
    chunk_size: int = 1 << 20,
    timeout: float = 60.0,
    retries: int = 3,
    backoff: float = 1.0,
    dataset: str | None = None,
) -> Path:
    """Download ``url`` to ``dest`` (resumable, verified, atomic) and return ``dest``.

    Bytes go to ``<dest>.part``, described by ``<dest>.part.json`` (URL, size, ETag,
    Last-Modified); an existing ``.part`` is resumed with ``Range: bytes=N-`` and ``If-Range``
    only while those match (a server answering 200 instead of 206, a changed ETag or size, or a
    ``.part`` of unknown origin without a checksum to verify it restart the file cleanly). A
    body without ``Content-Length`` is checked against the size recorded from an earlier
    response or a HEAD request, or ``size``; with none of them and no checksum the file is not
    accepted (:class:`UnverifiableDownloadError`; its bytes are kept as ``<dest>.unverified``).
    After the body is complete
    the SHA-256 and/or MD5 digests are checked, and only a verified file is renamed to ``dest``
    with :func:`os.replace`. A bad file is moved to ``<dest>.corrupt`` and :class:`ChecksumError`
    names the URL and both digests. If ``dest`` already exists (and matches the digests when
    given) nothing is downloaded. ``file://`` URLs (and loopback hosts) serve local mirrors.

    Network failures are retried ``retries`` times with exponential ``backoff`` seconds, keeping
    the partial file. In offline mode (``MEGALAB_OFFLINE``/``HF_HUB_OFFLINE``; local mirrors
    still work) or when the host
    cannot be reached, :class:`DatasetMissingError` says which file to fetch and where to put it;
    ``dataset`` names the dataset in that message.
    """
    scheme = urllib.parse.urlparse(url).scheme.lower()
    if scheme not in {"http", "https", "file"}:
        raise DownloadError(f"Unsupported URL scheme {scheme!r} in {url} (use http, https or file)")
    dest = Path(dest).expanduser().absolute()
    expected = _expected_digests(sha256, md5)
    part = dest.with_name(dest.name + ".part")
    corrupt = dest.with_name(dest.name + ".corrupt")

    if dest.exists():
        if not expected or not _digest_mismatches(dest, expected):
            return dest
        # A stale or damaged file under the final name: move it aside and fetch again.
        os.replace(dest, corrupt)

    if is_offline() and not _is_local(url):
        raise _unreachable_error(url, dest, dataset, "offline mode is on", offline=True)

    dest.parent.mkdir(parents=True, exist_ok=True)
    desc = dest.name if len(dest.name) <= 40 else dest.name[:37] + "..."
    attempt = 0
    restarted_after_mismatch = False
    while True:
        try:
            resumed = _transfer(
                url,
                part,
                chunk_size=chunk_size,
                timeout=timeout,
                progress=progress,
                desc=desc,
                verified=bool(expected),
                size=size,
            )
        except _RestartError:
            _drop_part(part)
            continue
        except UnverifiableDownloadError as e:
            unverified = dest.with_name(dest.name + ".unverified")
            os.replace(part, unverified)
            _meta_path(part).unlink(missing_ok=True)
            raise UnverifiableDownloadError(
                f"{e} Nothing was saved as {dest}; the bytes are in {unverified}. Give the "
                f"file's SHA-256 (`sha256=`, `megalab-data ... --sha256`) to have it verified, "
                f"or check it yourself and rename it to {dest}."
            ) from e
        except urllib.error.HTTPError as e:
            if e.code < 500 or attempt >= retries:
                raise DownloadError(
                    f"Downloading {url} failed: HTTP {e.code} {e.reason}. "
                    f"If the file has moved, download it by hand and save it as {dest}."
                ) from e
            attempt += 1
            time.sleep(backoff * 2 ** (attempt - 1))
            continue
        except FileNotFoundError as e:
            if urllib.parse.urlparse(url).scheme.lower() == "file":
                raise _unreachable_error(url, dest, dataset, f"local file not found: {e}") from e
            raise
        except (OSError, HTTPException, DownloadError) as e:
            if attempt >= retries:
                if _is_connection_failure(e):
                    reason = f"cannot reach the server ({getattr(e, 'reason', e)})"
                    raise _unreachable_error(url, dest, dataset, reason) from e
                if isinstance(e, DownloadError):
                    raise DownloadError(
                        f"{e} The partial file {part} is kept; run again to resume."
                    ) from e
                raise DownloadError(
                    f"Downloading {url} failed after {retries + 1} attempt(s): {e!r}. "
                    f"The partial file {part} is kept; run again to resume."
                ) from e
            attempt += 1
            time.sleep(backoff * 2 ** (attempt - 1))
            continue

        bad = _digest_mismatches(part, expected) if expected else {}
        if not bad:
            os.replace(part, dest)
            _meta_path(part).unlink(missing_ok=True)
            return dest
        if resumed and not restarted_after_mismatch:
            # The resumed bytes may come from a different version of the file: try once afresh.
            restarted_after_mismatch = True
            _drop_part(part)
            continue
        os.replace(part, corrupt)
        _meta_path(part).unlink(missing_ok=True)
        detail = "; ".join(f"{a}: expected {w}, got {g}" for a, (w, g) in bad.items())
        raise ChecksumError(
            f"Checksum mismatch for {url} ({detail}). The downloaded file was moved to {corrupt} "
            f"and is not used. Delete it and run again; if the mismatch persists, the upstream "
            f"file has changed: check the official source, or download it by hand, verify it, "
            f"and save it as {dest}."
        )


# --------------------------------------------------------------------------- extraction


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
        else archive.name + "-" + _short_hash(sorted(map(str, selected)))
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
    _write_atomic(marker, json.dumps({"archive": str(archive)}) + "\n")
    return dest_dir


# --------------------------------------------------------------------------- prepared-data cache


def _short_hash(obj: Any, n: int = 12) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)
    return hashlib.sha256(blob.encode()).hexdigest()[:n]


def _json_default(obj: Any) -> Any:
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    raise TypeError(f"Cannot use {type(obj).__name__} in cache parameters: {obj!r}")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())
    os.replace(tmp, path)


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
    path = Path(root).expanduser().absolute() / name / _short_hash(key)
    if not may_write(path):
        if (path / _COMPLETE).is_file():
            return path  # finished: read in place, nothing written there
        assert _WRITE_ROOT is not None
        path = _WRITE_ROOT / name / _short_hash(key)
        log.info("preparing %s data under %s (the data folder is not written)", name, path.parent)
    path.mkdir(parents=True, exist_ok=True)
    text = json.dumps(key, sort_keys=True, indent=2, default=_json_default) + "\n"
    pfile = path / "params.json"
    if not pfile.exists() or pfile.read_text() != text:
        _write_atomic(pfile, text)
    return path


def prepared(path: str | os.PathLike[str]) -> bool:
    """Whether :func:`mark_prepared` was called on ``path`` (the preparation finished).

    A finished cache is checked on the way (:func:`megalab.data.cache.check_cache`: sizes every
    time, checksums once and after any change); a damaged one raises
    :class:`megalab.data.cache.CacheError` saying how to rebuild it.
    """
    path = Path(path)
    if not (path / _COMPLETE).is_file():
        return False
    from megalab.data.cache import check_cache

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
    and of the ``sources`` it was prepared from (:mod:`megalab.data.cache`).
    """
    path = Path(path)
    body = dict(info or {})
    if checksums:
        from megalab.data.cache import INTEGRITY_KEY, record_integrity, write_stamp

        body[INTEGRITY_KEY] = record_integrity(path, sources)
        write_stamp(path, body[INTEGRITY_KEY])
    _write_atomic(path / _COMPLETE, json.dumps(body, sort_keys=True, default=_json_default) + "\n")
