"""Memory planning before training: micro-batches that fit, or an early error with numbers."""

from __future__ import annotations

import hydra
import pytest
import torch

from megalab import memory
from megalab.memory import MemoryPlanError, plan_memory, probe
from megalab.train import build
from megalab.utils.run import instantiate_trainer, lightning_trainer_config

GB = 2**30


def _cfg(compose_cfg, *overrides: str):
    # A small Mega on ListOps-shaped data: 6 layers is the paper's depth, widths are tiny.
    return compose_cfg(
        "model=mega",
        "model.d_model=16",
        "model.backbone.z_dim=8",
        "model.backbone.v_dim=16",
        "model.backbone.ffn_dim=16",
        "data.max_len=256",
        "model.backbone.max_positions=256",
        "data.batch_size=16",
        "data.eval_batch_size=32",
        "trainer.accumulate_grad_batches=1",
        *overrides,
    )


def test_trainer_keys_of_megalab_are_not_passed_to_lightning(compose_cfg) -> None:
    cfg = compose_cfg("trainer.max_tokens_per_step=1000", "trainer.memory_check=false")
    assert "max_tokens_per_step" in cfg.trainer and "memory_check" in cfg.trainer
    clean = lightning_trainer_config(cfg.trainer)
    assert "max_tokens_per_step" not in clean and "memory_check" not in clean
    assert clean.max_steps == cfg.trainer.max_steps
    assert cfg.trainer.max_tokens_per_step == 1000  # the run's config keeps them
    trainer = instantiate_trainer(cfg.trainer, logger=False, callbacks=[])
    assert trainer.max_steps == cfg.trainer.max_steps


@pytest.mark.parametrize(
    "override", ["trainer.memory_check=maybe", "trainer.max_tokens_per_step=0"]
)
def test_the_config_schema_checks_the_memory_keys(compose_cfg, override: str) -> None:
    from megalab.config_schema import ConfigError, validate

    validate(compose_cfg("trainer.max_tokens_per_step=4096"))
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        validate(compose_cfg(override))


def test_the_per_example_estimate_is_linear_in_the_batch(compose_cfg) -> None:
    cfg = _cfg(compose_cfg)
    task = hydra.utils.instantiate(cfg.task)
    p1, p2, p6 = (probe(task, cfg.data, m, True, torch.device("cpu")) for m in (1, 2, 6))
    e1, e2, e6 = (probe(task, cfg.data, m, False, torch.device("cpu")) for m in (1, 2, 6))
    per_example = p2.saved - p1.saved
    assert per_example > 0
    assert p6.saved == pytest.approx(p1.saved + 5 * per_example, rel=0.02)
    assert e1.saved == 0 and e6.peak > e2.peak > e1.peak > 0


def test_plan_raises_accumulation_until_a_micro_batch_fits(compose_cfg, monkeypatch) -> None:
    cfg = _cfg(compose_cfg)
    plan = plan_memory(cfg, hydra.utils.instantiate(cfg.task))
    assert plan is not None and plan.accumulate == 1  # plenty of memory
    # Now only what 5 examples need: 16 per step -> 4 micro-batches of 4.
    budget = plan.train_peak(5)
    monkeypatch.setattr(memory, "available_bytes", lambda device: budget / memory.SAFETY)
    cfg = _cfg(compose_cfg, "data.eval_batch_size=4")
    plan = plan_memory(cfg, hydra.utils.instantiate(cfg.task))
    assert (plan.accumulate, plan.micro_batch) == (4, 4)
    assert cfg.trainer.accumulate_grad_batches == 4
    assert cfg.data.batch_size == 16  # the global batch of an optimizer step is unchanged


def test_max_tokens_per_step_picks_the_micro_batch(compose_cfg) -> None:
    cfg = _cfg(compose_cfg, "trainer.max_tokens_per_step=600")  # 2 examples of 256 tokens
    objs = build(cfg)
    assert objs["trainer"].accumulate_grad_batches == 8  # 16 = 8 x 2


def test_a_configuration_that_cannot_fit_fails_early_with_the_numbers(
    compose_cfg, monkeypatch
) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1e6)  # 1 MB
    cfg = _cfg(compose_cfg)
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(cfg, hydra.utils.instantiate(cfg.task))
    text = str(err.value)
    assert "one training example of length 256 needs about" in text
    assert "GB available on cpu" in text
    for knob in ("checkpoint_activations=true", "chunk_size=128", "bf16-mixed"):
        assert knob in text


def test_an_evaluation_batch_that_cannot_fit_names_one_that_does(compose_cfg, monkeypatch) -> None:
    cfg = _cfg(compose_cfg, "data.eval_batch_size=64")
    task = hydra.utils.instantiate(cfg.task)
    plan = plan_memory(cfg, task)
    assert plan is not None
    # Room for a training micro-batch of 1, not for evaluating 64 at once.
    budget = max(plan.train_peak(1), plan.eval_peak(16)) + 1
    assert plan.eval_peak(64) > budget
    monkeypatch.setattr(memory, "available_bytes", lambda device: budget / memory.SAFETY)
    with pytest.raises(MemoryPlanError, match=r"set data.eval_batch_size=\d+ or less"):
        plan_memory(_cfg(compose_cfg, "data.eval_batch_size=64"), task)
    # the decision rests on a measured batch larger than 2 (the largest the line puts at half
    # the budget), not only on the line through 1 and 2; nothing is probed past the budget
    sizes = []
    real_probe = memory.probe

    def recording_probe(task, data, examples, train, device, length=None):
        sizes.append((examples, train))
        return real_probe(task, data, examples, train, device, length)

    monkeypatch.setattr(memory, "probe", recording_probe)
    with pytest.raises(MemoryPlanError):
        plan_memory(_cfg(compose_cfg, "data.eval_batch_size=64"), task)
    measured = [e for e, train in sizes if not train and e > 2]
    assert measured and all(plan.eval_peak(e) <= budget for e in measured)


def test_memory_check_can_be_turned_off(compose_cfg, monkeypatch) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1e6)
    cfg = _cfg(compose_cfg, "trainer.memory_check=false")
    assert plan_memory(cfg, hydra.utils.instantiate(cfg.task)) is None


def test_probes_never_run_past_the_memory(compose_cfg, monkeypatch) -> None:
    """Long inputs are probed at doubling lengths: a length predicted not to fit is not run."""
    cfg = _cfg(compose_cfg, "data.max_len=2048", "model.backbone.max_positions=2048")
    task = hydra.utils.instantiate(cfg.task)
    one = probe(task, cfg.data, 1, True, torch.device("cpu"), length=512)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1.5 * one.saved / memory.SAFETY)
    lengths = []
    real_probe = memory.probe

    def recording_probe(task, data, examples, train, device, length=None):
        lengths.append(length or int(data.max_len))
        return real_probe(task, data, examples, train, device, length)

    monkeypatch.setattr(memory, "probe", recording_probe)
    with pytest.raises(MemoryPlanError, match=r"extrapolated from .* at length 512"):
        plan_memory(cfg, task)
    assert lengths == [512]
