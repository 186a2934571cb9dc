"""Sequence-to-sequence training and evaluation (machine translation), as the Mega authors ran it.

Batch (`megalab.data.wmt.TranslationCollator`): `inputs` (B, S) source ids, `mask` True at real
source ids, `targets` (B, T) target ids ending with `</s>`, `target_mask`, `index` the sentences'
positions in their split. The decoder reads the targets shifted right behind `</s>` (teacher
forcing).

- Training: label-smoothed cross-entropy (fairseq's `label_smoothed_cross_entropy`, ε = 0.1:
  (1 − ε)·NLL + ε/V·Σ_v −log p_v, as `F.cross_entropy(label_smoothing=ε)`), averaged over the
  batch's target tokens (fairseq divides by the tokens of the whole update: the same on one
  device without accumulation). Logged: `train/loss` and `train/nll_loss` in nats per token.
- Validation (every `trainer.val_check_interval` steps): `val/loss`, `val/nll_loss`, `val/ppl`,
  and `val/bleu`: beam search (`val_generation`) on the validation split, or on the seeded
  subset the data serves as a second loader (`data.val_bleu_subset`), scored as the authors'
  `--eval-bleu --eval-tokenized-bleu --eval-bleu-detok space`: BPE removed, no detokenization,
  BLEU of the token statistics with sacrebleu's exponential smoothing; unknown words become
  `UNKNOWNTOKENINHYP` / `UNKNOWNTOKENINREF` so they never match. Checkpoints are selected by
  `val/bleu` (`--best-checkpoint-metric bleu`).
- Test: beam search with `generation` (Table 6: beam 5, length penalty 0.5) and
  `test/bleu`, the paper's tokenized BLEU (`compound_split_bleu.sh` on fairseq-generate's output:
  compounds split, references decoded from the binarized targets with unknown words escaped),
  and `test/sacrebleu`, SacreBLEU of the Moses-detokenized output against the raw references
  (its signature goes to `metrics.json` under `sacrebleu`). The translations are written to
  `<output_dir>/translations/test.{hyp,hyp.tok}.<lang>` in corpus order.

The text pipeline (Moses, BPE, dictionary) comes from the datamodule (`pipeline()`); checkpoints
store it with the model's class and options, so a checkpoint alone translates
(`megalab-translate`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import SumMetric

from megalab.batch import Batch
from megalab.generation.beam import GenerationConfig, SpecialTokens, beam_search
from megalab.generation.bleu import CorpusBLEU, sacrebleu_score
from megalab.models.base import unwrap
from megalab.models.seq2seq import EncoderDecoder, EncoderDecoderConfig
from megalab.tasks.base import TaskBase, TaskOptions
from megalab.utils.distributed import gather_from_ranks

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
_PIPELINE_KEY = "text_pipeline"
MODEL_KEY = "seq2seq_model"
UNK_HYP, UNK_REF = "UNKNOWNTOKENINHYP", "UNKNOWNTOKENINREF"


def decoder_inputs(targets: Tensor, target_mask: Tensor, eos_id: int) -> Tensor:
    """fairseq's `prev_output_tokens`: each target's final `</s>` moved to the front."""
    shifted = torch.cat([torch.full_like(targets[:, :1], eos_id), targets[:, :-1]], dim=1)
    return torch.where(target_mask, shifted, targets)


class Seq2SeqTask(TaskBase):
    """Teacher-forced training and beam-search evaluation of an encoder-decoder.

    A `TaskBase`, not a `SequenceTask`: the model is one encoder-decoder, not an encoder and a
    backbone; `compile` compiles it.

    Args:
        model: an `EncoderDecoder` (e.g. `MegaEncoderDecoder`, `TransformerEncoderDecoder`), or
            its config (`MegaEncoderDecoderConfig`, ...: what `model.encoder_decoder` builds),
            from which the model is built here.
        pad_id, eos_id, unk_id: the dictionary's special ids.
        label_smoothing: ε of the training loss (0.1 in Table 10).
        generation: test decoding (`GenerationConfig` fields: beam, len_penalty, max_len_a,
            max_len_b, min_len, unk_penalty).
        val_generation: validation decoding for `val/bleu`.
        val_bleu: compute validation BLEU (False: loss only).
        save_translations: write the test translations into the run directory.
        optim, scheduler, check_finite, compile: as `TaskBase` takes them (`TaskOptions`).
    """

    compile_target = "model"

    def __init__(
        self,
        model: EncoderDecoder | EncoderDecoderConfig,
        pad_id: int = 1,
        eos_id: int = 2,
        unk_id: int = 3,
        label_smoothing: float = 0.1,
        generation: Mapping[str, Any] | None = None,
        val_generation: Mapping[str, Any] | None = None,
        val_bleu: bool = True,
        save_translations: bool = True,
        **options: Unpack[TaskOptions],
    ) -> None:
        super().__init__(**options)
        if isinstance(model, EncoderDecoderConfig):
            model = model.build()
        if not isinstance(model, EncoderDecoder):
            raise TypeError(
                f"{type(model).__name__} is not an encoder-decoder: the seq2seq task needs a "
                "megalab.models.seq2seq.EncoderDecoder (model=seq2seq/mega or seq2seq/transformer)"
            )
        if model.pad_id != pad_id:
            raise ValueError(f"the model pads with id {model.pad_id}, the data with {pad_id}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        self.model = model
        self.special = SpecialTokens(eos=eos_id, pad=pad_id, unk=unk_id)
        self.label_smoothing = label_smoothing
        self.generation = GenerationConfig(**dict(generation or {}))
        self.val_generation = GenerationConfig(**dict(val_generation or {}))
        self.val_bleu_enabled = val_bleu
        self.save_translations = save_translations
        self.pipeline: Any = None  # megalab.data.wmt.TextPipeline
        self.sums = nn.ModuleDict(
            {
                f"{s}_{k}": SumMetric(nan_strategy="disable").set_dtype(torch.float64)
                for s in ("val", "test")
                for k in ("loss", "nll", "tokens")
            }
        )
        self.val_bleu = CorpusBLEU(compound=False, smooth="exp")
        self.test_bleu = CorpusBLEU(compound=True, smooth="none")
        self._test_outputs: list[tuple[int, str, str]] = []
        self._sacrebleu: dict[str, Any] = {}

    # -- setup ----------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        if self.pipeline is None and callable(getattr(datamodule, "pipeline", None)):
            self.pipeline = datamodule.pipeline()  # type: ignore[union-attr]
        super().setup(stage)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.pipeline is not None:
            checkpoint[_PIPELINE_KEY] = self.pipeline.state()
        # What `megalab-translate` rebuilds the model from: an allow-listed class name and its
        # config's fields (`EncoderDecoder.from_options`).
        model = cast(EncoderDecoder, unwrap(self.model))
        checkpoint[MODEL_KEY] = {"class": type(model).__name__, "config": model.config.options()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get(_PIPELINE_KEY)
        if state is not None:
            from megalab.data.wmt import TextPipeline

            self.pipeline = TextPipeline.from_state(state)

    # -- losses ---------------------------------------------------------------------------------
    def forward(self, batch: Batch) -> Tensor:
        """Teacher-forced logits (B, T, V)."""
        tgt_in = decoder_inputs(batch["targets"], batch["target_mask"], self.special.eos)
        return self.model(batch["inputs"], batch.get("mask"), tgt_in, batch["target_mask"])

    def losses(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """(summed label-smoothed loss, summed NLL, target tokens) of a batch, in nats."""
        logits = self(batch).float()
        targets = batch["targets"].masked_fill(~batch["target_mask"], self.special.pad)
        flat, tgt = logits.view(-1, logits.shape[-1]), targets.view(-1)
        loss = F.cross_entropy(
            flat, tgt, ignore_index=self.special.pad, label_smoothing=self.label_smoothing,
            reduction="sum",
        )  # fmt: skip
        nll = F.cross_entropy(flat, tgt, ignore_index=self.special.pad, reduction="sum")
        return loss, nll.detach(), batch["target_mask"].sum()

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss, nll, tokens = self.losses(batch)
        n = tokens.clamp_min(1)
        loss = loss / n
        self.assert_finite(loss)
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, prog_bar=True,
                 batch_size=int(tokens))  # fmt: skip
        self.log("train/nll_loss", nll / n, on_step=True, on_epoch=True, batch_size=int(tokens))
        self.log_throughput(int(tokens))
        return loss

    def _sum(self, name: str) -> SumMetric:
        return cast(SumMetric, self.sums[name])

    def _accumulate(self, split: str, batch: Batch) -> None:
        loss, nll, tokens = self.losses(batch)
        self._sum(f"{split}_loss").update(loss.detach().double())
        self._sum(f"{split}_nll").update(nll.double())
        self._sum(f"{split}_tokens").update(tokens.double())

    def _log_losses(self, split: str) -> None:
        if not self._sum(f"{split}_tokens").update_called:
            return
        tokens = self._sum(f"{split}_tokens").compute().clamp_min(1.0)
        loss = self._sum(f"{split}_loss").compute() / tokens
        nll = self._sum(f"{split}_nll").compute() / tokens
        self.log_dict(
            {f"{split}/loss": loss.float(), f"{split}/nll_loss": nll.float(),
             f"{split}/ppl": torch.exp(nll.clamp(max=50.0)).float()},
            prog_bar=True, add_dataloader_idx=False,
        )  # fmt: skip
        for k in ("loss", "nll", "tokens"):
            self._sum(f"{split}_{k}").reset()

    # -- generation -----------------------------------------------------------------------------
    def _require_pipeline(self) -> Any:
        if self.pipeline is None:
            raise RuntimeError(
                "BLEU needs the text pipeline (BPE and dictionary): train with a datamodule that "
                "has `pipeline()` (data=wmt16_en_de), or load a checkpoint that stores it"
            )
        return self.pipeline

    def translate_ids(
        self, src: Tensor, mask: Tensor | None, cfg: GenerationConfig
    ) -> list[Tensor]:
        """The best output ids (ending with `</s>`) of each source sentence."""
        nbest = beam_search(self.model, src, mask, cfg, self.special)
        return [h[0].tokens for h in nbest]

    def _bleu_update(self, batch: Batch) -> None:
        pipeline = self._require_pipeline()
        outputs = self.translate_ids(batch["inputs"], batch.get("mask"), self.val_generation)
        hyps = [pipeline.decode(o.tolist(), unk=UNK_HYP) for o in outputs]
        refs = [
            pipeline.decode(t[m].tolist(), unk=UNK_REF)
            for t, m in zip(batch["targets"], batch["target_mask"])
        ]
        self.val_bleu.update(hyps, refs)

    # -- validation -----------------------------------------------------------------------------
    def validation_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if dataloader_idx == 0:
            self._accumulate("val", batch)
        bleu_loader = 1 if self._has_bleu_loader() else 0
        if self.val_bleu_enabled and dataloader_idx == bleu_loader:
            self._bleu_update(batch)

    def _has_bleu_loader(self) -> bool:
        trainer = self._trainer
        loaders = getattr(trainer, "val_dataloaders", None) if trainer is not None else None
        return isinstance(loaders, list | tuple) and len(loaders) > 1

    def on_validation_epoch_end(self) -> None:
        self._log_losses("val")
        if self.val_bleu_enabled and self.val_bleu.update_called:
            self.log("val/bleu", self.val_bleu.compute().float(), prog_bar=True,
                     add_dataloader_idx=False)  # fmt: skip
            self.val_bleu.reset()

    # -- test -----------------------------------------------------------------------------------
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._accumulate("test", batch)
        pipeline = self._require_pipeline()
        outputs = self.translate_ids(batch["inputs"], batch.get("mask"), self.generation)
        hyps = [pipeline.decode(o.tolist()) for o in outputs]
        # fairseq-generate's references: the binarized targets, unknown words escaped.
        refs = [
            pipeline.decode(t[m].tolist(), unk="<<unk>>")
            for t, m in zip(batch["targets"], batch["target_mask"])
        ]
        self.test_bleu.update(hyps, refs)
        for i, h in zip(batch["index"].tolist(), hyps):
            self._test_outputs.append((i, h, pipeline.detokenize(h)))

    def on_test_epoch_start(self) -> None:
        self._test_outputs = []

    def on_test_epoch_end(self) -> None:
        self._log_losses("test")
        if self.test_bleu.update_called:
            self.log("test/bleu", self.test_bleu.compute().float())
            self.test_bleu.reset()
        outputs = sorted({i: (tok, detok) for part in gather_from_ranks(self._test_outputs)
                          for i, tok, detok in part}.items())  # fmt: skip
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        if not outputs or not callable(getattr(datamodule, "references", None)):
            return
        refs = datamodule.references("test")  # type: ignore[union-attr]
        hyps = [detok for _, (_, detok) in outputs]
        score, signature = sacrebleu_score(hyps, [refs[i] for i, _ in outputs])
        self._sacrebleu = {"score": score, "signature": signature, "sentences": len(hyps)}
        self.log("test/sacrebleu", float(score))
        if self.save_translations and self.global_rank == 0 and self._trainer is not None:
            self._write_translations(outputs)

    def _write_translations(self, outputs: list[tuple[int, tuple[str, str]]]) -> None:
        lang = getattr(self.pipeline, "target_lang", "txt")
        out = Path(self.trainer.default_root_dir) / "translations"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"test.hyp.{lang}").write_text("".join(d + "\n" for _, (_, d) in outputs))
        (out / f"test.hyp.tok.{lang}").write_text("".join(t + "\n" for _, (t, _) in outputs))
        log.info("test translations written to %s", out)

    def record_extras(self) -> dict[str, Any]:
        """What `metrics.json` records beside the logged metrics: the SacreBLEU signature."""
        return {"sacrebleu": dict(self._sacrebleu)} if self._sacrebleu else {}
