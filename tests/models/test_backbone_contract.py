"""The backbone contract (`megalab.models.base`), checked once for every model config.

Every `configs/model/*.yaml` is built at a tiny size (`TINY`) in each of its variants
(`VARIANTS`, Hydra-style overrides; a config without an entry runs as it is), its parameters
perturbed away from the init, and checked in float64 for: shapes and zeroed pads; padding
invariance; causality (causal variants); streaming segment by segment and token by token equals
one pass (causal variants with a state); the state survives `pack_state`/`unpack_state` through a
checkpoint file and `select_state`; gradients (gradcheck); `torch.compile` matches eager; bf16
autocast runs and stays finite; `max_len` is enforced with a clear error; no tensor made on the
host (a factory without a device) meets the model's tensors, which on a GPU would fail
(tests/host_tensors.py), and after a first step none is copied to the device in a step or a
stream (on CUDA a copy from host memory is a stream sync); both also with the fused kernels
forced (Triton's interpreter).

The hooks other code uses, declared on `Backbone` (`megalab.models.base`), are checked against
what each model does: `block_class` is the type of every layer and activation checkpointing of
it changes nothing; `carried_modules()` are called once per forward, in order, with their part
of the state, and return the backbone's state; `data_dependent_parameters` is true exactly when
a pass leaves a parameter without a gradient; `exact_streaming` false means streaming differs
from one pass; `ext_len` positions re-read by the next segment give the one-pass outputs;
`refresh_norm_state` with a state's own statistics changes nothing (and refuses where a model
carries none).

Every model config's `model.backbone` targets a config dataclass (`BackboneConfig`), and the
backbone class it builds takes exactly that config object: options typed and documented once, on
the dataclass fields.

A new model is tested by adding its config; variants that reach its other code paths (causal,
chunked, other attention functions) go into `contract_variants/<model>.yaml`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import typing
from pathlib import Path
from typing import Any

import hydra
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from host_tensors import HostTensors, unmark
from megalab import kernels
from megalab.models import block_classes
from megalab.models.base import Backbone, BackboneConfig, BackboneOutput, BackboneProtocol
from megalab.nn.state import map_state, pack_state, select_state, unpack_state
from megalab.utils.paths import CONFIG_DIR, group_config

DT = torch.float64
# What model configs interpolate from `${data.*}`.
DATA_SPEC = {"vocab_size": 32, "d_input": None, "pad_id": 0, "max_len": 64, "num_classes": 4}
TINY = ["model.d_model=16", "model.backbone.num_layers=2"]

# Variants per model config: tests/models/contract_variants/<model>.yaml maps a variant name to
# Hydra-style overrides; a model without that file runs as its config is (variant "default").
VARIANT_DIR = Path(__file__).parent / "contract_variants"
VARIANTS: dict[str, dict[str, list[str]]] = {
    p.stem: yaml.safe_load(p.read_text()) for p in sorted(VARIANT_DIR.glob("*.yaml"))
}


def model_variants() -> list[tuple[str, str]]:
    names = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
    return [(n, v) for n in names for v in VARIANTS.get(n, {"default": []})]


CASES = model_variants()
IDS = [f"{n}-{v}" for n, v in CASES]


def build(
    name: str, variant: str, dtype: torch.dtype = DT, seed: int = 0, extra: tuple[str, ...] = ()
) -> Any:
    """The tiny backbone of a model config variant (and `extra` overrides), parameters
    perturbed, in eval mode."""
    cfg = OmegaConf.create({"model": group_config("model", name), "data": DATA_SPEC})
    for override in [*TINY, *VARIANTS.get(name, {}).get(variant, []), *extra]:
        key, value = override.split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=False)
    torch.manual_seed(seed)
    config = hydra.utils.instantiate(cfg.model.backbone)
    assert isinstance(config, BackboneConfig), f"{name}: model.backbone targets no config class"
    backbone = config.build()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in backbone.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return backbone.to(dtype).eval()


def inputs(model: Any, B: int = 2, L: int = 21, seed: int = 1, dtype: torch.dtype = DT):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, model.d_model, generator=g, dtype=dtype)


def lengths_mask(L: int, lengths: list[int]) -> torch.Tensor:
    return torch.arange(L) < torch.tensor(lengths).unsqueeze(1)


def stateful(model: Any, B: int = 2) -> bool:
    return model.causal and model.initial_state(B, next(model.parameters())) is not None


# Which variants are causal, and which of those stream with a state (decided by building them).
_BUILT = {case: build(*case) for case in CASES}
CAUSAL = [c for c in CASES if _BUILT[c].causal]
STATEFUL = [c for c in CASES if stateful(_BUILT[c])]
# Stateful variants whose streamed outputs equal one pass (a model whose carried state is
# refreshed by later segments, LaMemo's look-ahead memory, sets `exact_streaming = False`).
EXACT = [c for c in STATEFUL if _BUILT[c].exact_streaming]


# Every backbone class the model configs build.
BACKBONE_TYPES = sorted({type(m) for m in _BUILT.values()}, key=lambda cls: cls.__name__)
TYPE_IDS = [cls.__name__ for cls in BACKBONE_TYPES]


def stream(model: Any, x: torch.Tensor, mask: torch.Tensor | None, segments: list[int]):
    """Run x segment by segment from the initial state; return (outputs, final state)."""
    state = model.initial_state(x.shape[0], x)
    outs, s = [], 0
    for n in segments:
        sl = slice(s, s + n)
        out = model(x[:, sl], None if mask is None else mask[:, sl], state)
        outs.append(out.y)
        state = out.state
        s += n
    return torch.cat(outs, 1), state


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("cls", BACKBONE_TYPES, ids=TYPE_IDS)
def test_constructor_takes_its_config_object(cls: type) -> None:
    """`__init__(self, config: XConfig | None = None)`: the options are the config's fields,
    typed and documented there once (None: the defaults); the backbone keeps the object it was
    given, and the config's `build()` makes this class."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params] == ["config"]
    assert params[0].default is None
    hint = typing.get_type_hints(cls.__init__)["config"]
    (config_class,) = [a for a in typing.get_args(hint) if a is not type(None)]
    assert dataclasses.is_dataclass(config_class) and issubclass(config_class, BackboneConfig)
    tiny = next(m for m in _BUILT.values() if type(m) is cls)
    assert type(tiny.config) is config_class
    assert cls(tiny.config).config is tiny.config
    assert type(tiny.config.build()) is cls


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_shapes_attributes_and_zeroed_pads(name: str, variant: str) -> None:
    model = build(name, variant)
    assert isinstance(model, BackboneProtocol)
    assert isinstance(model.d_model, int) and isinstance(model.causal, bool)
    assert model.max_len is None or isinstance(model.max_len, int)
    x = inputs(model)
    mask = lengths_mask(21, [21, 9])
    with torch.no_grad():
        out = model(x, mask)
    assert isinstance(out, BackboneOutput)
    assert out.y.shape == x.shape and out.y.dtype == x.dtype and out.state is None
    assert torch.isfinite(out.y).all()
    assert (out.y[1, 9:] == 0).all()
    assert all(isinstance(v, torch.Tensor) for v in out.aux.values())


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_real_outputs_ignore_padding(name: str, variant: str) -> None:
    """Neither the padded values nor the amount of padding reach the real positions."""
    model = build(name, variant)
    x = inputs(model, B=1, L=19)
    with torch.no_grad():
        base = model(x, torch.ones(1, 19, dtype=torch.bool)).y
        for extra in (1, 5, 13):
            pad = 7 * torch.randn(1, extra, model.d_model, dtype=DT)
            y = model(torch.cat([x, pad], 1), lengths_mask(19 + extra, [19])).y
            close(y[:, :19], base)
            assert (y[:, 19:] == 0).all()


