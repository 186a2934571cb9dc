"""Speed and memory on one CUDA GPU: blocks at scale, LRA Text (Mega Table 2), Megalodon vs Llama.

    python benchmarks/bench_gpu.py [--sections blocks lra_text e2e] [--widths 1024 4096]
        [--lengths 4096 32768] [--tokens-per-step 65536] [--rounds 3] [--warmup 0]
        [--time-box 180] [--json benchmarks/results/bench_gpu.json] [--smoke]
    python benchmarks/bench_gpu.py --render benchmarks/results/bench_gpu.json

Sections (every case forward + backward; one optimizer step where stated):

- blocks: one Llama block, one Mega-chunk block and one Megalodon-chunk block at d = 1024 and
  d = 4096 (Llama: heads of 128, its SwiGLU width; Mega-chunk and Megalodon-chunk: z = d/4,
  v = 2d, chunk 2048, Megalodon with a SwiGLU of 2.75 d and a head per 1024 channels), causal,
  dropout 0, under bf16 autocast (float32 weights), at 4K and 32K tokens per sequence (the
  targets' lengths; `--lengths`) with `--tokens-per-step` tokens per step (a batch of
  tokens_per_step / L sequences). Mega-chunk and Megalodon-chunk run again with the attention
  kernel off (`*_nokernel`).
- lra_text: Mega's Table 2 speed on LRA Text at the paper configurations and micro-batch
  (`data.batch_size / trainer.accumulate_grad_batches` of each experiment, 4K bytes), float32:
  mega, mega_chunk, seqboat and megalodon_chunk against the SDPA transformer, one AdamW step
  (forward, backward, step) each.
- e2e: `experiment=megalodon/pg19_100m` against `experiment=llama/pg19` (~100M parameters
  each), optimizer steps per second at a short length (`--e2e-len`, default 2048) on one GPU
  under the experiments' precision (bf16 autocast), batch `--e2e-batch`: the model, its loss
  and an AdamW step on synthetic token ids (no data pipeline).

Protocol (as benchmarks/bench_megalodon.py): every case of a group (a width and length, or a
section) is built and runs one untimed step (the warm-up: a case that cannot run fails there,
alone), and `--warmup` more; then `--rounds` rounds run every case once, in an order rotated by
one case per round, so a drift in the machine falls on every case alike. A case reports its
median time per step with min-max, tokens per second from the median, the peak of allocated GPU
memory over one step (`torch.cuda.max_memory_allocated`), and the kernels one step launches
(counted with `torch.profiler`; on the CPU, under --smoke, the aten operators instead). Ratios
against a section's baseline are of tokens per second, per round (`speed_ratio`), median with
min-max.
Times are wall clock between `torch.cuda.synchronize()` calls.

A case that fails (out of memory, an error) is recorded with its error and the rest still runs;
a section starts no new case past its share of `--time-box` seconds (blocks 60%, the others 20%
each; the rest are recorded as skipped). The JSON (settings: device, driver, CUDA, torch and
Triton versions; protocol; rows; failures) is written after every group, and the Markdown
tables are printed (and written to `--md`). `--smoke`: tiny sizes on the CPU in seconds (the
default test suite runs it), so the code is known to run before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from megalab.utils.runtime import configure_runtime

RUNTIME = configure_runtime()  # before torch: allocator and OpenMP settings

import torch  # noqa: E402
from torch import nn  # noqa: E402

Step = Callable[[], None]

# Mega's Table 2 rows on LRA Text, and the baseline the ratios are taken against.
LRA_TEXT = [
    "transformer/lra_text",
    "mega/lra_text",
    "mega_chunk/lra_text",
    "seqboat/lra_text",
    "megalodon_chunk/lra_text",
]
E2E = ["llama/pg19", "megalodon/pg19_100m"]
# --smoke: both ~100M models shrunk alike (the Makefile's reproduce-megalodon-vs-llama SMOKE=1).
E2E_SMOKE = {
    "*": ["data.vocab_size=400", "model.d_model=64", "model.backbone.num_layers=2"],
    "megalodon/pg19_100m": [
        "model.backbone.z_dim=16",
        "model.backbone.v_dim=128",
        "model.backbone.ffn_dim=96",
        "model.backbone.norm_groups=2",
        "model.backbone.chunk_size=64",
    ],
    "llama/pg19": ["model.backbone.num_heads=4", "model.backbone.ffn_dim=192"],
}


# -- the machine ---------------------------------------------------------------------------------
def _driver() -> str | None:
    """The NVIDIA driver version (nvidia-smi), or None where there is none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def machine(device: torch.device) -> dict[str, Any]:
    """Device, driver, CUDA, torch and Triton versions, and the process's settings."""
    try:
        import triton  # type: ignore[import-untyped]

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "device_type": device.type,
        "memory_gb": (
            torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None
        ),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device)))
        if cuda
        else None,
        "driver": _driver() if cuda else None,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "runtime": RUNTIME,
        "kernels": os.environ.get("MEGALAB_KERNELS", "auto"),
    }


