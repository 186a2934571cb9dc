"""Sequence pooling and output heads shared by every task."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

POOLING_MODES = ("mean", "first", "last", "sum")


def masked_mean(y: Tensor, mask: Tensor | None) -> Tensor:
    """Mean over real positions: (B, L, D) -> (B, D); the divisor is each sequence's length."""
    if mask is None:
        return y.mean(dim=1)
    m = mask.to(y.dtype).unsqueeze(-1)
    return (y * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


def pool(y: Tensor, mask: Tensor | None, mode: str = "mean") -> Tensor:
    """Reduce (B, L, D) to (B, D): length-aware `mean`, `sum`, `first` or `last` real token."""
    if mode == "mean":
        return masked_mean(y, mask)
    if mode == "sum":
        return y.sum(dim=1) if mask is None else (y * mask.unsqueeze(-1).to(y.dtype)).sum(dim=1)
    if mode == "first":
        return y[:, 0]
    if mode == "last":
        if mask is None:
            return y[:, -1]
        last = mask.long().sum(dim=1).clamp_min(1) - 1
        return y[torch.arange(y.size(0), device=y.device), last]
    raise ValueError(f"unknown pooling mode {mode!r}; choose one of {POOLING_MODES}")


class ClassificationHead(nn.Module):
    """The Mega-family classifier: act(dropout(fc1(x))) -> fc2 without bias, xavier init.

    With `d_hidden=0` it is a single linear layer with a zero-initialised bias (the mega-image
    head), also xavier-initialised. `init="bert"` draws both layers from N(0, 0.02) with zero
    biases, as fairseq's BERT initialisation of the LRA Transformer baselines.
    """

    def __init__(
        self,
        d_in: int,
        d_hidden: int,
        num_classes: int,
        dropout: float = 0.0,
        activation: str = "gelu",
        init: str = "xavier",
    ) -> None:
        super().__init__()
        if init not in ("xavier", "bert"):
            raise ValueError(f"unknown head init {init!r}; choose 'xavier' or 'bert'")
        if num_classes is None or num_classes < 2:
            raise ValueError(f"ClassificationHead needs num_classes >= 2, got {num_classes!r}")
        if activation not in ("gelu", "relu", "silu", "tanh"):
            raise ValueError(f"unknown head activation {activation!r}")
        self.activation = activation
        self.fc1: nn.Linear | None = None
        if d_hidden > 0:
            self.fc1 = nn.Linear(d_in, d_hidden)
            nn.init.xavier_uniform_(self.fc1.weight)
            nn.init.zeros_(self.fc1.bias)
            self.fc2 = nn.Linear(d_hidden, num_classes, bias=False)
            nn.init.xavier_uniform_(self.fc2.weight)
        else:
            self.fc2 = nn.Linear(d_in, num_classes)
            nn.init.xavier_uniform_(self.fc2.weight)
            nn.init.zeros_(self.fc2.bias)
        if init == "bert":
            # fairseq's init_bert_params, applied by its LRA Transformer to the whole model
            for layer in (self.fc1, self.fc2):
                if layer is not None:
                    nn.init.normal_(layer.weight, std=0.02)
                    if layer.bias is not None:
                        nn.init.zeros_(layer.bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(B, d_in) pooled features -> (B, num_classes) logits."""
        if self.fc1 is not None:
            x = getattr(F, self.activation)(self.dropout(self.fc1(x)))
        return self.fc2(x)


def combine_pair(a: Tensor, b: Tensor, mode: str) -> Tensor:
    """Combine two pooled documents for two-tower retrieval.

    `concat` is [a, b] (Mega); `nli` is [a, b, a - b, a * b] (LRA, S4); `nli_seqboat` is the
    SeqBoat code's `--use-nli` order [b, a, a * b, a - b].
    """
    if mode == "concat":
        return torch.cat([a, b], dim=-1)
    if mode == "nli":
        return torch.cat([a, b, a - b, a * b], dim=-1)
    if mode == "nli_seqboat":
        return torch.cat([b, a, a * b, a - b], dim=-1)
    raise ValueError(f"unknown pair combination {mode!r}; choose 'concat', 'nli' or 'nli_seqboat'")


def pair_width(d_model: int, mode: str) -> int:
    """Width of `combine_pair`'s output."""
    widths = {"concat": 2, "nli": 4, "nli_seqboat": 4}
    if mode not in widths:
        raise ValueError(f"unknown pair combination {mode!r}; choose one of {sorted(widths)}")
    return widths[mode] * d_model
