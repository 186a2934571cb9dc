"""Beam search and greedy decoding for any `megalab.models.seq2seq.EncoderDecoder`.

`beam_search` is fairseq's `SequenceGenerator` with `BeamSearch` (v0.10, what the Mega authors'
`generate.py --beam 5 --lenpen 0.5` runs), step for step:

- decoding starts from `SpecialTokens.bos` (fairseq: the end-of-sentence id) and feeds one
  token per step to `model.step`, which carries the incremental state; the state (encoder
  keys/values included) is reordered with `megalab.nn.state.select_state` after every step;
- log-probabilities are taken in float32; padding is never generated; `unk_penalty` is
  subtracted from the unknown word; end-of-sentence is forbidden before `min_len` tokens and
  forced after `max_len = min(max_len_a · S + max_len_b, max_target_len − 1)` tokens (S: the
  padded source length);
- each step keeps the 2·beam best continuations of all beams (the first step expands the first
  beam only); an end-of-sentence among the first `beam` of them finishes a hypothesis, scored
  Σ log p / (generated tokens incl. EOS)^len_penalty; the best `beam` others continue; a
  sentence is done when it holds `beam` finished hypotheses (or at `max_len`) and leaves the
  batch.

When fewer than 2·beam continuations exist (a vocabulary smaller than the beam, which fairseq
cannot run), the missing candidates score −∞ and never finish: the search then keeps every
hypothesis, i.e. it is exhaustive (tested against enumerating all outputs of a tiny model).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from megalab.models.seq2seq import EncoderDecoder
from megalab.nn.state import select_state

NEG_INF = float("-inf")


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings, with fairseq's defaults (`fairseq-generate`).

    beam: beam size (1: greedy).  len_penalty: scores are divided by length^len_penalty.
    max_len_a, max_len_b: at most a·S + b tokens (S: source length).  min_len: tokens before
    the end of sentence.  unk_penalty: subtracted from the unknown word's log-probability.
    """

    beam: int = 5
    len_penalty: float = 1.0
    max_len_a: float = 0.0
    max_len_b: int = 200
    min_len: int = 1
    unk_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.beam < 1:
            raise ValueError(f"beam must be >= 1, got {self.beam}")
        if self.min_len < 0:
            raise ValueError(f"min_len must be >= 0, got {self.min_len}")


@dataclass(frozen=True)
class SpecialTokens:
    """The dictionary's ids that decoding treats apart.

    eos: ends a hypothesis.  pad: never generated.  unk: the unknown word, which
    `GenerationConfig.unk_penalty` penalises (None: no penalty).  bos: the first decoder input
    (None: `eos`, as fairseq starts decoding from the end-of-sentence id).
    """

    eos: int
    pad: int
    unk: int | None = None
    bos: int | None = None

    @property
    def start(self) -> int:
        """The first decoder input."""
        return self.eos if self.bos is None else self.bos


@dataclass
class Hypothesis:
    """A finished output: `tokens` (generated ids ending with EOS), its length-normalised
    `score` and the log-probability of every token (`positional_scores`)."""

    tokens: Tensor
    score: float
    positional_scores: Tensor


def max_output_len(model: EncoderDecoder, src_len: int, cfg: GenerationConfig) -> int:
    """fairseq's limit: min(a·S + b, max target positions − 1) generated tokens before EOS."""
    n = int(cfg.max_len_a * src_len + cfg.max_len_b)
    if model.max_target_len is not None:
        n = min(n, model.max_target_len - 1)
    return n


_SEPARATE_IDS = ("eos_id", "pad_id", "unk_id", "bos_id")
_Search = TypeVar("_Search", bound=Callable[..., Any])


def _separate_ids_accepted(search: _Search) -> _Search:
    """Let `search(model, src, src_mask, cfg, special)` also be called with the ids as
    separate arguments `eos_id, pad_id[, unk_id[, bos_id]]` (positional or keyword), the
    earlier spelling: a FutureWarning names `SpecialTokens`."""

    @functools.wraps(search)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        positional = args[4:] if len(args) > 4 and not isinstance(args[4], SpecialTokens) else ()
        ids = dict(zip(_SEPARATE_IDS, positional))
        ids.update((name, kwargs.pop(name)) for name in _SEPARATE_IDS if name in kwargs)
        if not ids:
            return search(*args, **kwargs)
        if len(positional) > len(_SEPARATE_IDS) or "eos_id" not in ids or "pad_id" not in ids:
            raise TypeError(
                f"{search.__name__}() takes its special ids as `special` (SpecialTokens)"
            )
        warnings.warn(
            f"{search.__name__}(..., eos_id, pad_id, unk_id, bos_id) is deprecated: pass "
            "special=SpecialTokens(eos=..., pad=..., unk=..., bos=...) instead",
            FutureWarning,
            stacklevel=2,
        )
        special = SpecialTokens(ids["eos_id"], ids["pad_id"], ids.get("unk_id"), ids.get("bos_id"))
        return search(*args[: len(args) - len(positional)], special=special, **kwargs)

    return cast(_Search, wrapper)


