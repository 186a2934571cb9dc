"""The batch: one dict type that every DataModule produces and every task reads.

Masks are True at real tokens (the authors' code uses pad-is-True; convert at that boundary
only). Sequences are batch-first.
"""

from __future__ import annotations

from typing import TypedDict

from torch import Tensor


class Batch(TypedDict, total=False):
    """Keys a batch may carry; `inputs` and `targets` are always present.

    inputs: (B, L) int64 tokens, or (B, L, C) float features (pixels, audio, patches).
    targets: (B,) class ids, (B, C) soft labels (Mixup/CutMix), or (B, L) next tokens (LM).
    mask: (B, L) bool, True at real input positions; absent when nothing is padded.
    inputs2, mask2: the second document of a pair (two-tower retrieval).
    target_mask: (B, L) bool, True where a prediction is scored (LM; sliding-window evaluation
        scores only the new tokens of each window). Defaults to `mask`.
    reset: bool, True when an LM batch starts new streams (the carried state is dropped).
    stream_group: int, which set of LM streams the batch continues (gradient accumulation
        interleaves several).
    num_words: (B,) int, words covered by the scored tokens (word-level perplexity with a
        subword vocabulary).
    index: (B,) int, the examples' positions in their split (seq2seq: raw references).
    """

    inputs: Tensor
    targets: Tensor
    mask: Tensor
    inputs2: Tensor
    mask2: Tensor
    target_mask: Tensor
    reset: bool | Tensor
    stream_group: int | Tensor
    num_words: Tensor
    index: Tensor
