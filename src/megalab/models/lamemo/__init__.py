"""LaMemo (Ji et al., NAACL 2022): look-ahead memory over the Transformer-XL stack, and the
converter of the authors' checkpoints.
"""

from megalab.models.lamemo.model import (
    LaMemo,
    LaMemoConfig,
    LaMemoLayer,
    LaMemoState,
    interpolation_weight,
)

__all__ = [
    "LaMemo",
    "LaMemoConfig",
    "LaMemoLayer",
    "LaMemoState",
    "interpolation_weight",
]
