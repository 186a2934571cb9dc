"""Mega's speed and memory against its baselines: ratios from one process, rotated rounds.

    python benchmarks/bench_mega.py [--full] [--sections layer ema attention precision compile
        kernel scaling] [--lengths 1024 4096] [--tokens 8192] [--rounds 5] [--warmup 1]
        [--threads 1] [--json results.json]

The default is the quick suite (minutes: L = 1K and 4K at 8,192 tokens per batch, 5 rounds);
`--full` measures L = 1K, 4K and 16K at 16,384 tokens per batch over 7 rounds. Explicit options
override either preset.

Protocol (every section): all cases of a section are built in one process; each runs `--warmup`
untimed passes; then `--rounds` rounds run every case once, in an order rotated by one case per
round, so that a drift in the machine's load falls on every case alike. A case's time is its
median over rounds (with min-max); its ratio against the section's baseline is computed per
round (baseline time / case time, at the same length) and reported as the median with min-max.
Two clocks are read around every pass: wall time (`perf_counter`) and the process's CPU time
(`process_time`, user + system of all its threads). On a machine shared with other jobs the wall
time also counts the time the process waited for a core; its CPU time does not (but still counts
the page faults and cache misses the code causes), so with one intra-op thread the CPU-time
ratios are the stable measure of the code and the wall-time ratios show what the load added.
The process's thread and allocator settings and the machine's load average are recorded in the
JSON (`settings`). Memory is what autograd keeps for the backward, per token
(`saved_tensors_hooks`, unique storages, parameters excluded): deterministic, unlike RSS.

Sections (B = tokens // L, widths of LRA Text: d = 128, z = 64, v = d_FFN = 256, h = 16, fp32):

- layer: one block forward + backward: `transformer` (megalab's TransformerLayer: 4 heads,
  d_FFN = 4d, pre-norm, PyTorch SDPA), `mega_chunk128`, `mega_full` (fused attention, weights
  recomputed in the backward: the default beyond 512 keys), `mega_full_keep`
  (`attention_recompute=False`) and `mega_full_mkl` (`mega_full` with the fused attention's GEMMs
  on MKL's `bmm` instead of oneDNN, `megalab.nn.fused_attention.ONEDNN` off: what the attention
  kernel gives without the GEMM library).
- ema: the bidirectional EMA convolution alone, forward + backward: `conv_autograd` (rfft/irfft
  through autograd, as before `megalab.nn.fft_conv`) and `conv_ours` (`fft_conv_lean`), each
  with its share of the `mega_chunk128` layer step (timed in the same rounds); and the causal EMA
  sub-layer: `ema_authors` (the (d, h, L) powers, FFTs of length 2L), `ema_ours`.
- attention: Mega's full attention alone: `sdpa_math` (the unfused form: SDPA's math kernel with
  the bias as a float mask), `fused_recompute`, `fused_keep`, and both with their GEMMs on MKL
  (`fused_recompute_mkl`, `fused_keep_mkl`).
- precision: `mega_chunk128`, `mega_full` and `transformer` under CPU bf16 autocast
  (`<layer>_bf16`) against float32 (the ratio column is against `mega_chunk128` in fp32; compare
  each `_bf16` row with its own fp32 row).
- compile: `mega_chunk128` eager against `torch.compile` of the whole block
  (`mega_chunk128_compiled`, what `task.compile=true` does; default inductor, compilation falls
  in the warm-up passes) and of the block with the EMA sub-layer (kernel and FFT convolution)
  left eager (`mega_chunk128_compiled_real`: inductor generates no code for complex tensors).
- kernel: the bidirectional EMA kernel: `kernel_naive` ((2d, h, L) tensor of powers) and
  `kernel_ours` (blocked Vandermonde).
- scaling: the `mega_chunk128` layer at one sequence of 4K, 16K and 64K tokens, in two child
  processes, glibc malloc tuned (`megalab.utils.runtime`) and not (`MEGALAB_MALLOC_TUNING=0`):
  time per token relative to 4K.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from megalab.utils.runtime import configure_runtime

RUNTIME = configure_runtime()  # before torch: allocator and OpenMP settings

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

D_MODEL, Z_DIM, V_DIM, EMA_DIM, HEADS = 128, 64, 256, 16, 4

Case = Callable[[], None]


# -- cases ---------------------------------------------------------------------------------------
def _mega_block(L: int, chunk: int, recompute: bool | None = None):
    from megalab.models.mega.model import MegaBlock, MegaConfig

    cfg = MegaConfig(d_model=D_MODEL, z_dim=Z_DIM, v_dim=V_DIM, ffn_dim=V_DIM, ema_dim=EMA_DIM,
                     chunk_size=chunk, max_positions=max(L, 1024), dropout=0.0,
                     attention_recompute=recompute)  # fmt: skip
    return MegaBlock(cfg)


def layer_case(kind: str, L: int, B: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """A module and a closure returning the output of one forward (whose sum is backpropagated)."""
    torch.manual_seed(0)
    x = torch.randn(B, L, D_MODEL, requires_grad=True)
    if kind == "transformer":
        from megalab.models.transformer.model import TransformerLayer

        m = TransformerLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, prenorm=True)
        return m, lambda: m(x, None, False)
    if kind == "mega_chunk128":
        m = _mega_block(L, 128)
    elif kind == "mega_full":
        m = _mega_block(L, -1)
    elif kind == "mega_full_keep":
        m = _mega_block(L, -1, recompute=False)
    else:
        raise ValueError(kind)
    return m, lambda: m(x)[0]


def conv_case(kind: str, L: int, B: int) -> tuple[None, Callable[[], torch.Tensor]]:
    """The bidirectional EMA convolution as the layer runs it: x (B, L, D) read as (B, D, L)."""
    from megalab.nn.ema_kernel import fft_conv, next_fast_len
    from megalab.nn.fft_conv import fft_conv_lean

    torch.manual_seed(0)
    n = next_fast_len(2 * L - 1)
    x = torch.randn(B, L, D_MODEL, requires_grad=True)
    k = torch.randn(D_MODEL, n // 2 + 1, dtype=torch.complex64, requires_grad=True)
    conv = fft_conv_lean if kind == "conv_ours" else fft_conv
    return None, lambda: conv(x.transpose(1, 2), k, n).transpose(1, 2)


def ema_case(kind: str, L: int, B: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    from megalab.nn.ema import DampedEMA

    torch.manual_seed(0)
    x = torch.randn(B, L, D_MODEL, requires_grad=True)
    ema = DampedEMA(D_MODEL, EMA_DIM, bidirectional=False)
    if kind == "ema_ours":
        return ema, lambda: ema(x)[0]
    return ema, lambda: authors_ema(ema, x)


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


def kernel_case(kind: str, L: int, B: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    from megalab.nn.ema import DampedEMA

    torch.manual_seed(0)
    ema = DampedEMA(D_MODEL, EMA_DIM, bidirectional=True)
    if kind == "kernel_ours":
        return ema, lambda: ema.kernel(L)
    return ema, lambda: naive_kernel(ema, L)


def attention_case(kind: str, L: int, B: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    from megalab.nn.attention import ChunkedAttention, chunked_attention

    torch.manual_seed(0)
    att = ChunkedAttention(Z_DIM, -1, "softmax", "simple", max_positions=L)
    q, k = (torch.randn(B, L, Z_DIM, requires_grad=True) for _ in range(2))
    v = torch.randn(B, L, V_DIM, requires_grad=True)
    if kind == "sdpa_math":
        return att, lambda: chunked_attention(q, k, v, None, -1, att._attend_unfused)[0]
    att.recompute = kind == "fused_recompute"
    return att, lambda: att(q, k, v)[0]


def precision_case(kind: str, L: int, B: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """`<layer>` in float32 or `<layer>_bf16` under CPU bf16 autocast (EMA/FFT, norms in fp32)."""
    base = kind.removesuffix("_bf16")
    module, forward = layer_case(base, L, B)
    if not kind.endswith("_bf16"):
        return module, forward

    def autocast_forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward().float()

    return module, autocast_forward


def compile_case(kind: str, L: int, B: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """`mega_chunk128` eager or `torch.compile`d (compilation happens in the warm-up)."""
    torch.manual_seed(0)
    x = torch.randn(B, L, D_MODEL, requires_grad=True)
    block = _mega_block(L, 128)
    if kind == "mega_chunk128_compiled_real":
        # The EMA (complex kernel spectrum, FFTs) runs eager between two compiled graphs.
        block.maga.ema.forward = torch.compiler.disable(block.maga.ema.forward)
    run = torch.compile(block) if kind.startswith("mega_chunk128_compiled") else block
    return block, lambda: run(x)[0]


# -- measuring -----------------------------------------------------------------------------------
def saved_bytes(module: torch.nn.Module | None, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes autograd keeps for the backward of one forward (parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    params = set()
    if module is not None:
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    return sum(v for k, v in seen.items() if k not in params)


Times = dict[str, dict[str, list[float]]]  # case -> {"wall": [...], "cpu": [...]} per round


def rounds(cases: dict[str, Case], n_rounds: int, warmup: int) -> Times:
    """Time every case once per round (wall and CPU), in an order rotated by one case per round."""
    for run in cases.values():
        for _ in range(warmup):
            run()
    names = list(cases)
    times: Times = {k: {"wall": [], "cpu": []} for k in names}
    for r in range(n_rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = time.perf_counter(), time.process_time()
            cases[name]()
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    return times


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def clocks(times: dict[str, list[float]]) -> dict:
    """The row fields of one case's times: medians with min-max on both clocks."""
    return {"times_s": times["wall"], "cpu_times_s": times["cpu"], **stats(times["wall"]),
            "cpu": stats(times["cpu"])}  # fmt: skip


