"""Llama-2 decoder (Touvron et al. 2023): the Transformer that Megalodon is compared with.

One pre-norm block, with RMSNorm (no bias, eps 1e-5 in Llama-2):

    H = X + Attn(RMSNorm(X))
    Y = H + FFN(RMSNorm(H))             FFN(x) = W_2 (SiLU(W_1 x) ⊙ W_3 x)     (SwiGLU)

    Attn(x):  Q = x W_q,  K = x W_k,  V = x W_v                   (no biases)
              Q, K ← RoPE(Q, K) at absolute positions p, θ_j = base^(−2j/d_h)
              O_h = softmax(Q_h K_{g(h)}ᵀ / √d_h + causal mask) V_{g(h)}
              Attn(x) = [O_1 … O_H] W_o

with H query heads of width d_h = d/H and `num_kv_heads` key/value heads shared by groups of
H / num_kv_heads query heads (grouped-query attention, g(h) = h // (H / num_kv_heads); Llama-2
70B uses 8, 7B and 13B one per query head). The backbone ends with a final RMSNorm; the LM head
(untied in Llama-2) belongs to the task.

Conventions follow Hugging Face's `LlamaForCausalLM`, so `megalab.models.llama.convert` maps weights
one to one: RoPE pairs the two halves of a head (`rotate_half`; Meta's checkpoints pair
adjacent channels and Hugging Face permutes W_q, W_k on conversion), the FFN hidden width is
Meta's rule ⌈(2/3 · 4d · multiplier) / 256⌉ · 256 unless given (11,008 at d = 4096), and every
linear and the embedding start from N(0, 0.02) (HF's `initializer_range`; Meta did not publish
their initialisation), RMSNorm gains from 1.

The attention runs on `scaled_dot_product_attention`. A stream's state is, per layer, the
keys (after RoPE) and values of every token seen so far (`KVCache`); new tokens take positions
after them, so feeding a sequence in segments (or token by token) equals one pass. Unlike Mega
and Megalodon the state grows with the context: memory per decoded token is linear in the
context length, which `benchmarks/bench_long_context.py` measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab.models.base import Backbone, BackboneConfig, BackboneOutput
from megalab.models.stack import run_stack
from megalab.nn.attention import KVCache, chunked_attention
from megalab.nn.carried import CarriedLayer
from megalab.nn.ffn import GatedFFN
from megalab.nn.linear import joint_linear
from megalab.nn.norms import RMSNorm
from megalab.nn.rope import RotaryEmbedding
from megalab.nn.state import register_state
from megalab.utils.options import check_options, option, rate


@register_state
@dataclass
class LlamaState:
    """Streaming state of a causal `Llama`: one `KVCache` per layer, keys (B, T, H_kv, d_h)
    after RoPE, values (B, T, H_kv, d_h) and key validity (B, T) (or None); T = tokens seen."""

    layers: list[KVCache]


def llama_ffn_dim(d_model: int, multiple_of: int = 256, multiplier: float | None = None) -> int:
    """Meta's SwiGLU width: 2/3 of 4d (times `multiplier`), rounded up to `multiple_of`."""
    hidden = int(2 * (4 * d_model) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class LlamaConfig(BackboneConfig):
    """Every option of a Llama backbone, each with its range and meaning."""

    d_model: int = option(256, ge=1, doc="d, the feature width")
    num_layers: int = option(4, ge=1, doc="number of blocks")
    num_heads: int = option(4, ge=1, doc="query heads H")
    num_kv_heads: int | None = option(
        None, doc="key/value heads (None: H, plain multi-head attention)"
    )
    ffn_dim: int | None = option(
        None,
        doc="SwiGLU hidden width (None: Meta's rule from multiple_of and ffn_dim_multiplier)",
        note=" (null: Meta's 8d/3 rule)",
    )
    multiple_of: int = option(256, doc="Meta's rule rounds the hidden width up to a multiple")
    ffn_dim_multiplier: float | None = option(None, doc="Meta's rule's factor on 8d/3")
    rope_base: float = option(
        10000.0, doc="RoPE base θ (10,000 in Llama-2; Megalodon-7B used 100,000)"
    )
    norm_eps: float = option(1e-5, doc="RMSNorm epsilon (1e-5 in Llama-2, 1e-6 in Llama-1)")
    dropout: float = rate(0.0, doc="on each residual branch (Llama-2: 0)")
    attention_dropout: float = rate(0.0, doc="on the attention weights")
    init_std: float = option(0.02, doc="std of every linear weight (HF's initializer_range)")
    # RoPE itself has no limit, but a model does not extrapolate far beyond its training context.
    max_len: int | None = option(
        None, ge=1, doc="longest stream (None: unbounded)", note=" (null: unbounded)"
    )
    causal: bool = option(
        True, doc="decoder (True) or a bidirectional encoder without state (False)"
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} must be a positive multiple of num_heads={self.num_heads}"
            )
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(
                f"the head width d_model/num_heads = {self.d_model // self.num_heads} must be "
                "even for rotary embeddings: change d_model or num_heads"
            )
        kv = self.kv_heads
        if kv < 1 or self.num_heads % kv:
            raise ValueError(
                f"num_kv_heads={kv} must divide num_heads={self.num_heads} (grouped-query "
                "attention shares each key/value head among num_heads/num_kv_heads query heads)"
            )

    @property
    def kv_heads(self) -> int:
        """Key/value heads (num_heads without grouped-query attention)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden width: `ffn_dim`, or Meta's rule when it is None."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        return llama_ffn_dim(self.d_model, self.multiple_of, self.ffn_dim_multiplier)

    def build(self) -> Llama:
        """The `Llama` this config describes."""
        return Llama(self)


class LlamaAttention(CarriedLayer[KVCache]):
    """Multi-head (or grouped-query) self-attention with RoPE and a key/value cache."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.causal = cfg.causal
        self.dropout = cfg.attention_dropout
        d, hd = cfg.d_model, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.rope = RotaryEmbedding(hd, base=cfg.rope_base, interleaved=False)

    def advance(
        self, x: Tensor, mask: Tensor | None, state: KVCache | None, want_state: bool
    ) -> tuple[Tensor, KVCache | None]:
        """Attn(x) of the module docstring; the state is the keys (after RoPE) and values of
        every token so far, the carried ones before x."""
        B, L, _ = x.shape
        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # Q and K as one GEMM: neither is kept (the rotation's backward needs no input); V is
        # kept by the attention, and a joined output stays whole while any part is kept
        q, k = joint_linear(x, self.q_proj, self.k_proj)
        q, k = q.view(B, L, H, hd), k.view(B, L, Hkv, hd)
        v = self.v_proj(x).view(B, L, Hkv, hd)
        offset = state.key.shape[1] if state is not None else 0
        positions = torch.arange(offset, offset + L, device=x.device).unsqueeze(-1)  # (L, 1)
        q, k = self.rope.pair(q, k, positions)
        o, cache = chunked_attention(
            q, k, v, mask, -1, self._attend, cache=state, return_cache=want_state
        )
        return self.o_proj(o.reshape(B, L, H * hd)), cache

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, q_offset: int
    ) -> Tensor:
        """q (B, 1, Cq, H, d), k, v (B, 1, Ck, H_kv, d), valid (B, 1, Ck): one chunk (no
        chunking); query r sits at key position r + q_offset."""
        q, k, v = (t.squeeze(1).transpose(1, 2) for t in (q, k, v))  # (B, heads, C, d)
        Cq, Ck = q.shape[2], k.shape[2]
        p = self.dropout if self.training else 0.0
        gqa = self.num_kv_heads != self.num_heads
        if valid is None and (not self.causal or (q_offset == 0 and Cq == Ck)):
            o = F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=self.causal, enable_gqa=gqa
            )
        else:
            allowed = torch.ones(Cq, Ck, dtype=torch.bool, device=q.device)
            if self.causal:
                pos_q = torch.arange(q_offset, q_offset + Cq, device=q.device).unsqueeze(1)
                allowed = torch.arange(Ck, device=q.device).unsqueeze(0) <= pos_q
            causal = allowed
            if valid is not None:
                allowed = allowed & valid[:, 0, None, :]  # (B, Cq, Ck)
                # A query with no valid key (left padding) keeps its causal keys, not a NaN row.
                allowed = allowed | (~allowed.any(dim=-1, keepdim=True) & causal)
                allowed = allowed.unsqueeze(1)  # (B, 1, Cq, Ck)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=p, enable_gqa=gqa
            )
        return o.transpose(1, 2).unsqueeze(1)  # (B, 1, Cq, H, d)


