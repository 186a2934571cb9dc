"""Corpus BLEU (Papineni et al. 2002) as translation papers report it.

- **Tokenized BLEU** (Mega Table 6 "Token.", the authors' `scripts/compound_split_bleu.sh`):
  BLEU-4 of the Moses-tokenized output against the tokenized reference, both with German
  compounds split (`compound_split`: "a-b" -> "a ##AT##-##AT## b", as the script's perl
  substitution), no further tokenization, no smoothing: what `fairseq-score` and Moses'
  `multi-bleu.perl` compute.
- **Validation BLEU** (the authors' `--eval-bleu --eval-tokenized-bleu`): the same statistics on
  the tokenized output without compound splitting, turned into BLEU by sacrebleu's
  `compute_bleu` with exponential smoothing (`smooth="exp"`).
- **SacreBLEU** (Table 6 "Sacre."): detokenized output against the raw references with the
  `sacrebleu` package itself (`sacrebleu_score`, which also returns its signature).

`CorpusBLEU` accumulates the sufficient statistics (clipped n-gram matches and totals, output and
reference lengths) as a torchmetrics `Metric`, so batches and processes add up to the corpus
score; `bleu_from_stats` turns them into the score exactly as `sacrebleu.compute_bleu` (checked
against the package on fixed files).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torchmetrics import Metric

ORDER = 4
SMOOTHING = ("none", "exp")
_COMPOUND = re.compile(r"(\S)-(\S)")


def compound_split(line: str) -> str:
    """German compounds split as `compound_split_bleu.sh`: "a-b" -> "a ##AT##-##AT## b"."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


@dataclass
class BLEUStats:
    """Clipped n-gram matches and n-gram totals for n = 1..4, output and reference lengths."""

    correct: list[int]
    total: list[int]
    sys_len: int
    ref_len: int

    def __add__(self, other: BLEUStats) -> BLEUStats:
        return BLEUStats(
            [a + b for a, b in zip(self.correct, other.correct)],
            [a + b for a, b in zip(self.total, other.total)],
            self.sys_len + other.sys_len,
            self.ref_len + other.ref_len,
        )


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def sentence_stats(hyp: str, ref: str, order: int = ORDER) -> BLEUStats:
    """Statistics of one whitespace-tokenized output against one reference."""
    h, r = hyp.split(), ref.split()
    correct, total = [], []
    for n in range(1, order + 1):
        hc, rc = _ngrams(h, n), _ngrams(r, n)
        correct.append(sum(min(c, rc[g]) for g, c in hc.items()))
        total.append(max(0, len(h) - n + 1))
    return BLEUStats(correct, total, len(h), len(r))


def corpus_stats(hyps: Iterable[str], refs: Iterable[str], order: int = ORDER) -> BLEUStats:
    """Summed statistics of aligned outputs and references."""
    stats = BLEUStats([0] * order, [0] * order, 0, 0)
    hyps, refs = list(hyps), list(refs)
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} outputs but {len(refs)} references")
    for h, r in zip(hyps, refs):
        stats = stats + sentence_stats(h, r, order)
    return stats


def bleu_from_stats(stats: BLEUStats, smooth: str = "none") -> float:
    """BLEU (0-100) from corpus statistics, as `sacrebleu.compute_bleu` (no effective order).

    smooth="none": a zero n-gram precision gives 0 (multi-bleu, fairseq-score); "exp": the
    k-th zero precision becomes 1 / (2^k · total) (NIST's smoothing, sacrebleu's default).
    """
    if smooth not in SMOOTHING:
        raise ValueError(f"unknown smoothing {smooth!r}; choose one of {SMOOTHING}")
    if stats.sys_len == 0:
        return 0.0
    log_precisions = []
    factor = 1.0
    for correct, total in zip(stats.correct, stats.total):
        if total == 0:  # outputs shorter than n: a zero precision, whatever the smoothing
            return 0.0
        if correct == 0:
            if smooth == "none":
                return 0.0
            factor *= 2
            log_precisions.append(math.log(100.0 / (factor * total)))
        else:
            log_precisions.append(math.log(100.0 * correct / total))
    order = len(stats.correct)
    bp = 1.0 if stats.sys_len >= stats.ref_len else math.exp(1 - stats.ref_len / stats.sys_len)
    return bp * math.exp(sum(log_precisions) / order)


def tokenized_bleu(hyps: Iterable[str], refs: Iterable[str], compound: bool = True) -> float:
    """Tokenized BLEU of the Mega paper (`compound_split_bleu.sh` when `compound`)."""
    split = compound_split if compound else (lambda s: s)
    return bleu_from_stats(corpus_stats((split(h) for h in hyps), (split(r) for r in refs)))


def sacrebleu_score(hyps: Sequence[str], refs: Sequence[str]) -> tuple[float, str]:
    """SacreBLEU (13a tokenization, mixed case, exp smoothing) and its signature string."""
    from sacrebleu.metrics import BLEU

    metric = BLEU()
    score = metric.corpus_score(list(hyps), [list(refs)])
    return float(score.score), str(metric.get_signature())


class CorpusBLEU(Metric):
    """Corpus BLEU accumulated over batches (and processes) from whitespace-tokenized strings.

    `update(hyps, refs)` adds the statistics of aligned outputs and references; `compute()`
    returns BLEU (0-100). `compound=True` splits German compounds first (tokenized BLEU as
    reported); `smooth` as `bleu_from_stats`.
    """

    full_state_update = False
    higher_is_better = True
    correct: torch.Tensor
    total: torch.Tensor
    sys_len: torch.Tensor
    ref_len: torch.Tensor

    def __init__(self, compound: bool = False, smooth: str = "none", order: int = ORDER) -> None:
        super().__init__()
        if smooth not in SMOOTHING:
            raise ValueError(f"unknown smoothing {smooth!r}; choose one of {SMOOTHING}")
        self.compound, self.smooth, self.order = compound, smooth, order
        zeros = torch.zeros(order, dtype=torch.float64)
        self.add_state("correct", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("total", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state(
            "sys_len", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "ref_len", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(self, hyps: Sequence[str], refs: Sequence[str]) -> None:
        if self.compound:
            hyps = [compound_split(h) for h in hyps]
            refs = [compound_split(r) for r in refs]
        s = corpus_stats(hyps, refs, self.order)
        self.correct += torch.tensor(s.correct, dtype=torch.float64, device=self.correct.device)
        self.total += torch.tensor(s.total, dtype=torch.float64, device=self.total.device)
        self.sys_len += s.sys_len
        self.ref_len += s.ref_len

    def stats(self) -> BLEUStats:
        return BLEUStats(
            [round(v) for v in self.correct.tolist()],
            [round(v) for v in self.total.tolist()],
            round(float(self.sys_len)),
            round(float(self.ref_len)),
        )

    def compute(self) -> torch.Tensor:
        # On the states' device, like every logged value (a CPU tensor cannot go through NCCL).
        bleu = bleu_from_stats(self.stats(), self.smooth)
        return torch.tensor(bleu, dtype=torch.float64, device=self.correct.device)
