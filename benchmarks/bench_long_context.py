"""Long context: Megalodon block vs Llama block vs Mega block at equal width, training and
decoding, as ratios against Llama from one process in rotated rounds.

    python benchmarks/bench_long_context.py [--d-model 128] [--chunks 2048 4096]
        [--lengths 4096 16384 32768 65536] [--contexts 1024 4096 16384 32768]
        [--models llama mega megalodon] [--skip-cases megalodon_c4096] [--llama-max-len 16384]
        [--rounds 3] [--warmup 1]
        [--sections train decode] [--device cpu|cuda] [--threads 1] [--json out.json]
    python benchmarks/bench_long_context.py --render out_4096.json out_16384.json ...

Protocol (as benchmarks/bench_mega.py): every case of a section at one length is built in this
process; each runs `--warmup` untimed passes; then `--rounds` rounds run every case once, in an
order rotated by one case per round, so that a drift in the machine's load falls on every case
alike. Each pass is timed twice: wall clock and CPU time (`process_time`, user + system of all
the process's threads); on a machine shared with other jobs the wall clock includes the time
the process waited for a core, so with one intra-op thread the CPU time is the figure to trust.
A case's time is its median over rounds (min-max); its ratio against Llama at the same length
is computed per round (Llama's time / the case's), for wall and CPU time alike, and reported as
the median (min-max). Thread count, OpenMP wait policy and the allocator settings
(`megalab.utils.runtime`) are recorded with the results, and per length the load average and
the machine's available memory before and after, and the process's peak resident set.

Memory is bounded per length: a case's input gradient is dropped before each pass, and after
every length all its models and tensors are freed and the heap is trimmed (`malloc_trim`), so a
process that runs several lengths holds one length's cases at a time. At 32K and 64K, one
length per process (`--lengths 65536 --json out_65536.json`) keeps the peak to the largest
case of that length; the ratios are within one process at one length either way.

- **train**: one block (a 1-layer backbone built from `configs/model/<name>.yaml`) at width d,
  forward + backward of one sequence of L tokens, float32, dropout 0. Llama-2: d/64 heads of 64,
  SwiGLU by Meta's rule (512 at d = 128), full causal attention on SDPA. Mega: causal, z = d/4,
  v = d_FFN = 2d, h = 16, chunk c, rotary bias. Megalodon: z = d/4, v = 2d, one head, SwiGLU
  2d, CEMA h = 16, timestep norm in groups of 32 channels, chunk c (one case per `--chunks`
  value for Mega and Megalodon). Memory: the bytes autograd saves for the backward per token
  (`saved_tensors_hooks`, unique storages, parameters excluded; deterministic, unlike RSS),
  from one extra forward; on CPU also the peak resident set of one step over the live memory
  before it (`VmHWM` after `clear_refs`, heap trimmed first: what the step adds, allocator
  overhead included), measured on the first warm-up pass; on CUDA `max_memory_allocated` over
  a step. Llama beyond `--llama-max-len` is not timed (16384 by default on CPU: full attention
  took 11 s per step at 32K and 43 s at 64K on one thread, ×3.8 per doubling; pass
  `--llama-max-len 65536` to time it, as docs/benchmarks.md does); its saved bytes per token are
  measured up to that length, where they are already constant (SDPA keeps no L x L matrix).
- **decode**: a 2-layer model reads a context of N tokens in one pass with its state, then
  decodes `--decode` tokens one at a time from that state, the models in rotated rounds: ms per
  token and the size of the carried state (Llama's key/value cache grows with N; Mega's and
  Megalodon's state is the recurrent state plus the keys/values of the open chunk).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from megalab.utils.runtime import configure_runtime

RUNTIME = configure_runtime()  # before torch: allocator and OpenMP settings

import torch  # noqa: E402

from megalab.models.base import Backbone  # noqa: E402

# Everything measured so far, written to --json after every length: a timeout keeps it.
RECORD: dict[str, Any] = {"settings": {}, "rows": []}
JSON_PATH: list[Path] = []


def checkpoint(rows: list[dict]) -> None:
    RECORD["rows"].extend(rows)
    if JSON_PATH:
        JSON_PATH[0].parent.mkdir(parents=True, exist_ok=True)
        JSON_PATH[0].write_text(json.dumps(RECORD, indent=1))


# Per model: backbone overrides at width d and chunk c (attention widths as each paper's ratios).
def sizes(name: str, d: int, chunk: int) -> dict[str, Any]:
    if name == "llama":
        return {"num_heads": max(1, d // 64), "ffn_dim": None, "dropout": 0.0}
    if name == "mega":
        return {"z_dim": d // 4, "v_dim": 2 * d, "ffn_dim": 2 * d, "causal": True,
                "prenorm": True, "chunk_size": chunk, "rel_pos_bias": "rotary", "dropout": 0.0,
                "max_positions": 1024}  # fmt: skip
    if name == "megalodon":
        return {"z_dim": d // 4, "v_dim": 2 * d, "num_heads": 1, "ffn_dim": 2 * d,
                "swiglu": True, "cema_dim": 16, "norm_groups": max(1, d // 32),
                "chunk_size": chunk, "causal": True, "dropout": 0.0}  # fmt: skip
    raise ValueError(f"unknown model {name!r} (llama, mega, megalodon)")


def build(name: str, d: int, layers: int, chunk: int, device: str) -> Backbone:
    import hydra
    from omegaconf import OmegaConf

    from megalab.utils.paths import group_config

    model = group_config("model", name)
    cfg = OmegaConf.create({"model": model, "data": {"max_len": 1 << 20, "vocab_size": 256,
                            "d_input": None, "pad_id": None, "num_classes": None}})  # fmt: skip
    cfg.model.d_model = d
    cfg.model.backbone.num_layers = layers
    for k, v in sizes(name, d, chunk).items():
        if k in cfg.model.backbone:
            cfg.model.backbone[k] = v
    torch.manual_seed(0)
    return hydra.utils.instantiate(cfg.model.backbone).build().to(device)


def case_name(model: str, chunk: int) -> str:
    return model if model == "llama" else f"{model}_c{chunk}"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- memory of the process (Linux; None elsewhere) -----------------------------------------------
def _proc_kb(path: str, key: str) -> float | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def available_gb() -> float | None:
    """The machine's available memory (MemAvailable), GB."""
    kb = _proc_kb("/proc/meminfo", "MemAvailable")
    return None if kb is None else round(kb / 2**20, 2)