# -- measuring -----------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device` (float32 weights), or nothing for float32 (`dtype` None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def launches(step: Step, device: torch.device) -> int:
    """Kernels one step launches on CUDA (device-side kernel events of `torch.profiler`); on the
    CPU the aten operators it runs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    events = prof.events()
    if cuda:
        # Device-side kernel events (copies and fills are not kernels one launches); where a
        # profiler build lists none, the runtime's launch calls (cudaLaunchKernel and kin).
        copies = ("Memcpy", "Memset")
        kernels = [
            e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(copies)
        ]
        if kernels:
            return len(kernels)
        return sum(1 for e in events if "LaunchKernel" in e.name)
    return sum(1 for e in events if e.name.startswith("aten::"))


def peak_bytes(step: Step, device: torch.device) -> int | None:
    """The peak of allocated device memory over one step (None on the CPU)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return int(torch.cuda.max_memory_allocated(device))


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def rounds(steps: dict[str, Step], n_rounds: int, warmup: int, device: torch.device) -> dict:
    """Time every step once per round, in an order rotated by one case per round."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    sync(device)
    names = list(steps)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(n_rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            sync(device)
            t = time.perf_counter()
            steps[name]()
            sync(device)
            times[name].append(time.perf_counter() - t)
    return times


def speed_ratio(base: dict[str, Any], row: dict[str, Any]) -> dict[str, float]:
    """Tokens per second of `row` over the baseline's, per round (median, min-max). Cases may
    step different micro-batches (LRA Text: the Transformer's 50 sequences against Mega's 25 of
    an accumulated 50), so the ratio is of throughput, not of time per step."""
    scale = row["tokens_per_step"] / base["tokens_per_step"]
    return stats([b / t * scale for b, t in zip(base["times_s"], row["times_s"], strict=True)])


def release(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Group:
    """The cases of one comparison: built one by one (a failure is recorded, not raised), then
    timed together in rotated rounds, with peak memory and launches per case."""

    def __init__(self, section: str, key: dict[str, Any], device: torch.device, args: Any):
        self.section, self.key, self.device, self.args = section, key, device, args
        self.steps: dict[str, Step] = {}
        self.tokens: dict[str, int] = {}
        self.extra: dict[str, dict[str, Any]] = {}
        self.rows: list[dict[str, Any]] = []

    def add(self, kind: str, build: Callable[[], tuple[Step, int, dict[str, Any]]]) -> None:
        try:
            step, tokens, extra = build()
            step()  # one step now: a case that cannot run fails here, alone
            sync(self.device)
        except Exception as err:  # out of memory or an error: recorded, the rest runs
            self.rows.append(
                {
                    "section": self.section,
                    "kind": kind,
                    **self.key,
                    "error": f"{type(err).__name__}: {str(err)[:500]}",
                }
            )
            release(self.device)
            return
        self.steps[kind], self.tokens[kind], self.extra[kind] = step, tokens, extra

    def run(self, baseline: str | None) -> list[dict[str, Any]]:
        if self.steps:
            times = rounds(self.steps, self.args.rounds, self.args.warmup, self.device)
            for kind, step in self.steps.items():
                median = statistics.median(times[kind])
                row = {
                    "section": self.section,
                    "kind": kind,
                    **self.key,
                    **self.extra[kind],
                    "rounds": self.args.rounds,
                    "times_s": times[kind],
                    **stats(times[kind]),
                    "tokens_per_step": self.tokens[kind],
                    "tokens_per_s": self.tokens[kind] / median,
                    "peak_bytes": peak_bytes(step, self.device),
                    "launches_per_step": launches(step, self.device),
                    "launches_of": "cuda kernels" if self.device.type == "cuda" else "aten ops",
                }
                self.rows.append(row)
            base = next((r for r in self.rows if r["kind"] == baseline and "times_s" in r), None)
            for r in self.rows:
                if base is not None and "times_s" in r:
                    r["speed_ratio"] = speed_ratio(base, r)
        self.steps.clear()
        release(self.device)
        return self.rows


# -- cases ---------------------------------------------------------------------------------------
def block(kind: str, d: int, chunk: int) -> nn.Module:
    """One causal block of `kind` at width d (the module docstring's shapes)."""
    from megalab.models.llama.model import LlamaBlock, LlamaConfig
    from megalab.models.mega.model import MegaBlock, MegaConfig
    from megalab.models.megalodon.model import MegalodonBlock, MegalodonConfig

    if kind == "llama":
        return LlamaBlock(LlamaConfig(d_model=d, num_layers=1, num_heads=max(1, d // 128)))
    if kind == "mega_chunk":
        cfg = MegaConfig(
            d_model=d,
            num_layers=1,
            z_dim=d // 4,
            v_dim=2 * d,
            ffn_dim=2 * d,
            ema_dim=16,
            chunk_size=chunk,
            causal=True,
            prenorm=True,
            rel_pos_bias="rotary",
            norm_type="layernorm",
        )
        return MegaBlock(cfg)
    if kind == "megalodon_chunk":
        cfg_l = MegalodonConfig(
            d_model=d,
            num_layers=1,
            z_dim=d // 4,
            v_dim=2 * d,
            num_heads=max(1, d // 1024),
            ffn_dim=int(2.75 * d),
            swiglu=True,
            chunk_size=chunk,
            norm_groups=min(32, d // 4),
        )
        return MegalodonBlock(cfg_l)
    raise ValueError(f"unknown block {kind!r}")


# `<kind>_nokernel`: the same block with the attention kernel off (`kernels.disabled`): PyTorch's
# path, Mega's attention with its weights P materialised, Megalodon's through SDPA (docs/gpu.md,
# "The attention kernel's recomputation").
BLOCKS = [
    "llama",
    "mega_chunk",
    "mega_chunk_nokernel",
    "megalodon_chunk",
    "megalodon_chunk_nokernel",
]
NO_KERNEL = "_nokernel"


def block_case(
    kind: str,
    d: int,
    L: int,
    tokens: int,
    chunk: int,
    device: torch.device,
    dtype: torch.dtype | None,
) -> Callable[[], tuple[Step, int, dict[str, Any]]]:
    from megalab import kernels

    no_kernel = kind.endswith(NO_KERNEL)
    base = kind.removesuffix(NO_KERNEL)

    def build() -> tuple[Step, int, dict[str, Any]]:
        torch.manual_seed(0)
        module = block(base, d, chunk).to(device).train()
        B = max(1, tokens // L)
        x = torch.randn(B, L, d, device=device, requires_grad=True)

        def step() -> None:
            module.zero_grad(set_to_none=True)
            x.grad = None
            off = kernels.disabled("attention") if no_kernel else contextlib.nullcontext()
            with autocast(device, dtype), off:
                y = module(x)[0]
            y.float().square().mean().backward()

        params = sum(p.numel() for p in module.parameters())
        return step, B * L, {"B": B, "params": params}

    return build


def section_blocks(args: Any, device: torch.device, out: Callable[[list[dict]], None]) -> None:
    start = time.monotonic()
    dtype = torch.bfloat16
    box = SHARES["blocks"] * args.time_box
    for L in args.lengths:  # both widths at a length before the next length
        for d in args.widths:
            key = {"d": d, "L": L, "dtype": "bf16-autocast"}
            if time.monotonic() - start > box:
                out(
                    [{"section": "blocks", "kind": k, **key, "skipped": "time box"} for k in BLOCKS]
                )
                continue
            group = Group("blocks", key, device, args)
            for kind in BLOCKS:
                group.add(
                    kind, block_case(kind, d, L, args.tokens_per_step, args.chunk, device, dtype)
                )
            out(group.run(baseline="llama"))
            print(f"  blocks d={d} L={L} done", file=sys.stderr, flush=True)


def compose(experiment: str, overrides: list[str]) -> Any:
    """The config of `experiment` (Hydra), as `megalab-train experiment=...` composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from megalab.utils.paths import CONFIG_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(
            "train", overrides=[f"experiment={experiment}", "logger=none", *overrides]
        )


def task_case(
    experiment: str,
    overrides: list[str],
    device: torch.device,
    batch: int | None,
    length: int | None,
    dtype: torch.dtype | None,
) -> Callable[[], tuple[Step, int, dict[str, Any]]]:
    """One AdamW step of an experiment's task on a synthetic batch (its own loss)."""

    def build() -> tuple[Step, int, dict[str, Any]]:
        import hydra

        from megalab.memory import _loss, synthetic_batch

        cfg = compose(experiment, overrides)
        torch.manual_seed(0)
        task = hydra.utils.instantiate(cfg.task).to(device).train()
        accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
        B = batch or max(1, int(cfg.data.batch_size) // accumulate)
        L = int(length or cfg.data.max_len)
        data = synthetic_batch(task, cfg.data, B, device, L)
        opt = torch.optim.AdamW(task.parameters(), lr=1e-4)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast(device, dtype):
                loss = _loss(task, data)
            loss.backward()
            opt.step()

        params = sum(p.numel() for p in task.parameters())
        return step, B * L, {"B": B, "L": L, "params": params}

    return build


def section_lra_text(args: Any, device: torch.device, out: Callable[[list[dict]], None]) -> None:
    overrides = ["data.max_len=64"] if args.smoke else []
    group = Group("lra_text", {"dtype": "float32"}, device, args)
    start = time.monotonic()
    for experiment in LRA_TEXT:
        if time.monotonic() - start > SHARES["lra_text"] * args.time_box:
            group.rows.append({"section": "lra_text", "kind": experiment, "skipped": "time box"})
            continue
        batch = 1 if args.smoke else None
        group.add(experiment, task_case(experiment, overrides, device, batch, None, None))
    out(group.run(baseline="transformer/lra_text"))


def section_e2e(args: Any, device: torch.device, out: Callable[[list[dict]], None]) -> None:
    group = Group("e2e", {"dtype": "bf16-autocast"}, device, args)
    start = time.monotonic()
    for experiment in E2E:
        if time.monotonic() - start > SHARES["e2e"] * args.time_box:
            group.rows.append({"section": "e2e", "kind": experiment, "skipped": "time box"})
            continue
        smoke = [*E2E_SMOKE["*"], *E2E_SMOKE[experiment]] if args.smoke else []
        build = task_case(experiment, smoke, device, args.e2e_batch, args.e2e_len, torch.bfloat16)
        group.add(experiment, build)
    rows = group.run(baseline="llama/pg19")
    for r in rows:
        if "median" in r:
            r["steps_per_s"] = 1.0 / r["median"]
    out(rows)


# The share of `--time-box` each section may start cases in.
SHARES = {"blocks": 0.6, "lra_text": 0.2, "e2e": 0.2}
SECTIONS: dict[str, tuple[str, Callable[..., None]]] = {
    "blocks": ("Blocks, forward + backward, bf16 autocast (ratios against Llama)", section_blocks),
    "lra_text": (
        "LRA Text (Mega Table 2 speed), one AdamW step, float32 (ratios against the "
        "SDPA transformer)",
        section_lra_text,
    ),
    "e2e": (
        "Megalodon-100M vs Llama-100M (PG-19 configs), one AdamW step, bf16 autocast "
        "(ratios against Llama)",
        section_e2e,
    ),
}


# -- report --------------------------------------------------------------------------------------
def _x(v: float) -> str:
    return f"{v:.2f}" if v >= 0.1 else f"{v:.3g}"


def render(record: dict[str, Any]) -> str:
    """The Markdown tables of a record (one per section)."""
    s = record["settings"]
    out = [
        f"Device: {s['device']} (driver {s['driver']}, CUDA {s['cuda']}, torch {s['torch']}, "
        f"Triton {s['triton']}); {record['protocol']['rounds']} rounds after "
        f"{record['protocol']['warmup']} warm-up step(s), medians (min-max)."
    ]
    for name, (title, _) in SECTIONS.items():
        rows = [r for r in record["rows"] if r["section"] == name]
        if not rows:
            continue
        out += [
            f"\n### {title}\n",
            "| case | d | L | B | ms / step (median, min-max) | tokens/s | × speed "
            "| peak GB | launches / step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            head = f"| {r['kind']} | {r.get('d', '')} | {r.get('L', '')} | {r.get('B', '')} "
            if "error" in r or "skipped" in r:
                why = r.get("error") or r["skipped"]
                out.append(head + f"| {why.splitlines()[0][:120]} | | | | |")
                continue
            ms = f"{1e3 * r['median']:,.1f} ({1e3 * r['min']:,.1f}-{1e3 * r['max']:,.1f})"
            ratio = r.get("speed_ratio")
            speed = (
                f"{_x(ratio['median'])} ({_x(ratio['min'])}-{_x(ratio['max'])})" if ratio else ""
            )
            peak = f"{r['peak_bytes'] / 2**30:,.2f}" if r["peak_bytes"] is not None else "n/a"
            out.append(
                head + f"| {ms} | {r['tokens_per_s']:,.0f} | {speed} | {peak} "
                f"| {r['launches_per_step']:,} |"
            )
    if record["failures"]:
        out += ["\n### Failures\n"] + [
            f"- {f['section']}: {f['error']}" for f in record["failures"]
        ]
    return "\n".join(out)


# -- main ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _recorded(name: str, failures: list[dict[str, Any]]) -> Iterator[None]:
    """A section that fails is recorded with its traceback's last line; the rest still runs."""
    try:
        yield
    except Exception as err:
        failures.append(
            {
                "section": name,
                "error": f"{type(err).__name__}: {err}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
        )
        print(f"  {name} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--widths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--chunk", type=int, default=2048, help="Mega-chunk/Megalodon-chunk chunk")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="untimed steps beyond the first, which every case runs when built",
    )
    ap.add_argument("--e2e-len", type=int, default=2048)
    ap.add_argument("--e2e-batch", type=int, default=4)
    ap.add_argument(
        "--time-box",
        type=float,
        default=180.0,
        help="seconds of the whole benchmark; each section starts no new case past its share",
    )
    ap.add_argument("--render", type=Path, help="print the tables of a saved JSON, and exit")
    ap.add_argument("--json", type=Path, help="write the record here (after every group)")
    ap.add_argument("--md", type=Path, help="write the Markdown tables here")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes on the CPU in seconds (checks that the code runs)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.widths, args.lengths, args.tokens_per_step, args.chunk = [32], [64], 128, 32
        args.rounds, args.warmup, args.e2e_len, args.e2e_batch = 2, 0, 64, 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.render:
        saved: dict[str, Any] = json.loads(args.render.read_text())
        print(render(saved))
        return saved
    if args.smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit(
            "bench_gpu.py measures a CUDA GPU and none is visible; --smoke runs its code on the "
            "CPU at tiny sizes"
        )
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    protocol = {
        k: getattr(args, k)
        for k in (
            "sections",
            "widths",
            "lengths",
            "tokens_per_step",
            "chunk",
            "rounds",
            "warmup",
            "e2e_len",
            "e2e_batch",
            "time_box",
            "smoke",
        )
    }
    record: dict[str, Any] = {
        "settings": machine(device),
        "protocol": protocol,
        "rows": [],
        "failures": [],
        "measured": not args.smoke,
    }
    print(f"# GPU benchmarks: {json.dumps(record['settings'])}", file=sys.stderr)

    def out(rows: list[dict[str, Any]]) -> None:
        record["rows"] += rows
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")

    for name in args.sections:
        with _recorded(name, record["failures"]):
            SECTIONS[name][1](args, device, out)
    out([])
    text = render(record)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(text + "\n")
    print(text)
    return record


if __name__ == "__main__":
    record = main()
    bad = record["failures"] or any("error" in r for r in record["rows"])
    sys.exit(1 if bad else 0)
