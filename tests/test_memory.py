"""Memory planning before training: micro-batches that fit, or an early error with numbers."""

from __future__ import annotations

import copy
import gc
import json
import os
from pathlib import Path

import hydra
import pytest
import torch

from megalab import memory
from megalab.cli.train import build, train
from megalab.memory import MemoryPlanError, plan_memory, probe
from megalab.utils import errors
from megalab.utils.checkpointing import RunInterrupted
from megalab.utils.run import instantiate_trainer, lightning_trainer_config
from test_train import _final_weights

GB = 2**30


def _plenty(device: torch.device) -> float:
    return 16 * GB / memory.SAFETY


@pytest.fixture(autouse=True)
def plenty_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 GB free, whatever the machine's other processes take now: the plans below must not
    change with the load of a shared machine (tests that need less free memory set their own)."""
    monkeypatch.setattr(memory, "available_bytes", _plenty)


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


def test_plan_raises_accumulation_until_a_micro_batch_fits(
    compose_cfg, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(compose_cfg)
    plan = plan_memory(cfg, hydra.utils.instantiate(cfg.task), exact=True)
    assert plan is not None and plan.accumulate == 1  # plenty of memory
    # Now only what 5 examples need: 16 per step -> 4 micro-batches of 4.
    budget = plan.train_peak(5)
    monkeypatch.setattr(memory, "available_bytes", lambda device: budget / memory.SAFETY)
    cfg = _cfg(compose_cfg, "data.eval_batch_size=4")
    with caplog.at_level("WARNING", logger="megalab.memory"):
        plan = plan_memory(cfg, hydra.utils.instantiate(cfg.task))
    assert (plan.accumulate, plan.micro_batch) == (4, 4)
    assert "(trainer.accumulate_grad_batches 1 -> 4) so that a step fits in memory" in caplog.text
    assert cfg.trainer.accumulate_grad_batches == 4
    assert cfg.data.batch_size == 16  # the global batch of an optimizer step is unchanged


@pytest.mark.parametrize("chunk", ["-1", "128"])  # full attention (quadratic), chunked (linear)
def test_a_step_that_surely_fits_is_planned_from_one_short_example(
    compose_cfg, monkeypatch, chunk: str
) -> None:
    """With memory to spare the plan is two forwards of one 512-token example: m examples of
    length L need at most m x (L / 512)^2 as much (attention is quadratic in the length, the
    rest linear), and that bound fits. It does bound the step measured at full length."""
    overrides = ("data.max_len=2048", "model.backbone.max_positions=2048",
                 f"model.backbone.chunk_size={chunk}")  # fmt: skip
    cfg = _cfg(compose_cfg, *overrides)
    task = hydra.utils.instantiate(cfg.task)
    lengths = []
    real_probe = memory.probe

    def recording_probe(task, data, examples, train, device, length=None):
        lengths.append((examples, length or int(data.max_len), train))
        return real_probe(task, data, examples, train, device, length)

    monkeypatch.setattr(memory, "probe", recording_probe)
    bound = plan_memory(cfg, task)
    assert lengths == [(1, 512, True), (1, 512, False)]
    assert bound is not None and bound.bound_length == 512 and bound.accumulate == 1
    assert "bounded from one example of length 512" in bound.describe()
    monkeypatch.setattr(memory, "probe", real_probe)
    measured = plan_memory(_cfg(compose_cfg, *overrides), task, exact=True)
    assert measured is not None and measured.bound_length is None
    for m in (1, 2, 16):
        assert measured.train_peak(m) <= bound.train_peak(m)
    for e in (1, 2, 32):
        assert measured.eval_peak(e) <= bound.eval_peak(e)
    # Where the bound does not fit, the step is measured at full length: with room for the
    # measured batch of 16 but not for its bound, the batch is still taken at once.
    budget = (bound.train_peak(16) + measured.train_peak(16)) / 2
    assert measured.train_peak(16) < budget < bound.train_peak(16)
    assert measured.eval_peak(2) < budget
    monkeypatch.setattr(memory, "available_bytes", lambda device: budget / memory.SAFETY)
    tight = plan_memory(_cfg(compose_cfg, *overrides, "data.eval_batch_size=2"), task)
    assert tight is not None and tight.bound_length is None and tight.accumulate == 1


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
    plan = plan_memory(cfg, task, exact=True)
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


@pytest.mark.parametrize(
    ("trainer", "planned"),
    [
        ("default", True),
        ("cpu", True),
        ("gpu", True),
        ("ddp", True),
        ("ddp_cpu", True),
        ("slurm", True),
        ("fsdp", False),
        ("fsdp_blocks", False),
        ("model_parallel", False),
        ("model_parallel_cpu", False),
        ("chunk_parallel", False),
        ("chunk_parallel_cpu", False),
    ],
)
def test_the_plan_is_on_by_default_where_it_describes_the_step(
    compose_cfg, trainer: str, planned: bool
) -> None:
    """One process per device with the whole model (one CPU or GPU process, DDP): the plan
    runs unless turned off. Sharded parameters (FSDP, FSDP2) and sequences split between
    ranks (chunk parallelism) are not what it measures, so those trainers leave it off."""
    cfg = compose_cfg(f"trainer={trainer}", fast=False)
    assert cfg.trainer.memory_check is planned


def test_a_run_that_only_tests_is_not_planned(compose_cfg, monkeypatch) -> None:
    """`train=false` (evaluate a checkpoint) runs no training step: nothing to plan or refuse."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1e6)
    monkeypatch.setattr(memory, "plan_memory", lambda *a: pytest.fail("planned a test-only run"))
    objs = build(_cfg(compose_cfg, "train=false"))
    assert objs["memory_plan"] is None
    assert objs["trainer"].accumulate_grad_batches == 1