def ratios(base: dict[str, list[float]], case: dict[str, list[float]]) -> dict:
    """Per-round speed ratios baseline / case on both clocks (median, min, max)."""
    wall = [b / t for b, t in zip(base["wall"], case["wall"])]
    cpu = [b / t for b, t in zip(base["cpu"], case["cpu"])]
    return {"speed_ratio": stats(wall), "cpu_speed_ratio": stats(cpu)}


def fwd_bwd(module: torch.nn.Module | None, forward: Callable[[], torch.Tensor]) -> Case:
    def run() -> None:
        if module is not None:
            module.zero_grad(set_to_none=True)
        forward().sum().backward()

    return run


def without_onednn(run: Case) -> Case:
    """`run` with the fused attention's GEMMs on `bmm` (MKL) instead of oneDNN."""
    from megalab.nn import fused_attention

    def mkl() -> None:
        onednn, fused_attention.ONEDNN = fused_attention.ONEDNN, False
        try:
            run()
        finally:
            fused_attention.ONEDNN = onednn

    return mkl


SECTIONS: dict[str, dict] = {
    "layer": {"title": "Layer forward + backward", "baseline": "transformer",
              "kinds": ["transformer", "mega_chunk128", "mega_full", "mega_full_keep",
                        "mega_full_mkl"],
              "build": layer_case},
    "ema": {"title": "EMA convolution (bidirectional) and causal EMA sub-layer, forward + backward",
            "baseline": "conv_autograd",
            "kinds": ["conv_autograd", "conv_ours", "ema_authors", "ema_ours"],
            "build": None},
    "attention": {"title": "Full attention alone (softmax, simple bias), forward + backward",
                  "baseline": "sdpa_math",
                  "kinds": ["sdpa_math", "fused_recompute", "fused_keep", "fused_recompute_mkl",
                            "fused_keep_mkl"],
                  "build": attention_case},
    "precision": {"title": "bf16 autocast against float32, layer forward + backward",
                  "baseline": "mega_chunk128",
                  "kinds": ["mega_chunk128", "mega_chunk128_bf16", "mega_full",
                            "mega_full_bf16", "transformer", "transformer_bf16"],
                  "build": precision_case},
    "compile": {"title": "torch.compile of the Mega-chunk layer", "baseline": "mega_chunk128",
                "kinds": ["mega_chunk128", "mega_chunk128_compiled",
                          "mega_chunk128_compiled_real"], "build": compile_case},
    "kernel": {"title": "EMA kernel construction (bidirectional), forward + backward",
               "baseline": "kernel_naive", "kinds": ["kernel_naive", "kernel_ours"],
               "build": kernel_case},
}  # fmt: skip


