"""Sparse Modular Activation (Ren et al., NeurIPS 2023): the parts of a SeqBoat layer.

A latent configurator decides per token whether the gated attention unit (GAU) runs; the
activated tokens are packed into a shorter sequence, the GAU attends over it within a working
memory, and the outputs are scattered back and scaled by the configurator's confidence:

    p = softmax([u_skip + b_act, u_act] / τ),  a = argmax p,  c = a · max p     (SeqBoat §3.3)
    Hᶜ = Compress(H, a) ∈ R^{r×d},  Yᶜ = GAU(Hᶜ),  Y = Extract(Yᶜ, a)           (§3.2, App. A.1)

exactly as the authors' code (renll/SeqBoat, `seqboat_utils.py` and `seqboat_unit.py`) computes
them. This module holds the attention, and re-exports the routing it builds on
(`sma_routing.py`):

- **Compress / extract** (`plan_packing`, `pack`, `unpack`, in `sma_routing.py`). The code scatters
  each row's activated tokens into slots `a · cumsum(a)` of a zero tensor and gathers them back. We
  build the inverse map once per layer (the original position of every packed slot) and move
  features with one `gather` in each direction, forward and backward: packing and unpacking are
  inverse permutations on the valid slots, so each one's gradient is the other gather (no scatter,
  no atomics, no Python loop over the batch). L' is the batch maximum of activated tokens; L' = 0
  keeps one invalid slot as the code does (the GAU still runs, so every parameter gets a zero
  gradient and no rank of a data-parallel job skips it). The code does not pack at all when a row is
  fully active (L' = L): it then runs the GAU over the original positions with the skipped tokens
  masked as keys (`Packing.packed=False`), which changes the local window of the batch's other rows.
  We follow the code there (see `SeqBoat`'s `always_compress`).
- **Latent configurators** (`ROUTERS`, in `sma_routing.py`): the tempered softmax of the paper
  (default, learned τ = exp(θ), θ₀ = log(α√d)), and the ablations of Tables 7-8: Gumbel-softmax with
  the paper's annealing (App. A.4), a sigmoid over one logit, and the X-MoE router (Chi et al. 2022)
  between the GAU and a module that outputs zero. Decisions are a deterministic argmax; the router
  gets gradient only through c on activated tokens (no auxiliary loss; straight-through only in the
  Gumbel router's `hard` mode, the code's `gumbel_softmax(hard=True)`).
- **Attention over the compressed sequence** (`CompressedAttention`): the working memory of the
  paper (`mode="local"`: a sliding window of W keys on each side on *packed* indices, 2W + 1 keys
  bidirectional, W + 1 causal, computed in look-around blocks of W like the code), full attention
  over the compressed sequence (SeqBoat-full), or non-overlapping chunks (the "-chunk" ablation).
  Positions: the 'simple' relative bias on *original* positions (the packed tokens carry them),
  `local_pos` (offsets in the compressed sequence, the code's table of 2·3W − 1 entries read at
  4W − 1 + (j − i)), or interleaved RoPE on original positions (the LM).
- The learnably scaled sinusoidal absolute positions of the code's `--add-apos`.

Scaling as the code: softmax multiplies Q by d_z^-1/2; relu² and laplace (Mega's
½(1 + erf((x − μ)/(σ√2)))) divide Q by the constant 2W (bidirectional) or W (causal) in local
mode, and by the number of keys a query sees in chunk and full mode (Mega's rule; causal full:
i + 1, the code's mask row sum); the bias is added after. Masked softmax logits are −5e4 in
local mode (the code's constant, which replaces the score: a window without any key gives
uniform weights over the look-around blocks, whose slots outside the sequence hold the code's
−1), −inf elsewhere (a query with no key at all keeps its row unmasked: it is a discarded
slot). relu² and laplace mask the score to 0 in local mode, as the code (laplace(0) ≈ 0.0062
weighs every masked look-around slot), and the weights to 0 in full mode.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from megalab.kernels.attention_functions import check_attention_function
from megalab.models.seqboat.sma_routing import ROUTERS as ROUTERS
from megalab.models.seqboat.sma_routing import GumbelSoftmaxRouter as GumbelSoftmaxRouter
from megalab.models.seqboat.sma_routing import Packing as Packing
from megalab.models.seqboat.sma_routing import Router as Router
from megalab.models.seqboat.sma_routing import Routing as Routing
from megalab.models.seqboat.sma_routing import SigmoidRouter as SigmoidRouter
from megalab.models.seqboat.sma_routing import TemperedSoftmaxRouter as TemperedSoftmaxRouter
from megalab.models.seqboat.sma_routing import XMoERouter as XMoERouter
from megalab.models.seqboat.sma_routing import build_router as build_router
from megalab.models.seqboat.sma_routing import pack as pack
from megalab.models.seqboat.sma_routing import plan_packing as plan_packing
from megalab.models.seqboat.sma_routing import unpack as unpack
from megalab.nn.attention import RelativeBiasTable, laplace
from megalab.nn.positions import sinusoid_frequencies, sinusoid_table
from megalab.nn.rope import RotaryEmbedding
from megalab.nn.state import register_state

MASK_VALUE = -5e4  # the code's local-attention mask value
# Elements of one (B, queries, keys) tensor in full attention: 2^24 (64 MB in float32).
DENSE_BLOCK_ELEMENTS = 1 << 24
ATTENTION_MODES = ("local", "chunk", "full")
LOOK_AROUND_PAD = -1.0  # the code's look-around fill (keys and values) outside the sequence
REL_POS_BIASES = ("simple", "rotary", "none")
# The keys a query block attends, [memory, packed tokens, ...] in time: keys, values, original
# positions, validity.
_Keys = tuple[Tensor, Tensor, Tensor, Tensor]


class _Packed(NamedTuple):
    """The packed tokens of one pass, as every attention mode takes them: q, k (B, L', z),
    v (B, L', e), valid (B, L') bool and pos (B, L') int64, their original positions."""

    q: Tensor
    k: Tensor
    v: Tensor
    valid: Tensor
    pos: Tensor


def trunc_normal_(t: Tensor, std: float) -> Tensor:
    """The code's init: N(0, std²) truncated at ±2 std."""
    return nn.init.trunc_normal_(t, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std)


# ---------------------------------------------------------------------- positional information
class RelativePositionBias(RelativeBiasTable):
    """b(i, j) = w[(P − 1) + δ] for a relative offset δ, with w ∈ R^{2P−1} (init TN(0, 0.02)).

    Offsets past ±(P − 1) read the edge entries, as the code's table does when L > P.
    """

    def reset_parameters(self) -> None:
        """w ~ TN(0, 0.02), the code's truncated normal."""
        trunc_normal_(self.weight, 0.02)

    def forward(self, offset: Tensor) -> Tensor:
        """The bias at integer offsets (any shape)."""
        P = self.max_positions
        return self.weight[(offset + (P - 1)).clamp(0, 2 * P - 2)]


def sinusoidal_positions(length: int, d_model: int, like: Tensor, offset: int = 0) -> Tensor:
    """[sin(t·f) | cos(t·f)] (halves concatenated), f_i = 10000^(−2i/d), t = offset..: (L, d).

    The code's `SinusoidalPositionalEmbedding` of `--add-apos` (before its learned scale).
    """
    dtype = torch.promote_types(like.dtype, torch.float32)
    inv_freq = sinusoid_frequencies(
        d_model // 2, d_model / 2, dtype=dtype, device=like.device, power_dtype=torch.float64
    )
    t = torch.arange(offset, offset + length, device=like.device, dtype=dtype)
    return sinusoid_table(t, inv_freq, width=d_model)


# ------------------------------------------------------------------ attention on packed tokens
@register_state
class WorkingMemory(NamedTuple):
    """The GAU's memory of a causal stream: the last activated tokens of each row.

    key (B, M, z) (rotated when RoPE is on), value (B, M, e), pos (B, M) int64 original
    positions, valid (B, M) bool, right-aligned (a row's most recent token is in slot M − 1),
    and count (B,) int64, the number of tokens each row has activated so far. M = W in local
    mode (the paper's FIFO working memory), C − 1 in chunk mode, everything in full mode.
    """

    key: Tensor
    value: Tensor
    pos: Tensor
    valid: Tensor
    count: Tensor  # type: ignore[assignment]  # a field that shadows tuple.count, on purpose


class CompressedAttention(nn.Module):
    """O = f(Q Kᵀ / s + B_rel) V over the compressed (packed) sequence, single head.

    Args:
        z_dim: width of Q and K.
        mode: "local" (working memory: |i − j| ≤ W, or 0 ≤ i − j ≤ W causal, on packed
            indices), "chunk" (non-overlapping chunks of `chunk_size` packed tokens) or "full".
        chunk_size: W, the one-sided window (local; the code's `--chunk-size`), or the chunk
            length (chunk); unused in full mode.
        attention_activation: softmax | relu2 | laplace.
        rel_pos_bias: simple (a learned scalar per relative offset) | rotary (RoPE on Q, K) |
            none.
        local_pos: with `simple`, offsets in the compressed sequence (table of 2·3W − 1 entries
            read at 4W − 1 + (j − i), the code's layout) instead of original positions.
        max_positions: P of the 'simple' table on original positions (edges replicated past
            it).
        causal: keys at or before the query only.
        dropout: on the attention weights.
    """

    def __init__(
        self,
        z_dim: int,
        mode: str = "local",
        chunk_size: int = 128,
        attention_activation: str = "softmax",
        rel_pos_bias: str = "simple",
        local_pos: bool = False,
        max_positions: int = 1024,
        causal: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if mode not in ATTENTION_MODES:
            raise ValueError(
                f"unknown attention mode {mode!r}; allowed values: {', '.join(ATTENTION_MODES)}"
            )
        check_attention_function(attention_activation)
        if rel_pos_bias not in REL_POS_BIASES:
            raise ValueError(
                f"unknown rel_pos_bias {rel_pos_bias!r}; allowed values: "
                f"{', '.join(REL_POS_BIASES)}"
            )
        if mode != "full" and chunk_size <= 0:
            raise ValueError(
                f"attention={mode!r} needs a positive chunk_size (the window W or the chunk "
                f"length), got {chunk_size}; use attention='full' for no window"
            )
        if local_pos and (mode == "full" or rel_pos_bias != "simple"):
            raise ValueError(
                "local_pos indexes the 'simple' bias by offsets inside the window: it needs "
                "rel_pos_bias='simple' and attention='local' or 'chunk'"
            )
        self.z_dim = z_dim
        self.mode = mode
        self.chunk_size = chunk_size
        self.attention_activation = attention_activation
        self.local_pos = local_pos
        self.causal = causal
        self.dropout = dropout
        self.rel_pos_bias: RelativePositionBias | None = None
        if rel_pos_bias == "simple":
            P = 3 * chunk_size if local_pos else max_positions
            self.rel_pos_bias = RelativePositionBias(P)
        if rel_pos_bias == "rotary" and z_dim % 2:
            raise ValueError(f"rotary positions need an even z_dim, got {z_dim}")
        # RoPE on Q and K, interleaved pairs, base 10⁴ (no parameters: state dicts unchanged)
        self.rope = RotaryEmbedding(z_dim, interleaved=True) if rel_pos_bias == "rotary" else None

    @property
    def rotary(self) -> bool:
        """Whether Q and K are rotated (`rel_pos_bias='rotary'`)."""
        return self.rope is not None

    def extra_repr(self) -> str:
        return (
            f"z_dim={self.z_dim}, mode={self.mode!r}, chunk_size={self.chunk_size}, "
            f"attention_activation={self.attention_activation!r}, causal={self.causal}, "
            f"local_pos={self.local_pos}, rotary={self.rotary}"
        )

    @property
    def memory_size(self) -> int | None:
        """Slots of a stream's working memory (None: unbounded, full attention)."""
        if self.mode == "local":
            return self.chunk_size
        if self.mode == "chunk":
            return self.chunk_size - 1
        return None

    def empty_memory(self, batch_size: int, q_like: Tensor, v_dim: int) -> WorkingMemory:
        """The memory that starts a causal stream: every slot invalid."""
        M = self.memory_size or 0
        B, dev = batch_size, q_like.device
        return WorkingMemory(
            q_like.new_zeros(B, M, self.z_dim),
            q_like.new_zeros(B, M, v_dim),
            torch.zeros(B, M, dtype=torch.long, device=dev),
            torch.zeros(B, M, dtype=torch.bool, device=dev),
            torch.zeros(B, dtype=torch.long, device=dev),
        )

    # -------------------------------------------------------------------------------- forward
    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        valid: Tensor,
        pos: Tensor,
        memory: WorkingMemory | None = None,
        return_memory: bool = False,
    ) -> tuple[Tensor, WorkingMemory | None, tuple[Tensor, Tensor]]:
        """Attention over packed tokens.

        Args:
            q, k: (B, L', z); v: (B, L', e); valid: (B, L') bool; pos: (B, L') int64 original
                positions of the packed tokens.
            memory: a causal stream's memory (None: a stateless pass).
            return_memory: also return the memory after these tokens (causal only).

        Returns:
            (O (B, L', e), the new memory or None, (sum of mean spans over queries, number of
            queries) for the mean attention span in original positions).
        """
        streamed = memory is not None or return_memory
        if streamed and not self.causal:
            raise ValueError("only causal attention can be streamed with a working memory")
        if streamed and self.mode == "local" and self.attention_activation == "laplace":
            raise ValueError(
                "laplace in local mode weighs the masked slots of the code's look-around blocks "
                "(laplace(0) each), which depend on block alignment: a stream cannot equal one "
                "pass; stream with attention_activation='softmax' or 'relu2', or use "
                "attention='full'"
            )
        if self.rope is not None:
            q, k = self.rope.pair(q, k, pos)
        tokens = _Packed(q, k, v, valid, pos)
        if self.mode == "chunk" and not streamed:
            o, span = self._chunked(tokens)
            return o, None, span
        # Every other mode attends over [memory, packed tokens]: a stateless pass starts from the
        # empty memory, and a stream keeps the end of that sequence as its next memory.
        mem = memory if memory is not None else self.empty_memory(q.shape[0], k, v.shape[-1])
        if self.mode == "local":
            o, span, keys = self._local(tokens, mem, streamed)
        else:
            o, span, keys = self._dense(tokens, mem)
        return o, self._next_memory(mem, keys, valid) if return_memory else None, span

    def _next_memory(self, mem: WorkingMemory, keys: _Keys, valid: Tensor) -> WorkingMemory:
        """The memory after a segment: the last `memory_size` slots (all of them in full mode)
        of [memory, packed tokens], whose keys, values, positions and validity `keys` holds
        (more slots may follow); slots before the stream's start stay invalid."""
        M = mem.key.shape[1]
        r_new = valid.sum(dim=1)
        keep = self.memory_size
        if keep is None:  # full attention remembers every activated token
            keep = M + valid.shape[1]
        idx = (M + r_new - keep).unsqueeze(1) + torch.arange(keep, device=valid.device)
        inside = idx >= 0
        K, V, KP, KV = (_gather_time(t, idx.clamp(min=0)) for t in keys)
        return WorkingMemory(K, V, KP, KV & inside, mem.count + r_new)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        allowed: Tensor,
        bias: Tensor | None,
        relu_scale: float | Tensor,
    ) -> Tensor:
        """f(Q Kᵀ / s + bias) V on aligned blocks: q (..., Cq, z), k (..., Ck, z), v (..., Ck, e),
        allowed (..., Cq, Ck) bool; `relu_scale` is s for relu² (a constant or (..., Cq, 1))."""
        p = self.dropout if self.training else 0.0
        local = self.mode == "local"
        if self.attention_activation == "softmax":
            if local:
                # The code fills masked scores with −5e4 (it does not add it): a query whose
                # window holds no key gets uniform weights over the look-around blocks. A zero
                # query makes its scores the constant fill, so the softmax is that uniform row.
                q = q * allowed.any(dim=-1, keepdim=True).to(q.dtype)
            else:
                # A discarded slot with no key at all keeps its row (no −inf row, no NaN).
                allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
            fill = MASK_VALUE if local else float("-inf")
            base = bias if bias is not None else q.new_zeros(())
            mask = base.to(q.dtype).expand(allowed.shape).masked_fill(~allowed, fill)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, scale=self.z_dim**-0.5
            )
        cdt = torch.promote_types(q.dtype, torch.float32)
        scores = (q.to(cdt) / relu_scale) @ k.to(cdt).transpose(-1, -2)
        if bias is not None:
            scores = scores + bias.to(cdt)
        if self.attention_activation == "relu2":
            attn = F.relu(scores.masked_fill(~allowed, 0.0)).square()
        elif local:
            # The code's local attention fills masked scores with 0 before the activation, so
            # every masked slot of the look-around blocks weighs laplace(0) ≈ 0.0062 (its
            # value, −1 outside the sequence, still counts): kept for exactness.
            attn = laplace(scores.masked_fill(~allowed, 0.0))
        else:
            # Global mode: the code multiplies the weights by the key mask (exact zeros).
            attn = laplace(scores) * allowed
        attn = F.dropout(attn.to(v.dtype), p=p, training=self.training)
        return attn @ v

    def _local(
        self, tokens: _Packed, mem: WorkingMemory, streamed: bool
    ) -> tuple[Tensor, tuple[Tensor, Tensor], _Keys]:
        """Sliding window on packed indices, in look-around blocks of W queries: (O, span
        statistics, the keys' tensors for the next memory).

        The keys are [W memory slots (a stream's memory, or empty), the packed tokens, W empty
        slots (bidirectional)]; query block b (packed queries bW .. bW + W − 1, key index W + ·)
        sees key blocks b, b + 1 (and b + 2): the code's look-around, exact window by mask.
        """
        B, Lq = tokens.q.shape[:2]
        W = self.chunk_size
        nb = max(1, -(-Lq // W))
        pad = nb * W - Lq
        q, k, v, valid, pos = (_pad_time(t, pad) for t in tokens)
        # Outside the sequence the code's look-around holds −1: only laplace and a query with
        # no key in its window (uniform softmax) see these values. A stream's memory is kept.
        outside = 0.0 if streamed else LOOK_AROUND_PAD
        keys = [mem.key, k]
        values = [mem.value if streamed else torch.full_like(mem.value, outside), v]
        kpos = [mem.pos, pos]
        kvalid = [mem.valid, valid]
        n_look = 2
        if not self.causal:
            n_look = 3
            keys.append(k.new_zeros(B, W, k.shape[-1]))
            values.append(v.new_full((B, W, v.shape[-1]), outside))
            kpos.append(pos.new_zeros(B, W))
            kvalid.append(valid.new_zeros(B, W))
        K, V, KP, KV = (torch.cat(t, dim=1) for t in (keys, values, kpos, kvalid))

        def blocks(t: Tensor) -> Tensor:  # (B, (nb + n_look − 1)·W, ...) -> (B, nb, n_look·W, ...)
            return torch.cat(
                [t[:, i * W : (i + nb) * W].unflatten(1, (nb, W)) for i in range(n_look)], dim=2
            )

        qb = q.unflatten(1, (nb, W))
        kb, vb, kpb, kvb = blocks(K), blocks(V), blocks(KP), blocks(KV)
        r = torch.arange(W, device=q.device).unsqueeze(1)
        c = torch.arange(n_look * W, device=q.device).unsqueeze(0)
        d = W + r - c  # packed index of the query minus that of the key
        band = (d >= 0) & (d <= W) if self.causal else d.abs() <= W
        allowed = band & kvb.unsqueeze(2)  # (B, nb, W, n_look·W)
        bias = None
        if self.rel_pos_bias is not None:
            if self.local_pos:
                # The code's table rel_pos_bias(3W)[:W, :] per block: w[3W − 1 + c − r], i.e.
                # w[4W − 1 + (j − i)] in packed offsets (P = 3W, offset W off-centre).
                bias = self.rel_pos_bias(c - r)
            else:
                bias = self.rel_pos_bias(kpb.unsqueeze(2) - pos.unflatten(1, (nb, W)).unsqueeze(-1))
        relu_scale = W if self.causal else 2 * W  # the code's constant, not the key count
        o = self._attend(qb, kb, vb, allowed, bias, relu_scale).flatten(1, 2)[:, :Lq]
        return o, _window_span(pos, valid, KP, KV, W, self.causal), (K, V, KP, KV)

    def _chunked(self, tokens: _Packed) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Non-overlapping chunks of C packed tokens (stateless pass): (O, span statistics)."""
        B, Lq = tokens.q.shape[:2]
        C = self.chunk_size
        nb = max(1, -(-Lq // C))
        pad = nb * C - Lq
        q, k, v, validb, pos = (_pad_time(t, pad).unflatten(1, (nb, C)) for t in tokens)
        allowed = validb.unsqueeze(2).expand(B, nb, C, C)
        r = torch.arange(C, device=q.device)
        if self.causal:
            allowed = allowed & (r.unsqueeze(0) <= r.unsqueeze(1))
        bias = None
        rel = pos.unsqueeze(2) - pos.unsqueeze(-1)  # (B, nb, C, C): key − query positions
        if self.rel_pos_bias is not None:
            offset = r.unsqueeze(0) - r.unsqueeze(1) + C if self.local_pos else rel
            bias = self.rel_pos_bias(offset)
        relu_scale = allowed.sum(dim=-1, keepdim=True).clamp(min=1)
        o = self._attend(q, k, v, allowed, bias, relu_scale).flatten(1, 2)[:, :Lq]
        return o, _mask_span(rel, allowed, validb)

    def _dense(
        self, tokens: _Packed, mem: WorkingMemory
    ) -> tuple[Tensor, tuple[Tensor, Tensor], _Keys]:
        """Full attention (and chunk mode on a stream): every query against [memory, packed];
        (O, span statistics, the keys' tensors for the next memory).

        Queries run in blocks of about `DENSE_BLOCK_ELEMENTS` / (B · keys) rows, so no
        (B, L', L') tensor (mask, offsets, bias, weights) exists at once; with several blocks
        under autograd each block is recomputed in the backward (`torch.utils.checkpoint`,
        the RNG state kept for dropout), so memory stays linear in L' (SeqBoat-full on Path-X:
        16K packed tokens). One block, as at LRA lengths or below, is the plain computation.
        """
        q, k, v, valid, pos = tokens
        B, Lq = q.shape[:2]
        M = mem.key.shape[1]
        K, V = torch.cat([mem.key, k], 1), torch.cat([mem.value, v], 1)
        KP, KV = torch.cat([mem.pos, pos], 1), torch.cat([mem.valid, valid], 1)
        # Packed index of every key and query in its row's stream (memory right-aligned).
        n0 = mem.count.unsqueeze(1)
        kidx = n0 + torch.arange(-M, Lq, device=q.device)
        qidx = n0 + torch.arange(Lq, device=q.device)
        block = max(1, min(Lq, DENSE_BLOCK_ELEMENTS // max(1, B * (M + Lq))))
        recompute = block < Lq and torch.is_grad_enabled()
        outs, spans = [], []
        for s in range(0, Lq, block):
            args: tuple[Tensor, ...] = (
                q[:, s : s + block],
                K,
                V,
                KP,
                KV,
                kidx,
                qidx[:, s : s + block],
                pos[:, s : s + block],
                valid[:, s : s + block],
            )
            if recompute:
                o, span = checkpoint(self._dense_block, *args, use_reentrant=False)
            else:
                o, span = self._dense_block(*args)
            outs.append(o)
            spans.append(span)
        if len(outs) > 1:
            o = torch.cat(outs, dim=1)
            span = (sum(t[0] for t in spans), sum(t[1] for t in spans))  # type: ignore[assignment]
        return o, span, (K, V, KP, KV)

    def _dense_block(
        self,
        q: Tensor,
        K: Tensor,
        V: Tensor,
        KP: Tensor,
        KV: Tensor,
        kidx: Tensor,
        qidx: Tensor,
        pos: Tensor,
        valid: Tensor,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One block of queries of `_dense` against every key: (O, span statistics)."""
        B, Lq = q.shape[:2]
        allowed = KV.unsqueeze(1).expand(B, Lq, K.shape[1])
        if self.causal:
            allowed = allowed & (kidx.unsqueeze(1) <= qidx.unsqueeze(2))
        if self.mode == "chunk":
            C = self.chunk_size
            allowed = allowed & (kidx.unsqueeze(1) // C == qidx.unsqueeze(2) // C)
        rel = KP.unsqueeze(1) - pos.unsqueeze(2)
        bias = None
        if self.rel_pos_bias is not None:
            packed = kidx.unsqueeze(1) - qidx.unsqueeze(2) + self.chunk_size
            offset = packed if self.local_pos else rel
            bias = self.rel_pos_bias(offset)
        relu_scale: Tensor = allowed.sum(dim=-1, keepdim=True).clamp(min=1)
        if self.causal and self.mode == "full":
            # The code divides by its causal mask's row sum, i + 1 (the count of valid keys
            # for a real query; it also covers a padded query that the GAU still outputs).
            relu_scale = (qidx + 1).unsqueeze(-1)
        o = self._attend(q, K, V, allowed, bias, relu_scale)
        return o, _mask_span(rel, allowed, valid)


def _pad_time(t: Tensor, pad: int) -> Tensor:
    """Pad dim 1 (time) with `pad` trailing zeros (False for bool)."""
    if pad == 0:
        return t
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))


def _gather_time(t: Tensor, idx: Tensor) -> Tensor:
    """t (B, T, ...) at time indices idx (B, S)."""
    index = idx.reshape(*idx.shape, *([1] * (t.dim() - 2))).expand(*idx.shape, *t.shape[2:])
    return t.gather(1, index)


@torch.no_grad()
def _window_span(
    qpos: Tensor, qvalid: Tensor, kpos: Tensor, kvalid: Tensor, W: int, causal: bool
) -> tuple[Tensor, Tensor]:
    """Mean |pos_k − pos_q| over each valid query's window (self excluded), summed over the
    queries that see another key, and their number; O(L) with prefix sums over the key space.

    Query i sits at key index W + i; keys are ordered by original position, so the left part
    of the window lies before the query and the right part after it.
    """
    B, Lq = qpos.shape
    T = kpos.shape[1]
    zero = torch.zeros(B, 1, dtype=torch.long, device=qpos.device)
    n = torch.cat([zero, torch.cumsum(kvalid.long(), 1)], 1)  # n[j] = Σ_{<j} valid
    s = torch.cat([zero, torch.cumsum(kpos * kvalid, 1)], 1)
    i = W + torch.arange(Lq, device=qpos.device).expand(B, Lq)
    lo = (i - W).clamp(min=0)
    hi = i + 1 if causal else (i + W + 1).clamp(max=T)

    def take(t: Tensor, idx: Tensor) -> Tensor:
        return t.gather(1, idx)

    n_left = take(n, i) - take(n, lo)
    s_left = take(s, i) - take(s, lo)
    n_right = take(n, hi) - take(n, i + 1)
    s_right = take(s, hi) - take(s, i + 1)
    total = (n_left * qpos - s_left + s_right - n_right * qpos).double()
    count = n_left + n_right
    use = qvalid & (count > 0)
    mean = torch.where(use, total / count.clamp(min=1), torch.zeros_like(total))
    return mean.sum(), use.sum()


@torch.no_grad()
def _mask_span(rel: Tensor, allowed: Tensor, qvalid: Tensor) -> tuple[Tensor, Tensor]:
    """As `_window_span` from the offsets `rel` (..., Lq, Lk) and the `allowed` mask."""
    other = allowed & (rel != 0)
    count = other.sum(dim=-1)
    total = (rel.abs() * other).sum(dim=-1).double()
    use = qvalid & (count > 0)
    mean = torch.where(use, total / count.clamp(min=1), torch.zeros_like(total))
    return mean.sum(), use.sum()


class PositionwiseFFN(nn.Module):
    """fc2(hidden_dropout(SiLU(fc1 x))): Mega's FFN without its norm and residual, for the FFN
    module that SMA activates beside the GAU (SeqBoat-{GAU,FFN}, M = 2)."""

    def __init__(self, d_model: int, ffn_dim: int, hidden_dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.hidden_dropout = nn.Dropout(hidden_dropout)
        for lin in (self.fc1, self.fc2):
            trunc_normal_(lin.weight, 0.02)
            nn.init.zeros_(lin.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.hidden_dropout(F.silu(self.fc1(x))))
