"""The Triton attention kernel (Triton's interpreter on CPU) against the PyTorch reference.

Mega's `ChunkedAttention` and Megalodon's `NormalizedAttention` run once with the kernel forced
and once on their reference path, on the same inputs: outputs and the gradients of Q, K, V and
the learned biases must agree (float32 tightly, bf16 loosely). Lengths are not multiples of the
interpreter's 16-row blocks and the value widths span several 32-column value tiles.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab import kernels
from megalab.kernels import attention as gpu
from megalab.models.mega.model import MegaConfig
from megalab.models.megalodon.normalized_attention import NormalizedAttention
from megalab.nn.attention import ChunkedAttention, KVCache

from .tiny_models import tiny_megalodon

pytestmark = pytest.mark.skipif(
    not (kernels.triton_available() and kernels.interpreting()),
    reason="needs Triton's interpreter (TRITON_INTERPRET=1 without CUDA, set by conftest)",
)

FNS = ("softmax", "laplace", "relu2")
Z, E = 16, 72  # Q/K width; value width: three value tiles of 32 in the interpreter


def _perturbed(module: nn.Module, seed: int = 0, std: float = 0.5) -> nn.Module:
    """Every parameter moved by N(0, std²) away from its (near-trivial) init."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(std * torch.randn_like(p))
    return module


def _mega(fn: str, bias: str, causal: bool, chunk: int) -> ChunkedAttention:
    att = ChunkedAttention(Z, chunk, fn, bias, max_positions=64, causal=causal)
    return _perturbed(att)  # type: ignore[return-value]


def _padding(B: int, L: int, g: torch.Generator) -> Tensor:
    valid = torch.rand(B, L, generator=g) > 0.3
    valid[0, :5] = False  # left padding: causal rows that see no valid key
    valid[-1, -20:] = False  # the last chunk is padding only
    return valid


def _inputs(B: int, L: int, z: int, e: int, seed: int = 1) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, L, z, generator=g).requires_grad_(),
        torch.randn(B, L, z, generator=g).requires_grad_(),
        torch.randn(B, L, e, generator=g).requires_grad_(),
    ]


def _run(module: nn.Module, inputs: list[Tensor], forced: bool, **kw: object) -> list[Tensor]:
    """Output and the gradients of the inputs and parameters, kernel forced or not."""
    for t in [*inputs, *module.parameters()]:
        t.grad = None
    if forced:
        with kernels.forced("attention"):
            out = module(*inputs, **kw)
    else:
        with kernels.disabled("attention"):
            out = module(*inputs, **kw)
    o = out[0] if isinstance(out, tuple) else out
    g = torch.Generator().manual_seed(7)
    o.backward(torch.randn(o.shape, generator=g, dtype=o.dtype))
    grads = [t.grad for t in [*inputs, *module.parameters()]]
    assert all(gr is not None for gr in grads)
    return [o.detach(), *(gr.clone() for gr in grads)]  # type: ignore[union-attr]


def _close(got: list[Tensor], want: list[Tensor], rtol: float, atol: float) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        scale = b.abs().max().clamp(min=1.0)
        torch.testing.assert_close(
            a.float(), b.float(), rtol=rtol, atol=atol * scale.item(), msg=f"tensor {i}"
        )


# (bias, causal, padded, chunk size, length): full and chunked spans, a padded last chunk.
MEGA_CASES = [
    ("simple", False, True, -1, 37),
    ("simple", True, False, 24, 41),
    ("rotary", True, True, 24, 41),
    ("rotary", False, False, -1, 19),
]


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize(("bias", "causal", "padded", "chunk", "L"), MEGA_CASES)
def test_mega_kernel_matches_reference_float32(
    fn: str, bias: str, causal: bool, padded: bool, chunk: int, L: int
) -> None:
    att = _mega(fn, bias, causal, chunk)
    B = 2
    inputs = _inputs(B, L, Z, E)
    mask = _padding(B, L, torch.Generator().manual_seed(3)) if padded else None
    got = _run(att, inputs, True, mask=mask)
    want = _run(att, inputs, False, mask=mask)
    _close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fn", FNS)