def _ema_build(kind: str, L: int, B: int):
    if kind.startswith("conv"):
        return conv_case(kind, L, B)
    if kind == "mega_chunk128":
        return layer_case(kind, L, B)
    return ema_case(kind, L, B)


def run_section(name: str, args: argparse.Namespace) -> list[dict]:
    spec = SECTIONS[name]
    build = spec["build"] or _ema_build
    kinds = list(spec["kinds"]) + (["mega_chunk128"] if name == "ema" else [])
    rows = []
    for L in args.lengths:
        B = max(1, args.tokens // L)
        cases, saved = {}, {}
        for kind in kinds:
            module, forward = build(kind.removesuffix("_mkl"), L, B)
            # (compiled graphs run autograd's saved-tensor hooks differently: not counted)
            compiled = "compiled" in kind
            saved[kind] = float("nan") if compiled else saved_bytes(module, forward)
            cases[kind] = fwd_bwd(module, forward)
            if kind.endswith("_mkl"):
                cases[kind] = without_onednn(cases[kind])
        times = rounds(cases, args.rounds, args.warmup)
        base = times[spec["baseline"]]
        for kind in kinds:
            row = {"section": name, "kind": kind, "L": L, "B": B, **clocks(times[kind]),
                   "tokens_per_s": B * L / statistics.median(times[kind]["wall"]),
                   "saved_bytes_per_token": saved[kind] / (B * L),
                   **ratios(base, times[kind])}  # fmt: skip
            if name == "ema" and kind.startswith("conv"):
                layer = times["mega_chunk128"]["cpu"]
                row["share_of_layer"] = stats([t / lt for t, lt in zip(times[kind]["cpu"], layer)])
            rows.append(row)
        print(f"  {name} L={L} done", file=sys.stderr, flush=True)
    return rows


def scaling_child(args: argparse.Namespace) -> list[dict]:
    rows = []
    cases = {}
    for L in args.scaling_lengths:
        module, forward = layer_case("mega_chunk128", L, 1)
        cases[str(L)] = fwd_bwd(module, forward)
    times = rounds(cases, args.rounds, args.warmup)
    for L in args.scaling_lengths:
        t = times[str(L)]
        rows.append({"section": "scaling", "kind": "mega_chunk128", "L": L, "B": 1, **clocks(t),
                     "ms_per_ktoken": 1e6 * statistics.median(t["wall"]) / L,
                     "cpu_ms_per_ktoken": 1e6 * statistics.median(t["cpu"]) / L})  # fmt: skip
    return rows


def run_scaling(args: argparse.Namespace) -> list[dict]:
    rows = []
    for malloc in ("tuned", "default"):
        env = dict(os.environ)
        env.pop("MEGALAB_MALLOC_TUNING", None)
        if malloc == "default":
            env["MEGALAB_MALLOC_TUNING"] = "0"
        cmd = [sys.executable, __file__, "--scaling-child", "--rounds", str(args.rounds),
               "--warmup", str(args.warmup), "--threads", str(args.threads),
               "--scaling-lengths", *map(str, args.scaling_lengths)]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            rows.append({"section": "scaling", "malloc": malloc, "error": out.stderr[-500:]})
            continue
        child = json.loads(out.stdout.strip().splitlines()[-1])
        first = child["rows"][0]
        for row in child["rows"]:
            row.update(malloc=malloc, settings=child["settings"],
                       relative_to_first=row["ms_per_ktoken"] / first["ms_per_ktoken"],
                       cpu_relative_to_first=row["cpu_ms_per_ktoken"]
                       / first["cpu_ms_per_ktoken"])  # fmt: skip
            rows.append(row)
        print(f"  scaling ({malloc} malloc) done", file=sys.stderr, flush=True)
    return rows


def settings() -> dict:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "runtime": RUNTIME,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "device": "cpu",
        "dtype": "float32",
    }


