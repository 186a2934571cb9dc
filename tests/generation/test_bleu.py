"""BLEU against the sacrebleu package on a fixed pair of files (tests/generation/data).

The files hold 30 tokenized German outputs and references, with hyphenated compounds, short
lines and an empty output. The numbers sacrebleu 2.6.0 gives for them are pinned too.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import sacrebleu

from megalab.generation.bleu import (
    CorpusBLEU,
    bleu_from_stats,
    compound_split,
    corpus_stats,
    sacrebleu_score,
    tokenized_bleu,
)

DATA = Path(__file__).parent / "data"
# sacrebleu 2.6.0 on the files: tokenize="none" (tokenized BLEU), without and with compounds
# split; and its default 13a tokenization (SacreBLEU).
PINNED = {"plain": 50.032703401942264, "compound": 51.735202008426796, "sacre": 50.032703401942264}


def lines(name: str) -> list[str]:
    return (DATA / name).read_text(encoding="utf-8").split("\n")[:-1]


HYP, REF = lines("sample.hyp.de"), lines("sample.ref.de")


def test_files_are_aligned() -> None:
    assert len(HYP) == len(REF) == 30
    assert "" in HYP


def test_tokenized_bleu_equals_sacrebleu_without_tokenization() -> None:
    ref = sacrebleu.corpus_bleu(HYP, [REF], tokenize="none", smooth_method="none").score
    ours = tokenized_bleu(HYP, REF, compound=False)
    assert math.isclose(ours, ref, rel_tol=1e-12)
    assert math.isclose(ours, PINNED["plain"], rel_tol=1e-12)


def test_compound_split_bleu_as_the_papers_script() -> None:
    split = [compound_split(x) for x in HYP], [compound_split(x) for x in REF]
    ref = sacrebleu.corpus_bleu(split[0], [split[1]], tokenize="none", smooth_method="none")
    ours = tokenized_bleu(HYP, REF, compound=True)
    assert math.isclose(ours, ref.score, rel_tol=1e-12)
    assert math.isclose(ours, PINNED["compound"], rel_tol=1e-12)


def test_compound_split_matches_the_perl_substitution() -> None:
    assert compound_split("Schüler-Lehrer-Konferenz") == (
        "Schüler ##AT##-##AT## Lehrer ##AT##-##AT## Konferenz"
    )
    # perl's /g does not overlap matches: the "b" of "a-b" cannot start the next one.
    assert compound_split("a-b-c - d") == "a ##AT##-##AT## b-c - d"


@pytest.mark.parametrize("smooth", ["none", "exp"])
def test_sentence_level_scores_and_smoothing(smooth: str) -> None:
    """Every sentence alone (zero n-gram matches, outputs shorter than 4 tokens, an empty one)."""
    for h, r in zip(HYP, REF):
        ref = sacrebleu.corpus_bleu([h], [[r]], tokenize="none", smooth_method=smooth).score
        ours = bleu_from_stats(corpus_stats([h], [r]), smooth=smooth)
        assert math.isclose(ours, ref, rel_tol=1e-12, abs_tol=1e-12), (h, r)


def test_metric_accumulates_batches_to_the_corpus_score() -> None:
    metric = CorpusBLEU(compound=True)
    for i in range(0, len(HYP), 7):
        metric.update(HYP[i : i + 7], REF[i : i + 7])
    assert math.isclose(float(metric.compute()), PINNED["compound"], rel_tol=1e-12)
    metric.reset()
    metric.update(HYP, REF)
    assert math.isclose(float(metric.compute()), PINNED["compound"], rel_tol=1e-12)


def test_sacrebleu_score_and_signature() -> None:
    score, signature = sacrebleu_score(HYP, REF)
    assert math.isclose(score, sacrebleu.corpus_bleu(HYP, [REF]).score, rel_tol=1e-12)
    assert math.isclose(score, PINNED["sacre"], rel_tol=1e-12)
    # The paper's signature (Table 6) but for the version.
    assert signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")


def test_misaligned_inputs_fail() -> None:
    with pytest.raises(ValueError, match="30 outputs but 29 references"):
        corpus_stats(HYP, REF[:-1])