def test_mega_kernel_streams_with_a_cache(fn: str) -> None:
    """Queries that continue an open chunk (q_offset > 0) against the cached keys."""
    att = _mega(fn, "simple", True, 24)
    q, k, v = _inputs(2, 30, Z, E)
    _, cache_k, cache_v = _inputs(2, 5, Z, E, seed=4)
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, :3] = False
    cache = KVCache(cache_k.detach(), cache_v.detach(), valid)
    got = _run(att, [q, k, v], True, mask=None, cache=cache)
    want = _run(att, [q, k, v], False, mask=None, cache=cache)
    _close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fn", FNS)
def test_mega_kernel_bf16(fn: str) -> None:
    """bf16 inputs (fp32 accumulation) against the float32 reference on the same values."""
    att = _mega(fn, "simple", True, 24)
    L = 41
    inputs = _inputs(2, L, Z, E)
    mask = _padding(2, L, torch.Generator().manual_seed(3))
    low = [t.detach().bfloat16().requires_grad_() for t in inputs]
    got = _run(att, low, True, mask=mask)
    want = _run(att, [t.detach().float().requires_grad_() for t in low], False, mask=mask)
    assert got[0].dtype == torch.bfloat16
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        err = (a.float() - b).norm() / b.norm().clamp(min=1e-6)
        assert err < 2e-2, f"tensor {i}: relative error {err:.3g}"


def _megalodon_inputs(B: int, L: int, seed: int = 1) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, L, 2 * Z, generator=g).requires_grad_(),
        torch.randn(B, L, 2 * 48, generator=g).requires_grad_(),
    ]


@pytest.mark.parametrize(
    ("causal", "padded", "chunk", "L"),
    [(True, True, 24, 41), (False, True, 24, 41), (True, False, -1, 33)],
)
def test_megalodon_kernel_matches_reference(causal: bool, padded: bool, chunk: int, L: int) -> None:
    """Two heads of width 16 (queries and keys) and 48 (values), RoPE applied before."""
    att = _perturbed(NormalizedAttention(2 * Z, 2 * 48, 2, chunk, causal=causal), std=0.3)
    inputs = _megalodon_inputs(2, L)
    mask = _padding(2, L, torch.Generator().manual_seed(3)) if padded else None
    got = _run(att, inputs, True, mask=mask)
    want = _run(att, inputs, False, mask=mask)
    _close(got, want, rtol=1e-4, atol=1e-5)


def test_megalodon_kernel_streams_with_a_cache() -> None:
    att = _perturbed(NormalizedAttention(2 * Z, 2 * 48, 2, 24, causal=True), std=0.3)
    z, v = _megalodon_inputs(2, 30)
    cache_z, cache_v = _megalodon_inputs(2, 5, seed=4)
    with torch.no_grad():
        cache_k = att.queries_keys(cache_z)[1]
    cache = KVCache(cache_k, cache_v.detach().view(2, 5, 2, 48), None)
    got = _run(att, [z, v], True, cache=cache)
    want = _run(att, [z, v], False, cache=cache)
    _close(got, want, rtol=1e-4, atol=1e-5)


def test_sdpa_value_groups_equal_one_call() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 11, 8, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 11, 70, generator=g, requires_grad=True)
    bias = torch.randn(11, 11, generator=g, requires_grad=True)
    params = [q, k, v, bias]
    o1 = gpu.sdpa_value_groups(q, k, v, attn_mask=bias, scale=0.3, group=32)
    o2 = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3)
    torch.testing.assert_close(o1, o2)
    dy = torch.randn(o1.shape, generator=g)
    for a, b in zip(
        torch.autograd.grad(o1, params, dy), torch.autograd.grad(o2, params, dy), strict=True
    ):
        torch.testing.assert_close(a, b)