class LlamaBlock(CarriedLayer[KVCache]):
    """One Llama-2 layer: pre-norm attention and SwiGLU FFN, each with a plain residual."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.causal = cfg.causal
        self.input_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = GatedFFN(cfg.d_model, cfg.hidden_dim, activation="silu", bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def advance(
        self, x: Tensor, mask: Tensor | None, state: KVCache | None, want_state: bool
    ) -> tuple[Tensor, KVCache | None]:
        """H = X + Attn(RMSNorm(X)), Y = H + FFN(RMSNorm(H)); the state is the attention's
        key/value cache."""
        h, cache = self.attn(self.input_norm(x), mask, state, return_state=want_state)
        x = x + self.dropout(h)
        x = x + self.dropout(self.ffn(self.ffn_norm(x)))
        return x, cache


class Llama(Backbone):
    """The Llama-2 backbone: `num_layers` `LlamaBlock`s, a final RMSNorm; (B, L, D) -> (B, L, D)."""

    config: LlamaConfig
    block_class = LlamaBlock

    def __init__(self, config: LlamaConfig | None = None) -> None:
        super().__init__(cfg := config or LlamaConfig())
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HF's init: every linear N(0, init_std), RMSNorm gains 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            elif isinstance(module, RMSNorm) and module.weight is not None:
                nn.init.ones_(module.weight)

    @property
    def max_len(self) -> int | None:
        return self.config.max_len

    def state_length(self, state: LlamaState) -> int:
        """Tokens in the key/value cache (the whole stream so far)."""
        return state.layers[0].key.shape[1] if state.layers else 0

    def length_advice(self) -> str:
        return (
            f" (its context of {self.config.max_len} tokens): raise or unset "
            "`model.backbone.max_len`, or shorten the input"
        )

    def initial_state(self, batch_size: int, like: Tensor) -> LlamaState:
        """Empty key/value caches."""
        self.check_streamable()
        cfg = self.config
        empty = like.new_zeros(batch_size, 0, cfg.kv_heads, cfg.head_dim)
        return LlamaState([KVCache(empty, empty, None) for _ in self.layers])

    def carried_modules(self) -> list[nn.Module]:
        """The sub-modules that carry state along time, in order (chunk parallelism hook):
        each is called as `m(x, mask, state, ...)` and returns `(y, new_state)`."""
        return list(self.layers)

    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, state: LlamaState | None = None
    ) -> BackboneOutput:
        """x (B, L, D), mask (B, L) True at real tokens, state from the previous segment; the
        blocks and the final RMSNorm run in the shared stack (`megalab.models.stack`)."""
        self.check_input(x, mask, state)
        out = run_stack(
            self.layers,
            x,
            mask,
            None if state is None else state.layers,
            final=self.final_norm,
            return_state=state is not None,
        )
        return BackboneOutput(out.y, None if out.states is None else LlamaState(out.states))


def count_parameters(cfg: LlamaConfig, vocab_size: int, tie_embeddings: bool = False) -> int:
    """Parameters of a Llama language model (embedding, backbone, head) from the formula
    per layer 2d·(H + H_kv)·d_h + 3·d·F + 2d, plus the final norm and the embeddings."""
    d, hd, F_ = cfg.d_model, cfg.head_dim, cfg.hidden_dim
    per_layer = 2 * d * (cfg.num_heads + cfg.kv_heads) * hd + 3 * d * F_ + 2 * d
    embeddings = vocab_size * d * (1 if tie_embeddings else 2)
    return cfg.num_layers * per_layer + d + embeddings
