"""LRA Text: IMDB movie reviews classified from their UTF-8 bytes (Maas et al. 2011; Tay et al.).

Source: the Hugging Face Hub dataset ``stanfordnlp/imdb`` (columns ``text``, ``label``; train
25K, test 25K; the ``unsupervised`` split is not used), read from a local Hub-style copy
(``<data_dir>/plain_text/{train,test}-*.parquet`` or a ``save_to_disk`` folder) or fetched with
``datasets.load_dataset`` when online (``megalab-data imdb`` does it ahead of time).

Tokenisation is the Mega code's fairseq dictionary over bytes: ``<s>``=0, ``<pad>``=1,
``</s>``=2, ``<unk>``=3, byte ``b`` = ``4 + b`` (all 256 byte values, in byte order: the order
of the authors' frequency-sorted ``dict.txt`` is not public), then ``<CLS>``=260; 261 symbols.
Each review becomes its first bytes followed by EOS.

Length: ``max_len`` counts every token, EOS (and ``<CLS>``) included. The default 4001 is Mega's
setting: reviews truncated to 4000 bytes plus EOS; its ``max_positions`` of 4002 leaves room for
the ``<CLS>`` that the fairseq Transformer baseline prepends (``prepend_cls=true``,
``max_len=4002``). S4's "4096" is its ``l_max`` (4095 characters + EOS); set ``max_len: 4096``
to reproduce that length. Changing any of these re-prepares the token cache.

Validation: IMDB has no validation split. LRA, S4 and Mega validate on the test set and report
test accuracy (``val_source: test``, the default). ``val_source: train`` instead holds out
``val_fraction`` of the training set (a seeded ``random_split``) for model selection.

Tokens are prepared once (``prepare_data``, rank 0) into flat memory-mapped arrays under
``<data_dir>/prepared/imdb/<hash of the preprocessing parameters and source files>``. The byte
encoder and the flat token cache are shared with LRA Retrieval.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from megalab.data.base import SequenceDataModule, TokenSequences, check_truncation
from megalab.data.cache import (
    CacheError,
    cache_dir,
    check_npy,
    check_range,
    check_tokens,
    mark_prepared,
    read_marker,
    rebuild_hint,
)
from megalab.data.dictionary import EOS_ID, PAD_ID, SPECIALS
from megalab.data.hub import HubDataset
from megalab.data.lra import release
from megalab.data.lra.hub import LRAHubDataModule, hub_columns
from megalab.data.lra.release import LRAFormatError

log = logging.getLogger(__name__)

BYTE_OFFSET = len(SPECIALS)
CLS_ID = BYTE_OFFSET + 256
VOCAB_SIZE = CLS_ID + 1
NUM_CLASSES = 2
HUB_ID = "stanfordnlp/imdb"
_CACHE_VERSION = 1
_TOKEN_DTYPE = np.int16


def hub_dataset(data_dir: str | Path, hub_id: str = HUB_ID) -> HubDataset:
    """IMDB's train and test splits (``text``, ``label``) in ``<data_dir>/plain_text/``."""
    return release.hub_dataset("LRA Text (IMDB)", hub_id, data_dir, ("text", "label"), "imdb")


def byte_vocab() -> list[str]:
    """The 261 symbols in id order (bytes written as ``<0x..>``)."""
    return [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), "<CLS>"]


def encode_bytes(
    data: bytes, max_len: int, append_eos: bool = True, prepend_cls: bool = False
) -> np.ndarray:
    """Token ids of one document: [<CLS>] + its first bytes + [</s>], at most ``max_len``."""
    room = max_len - int(append_eos) - int(prepend_cls)
    if room < 1:
        raise ValueError(f"max_len={max_len} leaves no room for bytes")
    ids = np.frombuffer(data[:room], dtype=np.uint8).astype(_TOKEN_DTYPE) + BYTE_OFFSET
    head = np.array([CLS_ID], _TOKEN_DTYPE) if prepend_cls else np.zeros(0, _TOKEN_DTYPE)
    tail = np.array([EOS_ID], _TOKEN_DTYPE) if append_eos else np.zeros(0, _TOKEN_DTYPE)
    return np.concatenate([head, ids, tail])


