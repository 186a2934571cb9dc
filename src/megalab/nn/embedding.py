"""Input encoders: map a batch's `inputs` to (B, L, D) features for any backbone.

Token inputs use `TokenEmbedding`; real-valued features (pixels, audio, image patches) use
`FeatureEmbedding`. Both zero the features at padded positions so that nothing a backbone
computes can depend on pad content. `init_bert_params` is fairseq's BERT initialisation, shared
with the Transformer backbone (`init="bert"`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from megalab.nn.masking import zero_pads

INITS = ("default", "bert")
BERT_STD = 0.02


def init_bert_params(module: nn.Module) -> None:
    """fairseq's `init_bert_params`, for `Module.apply`: every `nn.Linear` weight and every
    `nn.Embedding` table ~ N(0, 0.02), Linear biases and an embedding's padding row zero.

    Other modules (norms, fairseq's RealNumberEmbedding) keep their own initialisation. It is
    what the fairseq LRA Transformer archs with `apply_bert_init=True` (ListOps, Text) use.
    """
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=BERT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=BERT_STD)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()


class TokenEmbedding(nn.Module):
    """Token embedding with the Mega-family initialisation.

    The authors' LRA encoders draw the table from N(0, d^-1/2) and do not scale the output;
    their language models scale by sqrt(d) (`scale=True`). `init="bert"` redraws the table as
    fairseq's `init_bert_params` does: N(0, 0.02) with a zero padding row. `init_truncation`
    draws from the normal truncated at ±that many σ (Megalodon's code: 3).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        pad_id: int | None = None,
        init_std: float | None = None,
        scale: bool = False,
        dropout: float = 0.0,
        init: str = "default",
        init_truncation: float | None = None,
    ) -> None:
        super().__init__()
        if init not in INITS:
            raise ValueError(f"TokenEmbedding init must be one of {INITS}, got {init!r}")
        if init == "bert" and init_std is not None:
            raise ValueError("init='bert' fixes the embedding std at 0.02: leave init_std unset")
        if vocab_size is None or vocab_size <= 0:
            raise ValueError(
                f"TokenEmbedding needs a positive vocab_size, got {vocab_size!r}: token inputs "
                "need a data config that declares `vocab_size`"
            )
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.pad_id = pad_id
        self.embed_scale = math.sqrt(d_model) if scale else 1.0
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        std = init_std or d_model**-0.5
        if init_truncation is None:
            nn.init.normal_(self.embedding.weight, mean=0.0, std=std)
        else:
            cut = init_truncation * std
            nn.init.trunc_normal_(self.embedding.weight, mean=0.0, std=std, a=-cut, b=cut)
        if init == "bert":
            init_bert_params(self.embedding)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        """Embed (B, L) int64 tokens; positions where `mask` is False become zero."""
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"TokenEmbedding expects integer token ids, got {tokens.dtype}: real-valued "
                "inputs need `FeatureEmbedding` (set the model's encoder accordingly)"
            )
        x = self.embedding(tokens) * self.embed_scale
        x = self.dropout(x)
        x = zero_pads(x, mask)
        return x


class FeatureEmbedding(nn.Module):
    """Linear map of real-valued features (B, L, C) to (B, L, D).

    `init="mega"` is the authors' RealNumberEmbedding for C = 1 (x·w + b with w ~ N(0, 1) and
    b ~ N(0, 0.1)); `init="default"` keeps PyTorch's Linear initialisation. `scale=True`
    multiplies the output by sqrt(d_model), as fairseq's LRA Transformer encoder does to every
    input embedding (pixels included) when its positions are sinusoidal.
    """

    def __init__(
        self,
        d_input: int,
        d_model: int,
        init: str = "default",
        dropout: float = 0.0,
        scale: bool = False,
    ) -> None:
        super().__init__()
        if d_input is None or d_input <= 0:
            raise ValueError(
                f"FeatureEmbedding needs a positive d_input, got {d_input!r}: real-valued "
                "inputs need a data config that declares `d_input`"
            )
        if init not in ("default", "mega"):
            raise ValueError(f"FeatureEmbedding init must be 'default' or 'mega', got {init!r}")
        self.d_input = d_input
        self.d_model = d_model
        self.proj = nn.Linear(d_input, d_model)
        if init == "mega":
            nn.init.normal_(self.proj.weight, mean=0.0, std=1.0)
            nn.init.normal_(self.proj.bias, mean=0.0, std=0.1)
        self.embed_scale = math.sqrt(d_model) if scale else 1.0
        self.dropout = nn.Dropout(dropout)

    def forward(self, features: Tensor, mask: Tensor | None = None) -> Tensor:
        """Project (B, L, C) (or (B, L), read as C = 1) features; zero padded positions."""
        if not features.is_floating_point():
            raise TypeError(
                f"FeatureEmbedding expects float features, got {features.dtype}: token inputs "
                "need `TokenEmbedding` (set the model's encoder accordingly)"
            )
        if features.dim() == 2:
            features = features.unsqueeze(-1)
        x = self.dropout(self.proj(features.to(self.proj.weight.dtype)) * self.embed_scale)
        x = zero_pads(x, mask)
        return x


class SequenceEncoder(nn.Module):
    """Picks a token or feature embedding from the data spec, so one model config fits any data.

    Exactly one of `vocab_size` (token inputs) and `d_input` (real-valued inputs) is set by the
    data config; `token_init_std`/`token_scale`, `feature_init`/`feature_scale` and `init` carry
    the model's choices. `init="bert"` is fairseq's `apply_bert_init` for the token table
    (N(0, 0.02), zero padding row); real-valued inputs keep `feature_init`, because fairseq's
    RealNumberEmbedding is neither a Linear nor an Embedding and `init_bert_params` skips it.
    """

    def __init__(
        self,
        d_model: int,
        vocab_size: int | None = None,
        d_input: int | None = None,
        pad_id: int | None = None,
        token_init_std: float | None = None,
        token_init_truncation: float | None = None,
        token_scale: bool = False,
        feature_init: str = "default",
        dropout: float = 0.0,
        feature_scale: bool = False,
        init: str = "default",
    ) -> None:
        super().__init__()
        if init not in INITS:
            raise ValueError(f"SequenceEncoder init must be one of {INITS}, got {init!r}")
        if (vocab_size is None) == (d_input is None):
            raise ValueError(
                "SequenceEncoder needs exactly one of vocab_size (token data) and d_input "
                f"(real-valued data); got vocab_size={vocab_size!r}, d_input={d_input!r}"
            )
        self.d_model = d_model
        self.embed: TokenEmbedding | FeatureEmbedding
        if vocab_size is not None:
            self.embed = TokenEmbedding(
                vocab_size,
                d_model,
                pad_id,
                init_std=token_init_std,
                init_truncation=token_init_truncation,
                scale=token_scale,
                dropout=dropout,
                init=init,
            )
        elif d_input is not None:
            self.embed = FeatureEmbedding(
                d_input, d_model, init=feature_init, dropout=dropout, scale=feature_scale
            )

    def forward(self, inputs: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L) tokens or (B, L, C) features -> (B, L, D)."""
        return self.embed(inputs, mask)