def merge(old: dict, new: dict) -> dict:
    """`new` with the rows (and section notes) of the sections it did not measure from `old`.

    Settings and protocol (lengths aside) must agree, so that one header describes every table.
    """
    free = ("loadavg", "lengths", "scaling_lengths")
    for key in ("settings", "protocol"):
        a = {k: v for k, v in old[key].items() if k not in free}
        b = {k: v for k, v in new[key].items() if k not in free}
        if a != b:
            raise SystemExit(f"--update: the {key} differ from the existing JSON ({a} vs {b})")
    kept = [r for r in old["rows"] if r["section"] not in new["sections"]]
    sections = {k: v for k, v in old.get("sections", {}).items() if k not in new["sections"]}
    return {**new, "sections": {**sections, **new["sections"]}, "rows": kept + new["rows"]}


QUICK = {"lengths": [1024, 4096], "tokens": 8192, "rounds": 5}
FULL = {"lengths": [1024, 4096, 16384], "tokens": 16384, "rounds": 7}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", default=["layer", "ema", "attention", "precision",
                    "compile", "kernel", "scaling"], choices=[*SECTIONS, "scaling"])  # fmt: skip
    ap.add_argument(
        "--full",
        action="store_true",
        help="all lengths: 1K, 4K, 16K at 16,384 tokens per batch, 7 rounds",
    )
    ap.add_argument("--lengths", type=int, nargs="+")
    ap.add_argument("--scaling-lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--tokens", type=int, help="tokens per batch (B = tokens // L)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: on a shared machine a second thread measures "
                    "contention, see docs/benchmarks.md)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write settings and all rows here")
    ap.add_argument("--update", action="store_true",
                    help="keep the rows of the sections not measured now from an existing --json "
                    "(re-measure some sections only)")  # fmt: skip
    ap.add_argument("--scaling-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    preset = FULL if args.full else QUICK
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    torch.set_num_threads(args.threads)
    if args.scaling_child:
        print(json.dumps({"rows": scaling_child(args), "settings": settings()}))
        return
    print(f"# Mega benchmarks: {json.dumps(settings())}", file=sys.stderr)
    rows: list[dict] = []
    measured: dict[str, dict] = {}
    for name in args.sections:
        measured[name] = {"start": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          "loadavg": list(os.getloadavg())}  # fmt: skip
        rows += run_scaling(args) if name == "scaling" else run_section(name, args)
    keys = ("full", "rounds", "warmup", "tokens", "lengths", "scaling_lengths", "threads")
    record = {"settings": settings(), "protocol": {k: getattr(args, k) for k in keys},
              "sections": measured, "rows": rows}  # fmt: skip
    if args.update and args.json and args.json.exists():
        record = merge(json.loads(args.json.read_text()), record)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
    from report import render  # benchmarks/report.py

    print(render(record))


if __name__ == "__main__":
    main()
