"""What every task shares: optimizer and schedule from config, throughput, loud failures.

`TaskBase` holds what any model needs; `SequenceTask` adds the encoder -> backbone path of the
tasks built on the backbone contract (the seq2seq task drives an encoder-decoder instead).
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict, cast

import lightning as L
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import Metric

from megalab.models.base import Backbone, BackboneConfig, BackboneOutput, BackboneProtocol, built
from megalab.optim import apply_schedule, build_optimizer, describe_groups
from megalab.utils.distributed import gather_from_ranks
from megalab.utils.errors import UserError

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)


def _plain(obj: Any) -> Any:
    """OmegaConf containers -> plain Python containers (partials are left alone)."""
    if isinstance(obj, DictConfig | ListConfig):
        return OmegaConf.to_container(obj, resolve=True)
    return obj


def _numpy_state_to_tensors(state: Any) -> tuple:
    """numpy's RNG state with its key array as a tensor (loadable with `weights_only=True`)."""
    name, keys, pos, has_gauss, gauss = state
    return (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))


def _numpy_state_from_tensors(state: tuple) -> tuple:
    name, keys, pos, has_gauss, gauss = state
    return (name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss)


class NonFiniteLossError(UserError, RuntimeError):
    """The training loss became NaN or infinite."""


class CheckpointMismatchError(UserError, RuntimeError):
    """A checkpoint's weights do not fit the model the config builds."""


COMPILED = "_orig_mod."
"""What torch.compile's wrapper adds to the names of the weights of a compiled module."""


def plain_name(name: str) -> str:
    """A weight's name without torch.compile's `_orig_mod.` (`backbone._orig_mod.layers.0...`
    is `backbone.layers.0...`)."""
    return name.replace(f".{COMPILED}", ".").removeprefix(COMPILED)


def weights_mismatch(own: Mapping[str, Tensor], saved: Mapping[str, Any]) -> str:
    """The names and shapes that differ between a model's state dict and a saved one ('' when
    they fit)."""

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [
        f"{k} {tuple(saved[k].shape)} here {tuple(own[k].shape)}"
        for k in own
        if k in saved and hasattr(saved[k], "shape") and saved[k].shape != own[k].shape
    ]
    found = {"missing": missing, "not in this model": unexpected, "other shapes": shapes}
    return "; ".join(f"{label}: {some(names)}" for label, names in found.items() if names)


class TaskOptions(TypedDict, total=False):
    """The keyword arguments every task passes on to `TaskBase` (`task.optim`, `task.scheduler`,
    `task.check_finite` and `task.compile` in the Hydra configs)."""

    optim: Mapping[str, Any] | None
    scheduler: Callable[..., Any] | None
    check_finite: bool
    compile: bool


def _state_dtypes(metric: Metric) -> dict[str, torch.dtype]:
    """The dtype of each floating tensor state of `metric` (a list state: its default's)."""
    dtypes: dict[str, torch.dtype] = {}
    for key, default in metric._defaults.items():
        state = getattr(metric, key)
        sample = state if isinstance(state, Tensor) else default
        if isinstance(sample, Tensor) and sample.is_floating_point():
            dtypes[key] = sample.dtype
    return dtypes


def _cast_state(state: Any, dtype: torch.dtype) -> Any:
    """A metric state (a tensor or a list of tensors) in `dtype`."""
    if isinstance(state, Tensor):
        return state.to(dtype) if state.is_floating_point() else state
    if isinstance(state, list):
        return [_cast_state(s, dtype) for s in state]
    return state


def _no_schedule_is_none(scheduler: Any) -> Callable[..., Any] | None:
    """The schedule, or None for `scheduler=none`: a config without `_target_`, which Hydra
    leaves a mapping (empty, or holding what an experiment set for its own schedule, such as
    `warmup_steps`, which `megalab-train` says it does not use)."""
    return None if isinstance(scheduler, Mapping | DictConfig) else scheduler


