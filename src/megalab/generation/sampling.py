"""Sampling from a causal language model: token prompts continued one token at a time.

`sample_tokens` carries the backbone's state (Mega, Megalodon, Llama, Transformer-XL/LaMemo:
`initial_state`, then one token per call), so each new token costs one step; a stateless causal
backbone re-reads the prefix (its last `max_len` tokens). Sampling applies `temperature` (0:
greedy), `top_k` and `top_p` in this order, as Hugging Face's `generate`. `megalab-generate`
(`megalab.cli.generate`) is the command line over it, with a run's tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from megalab.nn.modes import in_evaluation_mode

if TYPE_CHECKING:
    from megalab.tasks.language_modeling import LanguageModelingTask


def check_sampling(temperature: float = 0.0, top_p: float | None = None) -> None:
    """Refuse settings no token can be drawn with (before a prompt is read or shown)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p} (1 or null: no nucleus)")


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set to −inf every token outside the `top_k` most likely and outside the nucleus: the
    smallest set of most likely tokens whose probability reaches `top_p` (the most likely token
    is always kept). logits (..., V)."""
    if top_k is not None and top_k > 0:
        k = min(int(top_k), logits.shape[-1])
        kth = logits.topk(k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    check_sampling(top_p=top_p)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def next_token(
    log_probs: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw one token per row of log_probs (B, V): greedy when temperature is 0."""
    check_sampling(temperature)  # top_p: in filter_logits
    if temperature == 0:
        return log_probs.argmax(dim=-1)
    logits = filter_logits(log_probs.float() / temperature, top_k, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class IncrementalDecoder:
    """Feeds tokens to a language-model task and returns the next-token log-probabilities.

    With a causal backbone that has a state, each call continues the stream (the prompt in one
    pass, then one token per call); a stateless one re-reads the prefix (its last `max_len`
    tokens) on every call.
    """

    def __init__(self, task: LanguageModelingTask, batch_size: int) -> None:
        backbone = task.backbone
        if not backbone.causal:
            raise ValueError(
                f"{type(backbone).__name__} is bidirectional (causal=False): it cannot generate"
            )
        from megalab.tasks.language_modeling import check_no_extended_context

        check_no_extended_context(backbone, "generation")
        self.task = task
        like = next(task.parameters())
        self.state = backbone.initial_state(batch_size, like)
        self.stateful = self.state is not None
        self.prefix: Tensor | None = None
        self.max_len = backbone.max_len

    def feed(self, tokens: Tensor) -> Tensor:
        """tokens (B, n) -> log p(next | everything fed so far), (B, V) float32."""
        if self.stateful:
            out = self.task(tokens, None, self.state)
            self.state = out.state
        else:
            self.prefix = tokens if self.prefix is None else torch.cat([self.prefix, tokens], 1)
            window = self.prefix if self.max_len is None else self.prefix[:, -self.max_len :]
            out = self.task(window, None, None)
        return self.task.head.log_probs(out.y[:, -1:])[:, 0].float()


@torch.inference_mode()
@in_evaluation_mode
def sample_tokens(
    task: LanguageModelingTask,
    prompt: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    on_tokens: Callable[[Tensor], None] | None = None,
    return_log_probs: bool = False,
) -> Any:
    """Continue each row of `prompt` (B, P) by up to `max_new_tokens` tokens: (B, N) int64.

    `on_tokens` receives each new column (B,) as soon as it is drawn (streaming output). With
    `eos_id` generation stops once every row has produced it (rows that finished repeat it).
    `return_log_probs` also returns the (B, N, V) distributions the tokens were drawn from.
    The task samples in evaluation mode and is given back in the mode it came in.
    """
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"the prompt must be (batch, length >= 1) token ids, got {tuple(prompt.shape)}"
        )
    decoder = IncrementalDecoder(task, prompt.shape[0])
    log_probs = decoder.feed(prompt)
    tokens: list[Tensor] = []
    dists: list[Tensor] = []
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for i in range(max_new_tokens):
        if return_log_probs:
            dists.append(log_probs)
        tok = next_token(log_probs, temperature, top_k, top_p, generator)
        if eos_id is not None:
            tok = torch.where(done, torch.full_like(tok, eos_id), tok)
            done = done | (tok == eos_id)
        tokens.append(tok)
        if on_tokens is not None:
            on_tokens(tok)
        if (eos_id is not None and bool(done.all())) or i == max_new_tokens - 1:
            break
        log_probs = decoder.feed(tok.unsqueeze(1))
    out = torch.stack(tokens, 1) if tokens else prompt.new_zeros(prompt.shape[0], 0)
    if return_log_probs:
        return out, torch.stack(dists, 1) if dists else None
    return out
