"""How much memory a configuration needs, before it trains: micro-batches that fit, or a clear no.

`plan_memory(cfg, task)` runs in `megalab-train` after the model is built and before the trainer:

0. It runs one example of at most 512 tokens, with and without autograd. Memory grows at most
   quadratically in the length and at most linearly in the batch, so m × (L / 512)² times what
   that example needs bounds a step of m examples of length L. Where the bound fits (step 2's
   budget) at the config's micro-batch and evaluation batch, the step surely fits: the bound is
   the plan, and the steps below are skipped (a fraction of a second for most configurations).
1. Otherwise it measures the model on a synthetic batch at the data's longest length
   (`data.max_len`), of 1 and of 2 examples: a training forward with autograd's saved tensors
   counted (the activations the backward keeps; unique storages, parameters excluded), and an
   evaluation forward without autograd with the peak of the live tensors it creates (its
   working set, which the backward also needs on top of the saved activations). Memory grows
   linearly in the batch, so the two sizes give the bytes per example and the fixed part. The
   probes run on a copy of the task, on the device the run trains on (`trainer.accelerator`),
   with its SyncBatchNorms as BatchNorms (`local_batchnorm`). When a step comes near the
   budget, the working set is also measured at a larger batch (at most `PROBE_TOKENS` tokens,
   so the plan costs seconds, not steps) and the line is drawn through it: a blockwise
   attention's blocks stop growing with the batch.
2. It estimates the peak of a step at micro-batch m (the parameters exist already):
       train(m) = parameters × (4 + 8 bytes: gradients, Adam's two moments) + saved(m) + work(m)
       eval(e)  = work(e)
   and compares it with the memory the process may still take: on CPU the system's
   `MemAvailable` (or the cgroup limit) shared by the local processes, on CUDA the device's
   free memory, times `SAFETY` (0.85).
3. `data.batch_size` stays the global batch of an optimizer step. The micro-batch each process
   runs is `batch_size / (world_size × accumulate_grad_batches)`; the plan raises
   `accumulate_grad_batches` (never lowers it; the one asked for must divide the per-process
   batch) to the smallest divisor of the per-process batch whose micro-batch fits, or whose
   tokens stay within `trainer.max_tokens_per_step` when that is set (micro-batch ×
   `data.max_len` ≤ it). When even one example cannot fit it fails with the numbers and the
   settings that change them; likewise for the evaluation batch.

`trainer.max_tokens_per_step` and `trainer.memory_check` (default true; false skips the probes)
are megalab's keys in the `trainer` group: `megalab.utils.run.instantiate_trainer`, which every
entry point builds its trainer with, removes them before Lightning sees the config. The plan
describes one process holding the whole model and whole sequences (one CPU or GPU process,
DDP), so the sharded trainers (`fsdp`, `fsdp_blocks`, `model_parallel[_cpu]`) and the
chunk-parallel ones turn it off. BatchNorm models see their batch statistics per micro-batch
when the plan accumulates: the log says so.

Nothing of the probes outlives the plan: the model copy and the probes' graphs are freed, and
the heap pages they grew the process by go back to the system (`release_memory`), so a
process that plans many runs (a Hydra multirun, the test suite) does not grow.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from megalab.memory_probe import Probe, probe
from megalab.memory_probe import _loss as _loss
from megalab.memory_probe import synthetic_batch as synthetic_batch
from megalab.utils.errors import UserError

log = logging.getLogger(__name__)

SAFETY = 0.85
# The largest batch the plan measures, in tokens: beyond it the working set is extrapolated.
PROBE_TOKENS = 16384
# Peak RSS over live tensors with the start-up malloc settings (allocator_overhead).
CPU_TUNED_MALLOC_OVERHEAD = 1.45
# Bytes per parameter in training: fp32 weight, gradient and Adam's two moments.
TRAIN_BYTES_PER_PARAM = 16
# Resident growth over a plan above which the heap is trimmed afterwards (`release_memory`).
TRIM_ABOVE = 32 * 2**20
GB = 2**30


class MemoryPlanError(UserError, RuntimeError):
    """The configuration cannot fit in the memory available, even one example at a time."""


# -- budget ------------------------------------------------------------------------------------
def available_bytes(device: torch.device) -> int:
    """Memory this process may still allocate: CUDA free memory, or MemAvailable / cgroup."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            avail = min(avail or 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    if avail is None:  # not Linux: assume the physical memory is free
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return avail


