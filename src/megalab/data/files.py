"""File helpers the data modules share: digests, a short hash of parameters, atomic writes.

Downloads verify digests; archives and prepared caches name their folders and markers by a short
hash and write them atomically. They all use these, so none of them needs another's internals.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any


def file_digest(
    path: str | os.PathLike[str], algorithm: str = "sha256", chunk: int = 1 << 20
) -> str:
    """Hex digest of a file, read in chunks."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def short_hash(obj: Any, n: int = 12) -> str:
    """The first `n` hex digits of the SHA-256 of `obj`'s JSON form (keys sorted)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=json_default)
    return hashlib.sha256(blob.encode()).hexdigest()[:n]


def json_default(obj: Any) -> Any:
    """`json.dumps`'s `default` for parameters: paths, sets and numpy scalars."""
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    raise TypeError(f"Cannot use {type(obj).__name__} in cache parameters: {obj!r}")


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed over it: never half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())
    os.replace(tmp, path)