# ---------------------------------------------------------------------------------------------
# Flat token cache (memory-mapped; shared with Retrieval)
# ---------------------------------------------------------------------------------------------
class TokenWriter:
    """Appends token arrays to ``<prefix>.bin`` and records offsets (for 100K+ documents)."""

    def __init__(self, prefix: Path) -> None:
        self.path = prefix.with_name(prefix.name + ".bin")
        self._f = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self.offsets = [0]

    def add(self, ids: np.ndarray) -> None:
        self._f.write(np.ascontiguousarray(ids, dtype=_TOKEN_DTYPE).tobytes())
        self.offsets.append(self.offsets[-1] + len(ids))

    def close(self) -> np.ndarray:
        self._f.close()
        return np.asarray(self.offsets, dtype=np.int64)


def _load_tokens(path: Path) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, _TOKEN_DTYPE)
    return np.memmap(path, dtype=_TOKEN_DTYPE, mode="r")


def save_token_split(
    cache: Path,
    split: str,
    docs: Iterable[np.ndarray | tuple[np.ndarray, np.ndarray]],
    labels: Sequence[int] | np.ndarray,
    pairwise: bool = False,
) -> None:
    """Write one split's documents (or document pairs) and labels into ``cache``."""
    w1 = TokenWriter(cache / f"{split}.tokens")
    w2 = TokenWriter(cache / f"{split}.tokens2") if pairwise else None
    try:
        for doc in docs:
            if w2 is not None:
                a, b = doc  # type: ignore[misc]
                w1.add(a)
                w2.add(b)
            else:
                w1.add(doc)  # type: ignore[arg-type]
    finally:
        offsets = w1.close()
        offsets2 = w2.close() if w2 is not None else None
    np.save(cache / f"{split}.offsets.npy", offsets)
    if offsets2 is not None:
        np.save(cache / f"{split}.offsets2.npy", offsets2)
    np.save(cache / f"{split}.labels.npy", np.asarray(labels, dtype=np.int64))


def load_token_split(
    cache: Path, split: str, vocab_size: int | None = None, num_classes: int | None = None
) -> TokenSequences:
    """A split written by :func:`save_token_split`, tokens memory-mapped.

    The cheap invariants are checked on the way (:mod:`megalab.data.cache`): array headers,
    offsets that index the token file, token ids below ``vocab_size``, labels below
    ``num_classes``.
    """

    def tokens_and_offsets(name: str, offsets_name: str) -> tuple[np.ndarray, np.ndarray]:
        path = cache / f"{split}.{name}.bin"
        if path.stat().st_size % np.dtype(_TOKEN_DTYPE).itemsize:
            raise CacheError(f"{path} is truncated mid-token. {rebuild_hint(cache)}")
        tokens = _load_tokens(path)
        offsets_path = cache / f"{split}.{offsets_name}.npy"
        check_npy(offsets_path, np.int64, 1, cache)
        offsets = np.load(offsets_path)
        check_tokens(tokens, offsets, vocab_size, path, offsets_path, cache)
        return tokens, offsets

    tokens, offsets = tokens_and_offsets("tokens", "offsets")
    labels_path = cache / f"{split}.labels.npy"
    check_npy(labels_path, np.int64, 1, cache)
    labels = np.load(labels_path)
    if num_classes is not None:
        check_range(labels, 0, num_classes, "label", labels_path, cache)
    tokens2 = offsets2 = None
    if (cache / f"{split}.tokens2.bin").exists():
        tokens2, offsets2 = tokens_and_offsets("tokens2", "offsets2")
    return TokenSequences(tokens, offsets, labels, tokens2, offsets2)


def holdout_split(train: Dataset, fraction: float, seed: int) -> tuple[Subset, Subset]:
    """Train/validation subsets as ``random_split(train, [n - k, k], Generator(seed))``."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {fraction}")
    n = len(train)  # type: ignore[arg-type]
    k = int(n * fraction)
    if k == 0 or k == n:
        raise ValueError(f"val_fraction={fraction} of {n} training examples leaves a split empty")
    a, b = torch.utils.data.random_split(
        # torch types the first argument as a Dataset; random_split needs only len().
        cast(Any, range(n)),
        [n - k, k],
        generator=torch.Generator().manual_seed(seed),
    )
    return Subset(train, list(a.indices)), Subset(train, list(b.indices))


# ---------------------------------------------------------------------------------------------
# DataModule
# ---------------------------------------------------------------------------------------------
class ByteDataModule(SequenceDataModule):
    """The byte-level LRA tasks (Text, Retrieval): bytes shifted past the specials, with optional
    <s> and </s>; the spec (vocabulary, classes, padding) is the byte vocabulary's."""

    #: The task's name in error messages.
    task = "LRA bytes"

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int = 4001,
        append_eos: bool = True,
        prepend_cls: bool = False,
        truncate: bool = True,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("vocab_size", VOCAB_SIZE)
        kwargs.setdefault("num_classes", NUM_CLASSES)
        kwargs.setdefault("pad_id", PAD_ID)
        super().__init__(data_dir=data_dir, max_len=max_len, **kwargs)
        _check_spec(self, self.task)
        self.append_eos, self.prepend_cls, self.truncate = append_eos, prepend_cls, truncate
        encode_bytes(b"", max_len, append_eos, prepend_cls)  # fail early on an impossible length


