"""Long-context throughput and memory: Llama block vs Mega block (and Megalodon when its config
exists), training and decoding, as ratios against Llama from one run.

    python benchmarks/bench_long_context.py [--d-model 128] [--lengths 4096 16384 32768]
        [--contexts 1024 4096 16384 32768] [--models llama mega megalodon] [--json out.json]

1. Training: one block (a 1-layer backbone from `configs/model/<name>.yaml` at width d; Mega
   causal with chunk `--chunk`, Megalodon likewise), forward + backward on one sequence of L
   tokens, float32: tokens/s and peak memory, each case in a fresh process (peak RSS growth on
   CPU, `max_memory_allocated` on CUDA).
2. Decoding: a 2-layer model reads a context of N tokens (one pass with the state), then
   decodes `--decode` tokens one at a time with the carried state: ms per token and the
   state's size. Mega's and Megalodon's state is bounded; Llama's key/value cache grows with N.

Each case runs in its own process: one untimed warm-up pass, then `--rounds` timed repeats;
the time is their median, with min-max (the processes run one after the other, so load on a
shared machine affects the models alike only on average). Ratios are against Llama at the same
length. Thread count and allocator are printed with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# Per model: overrides at width d (attention widths as each paper's ratios).
SIZES = {
    "llama": lambda d, c: {"num_heads": max(1, d // 64), "ffn_dim": None},
    "mega": lambda d, c: {
        "z_dim": d // 4,
        "v_dim": 2 * d,
        "ffn_dim": 2 * d,
        "causal": True,
        "prenorm": True,
        "chunk_size": c,
        "rel_pos_bias": "rotary",
        "dropout": 0.0,
        "max_positions": 1024,
    },
    "megalodon": lambda d, c: {"chunk_size": c, "causal": True},
}


def build(name: str, d: int, layers: int, chunk: int):
    import hydra
    from omegaconf import OmegaConf

    from megalab.utils.paths import CONFIG_DIR

    path = CONFIG_DIR / "model" / f"{name}.yaml"
    cfg = OmegaConf.create({"model": OmegaConf.load(path), "data": {"max_len": 1 << 20,
                            "vocab_size": 256, "d_input": None, "pad_id": None,
                            "num_classes": None}})  # fmt: skip
    cfg.model.d_model = d
    cfg.model.backbone.num_layers = layers
    for k, v in SIZES.get(name, lambda d, c: {})(d, chunk).items():
        if k in cfg.model.backbone:
            cfg.model.backbone[k] = v
    torch.manual_seed(0)
    return hydra.utils.instantiate(cfg.model.backbone)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def train_case(name: str, d: int, L: int, chunk: int, rounds: int, device: str) -> dict:
    """Forward + backward of one block on one sequence (runs in its own process)."""
    model = build(name, d, 1, chunk).to(device).train()
    x = torch.randn(1, L, d, device=device, requires_grad=True)

    def step():
        model(x).y.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    before = rss_mb()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    step()  # warm-up, and the memory measurement
    peak = (
        (torch.cuda.max_memory_allocated() - base) / 2**20
        if device == "cuda"
        else rss_mb() - before
    )
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"times": times, "peak_mb": peak}


def decode_case(name: str, d: int, N: int, chunk: int, decode: int, rounds: int,
                device: str) -> dict:  # fmt: skip
    from megalab.long_context import state_bytes

    model = build(name, d, 2, chunk).to(device).eval()
    out = {}
    with torch.inference_mode():
        x = torch.randn(1, N, d, device=device)
        state = model(x, None, model.initial_state(1, x)).state
        step_x = torch.randn(1, 1, d, device=device)
        s = model(step_x, None, state).state  # warm-up
        times = []
        for _ in range(rounds):
            s = state
            t0 = time.perf_counter()
            for _ in range(decode):
                s = model(step_x, None, s).state
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / decode)
        out = {"times": times, "state_mb": state_bytes(s) / 2**20}
    return out


def run_isolated(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--case", *args], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(times: list[float]) -> tuple[float, float, float]:
    return statistics.median(times), min(times), max(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", nargs="+", default=["llama", "mega", "megalodon"])
    p.add_argument("--sections", nargs="+", default=["train", "decode"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--case", nargs="*", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.case is not None:  # a child process: one measurement, printed as JSON
        kind, name, n = a.case[0], a.case[1], int(a.case[2])
        if kind == "train":
            r = train_case(name, a.d_model, n, a.chunk, a.rounds, a.device)
        else:
            r = decode_case(name, a.d_model, n, a.chunk, a.decode, a.rounds, a.device)
        print(json.dumps(r))
        return
    from megalab.utils.paths import CONFIG_DIR

    models = [m for m in a.models if (CONFIG_DIR / "model" / f"{m}.yaml").exists()]
    skipped = sorted(set(a.models) - set(models))
    common = ["--d-model", str(a.d_model), "--chunk", str(a.chunk), "--rounds", str(a.rounds),
              "--decode", str(a.decode), "--device", a.device,
              "--threads", str(a.threads)]  # fmt: skip
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"device {a.device}, threads {a.threads}, d {a.d_model}, chunk {a.chunk}, "
          f"allocator {os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'default')}"
          + (f"; no config for {', '.join(skipped)}" if skipped else ""))  # fmt: skip
    rows = []
    if "train" in a.sections:
        print("\n| model | L | ms / step (min-max) | tokens/s | x speed | peak MB | x memory |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for L in a.lengths:
            res = {m: run_isolated(["train", m, str(L), *common]) for m in models}
            base = res.get("llama")
            for m in models:
                med, lo, hi = summary(res[m]["times"])
                bmed = summary(base["times"])[0] if base else med
                speed, mem = bmed / med, res[m]["peak_mb"] / base["peak_mb"] if base else 1.0
                print(f"| {m} | {L} | {med * 1e3:,.0f} ({lo * 1e3:,.0f}-{hi * 1e3:,.0f}) | "
                      f"{L / med:,.0f} | {speed:.2f} | {res[m]['peak_mb']:,.0f} | {mem:.2f} |",
                      flush=True)  # fmt: skip
                rows.append({"section": "train", "model": m, "L": L, **res[m]})
    if "decode" in a.sections:
        print("\n| model | context N | ms / token (min-max) | tokens/s | state MB |")
        print("|---|---:|---:|---:|---:|")
        for N in a.contexts:
            for m in models:
                r = run_isolated(["decode", m, str(N), *common])
                med, lo, hi = summary(r["times"])
                print(f"| {m} | {N} | {med * 1e3:.2f} ({lo * 1e3:.2f}-{hi * 1e3:.2f}) | "
                      f"{1 / med:,.0f} | {r['state_mb']:.2f} |", flush=True)  # fmt: skip
                rows.append({"section": "decode", "model": m, "N": N, **r})
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
