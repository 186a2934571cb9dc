"""LaMemo against Transformer-XL: layer speed and memory, look-ahead overhead, FLOPs, decoding.

    python benchmarks/bench_lamemo.py [--device cpu|cuda] [--mems 150 300 600] [--batch 4]
        [--rounds 7] [--warmup 2] [--decode-tokens 32] [--sections layer flops decode]

All ratios come from one process: every case is warmed up, then the cases run in rotated
rounds (each round times every case once, in a shifted order) and we report the median
tokens/s with its min-max, and the LaMemo / XL time ratio as the median of the per-round
ratios with their min-max. The process starts with the allocator and thread settings of
training (`megalab.utils.runtime`), printed in the header with the machine's load. At the
WikiText-103 layer width of both papers (d 410, 10 heads of 41, FFN 2100), segment L = 150:

1. One layer, forward + backward with a memory of M rows (M = 150 is the paper's setting; a
   longer M is the Fig. 5 regime, where each memory row takes several look-ahead windows):
   tokens/s (segment tokens), and the activation memory autograd keeps for the backward pass
   (the bytes of the distinct tensors saved by the graph, measured with saved-tensor hooks; on
   CUDA also the peak allocation).
2. FLOPs per predicted token of the 16-layer backbones (forward, `FlopCounterMode`), the
   paper's Table 1 column: 157M (XL) vs 191M (LaMemo), ratio 1.22.
3. Incremental decoding of the 16-layer backbones with a full memory of 150: tokens/s when
   feeding one token at a time (the state is the memory).
"""

from __future__ import annotations

from megalab.utils.runtime import configure_runtime

# The allocator and OpenMP settings of training must precede the first import of torch.
RUNTIME = configure_runtime()

import argparse  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from megalab.models.lamemo.model import LaMemo, LaMemoConfig, LaMemoLayer  # noqa: E402
from megalab.models.transformer_xl.model import TransformerXL, TransformerXLConfig, XLLayer  # noqa: E402
from megalab.nn.relative_attention import (  # noqa: E402
    SinusoidPositions,
    causal_mask,
    relative_distances,
)

D, H, DH, FFN, L = 410, 10, 41, 2100, 150


def layer_case(kind: str, M: int, B: int, device: str):
    """A closure running one layer forward + backward over a segment with M memory rows."""
    torch.manual_seed(0)
    kw = dict(d_model=D, num_heads=H, head_dim=DH, ffn_dim=FFN, dropout=0.0, mem_len=M)
    h = torch.randn(B, L, D, device=device, requires_grad=True)
    mem = torch.randn(B, M, D, device=device, requires_grad=kind == "lamemo")
    u, v, vf = (torch.randn(H, DH, device=device, requires_grad=True) for _ in range(3))
    masked = causal_mask(L, M, device=device)
    positions = SinusoidPositions(D).to(device)
    if kind == "xl":
        layer = XLLayer(TransformerXLConfig(**kw)).to(device)
        distances = relative_distances(M + L, device=device)

        def run():
            return layer(h, mem, positions(distances), u, v, masked)

    else:
        layer = LaMemoLayer(LaMemoConfig(**kw)).to(device)
        distances = relative_distances(M + L, future=M, device=device)
        c_old = torch.randn(B, M, H, DH, device=device)
        s_old = torch.randn(B, M, H, device=device)

        def run():
            table = positions(distances)
            y, mem_y, _, _ = layer(h, mem, c_old, s_old, table, u, v, vf, masked)
            return y + 0 * mem_y.sum()  # the refreshed memory feeds the next layer

    return run


