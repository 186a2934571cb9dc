"""Text <-> token ids for the language-model datasets, for prompts and generated text.

Each LM DataModule returns its codec from `text_codec()`, built from the same vocabulary its
streams were encoded with:

- `ByteCodec` (enwik8): UTF-8 bytes, ids = byte values (newlines dropped from prompts when
  the data drops them).
- `AlphabetCodec` (text8): a fixed alphabet (space, a-z), prompts lower-cased; any other
  character is an error that names it.
- `WordCodec` (WikiText-103): whitespace-separated words of the training vocabulary, one
  `<eos>` per line break; unknown words become `<unk>` (an ordinary word of that corpus).
- `TokenizerCodec` (PG-19, a corpus of one's own): the Hugging Face `tokenizers` tokenizer of
  the data, `<eos>` ends a document.

A data module describes its codec without reading any data (`text_spec()`: a JSON-able dict
naming the vocabulary file, if any, by its `tokenizer_files()` name); an export records it, and
`codec_from_spec` builds the codec again from the exported files (`megalab.text_codec`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class TextCodec(Protocol):
    """Encodes a prompt to ids and decodes ids to text; `eos_id` ends a document (or None)."""

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def continuation(codec: TextCodec, context: Sequence[int], new: Sequence[int]) -> str:
    """The text of the ids `new` as it reads after the ids `context` (a prompt's last tokens):
    decoded alone, a word codec's first word, or a unigram tokenizer's first piece, would lose
    the space that separates it from the prompt."""
    before = codec.decode(context)
    whole = codec.decode([*context, *new])
    return whole[len(before) :] if whole.startswith(before) else codec.decode(new)


class ByteCodec:
    """UTF-8 bytes as ids 0..255 (enwik8)."""

    eos_id = None

    def __init__(self, drop_newlines: bool = False) -> None:
        self.drop_newlines = drop_newlines

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        return [b for b in data if not (self.drop_newlines and b == 10)]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class AlphabetCodec:
    """Characters of a fixed alphabet, id = position (text8: space, then a-z)."""

    eos_id = None

    def __init__(self, alphabet: str, lowercase: bool = True, name: str = "text8") -> None:
        self.alphabet, self.lowercase, self.name = alphabet, lowercase, name
        self.index = {c: i for i, c in enumerate(alphabet)}

    def encode(self, text: str) -> list[int]:
        if self.lowercase:
            text = text.lower()
        bad = sorted({c for c in text if c not in self.index})
        if bad:
            raise ValueError(
                f"{self.name}: the prompt has characters outside its alphabet "
                f"{self.alphabet!r}: {''.join(bad)!r}; write the prompt with those only"
            )
        return [self.index[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.alphabet[int(i)] for i in ids)


class WordCodec:
    """Whitespace-separated words of a vocabulary, `<eos>` at each line break (WikiText)."""

    def __init__(self, vocabulary: Sequence[str], eos: str = "<eos>", unk: str = "<unk>") -> None:
        self.vocabulary = list(vocabulary)
        self.index = {w: i for i, w in enumerate(self.vocabulary)}
        if eos not in self.index:
            raise ValueError(f"the vocabulary has no {eos!r} token")
        self.eos, self.eos_id = eos, self.index[eos]
        self.unk_id = self.index.get(unk)
        self.unk = unk

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        lines = text.split("\n")
        unknown: list[str] = []
        for n, line in enumerate(lines):
            for word in line.split():
                i = self.index.get(word)
                if i is None:
                    if self.unk_id is None:
                        raise ValueError(f"{word!r} is not in the vocabulary (which has no <unk>)")
                    unknown.append(word)
                    i = self.unk_id
                ids.append(i)
            if n < len(lines) - 1:
                ids.append(self.eos_id)
        if unknown:
            log.warning("words outside the vocabulary became %s: %s", self.unk, unknown[:10])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        for i in ids:
            word = self.vocabulary[int(i)]
            if word == self.eos:
                out.append("\n")
            else:
                out.append(word if not out or out[-1] == "\n" else " " + word)
        return "".join(out)


class TokenizerCodec:
    """A Hugging Face `tokenizers.Tokenizer` (PG-19's subword vocabulary)."""

    def __init__(self, tokenizer: Any, eos_token: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def codec_from_spec(spec: Mapping[str, Any], folder: Path) -> TextCodec:
    """The codec a data module's `text_spec()` describes, its vocabulary file read from
    `folder` (an export's `tokenizer/`). Raises a ValueError for a kind it does not know."""
    kind = spec.get("kind")
    if kind == "bytes":
        return ByteCodec(drop_newlines=bool(spec.get("drop_newlines", False)))
    if kind == "alphabet":
        return AlphabetCodec(str(spec["alphabet"]), bool(spec["lowercase"]), str(spec["name"]))
    if kind == "words":
        lines = (folder / str(spec["file"])).read_text(encoding="utf-8").split("\n")[:-1]
        return WordCodec(lines, eos=str(spec["eos"]), unk=str(spec["unk"]))
    if kind == "tokenizer":
        from tokenizers import Tokenizer

        eos = spec.get("eos_token")
        tokenizer = Tokenizer.from_file(str(folder / str(spec["file"])))
        return TokenizerCodec(tokenizer, None if eos is None else str(eos))
    raise ValueError(f"unknown text codec {kind!r} (bytes, alphabet, words or tokenizer)")
