"""LRA Retrieval: do two ACL Anthology papers cite each other? (AAN; Radev et al. 2013; Tay et al.)

Files are the LRA release's ``tsv_data/new_aan_pairs.{train,eval,test}.tsv`` (147,086 / 18,090
/ 17,437 pairs), put in ``<data_dir>`` by ``megalab-data lra --task retrieval``. Each line has
five tab-separated fields and no header: ``label``, ``input1_id``, ``input2_id``, ``text1``,
``text2``. The label is written as a number (``0``/``1``, possibly ``0.0``/``1.0``: LRA reads it
as a float); the ids are ignored. As in LRA's reader, quotes have no special meaning and lines
are read as bytes, so documents are tokenised from their exact bytes.

Each document is tokenised on its own with the byte dictionary of LRA Text
(:mod:`megalab.data.lra.text`: 261 symbols, pad 1, EOS 2): its first 4000 bytes plus EOS by
default (``max_len: 4001`` per document; Mega's ``max_positions`` 4002 leaves room for the
``<CLS>`` the Transformer baseline prepends with ``prepend_cls: true``). Batches carry
``inputs``/``mask`` (first document) and ``inputs2``/``mask2`` (second); the retrieval task
encodes both with one shared backbone and classifies the combined pair.

Splits are the release's: train, eval (used as validation) and test.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megalab.data.base import TokenSequences
from megalab.data.cache import cache_dir, fresh_cache, mark_prepared, prepared
from megalab.data.download import require_files
from megalab.data.lra.release import LRAFormatError, binary_label, data_root_of, release_how
from megalab.data.lra.text import (
    NUM_CLASSES,
    VOCAB_SIZE,
    ByteDataModule,
    encode_bytes,
    load_token_split,
    report_truncation,
    save_token_split,
)

log = logging.getLogger(__name__)

#: Our split name -> the release's file infix.
FILES = {"train": "train", "val": "eval", "test": "test"}
COLUMNS = ("label", "input1_id", "input2_id", "text1", "text2")
_CACHE_VERSION = 1


def read_pairs(path: str | Path) -> Iterator[tuple[int, bytes, bytes]]:
    """Yield ``(label, text1, text2)`` from one AAN TSV; errors name the file and line."""
    path = Path(path)
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.rstrip(b"\n").rstrip(b"\r")
            if not line.strip():
                continue
            fields = line.split(b"\t")
            if len(fields) != len(COLUMNS):
                raise LRAFormatError(
                    f"{path}:{lineno}: expected {len(COLUMNS)} tab-separated fields "
                    f"({', '.join(COLUMNS)}), got {len(fields)}"
                )
            yield binary_label(fields[0], f"{path}:{lineno}", float), fields[3], fields[4]


class AANDataModule(ByteDataModule):
    """LRA Retrieval (AAN): byte-level document-pair classification, up to 4K bytes each.

    Takes `ByteDataModule`'s arguments; the examples are always pairs."""

    task = "LRA Retrieval"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["pairwise"] = True
        super().__init__(*args, **kwargs)

    def files(self) -> dict[str, Path]:
        return {s: self.data_dir / f"new_aan_pairs.{name}.tsv" for s, name in FILES.items()}

    def _require(self) -> dict[str, Path]:
        require_files(
            self.files().values(),
            dataset="LRA Retrieval (AAN)",
            how=release_how("retrieval", data_root_of(self.data_dir, 1)),
            url="https://github.com/google-research/long-range-arena",
            data_dir=self.data_dir,
        )
        return self.files()

    def cache_path(self) -> Path:
        sources = [
            [p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in self._require().values()
        ]
        params = {
            "max_len": self.max_len,
            "append_eos": self.append_eos,
            "prepend_cls": self.prepend_cls,
            "sources": sources,
        }
        return cache_dir(self.cache_root, "aan", params, version=_CACHE_VERSION)

    def prepare_data(self) -> None:
        cache = self.cache_path()
        if prepared(cache):
            return
        fresh_cache(cache)
        sizes: dict[str, int] = {}
        truncated: dict[str, int] = {}
        room = self.max_len - int(self.append_eos) - int(self.prepend_cls)
        for split, path in self.files().items():
            labels: list[int] = []
            cut = [0]

            def docs(
                path: Path = path, labels: list[int] = labels, cut: list[int] = cut
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
                for label, a, b in read_pairs(path):
                    labels.append(label)
                    cut[0] += int(len(a) > room or len(b) > room)
                    yield (
                        encode_bytes(a, self.max_len, self.append_eos, self.prepend_cls),
                        encode_bytes(b, self.max_len, self.append_eos, self.prepend_cls),
                    )

            # `labels` fills up while the documents are written; it is saved after them.
            save_token_split(cache, split, docs(), labels, pairwise=True)
            sizes[split] = len(labels)
            truncated[split] = cut[0]
        info = {"sizes": sizes, "truncated": truncated}
        mark_prepared(cache, info, sources=list(self.files().values()))
        log.info("AAN tokens prepared in %s (%s)", cache, sizes)

    def build_datasets(self) -> dict[str, TokenSequences]:
        cache = self.cache_path()
        if not prepared(cache):
            self.prepare_data()
        datasets = {
            split: load_token_split(cache, split, VOCAB_SIZE, NUM_CLASSES) for split in FILES
        }
        report_truncation(cache, "LRA Retrieval (AAN)", self.max_len, self.truncate)
        return datasets