class IMDBDataModule(LRAHubDataModule, ByteDataModule):
    """LRA Text: byte-level binary sentiment classification of IMDB reviews (up to 4K bytes).

    Takes the arguments of `ByteDataModule` and `LRAHubDataModule`, and where the validation
    split comes from: `val_source` "test" (LRA's choice) or "train" (a `val_fraction` held out
    with `split_seed`)."""

    task = "LRA Text"

    def __init__(self, *args: Any, val_source: str = "test", **kwargs: Any) -> None:
        kwargs.setdefault("hub_id", HUB_ID)
        super().__init__(*args, **kwargs)
        if val_source not in ("test", "train"):
            raise ValueError(f"val_source must be 'test' or 'train', got {val_source!r}")
        self.val_source = val_source
        self.source = hub_dataset(self.data_dir, self.hub_id)

    def cache_path(self) -> Path:
        params = {
            "dataset": self.hub_id,
            "max_len": self.max_len,
            "append_eos": self.append_eos,
            "prepend_cls": self.prepend_cls,
            "sources": self.source.fingerprint(),
        }
        return cache_dir(self.cache_root, "imdb", params, version=_CACHE_VERSION)

    def prepare_data(self) -> None:
        cache = self.cache_to_prepare()
        if cache is None:
            return
        sizes, truncated = {}, {}
        room = self.max_len - int(self.append_eos) - int(self.prepend_cls)
        for split, texts, labels in hub_columns(self.source, "text"):
            bad = [i for i, y in enumerate(labels) if y not in (0, 1)]
            if bad:
                raise LRAFormatError(
                    f"{self.data_dir} ({split}): row {bad[0]} has label {labels[bad[0]]!r}; "
                    "IMDB labels are 0 (neg) and 1 (pos)"
                )
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    raise LRAFormatError(f"{self.data_dir} ({split}): row {i} has no text ({t!r})")
            encoded = [t.encode("utf-8") for t in texts]
            docs = (
                encode_bytes(t, self.max_len, self.append_eos, self.prepend_cls) for t in encoded
            )
            save_token_split(cache, split, docs, np.asarray(labels, dtype=np.int64))
            sizes[split] = len(texts)
            truncated[split] = sum(len(t) > room for t in encoded)
        info = {"sizes": sizes, "truncated": truncated}
        mark_prepared(cache, info, sources=self.source.source_files())
        log.info("IMDB tokens prepared in %s (%s)", cache, json.dumps(sizes))

    def build_datasets(self) -> dict[str, Dataset]:
        cache = self.prepared_cache()
        train = load_token_split(cache, "train", VOCAB_SIZE, NUM_CLASSES)
        test = load_token_split(cache, "test", VOCAB_SIZE, NUM_CLASSES)
        report_truncation(cache, "LRA Text (IMDB)", self.max_len, self.truncate)
        if self.val_source == "test":
            return {"train": train, "val": test, "test": test}
        tr, va = holdout_split(train, self.val_fraction, self.split_seed)
        return {"train": tr, "val": va, "test": test}


def report_truncation(cache: Path, dataset: str, max_len: int, allow: bool) -> None:
    """Apply the `truncate` policy to the documents a prepared cache cut (recorded in it)."""

    info = read_marker(cache)
    truncated = {k: int(v) for k, v in (info.get("truncated") or {}).items()}
    check_truncation(dataset, truncated, info.get("sizes") or {}, max_len, allow)


def _check_spec(dm: SequenceDataModule, name: str) -> None:
    """The config's data spec must match the byte vocabulary (models size themselves by it)."""
    if dm.spec.vocab_size != VOCAB_SIZE:
        raise ValueError(f"{name} has vocab_size {VOCAB_SIZE}, the config says {dm.vocab_size}")
    if dm.spec.num_classes != NUM_CLASSES:
        raise ValueError(f"{name} has {NUM_CLASSES} classes, the config says {dm.num_classes}")
    if dm.spec.pad_id != PAD_ID:
        raise ValueError(f"{name} pads with id {PAD_ID}, the config says {dm.spec.pad_id}")
