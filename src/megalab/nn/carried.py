"""The calling convention of the sequence layers that can carry a state from segment to segment.

A causal layer streams: fed a sequence segment by segment, each call taking the state the
previous call returned, it computes what one pass over the whole sequence computes. The EMAs
(`DampedEMA`, `ComplexEMA`), the S4D layer, MAGA, Llama's attention and the Mega, Llama and S4D
blocks are called the same way,

    y, new_state = layer(x, mask, state, return_state)

and `CarriedLayer` declares that call once: its `forward` settles whether a state is wanted
(a state passed in, or asked for) and hands over to the layer's `advance`, which holds the
layer's equations. A bidirectional layer takes the same call and refuses a state.

Other streaming modules keep calls of their own: the chunked attentions carry a key/value
`cache`, SeqBoat's SMA a working `memory`, SeqBoat's layer also takes its stream `offset` and
returns a report, and Megalodon's blocks return a state exactly when one is passed in (they
take no `return_state`).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from torch import Tensor, nn

__all__ = ["CarriedLayer"]

S = TypeVar("S")


class CarriedLayer(nn.Module, Generic[S]):
    """A sequence layer on (B, L, D) that carries a state of type `S` along time.

    Subclasses implement `advance` and keep `forward`, so every carried layer takes the same
    arguments, positionally or by name (chunk parallelism and the model stack rely on that).
    """

    #: True when the output at t depends on the inputs at positions ≤ t only; a layer that sees
    #: future tokens (bidirectional) cannot continue a stream and refuses a state.
    causal: bool = True

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        state: S | None = None,
        return_state: bool = False,
    ) -> tuple[Tensor, S | None]:
        """Run the layer over one segment.

        Args:
            x: (B, L, D) input.
            mask: (B, L) bool, True at real tokens (None: all real).
            state: what the previous segment returned, to continue its stream (causal layers
                only: a bidirectional one raises a ValueError); None starts afresh.
            return_state: return the state after this segment even without an incoming one
                (the start of a stream); a passed state always gets its successor back.

        Returns:
            (y (B, L, D), the new state, or None when no state is wanted).
        """
        want_state = return_state or state is not None
        if want_state and not self.causal:
            raise ValueError(
                f"a bidirectional {type(self).__name__} sees future tokens and cannot be streamed; "
                "build it causal (without the backward direction) to carry a state"
            )
        return self.advance(x, mask, state, want_state)

    def advance(
        self, x: Tensor, mask: Tensor | None, state: S | None, want_state: bool
    ) -> tuple[Tensor, S | None]:
        """The layer on one segment: y and, when `want_state`, the state after the segment."""
        raise NotImplementedError(f"{type(self).__name__} does not implement advance()")