class TaskBase(L.LightningModule):
    """What every task shares, whatever its model: optimizer and schedule from config,
    throughput, loud failures, compilation and exact resume.

    `optim` is the `optim` config group, instantiated: `optimizer` (a partial taking parameter
    groups) and `param_groups` (rules, see `megalab.optim`). `scheduler` is a partial taking
    `(optimizer, total_steps)`; total steps come from the trainer (None, or the `none` group's
    config: the optimizer's learning rate throughout). `check_finite` stops training
    at a NaN or infinite loss. `compile` runs the submodule named by `compile_target` through
    `torch.compile` for training.
    """

    #: The attribute holding the module `compile=True` compiles (set by each kind of task).
    compile_target: ClassVar[str | None] = None

    def __init__(
        self,
        optim: Mapping[str, Any] | None = None,
        scheduler: Callable[..., Any] | None = None,
        check_finite: bool = True,
        compile: bool = False,
    ) -> None:
        super().__init__()
        if compile and self.compile_target is None:
            raise ValueError(f"{type(self).__name__} has no module to compile (compile_target)")
        self.optim_cfg = optim
        self.scheduler_fn = _no_schedule_is_none(scheduler)
        self.check_finite = check_finite
        # Not `self.compile`: that would shadow LightningModule.compile (nn.Module.compile).
        self.compile_for_fit = compile
        self._t_last: float | None = None
        self._pending_metric_states: dict[str, Any] | None = None
        # The training step of the last checkpoint loaded (a test-only run records it).
        self.checkpoint_step: int | None = None

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> TaskBase:
        """Move and cast as `nn.Module` does, but leave the dtype of every metric's state as it
        was made (float32, or float64 for the language models' sums).

        Lightning's `bf16-true` and `16-true` precisions cast the whole module with
        `.to(dtype)`, which torchmetrics lets through to its states (it guards only `.half()`
        and the like): losses, perplexities and example counts would then accumulate in 16 bits,
        where 256 + 1 == 256. Only the states' device follows `fn`.
        """
        metrics = [m for m in self.modules() if isinstance(m, Metric)]
        kept = [(m, m._dtype, _state_dtypes(m)) for m in metrics]
        out = super()._apply(fn, recurse)
        for metric, dtype, states in kept:
            metric._dtype = dtype
            for key, state_dtype in states.items():
                metric._defaults[key] = _cast_state(metric._defaults[key], state_dtype)
                setattr(metric, key, _cast_state(getattr(metric, key), state_dtype))
        return out

    def record_extras(self) -> dict[str, Any]:
        """What a run's `metrics.json` and `eval_metrics.json` record beside the logged metrics
        (translation: the SacreBLEU signature); none by default."""
        return {}

    def setup(self, stage: str) -> None:
        if self.compile_for_fit and stage == "fit" and self.compile_target is not None:
            # torch.compile of a Module returns an OptimizedModule wrapping it.
            module = getattr(self, self.compile_target)
            setattr(self, self.compile_target, torch.compile(module))

    # -- optimisation ---------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        if self.optim_cfg is None:
            raise ValueError("no optimizer configured: set the `optim` config group")
        optim = dict(self.optim_cfg)
        # Build from the trainer's (possibly FSDP-wrapped) module when there is one.
        module = self.trainer.model if self._trainer is not None else self
        assert module is not None, "the trainer has no model"
        rules: Sequence[dict] = _plain(optim.get("param_groups")) or []
        optimizer = build_optimizer(module, optim["optimizer"], rules)
        for line in describe_groups(optimizer):
            log.info(line)
        if self.scheduler_fn is None:
            return optimizer
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else None
        if total is None:
            raise ValueError("a scheduler needs the trainer's step count: fit through a Trainer")
        scheduler = self.scheduler_fn(optimizer, total_steps=int(total))
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"},
        }

    # -- training hooks -------------------------------------------------------------------------
    def assert_finite(self, loss: Tensor) -> None:
        if self.check_finite and not torch.isfinite(loss.detach()).all():
            raise NonFiniteLossError(
                f"training loss is {loss.item()} at step {self.global_step}: lower the learning "
                "rate, enable gradient clipping (`trainer.gradient_clip_val`), use fp32/bf16 "
                "instead of fp16, or check the inputs for NaN/inf"
            )

    def log_throughput(self, tokens: int | Tensor) -> None:
        """Log real tokens per second between consecutive training steps. A count on the device
        is logged as it is, not read back here: Lightning reads the logged values once, at the
        end of the batch."""
        now = time.perf_counter()
        if self._t_last is not None:
            dt = now - self._t_last
            if dt > 0:
                rate = tokens * self.trainer.world_size / dt
                self.log("train/tokens_per_sec", rate, on_step=True, on_epoch=False)
        self._t_last = now

    def on_train_epoch_start(self) -> None:
        self._t_last = None

    def configure_gradient_clipping(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, but by norm under FSDP through the sharded root's own
        `clip_grad_norm_`: the norm of sharded gradients needs every rank's shards, so
        Lightning's FSDP precision refuses `gradient_clip_algorithm=norm`, which the papers'
        experiments set (`trainer.gradient_clip_val`)."""
        from lightning.pytorch.strategies import FSDPStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel

        by_norm = (gradient_clip_algorithm or "norm") == "norm"
        if gradient_clip_val and by_norm and isinstance(self.trainer.strategy, FSDPStrategy):
            root = self.trainer.strategy.model
            if not isinstance(root, FullyShardedDataParallel):  # not wrapped (yet)
                raise RuntimeError("FSDP gradient clipping needs the FSDP-wrapped root module")
            root.clip_grad_norm_(float(gradient_clip_val))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # -- exact resume ---------------------------------------------------------------------------
    # Every process saves its own random number generators (dropout masks, augmentation) and the
    # accumulated state of its metrics (a resumed epoch reports the same accuracy, the best
    # validation accuracy so far is kept); each process restores its own on resume.
    def _own_resume_state(self) -> dict[str, Any]:
        return {
            "rng": {
                "python": random.getstate(),
                "numpy": _numpy_state_to_tensors(np.random.get_state()),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            },
            "metrics": metric_states(self),
        }

    def _same_processes(self, ranks: list[Any], saved: str, otherwise: str) -> bool:
        """Whether per-process states saved by `len(ranks)` processes match this run's number of
        processes; if not, a warning says what is `saved` and what happens `otherwise` (when
        resuming training only: a test or an evaluation of the weights continues nothing)."""
        world = self.trainer.world_size if self._trainer is not None else 1
        if len(ranks) == world:
            return True
        fitting = self._trainer is None or self.trainer.state.fn == TrainerFn.FITTING
        if fitting:
            log.warning(
                "%s comes from %d process(es), this run has %d: %s",
                saved,
                len(ranks),
                world,
                otherwise,
            )
        return False

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["resume_states"] = {"ranks": gather_from_ranks(self._own_resume_state())}
        # The weights by their plain names, compiled or not (`compile=True` wraps a module in
        # torch.compile's `_orig_mod`): evaluation, export and fine-tuning build it uncompiled.
        state = checkpoint.get("state_dict")
        if isinstance(state, Mapping) and any(COMPILED in k for k in state):
            checkpoint["state_dict"] = {plain_name(k): v for k, v in state.items()}

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """`nn.Module.load_state_dict`, by plain names (a checkpoint of a compiled run loads
        into an uncompiled task, and the reverse); weights saved for another model configuration
        (a `ckpt_path` given to a run with other model options) fail with the names that differ,
        as one message."""
        here = {plain_name(k): k for k in self.state_dict()}  # compiled names while fitting
        state_dict = {here.get(plain_name(k), k): v for k, v in state_dict.items()}
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except RuntimeError as err:
            if "Error(s) in loading state_dict" not in str(err):
                raise
            raise CheckpointMismatchError(
                f"the checkpoint's weights do not fit the model this config builds "
                f"({weights_mismatch(self.state_dict(), state_dict)}): it was saved with other "
                "model options. Give the options of the run that wrote it (its "
                ".hydra/config.yaml), or evaluate it with `megalab-eval ckpt_path=<checkpoint>`, "
                "which reads them."
            ) from None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._pending_metric_states = None
        step = checkpoint.get("global_step")
        self.checkpoint_step = step if type(step) is int else None
        saved = checkpoint.get("resume_states")
        if saved is None and checkpoint.get("rng_states"):  # checkpoints of earlier versions
            saved = {"ranks": [{"rng": checkpoint["rng_states"], "metrics": {}}]}
        if not saved:
            return
        ranks = saved["ranks"]
        rank = self.global_rank if self._trainer is not None else 0
        self._same_processes(
            ranks,
            "the checkpoint",
            "the random number generators and metric accumulations cannot continue exactly",
        )
        mine = ranks[rank] if rank < len(ranks) else ranks[0]
        states = mine["rng"]
        random.setstate(states["python"])
        np.random.set_state(_numpy_state_from_tensors(states["numpy"]))
        torch.set_rng_state(states["torch"])
        if states["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])
        self._pending_metric_states = mine.get("metrics") or None

    def on_train_start(self) -> None:
        # After the sanity check and the subclasses' resets: the restored accumulations win.
        pending = getattr(self, "_pending_metric_states", None)
        if pending:
            load_metric_states(self, pending)
        self._pending_metric_states = None
        metrics_to_device(self, self.device)
        if self.trainer.ckpt_path is not None:
            self._follow_schedule()

    def _follow_schedule(self) -> None:
        """A resumed run trains on at its own schedule's lr (see `apply_schedule`)."""
        for config in self.trainer.lr_scheduler_configs:
            if not isinstance(config.scheduler, LambdaLR):
                continue
            changed = apply_schedule(config.scheduler)
            if changed and self.trainer.is_global_zero:
                old, new = changed[0]
                log.info(
                    "the schedule differs from the checkpoint's (another trainer.max_steps?): "
                    "step %d trains at lr %.4g, not the checkpoint's %.4g",
                    self.trainer.global_step,
                    new,
                    old,
                )

    # Every metric state on the module's device before a loop updates and syncs it: torchmetrics
    # gathers states over the process group, and NCCL has no CPU backend ("No backend type
    # associated with device type cpu" at the first validation of a DDP run on GPUs).
    def on_fit_start(self) -> None:
        metrics_to_device(self, self.device)

    def on_validation_start(self) -> None:
        metrics_to_device(self, self.device)

    def on_test_start(self) -> None:
        metrics_to_device(self, self.device)


class SequenceTask(TaskBase):
    """Base of the tasks on a backbone: encoder -> backbone (optimisation as `TaskBase`).

    `backbone` is a module, or a backbone's config (what Hydra builds from `model.backbone`),
    which is built here (`megalab.models.base.BackboneConfig`).
    """

    # Any module that meets `BackboneProtocol` (checked in __init__), typed as the base class
    # that spells the contract out (initial_state, max_len, causal and nn.Module's methods).
    backbone: Backbone
    compile_target = "backbone"

    def __init__(
        self,
        encoder: nn.Module,
        backbone: nn.Module | BackboneConfig,
        **options: Unpack[TaskOptions],
    ) -> None:
        super().__init__(**options)
        backbone = built(backbone)
        if not isinstance(backbone, BackboneProtocol):
            raise TypeError(
                f"{type(backbone).__name__} is not a megalab backbone: it needs d_model, causal, "
                "max_len, initial_state and forward(x, mask, state) -> BackboneOutput "
                "(derive from megalab.models.base.Backbone)"
            )
        self.encoder = encoder
        self.backbone = cast(Backbone, backbone)

    # -- model ----------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Under Lightning's `ModelParallelStrategy` (`trainer=model_parallel`): FSDP2 with one
        unit per backbone block (`megalab.parallel.fsdp2`). Lightning may call it again (fit,
        then test): the first call shards."""
        mesh = self.device_mesh
        if mesh is None or getattr(self, "_megalab_sharded", False):
            return
        from megalab.parallel.fsdp2 import shard_blocks

        options = getattr(self.trainer.strategy, "megalab_shard_options", {})
        steps = ("training_step", "validation_step", "test_step", "predict_step")
        shard_blocks(self, mesh, forward_methods=steps, **options)
        self._megalab_sharded = True

    def encode(self, inputs: Tensor, mask: Tensor | None, state: Any = None) -> BackboneOutput:
        """Embed and run the backbone: (B, L[, C]) -> features (B, L, D), state and aux."""
        max_len = self.backbone.max_len
        if state is None and max_len is not None and inputs.shape[1] > max_len:
            raise ValueError(
                f"input length {inputs.shape[1]} exceeds the model's limit of {max_len} "
                f"({type(self.backbone).__name__}); lower `data.max_len` or raise the model's "
                "maximum length"
            )
        x = self.encoder(inputs, mask)
        return self.backbone(x, mask=mask, state=state)

    def aux_loss(self, out: BackboneOutput, split: str, batch_size: int) -> Tensor | None:
        """Log the backbone's `aux` values under `{split}/aux/...`; return its "loss" if any.

        A value with one entry per layer is logged per layer (`.../name/layer{i}`) and as its
        mean (`.../name`). Training adds the returned loss to the task's loss. Under DDP an
        evaluation's values are averaged over every process's batches (training's stay each
        process's own: a reduction per value and step would cost a collective each).
        """
        loss = out.aux.get("loss")
        for name, value in out.aux.items():
            value = value.detach().float()
            key = f"{split}/aux/{name}"
            on_step = split == "train"
            if value.dim() and value.numel() > 1:
                for i, v in enumerate(value.flatten()):
                    self.log(f"{key}/layer{i}", v, on_step=on_step, on_epoch=True,
                             batch_size=batch_size, sync_dist=not on_step)  # fmt: skip
                value = value.mean()
            self.log(key, value.reshape(()), on_step=on_step, on_epoch=True, batch_size=batch_size,
                     sync_dist=not on_step)  # fmt: skip
        return loss


# Metrics that carry over a resume: training accumulations (a resumed epoch reports the whole
# epoch) and best-so-far trackers. Evaluation metrics start every evaluation empty.
_RESUMED_METRIC = re.compile(r"(^|[._])train([._]|$)|_best$")


def metric_states(module: nn.Module) -> dict[str, dict[str, Any]]:
    """The accumulated state of the training and best-so-far metrics in `module` (cloned, CPU)."""
    out: dict[str, dict[str, Any]] = {}
    for name, metric in module.named_modules():
        if not isinstance(metric, Metric) or not name or not _RESUMED_METRIC.search(name):
            continue
        state: dict[str, Any] = {}
        for key, value in metric.metric_state.items():
            if isinstance(value, Tensor):
                state[key] = value.detach().clone().cpu()
            else:
                state[key] = [v.detach().clone().cpu() for v in value]
        out[name] = {"update_count": int(metric._update_count), "state": state}
    return out


def metrics_to_device(module: nn.Module, device: torch.device) -> list[str]:
    """Move every torchmetrics `Metric` in `module` with a state (or a default that `reset`
    restores) off `device` onto it; return their names (empty when all were there already).

    `Module.to` moves metric states with the module, but a state set or created afterwards
    (restored from a checkpoint, a tensor made without a device) stays where it was made.
    """
    moved = []
    for name, metric in module.named_modules():
        if not isinstance(metric, Metric):
            continue
        tensors = [*metric.metric_state.values(), *metric._defaults.values()]
        flat = [t for v in tensors for t in (v if isinstance(v, list) else [v])]
        if any(isinstance(t, Tensor) and t.device != device for t in flat):
            metric.to(device)
            moved.append(name)
    return moved


def load_metric_states(module: nn.Module, saved: Mapping[str, Mapping[str, Any]]) -> None:
    """Put accumulated metric states (from `metric_states`) back into `module`'s metrics."""
    metrics = {n: m for n, m in module.named_modules() if isinstance(m, Metric)}
    for name, entry in saved.items():
        metric = metrics.get(name)
        if metric is None:
            log.warning("the checkpoint has the state of a metric %r this task does not have", name)
            continue
        device = metric.device
        for key, value in entry["state"].items():
            if isinstance(value, Tensor):
                setattr(metric, key, value.to(device))
            else:
                setattr(metric, key, [v.to(device) for v in value])
        metric._update_count = int(entry["update_count"])
        metric._computed = None
