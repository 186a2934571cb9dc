"""Character-level language modelling: enwik8 (bytes) and text8 (27 characters).

Both come from Matt Mahoney's page as a zip with a single member of 10^8 bytes, split as the
Transformer-XL preparation does: the last `test_size` bytes are test, the `valid_size` before
them validation, the rest training (90M/5M/5M by default; the sizes are settings so that tiny
files work too).

- enwik8: the first 10^8 bytes of the 2006-03-03 English Wikipedia XML dump. Tokens are the raw
  bytes, vocabulary 256 (ids = byte values). Transformer-XL's pipeline loses the newline bytes
  (it writes one line per newline and encodes without `<eos>`, hence its 88,982,818 training
  tokens); `drop_newlines=true` reproduces that, the default keeps every byte (as fairseq's
  `</s>`-per-line encoding does, up to the id of the newline).
- text8: 10^8 characters of cleaned, lower-cased Wikipedia, only `a`-`z` and single spaces.
  Ids: space 0, a-z 1..26. Transformer-XL strips a boundary space of each part (89,999,999 /
  4,999,999 / 5,000,000 characters); we keep the exact 90M/5M/5M characters.

The first character of a split only serves as context (N-1 predictions per split).
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from megalab.data.cache import cache_dir, prepared
from megalab.data.download import download
from megalab.data.lm.codec import AlphabetCodec, ByteCodec
from megalab.data.lm.prepared import write_meta, write_split
from megalab.data.lm.stream import LMStreamDataModule, TokenStream, load_streams

log = logging.getLogger(__name__)

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
#: SHA-256 of the official enwik8.zip (36,445,475 bytes; its member has md5
#: a1fa5ffddb56f4953e226637dabbb36a as published with the Hutter Prize).
ENWIK8_SHA256 = "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc"
TEXT8_URL = "http://mattmahoney.net/dc/text8.zip"
#: SHA-256 of the official text8.zip (31,344,016 bytes).
TEXT8_SHA256 = "a6640522afe85d1963ad56c05b0ede0a0c000dddc9671758a6cc09b7a38e5232"
TEXT8_ALPHABET = " abcdefghijklmnopqrstuvwxyz"


def read_member(archive: Path, member: str, dataset: str) -> bytes:
    """The bytes of `member` in the zip `archive`, with clear errors for damaged archives."""
    try:
        with zipfile.ZipFile(archive) as zf:
            names = zf.namelist()
            if member not in names:
                raise ValueError(
                    f"{dataset}: {archive} has no member {member!r} (members: {names[:10]}); "
                    f"the official archive holds a single file named {member!r}"
                )
            return zf.read(member)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        raise ValueError(
            f"{dataset}: {archive} is not a readable zip archive ({e}): the download is "
            "corrupt or incomplete. Delete it and run again to download it afresh."
        ) from e


def split_sizes(total: int, valid_size: int, test_size: int, dataset: str) -> tuple[int, int]:
    """(train end, valid end) of a `total`-byte corpus split as Transformer-XL does."""
    if valid_size < 2 or test_size < 2 or total - valid_size - test_size < 2:
        raise ValueError(
            f"{dataset}: cannot split {total:,} characters into valid_size={valid_size:,} and "
            f"test_size={test_size:,} plus a training part (each needs at least 2): lower "
            "data.valid_size/data.test_size or check the file"
        )
    return total - valid_size - test_size, total - test_size


class CharLMDataModule(LMStreamDataModule):
    """A zipped 10^8-character corpus split into train/valid/test streams (see module doc)."""

    name = ""
    member = ""

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int,
        url: str,
        sha256: str | None = None,
        valid_size: int = 5_000_000,
        test_size: int = 5_000_000,
        **kwargs: Any,
    ) -> None:
        super().__init__(data_dir, max_len, **kwargs)
        self.url, self.sha256 = url, sha256
        self.valid_size, self.test_size = valid_size, test_size

    @property
    def archive(self) -> Path:
        return self.data_dir / f"{self.member}.zip"

    def params(self) -> dict:
        """Preprocessing parameters that key the prepared cache."""
        return {
            "archive": [self.archive.name, self.archive.stat().st_size],
            "valid_size": self.valid_size,
            "test_size": self.test_size,
        }

    def encode(self, data: bytes, split: str) -> np.ndarray:
        """Raw bytes of `split` -> token ids (uint8)."""
        raise NotImplementedError

    def prepare_data(self) -> None:
        download(self.url, self.archive, sha256=self.sha256, dataset=self.name)
        cache = cache_dir(self.cache_root, "tokens", self.params())
        if prepared(cache):
            return
        log.info("%s: preparing %s into %s", self.name, self.archive, cache)
        data = read_member(self.archive, self.member, self.name)
        a, b = split_sizes(len(data), self.valid_size, self.test_size, self.name)
        splits = {"train": data[:a], "val": data[a:b], "test": data[b:]}
        meta: dict = {"dataset": self.name, "vocab_size": self.spec.vocab_size, "splits": {}}
        for split, part in splits.items():
            entry = write_split(cache, split, [self.encode(part, split)], "uint8")
            meta["splits"][split] = entry
            log.info("%s %s: %s tokens", self.name, split, f"{entry['tokens']:,}")
        write_meta(cache, meta, [self.archive])

    def load_streams(self) -> dict[str, TokenStream]:
        if not self.archive.exists():
            self.prepare_data()
        cache = cache_dir(self.cache_root, "tokens", self.params())
        if not prepared(cache):
            self.prepare_data()
        return load_streams(cache, self.spec.vocab_size)


class Enwik8DataModule(CharLMDataModule):
    """enwik8 as bytes (vocabulary 256); `drop_newlines` mimics Transformer-XL's encoding."""

    name = "enwik8"
    member = "enwik8"

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int,
        url: str = ENWIK8_URL,
        sha256: str | None = ENWIK8_SHA256,
        drop_newlines: bool = False,
        vocab_size: int = 256,
        **kwargs: Any,
    ) -> None:
        super().__init__(data_dir, max_len, url, sha256, vocab_size=vocab_size, **kwargs)
        self.drop_newlines = drop_newlines

    def params(self) -> dict:
        return {**super().params(), "drop_newlines": self.drop_newlines}

    def encode(self, data: bytes, split: str) -> np.ndarray:
        tokens = np.frombuffer(data, dtype=np.uint8)
        return tokens[tokens != 10] if self.drop_newlines else tokens

    def text_codec(self) -> ByteCodec:
        """Prompts as UTF-8 bytes (without newlines when the data drops them)."""
        return ByteCodec(drop_newlines=self.drop_newlines)

    def text_spec(self) -> dict[str, Any]:
        return {"kind": "bytes", "drop_newlines": bool(self.drop_newlines)}


