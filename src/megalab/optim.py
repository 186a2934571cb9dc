"""Optimizers with explicit parameter groups, and step-based learning-rate schedules.

Parameter groups are declared in the `optim` config as an ordered list of rules; each rule
names parameters by regular expressions (on the full parameter name) or by kind
(`bias`, `norm`, `embedding`, `1d`) and overrides optimizer settings such as `weight_decay`
or `lr`. The first rule that matches a parameter wins; unmatched parameters use the
optimizer's defaults. Schedules take the total number of optimizer steps from the trainer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

KINDS = ("bias", "norm", "embedding", "1d")
_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


def _param_kinds(model: nn.Module) -> dict[str, set[str]]:
    """The kinds (`bias`, `norm`, `embedding`, `1d`) each named parameter belongs to."""
    kinds: dict[str, set[str]] = {}
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()
        for pname, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}" if module_name else pname
            k = kinds.setdefault(name, set())
            if pname == "bias" or pname.endswith("_bias"):
                k.add("bias")
            if is_norm:
                k.add("norm")
            if isinstance(module, nn.Embedding):
                k.add("embedding")
            if p.ndim <= 1:
                k.add("1d")
    return kinds


def build_param_groups(
    model: nn.Module, rules: Sequence[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Split trainable parameters into groups by `rules` (first match wins).

    A rule is a mapping with optional `name`, `match` (list of regexes searched in the
    parameter name), `kinds` (subset of `KINDS`), and optimizer overrides (e.g.
    `weight_decay: 0.0`). Groups with no parameters are dropped; every group has a `name`.
    """
    rules = [dict(r) for r in (rules or [])]
    for i, rule in enumerate(rules):
        unknown = set(rule.get("kinds", [])) - set(KINDS)
        if unknown:
            raise ValueError(f"param group rule {i}: unknown kinds {sorted(unknown)}; use {KINDS}")
        if not rule.get("match") and not rule.get("kinds"):
            raise ValueError(f"param group rule {i} ({rule}) needs `match` or `kinds`")
    kinds = _param_kinds(model)
    buckets: list[list[nn.Parameter]] = [[] for _ in range(len(rules) + 1)]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        slot = len(rules)
        for i, rule in enumerate(rules):
            by_name = any(re.search(pat, name) for pat in rule.get("match", []) or [])
            by_kind = bool(set(rule.get("kinds", []) or []) & kinds.get(name, set()))
            if by_name or by_kind:
                slot = i
                break
        buckets[slot].append(p)
    groups = []
    for i, params in enumerate(buckets):
        if not params:
            continue
        if i == len(rules):
            groups.append({"name": "default", "params": params})
        else:
            extra = {k: v for k, v in rules[i].items() if k not in ("match", "kinds", "name")}
            groups.append({"name": rules[i].get("name", f"group{i}"), "params": params, **extra})
    return groups


def build_optimizer(
    model: nn.Module,
    optimizer: Callable[..., torch.optim.Optimizer],
    param_groups: Sequence[dict[str, Any]] | None = None,
) -> torch.optim.Optimizer:
    """Instantiate `optimizer` (a partial from Hydra) over explicit parameter groups."""
    return optimizer(build_param_groups(model, param_groups))


def _check_steps(total_steps: int, warmup_steps: int) -> None:
    if total_steps is None or total_steps <= 0 or math.isinf(total_steps):
        raise ValueError(
            f"the schedule needs a finite number of training steps, got {total_steps}; set "
            "`trainer.max_steps` or `trainer.max_epochs`"
        )
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")


