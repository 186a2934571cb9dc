"""Autoregressive language modelling, with model state carried across consecutive segments.

Batch: `inputs` (B, L) tokens and `targets` (B, L) next tokens; optional `mask` (B, L) True at
real input tokens; `target_mask` (B, L) True where a prediction is scored (sliding-window
evaluation scores only the new tokens of each window); `reset` (bool) True when the batch
starts new streams, so the carried state must be dropped; `stream_group` (int) which set of
streams the batch continues (gradient accumulation interleaves several); `num_words` the number
of words the scored tokens cover (for word-level perplexity with a subword vocabulary).

With `carry_state=True` the backbone's returned state is passed to the next batch of the same
stage and stream group (training state is detached: truncated back-propagation through time),
as Transformer-XL, LaMemo, Mega and Megalodon need for contiguous streams. The training state
is saved in checkpoints (from every process), so a run resumed mid-epoch continues exactly.

Metrics per evaluation epoch: `loss` (nats per scored token), `ppl`, `bpc` (bits per token) and,
when batches carry `num_words`, `word_ppl` = exp(total NLL / number of words).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import SumMetric

from megalab.nn.adaptive import AdaptiveSoftmax
from megalab.tasks.base import NonFiniteLossError, SequenceTask

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
_STATE_KEY = "lm_train_state"


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


# --------------------------------------------------------------------------- carried state


def _map_tensors(state: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Apply `fn` to every tensor of a nested state, keeping its structure."""
    if isinstance(state, Tensor):
        return fn(state)
    if isinstance(state, dict):
        return {k: _map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(_map_tensors(v, fn) for v in state))
    if isinstance(state, list | tuple):
        return type(state)(_map_tensors(v, fn) for v in state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        changes = {
            f.name: _map_tensors(getattr(state, f.name), fn)
            for f in dataclasses.fields(state)
            if f.init
        }
        return dataclasses.replace(state, **changes)
    return state


def detach_state(state: Any) -> Any:
    """Detach every tensor in a (nested) state, keeping its structure."""
    if not isinstance(state, Tensor | dict | list | tuple) and hasattr(state, "detach"):
        return state.detach()
    return _map_tensors(state, lambda t: t.detach())


def pack_state(state: Any) -> Any:
    """A nested state as plain containers and CPU tensors (loadable with `weights_only`)."""
    if state is None or isinstance(state, bool | int | float | str):
        return state
    if isinstance(state, Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {"kind": "dict", "items": [[k, pack_state(v)] for k, v in state.items()]}
    cls = type(state)
    name = f"{cls.__module__}:{cls.__qualname__}"
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        fields = {f: pack_state(getattr(state, f)) for f in state._fields}
        return {"kind": "object", "class": name, "fields": fields}
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        fields = {f.name: pack_state(getattr(state, f.name)) for f in dataclasses.fields(state)}
        return {"kind": "object", "class": name, "fields": fields}
    if isinstance(state, list | tuple):
        return {"kind": cls.__name__, "items": [pack_state(v) for v in state]}
    raise TypeError(f"cannot save a carried state of type {cls.__name__} in a checkpoint")


def unpack_state(packed: Any) -> Any:
    """Inverse of `pack_state` (classes are imported from megalab or torch only)."""
    if not isinstance(packed, dict):
        return packed
    kind = packed["kind"]
    if kind == "dict":
        return {k: unpack_state(v) for k, v in packed["items"]}
    if kind in ("list", "tuple"):
        items = [unpack_state(v) for v in packed["items"]]
        return items if kind == "list" else tuple(items)
    module, qualname = packed["class"].split(":")
    if module.split(".")[0] not in ("megalab", "torch"):
        raise ValueError(f"refusing to rebuild a state of class {packed['class']}")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj(**{k: unpack_state(v) for k, v in packed["fields"].items()})


def _gather_from_ranks(obj: Any) -> list[Any]:
    """`obj` from every process (a one-element list without distributed training)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def check_causal(backbone: nn.Module) -> None:
    """Fail early when a backbone would see the tokens it has to predict."""
    causal = getattr(backbone, "causal", None)
    bidirectional = getattr(backbone, "bidirectional", None)
    if causal is False or bidirectional is True:
        raise ValueError(
            f"language modelling needs a causal backbone, but this {type(backbone).__name__} is "
            f"bidirectional (causal={causal}, bidirectional={bidirectional}): it would see the "
            "next tokens it predicts. Set model.backbone.causal=true"
        )


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
        check_causal(backbone)
        super().__init__(encoder, backbone, optim, scheduler, check_finite, compile)
        self.head = head
        if tie_weights:
            if isinstance(head, AdaptiveSoftmax):
                head.tie(encoder)
            else:
                embedding = getattr(getattr(encoder, "embed", encoder), "embedding", None)
                if embedding is None:
                    raise ValueError("tie_weights needs a token embedding in the encoder")
                head.tie(embedding)
        self.carry_state = carry_state
        # ModuleDict keys cannot be "train" (nn.Module.train), hence the `_nll` style suffixes.
        # NaN is kept (torchmetrics would drop it by default) so that `epoch_metrics` reports it.
        self.sums = nn.ModuleDict(
            {
                f"{s}_{k}": SumMetric(nan_strategy="disable").set_dtype(torch.float64)
                for s in SPLITS
                for k in ("nll", "tokens", "words")
            }
        )
        # Carried state per stage and stream group.
        self._state: dict[str, dict[int, Any]] = {s: {} for s in SPLITS}
        self._restored = False

    def forward(
        self, inputs: Tensor, mask: Tensor | None = None, state: Any = None
    ) -> tuple[Tensor, Any]:
        """Hidden states (B, L, D) and the state to carry into the next segment."""
        return self.encode(inputs, mask, state)

    def initial_state(self, batch_size: int) -> Any:
        """The start of a stream: the backbone's empty state, or None for a stateless backbone.

        Stateful backbones define `initial_state(batch_size, like)` and return a state only when
        given one; starting from it makes every segment use the exact recurrence (Mega's EMA
        state is carried beyond its training truncation, as the authors evaluate).
        """
        make = getattr(self.backbone, "initial_state", None)
        if make is None:
            return None
        like = next(self.backbone.parameters())
        return make(batch_size, like)

    def _step(self, batch: dict[str, Tensor], split: str) -> Tensor:
        states = self._state[split]
        group = int(batch["stream_group"]) if "stream_group" in batch else 0
        reset = batch.get("reset")
        if not self.carry_state or (reset is not None and bool(torch.as_tensor(reset).any())):
            states.pop(group, None)
        state = states.get(group)
        if state is not None and self._restored:
            device = batch["inputs"].device
            state = _map_tensors(state, lambda t: t.to(device))
        if state is None and self.carry_state:
            state = self.initial_state(batch["inputs"].shape[0])
        hidden, new_state = self(batch["inputs"], batch.get("mask"), state)
        if self.carry_state:
            states[group] = detach_state(new_state) if split == "train" else new_state
        nll = self.head.nll(hidden, batch["targets"])
        scored = batch.get("target_mask", batch.get("mask"))
        if scored is None:
            scored = torch.ones_like(nll, dtype=torch.bool)
        # `where`, not a product: a NaN at an unscored (padded) position must not leak in.
        total = torch.where(scored, nll, torch.zeros_like(nll)).sum()
        count = scored.sum()
        loss = total / count.clamp_min(1).to(total.dtype)
        self.sums[f"{split}_nll"](total.detach().double())
        self.sums[f"{split}_tokens"](count.detach().double())
        if "num_words" in batch:
            self.sums[f"{split}_words"](torch.as_tensor(batch["num_words"]).double().sum())
        if split == "train":
            self.log(
                "train/loss",
                loss.detach(),
                on_step=True,
                on_epoch=True,
                prog_bar=True,
                batch_size=int(count),
            )
        return loss

    def epoch_metrics(self, split: str) -> dict[str, Tensor]:
        """Loss, perplexities and bits of the batches of `split` seen since the last reset."""
        if not self.sums[f"{split}_nll"].update_called:
            return {}  # no batch in this epoch (e.g. limit_val_batches=0)
        total = self.sums[f"{split}_nll"].compute()
        count = self.sums[f"{split}_tokens"].compute()
        if self.check_finite and not bool(torch.isfinite(total)):
            raise NonFiniteLossError(
                f"the {split} loss is {total.item()}: the model produces NaN/inf; check the "
                "inputs, use fp32/bf16 instead of fp16, or lower the learning rate"
            )
        loss = total / count.clamp_min(1.0)
        metrics = {
            f"{split}/loss": loss,
            f"{split}/ppl": torch.exp(loss.clamp(max=50.0)),
            f"{split}/bpc": loss / math.log(2.0),
        }
        words_metric = self.sums[f"{split}_words"]
        words = words_metric.compute() if words_metric.update_called else torch.zeros(())
        if words > 0:
            metrics[f"{split}/word_ppl"] = torch.exp((total / words).clamp(max=50.0))
        return metrics

    def _log_epoch(self, split: str) -> None:
        metrics = self.epoch_metrics(split)
        if metrics:
            self.log_dict({k: v.float() for k, v in metrics.items()}, prog_bar=split != "train")
        for kind in ("nll", "tokens", "words"):
            self.sums[f"{split}_{kind}"].reset()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._step(batch, "train")
        self._restored = False
        self.assert_finite(loss)
        self.log_throughput(batch["inputs"].numel())
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        if not self._restored:  # a mid-epoch resume keeps the state restored from the checkpoint
            self._state["train"] = {}

    def on_train_epoch_end(self) -> None:
        for kind in ("nll", "tokens", "words"):
            self.sums[f"train_{kind}"].reset()

    def on_validation_epoch_start(self) -> None:
        self._state["val"] = {}

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_start(self) -> None:
        self._state["test"] = {}

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    # -- exact resume of carried state ----------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.carry_state:
            packed = {"items": [[g, pack_state(s)] for g, s in self._state["train"].items()]}
            checkpoint[_STATE_KEY] = {"ranks": _gather_from_ranks(packed)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get(_STATE_KEY)
        if not saved or not self.carry_state:
            return
        ranks = saved["ranks"]
        world = self.trainer.world_size if self._trainer is not None else 1
        if len(ranks) != world:
            log.warning(
                "the checkpoint's carried state comes from %d process(es), this run has "
                "%d: training streams restart without it",
                len(ranks),
                world,
            )
            return
        mine = ranks[self.global_rank if self._trainer is not None else 0]
        self._state["train"] = {int(g): unpack_state(s) for g, s in mine["items"]}
        self._restored = True
