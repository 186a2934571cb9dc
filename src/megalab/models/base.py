"""The backbone contract: what every model in `megalab.models` is to the tasks.

A backbone maps embedded inputs to features of the same width, batch-first:

    out = backbone(x, mask=None, state=None)        x (B, L, D), mask (B, L) True at real tokens
    out.y      (B, L, D) features, zero at padded positions
    out.state  what a causal model carries into the next segment (None for a stateless pass)
    out.aux    scalars the model reports (per-layer statistics, an auxiliary loss under "loss")

Attributes every backbone has:

- `d_model`: the feature width D.
- `causal`: True when the output at t depends on inputs at positions ≤ t only (decoders).
- `max_len`: the longest input (for a stream: the most tokens the model can still take), or
  None when unbounded. `check_length` raises a clear error past it.
- `check_input(x, mask, state)`: what each model's forward calls first. It refuses, with a
  message that says what was expected, features that are not (B, L, d_model) floats, a mask
  that is not a (B, L) bool tensor, a state given to a bidirectional model and an input longer
  than `max_len`.
- `initial_state(batch_size, like)`: the empty state that starts a stream (None for a model
  that keeps no state). Passing a state makes the model stream: the outputs of consecutive
  segments, each with the state the previous one returned, equal those of one pass over their
  concatenation. Without a state the pass is stateless and `out.state` is None.

Hooks other code uses, declared on `Backbone` with a default that fits a model without the
ability (override them where a model has it; nothing probes for them):

- `exact_streaming`: False when streamed outputs differ from one pass (LaMemo's look-ahead).
- `ext_len`: positions at the end of each segment kept out of the carried state (Transformer-XL's
  extended context; 0 by default); language modelling checks it against `data.ext_len`, and
  generation and long-context scoring refuse a model that has it.
- `carried_modules()`: the sub-modules that carry the state along time, for chunk parallelism
  (`megalab.parallel.chunk`); None (the default) when the model cannot run chunk-parallel.
- `refresh_norm_state(state, fresh)`: `state` with its normalisation statistics taken from
  `fresh` (Megalodon's timestep norms, `megalab.long_context`); raises by default.
- `block_class`: the class of the blocks in the model's `layers`, each one FSDP unit and
  activation-checkpointing region (`megalab.models.block_classes`); None: no such
  unit.
- `data_dependent_parameters`: True when some parameters take no part for some inputs or
  states, so DDP must look for unused parameters (`megalab.parallel.lightning`); False by
  default.

`Backbone` is the small base class the models derive from; `BackboneProtocol` is the same
contract as a structural type, for code that only calls a backbone.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor, nn


@dataclass
class BackboneOutput:
    """What a backbone returns: features `y`, the carried `state` and reported `aux` values.

    `aux` maps names to tensors: scalars (or one value per layer) that the task logs as
    `{split}/aux/{name}`, and an optional `"loss"` that the task adds to its loss.
    """

    y: Tensor
    state: Any = None
    aux: dict[str, Tensor] = field(default_factory=dict)


@runtime_checkable
class BackboneProtocol(Protocol):
    """The backbone contract as a structural type (see the module docstring)."""

    d_model: int
    causal: bool

    @property
    def max_len(self) -> int | None: ...

    def initial_state(self, batch_size: int, like: Tensor) -> Any: ...

    def __call__(
        self, x: Tensor, mask: Tensor | None = None, state: Any = None
    ) -> BackboneOutput: ...


B = TypeVar("B", bound="Backbone")


class Backbone(nn.Module):
    """Base class of megalab's backbones: the contract's attributes and hooks with their defaults.

    The config sets `d_model` and `causal`; subclasses implement `forward(x, mask, state)`
    returning a `BackboneOutput`, and override `max_len` and `initial_state` when they have a
    length limit or a streaming state, and the hooks below where they have the ability.
    """

    d_model: int
    causal: bool
    config: Any
    """The model's options (its `BackboneConfig`; None for a backbone built without one)."""

    block_class: ClassVar[type[nn.Module] | None] = None
    """The class of the blocks in `layers`: FSDP shards each block as its own unit and
    activation checkpointing recomputes it (`megalab.models.block_classes` collects
    the classes). None: the model has no such block."""

    data_dependent_parameters: bool = False
    """Whether some parameters take no part in the forward for some inputs or states (an expert
    no token reaches, a bias used only once a memory is carried): DDP then looks for unused
    parameters (`megalab.parallel.lightning`). False: every parameter gets a gradient from every
    batch."""

    causal_option: ClassVar[str] = "causal=True"
    """The option that builds the model causal, named when a bidirectional one is streamed."""

    def __init__(self, config: BackboneConfig | None = None) -> None:
        """Keep `config` (which the blocks read), its width `d_model` and its `causal`. A
        model's own constructor takes its config class, `__init__(self, config: XConfig | None
        = None)` (None: the defaults), and hands it here."""
        super().__init__()
        self.config = config
        if config is not None:
            self.d_model = config.d_model
            self.causal = config.causal

    @classmethod
    def from_config(cls: type[B], cfg: BackboneConfig) -> B:
        """Deprecated spelling of `cls(cfg)` (backbones take their config object)."""
        warnings.warn(
            f"{cls.__name__}.from_config(cfg) is deprecated: a backbone takes its config, "
            f"{cls.__name__}(cfg)",
            FutureWarning,
            stacklevel=2,
        )
        return cls(cfg)

    @property
    def exact_streaming(self) -> bool:
        """Whether streaming segment by segment gives the outputs of one pass over the stream
        (while it fits the model's memory). LaMemo's look-ahead memory, refreshed by later
        segments, is the exception."""
        return True

    @property
    def ext_len(self) -> int:
        """Positions at the end of each segment kept out of the carried state, for the next
        segment to re-read as extended context (Transformer-XL's `ext_len`; 0: none). The data
        must re-feed exactly as many (`data.ext_len`); generation and long-context scoring,
        which feed the stream without overlap, refuse a model with ext_len > 0."""
        return 0

    @property
    def max_len(self) -> int | None:
        """Longest input the model takes (None: unbounded)."""
        return None

    def initial_state(self, batch_size: int, like: Tensor) -> Any:
        """The state that starts a stream; None for a model that carries nothing."""
        return None

    def state_length(self, state: Any) -> int:
        """Tokens already consumed against `max_len` by a stream in `state` (0 by default)."""
        return 0

    def check_streamable(self) -> None:
        """Raise unless the model can carry a state from one segment to the next: a
        bidirectional model sees future tokens and keeps none."""
        if not self.causal:
            raise ValueError(
                f"a bidirectional {type(self).__name__} sees future tokens and keeps no streaming "
                f"state; build it with {self.causal_option} to stream"
            )

    def check_input(self, x: Tensor, mask: Tensor | None, state: Any = None) -> None:
        """Raise a ValueError that says what is wrong with a forward's arguments, before they
        fail deep inside a layer (or, for a mask of another dtype, silently mean something else):
        x must be (B, L, d_model) floating-point features, mask None or a (B, L) bool tensor
        True at real tokens; a state needs a causal model (`check_streamable`) and room for the
        input (`check_length`). Shapes and dtypes only: nothing is read from the device."""
        name = type(self).__name__
        if x.dim() != 3 or x.shape[-1] != self.d_model or not x.is_floating_point():
            hint = (
                ""
                if x.is_floating_point()
                else ": embed token ids first (megalab.nn.embedding.SequenceEncoder, or the "
                "task's encoder)"
            )
            raise ValueError(
                f"{name} takes features x of shape (batch, length, d_model={self.d_model}) in "
                f"a floating-point dtype; got {tuple(x.shape)} {x.dtype}{hint}"
            )
        if mask is not None and (mask.dtype != torch.bool or mask.shape != x.shape[:2]):
            hint = " (from a 0/1 attention mask: mask.bool())" if mask.dtype != torch.bool else ""
            raise ValueError(
                f"{name}'s mask is a bool tensor of shape (batch, length) = "
                f"{tuple(x.shape[:2])}, True at real tokens; got {tuple(mask.shape)} "
                f"{mask.dtype}{hint}"
            )
        if state is not None:
            self.check_streamable()
        self.check_length(x.shape[1], state)

    def check_length(self, length: int, state: Any = None) -> None:
        """Raise a ValueError that names the limit when `length` more tokens do not fit."""
        limit = self.max_len
        if limit is None:
            return
        total = length + (self.state_length(state) if state is not None else 0)
        if total > limit:
            raise ValueError(
                f"input length {total} exceeds max_len={limit} of {type(self).__name__}"
                f"{self.length_advice()}"
            )

    def length_advice(self) -> str:
        """What to change when an input is too long (appended to the length error)."""
        return ": lower `data.max_len` or raise the model's maximum length"

    def carried_modules(self) -> list[nn.Module] | None:
        """The sub-modules that carry the state along time, in order, for chunk parallelism
        (`megalab.parallel.chunk`): each is called as `m(x, mask, state, ...)` and returns
        `(y, new_state)`, and the states of the list make up the backbone's state. None (the
        default): the model cannot run chunk-parallel."""
        return None

    def refresh_norm_state(self, state: Any, fresh: Any) -> Any:
        """`state` with its normalisation statistics replaced by those of `fresh`, the state of
        a fresh pass over the recent tokens (`megalab.long_context`'s `norm_refresh_after`);
        the rest of `state` is kept. The default raises: the model carries no statistics."""
        raise ValueError(
            f"{type(self).__name__} has no timestep-norm statistics to re-estimate "
            "(`refresh_norm_state`): norm_refresh_after is for models with TimestepNorm "
            "(Megalodon); set it to null"
        )

    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, state: Any = None
    ) -> BackboneOutput:
        raise NotImplementedError