def test_sdpa_path_is_selectable(monkeypatch: pytest.MonkeyPatch) -> None:
    """`MEGALAB_ATTENTION_GPU=sdpa`: softmax on SDPA over value groups, never the kernel."""
    monkeypatch.setenv("MEGALAB_ATTENTION_GPU", "sdpa")
    calls: list[int] = []
    real = gpu.sdpa_value_groups

    def counted(*args: object, **kw: object) -> Tensor:
        calls.append(1)
        return real(*args, **kw)  # type: ignore[arg-type]

    def refuse(*args: object, **kw: object) -> Tensor:
        raise AssertionError("the Triton kernel ran on the sdpa path")

    monkeypatch.setattr(gpu, "sdpa_value_groups", counted)
    monkeypatch.setattr(gpu, "flash_attention", refuse)
    L = 29
    mask = _padding(2, L, torch.Generator().manual_seed(3))
    att = _mega("softmax", "simple", True, 24)
    inputs = _inputs(2, L, Z, E)
    _close(_run(att, inputs, True, mask=mask), _run(att, inputs, False, mask=mask), 1e-4, 1e-5)
    lodon = _perturbed(NormalizedAttention(2 * Z, 2 * 48, 2, 24, causal=True), std=0.3)
    inputs = _megalodon_inputs(2, L)
    _close(_run(lodon, inputs, True, mask=mask), _run(lodon, inputs, False, mask=mask), 1e-4, 1e-5)
    assert len(calls) == 2
    monkeypatch.setenv("MEGALAB_ATTENTION_GPU", "cudnn")
    with pytest.raises(ValueError, match="MEGALAB_ATTENTION_GPU='cudnn'"):
        gpu.gpu_path()


def test_attention_dropout_keeps_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mega's weight dropout and Megalodon's DropKey in training are not in the kernel."""

    def refuse(*args: object, **kw: object) -> Tensor:
        raise AssertionError("the Triton kernel ran with attention dropout")

    monkeypatch.setattr(gpu, "flash_attention", refuse)
    att = ChunkedAttention(Z, 8, "softmax", "simple", causal=True, dropout=0.5).train()
    lodon = NormalizedAttention(2 * Z, 2 * 48, 2, 8, causal=True, dropout=0.5).train()
    with kernels.forced("attention"):
        att(*_inputs(2, 13, Z, E))
        lodon(*_megalodon_inputs(2, 13))
        with pytest.raises(AssertionError, match="ran with attention dropout"):
            att.eval()(*_inputs(2, 13, Z, E))  # no dropout in evaluation: the kernel
        with pytest.raises(AssertionError, match="ran with attention dropout"):
            lodon.eval()(*_megalodon_inputs(2, 13))


def test_bad_input_is_refused_with_a_clear_message() -> None:
    q = torch.zeros(2, 1, 5, Z)
    v = torch.zeros(2, 1, 5, E)
    with pytest.raises(ValueError, match=r"must be \(N, H, C, width\)"):
        gpu.flash_attention(q[0], q[0], v[0])
    with pytest.raises(ValueError, match="disagree"):
        gpu.flash_attention(q, torch.zeros(2, 1, 5, Z + 1), v)
    with pytest.raises(ValueError, match="share one dtype"):
        gpu.flash_attention(q, q.double(), v)
    with pytest.raises(ValueError, match="unknown attention function"):
        gpu.flash_attention(q, q, v, fn="gelu")
    with pytest.raises(ValueError, match="exceed the 4 positions"):
        gpu.flash_attention(q, q, v, bias=torch.zeros(7), positions=4)
    with pytest.raises(ValueError, match=r"valid must be \(N, Ck\)"):
        gpu.flash_attention(q, q, v, valid=torch.ones(2, 4, dtype=torch.bool))


def _model_grads(
    model: nn.Module, x: Tensor, mask: Tensor, forced: bool, monkeypatch: pytest.MonkeyPatch
) -> list[Tensor]:
    """Features and parameter gradients; with `forced`, checks that every layer ran the kernel."""
    model.zero_grad()
    calls: list[int] = []
    real = gpu.flash_attention

    def counted(*args: object, **kw: object) -> Tensor:
        calls.append(1)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(gpu, "flash_attention", counted)
    ctx = kernels.forced("attention") if forced else kernels.disabled("attention")
    with ctx:
        y = model(x, mask).y
    monkeypatch.setattr(gpu, "flash_attention", real)
    assert len(calls) == (2 if forced else 0)  # one call per layer, chunks in the batch
    y.square().mean().backward()
    return [y.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


@pytest.mark.parametrize("fn", ["softmax", "relu2"])
def test_tiny_mega_equals_reference_with_the_kernel(
    fn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = MegaConfig(d_model=16, num_layers=2, z_dim=Z, v_dim=40, ffn_dim=20, ema_dim=4,
                       chunk_size=16, causal=True, attention_activation=fn).build()  # fmt: skip
    _perturbed(model, std=0.2).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 21, 16, generator=g)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, -6:] = False
    got = _model_grads(model, x, mask, True, monkeypatch)
    want = _model_grads(model, x, mask, False, monkeypatch)
    assert len(got) == len(want) == 1 + len(list(model.parameters()))
    _close(got, want, rtol=1e-4, atol=1e-5)


def test_tiny_megalodon_equals_reference_with_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = tiny_megalodon(z_dim=32, v_dim=64, chunk_size=16)
    _perturbed(model, std=0.2).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 21, 16, generator=g)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, -6:] = False
    got = _model_grads(model, x, mask, True, monkeypatch)
    want = _model_grads(model, x, mask, False, monkeypatch)
    assert len(got) == len(want) == 1 + len(list(model.parameters()))
    _close(got, want, rtol=1e-4, atol=1e-5)


_COMPILE = """
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megalab.kernels import attention as A
from megalab.kernels import attention_jit as J

