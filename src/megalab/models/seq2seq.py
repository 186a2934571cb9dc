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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from megalab.nn.state import register_state


def constructor_arguments(frame_locals: dict[str, Any]) -> dict[str, Any]:
    """The arguments of an `__init__`, from its `locals()` taken on entry."""
    return {k: v for k, v in frame_locals.items() if k not in ("self", "__class__")}


@register_state
@dataclass
class EncoderOut:
    """Encoder outputs (B, S, D) and the source mask (B, S) (True at real tokens, or None)."""

    memory: Tensor
    mask: Tensor | None


class EncoderDecoder(nn.Module):
    """Base class of megalab's encoder-decoders (see the module docstring).

    Subclasses set `vocab_size`, `pad_id`, `d_model`, `max_source_len` and `max_target_len`
    (None: unbounded) and `config` (their constructor's arguments, which checkpoints store),
    by hand or by passing `config` to this constructor, and implement `encode`, `decode`,
    `initial_state` and `step`.
    """

    vocab_size: int
    pad_id: int
    d_model: int
    max_source_len: int | None = None
    max_target_len: int | None = None
    config: dict[str, Any]

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        """With `config`, a subclass's constructor arguments (`constructor_arguments`), store it
        and take the sizes from its `vocab_size`, `pad_id`, `d_model`, `max_source_positions`
        and `max_target_positions`."""
        super().__init__()
        if config is not None:
            self.config = config  # which checkpoints store to rebuild the model
            self.vocab_size, self.pad_id = config["vocab_size"], config["pad_id"]
            self.d_model = config["d_model"]
            self.max_source_len = config["max_source_positions"]
            self.max_target_len = config["max_target_positions"]

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
