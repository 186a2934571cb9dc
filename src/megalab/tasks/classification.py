"""Sequence classification (LRA, Speech Commands, ImageNet) and two-tower retrieval (AAN)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from megalab.batch import Batch
from megalab.models.base import BackboneConfig, BackboneOutput
from megalab.nn.heads import POOLING_MODES, combine_pair, pair_width, pool
from megalab.tasks.base import SequenceTask, TaskOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

SPLITS = ("train", "val", "test")


class ClassificationTask(SequenceTask):
    """encoder -> backbone -> pooling -> head, trained with cross-entropy.

    Logs `{split}/loss`, `{split}/acc`, `val/acc_best`, the learning rate and tokens/s.
    `label_smoothing` applies to training only; batches may carry soft `targets` (B, C)
    (Mixup/CutMix), scored with soft cross-entropy.
    """

    def __init__(
        self,
        encoder: nn.Module,
        backbone: nn.Module | BackboneConfig,
        head: nn.Module | Callable[..., nn.Module],
        num_classes: int,
        pooling: str = "mean",
        label_smoothing: float = 0.0,
        **options: Unpack[TaskOptions],
    ) -> None:
        super().__init__(encoder, backbone, **options)
        if pooling not in POOLING_MODES:
            raise ValueError(f"unknown pooling {pooling!r}; choose one of {POOLING_MODES}")
        self.head = head if isinstance(head, nn.Module) else head(d_in=self.head_input_width())
        self.pooling = pooling
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing
        # ModuleDict keys cannot be "train" (nn.Module.train), hence the suffixes.
        # nn.ModuleDict's stub types its values as Module; these hold metrics only.
        self.losses: Mapping[str, MeanMetric] = nn.ModuleDict(  # type: ignore[assignment]
            {f"{s}_loss": MeanMetric(nan_strategy="disable") for s in SPLITS}
        )
        self.accs: Mapping[str, MulticlassAccuracy] = nn.ModuleDict(  # type: ignore[assignment]
            {f"{s}_acc": MulticlassAccuracy(num_classes, average="micro") for s in SPLITS}
        )
        self.val_acc_best = MaxMetric()

    def head_input_width(self) -> int:
        """Width of the pooled features the head receives."""
        return self.backbone.d_model

    def features(self, inputs: Tensor, mask: Tensor | None) -> Tensor:
        """Pooled sequence representation (B, D)."""
        return self.pooled(inputs, mask)[0]

    def pooled(self, inputs: Tensor, mask: Tensor | None) -> tuple[Tensor, BackboneOutput]:
        """Pooled representation (B, D) and the backbone's output (for its aux values)."""
        out = self.encode(inputs, mask)
        return pool(out.y, mask, self.pooling), out

    def forward(self, inputs: Tensor, mask: Tensor | None = None) -> Tensor:
        """Class logits (B, num_classes)."""
        return self.head(self.features(inputs, mask))

    def logits(self, batch: Batch) -> tuple[Tensor, BackboneOutput]:
        """Class logits (B, num_classes) of a batch, and the backbone's output."""
        pooled, out = self.pooled(batch["inputs"], batch.get("mask"))
        return self.head(pooled), out

    def _step(self, batch: Batch, split: str) -> Tensor:
        logits, out = self.logits(batch)
        targets = batch["targets"]
        smoothing = self.label_smoothing if split == "train" else 0.0
        loss = F.cross_entropy(logits.float(), targets, label_smoothing=smoothing)
        hard = targets.argmax(-1) if targets.is_floating_point() else targets
        n = logits.shape[0]
        aux_loss = self.aux_loss(out, split, n)
        # The batch mean once per example: the epoch's loss is the mean over examples however
        # the batches fall. (MeanMetric(nan_strategy="disable"), which keeps NaN checks and
        # their host syncs out of the step, ignores a `weight` argument: torchmetrics 1.9.)
        self.losses[f"{split}_loss"](loss.detach().expand(n))
        self.accs[f"{split}_acc"](logits.detach(), hard)
        for name, metric in (
            ("loss", self.losses[f"{split}_loss"]),
            ("acc", self.accs[f"{split}_acc"]),
        ):
            self.log(
                f"{split}/{name}",
                metric,
                on_step=split == "train",
                on_epoch=True,
                batch_size=n,
                prog_bar=True,
            )
        if aux_loss is not None and split == "train":
            loss = loss + aux_loss
        return loss

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self._step(batch, "train")
        self.assert_finite(loss)
        mask = batch.get("mask")
        tokens = mask.sum() if mask is not None else batch["inputs"].shape[:2].numel()
        self.log_throughput(tokens)
        return loss

    def on_train_start(self) -> None:
        # Sanity-check batches must not count towards the best validation accuracy; a resumed
        # run then gets the best so far back from its checkpoint.
        self.val_acc_best.reset()
        super().on_train_start()

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        acc = self.accs["val_acc"].compute()
        self.val_acc_best(acc)
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "test")


class RetrievalTask(ClassificationTask):
    """Two-tower matching (LRA Retrieval/AAN): a shared encoder pools each document, the pair
    is combined (`concat` = [a, b] as Mega; `nli` = [a, b, a-b, a*b] as LRA) and classified."""

    def __init__(self, *args: Any, combine: str = "concat", **kwargs: Any) -> None:
        self.combine = combine
        super().__init__(*args, **kwargs)

    def head_input_width(self) -> int:
        return pair_width(self.backbone.d_model, self.combine)

    def forward(  # type: ignore[override]
        self,
        inputs: Tensor,
        mask: Tensor | None,
        inputs2: Tensor,
        mask2: Tensor | None,
    ) -> Tensor:
        """Class logits (B, num_classes) of document pairs."""
        return self._pair_logits(inputs, mask, inputs2, mask2)[0]

    def _pair_logits(
        self, inputs: Tensor, mask: Tensor | None, inputs2: Tensor, mask2: Tensor | None
    ) -> tuple[Tensor, BackboneOutput]:
        # Both documents go through the backbone as one 2B batch, padded to a common length.
        B, L1, L2 = inputs.shape[0], inputs.shape[1], inputs2.shape[1]
        L = max(L1, L2)
        if mask is None:
            mask = torch.ones(inputs.shape[:2], dtype=torch.bool, device=inputs.device)
        if mask2 is None:
            mask2 = torch.ones(inputs2.shape[:2], dtype=torch.bool, device=inputs2.device)
        both = torch.cat([F.pad(inputs, (0, L - L1)), F.pad(inputs2, (0, L - L2))])
        masks = torch.cat([F.pad(mask, (0, L - L1)), F.pad(mask2, (0, L - L2))])
        pooled, out = self.pooled(both, masks)
        return self.head(combine_pair(pooled[:B], pooled[B:], self.combine)), out

    def logits(self, batch: Batch) -> tuple[Tensor, BackboneOutput]:
        return self._pair_logits(
            batch["inputs"], batch.get("mask"), batch["inputs2"], batch.get("mask2")
        )

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self._step(batch, "train")
        self.assert_finite(loss)
        tokens = sum(batch[k].sum() for k in ("mask", "mask2") if k in batch)
        self.log_throughput(tokens)
        return loss
