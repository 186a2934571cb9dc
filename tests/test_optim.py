"""Parameter groups and learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megalab.optim import (
    apply_schedule,
    build_optimizer,
    build_param_groups,
    constant_warmup,
    cosine_warmup,
    inverse_sqrt,
    linear_warmup_decay,
)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.ema_alpha = nn.Parameter(torch.zeros(4, 2))


def _names(model: nn.Module, group: dict) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_param_groups_first_matching_rule_wins() -> None:
    model = Toy()
    rules = [
        {"name": "ema", "match": [r"ema_"], "weight_decay": 0.0, "lr": 1e-3},
        {"name": "no_decay", "kinds": ["bias", "norm", "embedding"], "weight_decay": 0.0},
    ]
    groups = {g["name"]: g for g in build_param_groups(model, rules)}
    assert _names(model, groups["ema"]) == {"ema_alpha"}
    assert _names(model, groups["no_decay"]) == {
        "embedding.weight",
        "proj.bias",
        "norm.weight",
        "norm.bias",
    }
    assert _names(model, groups["default"]) == {"proj.weight"}
    assert groups["ema"]["lr"] == 1e-3 and "lr" not in groups["default"]
    # no rules: one group with everything (the fairseq setting: decay on all parameters)
    (only,) = build_param_groups(model, [])
    assert len(only["params"]) == len(list(model.parameters()))


def test_param_group_rules_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown kinds"):
        build_param_groups(Toy(), [{"kinds": ["weights"]}])
    with pytest.raises(ValueError, match="needs `match` or `kinds`"):
        build_param_groups(Toy(), [{"weight_decay": 0.0}])


def test_optimizer_uses_group_overrides() -> None:
    model = Toy()
    opt = build_optimizer(
        model,
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
        [{"name": "no_decay", "kinds": ["bias"], "weight_decay": 0.0}],
    )
    wd = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert wd == {"no_decay": 0.0, "default": 0.1}


def _lrs(scheduler_fn, steps: int, peak: float = 1.0, **kw) -> list[float]:
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=peak)
    sched = scheduler_fn(opt, **kw)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_linear_warmup_decay_is_fairseqs_linear_decay() -> None:
    peak, W, T, init = 0.01, 10, 50, 1e-7
    lrs = _lrs(linear_warmup_decay, T + 3, peak, total_steps=T, warmup_steps=W, init_lr=init)
    assert lrs[0] == pytest.approx(init)
    assert lrs[5] == pytest.approx(init + 5 * (peak - init) / W)
    assert lrs[W] == pytest.approx(peak)
    assert lrs[30] == pytest.approx(peak * (T - 30) / (T - W))
    assert lrs[T] == 0.0 and lrs[T + 2] == 0.0
    quad = _lrs(
        linear_warmup_decay,
        W + 1,
        peak,
        total_steps=T,
        warmup_steps=W,
        init_lr=init,
        warmup_power=2.0,
    )
    assert quad[5] == pytest.approx(init + 25 * (peak - init) / W**2)  # Path-X: power 2
    assert quad[W] == pytest.approx(peak)


def test_cosine_and_constant_schedules() -> None:
    lrs = _lrs(cosine_warmup, 21, 1.0, total_steps=20, warmup_steps=4, min_lr_ratio=0.1)
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(0.5) and lrs[4] == pytest.approx(1.0)
    assert lrs[12] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[20] == pytest.approx(0.1)
    # timm-style: the cosine runs its full length after warmup; training stops before its end
    timm = _lrs(cosine_warmup, 21, 1.0, total_steps=20, warmup_steps=4, decay_steps=20)
    assert timm[20] == pytest.approx(0.5 * (1 + math.cos(math.pi * 16 / 20)))
    assert _lrs(constant_warmup, 6, 2.0, total_steps=10, warmup_steps=2) == [
        0.0,
        1.0,
        2.0,
        2.0,
        2.0,
        2.0,
    ]


def test_inverse_sqrt_is_fairseqs() -> None:
    peak, W, init = 5e-4, 8, 1e-7
    lrs = _lrs(inverse_sqrt, 40, peak, total_steps=100, warmup_steps=W, init_lr=init)
    assert lrs[0] == pytest.approx(init)
    assert lrs[4] == pytest.approx(init + 4 * (peak - init) / W)
    assert lrs[W] == pytest.approx(peak)
    assert lrs[32] == pytest.approx(peak * math.sqrt(W) / math.sqrt(32))


def test_schedules_need_a_finite_horizon() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="max_steps"):
        linear_warmup_decay(opt, total_steps=float("inf"))


def test_a_resumed_schedule_sets_its_own_lr_before_the_first_step() -> None:
    """A 2-step decay ends at lr 0; resumed as an 8-step one (a larger `trainer.max_steps`),
    step 2 trains at the longer schedule's lr, not at the 0 the optimizer was saved with. With
    the same schedule the restored lr stays as it was, bit for bit."""
    w = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1e-3)
    short = linear_warmup_decay(opt, total_steps=2)
    for _ in range(2):
        opt.step()
        short.step()
    assert opt.param_groups[0]["lr"] == 0.0
    saved_opt, saved_sched = opt.state_dict(), short.state_dict()

    def resumed(total: int) -> tuple[torch.optim.Optimizer, list[tuple[float, float]]]:
        o = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-3)
        s = linear_warmup_decay(o, total_steps=total)
        o.load_state_dict(saved_opt)
        s.load_state_dict(saved_sched)
        return o, apply_schedule(s)

    longer, changed = resumed(8)
    assert changed == [(0.0, 1e-3 * 6 / 8)]
    assert longer.param_groups[0]["lr"] == 1e-3 * 6 / 8
    same, unchanged = resumed(2)
    assert unchanged == [] and same.param_groups[0]["lr"] == 0.0