@pytest.mark.parametrize(("name", "variant"), CAUSAL, ids=[f"{n}-{v}" for n, v in CAUSAL])
def test_causal_outputs_ignore_later_tokens(name: str, variant: str) -> None:
    model = build(name, variant)
    x = inputs(model, L=24)
    x2 = x.clone()
    x2[:, 13:] = 5 * torch.randn_like(x2[:, 13:])
    with torch.no_grad():
        close(model(x).y[:, :13], model(x2).y[:, :13])


@pytest.mark.parametrize(("name", "variant"), EXACT, ids=[f"{n}-{v}" for n, v in EXACT])
@pytest.mark.parametrize("segments", [[5, 1, 12, 3, 7], [1] * 9 + [19]], ids=["mixed", "tokens"])
def test_streaming_equals_one_pass(name: str, variant: str, segments: list[int]) -> None:
    model = build(name, variant)
    x = inputs(model, L=28)
    for mask in (None, lengths_mask(28, [28, 23])):
        with torch.no_grad():
            full = model(x, mask).y
            y, _ = stream(model, x, mask, segments)
        close(y, full)


@pytest.mark.parametrize(("name", "variant"), STATEFUL, ids=[f"{n}-{v}" for n, v in STATEFUL])
@pytest.mark.parametrize("segments", [[5, 1, 12, 3, 7], [1] * 9 + [19]], ids=["mixed", "tokens"])
def test_streamed_outputs_ignore_later_tokens(name: str, variant: str, segments: list[int]) -> None:
    """Causality within and across segments: streamed outputs before position 13 ignore every
    later input, whatever the carried state does with it."""
    model = build(name, variant)
    x = inputs(model, L=28)
    x2 = x.clone()
    x2[:, 13:] = 5 * torch.randn_like(x2[:, 13:])
    with torch.no_grad():
        close(
            stream(model, x, None, segments)[0][:, :13],
            stream(model, x2, None, segments)[0][:, :13],
        )