class Text8DataModule(CharLMDataModule):
    """text8: 27 symbols, space = 0 and a-z = 1..26; any other byte is an error."""

    name = "text8"
    member = "text8"

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int,
        url: str = TEXT8_URL,
        sha256: str | None = TEXT8_SHA256,
        vocab_size: int = 27,
        **kwargs: Any,
    ) -> None:
        super().__init__(data_dir, max_len, url, sha256, vocab_size=vocab_size, **kwargs)

    def encode(self, data: bytes, split: str) -> np.ndarray:
        table = np.full(256, 255, dtype=np.uint8)
        for i, ch in enumerate(TEXT8_ALPHABET):
            table[ord(ch)] = i
        tokens = table[np.frombuffer(data, dtype=np.uint8)]
        bad = np.flatnonzero(tokens == 255)
        if bad.size:
            raise ValueError(
                f"text8: character {chr(data[bad[0]])!r} (byte {data[bad[0]]}) at offset "
                f"{int(bad[0]):,} of the {split} split is not in text8's alphabet (a-z and "
                "space): this is not the text8 corpus"
            )
        return tokens

    def text_codec(self) -> AlphabetCodec:
        """Prompts in text8's alphabet (lower-cased)."""
        return AlphabetCodec(TEXT8_ALPHABET, name="text8")

    def text_spec(self) -> dict[str, Any]:
        return {"kind": "alphabet", "alphabet": TEXT8_ALPHABET, "lowercase": True, "name": "text8"}
