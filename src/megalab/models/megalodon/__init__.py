"""Megalodon (Ma et al., 2024): complex EMA, timestep normalization, normalized attention, and the
converter of the authors' checkpoints.
"""

from megalab.models.megalodon.model import (
    Megalodon,
    MegalodonAttention,
    MegalodonBlock,
    MegalodonConfig,
    MegalodonLayerState,
    MegalodonState,
    NormalizedFeedForward,
)

__all__ = [
    "Megalodon",
    "MegalodonAttention",
    "MegalodonBlock",
    "MegalodonConfig",
    "MegalodonLayerState",
    "MegalodonState",
    "NormalizedFeedForward",
]