@pytest.mark.parametrize(("name", "variant"), STATEFUL, ids=[f"{n}-{v}" for n, v in STATEFUL])
def test_state_survives_a_checkpoint_and_batch_selection(name: str, variant: str) -> None:
    model = build(name, variant)
    x = inputs(model, L=20)
    with torch.no_grad():
        _, state = stream(model, x, None, [11])
        buf = io.BytesIO()
        torch.save({"state": pack_state(state)}, buf)
        buf.seek(0)
        restored = unpack_state(torch.load(buf, weights_only=True)["state"])
        assert type(restored) is type(state)
        close(model(x[:, 11:], state=restored).y, model(x[:, 11:], state=state).y, tol=0)
        swapped = select_state(state, torch.tensor([1, 0]))
        close(model(x[[1, 0], 11:], state=swapped).y, model(x[:, 11:], state=state).y[[1, 0]])


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_gradcheck(name: str, variant: str) -> None:
    model = build(name, variant)
    x = inputs(model, B=1, L=10).requires_grad_(True)
    mask = lengths_mask(10, [8])
    assert torch.autograd.gradcheck(
        lambda t: model(t, mask).y, (x,), eps=1e-6, atol=1e-5, fast_mode=True
    )


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_bf16_autocast_runs_and_stays_finite(name: str, variant: str) -> None:
    model = build(name, variant, dtype=torch.float32).train()
    x = inputs(model, dtype=torch.float32)
    mask = lengths_mask(21, [21, 15])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x, mask).y
    y.float().sum().backward()
    assert torch.isfinite(y.float()).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_no_tensor_made_on_the_host_meets_the_models_tensors(name: str, variant: str) -> None:
    """What a GPU run would make on the host (a factory without a device; tests/host_tensors.py)
    never meets the model's tensors: not what the model keeps outside its parameters and buffers,
    nor what a training forward and backward or (stateful variants) a stream makes."""
    check = HostTensors()
    with check:
        model = build(name, variant, dtype=torch.float32).train()
        x, mask = inputs(model, dtype=torch.float32), lengths_mask(21, [21, 15])
        unmark(model)  # `.to(device)` moves these
        unmark((x, mask))  # and Lightning these
        model(x, mask).y.sum().backward()
        if (name, variant) in STATEFUL:
            stream(model.eval(), x, mask if model.causal else None, [5, 16])
    assert not check.meetings, "host tensors meet the model's:\n" + check.report()


