"""Autoregressive language modelling, with model state carried across consecutive segments.

Batch: `inputs` (B, L) tokens and `targets` (B, L) next tokens; optional `mask` (B, L) True at
real input tokens; `target_mask` (B, L) True where a prediction is scored (sliding-window
evaluation scores only the new tokens of each window); `reset` (bool) True when the batch
starts new streams, so the carried state must be dropped; `num_words` the number of words the
scored tokens cover (for word-level perplexity with a subword vocabulary).

With `carry_state=True` the backbone's returned state is passed to the next batch of the same
stage (training state is detached: truncated back-propagation through time), as Transformer-XL,
LaMemo, Mega and Megalodon need for contiguous streams.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import SumMetric

from megalab.tasks.base import SequenceTask

SPLITS = ("train", "val", "test")


class LinearLMHead(nn.Module):
    """Output projection to the vocabulary; optionally tied to the input embedding."""

    def __init__(self, d_model: int, vocab_size: int, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size, bias=bias)
        nn.init.normal_(self.proj.weight, std=d_model**-0.5)

    def tie(self, embedding: nn.Embedding) -> None:
        """Share the weight matrix with the token embedding (Press & Wolf 2017)."""
        if embedding.weight.shape != self.proj.weight.shape:
            raise ValueError(
                f"cannot tie output {tuple(self.proj.weight.shape)} to embedding "
                f"{tuple(embedding.weight.shape)}"
            )
        self.proj.weight = embedding.weight

    def nll(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Per-token negative log-likelihood (B, L) in nats."""
        logits = self.proj(hidden).float()
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


def detach_state(state: Any) -> Any:
    """Detach every tensor in a (nested) state, keeping its structure."""
    if isinstance(state, Tensor):
        return state.detach()
    if isinstance(state, dict):
        return {k: detach_state(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        out = [detach_state(v) for v in state]
        return type(state)(out) if not hasattr(state, "_fields") else type(state)(*out)
    if hasattr(state, "detach"):
        return state.detach()
    return state


class LanguageModelingTask(SequenceTask):
    """Next-token prediction; logs loss (nats), perplexity, bits per token and word perplexity."""

    def __init__(
        self,
        encoder: nn.Module,
        backbone: nn.Module,
        head: nn.Module,
        tie_weights: bool = False,
        carry_state: bool = False,
        optim: Mapping[str, Any] | None = None,
        scheduler: Callable[..., Any] | None = None,
        check_finite: bool = True,
        compile: bool = False,
    ) -> None:
        super().__init__(encoder, backbone, optim, scheduler, check_finite, compile)
        self.head = head
        if tie_weights:
            embedding = getattr(getattr(encoder, "embed", encoder), "embedding", None)
            if embedding is None:
                raise ValueError("tie_weights needs a token embedding in the encoder")
            head.tie(embedding)
        self.carry_state = carry_state
        # ModuleDict keys cannot be "train" (nn.Module.train), hence the `_nll` style suffixes.
        self.sums = nn.ModuleDict(
            {f"{s}_{k}": SumMetric() for s in SPLITS for k in ("nll", "tokens", "words")}
        )
        self._state: dict[str, Any] = dict.fromkeys(SPLITS)

    def forward(
        self, inputs: Tensor, mask: Tensor | None = None, state: Any = None
    ) -> tuple[Tensor, Any]:
        """Hidden states (B, L, D) and the state to carry into the next segment."""
        return self.encode(inputs, mask, state)

    def _step(self, batch: dict[str, Tensor], split: str) -> Tensor:
        reset = batch.get("reset")
        if not self.carry_state or (reset is not None and bool(torch.as_tensor(reset).any())):
            self._state[split] = None
        hidden, state = self(batch["inputs"], batch.get("mask"), self._state[split])
        if self.carry_state:
            self._state[split] = detach_state(state) if split == "train" else state
        nll = self.head.nll(hidden, batch["targets"])
        scored = batch.get("target_mask", batch.get("mask"))
        if scored is None:
            scored = torch.ones_like(nll, dtype=torch.bool)
        weight = scored.to(nll.dtype)
        total, count = (nll * weight).sum(), weight.sum()
        loss = total / count.clamp_min(1.0)
        self.sums[f"{split}_nll"](total.detach())
        self.sums[f"{split}_tokens"](count.detach())
        if "num_words" in batch:
            self.sums[f"{split}_words"](torch.as_tensor(batch["num_words"], dtype=nll.dtype).sum())
        if split == "train":
            self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, prog_bar=True,
                     batch_size=int(count))
        return loss

    def _log_epoch(self, split: str) -> None:
        total = self.sums[f"{split}_nll"].compute()
        count = self.sums[f"{split}_tokens"].compute()
        loss = total / count.clamp_min(1.0)
        metrics = {
            f"{split}/loss": loss,
            f"{split}/ppl": torch.exp(loss.clamp(max=50.0)),
            f"{split}/bpc": loss / math.log(2.0),
        }
        words = self.sums[f"{split}_words"].compute()
        if words > 0:
            metrics[f"{split}/word_ppl"] = torch.exp((total / words).clamp(max=50.0))
        self.log_dict(metrics, prog_bar=split != "train")
        for m in (self.sums[f"{split}_nll"], self.sums[f"{split}_tokens"], self.sums[f"{split}_words"]):
            m.reset()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._step(batch, "train")
        self.assert_finite(loss)
        self.log_throughput(batch["inputs"].numel())
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self._state["train"] = None

    def on_train_epoch_end(self) -> None:
        for kind in ("nll", "tokens", "words"):
            self.sums[f"train_{kind}"].reset()

    def on_validation_epoch_start(self) -> None:
        self._state["val"] = None

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_start(self) -> None:
        self._state["test"] = None

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")