def linear_warmup_decay(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int = 0,
    init_lr: float = 1e-7,
    warmup_power: float = 1.0,
    end_lr: float = 0.0,
) -> LambdaLR:
    """fairseq's `linear_decay`, the schedule of every Mega run.

    For step t <= W: lr = init + t^p (peak - init) / W^p; then lr = peak (T - t)/(T - W) down to
    `end_lr` at T; `end_lr` afterwards. `init_lr` is absolute, as in fairseq's
    `--warmup-init-lr`; the peak is each group's own lr.
    """
    _check_steps(total_steps, warmup_steps)

    def factor(peak: float) -> Callable[[int], float]:
        def f(t: int) -> float:
            if warmup_steps > 0 and t <= warmup_steps:
                lr = init_lr + (t**warmup_power) * (peak - init_lr) / (warmup_steps**warmup_power)
            elif t < total_steps:
                lr = end_lr + (peak - end_lr) * (total_steps - t) / (total_steps - warmup_steps)
            else:
                lr = end_lr
            return lr / peak if peak > 0 else 0.0

        return f

    return LambdaLR(optimizer, [factor(g["lr"]) for g in optimizer.param_groups])


def cosine_warmup(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int = 0,
    init_lr: float = 0.0,
    min_lr_ratio: float = 0.0,
    decay_steps: int | None = None,
) -> LambdaLR:
    """Linear warmup from `init_lr` to each group's lr, then cosine decay to `min_lr_ratio`.

    The cosine spans `decay_steps` after the warmup (default: the rest of training). timm's
    schedule, used by DeiT-style recipes, runs its cosine over all epochs *after* the warmup,
    so training ends before the minimum: `decay_steps = total_steps` reproduces that.
    """
    _check_steps(total_steps, warmup_steps)
    span = decay_steps if decay_steps is not None else total_steps - warmup_steps

    def factor(peak: float) -> Callable[[int], float]:
        def f(t: int) -> float:
            if warmup_steps > 0 and t < warmup_steps:
                return (init_lr + t * (peak - init_lr) / warmup_steps) / peak if peak > 0 else 0.0
            progress = min(1.0, (t - warmup_steps) / max(1, span))
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        return f

    return LambdaLR(optimizer, [factor(g["lr"]) for g in optimizer.param_groups])


def constant_warmup(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0
) -> LambdaLR:
    """Linear warmup from 0, then constant."""
    _check_steps(total_steps, warmup_steps)
    return LambdaLR(optimizer, lambda t: min(1.0, t / warmup_steps) if warmup_steps > 0 else 1.0)


def inverse_sqrt(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int = 4000,
    init_lr: float = 0.0,
) -> LambdaLR:
    """fairseq's `inverse_sqrt` (Vaswani et al. 2017): linear warmup from `init_lr` to each
    group's lr over `warmup_steps`, then lr = peak · sqrt(W / t)."""
    _check_steps(total_steps, warmup_steps)

    def factor(peak: float) -> Callable[[int], float]:
        def f(t: int) -> float:
            if peak <= 0:
                return 0.0
            if warmup_steps > 0 and t < warmup_steps:
                return (init_lr + t * (peak - init_lr) / warmup_steps) / peak
            return math.sqrt(max(warmup_steps, 1) / max(t, 1))

        return f

    return LambdaLR(optimizer, [factor(g["lr"]) for g in optimizer.param_groups])


def apply_schedule(scheduler: LambdaLR) -> list[tuple[float, float]]:
    """Set each group's lr to its schedule's value at the scheduler's step; return the
    (restored, scheduled) pairs that differed.

    A `LambdaLR` sets the lr only when it steps, so a run resumed with another step count
    (a larger `trainer.max_steps` to train longer, which stretches the schedule) would take its
    first step at the lr the checkpoint's optimizer ended with (0 at the end of a decay). When
    nothing changed the values are the ones restored, bit for bit.
    """
    t = scheduler.last_epoch
    changed = []
    lrs = [base * f(t) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        if group["lr"] != lr:
            changed.append((float(group["lr"]), float(lr)))
            group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() and the lr monitor report
    return changed


def describe_groups(optimizer: torch.optim.Optimizer) -> Iterable[str]:
    """One line per parameter group (name, size, lr, weight decay) for the run log."""
    for g in optimizer.param_groups:
        n = sum(p.numel() for p in g["params"])
        yield (
            f"param group {g.get('name', '?')}: {len(g['params'])} tensors, {n:,} parameters, "
            f"lr={g['lr']:.3g}, weight_decay={g.get('weight_decay', 0.0)}"
        )