def allocator_overhead(device: torch.device) -> float:
    """Resident bytes per byte of live tensors at the peak of a step. On CPU with the start-up
    malloc settings (`megalab.utils.runtime`: freed blocks are kept, not returned), peak RSS ran
    25-45% above glibc's defaults on a Mega layer's step: the plan counts 45%."""
    if device.type != "cpu":
        return 1.0  # the CUDA caching allocator's free memory is what `available_bytes` reads
    from megalab.utils.runtime import settings

    return (
        CPU_TUNED_MALLOC_OVERHEAD if str(settings().get("malloc", "")).startswith("tuned") else 1.0
    )


# -- the plan ---------------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    """The estimate behind a run's micro-batch (bytes, per process)."""

    device: str
    max_len: int
    per_process_batch: int
    accumulate: int
    micro_batch: int
    budget: float
    params: int
    optimizer_bytes: float  # gradients and Adam moments (the weights exist already)
    saved_per_example: float
    saved_fixed: float
    work_per_example: float
    work_fixed: float
    eval_batch: int
    measured_work: dict[int, float]  # working set measured at these batch sizes
    overhead: float = 1.0  # resident memory per byte of live tensors (the allocator's share)
    # Set when the plan is the bound from one example of this length (`_measure`), not measured
    bound_length: int | None = None

    def work(self, m: int) -> float:
        """Peak live bytes of a forward of m examples: measured, else the line (module docs)."""
        return self.measured_work.get(m, self.work_fixed + m * self.work_per_example)

    def train_peak(self, m: int) -> float:
        live = self.optimizer_bytes + self.saved_fixed + m * self.saved_per_example + self.work(m)
        return self.overhead * live

    def eval_peak(self, e: int) -> float:
        return self.overhead * self.work(e)

    def record(self, world_size: int, precision: str) -> dict[str, Any]:
        """What a run records of its plan (`memory_plan.json`, `metrics.json`)."""
        return {
            "global_batch": self.per_process_batch * world_size,
            "world_size": world_size,
            "max_len": self.max_len,
            "precision": precision,
            "accumulate_grad_batches": self.accumulate,
            "micro_batch": self.micro_batch,
            "estimated_train_peak_gb": round(self.train_peak(self.micro_batch) / GB, 3),
            "estimated_eval_peak_gb": round(self.eval_peak(self.eval_batch) / GB, 3),
            "saved_mb_per_example": round(self.saved_per_example / 2**20, 1),
            "available_gb": round(self.budget / GB, 3),
            "device": self.device,
            "bound_from_length": self.bound_length,
        }

    def describe(self) -> str:
        kept = f"{self.saved_per_example / 2**20:,.0f} MB kept per example"
        if self.bound_length is not None:
            kept = f"at most, bounded from one example of length {self.bound_length}"
        return (
            f"micro-batch {self.micro_batch} x {self.accumulate} accumulation = "
            f"{self.per_process_batch} per process at L={self.max_len}: estimated peak "
            f"{self.train_peak(self.micro_batch) / GB:.2f} GB training ({kept}), "
            f"{self.eval_peak(self.eval_batch) / GB:.2f} GB evaluating {self.eval_batch}, of "
            f"{self.budget / GB:.2f} GB available ({self.device})"
        )


def _world(trainer: DictConfig) -> tuple[int, int]:
    """(processes in total, processes on this machine) from the trainer config."""
    devices = trainer.get("devices", 1)
    nodes = int(trainer.get("num_nodes", 1) or 1)
    accel = str(trainer.get("accelerator", "auto"))
    if isinstance(devices, int) and devices > 0:
        local = devices
    elif isinstance(devices, list | tuple) or OmegaConf.is_list(devices):
        local = len(devices)
    elif accel in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        local = torch.cuda.device_count()
    else:
        local = 1
    return local * nodes, local


