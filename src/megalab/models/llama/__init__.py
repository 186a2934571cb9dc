"""The Llama-style Transformer baseline (RMSNorm, RoPE, SwiGLU) and its Hugging Face conversion."""

from megalab.models.llama.model import (
    Llama,
    LlamaAttention,
    LlamaBlock,
    LlamaConfig,
    LlamaState,
    count_parameters,
    llama_ffn_dim,
)

__all__ = [
    "Llama",
    "LlamaAttention",
    "LlamaBlock",
    "LlamaConfig",
    "LlamaState",
    "count_parameters",
    "llama_ffn_dim",
]