POINTERS = {"Q": "q", "K": "q", "V": "q", "DO": "q", "DQ": "q", "DK": "q", "DV": "q", "OUT": "q",
            "W": "*fp32", "LSE": "*fp32", "DELTA": "*fp32", "DW": "*fp32", "VALID": "*i8",
            "FIRST": "*i32"}
shared = {}
for dtype, z, e in json.loads(sys.argv[1]):
    dt = getattr(torch, dtype)
    spec = A._Spec("softmax", 1.0, True, 0, 64, "causal", True, True, z, e,
                   torch.device("cuda"), dt)
    meta = spec.meta()
    options = {"num_warps": meta.pop("num_warps"), "enable_fp_fusion": meta.pop("enable_fp_fusion")}
    for kernel in (J.fwd_kernel, J.bwd_dv_kernel, J.bwd_dk_kernel, J.bwd_dq_kernel):
        names = kernel.arg_names
        sig = {}
        for n in names:
            if n in meta:
                sig[n] = "constexpr"
            elif n in POINTERS:
                p = POINTERS[n]
                sig[n] = {"float32": "*fp32", "bfloat16": "*bf16"}[dtype] if p == "q" else p
            else:
                sig[n] = "fp32" if n == "scale" else "i32"
        consts = {(names.index(n),): v for n, v in meta.items()}
        src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        shared[f"{kernel.__name__} {dtype} z={z}"] = c.metadata.shared
print(json.dumps(shared))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_within_shared_memory() -> None:
    """The GPU kernels compile (no GPU needed: Triton's own ptxas) for an H100 and their tiles
    fit its 227 KB of shared memory per block, at Mega's widest shapes: z = 256 (d = 1024), with
    the 'rotary' bias's extra columns z = 512, value tiles of 128."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    shapes = [["bfloat16", 256, 2048], ["float32", 256, 2048], ["float32", 512, 2048],
              ["bfloat16", 64, 96], ["float32", 128, 512]]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(shapes)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(shared) == 4 * len(shapes)
    too_big = {k: v for k, v in shared.items() if v > 227 * 1024}
    assert not too_big, f"tiles over the H100's shared memory per block: {too_big}"
