"""Megalodon throughput and peak memory, as ratios against baselines, from one run.

    python benchmarks/bench_megalodon.py [--device cpu|cuda] [--lengths 4096 16384 65536]

Three tables, forward + backward in training mode, float32, batch 1 at every length L:

1. Block: one causal Megalodon block (TimestepNorm, CEMA, normalized attention, SiLU FFN) against
   one causal Mega block (EMA, single-head softmax attention, FFN) at equal widths (d = 128,
   z = 64, v = d_FFN = 256, h = N = 16, one head, 16 norm groups), both with chunk c = 2048.
2. CEMA sub-layer: ours (blocked Vandermonde kernel, one real FFT of length ≥ 2L − 1) against the
   authors' formulation (the (d, N, L) complex tensor of powers exp(l·log q), float32 FFTs of
   length 2·nextpow2(L)) and the recurrence h_t = α x_t + q h_{t−1} (a loop over time).
3. TimestepNorm: ours (shifted cumulative sums in float64, elementwise work in float32) against
   the Welford recurrence as a loop over time (what the authors' CPU kernel does) and the plain
   float32 cumulative E[x²] − E[x]² (fast, but it loses the variance at long lengths; see
   tests/nn/test_timestep_norm.py).

Timing: each case runs in its own process: one untimed pass (its peak memory), then rounds of
timed passes; the median, min and max are reported. Peak memory: on CUDA
`torch.cuda.max_memory_allocated` above the baseline; on CPU the growth of the resident set over
the first pass (peak RSS from `getrusage` minus the RSS before it): activations, gradients and
allocator growth, not the parameters. Ratios are against the table's baseline at the same L.
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

D_MODEL, Z_DIM, V_DIM, N_DIM, GROUPS, CHUNK = 128, 64, 256, 16, 16, 2048


def build_case(kind: str, L: int, device: str):
    """A module and a closure running one forward + backward on a (1, L, d) input."""
    from megalab.models.mega import MegaBlock, MegaConfig
    from megalab.models.megalodon import MegalodonBlock, MegalodonConfig
    from megalab.nn.cema import ComplexEMA
    from megalab.nn.timestep_norm import TimestepNorm

    torch.manual_seed(0)
    x = torch.randn(1, L, D_MODEL, device=device, requires_grad=True)
    if kind == "mega_block":
        cfg = MegaConfig(d_model=D_MODEL, z_dim=Z_DIM, v_dim=V_DIM, ffn_dim=V_DIM,
                         ema_dim=N_DIM, chunk_size=CHUNK, causal=True, prenorm=True,
                         rel_pos_bias="rotary")  # fmt: skip
        m = MegaBlock(cfg).to(device)
        return m, lambda: m(x)[0].sum().backward()
    if kind == "megalodon_block":
        cfg = MegalodonConfig(d_model=D_MODEL, z_dim=Z_DIM, v_dim=V_DIM, ffn_dim=V_DIM,
                              cema_dim=N_DIM, chunk_size=CHUNK, norm_groups=GROUPS)  # fmt: skip
        m = MegalodonBlock(cfg).to(device)
        return m, lambda: m(x)[0].sum().backward()
    if kind.startswith("cema"):
        m = ComplexEMA(D_MODEL, N_DIM).to(device)
        fn = {"cema_ours": lambda: m(x)[0], "cema_authors": lambda: authors_cema(m, x),
              "cema_recurrence": lambda: recurrent_cema(m, x)}[kind]  # fmt: skip
        return m, lambda: fn().sum().backward()
    if kind.startswith("tsn"):
        m = TimestepNorm(D_MODEL, GROUPS).to(device)
        fn = {"tsn_ours": lambda: m(x)[0], "tsn_welford_loop": lambda: welford_loop(m, x),
              "tsn_cumsum_fp32": lambda: cumsum_fp32(m, x)}[kind]  # fmt: skip
        return m, lambda: fn().sum().backward()
    raise ValueError(kind)


# ---------------------------------------------------------------------------- naive forms
def authors_cema(m, x: torch.Tensor) -> torch.Tensor:
    """The authors' formulation: kernel Re(Σ_n η α q^l) from the (d, N, L) powers, FFT at 2·2^k."""
    L = x.shape[1]
    p, eta, log_q = m.coefficients(torch.float32)
    powers = torch.exp(torch.arange(L, device=x.device) * log_q.unsqueeze(-1))  # (d, N, L)
    k = torch.einsum("dn,dnl->dl", p * eta, powers).real
    n = 2 * (1 << (L - 1).bit_length())
    xt = x.transpose(1, 2)
    y = torch.fft.irfft(torch.fft.rfft(xt, n=n) * torch.fft.rfft(k, n=n), n=n)[..., :L]
    return (y + m.omega.unsqueeze(-1) * xt).transpose(1, 2)


def recurrent_cema(m, x: torch.Tensor) -> torch.Tensor:
    """h_t = α x_t + q h_{t−1}; y_t = Re Σ_n η h_t + ω x_t: a loop over time."""
    p, eta, log_q = m.coefficients(torch.float32)
    q = torch.exp(log_q)
    h = torch.zeros(x.shape[0], x.shape[2], m.ema_dim, dtype=q.dtype, device=x.device)
    ys = []
    for t in range(x.shape[1]):
        h = p * x[:, t, :, None] + q * h
        ys.append((h * eta).sum(-1).real)
    return torch.stack(ys, 1) + m.omega * x


