"""Text <-> ids for WMT'16 En-De as the authors prepared it: Moses normalisation and
tokenisation (sacremoses), the joint BPE in subword-nmt notation, the fairseq dictionary, and
`TextPipeline`, which carries them for one translation direction.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from megalab.data.dictionary import BOS_ID, EOS_ID, PAD_ID, SPECIALS, UNK_ID

BPE_CONT = "@@"  # subword-nmt's mark of a non-final piece
_EOW = "</w>"  # the end-of-word suffix of the `tokenizers` BPE model


# ---------------------------------------------------------------------------------------------
# Moses normalisation, tokenisation and detokenisation (sacremoses)
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _moses(lang: str) -> tuple[Any, Any, Any]:
    from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer

    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang), MosesDetokenizer(lang=lang)


@lru_cache(maxsize=1)
def _non_printing() -> Any:
    import regex

    return regex.compile(r"\p{C}")


def remove_non_printing(text: str) -> str:
    """Moses `remove-non-printing-char.perl`: every control/format character becomes a space."""
    return _non_printing().sub(" ", text)


def normalize(text: str, lang: str) -> str:
    """Moses `normalize-punctuation.perl <lang>` after `remove-non-printing-char.perl`."""
    return _moses(lang)[0].normalize(remove_non_printing(text))


def tokenize(text: str, lang: str) -> str:
    """Moses `tokenizer.perl -l <lang> -no-escape`."""
    return _moses(lang)[1].tokenize(text, escape=False, return_str=True)


def detokenize(text: str, lang: str) -> str:
    """Moses `detokenizer.perl -l <lang>` (what SacreBLEU scores)."""
    return _moses(lang)[2].detokenize(text.split())


def _prepare_line(args: tuple[str, str, bool]) -> str:
    text, lang, norm = args
    return tokenize(normalize(text, lang) if norm else text, lang)


def moses_lines(texts: Sequence[str], lang: str, norm: bool, workers: int = 1) -> list[str]:
    """Tokenize (and for training text first normalise) lines, in `workers` processes."""
    jobs = [(t, lang, norm) for t in texts]
    if workers <= 1 or len(jobs) < 10_000:
        return [_prepare_line(j) for j in jobs]
    with mp.get_context("spawn").Pool(workers) as pool:
        return pool.map(_prepare_line, jobs, chunksize=2_000)


# ---------------------------------------------------------------------------------------------
# BPE and dictionary
# ---------------------------------------------------------------------------------------------
def learn_bpe(lines: Sequence[str], merges: int) -> str:
    """A joint BPE of `merges` merge operations over whitespace-tokenized lines (JSON model).

    Like subword-nmt's `learn_bpe.py -s merges`: characters with an end-of-word marker on the
    last one, pairs merged by frequency while seen at least twice.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    chars: set[str] = set()
    finals: set[str] = set()
    for line in lines:
        for w in line.split():
            chars.update(w)
            finals.add(w[-1])
    tok = Tokenizer(models.BPE(unk_token=SPECIALS[UNK_ID], end_of_word_suffix=_EOW))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(
        # The trainer counts the initial alphabet (characters, word-final characters) and the
        # special token in the vocabulary: what is left is the number of merges.
        vocab_size=len(chars) + len(finals) + 1 + merges,
        min_frequency=2,
        special_tokens=[SPECIALS[UNK_ID]],
        end_of_word_suffix=_EOW,
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer, length=len(lines))
    return tok.to_str()


class BPE:
    """Applies a learned BPE to whitespace-tokenized text, in subword-nmt notation."""

    def __init__(self, model_json: str) -> None:
        from tokenizers import Tokenizer

        self.model_json = model_json
        self.tokenizer = Tokenizer.from_str(model_json)

    def segment(self, lines: Sequence[str]) -> list[list[str]]:
        """Subwords of each line; non-final pieces end with `@@` (an unknown piece is `<unk>`)."""
        out = []
        for enc in self.tokenizer.encode_batch(list(lines), add_special_tokens=False):
            pieces = []
            for tok in enc.tokens:
                if tok.endswith(_EOW):
                    pieces.append(tok[: -len(_EOW)])
                elif tok == SPECIALS[UNK_ID]:
                    pieces.append(tok)
                else:
                    pieces.append(tok + BPE_CONT)
            out.append(pieces)
        return out


def remove_bpe(pieces: Iterable[str]) -> str:
    """fairseq's `--remove-bpe '@@ '`: join the pieces into the tokenized sentence."""
    return (" ".join(pieces) + " ").replace(BPE_CONT + " ", "").rstrip()


def build_dictionary(counts: Counter[str], size: int) -> list[str]:
    """fairseq's `Dictionary.finalize`: specials, then the most frequent symbols (ties
    alphabetical), padded with `madeupwordNNNN` to exactly `size` entries."""
    if size <= len(SPECIALS):
        raise ValueError(f"vocab_size={size} leaves no room beside the {len(SPECIALS)} specials")
    ranked = sorted((s for s in counts if s not in SPECIALS), key=lambda s: (-counts[s], s))
    symbols = [*SPECIALS, *ranked[: size - len(SPECIALS)]]
    symbols += [f"madeupword{i:04d}" for i in range(size - len(symbols))]
    return symbols


class TextPipeline:
    """Text <-> ids for one direction: Moses, the joint BPE and the fairseq dictionary.

    `encode(text, lang)` tokenizes raw text (as the validation/test data: no normalisation),
    applies the BPE and returns the ids with `</s>`; `decode(ids)` gives the tokenized sentence
    (BPE removed, what tokenized BLEU scores), `detokenize` the plain text (SacreBLEU).
    `state()` / `from_state()` are plain strings and lists (saved in checkpoints).
    """

    def __init__(self, source_lang: str, target_lang: str, bpe: str, symbols: Sequence[str]):
        self.source_lang, self.target_lang = source_lang, target_lang
        self.bpe = BPE(bpe)
        self.symbols = list(symbols)
        self.ids = {s: i for i, s in enumerate(self.symbols)}

    def state(self) -> dict[str, Any]:
        return {
            "source_lang": self.source_lang,
            "target_lang": self.target_lang,
            "bpe": self.bpe.model_json,
            "symbols": self.symbols,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TextPipeline:
        return cls(state["source_lang"], state["target_lang"], state["bpe"], state["symbols"])

    def index(self, pieces: Iterable[str]) -> list[int]:
        """Ids of subword pieces (`<unk>` for unknown ones) followed by `</s>`."""
        return [self.ids.get(p, UNK_ID) for p in pieces] + [EOS_ID]

    def encode_tokenized(self, lines: Sequence[str]) -> list[list[int]]:
        return [self.index(p) for p in self.bpe.segment(lines)]

    def encode(self, texts: Sequence[str], lang: str | None = None) -> list[list[int]]:
        """Raw sentences -> ids (Moses tokenizer of `lang`, default the source language)."""
        lang = lang or self.source_lang
        return self.encode_tokenized([tokenize(t, lang) for t in texts])

    def decode(self, ids: Iterable[int], unk: str = SPECIALS[UNK_ID]) -> str:
        """Ids -> tokenized sentence, stopping at `</s>`; padding and `<s>` are dropped."""
        pieces = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i in (PAD_ID, BOS_ID):
                continue
            pieces.append(unk if i == UNK_ID else self.symbols[i])
        return remove_bpe(pieces)

    def detokenize(self, text: str) -> str:
        return detokenize(text, self.target_lang)