def trim_heap() -> None:
    """Free unreachable objects and give the heap's free pages back (the tuned allocator keeps
    them otherwise), so that one case's or length's memory does not stay resident."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


PEAK_RSS = [0.0]  # the process's peak resident set so far, kB (VmHWM is reset per case)


def note_peak() -> float | None:
    """The kernel's peak resident set since its last reset (kB), folded into PEAK_RSS."""
    peak = _proc_kb("/proc/self/status", "VmHWM")
    PEAK_RSS[0] = max(PEAK_RSS[0], peak or 0.0)
    return peak


def step_peak_mb(run: Callable[[], None]) -> float | None:
    """Run once; the peak resident set over the resident set before it, MB (None where the
    kernel does not let the peak be reset)."""
    note_peak()
    trim_heap()
    before = _proc_kb("/proc/self/status", "VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    except OSError:
        before = None
    run()
    peak = note_peak()
    return None if before is None or peak is None else (peak - before) / 1024


def conditions() -> dict[str, Any]:
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "available_gb": available_gb()}


# -- measuring -----------------------------------------------------------------------------------
def saved_bytes(module: torch.nn.Module, forward: Callable[[], Any]) -> int:
    """Bytes autograd keeps for the backward of one forward (parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        # Detached: a node that saves its own output would otherwise hold that output with its
        # grad_fn, a reference cycle through C++ that keeps the whole graph alive (it kept the
        # saved bytes of every case resident, ~L x 37 KB each).
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    return sum(v for k, v in seen.items() if k not in params)


def rounds(
    cases: dict[str, Callable[[], None]],
    n_rounds: int,
    warmup: int,
    peaks: dict[str, float | None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Time every case once per round, in an order rotated by one case per round: (wall, CPU)
    seconds per case. With `peaks`, the first warm-up pass of each case measures its peak."""
    for name, run in cases.items():
        for i in range(warmup):
            if i == 0 and peaks is not None:
                peaks[name] = step_peak_mb(run)
            else:
                run()
    names = list(cases)
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(n_rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            w, c = time.perf_counter(), time.process_time()
            cases[name]()
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    return wall, cpu


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# -- sections ------------------------------------------------------------------------------------
def train_case(
    a: argparse.Namespace, model: str, chunk: int, L: int
) -> tuple[Callable[[], None], int, float | None]:
    """One block's training step on L tokens: (step, bytes saved for the backward, CUDA peak MB).
    Its model and tensors live in the step's closure only, so dropping the step frees them."""
    block = build(model, a.d_model, 1, chunk, a.device).train()
    x = torch.randn(1, L, a.d_model, device=a.device, requires_grad=True)

    def forward() -> torch.Tensor:
        return block(x).y

    def step() -> None:
        block.zero_grad(set_to_none=True)
        x.grad = None  # not accumulated: each pass allocates what a training step does
        forward().sum().backward()
        sync(a.device)

    saved = saved_bytes(block, forward)
    trim_heap()
    peak = None
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return step, saved, peak


def train_section(a: argparse.Namespace) -> None:
    llama_per_token: dict[int, float] = {}
    for L in a.lengths:
        before = conditions()
        rows: list[dict[str, Any]] = []
        cases: dict[str, Callable[[], None]] = {}
        saved: dict[str, int] = {}
        peaks: dict[str, float] = {}
        rss_peaks: dict[str, float | None] = {}
        for model in a.models:
            for chunk in [0] if model == "llama" else a.chunks:
                name = case_name(model, chunk)
                if (model == "llama" and a.llama_max_len < L) or name in a.skip_cases:
                    continue
                cases[name], saved[name], cuda_peak = train_case(a, model, chunk, L)
                if cuda_peak is not None:
                    peaks[name] = cuda_peak
        if a.rounds == 0:  # --rounds 0: the saved bytes only (one forward per case)
            rows += [{"section": "train", "case": n, "L": L, "saved_bytes_per_token": b / L,
                      "not_timed": "--rounds 0"} for n, b in saved.items()]  # fmt: skip
        else:
            measure_rss = a.device == "cpu" and a.warmup > 0
            times, cpu_times = rounds(cases, a.rounds, a.warmup, rss_peaks if measure_rss else None)
            if "llama" in saved:
                llama_per_token[L] = saved["llama"] / L
            base_times, base_cpu = times.get("llama"), cpu_times.get("llama")
            for name, ts in times.items():
                cs = cpu_times[name]
                row: dict[str, Any] = {
                    "section": "train", "case": name, "L": L, "times_s": ts, **stats(ts),
                    "tokens_per_s": L / statistics.median(ts), "cpu_times_s": cs,
                    "cpu": stats(cs), "cpu_tokens_per_s": L / statistics.median(cs),
                    "saved_bytes_per_token": saved[name] / L,
                }  # fmt: skip
                if name in peaks:
                    row["cuda_peak_mb"] = peaks[name]
                if rss_peaks.get(name) is not None:
                    row["step_peak_rss_mb"] = rss_peaks[name]
                if base_times and base_cpu:
                    row["speed_ratio"] = stats([b / t for b, t in zip(base_times, ts)])
                    row["cpu_speed_ratio"] = stats([b / t for b, t in zip(base_cpu, cs)])
                    row["memory_ratio"] = saved[name] / saved["llama"]
                elif llama_per_token:  # against Llama's bytes per token at its longest L
                    longest = max(llama_per_token)
                    row["memory_ratio"] = saved[name] / L / llama_per_token[longest]
                    row["memory_ratio_llama_L"] = longest
                rows.append(row)
            if "llama" in a.models and a.llama_max_len < L:
                rows.append({"section": "train", "case": "llama", "L": L, "not_run":
                             f"full attention over {L} tokens is not timed beyond "
                             f"--llama-max-len {a.llama_max_len}"})  # fmt: skip
        cases.clear()  # this length's models and tensors
        trim_heap()
        record_conditions("train", L, before)
        checkpoint(rows)
        print(f"  train L={L} done", file=sys.stderr, flush=True)


def record_conditions(section: str, length: int, before: dict[str, Any]) -> None:
    """Record the load and memory around one length of a section."""
    note_peak()
    RECORD["settings"].setdefault("conditions", []).append(
        {"section": section, "L": length, "before": before, "after": conditions(),
         "process_peak_rss_mb": round(PEAK_RSS[0] / 1024, 1) if PEAK_RSS[0] else None}
    )  # fmt: skip


def decode_case(
    a: argparse.Namespace, model: str, chunk: int, N: int
) -> tuple[Callable[[], None], int]:
    """A 2-layer model's state after N tokens; (decode `--decode` tokens from it, state bytes)."""
    from megalab.long_context import state_bytes

    net = build(model, a.d_model, 2, chunk, a.device).eval()
    with torch.inference_mode():
        x = torch.randn(1, N, a.d_model, device=a.device)
        state = net(x, None, net.initial_state(1, x)).state
    del x
    step_x = torch.randn(1, 1, a.d_model, device=a.device)

    def run() -> None:
        with torch.inference_mode():
            s = state
            for _ in range(a.decode):
                s = net(step_x, None, s).state
            sync(a.device)

    return run, state_bytes(state)


def decode_section(a: argparse.Namespace) -> None:
    chunk = a.chunks[0]
    for N in a.contexts:
        before = conditions()
        rows: list[dict[str, Any]] = []
        cases: dict[str, Callable[[], None]] = {}
        states: dict[str, int] = {}
        for model in a.models:
            if model == "llama" and a.llama_max_len < N:
                continue
            name = case_name(model, 0 if model == "llama" else chunk)
            cases[name], states[name] = decode_case(a, model, chunk, N)
            trim_heap()
        times, cpu_times = rounds(cases, a.rounds, a.warmup)
        for name, ts in times.items():
            per_token = [t / a.decode for t in ts]
            cpu_per_token = [t / a.decode for t in cpu_times[name]]
            rows.append({"section": "decode", "case": name, "N": N, "times_s": per_token,
                         **stats(per_token), "tokens_per_s": 1 / statistics.median(per_token),
                         "cpu_times_s": cpu_per_token, "cpu": stats(cpu_per_token),
                         "cpu_tokens_per_s": 1 / statistics.median(cpu_per_token),
                         "state_mb": states[name] / 2**20})  # fmt: skip
        cases.clear()
        trim_heap()
        record_conditions("decode", N, before)
        checkpoint(rows)
        print(f"  decode N={N} done", file=sys.stderr, flush=True)


# -- report --------------------------------------------------------------------------------------
def settings(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "runtime": RUNTIME,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "dtype": "float32",
        "d_model": a.d_model,
        "rounds": a.rounds,
        "warmup": a.warmup,
        "decode_tokens": a.decode,
        "skip_cases": a.skip_cases,
        "start": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        **{f"{k}_at_start": v for k, v in conditions().items()},
    }


def _range(r: dict[str, float], scale: float = 1.0, fmt: str = "{:,.0f}") -> str:
    return (f"{fmt.format(r['median'] * scale)} ({fmt.format(r['min'] * scale)}-"
            f"{fmt.format(r['max'] * scale)})")  # fmt: skip


def render(records: list[dict]) -> str:
    """The tables of one or more --json records (e.g. one per length), in their order."""
    rows = [r for rec in records for r in rec["rows"]]
    out = []
    train = [r for r in rows if r["section"] == "train"]
    if train:
        out += ["### Training block, forward + backward (ratios against `llama` at the same L)",
                "", "| case | L | CPU ms / step (min-max) | × speed, CPU (min-max) | "
                "wall ms / step (min-max) | × speed, wall (min-max) | tokens/s (CPU) | "
                "saved KB / token | × memory | step peak RSS MB |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in train:
            if "not_timed" in r:
                kb = r["saved_bytes_per_token"] / 1024
                out.append(f"| {r['case']} | {r['L']} | not timed | | | | | {kb:,.2f} | | |")
                continue
            if "not_run" in r:
                out.append(f"| {r['case']} | {r['L']} | not run: {r['not_run']} "
                           "| | | | | | | |")  # fmt: skip
                continue
            cpu = _range(r["cpu"], 1e3) if "cpu" in r else "—"
            cpu_ratio = _range(r["cpu_speed_ratio"], fmt="{:.2f}") if "cpu_speed_ratio" in r \
                else "—"  # fmt: skip
            ratio = _range(r["speed_ratio"], fmt="{:.2f}") if "speed_ratio" in r else "—"
            tps = f"{r['cpu_tokens_per_s']:,.0f}" if "cpu_tokens_per_s" in r else "—"
            mem = f"{r['memory_ratio']:.2f}" if "memory_ratio" in r else "—"
            if "memory_ratio_llama_L" in r:
                mem += f" (vs Llama's per token at {r['memory_ratio_llama_L']})"
            kb = r["saved_bytes_per_token"] / 1024
            peak = f"{r['step_peak_rss_mb']:,.0f}" if "step_peak_rss_mb" in r else "—"
            out.append(f"| {r['case']} | {r['L']} | {cpu} | {cpu_ratio} | {_range(r, 1e3)} | "
                       f"{ratio} | {tps} | {kb:,.2f} | {mem} | {peak} |")  # fmt: skip
    decode = [r for r in rows if r["section"] == "decode"]
    if decode:
        out += ["", "### Decoding one token after a context of N tokens", "",
                "| case | context N | CPU ms / token (min-max) | wall ms / token (min-max) | "
                "tokens/s (CPU) | state MB |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in decode:
            cpu = _range(r["cpu"], 1e3, "{:.2f}") if "cpu" in r else "—"
            tps = f"{r['cpu_tokens_per_s']:,.0f}" if "cpu_tokens_per_s" in r else "—"
            out.append(f"| {r['case']} | {r['N']} | {cpu} | {_range(r, 1e3, '{:.2f}')} | "
                       f"{tps} | {r['state_mb']:.2f} |")  # fmt: skip
    notes = [(rec["settings"], c) for rec in records for c in rec["settings"].get("conditions", [])]
    if notes:
        out += ["", "### Conditions per length (load average 1/5/15 min; available memory)", "",
                "| section | L or N | started (UTC) | load before | load after | "
                "available GB before / after | process peak RSS MB |",
                "|---|---:|---|---|---|---|---:|"]  # fmt: skip
        for st, c in notes:
            load = [" / ".join(f"{x:.1f}" for x in c[k]["loadavg"]) for k in ("before", "after")]
            avail = f"{c['before']['available_gb']} / {c['after']['available_gb']}"
            peak = c["process_peak_rss_mb"]
            out.append(f"| {c['section']} | {c['L']} | {st.get('start', '—')} | {load[0]} | "
                       f"{load[1]} | {avail} | {peak if peak is not None else '—'} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="0: memory only, no timing")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--models", nargs="+", default=["llama", "mega", "megalodon"])
    p.add_argument("--skip-cases", nargs="+", default=[],
                   help="train cases to leave out, e.g. megalodon_c4096 (run apart, with Llama, "
                   "when its memory would not fit beside the others)")  # fmt: skip
    p.add_argument("--llama-max-len", type=int, default=None,
                   help="longest L/N for Llama (default 16384 on CPU)")  # fmt: skip
    p.add_argument("--sections", nargs="+", default=["decode", "train"],
                   choices=["train", "decode"])  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (1 on a shared machine)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None,
                   help="write settings and rows here (after every length)")  # fmt: skip
    p.add_argument("--render", type=Path, nargs="+", default=None,
                   help="print the tables of --json files (in order) and exit")  # fmt: skip
    a = p.parse_args()
    if a.render:
        print(render([json.loads(f.read_text()) for f in a.render]))
        return
    if a.llama_max_len is None:
        a.llama_max_len = 16384 if a.device == "cpu" else 1 << 30
    torch.set_num_threads(a.threads)
    RECORD["settings"] = settings(a)
    if a.json:
        JSON_PATH.append(a.json)
    print(f"# {json.dumps(RECORD['settings'])}", file=sys.stderr, flush=True)
    for section in a.sections:
        if section == "train":
            train_section(a)
        else:
            decode_section(a)
    print(render([RECORD]))


if __name__ == "__main__":
    main()
