"""The stack of blocks that Mega, SeqBoat, Llama, Megalodon and S4D share.

Each of these backbones is, after its own input step (positions, an embedding norm), the same
computation over its `layers`:

    x₀ = Dropout(x) ⊙ m                 m: the mask, 1 at real tokens, 0 at padded positions
    xₗ, sₗ' = blockₗ(xₗ₋₁, mask, sₗ)     l = 1 … N; sₗ the layer's carried state (or None)
    y = final(x_N) ⊙ m                  the final norm (and what follows it); pads zeroed

`run_stack` runs it once, so every model streams, checkpoints and masks the same way:

- **Blocks as they are**: the blocks are iterated as given, without `isinstance` filters, since
  activation checkpointing and FSDP replace each block by a wrapper; every block is called as
  `block(x, mask, state, **block_kwargs)` and returns `(y, new_state, *extras)`, the
  convention chunk parallelism's hooks expect of `carried_modules()` (`megalab.parallel.chunk`:
  the state third, the pair first in the output).
- **Per-layer state**: with `states` (one per block, from the previous segment) each block gets
  its own and the new ones come back in order; without, the pass is stateless and returns
  none, sparing the state's reductions in stateless training. A final norm with a carried
  state of its own (Megalodon's timestep norm) is one more carried module at the end of
  `blocks`, with its state at the end of `states`.
- **Activation checkpointing**: with `checkpoint=True` each block runs through
  `megalab.nn.activation_checkpoint.checkpoint_block` (its input kept, its inside recomputed
  in the backward); results are unchanged.
- **Masks**: the input and the output are zeroed at padded positions, so `y` is zero there
  whatever the final step does.

What differs between the models stays in the model: the input step before the stack, the
block's keyword arguments (`return_state`, SeqBoat's `offset`), what a block returns beyond
its state (SeqBoat's per-layer report, in `extras`), and how the per-layer states make up the
backbone's state class. Transformer-XL and LaMemo (a memory of hidden states shared by all
layers, `models/transformer_xl/memory.py`), the Transformer (absolute positions, a layer
without state) and the translation decoders (cross-attention to an encoder) do not fit this
shape and keep their own loops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from megalab.nn.activation_checkpoint import checkpoint_block
from megalab.nn.masking import zero_pads


@dataclass
class StackOutput:
    """What `run_stack` returns: the features, the new per-block states, the blocks' extras.

    `states` is None for a stateless pass, else one entry per block (in order). `extras[l]` is
    what block l returned after `(y, state)` (an empty tuple for most models).
    """

    y: Tensor
    states: list[Any] | None
    extras: list[tuple[Any, ...]] = field(default_factory=list)


def run_stack(
    blocks: Iterable[nn.Module],
    x: Tensor,
    mask: Tensor | None = None,
    states: Sequence[Any] | None = None,
    *,
    input_dropout: Callable[[Tensor], Tensor] | None = None,
    final: Callable[[Tensor], Tensor] | None = None,
    checkpoint: bool = False,
    **block_kwargs: Any,
) -> StackOutput:
    """Dropout and mask the input, run `blocks` threading each one's state, finish, mask.

    x (B, L, D), mask (B, L) True at real tokens, `states` one per block (None: stateless).
    `input_dropout` (the model's embedding or input dropout) applies before the input is
    masked, `final` (the final norm, and what follows it) after the last block; every block
    gets `block_kwargs` and, with `checkpoint`, is recomputed in the backward.
    """
    blocks = list(blocks)
    if states is not None and len(states) != len(blocks):
        raise ValueError(
            f"the state holds {len(states)} layers, the model has {len(blocks)}: pass a state "
            "made by this model's initial_state"
        )
    if input_dropout is not None:
        x = input_dropout(x)
    x = zero_pads(x, mask)
    new_states: list[Any] | None = None if states is None else []
    extras: list[tuple[Any, ...]] = []
    for i, block in enumerate(blocks):
        layer_state = None if states is None else states[i]
        x, layer_state, *rest = checkpoint_block(
            block, x, mask, layer_state, enabled=checkpoint, **block_kwargs
        )
        extras.append(tuple(rest))
        if new_states is not None:
            new_states.append(layer_state)
    if final is not None:
        x = final(x)
    return StackOutput(zero_pads(x, mask), new_states, extras)
