"""WMT'16 English-German translation, prepared as the Mega authors did (Mega §4.3, Table 6).

Sources (the Hugging Face Hub copies of the official WMT releases):

- training: ``wmt/wmt16``, config ``de-en``, split ``train`` (Europarl v7, Common Crawl and News
  Commentary v11: 4,548,885 pairs), in ``<data_dir>/wmt16/de-en/train-*.parquet``;
- validation and test: ``wmt/wmt14``, config ``de-en``, splits ``validation`` (newstest2013, 3,000
  pairs) and ``test`` (newstest2014 "full", 3,003 pairs), in ``<data_dir>/wmt14/de-en/``.

Every file has one column ``translation``, a struct ``{"de": str, "en": str}``. Missing files
are fetched with ``datasets.load_dataset`` when online (``megalab-data wmt16 --root data``);
offline the error says what to download where.

Preparation follows the authors' ``examples/mega/prepare-wmt16en2de.sh`` and fairseq's
``preprocess.py`` (the paper cites Ma 2020, Apollo, for it):

1. training text: Moses ``remove-non-printing-char`` (every ``\\p{C}`` character becomes a
   space) and ``normalize-punctuation`` per language (sacremoses);
2. every split: the Moses tokenizer per language with ``-no-escape`` (sacremoses, no aggressive
   dash splitting);
3. one joint BPE of ``bpe_merges`` = 32,000 merge operations learned on the tokenized English and
   German training text (the script uses subword-nmt; we learn it with ``tokenizers`` — the same
   algorithm with end-of-word markers and pairs seen at least twice, whose tie-breaking between
   equally frequent pairs may differ), applied to every split;
4. training pairs cleaned as Moses ``clean-corpus-n.perl -ratio 1.5 ... 3 150``: both sides 3 to
   150 subword tokens, neither more than 1.5 times as long as the other;
5. one joint fairseq dictionary (``--joined-dictionary --nwordssrc 33000``): ``<s>``=0,
   ``<pad>``=1, ``</s>``=2, ``<unk>``=3, then the subwords of the cleaned training text by
   frequency (ties in alphabetical order, as fairseq), at most ``vocab_size`` entries; fairseq
   pads a dictionary to a multiple of 8 with ``madeupwordNNNN`` symbols, we pad it to exactly
   ``vocab_size`` (the model's table size, which the config must know before preparation);
   symbols are written in subword-nmt's notation (``@@`` ends a non-final piece);
6. every sentence becomes its ids followed by ``</s>``; the decoder reads ``[</s>, y_1..y_n]``
   and predicts ``[y_1..y_n, </s>]`` (fairseq's convention).

Batches are fairseq's: examples sorted by (source, target) length after a seeded shuffle, packed
greedily while (sentences x longest) <= ``max_tokens`` and sentences <= ``batch_size``, in
multiples of 8 when full (``--required-batch-size-multiple 8``); the set of batches is fixed,
their order reshuffled every epoch. ``max_tokens`` and ``batch_size`` are *global* per
optimizer step (the paper's 8,192 tokens x 8 GPUs = 65,536), divided over processes and
gradient-accumulation steps. Sources are left-padded like fairseq's translation task
(``left_pad_source``), targets right-padded.

The prepared files (``<data_dir>/prepared/wmt16_en_de/<hash>/``) hold the BPE model, the
dictionary, the binarized splits and the raw validation/test references (for SacreBLEU).
`TextPipeline` carries the tokenizers, BPE and dictionary (checkpoints store it, so
``megalab-translate`` needs no data).

The modules: `text` (Moses, BPE, dictionary, `TextPipeline`), `batching` (datasets, batches,
collation) and `datamodule` (the Hub sources, the preparation and the loaders).
"""

from megalab.data.wmt.batching import (
    ParallelSentences,
    TokenBatchSampler,
    TranslationCollator,
    batch_by_size,
    ordered_indices,
)
from megalab.data.wmt.datamodule import LANGS, WMT16EnDeDataModule, WMTFormatError, hub_sources
from megalab.data.wmt.text import (
    BOS_ID,
    BPE,
    BPE_CONT,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    UNK_ID,
    TextPipeline,
    build_dictionary,
    detokenize,
    learn_bpe,
    moses_lines,
    normalize,
    remove_bpe,
    remove_non_printing,
    tokenize,
)

__all__ = [
    "BOS_ID",
    "BPE",
    "BPE_CONT",
    "EOS_ID",
    "LANGS",
    "PAD_ID",
    "SPECIALS",
    "UNK_ID",
    "ParallelSentences",
    "TextPipeline",
    "TokenBatchSampler",
    "TranslationCollator",
    "WMT16EnDeDataModule",
    "WMTFormatError",
    "batch_by_size",
    "build_dictionary",
    "detokenize",
    "hub_sources",
    "learn_bpe",
    "moses_lines",
    "normalize",
    "ordered_indices",
    "remove_bpe",
    "remove_non_printing",
    "tokenize",
]
