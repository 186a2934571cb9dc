"""Mega throughput and peak memory, as ratios against baselines, from one run.

    python benchmarks/bench_mega.py [--device cpu|cuda] [--lengths 1024 4096 16384]

Three tables, each at every length L with a fixed token budget per batch (B = tokens // L):

1. Layer, forward + backward: a Mega block (MAGA + NFFN, softmax, bidirectional, LRA-Text
   widths d = 128, z = 64, v = d_FFN = 256, h = 16) chunked (c = 128) and with full attention,
   against a Transformer encoder layer of the same width (4 heads, d_FFN = 4d, pre-norm): the
   project's `megalab.models.transformer.TransformerLayer` when present, else
   `torch.nn.TransformerEncoderLayer(batch_first=True, norm_first=True)`.
2. Causal EMA sub-layer, forward + backward: ours (blocked Vandermonde kernel, one FFT of
   length ≥ 2L − 1) against the naive recurrence h_t = αβ x_t + q h_{t−1} (a Python loop over
   time) and the authors' formulation (kernel from the (d, h, L) tensor of powers q^l, float32
   FFTs of length 2L).
3. EMA kernel construction (bidirectional, 2d rows), forward + backward: ours against the
   naive (2d, h, L) tensor of powers.

Peak memory: on CUDA, `torch.cuda.max_memory_allocated` over one forward + backward, above
what was allocated before it. On CPU, every case runs in its own process and we report the
growth of the resident set (peak RSS from `getrusage` minus the RSS just before the first
forward + backward): it counts activations, gradients and allocator growth, not the model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

D_MODEL, Z_DIM, V_DIM, EMA_DIM, HEADS = 128, 64, 256, 16, 4


# ---------------------------------------------------------------------------------- models
def build_case(kind: str, L: int, B: int, device: str):
    """A module and a closure running one forward + backward."""
    from megalab.models.mega import MegaBlock, MegaConfig
    from megalab.nn.ema import DampedEMA

    torch.manual_seed(0)
    x = torch.randn(B, L, D_MODEL, device=device, requires_grad=True)
    if kind in ("mega_chunk128", "mega_full"):
        chunk = 128 if kind == "mega_chunk128" else -1
        cfg = MegaConfig(d_model=D_MODEL, z_dim=Z_DIM, v_dim=V_DIM, ffn_dim=V_DIM,
                         ema_dim=EMA_DIM, chunk_size=chunk, max_positions=max(L, 1024),
                         attention_activation="softmax")  # fmt: skip
        m = MegaBlock(cfg)
        return m.to(device), lambda: m(x)[0].sum().backward()
    if kind == "transformer":
        try:
            from megalab.models.transformer import TransformerLayer

            m = TransformerLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, prenorm=True)
            run = lambda: m(x, None, False).sum().backward()  # noqa: E731
        except ImportError:
            m = torch.nn.TransformerEncoderLayer(
                D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, batch_first=True, norm_first=True
            )
            run = lambda: m(x).sum().backward()  # noqa: E731
        return m.to(device), run
    # EMA sub-layers are causal (the recurrence is one-directional); kernels are bidirectional.
    ema = DampedEMA(D_MODEL, EMA_DIM, bidirectional=kind.startswith("kernel")).to(device)
    if kind == "ema_ours":
        return ema, lambda: ema(x)[0].sum().backward()
    if kind == "ema_authors":
        return ema, lambda: authors_ema(ema, x).sum().backward()
    if kind == "ema_recurrence":
        return ema, lambda: recurrent_ema(ema, x).sum().backward()
    if kind == "kernel_ours":
        return ema, lambda: ema.kernel(L).sum().backward()
    if kind == "kernel_naive":
        return ema, lambda: naive_kernel(ema, L).sum().backward()
    raise ValueError(kind)


def naive_kernel(ema, L: int) -> torch.Tensor:
    """The authors' kernel: materialise q^l = exp(l log q) as (D', h, L), then reduce over h."""
    p = torch.sigmoid(ema.alpha)
    q = 1 - p * torch.sigmoid(ema.delta)
    vander = torch.exp(torch.arange(L, device=q.device, dtype=q.dtype) * torch.log(q)[..., None])
    return torch.einsum("dnl,dn->dl", (p * ema.beta)[..., None] * vander, ema.eta * ema.scale)


def authors_ema(ema, x: torch.Tensor) -> torch.Tensor:
    """The authors' causal FFT path: kernel from the powers tensor, float32 FFTs of length 2L."""
    L = x.shape[1]
    k = naive_kernel(ema, L)
    xt = x.transpose(1, 2).float()
    y = torch.fft.irfft(torch.fft.rfft(xt, n=2 * L) * torch.fft.rfft(k.float(), n=2 * L), n=2 * L)
    return F.silu(y[..., :L].transpose(1, 2).to(x.dtype) + x * ema.omega)


