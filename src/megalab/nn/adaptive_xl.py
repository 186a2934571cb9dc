"""Transformer-XL's adaptive input and projected adaptive softmax (the XL and LaMemo code's
`AdaptiveEmbedding` and `ProjectedAdaptiveLogSoftmax`).

They differ from fairseq's pair in `megalab.nn.adaptive` in the parametrisation:

- The vocabulary (sorted by frequency) is split at `cutoffs` (+ [V]). With `div_val` = 1 there
  is one embedding table (V, d_embed) and, when d_embed ≠ d_model, one projection; the softmax
  reads slices of one output matrix (V, d_embed) with one bias. With `div_val` > 1 band i has
  width d_embed // div_val^i and its own table, projection (d_model, d_i) and output layer.
- The input is scaled by √d_model after the projection; `dropout` follows (the model's dropout
  on the embedding, which XL applies in the model and we apply here).
- The softmax head holds the first band's words plus one logit per tail cluster
  (`cluster_weight`, `cluster_bias`); tail i reads the head column −i, so cluster row
  n_clusters − i belongs to tail i (the code's ordering, kept so converted weights are exact).
- Tying (`tie_encoder`): every output layer shares its band's embedding table; with
  `tie_projs[i]` the softmax projection of band i is the input projection (the same
  (d_model, d_i) matrix: hidden @ P for the softmax, e @ Pᵀ for the input).

Initialisation is the XL trainer's `weights_init`: tables, output weights and cluster weights
N(0, `init_std`), projections N(0, `proj_init_std`), biases 0.

With no cutoffs, `div_val` 1 and d_embed = d_model (every LaMemo configuration and XL's
character-level ones), the encoder is a scaled embedding and the head a full softmax with a
bias whose weight is the embedding.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.nn.adaptive import BandedParameters, check_ids
from megalab.nn.lm_head import LMHead
from megalab.nn.masking import zero_pads
from megalab.nn.relative_attention import at_least_float32


def _ends(vocab_size: int, cutoffs: Sequence[int]) -> list[int]:
    """Band boundaries [c_0, …, V] (XL's `cutoffs + [n_token]`), validated."""
    if vocab_size is None or vocab_size <= 0:
        raise ValueError(f"adaptive embeddings need a positive vocab_size, got {vocab_size!r}")
    cuts = [int(c) for c in cutoffs]
    if any(c <= 0 for c in cuts) or any(b <= a for a, b in itertools.pairwise(cuts)):
        raise ValueError(f"cutoffs must be positive and increasing, got {list(cutoffs)}")
    if cuts and cuts[-1] >= vocab_size:
        raise ValueError(
            f"cutoffs {cuts} reach the vocabulary size {vocab_size}: every cutoff must be below "
            "it (lower the cutoffs or check data.vocab_size)"
        )
    return [*cuts, vocab_size]


def _band_dims(d_embed: int, div_val: int, bands: int) -> list[int]:
    if div_val < 1:
        raise ValueError(f"div_val must be >= 1, got {div_val}")
    if div_val == 1:
        return [d_embed]
    dims = [d_embed // div_val**i for i in range(bands)]
    if min(dims) < 1:
        raise ValueError(f"div_val={div_val} leaves a band of width 0: lower it or the cutoffs")
    return dims


class _Bands(BandedParameters, nn.Module):
    """The frequency bands both layers split the vocabulary into: boundaries `ends` ([c_0, …,
    V]), their `starts`, and each band's table width `dims`."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        d_embed: int | None,
        cutoffs: Sequence[int],
        div_val: int,
    ) -> None:
        super().__init__()
        self.vocab_size, self.d_model = vocab_size, d_model
        self.d_embed = d_embed or d_model
        self.cutoffs = list(cutoffs)
        self.ends = _ends(vocab_size, cutoffs)
        self.starts = [0, *self.ends[:-1]]
        self.div_val = div_val
        self.dims = _band_dims(self.d_embed, div_val, len(self.ends))


class AdaptiveEmbedding(_Bands):
    """XL's adaptive input embedding as an encoder: `forward(tokens, mask)` -> (B, L, d_model).

    Args:
        vocab_size: V.  d_model: output width (the code's d_proj).
        d_embed: table width of the first band (None: d_model).
        cutoffs: band boundaries below V ([]: one band).
        div_val: width divisor per band (1: one table for the whole vocabulary).
        dropout: on the scaled embedding (the model's dropout).
        init_std, proj_init_std: the trainer's initialisation scales.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        d_embed: int | None = None,
        cutoffs: Sequence[int] = (),
        div_val: int = 1,
        dropout: float = 0.0,
        init_std: float = 0.02,
        proj_init_std: float = 0.01,
    ) -> None:
        super().__init__(vocab_size, d_model, d_embed, cutoffs, div_val)
        self.emb_scale = math.sqrt(d_model)
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        if div_val == 1:
            self.emb_layers.append(nn.Embedding(vocab_size, self.d_embed))
            if d_model != self.d_embed:
                self.emb_projs.append(nn.Parameter(torch.empty(d_model, self.d_embed)))
        else:
            for lo, hi, dim in zip(self.starts, self.ends, self.dims):
                self.emb_layers.append(nn.Embedding(hi - lo, dim))
                self.emb_projs.append(nn.Parameter(torch.empty(d_model, dim)))
        self.dropout = nn.Dropout(dropout)
        self.init_std, self.proj_init_std = init_std, proj_init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for emb in self.emb_layers:
            nn.init.normal_(cast(nn.Embedding, emb).weight, 0.0, self.init_std)
        for proj in self.emb_projs:
            nn.init.normal_(cast(Tensor, proj), 0.0, self.proj_init_std)

    def forward(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L) ids -> √d_model · embedding, dropped out; zero where `mask` is False."""
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"AdaptiveEmbedding expects integer token ids, got {tokens.dtype}")
        check_ids(tokens, self.vocab_size, "token", mask)
        if self.div_val == 1:
            embed = self.emb_layers[0](tokens)
            if len(self.emb_projs):
                embed = F.linear(embed, self.emb_projs[0])
        else:
            flat = tokens.reshape(-1)
            embed = self.emb_projs[0].new_zeros(flat.shape[0], self.d_model)
            lo = 0
            for emb, proj, hi in zip(self.emb_layers, self.emb_projs, self.ends):
                idx = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)
                if idx.numel():
                    band = F.linear(emb(flat.index_select(0, idx) - lo), proj)
                    embed = embed.index_copy(0, idx, band.to(embed.dtype))
                lo = hi
            embed = embed.view(*tokens.shape, self.d_model)
        out = self.dropout(embed * self.emb_scale)
        out = zero_pads(out, mask)
        return out


class ProjectedAdaptiveLogSoftmax(_Bands, LMHead):
    """XL's output layer with `nll(hidden, targets)` and `log_probs(hidden)` as the LM heads.

    Args:
        d_model: hidden width (the code's d_proj).  vocab_size: V.
        d_embed: output table width of the first band (None: d_model).
        cutoffs, div_val: as `AdaptiveEmbedding` ([]: a full softmax).
        tie_projs: per band, whether `tie_encoder` shares its projection (XL's WT103 setting
            is [False] + [True] per tail; projections exist only when d_embed ≠ d_model or
            div_val > 1).
        tie_weight: whether `tie_encoder` shares the output tables with the embedding (XL's
            `tie_weight`, the default); False keeps them separate and shares only the
            projections of `tie_projs`, as the code does for an untied model.
        init_std, proj_init_std: the trainer's initialisation scales.
    """

    def __init__(
        self,
        d_model: int,
        vocab_size: int,
        d_embed: int | None = None,
        cutoffs: Sequence[int] = (),
        div_val: int = 1,
        tie_projs: Sequence[bool] = (False,),
        tie_weight: bool = True,
        init_std: float = 0.02,
        proj_init_std: float = 0.01,
    ) -> None:
        super().__init__(vocab_size, d_model, d_embed, cutoffs, div_val)
        self.n_clusters = len(self.ends) - 1
        self.tie_projs = list(tie_projs)
        self.tie_weight = tie_weight
        if self.n_clusters > 0:
            self.cluster_weight = nn.Parameter(torch.empty(self.n_clusters, self.d_embed))
            self.cluster_bias = nn.Parameter(torch.empty(self.n_clusters))
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ParameterList()
        if div_val == 1:
            for _ in self.ends:
                proj = torch.empty(d_model, self.d_embed) if d_model != self.d_embed else None
                self.out_projs.append(None if proj is None else nn.Parameter(proj))
            self.out_layers.append(nn.Linear(self.d_embed, vocab_size))
        else:
            for lo, hi, dim in zip(self.starts, self.ends, self.dims):
                self.out_projs.append(nn.Parameter(torch.empty(d_model, dim)))
                self.out_layers.append(nn.Linear(dim, hi - lo))
        self.init_std, self.proj_init_std = init_std, proj_init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in self.out_layers:
            linear = cast(nn.Linear, layer)
            nn.init.normal_(linear.weight, 0.0, self.init_std)
            nn.init.zeros_(linear.bias)
        for proj in self.out_projs:
            if proj is not None:
                nn.init.normal_(proj, 0.0, self.proj_init_std)
        if self.n_clusters > 0:
            nn.init.normal_(self.cluster_weight, 0.0, self.init_std)
            nn.init.zeros_(self.cluster_bias)

    def tie_encoder(self, encoder: nn.Module) -> None:
        """Share the output tables (unless `tie_weight=False`) and the projections of
        `tie_projs` with an `AdaptiveEmbedding` of the same vocabulary split (XL's
        `tie_weight`, `tie_projs`)."""
        if not isinstance(encoder, AdaptiveEmbedding):
            raise ValueError(
                "a ProjectedAdaptiveLogSoftmax ties only to an AdaptiveEmbedding encoder "
                "(megalab.nn.adaptive_xl.AdaptiveEmbedding), or set task.tie_weights=false"
            )
        if (encoder.ends, encoder.div_val, encoder.d_embed, encoder.d_model) != (
            self.ends,
            self.div_val,
            self.d_embed,
            self.d_model,
        ):
            raise ValueError(
                f"cannot tie: the embedding's bands {encoder.ends} (div_val {encoder.div_val}, "
                f"d_embed {encoder.d_embed}, d_model {encoder.d_model}) differ from the "
                f"softmax's {self.ends} (div_val {self.div_val}, d_embed {self.d_embed}, "
                f"d_model {self.d_model})"
            )
        if self.tie_weight:
            for layer, emb in zip(self.out_layers, encoder.emb_layers):
                layer.weight = emb.weight
        for i, tie in enumerate(self.tie_projs[: len(self.out_projs)]):
            if not tie or self.out_projs[i] is None:
                continue
            self.out_projs[i] = encoder.emb_projs[0 if self.div_val == 1 else i]

    def _logits(self, hidden: Tensor, weight: Tensor, bias: Tensor, proj: Tensor | None) -> Tensor:
        if proj is not None:
            hidden = F.linear(hidden, proj.t())
        return F.linear(hidden, weight, bias)

    def _band(self, i: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """(weight, bias, projection) of band i; band 0 includes the cluster rows."""
        if self.div_val == 1:
            lo, hi = self.starts[i], self.ends[i]
            first = cast(nn.Linear, self.out_layers[0])
            weight, bias = first.weight[lo:hi], first.bias[lo:hi]
        else:
            layer = cast(nn.Linear, self.out_layers[i])
            weight, bias = layer.weight, layer.bias
        if i == 0 and self.n_clusters > 0:
            weight = torch.cat([weight, self.cluster_weight], dim=0)
            bias = torch.cat([bias, self.cluster_bias], dim=0)
        return weight, bias, self.out_projs[i]

    def logits(self, hidden: Tensor) -> Tensor:
        """Output logits (..., V) of a full softmax (the code's `compute_logit`, which also
        refuses clusters: an adaptive softmax has log-probabilities, see `log_probs`)."""
        if self.n_clusters:
            raise ValueError("an adaptive softmax with cutoffs has no single logit vector")
        return self._logits(hidden, *self._band(0))

    def nll(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Per-token negative log-likelihood (B, L) in nats, in position order."""
        shape = targets.shape
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        check_ids(t, self.vocab_size, "target")
        head = F.log_softmax(at_least_float32(self._logits(h, *self._band(0))), dim=-1)
        if self.n_clusters == 0:
            return -head.gather(1, t.unsqueeze(1)).squeeze(1).view(shape)
        nll = head.new_zeros(t.shape[0])
        lo = 0
        for i, hi in enumerate(self.ends):
            idx = ((t >= lo) & (t < hi)).nonzero().squeeze(1)
            if idx.numel():
                target_i = t.index_select(0, idx) - lo
                head_i = head.index_select(0, idx)
                if i == 0:
                    logp = head_i.gather(1, target_i.unsqueeze(1)).squeeze(1)
                else:
                    tail = at_least_float32(self._logits(h.index_select(0, idx), *self._band(i)))
                    logp = head_i[:, -i] + F.log_softmax(tail, dim=-1).gather(
                        1, target_i.unsqueeze(1)
                    ).squeeze(1)
                nll = nll.index_copy(0, idx, -logp)
            lo = hi
        return nll.view(shape)

    def log_probs(self, hidden: Tensor) -> Tensor:
        """Full log-distribution over the vocabulary (..., V) (scoring and generation)."""
        lead = hidden.shape[:-1]
        h = hidden.reshape(-1, hidden.shape[-1])
        head = F.log_softmax(at_least_float32(self._logits(h, *self._band(0))), dim=-1)
        if self.n_clusters == 0:
            return head.view(*lead, self.vocab_size)
        parts = [head[:, : self.ends[0]]]
        for i in range(1, len(self.ends)):
            tail = F.log_softmax(at_least_float32(self._logits(h, *self._band(i))), dim=-1)
            parts.append(head[:, -i : head.shape[1] - i + 1] + tail)
        return torch.cat(parts, dim=-1).view(*lead, self.vocab_size)
