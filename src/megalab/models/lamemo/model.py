"""LaMemo: Language Modeling with Look-Ahead Memory (Ji et al., NAACL 2022), exact to the
authors' code (thu-coai/LaMemo, `MemTransformerLM` with `attn_type=3`).

LaMemo is Transformer-XL (`megalab.models.transformer_xl`) whose memory is refreshed at every
segment instead of frozen. Per layer ℓ, with M the memory rows (m) entering the layer and h the
segment (L rows), X̃ = [M; h], Q, K, V = X̃ W_q, X̃ W_k, X̃ W_v (shared by both attentions):

    C→  = softmax_causal(((q + u)ᵀ k + (q + v₊)ᵀ W_R R_{i−j}) / √d) V     segment rows (eq. 2)
    C←  = softmax_ahead(((q + u)ᵀ k + (q + v₋)ᵀ W_R R_{|i−j|}) / √d) Ṽ    memory rows (eqs. 7-9)
    α   = s_old / (s_old + s← + ε)                                          (eq. 11)
    C↔  = α · sg(C_old) + (1 − α) · C←                                      (eq. 10)
    M'  = FFN(LN(M + dropout(W_o C↔))),   h' = FFN(LN(h + dropout(W_o C→)))

The look-ahead window Ṽ is the last min(m, L) rows of X̃ ending at the first current token,
and memory row i sees only keys strictly to its right (no token beyond the first current one:
no leakage). Its positions use the distances 1 … m with their own bias v₋ (the disentangled
encoding, eq. 12; `rpe="xl"` is the Table 3 ablation with XL's R_{i−j} at −1 … −m and v).

What is carried (`LaMemoState`, detached) is not the hidden states of every layer but:
the dropped-out embeddings of the last `mem_len` tokens (the memory input of layer 0; the
memory of layer ℓ + 1 is layer ℓ's refreshed output M', recomputed every segment, so the
segment's loss back-propagates into the refresh), and per layer the running context C (per
head, before W_o) and log-normaliser log s of each memory position. A position enters the
memory with its causal context and log-sum-exp; each refresh merges a look-ahead window in:

    c      = max(log s_old, log s←)                  (the code's shift; gradients pass it)
    α      = e^{log s_old − c} / (e^{log s_old − c} + e^{log s← − c} + ε)      ε = 1e-6
    log s  = logaddexp(log s_old, log s←)

so ε enters after the max-shift, as in the code (α = s_old / (s_old + s← + ε·e^c)).
Gradients stop at the carried C_old and log s_old (and everything carried), not at log s←.
With m = L (every paper configuration) each position is refreshed once; with m > L (longer
memory at evaluation, Fig. 5) successive windows tile its right context.

Ablations (Table 3): `interpolation=False` sets α = 0 (C↔ = C←); `look_ahead=False` keeps
C↔ = C_old, i.e. Transformer-XL computed LaMemo's way (numerically XL, tested); `rpe="xl"`.
`mem_len` = 0 is Transformer+RPE. The memory normalisers stay in at least float32 (the code
casts them to the activation dtype, fp16 under its apex O2 training, against its own comment).

Initialisation is the code's: linears N(0, 0.02), zero biases, LayerNorm weights N(1, 0.02),
u and v₊ N(0, 0.02), and v₋ Xavier-uniform (the trainer's `weights_init` does not reach it).
Padding and `eval_mem_len` as for Transformer-XL; what both share (options, sub-layers, segment
set-up, output, initialisation) is `megalab.models.transformer_xl.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from megalab.models.base import BackboneOutput
from megalab.models.transformer_xl.memory import (
    RelativeMemoryBackbone,
    RelativeMemoryConfig,
    ended_after,
    relative_sublayers,
)
from megalab.nn.relative_attention import (
    at_least_float32,
    look_ahead_mask,
    look_ahead_window,
    update_memory,
)
from megalab.nn.state import register_state
from megalab.utils.options import option

RPES = ("disentangled", "xl")


@register_state
@dataclass
class LaMemoState:
    """LaMemo's carried memory (batch first, detached).

    `embeddings` (B, m, D): dropped-out embeddings of the last m tokens (layer 0's memory);
    per layer, `contexts` (B, m, H, d_head): the running context C before W_o, and
    `log_normalizers` (B, m, H): its log-normaliser log s (at least float32);
    `ended` (B,): streams that reached padding.
    """

    embeddings: Tensor
    contexts: list[Tensor]
    log_normalizers: list[Tensor]
    ended: Tensor


@dataclass(frozen=True)
class LaMemoConfig(RelativeMemoryConfig):
    """Every option of `LaMemo`, each with its range and meaning: those
    of `RelativeMemoryConfig` (as Transformer-XL's; LaMemo has no `ext_len`, its code ignores
    it in the memory) and the four below."""

    model_name = "LaMemo"

    look_ahead: bool = option(
        True, doc="refresh the memory by look-ahead attention (False: only C_old; Table 3)"
    )
    interpolation: bool = option(
        True, doc="merge the carried context with weight α (False: α = 0; Table 3)"
    )
    # "disentangled": |i − j| with v₋ for look-ahead keys; "xl": XL's R_{i−j} at negative
    # distances with v (Table 3's diverging ablation).
    rpe: str = option("disentangled", choices=RPES, doc="relative positions of look-ahead keys")
    eps: float = option(1e-6, doc="ε of the interpolation weight (the code's 1e-6)")

    def build(self) -> LaMemo:
        """The `LaMemo` this config describes."""
        return LaMemo(self)


def interpolation_weight(log_s_old: Tensor, log_s_new: Tensor, eps: float) -> Tensor:
    """α = s_old / (s_old + s_new + ε) after the code's max-shift (ε added after it).

    The shift c = max(log s_new, log s_old) is taken like the code (`torch.stack(...).max(0)`),
    so gradients through log s_new follow the same path.
    """
    c = torch.stack([log_s_new, log_s_old]).max(0).values
    s_old = (log_s_old - c).exp()
    s_new = (log_s_new - c).exp()
    return s_old / (s_old + s_new + eps)


class LaMemoLayer(nn.Module):
    """One LaMemo layer: causal attention for the segment, look-ahead attention and memory
    interpolation for the memory, one post-LN attention sub-layer and FFN shared by both."""

    def __init__(self, cfg: LaMemoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.attn, self.ffn = relative_sublayers(cfg)

    def forward(
        self,
        h: Tensor,
        memory: Tensor | None,
        c_old: Tensor | None,
        log_s_old: Tensor | None,
        table: Tensor,
        u: Tensor,
        v: Tensor,
        v_future: Tensor,
        masked: Tensor,
        details: dict[str, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """h (B, L, D); memory (B, m, D), c_old (B, m, H, d), log_s_old (B, m, H) or None;
        table (K [+ m], D).

        Returns the segment's output (B, L, D), the refreshed memory M' (B, m, D) (None
        without memory), and the contexts (B, K, H, d) and log-normalisers (B, K, H) of all
        K = m + L rows, from which the caller keeps the last mem_len.
        """
        cfg = self.cfg
        m = 0 if memory is None else memory.shape[1]
        L = h.shape[1]
        K = m + L
        cat = h if m == 0 else torch.cat([memory, h], dim=1)  # type: ignore[list-item]
        q, k, v_ = self.attn.project(cat)
        r = self.attn.project_positions(table)
        # Causal attention of the segment (XL's, with v₊ = v).
        ctx, lse, probs = self.attn.attend(q[:, m:], k, v_, r[:K], u, v, masked, need_lse=True)
        out = self.attn.output(h, ctx)
        if details is not None:
            details.update(attn_prob=probs, attn_out=out)
        if m == 0:
            y = self.ffn(out)
            if details is not None:
                details["out"] = y
            return y, None, ctx, lse  # type: ignore[return-value]
        assert c_old is not None and log_s_old is not None and memory is not None
        if cfg.look_ahead:
            # Look-ahead attention of the memory rows onto the window ending at row m.
            lo, hi = look_ahead_window(m, L)
            ctx_ahead, lse_ahead, probs_ahead = self.attn.attend(
                q[:, :m],
                k[:, lo:hi],
                v_[:, lo:hi],
                r[K:],
                u,
                v_future,
                look_ahead_mask(m, L, device=h.device),
                future=True,
                need_lse=True,
            )
            assert lse_ahead is not None
            if cfg.interpolation:
                alpha = interpolation_weight(log_s_old, lse_ahead, cfg.eps)
            else:
                alpha = torch.zeros_like(lse_ahead)
            inter = c_old * alpha.unsqueeze(-1) + ctx_ahead * (1 - alpha.unsqueeze(-1))
            inter = inter.to(ctx_ahead.dtype).nan_to_num()
            log_s_mem = torch.logaddexp(log_s_old, lse_ahead)
            if details is not None:
                details.update(attn_prob_mem=probs_ahead, alpha=alpha)
        else:
            inter, log_s_mem = c_old.to(ctx.dtype), log_s_old
        out_mem = self.attn.output(memory, inter)
        y = self.ffn(torch.cat([out_mem, out], dim=1))
        mem_y, y = y[:, :m], y[:, m:]
        if details is not None:
            details.update(attn_mem_out=out_mem, out=y, mem_out=mem_y)
        contexts = torch.cat([inter, ctx], dim=1)
        log_s = torch.cat([log_s_mem, lse], dim=1)  # type: ignore[list-item]
        return y, mem_y, contexts, log_s


class LaMemo(RelativeMemoryBackbone):
    """The LaMemo backbone (see the module docstring), (B, L, D) -> (B, L, D)."""

    config: LaMemoConfig
    block_class = LaMemoLayer

    def __init__(self, config: LaMemoConfig | None = None) -> None:
        super().__init__(cfg := config or LaMemoConfig(), LaMemoLayer)
        # Besides u and v₊ = v (the code's r_w_bias, r_r_bias): v₋ for keys on the right
        # (r_r_bias_future); XL's encoding reuses v for both.
        self.v_future = (
            nn.Parameter(torch.empty(cfg.num_heads, cfg.d_head))
            if cfg.rpe == "disentangled"
            else None
        )
        # v₋ serves the look-ahead attention only, which needs a carried memory: the first
        # segment of a stream (and every segment without look-ahead) leaves it unused.
        self.data_dependent_parameters = self.v_future is not None
        self.reset_parameters()

    @property
    def exact_streaming(self) -> bool:
        """Whether streamed outputs equal one pass over the stream (while it fits the memory):
        not with look-ahead, which refreshes the memory by each later segment."""
        return not self.config.look_ahead

    def reset_parameters(self) -> None:
        """The code's initialisation; v₋ keeps its Xavier-uniform draw (see the docstring)."""
        super().reset_parameters()
        if self.v_future is not None:
            nn.init.xavier_uniform_(self.v_future)

    # -- memory -------------------------------------------------------------------------------
    def initial_state(self, batch_size: int, like: Tensor) -> LaMemoState | None:
        """An empty memory (None for mem_len 0: Transformer+RPE)."""
        if self.mem_len == 0:
            return None
        cfg = self.config
        B, H, d = batch_size, cfg.num_heads, cfg.d_head
        n = len(self.layers)
        lse_dtype = at_least_float32(like).dtype
        return LaMemoState(
            like.new_zeros(B, 0, cfg.d_model),
            [like.new_zeros(B, 0, H, d) for _ in range(n)],
            [like.new_zeros(B, 0, H, dtype=lse_dtype) for _ in range(n)],
            torch.zeros(B, dtype=torch.bool, device=like.device),
        )

    def memory_length(self, state: LaMemoState | None) -> int:
        return 0 if state is None else state.embeddings.shape[1]

    # -- forward ------------------------------------------------------------------------------
    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, state: LaMemoState | None = None
    ) -> BackboneOutput:
        """x (B, L, D) embeddings, mask (B, L) True at real tokens, state = the memory.

        Returns y (B, L, D) (zero at padded positions), the memory for the next segment when
        one was passed, and in `aux` the mean α per layer ("alpha") when the memory refreshed.
        """
        return self._forward(x, mask, state, None)

    def _forward(
        self,
        x: Tensor,
        mask: Tensor | None,
        state: LaMemoState | None,
        details: list[dict[str, Tensor]] | None,
    ) -> BackboneOutput:
        cfg = self.config
        if state is not None and len(state.contexts) != len(self.layers):
            raise ValueError(
                f"this memory has {len(state.contexts)} layers; the model has {len(self.layers)}"
            )
        future_sign = 1 if cfg.rpe == "disentangled" else -1
        ended = None if state is None else state.ended
        padded, m, masked, table = self.segment(x, mask, state, ended, future_sign)
        K = m + x.shape[1]
        v_future = self.v_future if self.v_future is not None else self.v
        memory = None if state is None or m == 0 else state.embeddings
        h = x
        contexts, log_normalizers, alphas = [], [], []
        for i, layer in enumerate(self.layers):
            c_old = None if memory is None else state.contexts[i]  # type: ignore[union-attr]
            s_old = None if memory is None else state.log_normalizers[i]  # type: ignore[union-attr]
            layer_details = None if details is None else details[i]
            if layer_details is None and memory is not None and cfg.look_ahead:
                layer_details = {}
            h, memory, ctx, log_s = layer(
                h, memory, c_old, s_old, table, self.u, self.v, v_future, masked, layer_details
            )
            if layer_details is not None and "alpha" in layer_details:
                alphas.append(layer_details["alpha"].detach().float().mean())
            contexts.append(ctx)
            log_normalizers.append(log_s)
        y = self.output(h, padded)
        aux = {"alpha": torch.stack(alphas)} if alphas else {}
        new_state = None
        if state is not None:
            mem_len = self.mem_len
            new_state = LaMemoState(
                update_memory(state.embeddings, x, mem_len),
                [c[:, max(0, K - mem_len) :].detach() for c in contexts],
                [s[:, max(0, K - mem_len) :].detach().nan_to_num() for s in log_normalizers],
                ended_after(state.ended, padded),
            )
        return BackboneOutput(y, new_state, aux)