def welford_loop(m, x: torch.Tensor) -> torch.Tensor:
    """The Welford/Chan update per step, a loop over time (the code's CPU kernel's order)."""
    B, L, D = x.shape
    G = m.num_groups
    xg = x.view(B, L, G, D // G)
    step_mean, step_var = xg.mean(-1), xg.var(-1, unbiased=False)
    mean = torch.zeros(B, G, device=x.device)
    var = torch.zeros(B, G, device=x.device)
    means, vars_ = [], []
    for t in range(L):
        c = float(t)
        delta = step_mean[:, t] - mean
        mean = mean + delta / (c + 1)
        var = var * (c / (c + 1)) + step_var[:, t] / (c + 1) + delta.square() * c / (c + 1) ** 2
        means.append(mean)
        vars_.append(var)
    mu, v = torch.stack(means, 1), torch.stack(vars_, 1)
    y = (xg - mu.unsqueeze(-1)) * torch.rsqrt(v + m.eps).unsqueeze(-1)
    return y.view(B, L, D) * (1 + m.weight) + m.bias


def cumsum_fp32(m, x: torch.Tensor) -> torch.Tensor:
    """Cumulative E[x] and E[x²] in float32 (the textbook form; cancels at long lengths)."""
    B, L, D = x.shape
    G = m.num_groups
    xg = x.view(B, L, G, D // G)
    n = torch.arange(1, L + 1, device=x.device, dtype=x.dtype).view(1, L, 1)
    mu = xg.mean(-1).cumsum(1) / n
    var = (xg.square().mean(-1).cumsum(1) / n - mu.square()).clamp_min(0)
    y = (xg - mu.unsqueeze(-1)) * torch.rsqrt(var + m.eps).unsqueeze(-1)
    return y.view(B, L, D) * (1 + m.weight) + m.bias


# ---------------------------------------------------------------------------- measuring
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(kind: str, L: int, device: str, rounds: int) -> dict:
    module, run = build_case(kind, L, device)
    module.train()
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
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
    times = []
    for _ in range(rounds):
        module.zero_grad(set_to_none=True)
        sync()
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
    times.sort()
    return {"kind": kind, "L": L, "median": times[len(times) // 2], "min": times[0],
            "max": times[-1], "rounds": rounds, "peak_mb": peak / 2**20}  # fmt: skip


def run_isolated(args, kind: str, L: int) -> dict:
    spec = json.dumps({"kind": kind, "L": L})
    cmd = [sys.executable, __file__, "--device", args.device, "--rounds", str(args.rounds),
           "--threads", str(args.threads), "--case", spec]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["killed"])[-1]
        return {"kind": kind, "L": L, "error": tail}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(title: str, rows: list[dict], baseline: str, lengths: list[int]) -> str:
    lines = [f"\n### {title} (ratios against `{baseline}` at the same L)\n",
             "| variant | L | ms / iter (median, min-max) | tokens/s | × speed | peak MB "
             "| × memory |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for L in lengths:
        at_L = [r for r in rows if r["L"] == L]
        base = next((r for r in at_L if r["kind"] == baseline and "error" not in r), None)
        for r in at_L:
            if "error" in r:
                lines.append(f"| {r['kind']} | {L} | failed: {r['error']} | | | | |")
                continue
            speed = base["median"] / r["median"] if base else math.nan
            mem = r["peak_mb"] / base["peak_mb"] if base and base["peak_mb"] > 0 else math.nan
            lines.append(
                f"| {r['kind']} | {L} | {1e3 * r['median']:,.1f} ({1e3 * r['min']:,.1f}-"
                f"{1e3 * r['max']:,.1f}) | {L / r['median']:,.0f} | {speed:.2f} | "
                f"{r['peak_mb']:,.1f} | {mem:.2f} |"
            )
    return "\n".join(lines)


SECTIONS = {
    "block": ("Block forward + backward", "mega_block", ["mega_block", "megalodon_block"]),
    "cema": ("CEMA sub-layer forward + backward", "cema_authors",
             ["cema_recurrence", "cema_authors", "cema_ours"]),
    "tsn": ("TimestepNorm forward + backward", "tsn_cumsum_fp32",
            ["tsn_welford_loop", "tsn_cumsum_fp32", "tsn_ours"]),
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--rounds", type=int, default=3, help="timed passes after the untimed one")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (CPU: 1)")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument(
        "--skip",
        nargs="*",
        default=["cema_recurrence@65536", "tsn_welford_loop@65536"],
        help="kind@L cases to leave out (Python loops over 64K steps take minutes)",
    )
    ap.add_argument("--json", help="also write all rows to this file")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads is None:
        args.threads = 1 if args.device == "cpu" else torch.get_num_threads()
    torch.set_num_threads(args.threads)
    if args.case:
        c = json.loads(args.case)
        print(json.dumps(measure(c["kind"], c["L"], args.device, args.rounds)))
        return
    print(f"# Megalodon benchmark: device={args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
          f"d={D_MODEL}, batch 1, chunk {CHUNK}, {args.rounds} timed rounds")  # fmt: skip
    all_rows = []
    for name in args.sections:
        title, baseline, kinds = SECTIONS[name]
        rows = []
        for L in args.lengths:
            for kind in kinds:
                if f"{kind}@{L}" in args.skip:
                    continue
                rows.append(run_isolated(args, kind, L))
                print(f"  done {kind} L={L}", file=sys.stderr, flush=True)
        print(table(title, rows, baseline, args.lengths), flush=True)
        all_rows += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)


if __name__ == "__main__":
    main()
