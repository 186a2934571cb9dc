"""The kernels one training step of a block launches, counted on the CPU, by source line.

    python benchmarks/count_launches.py [--blocks llama mega_chunk megalodon_chunk] [--d 64]
        [--length 64] [--batch 2] [--chunk 32] [--lines 25] [--json out.json]

On CUDA every aten operator that computes something (not a view, not an empty allocation)
launches at least one kernel, and every Triton kernel one. This counts both without a GPU: the
blocks of `benchmarks/bench_gpu.py` run one forward and backward under bf16 autocast with the
Triton kernels and the joined projections taken as on CUDA (`kernels.forced`, under Triton's
interpreter, and `megalab.nn.linear.joined_on`), a `TorchDispatchMode` counts the operators
outside the kernels, and each launch is charged to the megalab source line that made it (a
backward operator to the forward line that recorded its autograd node, from autograd's
anomaly-mode traceback). The count does not depend on the sizes,
but for the chunks: keep `--length` a multiple of `--chunk`. Beside the launches it reports the
bytes the block's forward keeps for the backward (distinct storages under
`saved_tensors_hooks`, parameters and input left out), per token and feature: activation
memory, the bulk of a training step's peak at long context.

It is a stand-in for `launches_per_step` of `bench_gpu.py` (the profiler's CUDA kernels): on
2026-11-27 one H100 counted 158 (Llama), 272 (Mega-chunk) and 341 (Megalodon-chunk) launches per
step at d = 1024; this count gives 167, 255 and 325 for the same code (docs/gpu.md, "Kernel
launches without a GPU"). cuBLAS, cuFFT and a few composite operators launch more than one
kernel, and some operators counted here launch none on CUDA (an `arange` folded into a cached
table). Triton launches are counted inside the counted step only, not in the warm-up step.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: kernels run on CPU tensors
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bench_gpu
import megalab

# Operators that launch no kernel on CUDA: views, metadata and empty allocations.
NO_KERNEL = frozenset(
    {
        "alias", "as_strided", "chunk", "detach", "diagonal", "empty", "empty_like",
        "empty_strided", "expand", "imag", "lift_fresh", "narrow", "new_empty", "permute",
        "promote_types", "real", "_reshape_alias", "resolve_conj", "select", "slice", "split",
        "split_with_sizes", "squeeze", "t", "transpose", "unbind", "unfold", "unsqueeze",
        "_unsafe_view", "view", "view_as_complex", "view_as_real", "_conj",
    }
)  # fmt: skip
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_PACKAGE = str(Path(megalab.__file__).parent) + os.sep  # as the frames name it


def _source_line(stack: str) -> str:
    """The innermost frame of a formatted stack inside the megalab package, as `path:line`
    relative to the package (`?` when none)."""
    found = [(f, n) for f, n in _FRAME.findall(stack) if f.startswith(_PACKAGE)]
    return f"{found[-1][0][len(_PACKAGE) :]}:{found[-1][1]}" if found else "?"


class LaunchCounter(TorchDispatchMode):
    """Counts the kernel-launching aten operators by name and by megalab source line."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: collections.Counter[str] = collections.Counter()
        self.by_line: collections.Counter[str] = collections.Counter()
        self.paused = 0
        self.active = False  # inside `with counter:` (Triton launches are counted only there)

    def __enter__(self) -> LaunchCounter:
        self.active = True
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        super().__exit__(*exc)

    def add(self, name: str) -> None:
        node = torch._C._current_autograd_node()
        if node is not None:  # backward: the forward line that made the node
            recorded = node.metadata.get("traceback_")
            line = _source_line("".join(recorded)) if recorded else "?"
        else:
            line = _source_line("".join(traceback.format_stack()))
        self.by_op[name] += 1
        self.by_line[line] += 1

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        name = str(func.overloadpacket.__name__)
        if not self.paused and name not in NO_KERNEL:
            self.add(name)
        return func(*args, **(kwargs or {}))


def count(kind: str, d: int, length: int, batch: int, chunk: int) -> tuple[LaunchCounter, float]:
    """One training step of `bench_gpu.block(kind, ...)`, counted (the module docstring), and
    the bytes its forward keeps for the backward per token and feature."""
    from triton.runtime.interpreter import InterpretedFunction

    from megalab import kernels
    from megalab.nn.linear import joined_on

    counter = LaunchCounter()
    run = InterpretedFunction.run

    def counted_run(self: Any, *args: Any, grid: Any, warmup: Any, **kw: Any) -> Any:
        if counter.active:
            counter.add("triton:" + self.fn.__name__)  # one launch; its host copies are not
        counter.paused += 1
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kw)
        finally:
            counter.paused -= 1

    torch.manual_seed(0)
    module = bench_gpu.block(kind, d, chunk).train()
    x = torch.randn(batch, length, d, requires_grad=True)

    def step() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x)[0]
        y.float().square().mean().backward()

    setattr(InterpretedFunction, "run", counted_run)  # noqa: B010
    try:
        with kernels.forced(*kernels.KERNELS), joined_on("cpu"):
            saved = saved_bytes(module, x)
            step()  # once uncounted: lazy set-up is not a step's work
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "Anomaly Detection has been enabled"
                with torch.autograd.detect_anomaly(check_nan=False), counter:
                    step()
    finally:
        setattr(InterpretedFunction, "run", run)  # noqa: B010
    return counter, saved / x.numel()


def saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """The bytes of the distinct storages one forward of `module` on x keeps for the backward,
    under bf16 autocast, its parameters and x left out."""
    own = {p.untyped_storage().data_ptr() for p in (*module.parameters(), x)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        module(x)
    return sum(kept.values())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", nargs="+", default=["llama", "mega_chunk", "megalodon_chunk"])
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--lines", type=int, default=25, help="source lines listed per block")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.length % args.chunk:
        ap.error(f"--length {args.length} is not a multiple of --chunk {args.chunk}")
    record: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "torch": torch.__version__,
        "blocks": {},
    }
    base = None
    for kind in args.blocks:
        counter, saved = count(kind, args.d, args.length, args.batch, args.chunk)
        total = sum(counter.by_op.values())
        base = base or total
        record["blocks"][kind] = {
            "launches": total,
            "ratio_to_first": total / base,
            "saved_bytes_per_token_feature": saved,
            "by_op": dict(counter.by_op.most_common()),
            "by_line": dict(counter.by_line.most_common()),
        }
        print(f"{kind}: {total} launches ({total / base:.2f}x {args.blocks[0]}), "
              f"{saved:.1f} bytes kept for the backward per token and feature")  # fmt: skip
        for line, n in counter.by_line.most_common(args.lines):
            print(f"  {n:4d}  {line}")
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
