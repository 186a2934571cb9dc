"""Language-model data: enwik8 and text8 (characters), WikiText-103 (words), PG-19 and a corpus
of one's own (subwords).

All of them come as token streams (`stream.py`) read in Transformer-XL order for models that
carry state across segments, or as random windows for stateless models.
"""

from megalab.data.lm.char import Enwik8DataModule, Text8DataModule
from megalab.data.lm.corpus import TextCorpusDataModule
from megalab.data.lm.pg19 import PG19DataModule
from megalab.data.lm.stream import LMStreamDataModule, TokenStream
from megalab.data.lm.wikitext import WikiText103DataModule

__all__ = [
    "Enwik8DataModule",
    "LMStreamDataModule",
    "PG19DataModule",
    "Text8DataModule",
    "TextCorpusDataModule",
    "TokenStream",
    "WikiText103DataModule",
]
