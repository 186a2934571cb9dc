"""Megalodon's speed and memory against its baselines: ratios from one process, rotated rounds.

    python benchmarks/bench_megalodon.py [--sections block cema tsn]
        [--lengths 4096 16384 65536] [--rounds 5] [--long-rounds 3] [--warmup 1]
        [--threads 1] [--json results.json]

Protocol (as benchmarks/bench_mega.py): at each length L every case of a section is built in
one process and runs `--warmup` untimed passes; then `--rounds` rounds (`--long-rounds` from
64K on) run every case once, in an order rotated by one case per round, so that a drift in the
machine's load falls on every case alike. A case's time is its median over the rounds (with
min-max); its ratio against the section's baseline is computed per round (baseline time / case
time at the same L) and reported as the median with min-max. Wall time (`perf_counter`); the
process's thread and allocator settings (`megalab.utils.runtime`) are recorded in the JSON.
Memory is what autograd keeps for the backward, per token (`saved_tensors_hooks`, unique
storages, parameters excluded): deterministic, unlike the resident set.

Sections (forward + backward, training mode, float32, dropout 0, one sequence (1, L, d)):

- block: one causal Megalodon block (TimestepNorm, CEMA, RMSNorm, normalized attention, SiLU
  FFN, two-hop residual) against one causal pre-norm Mega block (EMA, single-head softmax
  attention with the rotary bias, FFN) at equal widths: d = 128, z = 64, v = d_FFN = 256,
  N = h = 16, one head, 16 norm groups, chunk c = 2048 for both.
- cema: the CEMA sub-layer, ours (kernel built blockwise from O(d·N·√L) powers, one real FFT of
  length ≥ 2L − 1) against the authors' formulation (the (d, N, L) complex tensor of powers
  exp(l·log q), FFTs of length 2·nextpow2(L)) and the recurrence h_t = α x_t + q h_{t−1} as a
  loop over time.
- tsn: TimestepNorm, ours (shifted cumulative sums in float64) against the float32 cumulative
  E[x²] − E[x]² (fast, but it loses the variance at long lengths:
  tests/models/megalodon/test_timestep_norm.py) and the Welford update as a loop over time (the
  order of the authors' CPU kernel).

Estimated rows (`--estimate kind@L`, marked `estimated` in the JSON and the tables): cases too
slow to run here at that length (Python loops over time, the authors' CEMA at 64K). Their time
is the kind's median at its longest timed length scaled linearly in L (each is O(L) apart from
an FFT); their memory is measured by one forward under the saved-tensor hooks when listed in
`--memory-at` (no timing), otherwise the per-token bytes of that length (a loop keeps the same
tensors at every step, so the bytes per token do not depend on L).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from megalab.utils.runtime import configure_runtime

RUNTIME = configure_runtime()  # before torch: allocator and OpenMP settings

import torch  # noqa: E402

D_MODEL, Z_DIM, V_DIM, N_DIM, GROUPS, CHUNK = 128, 64, 256, 16, 16, 2048

Case = Callable[[], None]
Build = tuple[torch.nn.Module, Callable[[], torch.Tensor]]


# -- cases ---------------------------------------------------------------------------------------
def build_case(kind: str, L: int) -> Build:
    """A module and a closure returning one forward's output (its sum is backpropagated)."""
    from megalab.models.mega.model import MegaBlock, MegaConfig
    from megalab.models.megalodon.cema import ComplexEMA
    from megalab.models.megalodon.model import MegalodonBlock, MegalodonConfig
    from megalab.models.megalodon.timestep_norm import TimestepNorm

    torch.manual_seed(0)
    x = torch.randn(1, L, D_MODEL, requires_grad=True)
    if kind == "mega_block":
        mega = MegaConfig(d_model=D_MODEL, z_dim=Z_DIM, v_dim=V_DIM, ffn_dim=V_DIM,
                          ema_dim=N_DIM, chunk_size=CHUNK, causal=True, prenorm=True,
                          rel_pos_bias="rotary", dropout=0.0)  # fmt: skip
        block = MegaBlock(mega)
        return block, lambda: block(x)[0]
    if kind == "megalodon_block":
        cfg = MegalodonConfig(d_model=D_MODEL, z_dim=Z_DIM, v_dim=V_DIM, ffn_dim=V_DIM,
                              cema_dim=N_DIM, chunk_size=CHUNK, norm_groups=GROUPS)  # fmt: skip
        lodon = MegalodonBlock(cfg)
        return lodon, lambda: lodon(x)[0]
    if kind.startswith("cema"):
        cema = ComplexEMA(D_MODEL, N_DIM)
        forms = {"cema_ours": lambda: cema(x)[0], "cema_authors": lambda: authors_cema(cema, x),
                 "cema_recurrence": lambda: recurrent_cema(cema, x)}  # fmt: skip
        return cema, forms[kind]
    if kind.startswith("tsn"):
        norm = TimestepNorm(D_MODEL, GROUPS)
        forms = {"tsn_ours": lambda: norm(x)[0], "tsn_welford_loop": lambda: welford_loop(norm, x),
                 "tsn_cumsum_fp32": lambda: cumsum_fp32(norm, x)}  # fmt: skip
        return norm, forms[kind]
    raise ValueError(kind)


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


