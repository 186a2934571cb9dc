"""Adaptive input embeddings (Baevski & Auli 2019) and adaptive softmax (Grave et al. 2017).

Both split the vocabulary, sorted by decreasing frequency, into bands at `cutoffs`
(e.g. [20000, 60000] + [V]); band i has width `initial_dim // factor**i`, so rare words get
small vectors. As in fairseq (which Mega's WikiText-103 model uses):

- `AdaptiveInput`: band i embeds its tokens in `dim_i` and projects them to `d_model` with a
  bias-free linear map; embeddings ~ N(0, dim_i^-1/2), projections Xavier-uniform. `scale`
  multiplies by sqrt(d_model) (the LM decoders' embedding scale).
- `AdaptiveSoftmax`: a head softmax over the first band's words plus one entry per tail cluster,
  and per tail cluster a projection d_model -> dim_i followed by the band's output matrix;
  log p(w) = log p_head(cluster(w)) + log p_tail(w | cluster). Dropout (`dropout`, fairseq's
  --adaptive-softmax-dropout) acts on the hidden state before the head and after each tail
  projection. `tie(adaptive_input)` shares the band embeddings with the output matrices
  (--tie-adaptive-weights) and, with `tie_proj`, the tail projections (transposed) with the
  input projections (--tie-adaptive-proj).

fairseq's adaptive loss also drops tail targets equal to its padding index (a word whose id
within its band is 1 is never scored); that quirk is not reproduced: every target is scored.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.nn.lm_head import LMHead
from megalab.nn.masking import zero_pads


class BandedParameters:
    """A module that keeps a band of parameters per frequency band of the vocabulary: a band with
    no token in a batch leaves its parameters out of the graph, so data-parallel training must
    look for unused parameters (`megalab.parallel.lightning`; a backbone says the same with
    `Backbone.data_dependent_parameters`)."""

    data_dependent_parameters: bool = True


def _bands(vocab_size: int, cutoffs: Sequence[int]) -> list[int]:
    """Band boundaries [c_0, c_1, ..., V], validated."""
    cuts = [int(c) for c in cutoffs]
    if vocab_size is None or vocab_size <= 0:
        raise ValueError(f"adaptive embeddings need a positive vocab_size, got {vocab_size!r}")
    if not cuts or any(c <= 0 for c in cuts) or any(b <= a for a, b in itertools.pairwise(cuts)):
        raise ValueError(f"cutoffs must be positive and increasing, got {list(cutoffs)}")
    if cuts[-1] > vocab_size:
        raise ValueError(
            f"cutoffs {cuts} exceed the vocabulary of {vocab_size} tokens: lower the cutoffs or "
            "check data.vocab_size"
        )
    return cuts if cuts[-1] == vocab_size else [*cuts, vocab_size]


def check_ids(tokens: Tensor, vocab_size: int, what: str, mask: Tensor | None = None) -> None:
    """Raise a ValueError naming the first id outside [0, vocab_size) (`what`: token, target),
    among the positions where `mask` is True (all without one). One host sync when the ids are
    valid: on a GPU, an id out of range would stop the process with a device-side assert."""
    out = (tokens < 0) | (tokens >= vocab_size)
    if mask is not None:
        out = out & mask
    if bool(out.any()):
        bad = tokens[out][0].item()
        raise ValueError(
            f"{what} id {bad} is outside the vocabulary of {vocab_size} tokens: check "
            "data.vocab_size against the data"
        )


class AdaptiveInput(BandedParameters, nn.Module):
    """Adaptive input embedding, usable as the LM task's encoder: `forward(tokens, mask)`."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        cutoffs: Sequence[int],
        factor: float = 4.0,
        initial_dim: int | None = None,
        pad_id: int | None = None,
        scale: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.vocab_size, self.d_model = vocab_size, d_model
        self.cutoffs = _bands(vocab_size, cutoffs)
        self.factor = factor
        self.initial_dim = initial_dim or d_model
        self.embed_scale = math.sqrt(d_model) if scale else 1.0
        self.embeddings = nn.ModuleList()
        self.projections = nn.ModuleList()
        prev = 0
        for i, cut in enumerate(self.cutoffs):
            dim = int(self.initial_dim // factor**i)
            if dim < 1:
                raise ValueError(f"band {i} would have width {dim}: lower factor or cutoffs")
            emb = nn.Embedding(cut - prev, dim)
            nn.init.normal_(emb.weight, mean=0.0, std=dim**-0.5)
            proj = nn.Linear(dim, d_model, bias=False)
            nn.init.xavier_uniform_(proj.weight)
            self.embeddings.append(emb)
            self.projections.append(proj)
            prev = cut
        self.pad_id = pad_id
        if pad_id is not None:
            with torch.no_grad():
                cast(nn.Embedding, self.embeddings[0]).weight[pad_id].zero_()
        self.dropout = nn.Dropout(dropout)

    def band_weights(self, band: int) -> tuple[nn.Parameter, nn.Parameter]:
        """(embedding (size, dim), projection (d_model, dim)) of a band."""
        emb, proj = self.embeddings[band], self.projections[band]
        # torch declares Embedding/Linear.weight as Tensor; they are Parameters.
        return cast(nn.Embedding, emb).weight, cast(nn.Linear, proj).weight  # type: ignore[return-value]

    def forward(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L) token ids -> (B, L, d_model); positions where `mask` is False are zero."""
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"AdaptiveInput expects integer token ids, got {tokens.dtype}")
        check_ids(tokens, self.vocab_size, "token", mask)
        weight = cast(nn.Linear, self.projections[0]).weight
        out = weight.new_zeros(*tokens.shape, self.d_model)
        prev = 0
        for emb, proj, cut in zip(self.embeddings, self.projections, self.cutoffs):
            sel = (tokens >= prev) & (tokens < cut)
            if bool(sel.any()):
                out = out.index_put((sel,), proj(emb(tokens[sel] - prev)).to(out.dtype))
            prev = cut
        out = self.dropout(out * self.embed_scale)
        out = zero_pads(out, mask)
        return out


class _Tail(nn.Module):
    """One tail cluster: projection d_model -> dim, dropout, output matrix dim -> band size."""

    def __init__(self, d_model: int, dim: int, size: int, dropout: float) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.empty(dim, d_model))
        self.out = nn.Parameter(torch.empty(size, dim))
        nn.init.xavier_uniform_(self.proj)
        nn.init.xavier_uniform_(self.out)
        self.proj_transposed = False  # True when tied to an input projection (d_model, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        proj = self.proj.t() if self.proj_transposed else self.proj
        return F.linear(self.dropout(F.linear(x, proj)), self.out)


class AdaptiveSoftmax(BandedParameters, LMHead):
    """Adaptive softmax head with `nll(hidden, targets)` like `LinearLMHead`.

    Args:
        d_model: width of the hidden states.  vocab_size: V.  cutoffs: band boundaries.
        factor: width divisor per band (tail i has width d_model // factor**(i+1)).
        dropout: adaptive-softmax dropout.  tie_proj: when tied, share the tail projections too.
    """

    def __init__(
        self,
        d_model: int,
        vocab_size: int,
        cutoffs: Sequence[int],
        factor: float = 4.0,
        dropout: float = 0.0,
        tie_proj: bool = False,
    ) -> None:
        super().__init__()
        self.d_model, self.vocab_size = d_model, vocab_size
        self.cutoffs = _bands(vocab_size, cutoffs)
        if len(self.cutoffs) < 2:
            raise ValueError("an adaptive softmax needs at least one cutoff below the vocabulary")
        self.factor, self.tie_proj = factor, tie_proj
        head = torch.empty(self.cutoffs[0] + len(self.cutoffs) - 1, d_model)
        nn.init.xavier_uniform_(head)
        self.head_words = nn.Parameter(head[: self.cutoffs[0]].clone())
        self.head_clusters = nn.Parameter(head[self.cutoffs[0] :].clone())
        self.tails = nn.ModuleList(
            _Tail(d_model, int(d_model // factor ** (i + 1)), hi - lo, dropout)
            for i, (lo, hi) in enumerate(itertools.pairwise(self.cutoffs))
        )
        self.dropout = nn.Dropout(dropout)

    def tie_encoder(self, encoder: nn.Module) -> None:
        """`tie` to the task's encoder, which must be an `AdaptiveInput`."""
        self.tie(encoder)

    def tie(self, adaptive_input: nn.Module) -> None:
        """Share the output matrices (and with `tie_proj` the tail projections) with an
        `AdaptiveInput` of the same vocabulary and cutoffs."""
        if not isinstance(adaptive_input, AdaptiveInput):
            raise ValueError(
                "an AdaptiveSoftmax ties only to an AdaptiveInput encoder; use "
                "megalab.nn.adaptive.AdaptiveInput as the model's encoder or set tie_weights=false"
            )
        if adaptive_input.cutoffs != self.cutoffs or adaptive_input.d_model != self.d_model:
            raise ValueError(
                f"cannot tie: input bands {adaptive_input.cutoffs} (d_model "
                f"{adaptive_input.d_model}) differ from output bands {self.cutoffs} (d_model "
                f"{self.d_model})"
            )
        emb0, _ = adaptive_input.band_weights(0)
        if emb0.shape != self.head_words.shape:
            raise ValueError(
                f"cannot tie the head {tuple(self.head_words.shape)} to the first band's "
                f"embedding {tuple(emb0.shape)}: the input's initial_dim must equal d_model"
            )
        self.head_words = emb0
        # fairseq's tied head: the cluster logits are their own Xavier-initialised linear map.
        with torch.no_grad():
            nn.init.xavier_uniform_(self.head_clusters)
        for i, tail in enumerate(cast(list[_Tail], list(self.tails))):
            emb, proj = adaptive_input.band_weights(i + 1)
            if emb.shape != tail.out.shape:
                raise ValueError(
                    f"cannot tie tail {i}: output {tuple(tail.out.shape)} vs input embedding "
                    f"{tuple(emb.shape)} (use the same factor for input and output)"
                )
            tail.out = emb
            if self.tie_proj:
                if proj.t().shape != tail.proj.shape:
                    raise ValueError(f"cannot tie the projection of tail {i}: shapes differ")
                tail.proj = proj
                tail.proj_transposed = True

    def _head_log_probs(self, x: Tensor) -> Tensor:
        weight = torch.cat([self.head_words, self.head_clusters], dim=0)
        return F.log_softmax(F.linear(x, weight).float(), dim=-1)

    def nll(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Per-token negative log-likelihood (B, L) in nats."""
        shape = targets.shape
        t = targets.reshape(-1)
        check_ids(t, self.vocab_size, "target")
        x = self.dropout(hidden.reshape(-1, hidden.shape[-1]))
        c0 = self.cutoffs[0]
        head_index = t.clone()
        for i, (lo, hi) in enumerate(itertools.pairwise(self.cutoffs)):
            head_index = torch.where((t >= lo) & (t < hi), c0 + i, head_index)
        nll = -self._head_log_probs(x).gather(1, head_index.unsqueeze(1)).squeeze(1)
        for tail, lo, hi in zip(self.tails, self.cutoffs, self.cutoffs[1:]):
            idx = ((t >= lo) & (t < hi)).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            lsm = F.log_softmax(tail(x.index_select(0, idx)).float(), dim=-1)
            picked = lsm.gather(1, (t.index_select(0, idx) - lo).unsqueeze(1)).squeeze(1)
            nll = nll.index_add(0, idx, -picked)
        return nll.view(shape)

    def log_probs(self, hidden: Tensor) -> Tensor:
        """Full log-distribution over the vocabulary (..., V) (for scoring and generation)."""
        lead = hidden.shape[:-1]
        x = self.dropout(hidden.reshape(-1, hidden.shape[-1]))
        head = self._head_log_probs(x)
        c0 = self.cutoffs[0]
        parts = [head[:, :c0]]
        for i, tail in enumerate(self.tails):
            parts.append(head[:, c0 + i : c0 + i + 1] + F.log_softmax(tail(x).float(), dim=-1))
        return torch.cat(parts, dim=-1).view(*lead, self.vocab_size)