def _device(trainer: DictConfig) -> torch.device:
    """The device this process will train on, where the probes run: the trainer's accelerator
    (a GPU asked for without CUDA fails here, before any probe), on a GPU this process's one (the
    first of a `devices` list, or the DDP rank's `LOCAL_RANK`)."""
    from megalab.utils.run import check_accelerator

    check_accelerator(trainer)
    accel = str(trainer.get("accelerator", "auto"))
    if accel in ("gpu", "cuda") or (accel == "auto" and torch.cuda.is_available()):
        devices = trainer.get("devices", 1)
        if isinstance(devices, list | tuple) or OmegaConf.is_list(devices):
            return torch.device("cuda", int(devices[int(os.environ.get("LOCAL_RANK", 0))]))
        if "LOCAL_RANK" in os.environ:
            return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_batchnorm(module: nn.Module) -> nn.Module:
    """`module` with every SyncBatchNorm replaced by a BatchNorm of the same state, in place.

    For the probes' copy of the task: one process measures one process's step, whose batch
    statistics and memory are those of a BatchNorm; a SyncBatchNorm raises on the CPU once a
    process group exists ("expected input tensor to be on GPU") and would try to synchronise
    with ranks that do not run the probe.
    """
    for name, child in list(module.named_children()):
        if isinstance(child, nn.SyncBatchNorm):
            bn = nn.BatchNorm1d(
                child.num_features,
                eps=child.eps,
                momentum=child.momentum,
                affine=child.affine,
                track_running_stats=child.track_running_stats,
            )
            bn.load_state_dict(child.state_dict())
            bn.train(child.training)
            setattr(module, name, bn)  # on the CPU: the copy moves to the device next
        else:
            local_batchnorm(child)
    return module


