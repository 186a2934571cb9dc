"""Writing a prepared folder of language-model token streams: one raw `.bin` token file per
split and a `meta.json` that describes them, read back by `megalab.data.lm.stream.load_streams`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from megalab.data.cache import mark_prepared

__all__ = ["token_dtype", "write_meta", "write_split", "write_tokens"]


def write_tokens(path: Path, chunks: Iterable[np.ndarray], dtype: str) -> dict[str, int]:
    """Write token chunks to a raw `.bin` file (native byte order), atomically.

    Returns the number of tokens and the largest id.
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    count, max_id = 0, -1
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                chunk = np.asarray(chunk)
                if chunk.size == 0:
                    continue
                if chunk.min() < 0 or chunk.max() > np.iinfo(dtype).max:
                    raise ValueError(f"token ids out of range for {dtype} while writing {path}")
                f.write(chunk.astype(dtype).tobytes())
                count += chunk.size
                max_id = max(max_id, int(chunk.max()))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return {"tokens": count, "max_id": max_id}


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds ids below `vocab_size`."""
    for dtype in ("uint8", "uint16", "uint32"):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return dtype
    raise ValueError(f"vocabulary of {vocab_size} ids is too large")


def write_split(
    cache: Path, split: str, chunks: Iterable[np.ndarray], dtype: str, **extra: Any
) -> dict[str, Any]:
    """Write one split's token chunks to `<split>.bin` in `cache`; returns its `meta.json` entry
    (file, dtype, number of tokens, largest id, and `extra`)."""
    info = write_tokens(cache / f"{split}.bin", chunks, dtype)
    return {"file": f"{split}.bin", "dtype": dtype, **info, **extra}


def write_meta(
    cache: Path, meta: Mapping[str, Any], sources: Iterable[str | os.PathLike[str]]
) -> None:
    """The last step of a preparation: write `meta.json`, then mark `cache` prepared with the
    checksums of its files and of the `sources` it was prepared from (`megalab.data.cache`)."""
    tmp = cache / f".meta.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(dict(meta), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, cache / "meta.json")
    mark_prepared(cache, meta, sources=sources)