class BackboneConfig:
    """Base of the backbones' config dataclasses: every option of one model, declared once on
    its fields with `megalab.utils.options.option` (type, range, meaning). Each has at least
    `d_model`, the feature width.

    A backbone takes its config object (`Mega(MegaConfig(chunk_size=128))`, or `build()`), and
    Hydra builds the config from YAML: `model.backbone._target_` names the config class and the
    other keys are its fields, so `model.backbone.chunk_size=128` overrides one. A task given a
    config builds the backbone from it (`megalab.tasks.base.SequenceTask`).
    """

    d_model: int

    @property
    def causal(self) -> bool:
        """Whether the backbone is causal (a decoder that can stream). A config declares it as
        a `causal` field, or derives it from its own options."""
        raise NotImplementedError(f"{type(self).__name__} does not say whether it is causal")

    def build(self) -> Backbone:
        """The backbone this config describes."""
        raise NotImplementedError(f"{type(self).__name__} does not say which backbone it builds")


def built(backbone: nn.Module | BackboneConfig) -> nn.Module:
    """`backbone`, or the backbone it describes when it is a config (what Hydra builds from a
    `model.backbone` that targets a config class)."""
    return backbone.build() if isinstance(backbone, BackboneConfig) else backbone


def unwrap(module: nn.Module) -> nn.Module:
    """The module behind a `torch.compile` wrapper (attribute access needs no unwrapping)."""
    return getattr(module, "_orig_mod", module)