def _lengths(L: int) -> list[int]:
    """The lengths a long input is probed at: L halved until at most 512, shortest first."""
    lengths = [L]
    while lengths[-1] > 512:
        lengths.append(-(-lengths[-1] // 2))
    return lengths[::-1]


def _one_example(
    model: nn.Module,
    data: Any,
    L: int,
    device: torch.device,
    budget: float,
    first: Probe | None = None,
) -> Probe:
    """The training probe of one example at length L, reached by doubling the length from 512
    so that no probe runs out of memory: each length is tried only if the growth seen so far
    (at first the quadratic worst case) says it fits, and the lengths between are skipped once
    it says that L fits. Fails early when it does not. `first`: the probe at the shortest
    length, when it was run already."""
    lengths = _lengths(L)
    last: tuple[int, Probe] | None = None
    exponent = 2.0  # attention: memory quadratic in the length, until measured
    for length in lengths:
        if last is None and first is not None:
            last = (length, first)
            if length == L:
                break
            continue
        if last is not None:
            if length < L and last[1].saved * (L / last[0]) ** exponent <= budget:
                continue
            predicted = last[1].saved * (length / last[0]) ** exponent
            if predicted > budget:
                full = last[1].saved * (L / last[0]) ** exponent
                raise MemoryPlanError(
                    f"one training example of length {L} needs about {full / GB:.2f} GB of "
                    f"activations (extrapolated from {last[1].saved / GB:.2f} GB at length "
                    f"{last[0]}), more than the {budget / GB:.2f} GB available on {device}. "
                    + _ADVICE
                )
        probe_ = probe(model, data, 1, True, device, length)
        if last is not None and last[1].saved > 0 and probe_.saved > last[1].saved:
            exponent = min(2.0, max(1.0, math.log(probe_.saved / last[1].saved, length / last[0])))
        last = (length, probe_)
    assert last is not None
    return last[1]


def _micro_batch(per_process: int, accumulate: int, max_tokens: int | None, L: int) -> int:
    """The micro-batch the config asks for: its accumulation, raised (as the plan does) until
    the micro-batch holds at most `trainer.max_tokens_per_step` tokens, when that is set."""
    for acc in range(max(1, accumulate), per_process + 1):
        m = per_process // acc
        if per_process % acc == 0 and not (max_tokens and m > 1 and m * L > int(max_tokens)):
            return m
    return 1


_ADVICE = (
    "Options: model.backbone.checkpoint_activations=true (keeps one tensor per layer), a "
    "chunked attention (model.backbone.chunk_size=128), trainer.precision=bf16-mixed, shorter "
    "inputs (data.max_len), or a machine with more memory (trainer.memory_check=false skips "
    "this check)"
)


def _measure(
    twin: nn.Module,
    trainer: DictConfig,
    data: Any,
    device: torch.device,
    budget: float,
    per_process: int,
    accumulate: int,
    eval_batch: int,
    exact: bool,
) -> MemoryPlan:
    """Probe the model copy `twin` (module docs, step 1) at the trainer's precision.

    First one example at the shortest probe length l (at most 512): memory grows at most
    quadratically in the length (attention) and at most linearly in the batch, so
    m × (L / l)² × what it needs bounds what m examples of length L need. Where that bound
    fits the budget at the config's micro-batch and evaluation batch, the step surely fits and
    the bound is the plan (two short forwards, instead of several at full length); otherwise,
    or with `exact`, the step is measured at full length.
    """
    L = int(data.max_len)
    probing = contextlib.ExitStack()  # the probes run at the trainer's precision
    # and leave the random state as they found it: dropout in the training probes draws from
    # it, which would make a planned run's random stream differ from an unplanned or resumed
    # one's (a resumed run takes its recorded plan without probing)
    cuda = [device.index or 0] if device.type == "cuda" else []
    probing.enter_context(torch.random.fork_rng(devices=cuda, device_type="cuda"))
    precision = str(trainer.get("precision", "32-true"))
    if precision in ("bf16-true", "16-true"):
        twin.to(torch.bfloat16 if precision.startswith("bf16") else torch.float16)
    elif precision in ("bf16-mixed", "16-mixed", "bf16", "16"):
        dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
        probing.enter_context(torch.autocast(device.type, dtype=dtype))
    with probing:  # left also when a probe fails (autocast is the process's state)
        n_params = sum(p.numel() for p in twin.parameters())
        bytes_params = sum(p.numel() * p.element_size() for p in twin.parameters())
        short = _lengths(L)[0]
        t1 = probe(twin, data, 1, True, device, short)
        w1 = probe(twin, data, 1, False, device, short)
        grow = (L / short) ** 2
        bound = MemoryPlan(
            device=str(device),
            max_len=L,
            per_process_batch=per_process,
            accumulate=accumulate,
            micro_batch=per_process // max(1, accumulate),
            budget=budget,
            params=n_params,
            optimizer_bytes=float(TRAIN_BYTES_PER_PARAM * n_params - bytes_params),
            saved_per_example=grow * t1.saved,
            saved_fixed=0.0,
            work_per_example=grow * w1.peak,
            work_fixed=0.0,
            eval_batch=eval_batch,
            measured_work={},
            overhead=allocator_overhead(device),
            bound_length=short,
        )
        m = _micro_batch(per_process, accumulate, trainer.get("max_tokens_per_step"), L)
        if not exact and max(bound.train_peak(m), bound.eval_peak(eval_batch)) <= budget:
            return bound
        p1 = _one_example(twin, data, L, device, budget, first=t1)
        # A second example only where it surely fits; else all of the first counts per example.
        p2 = probe(twin, data, 2, True, device) if 2 * p1.saved <= budget / 2 else None
        e1 = w1 if short == L else probe(twin, data, 1, False, device)
        e2 = probe(twin, data, 2, False, device) if 2 * e1.peak <= budget / 2 else None
        if p2 is None:
            p2 = Probe(2, 2 * p1.saved, 0)
        if e2 is None:
            e2 = Probe(2, 0, 2 * e1.peak)
        plan = replace(
            bound,  # the same run; the per-example terms now measured at the full length
            saved_per_example=float(max(0, p2.saved - p1.saved)),
            saved_fixed=float(max(0, 2 * p1.saved - p2.saved)),
            work_per_example=float(max(0, e2.peak - e1.peak)),
            work_fixed=float(max(0, 2 * e1.peak - e2.peak)),
            measured_work={1: float(e1.peak), 2: float(e2.peak)},
            bound_length=None,
        )

        if max(plan.train_peak(plan.micro_batch), plan.eval_peak(eval_batch)) > budget / 2:
            # Close enough to the budget for the line's error to matter. The line through 1 and 2
            # examples misses what changes with the batch (a blockwise attention's blocks stop
            # growing, other terms take over): measure the largest batch of at most PROBE_TOKENS
            # tokens that the line puts at half the budget (a probe must not run out of memory,
            # nor take longer than a few steps), and draw the line through it and 2 examples.
            cap = max(2, PROBE_TOKENS // L)
            size = max((e for e in range(3, cap + 1) if plan.eval_peak(e) <= budget / 2), default=2)
            if size > 2:
                plan.measured_work[size] = float(probe(twin, data, size, False, device).peak)
                slope = (plan.measured_work[size] - plan.measured_work[2]) / (size - 2)
                plan.work_per_example = max(0.0, slope)
                plan.work_fixed = max(0.0, plan.measured_work[size] - size * plan.work_per_example)
    return plan


def release_memory(device: torch.device, resident_before: int | None = None) -> None:
    """Give freed memory back to the system: the CUDA cache, or on CPU the glibc heap's free
    pages (`megalab.utils.runtime.release_free_memory`) when the resident set grew by more than
    `TRIM_ABOVE` since `resident_before` (when given). A heap that did not grow is reused by
    the steps that follow as it is; trimming it would only make them fault its pages in again
    (once per plan, in a process that trains many runs)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    from megalab.utils.runtime import release_free_memory, resident_bytes

    now = resident_bytes()
    if resident_before is None or now is None or now - resident_before > TRIM_ABOVE:
        release_free_memory()


def plan_memory(cfg: DictConfig, task: nn.Module, exact: bool = False) -> MemoryPlan | None:
    """Estimate, pick `trainer.accumulate_grad_batches`, or fail early (module docstring).

    Writes the chosen accumulation into `cfg.trainer.accumulate_grad_batches`; returns the plan
    (None when `trainer.memory_check=false`). `exact`: measure the step at full length even
    where a bound from one short example shows that it fits (`_measure`).
    """
    trainer, data = cfg.trainer, cfg.data
    if not trainer.get("memory_check", True) or data.get("max_len") is None:
        return None
    if data.get("max_tokens"):
        # Token-budget batches (translation): a batch holds up to data.max_tokens tokens of
        # sentences of any length, not data.batch_size sequences of data.max_len; the plan's
        # per-example model does not describe them.
        log.info(
            "memory: not planned for token-budget batches (data.max_tokens=%s); lower "
            "data.max_tokens or raise trainer.accumulate_grad_batches if a step does not fit",
            data.max_tokens,
        )
        return None
    world, local = _world(trainer)
    device = _device(trainer)
    accumulate = int(trainer.get("accumulate_grad_batches") or 1)
    global_batch = int(data.batch_size)
    if global_batch % world:
        raise ValueError(
            f"data.batch_size={global_batch} is not divisible by the {world} processes; choose a "
            "global batch size that is"
        )
    per_process = global_batch // world
    if per_process % accumulate:
        # As the data module would refuse it: the plan raises an accumulation for memory only.
        raise ValueError(
            f"data.batch_size={global_batch} is not divisible by world_size x "
            f"accumulate_grad_batches = {world} x {accumulate}; choose a batch size that is, "
            "or another trainer.accumulate_grad_batches"
        )
    eval_batch = max(1, int(data.get("eval_batch_size") or global_batch) // world)
    L = int(data.max_len)
    max_tokens = trainer.get("max_tokens_per_step")

    budget = SAFETY * available_bytes(device) / (local if device.type == "cpu" else 1)
    from megalab.utils.runtime import resident_bytes

    resident = resident_bytes()
    twin = local_batchnorm(copy.deepcopy(task)).to(device)
    try:
        plan = _measure(
            twin, trainer, data, device, budget, per_process, accumulate, eval_batch, exact
        )
    finally:
        # Nothing of the probes outlives the plan: the copy goes (the probes' autograd graphs
        # went with their losses), and the memory they grew the process by goes back to the
        # system instead of staying resident for the rest of the process (the tuned malloc
        # keeps freed blocks; on CUDA the caching allocator does).
        del twin
        release_memory(device, resident)
    n_params = plan.params

    chosen = None
    for acc in range(max(1, accumulate), per_process + 1):
        m = per_process // acc
        if per_process % acc or (max_tokens and m > 1 and m * L > int(max_tokens)):
            continue
        if plan.train_peak(m) <= budget:
            chosen = acc
            break
    if chosen is None:
        raise MemoryPlanError(
            f"one training example of length {L} needs about {plan.train_peak(1) / GB:.2f} GB "
            f"(activations kept for the backward {plan.saved_per_example / GB:.2f} GB per "
            f"example, gradients and Adam moments of {n_params:,} parameters "
            f"{plan.optimizer_bytes / GB:.2f} GB), more than the {budget / GB:.2f} GB available "
            f"on {device}. " + _ADVICE
        )
    if plan.eval_peak(eval_batch) > budget:
        fitting = max(
            (e for e in range(1, eval_batch + 1) if plan.eval_peak(e) <= budget), default=0
        )
        raise MemoryPlanError(
            f"evaluating {eval_batch} examples of length {L} at once needs about "
            f"{plan.eval_peak(eval_batch) / GB:.2f} GB, more than the {budget / GB:.2f} GB "
            f"available on {device}: set data.eval_batch_size={max(1, fitting) * world} or less"
            + ("" if fitting else ", and a chunked attention (model.backbone.chunk_size=128)")
        )
    plan.accumulate, plan.micro_batch = chosen, per_process // chosen
    if chosen != accumulate:
        with open_dict(cfg):
            cfg.trainer.accumulate_grad_batches = chosen
        norm = str(OmegaConf.select(cfg, "model.backbone.norm_type", default=""))
        by_tokens = _micro_batch(per_process, accumulate, max_tokens, L) == plan.micro_batch
        log.warning(
            "memory: accumulating %d micro-batches of %d (trainer.accumulate_grad_batches %d -> "
            "%d) %s; data.batch_size=%d stays the batch of an optimizer step%s",
            chosen,
            plan.micro_batch,
            accumulate,
            chosen,
            f"so that a micro-batch holds at most trainer.max_tokens_per_step={max_tokens} tokens"
            if by_tokens
            else "so that a step fits in memory",
            global_batch,
            "; BatchNorm statistics are per micro-batch" if "batchnorm" in norm else "",
        )
    log.info("memory: %s", plan.describe())
    if not math.isfinite(plan.train_peak(plan.micro_batch)):
        raise MemoryPlanError("the memory estimate is not finite")
    return plan


# -- the plan of a run ------------------------------------------------------------------------
PLAN_FILE = "memory_plan.json"
# The launching process's plan, for the processes it starts (Lightning's DDP launcher re-runs
# the command with this environment): every rank takes the same micro-batch.
PLAN_ENV = "MEGALAB_MEMORY_PLAN"


def _matches(record: dict[str, Any], cfg: DictConfig) -> bool:
    """Whether a recorded plan was made for this run's batch, length, processes and precision."""
    world, _ = _world(cfg.trainer)
    return (
        record.get("global_batch") == int(cfg.data.batch_size)
        and record.get("max_len") == cfg.data.get("max_len")
        and record.get("world_size") == world
        and record.get("precision") == str(cfg.trainer.get("precision", "32-true"))
    )


def plan_run(
    cfg: DictConfig, task: nn.Module, run_dir: str | os.PathLike[str], resume: bool = False
) -> dict[str, Any] | None:
    """The micro-batch of a run (what `megalab.cli.train` calls before building the trainer).

    A resumed run (`resume`) takes the accumulation its `memory_plan.json` recorded, and a
    process started by a launcher takes its launcher's (`PLAN_ENV`), so that the micro-batches
    and their order stay those of the run (the free memory, and with it a fresh plan, changes
    between runs and between the processes of one). Otherwise `plan_memory` decides and its
    record is written to `<run_dir>/memory_plan.json`. Returns the record (None without a plan).
    """
    from lightning.pytorch.utilities import rank_zero_only

    path = Path(run_dir) / PLAN_FILE
    candidates = []
    if os.environ.get(PLAN_ENV):
        candidates.append(("the launching process", os.environ[PLAN_ENV]))
    if resume and cfg.trainer.get("memory_check", True) and path.is_file():
        candidates.append((str(path), path.read_text()))
    for source, text in candidates:
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            log.warning("memory: the plan in %s is not JSON; planning again", source)
            continue
        if not isinstance(record, dict) or not _matches(record, cfg):
            continue  # made for another batch, length, world or precision: plan again
        acc = int(record["accumulate_grad_batches"])
        if acc > int(cfg.trainer.get("accumulate_grad_batches") or 1):
            with open_dict(cfg):
                cfg.trainer.accumulate_grad_batches = acc
        log.info("memory: micro-batch %s x %d accumulation, planned by %s",
                 record.get("micro_batch"), acc, source)  # fmt: skip
        return record
    plan = plan_memory(cfg, task)
    if plan is None:
        return None
    world, _ = _world(cfg.trainer)
    record = plan.record(world, str(cfg.trainer.get("precision", "32-true")))
    if getattr(rank_zero_only, "rank", 0) == 0:  # set by Lightning from the environment
        from megalab.utils.run import atomic_write_text

        atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return record


@contextlib.contextmanager
def shared_with_launched_processes(record: dict[str, Any] | None) -> Iterator[None]:
    """Hand the plan to the processes started inside the block (DDP ranks), then forget it."""
    if record is None or PLAN_ENV in os.environ:
        yield
        return
    os.environ[PLAN_ENV] = json.dumps(record)
    try:
        yield
    finally:
        os.environ.pop(PLAN_ENV, None)
