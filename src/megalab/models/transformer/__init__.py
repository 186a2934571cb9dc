"""The Transformer baseline (Vaswani et al., 2017) and its encoder-decoder for translation."""

from megalab.models.transformer.model import (
    MultiHeadSelfAttention,
    Transformer,
    TransformerConfig,
    TransformerLayer,
    sinusoidal_positions,
)

__all__ = [
    "MultiHeadSelfAttention",
    "Transformer",
    "TransformerConfig",
    "TransformerLayer",
    "sinusoidal_positions",
]