# -- measuring -----------------------------------------------------------------------------------
def saved_bytes(module: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes autograd keeps for the backward of one forward (parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    return sum(v for k, v in seen.items() if k not in params)


def fwd_bwd(module: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> Case:
    def run() -> None:
        module.zero_grad(set_to_none=True)
        forward().sum().backward()

    return run


def rounds(cases: dict[str, Case], n_rounds: int, warmup: int) -> dict[str, list[float]]:
    """Time every case once per round, in an order rotated by one case per round."""
    for run in cases.values():
        for _ in range(warmup):
            run()
    names = list(cases)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(n_rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            t = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t)
    return times


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


SECTIONS: dict[str, dict] = {
    "block": {"title": "Block forward + backward", "baseline": "mega_block",
              "kinds": ["mega_block", "megalodon_block"]},
    "cema": {"title": "CEMA sub-layer forward + backward", "baseline": "cema_authors",
             "kinds": ["cema_recurrence", "cema_authors", "cema_ours"]},
    "tsn": {"title": "TimestepNorm forward + backward", "baseline": "tsn_cumsum_fp32",
            "kinds": ["tsn_welford_loop", "tsn_cumsum_fp32", "tsn_ours"]},
}  # fmt: skip
ESTIMATE = ["cema_recurrence@16384", "cema_recurrence@65536", "tsn_welford_loop@16384",
            "tsn_welford_loop@65536", "cema_authors@65536"]  # fmt: skip
# The authors' CEMA at 64K holds ~4 GB (three (d, N, L) complex tensors); on a shared machine
# its bytes per token are taken from 16K instead (every tensor it saves is linear in L).
MEMORY_AT: list[str] = []


def run_section(
    name: str, args: argparse.Namespace, done: list[dict], save: Callable[[list[dict]], None]
) -> list[dict]:
    """The rows of one section; `save(done + rows)` after every length (a run killed later, by
    the machine's memory or a time limit, keeps what it measured)."""
    spec = SECTIONS[name]
    rows: list[dict] = []
    timed: dict[str, dict] = {}  # kind -> its row at the longest timed length so far
    for L in sorted(args.lengths):
        n_rounds = args.long_rounds if L >= 65536 else args.rounds
        cases, saved, estimated = {}, {}, {}
        for kind in spec["kinds"]:
            tag = f"{kind}@{L}"
            if tag in args.estimate:
                estimated[kind] = tag in args.memory_at
                continue
            module, forward = build_case(kind, L)
            module.train()
            saved[kind] = saved_bytes(module, forward)
            cases[kind] = fwd_bwd(module, forward)
        times = rounds(cases, n_rounds, args.warmup)
        for kind in cases:
            row = {"section": name, "kind": kind, "L": L, "B": 1, "rounds": n_rounds,
                   "times_s": times[kind], **stats(times[kind]),
                   "tokens_per_s": L / statistics.median(times[kind]),
                   "saved_bytes_per_token": saved[kind] / L, "estimated": False}  # fmt: skip
            timed[kind] = row
            rows.append(row)
        del cases
        for kind, measure_memory in estimated.items():
            src = timed.get(kind)
            if src is None:
                raise SystemExit(f"{kind}@{L} is estimated but was never timed at a shorter L")
            scale = L / src["L"]
            per_token = src["saved_bytes_per_token"]
            if measure_memory:
                module, forward = build_case(kind, L)
                module.train()
                per_token = saved_bytes(module, forward) / L
                del module, forward
            est = src["median"] * scale
            memory = "measured" if measure_memory else f"from L={src['L']}"
            rows.append({"section": name, "kind": kind, "L": L, "B": 1, "rounds": 0,
                         "times_s": [], "median": est, "min": est, "max": est,
                         "tokens_per_s": L / est, "saved_bytes_per_token": per_token,
                         "estimated": True, "time_from_L": src["L"], "memory": memory})  # fmt: skip
        # Ratios against the baseline, per round where both were timed.
        at_L = [r for r in rows if r["L"] == L]
        base = next(r for r in at_L if r["kind"] == spec["baseline"])
        for r in at_L:
            if r["estimated"] or base["estimated"]:
                ratio = base["median"] / r["median"]
                r["speed_ratio"] = {"median": ratio, "min": ratio, "max": ratio}
            else:
                r["speed_ratio"] = stats([b / t for b, t in zip(base["times_s"], r["times_s"])])
            r["memory_ratio"] = r["saved_bytes_per_token"] / base["saved_bytes_per_token"]
        save(done + rows)
        print(f"  {name} L={L} done", file=sys.stderr, flush=True)
    return rows


def _x(v: float) -> str:
    """A ratio with two decimals, three significant digits below 0.1."""
    return f"{v:.2f}" if v >= 0.1 else f"{v:.3g}"


def render(record: dict) -> str:
    out = []
    for name, spec in SECTIONS.items():
        rows = [r for r in record["rows"] if r["section"] == name]
        if not rows:
            continue
        out += [
            f"\n### {spec['title']} (ratios against `{spec['baseline']}` at the same L)\n",
            "| variant | L | ms / iter (median, min-max) | tokens/s "
            "| × speed (median, min-max) | saved KB / token | × memory |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            s = r["speed_ratio"]
            if r["estimated"]:
                ms = f"≈ {1e3 * r['median']:,.0f} (est. from {r['time_from_L']:,})"
                speed = f"≈ {_x(s['median'])} (est.)"
                mem_note = " (measured)" if r["memory"] == "measured" else " (est.)"
            else:
                ms = f"{1e3 * r['median']:,.1f} ({1e3 * r['min']:,.1f}-{1e3 * r['max']:,.1f})"
                speed = f"{_x(s['median'])} ({_x(s['min'])}-{_x(s['max'])})"
                mem_note = ""
            if not r["estimated"] and any(
                b["estimated"] for b in rows if b["L"] == r["L"] and b["kind"] == spec["baseline"]
            ):
                speed = f"≈ {_x(s['median'])} (est. baseline)"
            out.append(
                f"| {r['kind']} | {r['L']:,} | {ms} | {r['tokens_per_s']:,.0f} | {speed} | "
                f"{r['saved_bytes_per_token'] / 1024:,.2f}{mem_note} | {r['memory_ratio']:.2f} |"
            )
    return "\n".join(out)


def settings(args: argparse.Namespace) -> dict:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "runtime": RUNTIME,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "device": "cpu",
        "dtype": "float32",
        "widths": {"d": D_MODEL, "z": Z_DIM, "v": V_DIM, "N": N_DIM, "groups": GROUPS},
        "chunk": CHUNK,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--long-rounds", type=int, default=3, help="rounds from L = 64K on")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: on a shared machine a second thread measures "
                    "contention)")  # fmt: skip
    ap.add_argument(
        "--estimate",
        nargs="*",
        default=ESTIMATE,
        help="kind@L cases estimated instead of run (see the module docstring)",
    )
    ap.add_argument(
        "--memory-at",
        nargs="*",
        default=MEMORY_AT,
        help="estimated kind@L cases whose saved bytes are measured by one forward",
    )
    ap.add_argument("--json", type=Path, help="write settings and the rows here (after each L)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# Megalodon benchmarks: {json.dumps(settings(args))}", file=sys.stderr)
    keys = ("rounds", "long_rounds", "warmup", "lengths", "estimate", "memory_at")

    def record(rows: list[dict]) -> dict:
        protocol = {k: getattr(args, k) for k in keys}
        return {"settings": settings(args), "protocol": protocol, "rows": rows}

    def save(rows: list[dict]) -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record(rows), indent=1))

    rows: list[dict] = []
    for name in args.sections:
        rows += run_section(name, args, rows, save)
    print(render(record(rows)))


if __name__ == "__main__":
    main()
