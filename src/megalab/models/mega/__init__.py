"""Mega (Ma et al., ICLR 2023): moving-average gated attention, its encoder-decoder for translation
and the converter of the authors' checkpoints.
"""

from megalab.models.mega.model import (
    MAGAState,
    Mega,
    MegaBlock,
    MegaConfig,
    MegaState,
    MovingAverageGatedAttention,
)

__all__ = [
    "MAGAState",
    "Mega",
    "MegaBlock",
    "MegaConfig",
    "MegaState",
    "MovingAverageGatedAttention",
]
