"""Two training steps on one CUDA GPU for one experiment of every model, with each GPU trainer.

`trainer=gpu` (one device), `trainer=ddp` (DDP over NCCL, one process) and `trainer=fsdp` (one
FSDP rank, bf16-mixed as configured) on the fixture datasets, with the fixture overrides of
tests/test_experiments.py. Marked `gpu`: skipped without CUDA (`make gpu-check` runs them, see
docs/gpu.md). What the CPU can check, that every pair composes into a one-GPU run of its
strategy, runs in the default suite.
"""

from __future__ import annotations

import pytest

from test_experiments import fixture_overrides

# One experiment per model: the smallest configuration each paper trains. LaMemo and
# Transformer-XL first: their runs failed on the H100 for a reason not yet read (docs/gpu.md),
# which a check cut at its time budget should still record.
EXPERIMENTS = {
    "lamemo": "lamemo/enwik8",
    "transformer_xl": "transformer_xl/enwik8_base",
    "mega": "mega/lra_listops",
    "seqboat": "seqboat/lra_listops",
    "megalodon": "megalodon/lra_listops",
    "llama": "llama/pg19",
    "transformer": "transformer/lra_listops",
    "translation": "mega/wmt16_en_de",
}
TRAINERS = ["gpu", "ddp", "fsdp"]
STRATEGIES = {"gpu": None, "ddp": "DDPStrategy", "fsdp": "FSDPStrategy"}


def _overrides(compose_cfg, experiment: str, trainer: str) -> list[str]:
    """The fixture's overrides, then the trainer on one GPU with the smoke run's step limits
    (the trainer group is replaced whole, so they are set again after it)."""
    return [
        *fixture_overrides(compose_cfg, experiment),
        f"trainer={trainer}",
        "trainer.devices=1",
        "trainer.max_steps=2",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "trainer.num_sanity_val_steps=0",
        "trainer.val_check_interval=null",
        "trainer.check_val_every_n_epoch=1",
    ]


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("model", list(EXPERIMENTS))
def test_every_pair_composes_into_a_one_gpu_run(compose_cfg, model: str, trainer: str) -> None:
    import hydra

    experiment = EXPERIMENTS[model]
    cfg = compose_cfg(f"experiment={experiment}", *_overrides(compose_cfg, experiment, trainer))
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.devices == 1
    assert cfg.trainer.max_steps == 2 and cfg.trainer.limit_train_batches == 2
    strategy = cfg.trainer.get("strategy")
    if STRATEGIES[trainer] is None:
        assert strategy is None
    else:
        assert type(hydra.utils.instantiate(strategy)).__name__ == STRATEGIES[trainer]


@pytest.mark.gpu
@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("model", list(EXPERIMENTS))
def test_two_training_steps_on_cuda(compose_cfg, model: str, trainer: str) -> None:
    from megalab.cli.train import train

    experiment = EXPERIMENTS[model]
    cfg = compose_cfg(f"experiment={experiment}", *_overrides(compose_cfg, experiment, trainer))
    record = train(cfg)
    assert record["global_step"] == 2
    assert record["experiment"] == experiment
    assert record["metrics"], "the run reported no metrics"


# The host-tensor check of the runs: the two models whose GPU runs failed for a reason not yet
# read (docs/gpu.md) in the default suite, the others slow.
HOST_CHECK_DEFAULT = {"lamemo", "transformer_xl"}
HOST_CHECK = [
    m if m in HOST_CHECK_DEFAULT else pytest.param(m, marks=pytest.mark.slow) for m in EXPERIMENTS
]


@pytest.mark.parametrize("model", HOST_CHECK)
def test_no_tensor_made_on_the_host_meets_the_runs_tensors(
    compose_cfg, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU, the two steps of the GPU run (with `trainer=cpu`): nothing megalab makes on
    the host in the memory plan's probes or in Lightning's hooks (steps, epoch ends, callbacks)
    meets the task's tensors (tests/host_tensors.py), as it would fail on a GPU."""
    from lightning.pytorch.trainer import call

    import megalab.memory
    from host_tensors import HostTensors, unmark
    from megalab.cli.train import train

    check = HostTensors(watch=False)
    plan_memory = megalab.memory.plan_memory

    def plan(cfg, task, exact: bool = False):
        unmark(task)  # built on the host, then moved to the GPU
        with check.region():
            return plan_memory(cfg, task, exact)

    monkeypatch.setattr(megalab.memory, "plan_memory", plan)
    for hook in ("_call_lightning_module_hook", "_call_strategy_hook", "_call_callback_hooks"):
        monkeypatch.setattr(call, hook, check.wrap(getattr(call, hook)))
    experiment = EXPERIMENTS[model]
    overrides = _overrides(compose_cfg, experiment, "gpu")
    cfg = compose_cfg(f"experiment={experiment}", *overrides, "trainer=cpu", *overrides[-8:])
    with check:
        record = train(cfg)
    assert record["global_step"] == 2
    assert not check.meetings, "host tensors meet the run's:\n" + check.report()
