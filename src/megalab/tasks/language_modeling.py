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

import math
from collections.abc import Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import SumMetric

from megalab.batch import Batch
from megalab.models.base import Backbone, BackboneConfig, BackboneOutput
from megalab.nn.embedding import SequenceEncoder, TokenEmbedding
from megalab.nn.lm_head import LMHead
from megalab.nn.state import detach_state, pack_state, state_to, unpack_state
from megalab.tasks.base import NonFiniteLossError, SequenceTask, TaskOptions
from megalab.utils.distributed import gather_from_ranks

if TYPE_CHECKING:
    from typing_extensions import Unpack

SPLITS = ("train", "val", "test")
_STATE_KEY = "lm_train_state"


class LinearLMHead(LMHead):
    """Output projection to the vocabulary; optionally tied to the input embedding.

    The weight starts from N(0, `init_std`), d^-1/2 by default (Llama: 0.02, HF's init);
    `init_truncation` cuts the normal at ±that many σ (Megalodon: 3).
    """

    def __init__(
        self,
        d_model: int,
        vocab_size: int,
        bias: bool = False,
        init_std: float | None = None,
        init_truncation: float | None = None,
    ) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size, bias=bias)
        std = init_std or d_model**-0.5
        if init_truncation is None:
            nn.init.normal_(self.proj.weight, std=std)
        else:
            cut = init_truncation * std
            nn.init.trunc_normal_(self.proj.weight, std=std, a=-cut, b=cut)

    def tie_encoder(self, encoder: nn.Module) -> None:
        """`tie` to the token table of the task's encoder: a `TokenEmbedding`, or a
        `SequenceEncoder` of tokens."""
        embed = encoder.embed if isinstance(encoder, SequenceEncoder) else encoder
        if not isinstance(embed, TokenEmbedding):
            raise ValueError(
                f"tie_weights needs a token embedding in the encoder, got {type(embed).__name__}"
            )
        self.tie(embed.embedding)

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

    def log_probs(self, hidden: Tensor) -> Tensor:
        """Log-distribution over the vocabulary (..., V) in float32 (for generation)."""
        return F.log_softmax(self.proj(hidden).float(), dim=-1)


def check_causal(backbone: nn.Module) -> None:
    """Fail early when a backbone would see the tokens it has to predict."""
    if not backbone.causal:
        raise ValueError(
            f"language modelling needs a causal backbone, but this {type(backbone).__name__} is "
            "bidirectional (causal=False): it would see the next tokens it predicts. Set "
            "model.backbone.causal=true"
        )


def check_ext_len(backbone: Backbone, datamodule: Any) -> None:
    """Fail early when the data's extended context (`data.ext_len`) and the backbone's
    (`model.backbone.ext_len`, Transformer-XL's) differ: the memory would then either repeat
    the re-read tokens or skip the ones it leaves out."""
    data_ext = int(getattr(datamodule, "ext_len", 0) or 0)
    model_ext = backbone.ext_len
    if data_ext != model_ext:
        raise ValueError(
            f"data.ext_len={data_ext} but the {type(backbone).__name__} backbone keeps "
            f"ext_len={model_ext} positions out of its memory: set model.backbone.ext_len to "
            "data.ext_len (only Transformer-XL supports ext_len > 0)"
        )


def check_no_extended_context(backbone: Backbone, what: str) -> None:
    """Fail early when `what` (generation, long-context scoring: contiguous segments without
    extended context) would run a backbone that leaves `ext_len` positions of every segment
    out of its memory: those tokens would be lost from the context."""
    ext = backbone.ext_len
    if ext:
        raise ValueError(
            f"{what} feeds the stream without extended context, but this "
            f"{type(backbone).__name__} keeps the last ext_len={ext} positions of every segment "
            "out of its memory: they would be lost. Run it with model.backbone.ext_len=0 (the "
            "same weights; the memory then keeps every token)"
        )