def _second_training_step(
    name: str, variant: str
) -> tuple[Any, torch.Tensor, torch.Tensor, HostTensors]:
    """(model, x, mask, the check) after two training steps, the second watched by the check:
    the first makes what a model keeps between steps."""
    model = build(name, variant, dtype=torch.float32).train()
    x, mask = inputs(model, dtype=torch.float32), lengths_mask(21, [21, 15])
    model(x, mask).y.sum().backward()
    check = HostTensors()
    with check:
        model(x, mask).y.sum().backward()
    return model, x, mask, check


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_a_training_step_copies_nothing_from_the_host(name: str, variant: str) -> None:
    """On CUDA a copy from host memory to the GPU waits for its queue to drain (a stream sync),
    which a step should not do once per layer: after a first step (where tables are made and
    kept), a training forward and backward copy nothing that megalab made on the host to the
    device (`HostTensors.copies`: `.to(device)`, a host index, `copy_` from the host); nor does
    a stream after a first one."""
    model, x, mask, check = _second_training_step(name, variant)
    if (name, variant) in STATEFUL:  # and a stream (decoding: a step per token) after a first
        model.eval()
        stream(model, x, mask if model.causal else None, [5, 16])
        with check:
            stream(model, x, mask if model.causal else None, [5, 1, 15])
    assert not check.copies, "copies from the host in a step:\n" + check.report(check.copies)


@pytest.mark.skipif(
    not (kernels.triton_available() and kernels.interpreting()),
    reason="needs Triton's interpreter (TRITON_INTERPRET=1 without CUDA, set by conftest)",
)
@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_the_gpu_paths_keep_nothing_on_the_host(name: str, variant: str) -> None:
    """The two host checks above with every fused kernel forced (`megalab.kernels`, run by
    Triton's interpreter): the GPU paths' launchers make no tensor on the host that meets the
    model's, and after a first step copy nothing from the host."""
    with kernels.forced(*kernels.KERNELS):
        *_, check = _second_training_step(name, variant)
    assert not check.meetings, "host tensors meet the model's:\n" + check.report()
    assert not check.copies, "copies from the host in a step:\n" + check.report(check.copies)


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_max_len_is_enforced(name: str, variant: str) -> None:
    model = build(name, variant)
    if model.max_len is None:
        with torch.no_grad():
            model(inputs(model, B=1, L=70))  # beyond DATA_SPEC's max_len: nothing to enforce
        return
    n = model.max_len
    with torch.no_grad():
        model(inputs(model, B=1, L=n))
        with pytest.raises(ValueError, match=rf"input length {n + 1} exceeds max_len={n}"):
            model(inputs(model, B=1, L=n + 1))
        if stateful(model, B=1):
            _, state = stream(model, inputs(model, B=1, L=n - 2), None, [n - 2])
            with pytest.raises(ValueError, match=rf"input length {n + 1} exceeds max_len={n}"):
                model(inputs(model, B=1, L=3), state=state)


@pytest.mark.parametrize("cls", BACKBONE_TYPES, ids=TYPE_IDS)
def test_bad_inputs_are_refused_saying_what_was_expected(cls: type) -> None:
    """Features of the wrong shape or dtype and a mask that is not (B, L) bool fail before any
    layer, naming what the backbone takes (they failed inside a norm or a mask product, and a
    float mask in some models silently weighted the tokens)."""
    model = _BUILT[next(c for c in CASES if type(_BUILT[c]) is cls)]
    x = inputs(model, B=2, L=8)
    expected_x = rf"{cls.__name__} takes features x of shape \(batch, length, d_model=16\)"
    one_sequence, another_width, token_ids = x[0], x[..., :-1], torch.zeros(2, 8, 16).long()
    with torch.no_grad():
        for bad in (one_sequence, another_width, token_ids):
            with pytest.raises(ValueError, match=expected_x):
                model(bad)
        for mask, hint in [
            (torch.ones(2, 8), r"mask\.bool\(\)"),
            (torch.ones(2, 9, dtype=torch.bool), r"got \(2, 9\) torch\.bool$"),
        ]:
            with pytest.raises(ValueError, match=rf"mask is a bool tensor .* \(2, 8\).*{hint}"):
                model(x, mask=mask)
        assert model(x, mask=torch.ones(2, 8, dtype=torch.bool)).y.shape == x.shape