def test_memory_check_can_be_turned_off(compose_cfg, monkeypatch) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1e6)
    cfg = _cfg(compose_cfg, "trainer.memory_check=false")
    assert plan_memory(cfg, hydra.utils.instantiate(cfg.task)) is None


def _census() -> tuple[int, int, int]:
    """Live tensors, their storages' bytes, and live modules and megalab objects (a model copy
    or a probe's records). All objects the collector tracks would be too fragile a count in a
    long process: Python's ABC caches add weak references whenever new classes are checked."""
    gc.collect()
    objects = gc.get_objects()
    tensors = [o for o in objects if issubclass(type(o), torch.Tensor)]
    ours = sum(
        1
        for o in objects
        if isinstance(o, torch.nn.Module) or str(type(o).__module__).startswith("megalab.")
    )
    storages = {}
    for t in tensors:
        try:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except RuntimeError:  # no data (fake tensors of an earlier torch.compile test)
            continue
    return len(tensors), sum(storages.values()), ours


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_planning_again_and_again_leaves_nothing_behind(compose_cfg) -> None:
    """A process that plans many runs (a multirun, this test suite) keeps no probe behind: no
    tensor, no module or megalab object, no draw from the random state, and (Linux) no
    resident memory: the model copy and the probes' autograd graphs are freed, the heap pages
    they used are returned."""
    task = hydra.utils.instantiate(_cfg(compose_cfg).task)
    plan_memory(_cfg(compose_cfg), task, exact=True)  # once: what a first call caches
    rng = torch.get_rng_state()  # nor a random number (dropout=0.1 in the training probes)
    before = _census()
    for _ in range(4):
        plan = plan_memory(_cfg(compose_cfg), task, exact=True)  # every probe, at full length
        assert plan is not None
    assert torch.equal(torch.get_rng_state(), rng)
    del plan  # the last plan's record is the caller's
    tensors, nbytes, objects = _census()
    assert (tensors, nbytes) == before[:2]  # each plan had left 656 tensors (12.5 MB) alive
    assert objects == before[2]  # and the model copy's modules
    if not Path("/proc/self/statm").exists():
        return
    # Probes that peak at a few hundred MB (the batch of 16 at L=1024 is estimated at 0.34 GB):
    # the process's resident set afterwards is what it was (with the start-up malloc settings,
    # freed memory stayed resident: +60 MB here, 0.5 GB for the ListOps model).
    long = ("data.max_len=1024", "model.backbone.max_positions=1024")
    task = hydra.utils.instantiate(_cfg(compose_cfg, *long).task)
    rss = _rss()
    plan = plan_memory(_cfg(compose_cfg, *long), task, exact=True)
    # (about 0.2 GB of live tensors: the test process runs with glibc's default malloc, so the
    # plan's allocator overhead is 1.0 here)
    assert plan is not None and plan.train_peak(16) > 128 * 2**20
    # The heap is trimmed when the probes grew it by more than TRIM_ABOVE; below that it is kept
    # for the next steps to reuse.
    assert _rss() - rss < memory.TRIM_ABOVE + 8 * 2**20


