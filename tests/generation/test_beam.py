"""Beam search: beam 1 is greedy decoding; on a tiny vocabulary a wide beam finds the best
output by exhaustive enumeration; batching (sentences leaving the batch) changes nothing."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from megalab.generation.beam import (
    GenerationConfig,
    SpecialTokens,
    beam_search,
    generate,
    greedy_search,
)
from megalab.models.mega.translation import MegaEncoderDecoderConfig
from megalab.models.transformer.translation import TransformerEncoderDecoderConfig

PAD, EOS, UNK = 1, 2, 3
SPECIAL = SpecialTokens(eos=EOS, pad=PAD, unk=UNK)


def tiny_model(kind: str, vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "mega":
        model = MegaEncoderDecoderConfig(
            vocab, PAD, d_model=16, encoder_layers=1, decoder_layers=2, z_dim=8, v_dim=16,
            ffn_dim=16, ema_dim=4, max_source_positions=32, max_target_positions=32,
        ).build()  # fmt: skip
    else:
        model = TransformerEncoderDecoderConfig(
            vocab, PAD, d_model=16, num_heads=2, ffn_dim=32, encoder_layers=1, decoder_layers=2
        ).build()
    model = model.double().eval()
    with torch.no_grad():  # sharpen the distributions: the init makes them near uniform
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn_like(p) * 0.5)
        # A larger end-of-sentence row (the output is tied to it): outputs of mixed lengths.
        model.embed_tgt.embedding.weight[EOS] *= 3
    return model


def sources(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (4, 6), generator=g)
    mask = torch.ones_like(src, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    src[:, -1] = EOS
    return src.masked_fill(~mask, PAD), mask


@pytest.mark.parametrize("kind", ["mega", "transformer"])
def test_beam_one_is_greedy(kind: str) -> None:
    model = tiny_model(kind, 30)
    src, mask = sources(30)
    cfg = GenerationConfig(beam=1, len_penalty=0.5, max_len_b=12)
    beams = beam_search(model, src, mask, cfg, SPECIAL)
    greedy = greedy_search(model, src, mask, cfg, SPECIAL)
    for nbest, g in zip(beams, greedy):
        assert len(nbest) == 1
        assert torch.equal(nbest[0].tokens, g.tokens)
        assert math.isclose(nbest[0].score, g.score, rel_tol=1e-6)
        # fairseq recovers per-token scores from float32 running sums.
        assert torch.allclose(nbest[0].positional_scores, g.positional_scores, atol=1e-4)
    assert any(len(g.tokens) < 13 for g in greedy), "no sentence ended before the limit"


def exhaustive(model, src, mask, vocab: int, max_len: int, len_penalty: float):
    """Every output (1..max_len tokens of any id but padding and EOS, then EOS; like fairseq,
    <s> and <unk> can be generated) with its score Σ log p / (tokens + 1)^len_penalty, from
    teacher-forced log-probabilities."""
    words = [w for w in range(vocab) if w not in (PAD, EOS)]
    outputs = []
    with torch.no_grad():
        enc = model.encode(src, mask)
        for n in range(1, max_len + 1):
            for seq in itertools.product(words, repeat=n):
                tgt = torch.tensor([[EOS, *seq]])
                lprobs = F.log_softmax(model.decode(tgt, None, enc).float(), dim=-1)[0]
                out = [*seq, EOS]
                total = sum(float(lprobs[t, w]) for t, w in enumerate(out))
                outputs.append((total / len(out) ** len_penalty, out))
    return sorted(outputs, reverse=True)


@pytest.mark.parametrize(("kind", "len_penalty"), [("mega", 0.5), ("transformer", 1.0)])
def test_wide_beam_returns_the_best_of_all_outputs(kind: str, len_penalty: float) -> None:
    """Vocabulary of 5 (<s>, <pad>, </s>, <unk> and one word): 3 + 9 + 27 = 39 outputs of at
    most 3 tokens; a beam of 64 keeps all of them, so its n-best list is the exhaustive
    ranking."""
    vocab, max_len = 5, 3
    model = tiny_model(kind, vocab, seed=3)
    src, mask = sources(vocab, seed=4)
    cfg = GenerationConfig(beam=64, len_penalty=len_penalty, max_len_b=max_len)
    nbest = beam_search(model, src[:1], mask[:1], cfg, SPECIAL)[0]
    ranking = exhaustive(model, src[:1], mask[:1], vocab, max_len, len_penalty)
    assert len(nbest) == len(ranking) == 39
    assert nbest[0].tokens.tolist() == ranking[0][1]
    assert math.isclose(nbest[0].score, ranking[0][0], rel_tol=1e-5)
    for hyp, (score, _) in zip(nbest, ranking):
        assert math.isclose(hyp.score, score, rel_tol=1e-5)


@pytest.mark.parametrize("kind", ["mega", "transformer"])
def test_batched_beam_search_equals_one_sentence_at_a_time(kind: str) -> None:
    """Sentences finish at different steps and leave the batch; the state is reordered with
    the shifted indices: every sentence gets what it gets alone."""
    model = tiny_model(kind, 30, seed=13)
    src, mask = sources(30, seed=6)
    cfg = GenerationConfig(beam=4, len_penalty=0.5, max_len_a=1.0, max_len_b=3)
    batched = beam_search(model, src, mask, cfg, SPECIAL)
    for b in range(src.shape[0]):
        n = int(mask[b].sum())
        # Same padded width as the batch, so that max_len (from S) is the same.
        alone = beam_search(model, src[b : b + 1], mask[b : b + 1], cfg, SPECIAL)[0]
        assert [h.tokens.tolist() for h in alone] == [h.tokens.tolist() for h in batched[b]]
        for a, c in zip(alone, batched[b]):
            assert math.isclose(a.score, c.score, rel_tol=1e-6), n
    # The step a sentence finished at is the length of its longest finished hypothesis.
    finish_steps = {max(len(h.tokens) for h in nbest) for nbest in batched}
    assert len(finish_steps) > 1, "all sentences finished together: the removal is untested"


def test_max_len_forces_the_end_and_min_len_delays_it() -> None:
    model = tiny_model("mega", 30)
    src, mask = sources(30)
    out = beam_search(model, src, mask, GenerationConfig(beam=3, max_len_b=2, min_len=2), SPECIAL)
    for nbest in out:
        for h in nbest:
            assert h.tokens[-1] == EOS and 3 <= len(h.tokens) <= 3
    with pytest.raises(ValueError, match="beam"):
        GenerationConfig(beam=0)


def _flat(out: list) -> list:
    """Every hypothesis of a search's output (n-best lists or one per sentence)."""
    return [h for item in out for h in (item if isinstance(item, list) else [item])]


