"""SeqBoat (Ren et al., NeurIPS 2023): sparse modular activation over a Mega-style EMA, and the
converter of the authors' checkpoints.
"""

from megalab.models.seqboat.model import (
    LayerReport,
    SeqBoat,
    SeqBoatBlock,
    SeqBoatConfig,
    SeqBoatLayer,
    SeqBoatLayerState,
    SeqBoatState,
)

__all__ = [
    "LayerReport",
    "SeqBoat",
    "SeqBoatBlock",
    "SeqBoatConfig",
    "SeqBoatLayer",
    "SeqBoatLayerState",
    "SeqBoatState",
]