def test_the_heap_is_trimmed_after_a_plan_that_grew_the_process(monkeypatch) -> None:
    """Trimming costs the next steps a page fault per page; it is worth it only when the
    probes grew the resident set (a heap that did not grow is reused as it is)."""
    from megalab.utils import runtime

    calls = []
    monkeypatch.setattr(runtime, "release_free_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(runtime, "resident_bytes", lambda: 3 * GB)
    cpu = torch.device("cpu")
    memory.release_memory(cpu, resident_before=3 * GB - memory.TRIM_ABOVE // 2)
    assert calls == []
    memory.release_memory(cpu, resident_before=2 * GB)
    assert calls == [1]


def test_probes_never_run_past_the_memory(compose_cfg, monkeypatch) -> None:
    """Long inputs are probed at doubling lengths: a length predicted not to fit is not run."""
    cfg = _cfg(compose_cfg, "data.max_len=2048", "model.backbone.max_positions=2048")
    task = hydra.utils.instantiate(cfg.task)
    one = probe(task, cfg.data, 1, True, torch.device("cpu"), length=512)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1.5 * one.saved / memory.SAFETY)
    lengths = []
    real_probe = memory.probe

    def recording_probe(task, data, examples, train, device, length=None):
        lengths.append((length or int(data.max_len), train))
        return real_probe(task, data, examples, train, device, length)

    monkeypatch.setattr(memory, "probe", recording_probe)
    with pytest.raises(MemoryPlanError, match=r"extrapolated from .* at length 512"):
        plan_memory(cfg, task)
    assert lengths == [(512, True), (512, False)]  # one example of 512 tokens, nothing longer


def test_a_resumed_run_keeps_its_micro_batch(compose_cfg, tmp_path, monkeypatch) -> None:
    """An accumulating run, interrupted and resumed when more memory is free, ends with the
    weights of the run trained straight: the resume takes the recorded plan, not a new one."""
    common = ("data.batch_size=8", "data.eval_batch_size=8", "trainer.limit_train_batches=4",
              "trainer.limit_val_batches=1", "test=false", "scheduler=constant",
              "scheduler.warmup_steps=2", "trainer.max_steps=3")  # fmt: skip
    cfg = compose_cfg(*common)
    full = plan_memory(cfg, hydra.utils.instantiate(cfg.task), exact=True)
    assert full is not None and full.accumulate == 1
    # Free memory for a micro-batch of 4, not 8: 2 micro-batches per optimizer step.
    budget = max(full.train_peak(4), full.eval_peak(8)) * 1.01
    assert full.train_peak(8) > budget
    tight = lambda device: budget / memory.SAFETY  # noqa: E731

    monkeypatch.setattr(memory, "available_bytes", tight)
    straight = compose_cfg(*common)
    straight.paths.output_dir = str(tmp_path / "straight")
    record = train(straight)
    assert record["memory_plan"]["accumulate_grad_batches"] == 2
    assert record["memory_plan"]["micro_batch"] == 4

    first = compose_cfg(*common, "+callbacks.stop._target_=test_train.SigtermAt",
                        "+callbacks.stop.step=2")  # fmt: skip
    first.paths.output_dir = str(tmp_path / "resumed")
    with pytest.raises(RunInterrupted):
        train(first)
    # plenty of memory now: a fresh plan would take the batch of 8 at once
    monkeypatch.setattr(memory, "available_bytes", _plenty)
    second = compose_cfg("ckpt_path=last", *common)
    second.paths.output_dir = str(tmp_path / "resumed")
    assert train(second)["memory_plan"]["accumulate_grad_batches"] == 2

    a, b = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "resumed")
    assert a["global_step"] == b["global_step"] == 3
    for name, value in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][name], value, rtol=0, atol=0, msg=name)