def recurrent_ema(ema, x: torch.Tensor) -> torch.Tensor:
    """h_t = αβ x_t + q h_{t−1}; y_t = Σ η h_t/√h: a Python loop over time (causal)."""
    p = torch.sigmoid(ema.alpha)
    q, w_in, w_out = 1 - p * torch.sigmoid(ema.delta), p * ema.beta, ema.eta * ema.scale
    h = x.new_zeros(x.shape[0], x.shape[2], ema.ema_dim)
    ys = []
    for t in range(x.shape[1]):
        h = w_in * x[:, t, :, None] + q * h
        ys.append((h * w_out).sum(-1))
    return F.silu(torch.stack(ys, 1) + x * ema.omega)


# ---------------------------------------------------------------------------------- measuring
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(kind: str, L: int, B: int, device: str, min_time: float, max_reps: int) -> dict:
    """Run one case: peak memory of the first forward + backward, then timed repeats."""
    module, run = build_case(kind, L, B, device)
    module.train()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    if device.startswith("cuda"):
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        sync()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = rss_bytes()
        run()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (not times or time.perf_counter() - start < min_time):
        module.zero_grad(set_to_none=True)
        sync()
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
    times.sort()
    seconds = times[len(times) // 2]
    return {"kind": kind, "L": L, "B": B, "seconds": seconds, "reps": len(times),
            "tokens_per_s": B * L / seconds, "peak_mb": peak / 2**20}  # fmt: skip


def run_isolated(args, kind: str, L: int, B: int) -> dict:
    """Each case in a fresh process, so peak RSS belongs to that case alone."""
    spec = json.dumps({"kind": kind, "L": L, "B": B})
    cmd = [sys.executable, __file__, "--device", args.device, "--min-time", str(args.min_time),
           "--max-reps", str(args.max_reps), "--threads", str(args.threads),
           "--case", spec]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"kind": kind, "L": L, "B": B, "error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(title: str, rows: list[dict], baseline: str, lengths: list[int]) -> str:
    lines = [f"\n## {title} (ratios against `{baseline}` at the same L)\n",
             "| variant | L | B | ms / iter | tokens/s | × speed | peak MB | × memory |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for L in lengths:
        at_L = [r for r in rows if r["L"] == L]
        base = next((r for r in at_L if r["kind"] == baseline and "error" not in r), None)
        for r in at_L:
            if "error" in r:
                lines.append(f"| {r['kind']} | {L} | {r['B']} | failed: {r['error']} | | | | |")
                continue
            speed = r["tokens_per_s"] / base["tokens_per_s"] if base else math.nan
            mem = r["peak_mb"] / base["peak_mb"] if base and base["peak_mb"] > 0 else math.nan
            lines.append(
                f"| {r['kind']} | {L} | {r['B']} | {1e3 * r['seconds']:,.1f} | "
                f"{r['tokens_per_s']:,.0f} | {speed:.2f} | "
                f"{r['peak_mb']:,.1f} | {mem:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens // L)")
    ap.add_argument("--min-time", type=float, default=2.0, help="seconds of timed repeats")
    ap.add_argument("--max-reps", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on CPU, see docs/benchmarks.md)",
    )
    ap.add_argument("--sections", nargs="+", default=["layer", "ema", "kernel"],
                    choices=["layer", "ema", "kernel"], help="which tables to run")  # fmt: skip
    ap.add_argument("--json", help="also write all rows to this file")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads is None:
        # On a shared few-core CPU, OpenMP threads spinning against other processes made
        # timings 10-20x slower and erratic; one thread measures the code, not the contention.
        args.threads = 1 if args.device == "cpu" else torch.get_num_threads()
    torch.set_num_threads(args.threads)
    if args.case:
        c = json.loads(args.case)
        print(json.dumps(measure(c["kind"], c["L"], c["B"], args.device, args.min_time,
                                 args.max_reps)))  # fmt: skip
        return

    print(f"# Mega benchmark: device={args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, d={D_MODEL}, tokens/batch={args.tokens}")  # fmt: skip
    sections = {
        "layer": ("Layer forward + backward", "transformer",
                  ["transformer", "mega_chunk128", "mega_full"]),
        "ema": ("Causal EMA sub-layer forward + backward", "ema_recurrence",
                ["ema_recurrence", "ema_authors", "ema_ours"]),
        "kernel": ("EMA kernel construction (bidirectional) forward + backward", "kernel_naive",
                   ["kernel_naive", "kernel_ours"]),
    }  # fmt: skip
    all_rows = []
    for title, baseline, kinds in (sections[s] for s in args.sections):
        rows = []
        for L in args.lengths:
            B = max(1, args.tokens // L)
            for kind in kinds:
                rows.append(run_isolated(args, kind, L, B))
                print(f"  done {kind} L={L}", file=sys.stderr, flush=True)
        print(table(title, rows, baseline, args.lengths), flush=True)
        all_rows += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)


if __name__ == "__main__":
    main()
