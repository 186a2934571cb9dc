"""The encoder-decoder contract: what a translation model is to the seq2seq task and beam search.

An encoder-decoder maps source tokens to target-vocabulary logits, batch-first:

    enc = model.encode(src, src_mask)              src (B, S) ids, src_mask (B, S) True at real ids
    logits = model.decode(tgt_in, tgt_mask, enc)   tgt_in (B, T) -> (B, T, V), teacher forcing
    state = model.initial_state(enc)               incremental decoding starts here
    logits, state = model.step(tokens, state)      tokens (B, L) continue every stream

`forward(src, src_mask, tgt_in, tgt_mask)` is `decode(..., encode(...))`. Decoder inputs start
with the end-of-sentence id (fairseq's convention: `[</s>, y_1, ..., y_n]` predicts
`[y_1, ..., y_n, </s>]`). Stepping through a target, one token or several at a time, gives the
logits of one `decode` pass over it (tested per model).

`EncoderOut` and every decoder state are registered state classes whose tensors hold the batch
in dim 0, so `megalab.nn.state.select_state` expands a batch into beams and reorders them
(beam search) without knowing the model.

Each model takes one frozen config dataclass, a subclass of `EncoderDecoderConfig` whose
fields are its typed, documented options (`MegaEncoderDecoder(MegaEncoderDecoderConfig(
vocab_size=V, pad_id=1))`, or `MegaEncoderDecoderConfig(...).build()`), as backbones take
theirs (`megalab.models.base.BackboneConfig`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor, nn

from megalab.nn.state import register_state
from megalab.utils.options import check_options, config_class_of, option, rate


@register_state
@dataclass
class EncoderOut:
    """Encoder outputs (B, S, D) and the source mask (B, S) (True at real tokens, or None)."""

    memory: Tensor
    mask: Tensor | None


@dataclass(frozen=True)
class EncoderDecoderConfig:
    """Base of the encoder-decoders' config dataclasses: the options every translation model
    has, declared once with `megalab.utils.options` (type, range, meaning); each model's config
    adds its own and `build()`s the model.

    Hydra builds the config from YAML: `model.encoder_decoder._target_` names the config class
    and the other keys are its fields (`model.encoder_decoder.dropout=0.3` overrides one); the
    seq2seq task builds the model from it. Checkpoints store the fields (`options()`), which
    `EncoderDecoder.from_options` reads back.
    """

    vocab_size: int = option(
        dataclasses.MISSING, ge=1, doc="the (joint) vocabulary of sources, targets and output"
    )
    pad_id: int = option(dataclasses.MISSING, ge=0, doc="the vocabulary's padding id")
    d_model: int = option(512, ge=1, doc="d, the width of both stacks and of the embeddings")
    encoder_layers: int = option(6, ge=1, doc="number of encoder layers")
    decoder_layers: int = option(6, ge=1, doc="number of decoder layers")
    max_source_positions: int = option(
        1024, ge=1, doc="the longest source (fairseq's --max-source-positions, 1024)"
    )
    max_target_positions: int = option(
        1024, ge=1, doc="the longest target (fairseq's --max-target-positions, 1024)"
    )
    prenorm: bool = option(
        False,
        doc="pre-norm layers and a final norm after each stack (fairseq's --*-normalize-before) "
        "or post-norm layers (False, the WMT models)",
    )
    dropout: float = rate(
        0.1,
        doc="on the embeddings and in every layer (Mega: on X', Ĥ and the FFN output; the "
        "Transformer: on the attention and FFN outputs)",
    )
    share_all_embeddings: bool = option(
        True,
        doc="one table for source, target and output projection (--share-all-embeddings, "
        "which needs a joint vocabulary)",
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.pad_id >= self.vocab_size:
            raise ValueError(
                f"pad_id must be an id of the vocabulary (< vocab_size={self.vocab_size}), "
                f"got {self.pad_id}"
            )

    def options(self) -> dict[str, Any]:
        """The fields by name: what a checkpoint stores to build the model again."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def build(self) -> EncoderDecoder:
        """The encoder-decoder this config describes."""
        raise NotImplementedError(f"{type(self).__name__} does not say which model it builds")


E = TypeVar("E", bound="EncoderDecoder")


class EncoderDecoder(nn.Module):
    """Base class of megalab's encoder-decoders (see the module docstring).

    A subclass's constructor takes its config object, `__init__(self, config: XConfig)`, and
    hands it here; it implements `encode`, `decode`, `initial_state` and `step`.
    """

    vocab_size: int
    pad_id: int
    d_model: int
    max_source_len: int | None = None
    max_target_len: int | None = None
    config: EncoderDecoderConfig
    """The model's options, which checkpoints store (`config.options()`) to rebuild it."""

    def __init__(self, config: EncoderDecoderConfig) -> None:
        """Keep `config` and take the sizes from it: `vocab_size`, `pad_id`, `d_model` and the
        longest source and target (`max_source_positions`, `max_target_positions`)."""
        super().__init__()
        self.config = config
        self.vocab_size, self.pad_id = config.vocab_size, config.pad_id
        self.d_model = config.d_model
        self.max_source_len = config.max_source_positions
        self.max_target_len = config.max_target_positions

    @classmethod
    def config_class(cls) -> type[EncoderDecoderConfig]:
        """The config dataclass this model's constructor takes."""
        found = config_class_of(cls)
        if found is None or not issubclass(found, EncoderDecoderConfig):
            raise TypeError(f"{cls.__name__}.__init__ does not take an EncoderDecoderConfig")
        return found

    @classmethod
    def from_options(cls: type[E], options: Mapping[str, Any]) -> E:
        """The model built from its config's fields by name, as checkpoints store them (those
        written when the models took their options as keyword arguments store the same names).
        Raises a TypeError naming an unknown option, a ValueError for one out of range."""
        return cls(cls.config_class()(**dict(options)))

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> EncoderOut:
        raise NotImplementedError

    def decode(self, tgt_in: Tensor, tgt_mask: Tensor | None, enc: EncoderOut) -> Tensor:
        raise NotImplementedError

    def initial_state(self, enc: EncoderOut) -> Any:
        raise NotImplementedError

    def step(self, tokens: Tensor, state: Any) -> tuple[Tensor, Any]:
        raise NotImplementedError

    def forward(  # type: ignore[override]
        self,
        src: Tensor,
        src_mask: Tensor | None,
        tgt_in: Tensor,
        tgt_mask: Tensor | None = None,
    ) -> Tensor:
        """Teacher-forced logits (B, T, V)."""
        return self.decode(tgt_in, tgt_mask, self.encode(src, src_mask))

    def check_lengths(self, src_len: int | None = None, tgt_len: int | None = None) -> None:
        """Raise a ValueError naming the limit when a source or target is too long."""
        for name, length, limit, knob in (
            ("source", src_len, self.max_source_len, "max_source_positions"),
            ("target", tgt_len, self.max_target_len, "max_target_positions"),
        ):
            if length is not None and limit is not None and length > limit:
                raise ValueError(
                    f"{name} length {length} exceeds {knob}={limit} of {type(self).__name__}: "
                    f"raise model.{knob} or filter longer sentences (data.max_source_len / "
                    "data.max_target_len)"
                )