def test_processes_a_launcher_starts_take_its_plan(compose_cfg, tmp_path, monkeypatch) -> None:
    cfg = compose_cfg("data.batch_size=8", "trainer.max_tokens_per_step=8000")
    record = memory.plan_run(cfg, hydra.utils.instantiate(cfg.task), tmp_path)
    assert record is not None and record["accumulate_grad_batches"] == 4  # 2 x 2001 tokens
    assert json.loads((tmp_path / memory.PLAN_FILE).read_text()) == record
    assert memory.PLAN_ENV not in os.environ
    with memory.shared_with_launched_processes(record):
        # a DDP rank re-runs the command: it takes the plan without measuring anything
        monkeypatch.setattr(memory, "plan_memory", lambda *a: pytest.fail("planned again"))
        child = compose_cfg("data.batch_size=8", "trainer.max_tokens_per_step=8000")
        assert memory.plan_run(child, None, tmp_path / "child") == record  # type: ignore[arg-type]
        assert child.trainer.accumulate_grad_batches == 4
    assert memory.PLAN_ENV not in os.environ


def test_a_plan_made_for_another_batch_is_not_reused(compose_cfg, tmp_path) -> None:
    cfg = compose_cfg("data.batch_size=8", "trainer.max_tokens_per_step=8000")
    memory.plan_run(cfg, hydra.utils.instantiate(cfg.task), tmp_path)
    other = compose_cfg("data.batch_size=4", "trainer.max_tokens_per_step=8000")
    record = memory.plan_run(other, hydra.utils.instantiate(other.task), tmp_path, resume=True)
    assert record is not None and record["global_batch"] == 4
    assert record["accumulate_grad_batches"] == 2


