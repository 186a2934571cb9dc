"""Every Triton kernel launch of the interpreted kernel tests, compiled for a GPU without one.

Triton's interpreter runs a kernel as Python: it accepts code that the compiler refuses (a
constexpr branch on a runtime value, a dtype the hardware has no instruction for, a tile over
the shared memory of the target). This module closes that gap on a machine without a GPU:

1. `record_launches(path)` (a pytest plugin: `-p tests.kernels.launches` with
   `MEGALAB_RECORD_LAUNCHES=<file>`) wraps the interpreter's launch and writes, at the end of
   the session, every distinct launch the tests made: the kernel, its arguments' types (tensor
   dtypes, integer widths), its constexpr values and launch options.
2. `python tests/kernels/launches.py <file> [capability]` (Triton's interpreter off) compiles
   each recorded launch with Triton's own compiler and ptxas for that CUDA capability (default
   90, the H100) and prints, per launch, its shared memory or the compiler's error, as JSON.

tests/kernels/test_compile.py runs both for the installed Triton. The same two steps check
another Triton (the oldest supported, a GPU image's) put first on `PYTHONPATH` (docs/gpu.md).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

ENV = "MEGALAB_RECORD_LAUNCHES"
# Launch options of `kernel[grid](..., num_warps=4)` that are not kernel parameters.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")
# torch dtype -> Triton's pointer element type in a signature.
POINTEE = {
    "torch.float32": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float64": "fp64",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.int16": "i16",
    "torch.int32": "i32",
    "torch.int64": "i64",
    "torch.bool": "i1",
}


def describe(value: Any) -> list[Any]:
    """A runtime argument as [kind, detail]: a tensor's dtype, an integer's Triton type (i32 or
    i64: the value does not change the compiled code), a float, None (a constexpr argument is
    recorded as ["constexpr", value])."""
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype)]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", "i32" if -(2**31) <= value < 2**31 else "i64"]
    if isinstance(value, float):
        return ["float", None]
    if value is None:
        return ["none", None]
    if isinstance(value, str):
        return ["str", value]
    raise TypeError(f"a kernel argument of type {type(value).__name__} cannot be recorded")


class _Recorder:
    """Wraps `InterpretedFunction.run` and keeps each distinct launch once."""

    def __init__(self) -> None:
        self.launches: dict[str, dict[str, Any]] = {}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run
        recorder = self

        def recording_run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
            recorder.add(self.fn, args, kwargs)
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(InterpretedFunction, "run", recording_run)

    def add(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
        signature = inspect.signature(fn)
        bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k not in options})
        described = {
            name: ["constexpr", v]
            if "constexpr" in str(signature.parameters[name].annotation)
            else describe(v)
            for name, v in bound.arguments.items()
        }
        entry = {
            "module": fn.__module__,
            "name": fn.__name__,
            "args": described,
            "options": options,
        }
        self.launches.setdefault(json.dumps(entry, sort_keys=True), entry)


_recorder = _Recorder()


@pytest.fixture(autouse=True)
def _record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records the launches of each test (the plugin is loaded only to record)."""
    _recorder.install(monkeypatch)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(ENV)
    if path:
        launches = list(_recorder.launches.values())
        Path(path).write_text(json.dumps(launches, indent=1, sort_keys=True))


# -- compiling ----------------------------------------------------------------------------------
def signature(kernel: Any, args: dict[str, list[Any]]) -> tuple[dict[str, str], dict]:
    """Triton's (signature, constexprs) for a recorded launch of the JIT function `kernel`."""
    types: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    for i, param in enumerate(kernel.params):
        kind, detail = args[param.name]
        if param.is_constexpr or kind in ("constexpr", "none", "str"):
            types[param.name] = "constexpr"
            constexprs[(i,)] = detail
        elif kind == "tensor":
            types[param.name] = "*" + POINTEE[detail]
        elif kind == "bool":
            types[param.name] = "i1"
        elif kind == "int":
            types[param.name] = detail
        else:
            types[param.name] = "fp32"
    return types, constexprs


def compile_launches(launches: list[dict[str, Any]], capability: int) -> list[dict[str, Any]]:
    """Compile each launch for CUDA `capability`; its shared memory in bytes, or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    results = []
    for launch in launches:
        # Only megalab's own kernel modules are imported from the record, and only JIT functions
        # taken from them.
        if not str(launch["module"]).startswith("megalab.kernels."):
            raise ValueError(f"{launch['module']!r} is not a megalab kernel module")
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        if not isinstance(kernel, triton.runtime.JITFunction):
            raise ValueError(f"{launch['module']}.{launch['name']} is not a Triton kernel")
        types, constexprs = signature(kernel, launch["args"])
        name = f"{launch['module']}.{launch['name']}"
        try:
            if "constexprs" in inspect.signature(ASTSource).parameters:
                src = ASTSource(fn=kernel, signature=types, constexprs=constexprs)
            else:  # Triton before 3.3: constants by name
                names = [p.name for p in kernel.params]
                constants = {names[i]: v for (i,), v in constexprs.items()}
                src = ASTSource(fn=kernel, signature=types, constants=constants)
            compiled = triton.compile(src, target=target, options=launch["options"])
        except Exception as e:  # the compiler's own error, reported per launch
            results.append({"kernel": name, "launch": launch, "error": f"{type(e).__name__}: {e}"})
            continue
        results.append({"kernel": name, "launch": launch, "shared": compiled.metadata.shared})
    return results


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
        print("unset TRITON_INTERPRET: the launches are compiled, not interpreted", file=sys.stderr)
        return 2
    launches = json.loads(Path(argv[0]).read_text())
    capability = int(argv[1]) if len(argv) > 1 else 90
    print(json.dumps(compile_launches(launches, capability)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