def _start(
    model: EncoderDecoder, src: Tensor, src_mask: Tensor | None, cfg: GenerationConfig, beam: int
) -> tuple[int, Any]:
    """The output length limit and the decoder's first state, whose rows are each sentence's
    encoder output `beam` times in a row."""
    B, S = src.shape
    max_len = max_output_len(model, S, cfg)
    enc = model.encode(src, src_mask)
    if beam > 1:
        enc = select_state(enc, torch.arange(B, device=src.device).repeat_interleave(beam))
    return max_len, model.initial_state(enc)


def _next_lprobs(
    model: EncoderDecoder,
    prev: Tensor,
    state: Any,
    step: int,
    max_len: int,
    cfg: GenerationConfig,
    special: SpecialTokens,
) -> tuple[Tensor, Any]:
    """One decoder step from the tokens `prev` (rows, 1): the float32 log-probabilities of the
    next token, masked as fairseq masks them (`step` of at most `max_len`), and the new state."""
    logits, state = model.step(prev, state)
    lprobs = F.log_softmax(logits[:, -1].float(), dim=-1)
    lprobs[lprobs != lprobs] = NEG_INF
    lprobs[:, special.pad] = NEG_INF
    if special.unk is not None and cfg.unk_penalty:
        lprobs[:, special.unk] -= cfg.unk_penalty
    if step >= max_len:
        lprobs[:, : special.eos] = NEG_INF
        lprobs[:, special.eos + 1 :] = NEG_INF
    elif step < cfg.min_len:
        lprobs[:, special.eos] = NEG_INF
    return lprobs, state


@_separate_ids_accepted
@torch.no_grad()
def beam_search(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None,
    cfg: GenerationConfig,
    special: SpecialTokens,
) -> list[list[Hypothesis]]:
    """The finished hypotheses of every source sentence, best first (at most `cfg.beam`)."""
    B = src.shape[0]
    beam = cfg.beam
    device = src.device
    eos_id, pad_id = special.eos, special.pad
    max_len, state = _start(model, src, src_mask, cfg, beam)

    tokens = torch.full((B * beam, max_len + 2), pad_id, dtype=torch.long, device=device)
    tokens[:, 0] = special.start
    scores = torch.zeros(B * beam, max_len + 1, dtype=torch.float32, device=device)
    finalized: list[list[Hypothesis]] = [[] for _ in range(B)]
    finished = [False] * B
    sent_ids = torch.arange(B, device=device)  # original sentence of each row of the batch
    bsz, remaining = B, B
    cand_size = 2 * beam
    cand_offsets = torch.arange(cand_size, device=device)
    cands_to_ignore = torch.zeros(B, beam, dtype=torch.bool, device=device)
    reorder: Tensor | None = None
    batch_idxs: Tensor | None = None

    for step in range(max_len + 1):
        if reorder is not None:
            if batch_idxs is not None:
                # Rows of finished sentences left the batch: shift the reorder into the
                # numbering the state still has.
                shift = batch_idxs - torch.arange(batch_idxs.numel(), device=device)
                reorder = (reorder.view(-1, beam) + shift.unsqueeze(-1) * beam).view(-1)
            state = select_state(state, reorder)
        lprobs, state = _next_lprobs(
            model, tokens[:, step : step + 1], state, step, max_len, cfg, special
        )
        V = lprobs.shape[-1]

        # BeamSearch.step: the 2·beam best continuations of each sentence.
        lp = lprobs.view(bsz, beam, V)
        if step == 0:
            lp = lp[:, :1]
        else:
            lp = lp + scores.view(bsz, beam, -1)[:, :, step - 1].unsqueeze(-1)
        flat = lp.reshape(bsz, -1)
        k = min(cand_size, flat.shape[1])
        cand_scores, idx = flat.topk(k, dim=1)
        if k < cand_size:  # fewer continuations than 2·beam: the rest are dead (−∞)
            cand_scores = F.pad(cand_scores, (0, cand_size - k), value=NEG_INF)
            idx = F.pad(idx, (0, cand_size - k), value=pad_id)
        cand_beams = torch.div(idx, V, rounding_mode="floor")
        cand_indices = idx.fmod(V)
        bbsz_offsets = (torch.arange(bsz, device=device) * beam).unsqueeze(1)
        cand_bbsz_idx = cand_beams + bbsz_offsets

        eos_mask = cand_indices.eq(eos_id) & cand_scores.ne(NEG_INF)
        eos_mask[:, :beam][cands_to_ignore] = False
        eos_bbsz_idx = torch.masked_select(cand_bbsz_idx[:, :beam], eos_mask[:, :beam])
        done: list[int] = []
        if eos_bbsz_idx.numel() > 0:
            eos_scores = torch.masked_select(cand_scores[:, :beam], eos_mask[:, :beam])
            done = _finalize(
                step, eos_bbsz_idx, eos_scores, tokens, scores, sent_ids, finalized, finished,
                beam, max_len, eos_id, cfg.len_penalty,
            )  # fmt: skip
            remaining -= len(done)
        if remaining == 0 or step >= max_len:
            break

        if done:
            keep = torch.ones(bsz, dtype=torch.bool, device=device)
            keep[done] = False
            batch_idxs = keep.nonzero().squeeze(-1)
            new_bsz = batch_idxs.numel()
            eos_mask, cand_beams = eos_mask[batch_idxs], cand_beams[batch_idxs]
            cand_bbsz_idx = cand_beams + (torch.arange(new_bsz, device=device) * beam).unsqueeze(1)
            cand_scores, cand_indices = cand_scores[batch_idxs], cand_indices[batch_idxs]
            cands_to_ignore = cands_to_ignore[batch_idxs]
            sent_ids = sent_ids[batch_idxs]
            scores = scores.view(bsz, -1)[batch_idxs].view(new_bsz * beam, -1)
            tokens = tokens.view(bsz, -1)[batch_idxs].view(new_bsz * beam, -1)
            bsz = new_bsz
        else:
            batch_idxs = None

        # The first `beam` candidates that did not just finish (nor were ignored) continue.
        eos_mask[:, :beam] = ~((~cands_to_ignore) & (~eos_mask[:, :beam]))
        active_mask = eos_mask.to(cand_offsets.dtype) * cand_size + cand_offsets
        new_ignore, active = active_mask.topk(beam, dim=1, largest=False)
        cands_to_ignore = new_ignore.ge(cand_size)[:, :beam]
        active_bbsz_idx = torch.gather(cand_bbsz_idx, 1, active).view(-1)
        tokens[:, : step + 1] = tokens[active_bbsz_idx, : step + 1]
        tokens.view(bsz, beam, -1)[:, :, step + 1] = torch.gather(cand_indices, 1, active)
        if step > 0:
            scores[:, :step] = scores[active_bbsz_idx, :step]
        scores.view(bsz, beam, -1)[:, :, step] = torch.gather(cand_scores, 1, active)
        reorder = active_bbsz_idx

    return [sorted(h, key=lambda x: x.score, reverse=True) for h in finalized]