def saved_bytes(run) -> int:
    """Bytes of the distinct tensors autograd saves for the backward of `run()`."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        seen[key] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run()
    y.sum().backward()
    return sum(seen.values())


def peak_bytes(run, device: str) -> int | None:
    """CUDA: the peak allocation of one forward + backward above what was allocated before."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run().sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def time_rounds(cases: dict, rounds: int, warmup: int, device: str) -> dict[str, list[float]]:
    def once(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    names = list(cases)
    for name in names:
        for _ in range(warmup):
            once(cases[name])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(once(cases[name]))
    return times


def rate(x: float) -> str:
    """Tokens/s with at least 3 significant digits (decoding on a CPU is a few tokens/s)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def fmt(ts: list[float], tokens: int) -> str:
    med = statistics.median(ts)
    return f"{rate(tokens / med)} ({rate(tokens / max(ts))}-{rate(tokens / min(ts))})"


def ratio(times: dict[str, list[float]]) -> str:
    """LaMemo / XL time: the median of the per-round ratios (both timed in the same round),
    with their min-max."""
    r = [a / b for a, b in zip(times["lamemo"], times["xl"])]
    return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"


def backbone(kind: str, mem_len: int, device: str):
    torch.manual_seed(0)
    kw = dict(d_model=D, num_layers=16, num_heads=H, head_dim=DH, ffn_dim=FFN, mem_len=mem_len)
    model = (LaMemo if kind == "lamemo" else TransformerXL)(**kw)
    return model.to(device).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mems", type=int, nargs="+", default=[150, 300, 600])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to run"
    )
    args = parser.parse_args()
    dev = args.device
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs (load average {load}), device {dev}, float32; "
        f"intra-op threads {torch.get_num_threads()} ({RUNTIME['threads']}), OMP_WAIT_POLICY "
        f"{RUNTIME['omp_wait_policy']}, malloc {RUNTIME['malloc']}, CUDA allocator "
        f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'default')}; {args.rounds} rotated rounds "
        f"after {args.warmup} warm-up runs; median (min-max)"
    )
    for section in args.sections:
        SECTIONS[section](args)


def bench_layers(args: argparse.Namespace) -> None:
    dev, B = args.device, args.batch
    print("\n## One layer, forward + backward (segment 150, batch", B, ")\n")
    cuda = " | peak XL | peak LaMemo | ratio" if dev == "cuda" else ""
    print("| memory M | XL tokens/s | LaMemo tokens/s | LaMemo / XL time | saved for backward "
          f"XL | LaMemo | ratio{cuda} |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (3 if cuda else 0))
    for M in args.mems:
        cases = {}
        for kind in ("xl", "lamemo"):
            run = layer_case(kind, M, B, dev)
            cases[kind] = lambda run=run: run().sum().backward()
        mem = {k: saved_bytes(layer_case(k, M, B, dev)) for k in ("xl", "lamemo")}
        peak = {k: peak_bytes(layer_case(k, M, B, dev), dev) for k in ("xl", "lamemo")}
        t = time_rounds(cases, args.rounds, args.warmup, dev)
        peaks = ""
        if peak["xl"] is not None and peak["lamemo"] is not None:
            peaks = (
                f" {peak['xl'] / 2**20:.0f} MiB | {peak['lamemo'] / 2**20:.0f} MiB | "
                f"{peak['lamemo'] / peak['xl']:.2f}x |"
            )
        print(
            f"| {M} | {fmt(t['xl'], B * L)} | {fmt(t['lamemo'], B * L)} | {ratio(t)} | "
            f"{mem['xl'] / 2**20:.0f} MiB | {mem['lamemo'] / 2**20:.0f} MiB | "
            f"{mem['lamemo'] / mem['xl']:.2f}x |{peaks}"
        )


def bench_flops(args: argparse.Namespace) -> None:
    dev = args.device
    print("\n## FLOPs per predicted token, 16-layer backbones, forward, memory = segment = 150\n")
    flops = {}
    for kind in ("xl", "lamemo"):
        model = backbone(kind, 150, dev)
        x = torch.randn(1, L, D, device=dev)
        with torch.no_grad():
            state = model(x, state=model.initial_state(1, x)).state
            with FlopCounterMode(display=False) as counter:
                model(x, state=state)
        flops[kind] = counter.get_total_flops() / L
    print(f"XL {flops['xl'] / 1e6:.1f}M, LaMemo {flops['lamemo'] / 1e6:.1f}M, ratio "
          f"{flops['lamemo'] / flops['xl']:.3f} (paper: 157M, 191M, 1.217; ours count the "
          "backbone's matrix products, without the embedding and softmax)")  # fmt: skip


def bench_decode(args: argparse.Namespace) -> None:
    dev, B = args.device, args.batch
    print(f"\n## Decoding one token at a time, 16 layers, memory 150, batch {B}\n")
    cases = {}
    for kind in ("xl", "lamemo"):
        model = backbone(kind, 150, dev)
        x = torch.randn(B, L, D, device=dev)
        with torch.no_grad():
            warm = model(x, state=model.initial_state(B, x)).state
        tokens = torch.randn(B, args.decode_tokens, D, device=dev)

        def decode(model=model, warm=warm, tokens=tokens):
            state = warm
            with torch.no_grad():
                for i in range(tokens.shape[1]):
                    state = model(tokens[:, i : i + 1], state=state).state

        cases[kind] = decode
    t = time_rounds(cases, args.rounds, args.warmup, dev)
    n = B * args.decode_tokens
    print("| | XL tokens/s | LaMemo tokens/s | LaMemo / XL time |\n|---|---:|---:|---:|")
    print(f"| decode | {fmt(t['xl'], n)} | {fmt(t['lamemo'], n)} | {ratio(t)} |")


SECTIONS = {"layer": bench_layers, "flops": bench_flops, "decode": bench_decode}

if __name__ == "__main__":
    main()
