"""Transformer-XL (Dai et al., ACL 2019): segment recurrence with relative positions, the memory
stack LaMemo shares, and the converter.
"""

from megalab.models.transformer_xl.model import (
    TransformerXL,
    TransformerXLConfig,
    XLLayer,
    XLMemory,
)

__all__ = [
    "TransformerXL",
    "TransformerXLConfig",
    "XLLayer",
    "XLMemory",
]