def _finalize(
    step: int,
    bbsz_idx: Tensor,
    eos_scores: Tensor,
    tokens: Tensor,
    scores: Tensor,
    sent_ids: Tensor,
    finalized: list[list[Hypothesis]],
    finished: list[bool],
    beam: int,
    max_len: int,
    eos_id: int,
    len_penalty: float,
) -> list[int]:
    """fairseq's `finalize_hypos`: store the hypotheses that end at `step`; return the batch
    rows of the sentences this finishes."""
    hyp_tokens = tokens[bbsz_idx, 1 : step + 2].clone()
    hyp_tokens[:, step] = eos_id
    pos_scores = scores[bbsz_idx, : step + 1].clone()
    pos_scores[:, step] = eos_scores
    pos_scores[:, 1:] = pos_scores[:, 1:] - pos_scores[:, :-1]
    normalized = eos_scores / (step + 1) ** len_penalty
    seen: dict[int, int] = {}
    for i, (row, score) in enumerate(zip(bbsz_idx.tolist(), normalized.tolist())):
        unfin = row // beam
        sent = int(sent_ids[unfin])
        if len(finalized[sent]) < beam:
            finalized[sent].append(Hypothesis(hyp_tokens[i], score, pos_scores[i]))
        seen[sent] = unfin
    newly: list[int] = []
    for sent, unfin in seen.items():
        if not finished[sent] and (len(finalized[sent]) == beam or step == max_len):
            finished[sent] = True
            newly.append(unfin)
    return newly


@_separate_ids_accepted
@torch.no_grad()
def greedy_search(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None,
    cfg: GenerationConfig,
    special: SpecialTokens,
) -> list[Hypothesis]:
    """The most probable next token at every step (the same masks and limits as the beam)."""
    B = src.shape[0]
    max_len, state = _start(model, src, src_mask, cfg, 1)
    prev = src.new_full((B, 1), special.start)
    out = src.new_full((B, max_len + 1), special.pad)
    logp = torch.zeros(B, max_len + 1, dtype=torch.float32, device=src.device)
    length = torch.full((B,), max_len + 1, dtype=torch.long, device=src.device)
    for step in range(max_len + 1):
        lprobs, state = _next_lprobs(model, prev, state, step, max_len, cfg, special)
        best, prev = lprobs.max(dim=-1, keepdim=True)
        running = length > step
        out[:, step] = torch.where(running, prev[:, 0], out[:, step])
        logp[:, step] = torch.where(running, best[:, 0], logp[:, step])
        length = torch.where(running & prev[:, 0].eq(special.eos), step + 1, length)
        if not bool((length > step + 1).any()):
            break
    hyps = []
    for b in range(B):
        n = int(length[b])
        total = float(logp[b, :n].sum())
        hyps.append(Hypothesis(out[b, :n], total / n**cfg.len_penalty, logp[b, :n]))
    return hyps


@_separate_ids_accepted
def generate(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None,
    cfg: GenerationConfig,
    special: SpecialTokens,
) -> list[Hypothesis]:
    """The best hypothesis of each sentence by beam search (`cfg.beam`)."""
    nbest = beam_search(model, src, src_mask, cfg, special)
    return [h[0] for h in nbest]
