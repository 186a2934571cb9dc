"""The parameter annotations of the @triton.jit functions: only `tl.constexpr` and `tl.tensor`.

Triton reads these annotations, unlike Python: `int` or `float` fixes the argument's type (i32,
fp32: a pointer or a 64-bit size would be passed wrongly, an int equal to 1 no longer becomes a
constant) and a name that is not Triton's, such as torch's `Tensor`, fails the compilation on a
GPU (the interpreter does not notice). `tl.tensor` changes nothing: the compiled kernels are the
unannotated ones.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import megalab.kernels

ALLOWED = {"tl.constexpr", "tl.tensor"}
MODULES = sorted(Path(megalab.kernels.__file__).parent.glob("*.py"))


def _jit_functions(path: Path) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any(ast.unparse(d) == "triton.jit" for d in node.decorator_list)
    ]


def test_jit_parameters_are_annotated_constexpr_or_tensor() -> None:
    seen = 0
    for path in MODULES:
        for fn in _jit_functions(path):
            params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
            wrong = [
                f"{a.arg}: {ast.unparse(a.annotation) if a.annotation else '(none)'}"
                for a in params
                if a.annotation is None or ast.unparse(a.annotation) not in ALLOWED
            ]
            assert not wrong, f"{path.name}:{fn.lineno} {fn.name}: {wrong}"
            seen += 1
    assert seen >= 20  # the three kernel modules were found


def test_triton_reads_tl_tensor_as_no_type() -> None:
    jit = pytest.importorskip("triton.runtime.jit")
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    tensor = jit.KernelParam(0, inspect.Parameter("x", kind, annotation="tl.tensor"), False, False)
    assert (tensor.is_constexpr, tensor.is_const, tensor.annotation_type) == (False, False, "")
    const = inspect.Parameter("N", kind, annotation="tl.constexpr")
    assert jit.KernelParam(1, const, False, False).is_constexpr