def _first_variants() -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for n, v in CASES:
        seen.setdefault(n, v)
    return list(seen.items())


def _compile_cases() -> list[Any]:
    """One aot_eager case per model config in the default suite, the rest slow. The Llama size
    presets (`llama_1_3b`, ...) build `llama`'s code at other widths: theirs are slow too."""
    first = set(_first_variants())
    cases = []
    for n, v in CASES:
        fast = (n, v) in first and not n.startswith("llama_")
        cases.append(pytest.param(n, v, "aot_eager", marks=() if fast else pytest.mark.slow))
        cases.append(pytest.param(n, v, "inductor", marks=pytest.mark.slow))
    return cases


@pytest.mark.parametrize(("name", "variant", "backend"), _compile_cases())
def test_torch_compile_matches_eager(name: str, variant: str, backend: str) -> None:
    """Graph capture and AOT autograd (`aot_eager`) for one variant per model in the default
    suite; every variant, and inductor's generated code, in the slow suite."""
    torch._dynamo.reset()
    model = build(name, variant, dtype=torch.float32).train()
    for m in model.modules():  # dropout off, but training-mode code paths on
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    x = inputs(model, dtype=torch.float32)
    mask = lengths_mask(21, [21, 15])
    ref = model(x, mask).y
    y = torch.compile(model, backend=backend)(x, mask).y
    y.sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)


# -- the declared hooks against behaviour ---------------------------------------------------------
def overrides(model: Any, name: str) -> bool:
    """Whether `model`'s class overrides the `Backbone` hook `name`."""
    return getattr(type(model), name) is not getattr(Backbone, name)


def no_dropout(model: Any) -> Any:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_declared_block_class_is_every_layer_and_a_checkpointing_unit(
    name: str, variant: str
) -> None:
    """Every layer is a `block_class` and nothing else is (FSDP units and checkpointed regions
    cover the stack, none inside another), and recomputing each block in the backward
    (activation checkpointing, as FSDP applies it) leaves outputs and gradients unchanged."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    model = no_dropout(build(name, variant)).train()
    block = type(model).block_class
    if block is None:
        return
    assert block in block_classes()
    layers = list(model.layers)
    assert layers and all(type(layer) is block for layer in layers)
    assert {id(m) for m in model.modules() if isinstance(m, block)} == {id(m) for m in layers}
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, block))
    x = inputs(model)
    mask = lengths_mask(21, [21, 15])
    grads = []
    for m in (model, wrapped):
        xi = x.clone().requires_grad_(True)
        y = m(xi, mask).y
        y.pow(2).sum().backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
        if m is model:
            ref = y.detach()
    close(y.detach(), ref)
    for a, b in zip(*grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            close(a, b)


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_data_dependent_parameters_are_declared(name: str, variant: str) -> None:
    """`data_dependent_parameters` is true exactly when a training pass leaves a parameter
    without a gradient (DDP then looks for unused ones): a stateless pass, and for a model
    with a state the second segment of a stream as well."""
    model = build(name, variant).train()
    x = inputs(model, L=20)
    model(x, lengths_mask(20, [20, 13])).y.sum().backward()
    unused = {n for n, p in model.named_parameters() if p.grad is None}
    if (name, variant) in STATEFUL:
        model.zero_grad()
        with torch.no_grad():
            _, state = stream(model, x[:, :9], None, [9])
        model(x[:, 9:], None, state).y.sum().backward()
        unused |= {n for n, p in model.named_parameters() if p.grad is None}
    assert bool(unused) == model.data_dependent_parameters, sorted(unused)


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_carried_modules_carry_the_whole_state(name: str, variant: str) -> None:
    """What chunk parallelism relies on: each carried module is a sub-module called once per
    streamed forward, in the declared order, with its part of the state (third argument or
    `state=`), returning `(y, new_state)`; their new states make up the backbone's state."""
    model = build(name, variant)
    if not model.causal or (name, variant) not in STATEFUL:
        return
    carried = model.carried_modules()
    if carried is None:
        return
    inside = {id(m) for m in model.modules()}
    assert carried and all(id(m) in inside for m in carried)
    calls: list[tuple[int, Any, Any]] = []

    def record(index: int):
        def hook(module, args, kwargs, out) -> None:
            state = args[2] if len(args) > 2 else kwargs.get("state")
            calls.append((index, state, out))

        return hook

    handles = [m.register_forward_hook(record(i), with_kwargs=True) for i, m in enumerate(carried)]
    x = inputs(model, L=9)
    try:
        with torch.no_grad():
            out = model(x, None, model.initial_state(2, x))
    finally:
        for h in handles:
            h.remove()
    assert [i for i, _, _ in calls] == list(range(len(carried)))
    returned: set[int] = set()
    for _, state, result in calls:
        assert state is not None and isinstance(result, tuple) and len(result) == 2
        map_state(result[1], lambda t: returned.add(id(t)) or t)
    in_state: set[int] = set()
    map_state(out.state, lambda t: in_state.add(id(t)) or t)
    assert in_state == returned