def test_the_early_failure_is_one_message_without_a_traceback(
    compose_cfg, monkeypatch, capsys
) -> None:
    """What `megalab-train` prints (errors.reported) when a step cannot fit: the numbers and the
    knobs, once, and exit status 1; nothing is trained."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 64 * 2**20)  # 64 MB free
    cfg = compose_cfg("model=mega", "model.backbone.chunk_size=-1")
    with pytest.raises(SystemExit) as exit_, errors.reported():
        train(cfg)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.count("Error: ") == 1 and "Traceback" not in err
    assert "one training example of length 2001 needs about" in err
    assert "GB available on cpu" in err and "checkpoint_activations=true" in err
    assert not (Path(cfg.paths.output_dir) / "checkpoints").exists()


@pytest.fixture
def process_group(tmp_path: Path):
    """A one-process gloo group, as in a DDP rank: SyncBatchNorm refuses CPU inputs inside one."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_syncbatchnorm_model_is_probed_with_a_local_batchnorm(compose_cfg, process_group) -> None:
    """Path-X's Mega and SeqBoat use SyncBatchNorm: the probes still run (on the CPU, in a
    process group), on a copy whose norms are BatchNorms of the same state; the task keeps its
    SyncBatchNorms."""
    cfg = _cfg(compose_cfg, "model.backbone.norm_type=syncbatchnorm")
    task = hydra.utils.instantiate(cfg.task)
    sync = [m for m in task.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    assert sync
    with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
        probe(task, cfg.data, 1, True, torch.device("cpu"))  # what the plan ran before
    plan = plan_memory(cfg, task, exact=True)
    assert plan is not None and plan.accumulate == 1 and plan.saved_per_example > 0
    assert [m for m in task.modules() if isinstance(m, torch.nn.SyncBatchNorm)] == sync

    sync[0].running_mean.fill_(0.5)
    twin = memory.local_batchnorm(copy.deepcopy(task))
    norms = [m for m in twin.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == len(sync) and not any(isinstance(m, torch.nn.SyncBatchNorm) for m in norms)
    assert torch.equal(norms[0].running_mean, sync[0].running_mean)
    assert norms[0].eps == sync[0].eps and norms[0].momentum == sync[0].momentum


def test_the_probes_run_on_the_trainers_device(compose_cfg, monkeypatch) -> None:
    """The plan measures where the run trains: the CPU for trainer=cpu, this process's GPU
    otherwise (the first of a `devices` list, or a DDP rank's LOCAL_RANK)."""
    cfg = compose_cfg("trainer=cpu")
    assert memory._device(cfg.trainer) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert memory._device(compose_cfg("trainer=cpu").trainer) == torch.device("cpu")
    assert memory._device(compose_cfg("trainer=gpu").trainer) == torch.device("cuda", 0)
    assert memory._device(compose_cfg("trainer=default").trainer) == torch.device("cuda", 0)
    listed = compose_cfg("trainer=gpu", "trainer.devices=[3]").trainer
    assert memory._device(listed) == torch.device("cuda", 3)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert memory._device(compose_cfg("trainer=ddp").trainer) == torch.device("cuda", 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
@pytest.mark.parametrize("trainer", ["gpu", "ddp"])
def test_a_gpu_trainer_without_cuda_fails_early_in_one_message(
    compose_cfg, capsys, trainer: str
) -> None:
    """trainer=gpu on a machine without CUDA: what was asked, that no CUDA device is visible,
    and what to use instead, when the run is built (before the memory plan and Lightning)."""
    from megalab.config_schema import ConfigError

    cfg = compose_cfg(f"trainer={trainer}")
    with pytest.raises(ConfigError, match=r"trainer\.accelerator=gpu asks for a CUDA GPU"):
        build(cfg)
    cfg = compose_cfg(f"trainer={trainer}", "trainer.memory_check=false")
    with pytest.raises(SystemExit), errors.reported():
        train(cfg)
    err = capsys.readouterr().err
    assert err.count("Error: ") == 1 and "Traceback" not in err
    assert "no CUDA device is visible" in err and "trainer=cpu" in err and "trainer=default" in err
    # A layout with a CPU counterpart names it.
    assert ("trainer=ddp_cpu (trainer=ddp's layout on CPU processes)" in err) == (trainer == "ddp")


def test_an_accumulation_that_does_not_divide_the_batch_fails_early(compose_cfg) -> None:
    """The plan raises the accumulation for memory only: 2 of 7 examples is refused, as the
    data module would refuse it without the plan, not turned into 7 micro-batches of 1."""
    cfg = _cfg(compose_cfg, "data.batch_size=7", "trainer.accumulate_grad_batches=2")
    with pytest.raises(ValueError, match=r"batch_size=7 is not divisible by .* 1 x 2"):
        plan_memory(cfg, hydra.utils.instantiate(cfg.task))
    assert cfg.trainer.accumulate_grad_batches == 2


def test_the_plan_says_which_limit_raised_the_accumulation(
    compose_cfg, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(compose_cfg, "trainer.max_tokens_per_step=600")  # 2 examples of 256 tokens
    with caplog.at_level("WARNING", logger="megalab.memory"):
        plan_memory(cfg, hydra.utils.instantiate(cfg.task))
    assert "(trainer.accumulate_grad_batches 1 -> 8) so that a micro-batch holds at most " in (
        caplog.text
    )
    assert "fits in memory" not in caplog.text