def _same(a: list, b: list) -> bool:
    return all(
        torch.equal(x.tokens, y.tokens)
        and x.score == y.score
        and torch.equal(x.positional_scores, y.positional_scores)
        for x, y in zip(_flat(a), _flat(b), strict=True)
    )


def test_separate_ids_still_accepted_with_a_future_warning() -> None:
    """The earlier spelling `eos_id, pad_id, unk_id[, bos_id]` (positional or keyword) decodes
    as `SpecialTokens` does, and warns."""
    model = tiny_model("mega", 30)
    src, mask = sources(30)
    cfg = GenerationConfig(beam=2, max_len_b=4)
    for search in (beam_search, greedy_search, generate):
        expected = search(model, src, mask, cfg, SPECIAL)
        assert _same(search(model, src, mask, cfg, special=SPECIAL), expected)
        with pytest.warns(FutureWarning, match="SpecialTokens"):
            positional = search(model, src, mask, cfg, EOS, PAD, UNK)
        with pytest.warns(FutureWarning, match="SpecialTokens"):
            keyword = search(model, src, mask, cfg, eos_id=EOS, pad_id=PAD, unk_id=UNK)
        assert _same(positional, expected) and _same(keyword, expected), search.__name__
    with pytest.warns(FutureWarning, match="SpecialTokens"):
        started = greedy_search(model, src, mask, cfg, EOS, PAD, UNK, 0)
    assert _same(started, greedy_search(model, src, mask, cfg, SpecialTokens(EOS, PAD, UNK, 0)))
    with pytest.raises(TypeError, match="special"):
        beam_search(model, src, mask, cfg, pad_id=PAD)


def test_decoding_starts_from_bos_or_else_eos() -> None:
    assert SpecialTokens(eos=2, pad=1).start == 2
    assert SpecialTokens(eos=2, pad=1, bos=0).start == 0