@pytest.mark.parametrize(("name", "variant"), STATEFUL, ids=[f"{n}-{v}" for n, v in STATEFUL])
def test_inexact_streaming_is_declared(name: str, variant: str) -> None:
    """`exact_streaming = False` only where streamed outputs really differ from one pass (the
    exact ones are `test_streaming_equals_one_pass`)."""
    model = build(name, variant)
    if model.exact_streaming:
        return
    x = inputs(model, L=28)
    with torch.no_grad():
        streamed, _ = stream(model, x, None, [5, 1, 12, 3, 7])
        assert not torch.allclose(streamed, model(x).y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("name", "variant"), STATEFUL, ids=[f"{n}-{v}" for n, v in STATEFUL])
def test_ext_len_positions_are_re_read_by_the_next_segment(name: str, variant: str) -> None:
    """`ext_len` is 0 unless the model has that option; with it set, the memory leaves the last
    ext_len positions of each segment out, and a stream whose segments re-read them (as the
    data does, `data.ext_len`) gives the outputs of one pass."""
    model = build(name, variant)
    assert model.ext_len == 0
    if "ext_len" not in {f.name for f in dataclasses.fields(model.config)}:
        return
    k = 3
    model = build(name, variant, extra=(f"model.backbone.ext_len={k}",))
    assert model.ext_len == k
    x = inputs(model, L=28)
    with torch.no_grad():
        full = model(x).y
        state, end, outs = model.initial_state(2, x), 0, []
        for stop in (8, 14, 20, 28):
            start = max(0, end - k)
            out = model(x[:, start:stop], None, state)
            outs.append(out.y[:, end - start :])
            state, end = out.state, stop
    close(torch.cat(outs, 1), full)


@pytest.mark.parametrize(("name", "variant"), STATEFUL, ids=[f"{n}-{v}" for n, v in STATEFUL])
def test_refresh_norm_state_with_its_own_statistics_changes_nothing(
    name: str, variant: str
) -> None:
    """A model that carries normalisation statistics swaps them in from a fresh state: from
    the state itself, the stream goes on unchanged. Any other model refuses with the message
    long-context scoring shows."""
    model = build(name, variant)
    x = inputs(model, L=20)
    with torch.no_grad():
        _, state = stream(model, x, None, [11])
        if not overrides(model, "refresh_norm_state"):
            with pytest.raises(ValueError, match="no timestep-norm statistics"):
                model.refresh_norm_state(state, state)
            return
        refreshed = model.refresh_norm_state(state, state)
        assert type(refreshed) is type(state)
        close(model(x[:, 11:], state=refreshed).y, model(x[:, 11:], state=state).y, tol=0)
