"""SeqBoat vs Mega-chunk vs Mega layers: throughput and peak memory as ratios, from one run.

    python benchmarks/bench_seqboat.py [--device cpu|cuda] [--lengths 1024 2048 4096 16384]
        [--rates 0.1 0.5 1.0] [--rounds 3] [--tokens 16384] [--json rows.json]

At every length L, with a fixed token budget per batch (B = tokens // L), forward + backward of
one layer in training mode (float32, dropout 0), LRA-Text widths (d = 128, d_z = 64,
d_v = 256, h = 16, softmax, bidirectional, LayerNorm post-norm):

- `seqboat_r{rate}`: a SeqBoat layer (working memory W = 128 on each side, 'simple' bias on
  original positions) with its activation rate forced to 10 / 50 / 100 % through `act_bias`
  (calibrated on the batch: the (1 − rate) quantile of u_act − u_skip). At 100 % every row is
  fully active, so the code's rule runs the GAU unpacked (as the authors' code would).
- `packscatter_r{rate}`: the compress/extract part of that layer alone (the packing plan,
  packing H and unpacking the GAU output, forward + backward), to give its share of the step.
- `mega_chunk128`, `mega_full`: a Mega block (MAGA + normalized FFN of 256) with chunks of 128
  and with full attention (the paper's baselines, Tables 1 and 6).

Timing: all variants of one L are built in one process, warmed up once, then timed in
`--rounds` rounds, each running every variant once in a rotated order (round r starts at
variant r), so that load changes on a shared machine hit every variant alike. We report the
median and min-max of the rounds, and ratios of medians against `mega_full` (and the
pack/scatter share of its SeqBoat step). The timing process applies the training entry
points' start-up settings (`megalab.utils.runtime.configure_runtime`: glibc malloc without mmap
or trimming, passive OpenMP waits) and prints them with the thread count and load average.

Peak memory: each variant once in a fresh process. CUDA: `max_memory_allocated` above the
allocation before the pass. CPU: growth of the peak resident set over one forward + backward
(VmHWM reset before the pass), with glibc's mmap threshold fixed at 64 KB
(`MALLOC_MMAP_THRESHOLD_=65536`, which also turns off its dynamic threshold): every tensor of
64 KB or more is its own mapping, returned on free, so the resident set follows the live tensors
instead of the heap that set-up left behind. Mega at full length uses the fused attention kernel
(`attention_recompute=None`: weights recomputed in the backward for spans over 512 keys), so
its memory grows linearly and the 16K row runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

from megalab.utils.runtime import configure_runtime

RUNTIME = configure_runtime()  # before torch: OpenMP reads its environment when loaded

import torch  # noqa: E402

D_MODEL, Z_DIM, V_DIM, EMA_DIM, WINDOW = 128, 64, 256, 16, 128
MMAP_THRESHOLD = 1 << 16  # bytes, for the CPU memory processes (see the module docstring)


def build(kind: str, L: int, B: int, device: str):
    """(module, run) for a variant: run() does one forward + backward."""
    from megalab.models.mega.model import MegaBlock, MegaConfig
    from megalab.models.seqboat.model import SeqBoatConfig, SeqBoatLayer
    from megalab.models.seqboat.sma import pack, plan_packing, unpack

    torch.manual_seed(0)
    x = torch.randn(B, L, D_MODEL, device=device, requires_grad=True)
    if kind.startswith("mega"):
        chunk = 128 if kind == "mega_chunk128" else -1
        cfg = MegaConfig(d_model=D_MODEL, z_dim=Z_DIM, v_dim=V_DIM, ffn_dim=V_DIM,
                         ema_dim=EMA_DIM, chunk_size=chunk, max_positions=max(L, 1024),
                         norm_type="layernorm", prenorm=False)  # fmt: skip
        m = MegaBlock(cfg).to(device)
        return m, lambda: m(x)[0].sum().backward()
    rate = float(kind.rsplit("_r", 1)[1])
    cfg = SeqBoatConfig(d_model=D_MODEL, num_layers=1, z_dim=Z_DIM, v_dim=V_DIM, ema_dim=EMA_DIM,
                        chunk_size=WINDOW, max_positions=max(L, 1024), norm_type="layernorm",
                        prenorm=False, init_temp_scale=0.3)  # fmt: skip
    layer = SeqBoatLayer(cfg).to(device)
    with torch.no_grad():
        _, _, rep = layer(x, details=True)
        u = rep.details["logits"]
        diff = (u[..., 1] - u[..., 0]).flatten().float()
        layer.act_bias = -1e4 if rate >= 1 else float(torch.quantile(diff, 1 - rate))
    if kind.startswith("seqboat"):
        return layer, lambda: layer(x)[0].sum().backward()
    # packscatter: the layer's compress/extract alone, on its own decisions.
    with torch.no_grad():
        active = layer(x, details=True)[2].details["active"]
    H = torch.randn(B, L, D_MODEL, device=device, requires_grad=True)

    def run() -> None:
        full_row = bool(active.all(dim=1).any())
        plan = plan_packing(active, compress=not full_row)
        Hc = pack(H, plan)
        unpack(Hc * 1.0, plan).sum().backward()

    return layer, run


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_memory(kind: str, L: int, B: int, device: str) -> float:
    """MB over one forward + backward (run in a fresh process by `memory_isolated`)."""
    module, run = build(kind, L, B, device)
    module.train()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    # Reset the peak resident set (VmHWM) to the current one, so that the peak of imports and
    # set-up does not hide the pass's (Linux clear_refs "5").
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kb("VmRSS")
    run()
    return (_status_kb("VmHWM") - base) / 1024


def memory_isolated(args, kind: str, L: int, B: int) -> float:
    spec = json.dumps({"kind": kind, "L": L, "B": B})
    cmd = [sys.executable, __file__, "--device", args.device, "--threads", str(args.threads),
           "--memory-case", spec]  # fmt: skip
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return math.nan
    return float(out.stdout.strip().splitlines()[-1])


def timed_rounds(kinds: list[str], L: int, B: int, device: str, rounds: int) -> dict:
    """Seconds per forward + backward for each variant: one warm-up, then rotated rounds."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    cases = {k: build(k, L, B, device) for k in kinds}
    for module, run in cases.values():
        module.train()
        run()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for k in order:
            module, run = cases[k]
            module.zero_grad(set_to_none=True)
            sync()
            t = time.perf_counter()
            run()
            sync()
            times[k].append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 16384])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.5, 1.0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens // L)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (CPU default 1)")
    ap.add_argument("--no-full", action="store_true", help="skip mega_full (slow at 16K on CPU)")
    ap.add_argument("--json", help="also write all rows to this file")
    ap.add_argument("--memory-case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads is None:
        args.threads = 1 if args.device == "cpu" else torch.get_num_threads()
    torch.set_num_threads(args.threads)
    if args.memory_case:
        c = json.loads(args.memory_case)
        print(peak_memory(c["kind"], c["L"], c["B"], args.device))
        return

    alloc = (
        f"CUDA caching allocator ({os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'default')})"
        if args.device != "cpu"
        else f"glibc malloc {RUNTIME['malloc']}; memory processes MALLOC_MMAP_THRESHOLD_="
        f"{MMAP_THRESHOLD}"
    )
    settings = {
        "device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "omp_wait_policy": RUNTIME["omp_wait_policy"], "allocator": alloc,
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "tokens_per_batch": args.tokens, "rounds": args.rounds,
        "load_average_start": os.getloadavg()[0],
    }  # fmt: skip
    print(f"# SeqBoat benchmark: device={args.device}, torch {torch.__version__}, "
          f"{settings['threads']} intra-op threads (OMP_NUM_THREADS={settings['omp_num_threads']}, "
          f"OMP_WAIT_POLICY {settings['omp_wait_policy']}), allocator {alloc}, "
          f"{settings['cpu']}, {os.cpu_count()} CPUs, d={D_MODEL}, "
          f"W={WINDOW}, tokens/batch={args.tokens}, {args.rounds} rotated rounds after warm-up, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(
        "\n| variant | L | B | ms / iter (median, min-max) | tokens/s | × speed vs mega_full "
        "| × speed vs mega_chunk128 | peak MB | × memory vs mega_full | pack/scatter share |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for L in args.lengths:
        B = max(1, args.tokens // L)
        kinds = ["mega_chunk128"] + ([] if args.no_full else ["mega_full"])
        kinds += [f"seqboat_r{r:g}" for r in args.rates] + [
            f"packscatter_r{r:g}" for r in args.rates
        ]
        times = timed_rounds(kinds, L, B, args.device, args.rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        mem = {k: memory_isolated(args, k, L, B) for k in kinds if not k.startswith("pack")}
        for k in kinds:
            if k.startswith("pack"):
                continue
            share = ""
            if k.startswith("seqboat"):
                share = f"{med['packscatter_r' + k.rsplit('_r', 1)[1]] / med[k]:.1%}"
            ref = med.get("mega_full", math.nan)
            row = {"kind": k, "L": L, "B": B, "median_s": med[k], "min_s": min(times[k]),
                   "max_s": max(times[k]), "tokens_per_s": B * L / med[k],
                   "speed_vs_full": ref / med[k], "speed_vs_chunk": med["mega_chunk128"] / med[k],
                   "peak_mb": mem[k], "memory_vs_full": mem[k] / mem.get("mega_full", math.nan),
                   "pack_scatter_share": share}  # fmt: skip
            rows.append(row)
            print(f"| {k} | {L} | {B} | {1e3 * med[k]:,.0f} ({1e3 * row['min_s']:,.0f}-"
                  f"{1e3 * row['max_s']:,.0f}) | {row['tokens_per_s']:,.0f} | "
                  f"{row['speed_vs_full']:.2f} | {row['speed_vs_chunk']:.2f} | "
                  f"{mem[k]:,.0f} | {row['memory_vs_full']:.2f} | {share} |",
                  flush=True)  # fmt: skip
    settings["load_average_end"] = os.getloadavg()[0]
    print(f"\n# load average at the end {settings['load_average_end']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