class LanguageModelingTask(SequenceTask):
    """Next-token prediction; logs loss (nats), perplexity, bits per token and word perplexity."""

    def __init__(
        self,
        encoder: nn.Module,
        backbone: nn.Module | BackboneConfig,
        head: nn.Module,
        tie_weights: bool = False,
        carry_state: bool = False,
        *,
        loss_scale: float = 1.0,
        **options: Unpack[TaskOptions],
    ) -> None:
        super().__init__(encoder, backbone, **options)
        check_causal(self.backbone)
        # The optimised loss is loss_scale x the mean NLL (the logged train/loss is not scaled).
        # 0.5 reproduces the LaMemo code's `(loss + mem_loss) / 2` with mem_loss = 0: half the
        # gradient, so its clip norm acts as twice that norm on the NLL's gradient.
        if loss_scale <= 0:
            raise ValueError(f"loss_scale must be positive, got {loss_scale}")
        self.loss_scale = loss_scale
        self.head: Any = head  # an LM head (`LMHead`: nll, log_probs, tie_encoder)
        if tie_weights:
            if not isinstance(head, LMHead):
                raise TypeError(
                    f"tie_weights needs an LM head (megalab.nn.lm_head.LMHead), got "
                    f"{type(head).__name__}: subclass LMHead and implement tie_encoder, or set "
                    "task.tie_weights=false"
                )
            head.tie_encoder(encoder)
        self.carry_state = carry_state
        # ModuleDict keys cannot be "train" (nn.Module.train), hence the `_nll` style suffixes.
        # NaN is kept (torchmetrics would drop it by default) so that `epoch_metrics` reports it.
        # nn.ModuleDict's stub types its values as Module; this one holds SumMetrics only.
        self.sums: Mapping[str, SumMetric] = nn.ModuleDict(  # type: ignore[assignment]
            {
                f"{s}_{k}": SumMetric(nan_strategy="disable").set_dtype(torch.float64)
                for s in SPLITS
                for k in ("nll", "tokens", "words")
            }
        )
        # Carried state per stage and stream group.
        self._state: dict[str, dict[int, Any]] = {s: {} for s in SPLITS}
        self._restored = False
        # The chunk-parallel group this rank belongs to (`megalab.parallel.chunk.ChunkParallel`,
        # set by `use_chunk_parallel`) and the exchange hooks it installed.
        self.chunk_parallel: Any = None
        self._chunk_hooks: list[Any] = []

    def setup(self, stage: str) -> None:
        trainer = self._trainer
        if trainer is not None:
            check_ext_len(self.backbone, getattr(trainer, "datamodule", None))
        super().setup(stage)

    def forward(
        self, inputs: Tensor, mask: Tensor | None = None, state: Any = None
    ) -> BackboneOutput:
        """Hidden states (B, L, D), the state to carry into the next segment, and aux values."""
        return self.encode(inputs, mask, state)

    def initial_state(self, batch_size: int) -> Any:
        """The start of a stream: the backbone's empty state (None for a stateless backbone).

        Starting from it makes every segment use the exact recurrence (Mega's EMA state is
        carried beyond its training truncation, as the authors evaluate).
        """
        like = next(self.backbone.parameters())
        return self.backbone.initial_state(batch_size, like)

    # -- chunk parallelism ----------------------------------------------------------------------
    def check_chunk_parallel(self, datamodule: Any) -> None:
        """Fail before any process starts where chunk parallelism cannot run this task.

        Every training batch must start from a fresh state: the ranks of a group run the
        slices of one batch as a wavefront, and carrying the last slice's final state into the
        first slice of the next batch (`data.sampler=stream` with `task.carry_state=true`,
        truncated BPTT over contiguous streams) is not implemented. `carry_state=true` with
        `data.sampler=random` (every window starts afresh: Megalodon on WikiText-103) trains
        chunk-parallel and evaluates as one process would (`_step`)."""
        if not self.carry_state:
            return
        sampling = getattr(datamodule, "train_sampling", None)
        if sampling != "random":
            raise ValueError(
                "chunk parallelism trains on batches that each start from a fresh state, but "
                f"this run carries the state from one training batch to the next "
                f"(task.carry_state=true, data.sampler={sampling}): set data.sampler=random "
                "(independent windows, as the authors' chunk-parallel pretraining) or "
                "task.carry_state=false, or train these streams without chunk parallelism "
                "(trainer=ddp / ddp_cpu)"
            )

    def use_chunk_parallel(self, chunk: Any) -> None:
        """Run as one rank of a chunk-parallel group (`megalab.parallel`): take this rank's
        slice of every training batch, exchange the backbone's state with the neighbours, and
        scale the loss so that data-parallel averaging gives the whole-sequence gradient.
        Evaluation is sliced too, unless it carries state from segment to segment
        (`carry_state`): then every rank of a group scores the whole segments, as one process."""
        trainer = self._trainer
        self.check_chunk_parallel(getattr(trainer, "datamodule", None))
        # Every fit/validate/test sets the strategy up again with a new exchange: the hooks of
        # the previous one go, or each layer would exchange its state twice.
        for handle in self._chunk_hooks:
            handle.remove()
        self._chunk_hooks = chunk.install(self.backbone)
        self.chunk_parallel = chunk

    def _slice_batch(self, batch: Batch) -> Batch:
        """This rank's time slice; the length is padded (masked) to a multiple of the group."""
        cp = self.chunk_parallel
        out: dict[str, Any] = dict(batch)
        B, L = batch["inputs"].shape[:2]
        pad = (-L) % cp.size
        mask = batch.get("mask")
        if mask is None:
            mask = torch.ones(B, L, dtype=torch.bool, device=batch["inputs"].device)
        out["mask"] = mask
        for key in ("inputs", "targets", "mask", "target_mask"):
            if key in out:
                t = out[key]
                if pad:
                    t = torch.cat([t, t.new_zeros(B, pad, *t.shape[2:])], 1)
                out[key] = cp.slice(t)
        if "num_words" in out and cp.index > 0:
            out["num_words"] = torch.zeros_like(torch.as_tensor(out["num_words"]))
        return out  # type: ignore[return-value]

    def _step(self, batch: Batch, split: str) -> Tensor:
        cp = self.chunk_parallel
        if cp is not None and split != "train" and self.carry_state:
            # Evaluation over carried streams: the whole segments on every rank (the group's
            # ranks score the same tokens, which leaves the synced loss ratios unchanged).
            cp = None
        if cp is not None:
            batch = self._slice_batch(batch)
        states = self._state[split]
        group = int(batch["stream_group"]) if "stream_group" in batch else 0
        reset = batch.get("reset", False)  # a bool from megalab's streams: no device read
        if isinstance(reset, Tensor):
            reset = bool(reset.any())
        if not self.carry_state or reset:
            states.pop(group, None)
        state = states.get(group)
        if state is not None and self._restored:
            state = state_to(state, batch["inputs"].device)
        if state is None and self.carry_state:
            state = self.initial_state(batch["inputs"].shape[0])
        chunk = self.chunk_parallel
        with chunk.paused() if chunk is not None and cp is None else nullcontext():
            out = self(batch["inputs"], batch.get("mask"), state)
        if self.carry_state:
            states[group] = detach_state(out.state) if split == "train" else out.state
        nll = self.head.nll(out.y, batch["targets"])
        scored = batch.get("target_mask", batch.get("mask"))
        if scored is None:
            scored = torch.ones_like(nll, dtype=torch.bool)
        # `where`, not a product: a NaN at an unscored (padded) position must not leak in.
        total = torch.where(scored, nll, torch.zeros_like(nll)).sum()
        count = scored.sum()
        loss = total / count.clamp_min(1).to(total.dtype)
        group_loss = loss
        if cp is not None:
            # The group's tokens: each rank's loss is its share of the whole sequence's mean,
            # times cp (DDP averages over the dp x cp processes).
            sums = torch.stack([total.detach(), count.to(total.dtype)])
            torch.distributed.all_reduce(sums, group=cp.group)
            loss = total / sums[1].clamp_min(1) * cp.size
            group_loss = sums[0] / sums[1].clamp_min(1)
        self.sums[f"{split}_nll"](total.detach().double())
        self.sums[f"{split}_tokens"](count.detach().double())
        if "num_words" in batch:
            self.sums[f"{split}_words"](torch.as_tensor(batch["num_words"]).double().sum())
        n_scored = int(count)  # one host sync, read by the log's weight and the auxiliary loss
        if split == "train":
            self.log(
                "train/loss",
                group_loss.detach(),
                on_step=True,
                on_epoch=True,
                prog_bar=True,
                batch_size=n_scored,
            )
        aux_loss = self.aux_loss(out, split, n_scored)
        if aux_loss is not None and split == "train":
            loss = loss + aux_loss
        if split == "train" and self.loss_scale != 1.0:
            loss = loss * self.loss_scale
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
        words = words_metric.compute() if words_metric.update_called else total.new_zeros(())
        if words > 0:
            metrics[f"{split}/word_ppl"] = torch.exp((total / words).clamp(max=50.0))
        return metrics

    def _log_epoch(self, split: str) -> None:
        metrics = self.epoch_metrics(split)
        if metrics:
            self.log_dict({k: v.float() for k, v in metrics.items()}, prog_bar=split != "train")
        for kind in ("nll", "tokens", "words"):
            self.sums[f"{split}_{kind}"].reset()

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self._step(batch, "train")
        self._restored = False
        self.assert_finite(loss)
        cp = self.chunk_parallel
        self.log_throughput(batch["inputs"].numel() // (cp.size if cp is not None else 1))
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
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
            checkpoint[_STATE_KEY] = {"ranks": gather_from_ranks(packed)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get(_STATE_KEY)
        if not saved or not self.carry_state:
            return
        ranks = saved["ranks"]
        if not self._same_processes(
            ranks, "the checkpoint's carried state", "training streams restart without it"
        ):
            return
        mine = ranks[self.global_rank if self._trainer is not None else 0]
        self._state["train"] = {int(g): unpack_state(s) for g, s in mine["items"]}
        self._restored = True
