"""Fetching a dataset's official files, and saying what to do when they cannot be fetched.

Everything here uses the standard library only (``urllib``), so a dataset can fetch its official
files without extra dependencies:

- :func:`download` streams a URL (``http``, ``https`` or ``file``) to ``<dest>.part``, resumes an
  interrupted transfer with a ``Range`` request, verifies SHA-256/MD5 digests and only then
  renames the file to its final name, so a file under the final name is always complete. Beside
  the ``.part`` a sidecar (``<dest>.part.json``) records the URL, size, ETag and Last-Modified
  of what is being fetched: a transfer resumes (``If-Range``) only when they still match, and a
  transfer whose length the server never states is not taken as complete without a checksum.
- :class:`DatasetMissingError` and :func:`require_files` turn "the data is not there" into one
  actionable message (what, from where, to which path) instead of a deep library traceback;
  offline mode (``MEGALAB_OFFLINE``/``HF_HUB_OFFLINE``) or a failed connection yields the same.

Archives are unpacked by :mod:`megalab.data.archives`; prepared data is kept by
:mod:`megalab.data.cache`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from http.client import HTTPException
from pathlib import Path
from typing import Any, BinaryIO

from megalab.data.files import file_digest
from megalab.utils.errors import UserError

__all__ = [
    "ChecksumError",
    "DatasetMissingError",
    "DownloadError",
    "UnverifiableDownloadError",
    "download",
    "is_offline",
    "require_files",
]

_USER_AGENT = "megalab-data/0.1 (+python-urllib)"
_OFFLINE_VARS = ("MEGALAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
log = logging.getLogger(__name__)
_DATA_DIR_HINT = (
    "The data root is the `paths.data_dir` setting; to keep data elsewhere, run with "
    "`paths.data_dir=/your/data/root` and put the files at the same relative paths there."
)


class DatasetMissingError(UserError):
    """The dataset's files are not on disk and cannot be fetched; the message says what to do."""


class DownloadError(UserError, RuntimeError):
    """A download failed in a way the user has to look at (HTTP error, bad transfer)."""


class ChecksumError(DownloadError):
    """The downloaded bytes do not have the expected digest."""


class UnverifiableDownloadError(DownloadError):
    """A transfer ended without any way to tell whether it is complete (no size, no checksum)."""


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


def _after_backoff(attempt: int, backoff: float) -> int:
    """Wait before the next try (backoff · 2^attempt seconds) and return its number."""
    time.sleep(backoff * 2**attempt)
    return attempt + 1


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

    found = ""  # what became of a file already at `dest` that failed its checksum
    if dest.exists():
        stale = _digest_mismatches(dest, expected) if expected else {}
        if not stale:
            return dest
        # A stale or damaged file under the final name: move it aside and fetch again.
        os.replace(dest, corrupt)
        detail = "; ".join(f"{a}: expected {w}, got {g}" for a, (w, g) in stale.items())
        found = (
            f"{dest} was there but failed its checksum ({detail}), so it was moved to "
            f"{corrupt}; to use a file you trust as it is (another version, smoke-test data), "
            "set the data config's checksum to null (data.sha256=null). Fetching it again "
            "failed: "
        )

    if is_offline() and not _is_local(url):
        raise _unreachable_error(url, dest, dataset, found + "offline mode is on", offline=True)

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
            attempt = _after_backoff(attempt, backoff)
            continue
        except FileNotFoundError as e:
            if urllib.parse.urlparse(url).scheme.lower() == "file":
                reason = f"{found}local file not found: {e}"
                raise _unreachable_error(url, dest, dataset, reason) from e
            raise
        except (OSError, HTTPException, DownloadError) as e:
            if attempt >= retries:
                if _is_connection_failure(e):
                    reason = f"{found}cannot reach the server ({getattr(e, 'reason', e)})"
                    raise _unreachable_error(url, dest, dataset, reason) from e
                if isinstance(e, DownloadError):
                    raise DownloadError(
                        f"{e} The partial file {part} is kept; run again to resume."
                    ) from e
                raise DownloadError(
                    f"Downloading {url} failed after {retries + 1} attempt(s): {e!r}. "
                    f"The partial file {part} is kept; run again to resume."
                ) from e
            attempt = _after_backoff(attempt, backoff)
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
