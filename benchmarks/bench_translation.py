"""Translation models: training step and decoding speed, as ratios against baselines, one run.

    python benchmarks/bench_translation.py [--device cpu|cuda] [--rounds 5]

Models at their WMT'16 sizes (Table 10, a 33,000-entry shared dictionary): Mega-base
(`MegaEncoderDecoder`, 63.3M parameters) and Transformer-base (`TransformerEncoderDecoder`,
61.0M). Two tables:

1. Training step (teacher forcing, label-smoothed loss, forward + backward) on B sentence pairs
   of L source and L target tokens: target tokens/s, ratio against Transformer-base.
2. Decoding B sentences of L source tokens for exactly T output tokens (end of sentence
   forbidden before T, so every case does the same work): output tokens/s of beam search
   (beam 5) and greedy decoding with the incremental state, against greedy decoding that
   reruns the whole decoder on the prefix at every step (no state: the baseline the cached EMA
   state and keys/values replace).

Timing: one warm-up round, then `--rounds` rounds in which every case runs once, in an order
rotated each round (so slow phases of a shared machine spread over all cases); we report the
median and the min-max over rounds. Intra-op threads default to 1 on CPU (see
docs/benchmarks.md), recorded in the header with the allocator and the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def build(kind: str, vocab: int, device: str) -> torch.nn.Module:
    from megalab.models.mega.translation import MegaEncoderDecoderConfig
    from megalab.models.transformer.translation import TransformerEncoderDecoderConfig

    torch.manual_seed(0)
    if kind == "mega":
        return MegaEncoderDecoderConfig(vocab, 1, dropout=0.0).build().to(device)
    return TransformerEncoderDecoderConfig(vocab, 1, dropout=0.0).build().to(device)


def batch(B: int, L: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, vocab, (B, L), generator=g)
    tgt = torch.randint(4, vocab, (B, L), generator=g)
    src[:, -1] = tgt[:, -1] = 2
    return src.to(device), tgt.to(device)


def train_case(model: torch.nn.Module, src: torch.Tensor, tgt: torch.Tensor) -> Callable:
    model.train()
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], 2), tgt[:, :-1]], dim=1)

    def run() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(src, None, tgt_in, None)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), label_smoothing=0.1)
        loss.backward()

    return run


def decode_case(model, src: torch.Tensor, T: int, how: str) -> Callable:
    from megalab.generation.beam import (
        GenerationConfig,
        SpecialTokens,
        beam_search,
        greedy_search,
    )

    model.eval()
    cfg = GenerationConfig(beam=5 if how == "beam5" else 1, max_len_b=T, min_len=T)
    special = SpecialTokens(eos=2, pad=1, unk=3)

    @torch.no_grad()
    def naive() -> None:
        enc = model.encode(src, None)
        prefix = src.new_full((src.shape[0], 1), 2)
        for _ in range(T + 1):
            logits = model.decode(prefix, None, enc)[:, -1].float()
            logits[:, 1] = float("-inf")
            prefix = torch.cat([prefix, logits.argmax(-1, keepdim=True)], dim=1)

    if how == "greedy_naive":
        return naive
    if how == "greedy":
        return lambda: greedy_search(model, src, None, cfg, special)
    return lambda: beam_search(model, src, None, cfg, special)


def timed(cases: dict[str, Callable], rounds: int, sync: Callable[[], None]) -> dict:
    """Warm-up, then `rounds` rotated rounds; seconds per case."""
    names = list(cases)
    for name in names:
        cases[name]()
    sync()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync()
            t = time.perf_counter()
            cases[name]()
            sync()
            times[name].append(time.perf_counter() - t)
    return times


def table(title: str, times: dict, work: dict, baseline: str, unit: str) -> str:
    lines = [f"\n## {title} (ratios against `{baseline}`)\n",
             f"| case | ms (median) | min-max ms | {unit}/s | × speed |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    base = work[baseline] / statistics.median(times[baseline])
    for name, ts in times.items():
        med = statistics.median(ts)
        rate = work[name] / med
        lines.append(
            f"| {name} | {1e3 * med:,.0f} | {1e3 * min(ts):,.0f}-{1e3 * max(ts):,.0f} | "
            f"{rate:,.1f} | {rate / base:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=33000)
    ap.add_argument("--train-batch", type=int, nargs=2, default=[8, 32], metavar=("B", "L"))
    ap.add_argument("--decode", type=int, nargs=3, default=[4, 24, 24], metavar=("B", "L", "T"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (CPU: 1)")
    args = ap.parse_args()
    threads = args.threads or (1 if args.device == "cpu" else torch.get_num_threads())
    torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("MALLOC_CONF") or "default"
    print(f"# Translation benchmark: device={args.device}, torch {torch.__version__}, "
          f"{threads} intra-op threads, allocator {alloc}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"vocab {args.vocab}, {args.rounds} rounds after one warm-up")  # fmt: skip
    models = {k: build(k, args.vocab, args.device) for k in ("transformer", "mega")}

    B, L = args.train_batch
    src, tgt = batch(B, L, args.vocab, args.device)
    cases = {f"{k}_base": train_case(m, src, tgt) for k, m in models.items()}
    times = timed(cases, args.rounds, sync)
    work = dict.fromkeys(cases, B * L)
    print(table(f"Training step, B={B} x L={L}", times, work, "transformer_base", "target tokens"))

    B, L, T = args.decode
    src, _ = batch(B, L, args.vocab, args.device)
    cases = {
        f"{k}_{how}": decode_case(m, src, T, how)
        for k, m in models.items()
        for how in ("greedy_naive", "greedy", "beam5")
    }
    times = timed(cases, args.rounds, sync)
    work = dict.fromkeys(cases, B * (T + 1))
    print(table(f"Decoding B={B}, source L={L}, T={T} tokens + EOS", times, work,
                "mega_greedy_naive", "output tokens"))  # fmt: skip


if __name__ == "__main__":
    main()
