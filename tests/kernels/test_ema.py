"""The Triton EMA kernels (`megalab.kernels.ema`) against the PyTorch reference they replace.

Run under Triton's interpreter on CPU tensors (`kernels.forced("ema")`): the generated kernel,
the EMA and CEMA modules (causal and bidirectional, float32 and bf16 inputs, with a padding mask),
the gradient of every EMA parameter and of the input, streaming with a carried state, tiny Mega
and Megalodon models, and what autograd keeps for the backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalab import kernels
from megalab.models.megalodon.cema import CEMAState, ComplexEMA
from megalab.nn import ema_kernel
from megalab.nn.ema import DampedEMA

from .tiny_models import tiny_megalodon

pytestmark = [
    pytest.mark.skipif(
        not (kernels.triton_available() and (kernels.interpreting() or torch.cuda.is_available())),
        reason="needs Triton (the gpu or dev extra), with CUDA or TRITON_INTERPRET=1",
    ),
    pytest.mark.usefixtures("kernel_device"),  # CUDA tensors when compiled (conftest)
]


def perturbed(module: nn.Module, seed: int = 0) -> nn.Module:
    """Parameters moved off the init (spread decays, non-zero Im η), deterministic."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def ema_module(kind: str, D: int, N: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mega":
        return perturbed(DampedEMA(D, N))
    if kind == "mega-bi":
        return perturbed(DampedEMA(D, N, bidirectional=True))
    if kind == "mega-shift":
        return perturbed(DampedEMA(D, N, bidirectional=True, truncation=40, shift=True))
    if kind == "cema":
        return perturbed(ComplexEMA(D, N))
    return perturbed(ComplexEMA(D, N, bidirectional=True))


def run(fn, module: nn.Module, *inputs: Tensor, forced: bool):
    """fn(*inputs) and the gradients of every parameter and input for a fixed random cotangent."""
    module.zero_grad()
    inputs = tuple(
        t.detach().clone().requires_grad_(t.is_floating_point() or t.is_complex()) for t in inputs
    )
    with kernels.forced("ema") if forced else kernels.disabled("ema"):
        outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(1)
    loss = torch.zeros((), device=outs[0].device)
    for o in outs:
        real = (torch.view_as_real(o) if o.is_complex() else o).float()
        loss = loss + (real * torch.randn(real.shape, generator=g).to(real.device)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    grads.update({f"input{i}": t.grad.clone() for i, t in enumerate(inputs) if t.grad is not None})
    return tuple(o.detach() for o in outs), grads


def assert_near(actual: Tensor, expected: Tensor, tol: float, what: str) -> None:
    """|actual − expected| ≤ tol · max|expected| elementwise (a scale-aware tolerance)."""
    if actual.is_complex():
        actual, expected = torch.view_as_real(actual), torch.view_as_real(expected)
    actual, expected = actual.to(torch.float64), expected.to(torch.float64)
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} against max {scale:.3g}"


def assert_same_run(kernel_run, reference_run, tol: float = 2e-5, grad_tol: float = 1e-4) -> None:
    (outs_k, grads_k), (outs_r, grads_r) = kernel_run, reference_run
    for i, (a, b) in enumerate(zip(outs_k, outs_r, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_near(a, b, tol, f"output {i}")
    assert grads_k.keys() == grads_r.keys()
    for name in grads_r:
        assert grads_r[name].abs().max() > 0, f"{name} got no gradient"
        assert_near(grads_k[name], grads_r[name], grad_tol, f"grad of {name}")


KINDS = ["mega", "mega-bi", "mega-shift", "cema", "cema-bi"]


@pytest.mark.parametrize(("kind", "D", "N", "L"), [("mega", 8, 2, 300), ("mega-bi", 16, 16, 97),
                         ("cema", 8, 16, 300), ("cema-bi", 12, 5, 64)])  # fmt: skip
def test_generated_kernel_and_its_gradients(kind: str, D: int, N: int, L: int) -> None:
    m = ema_module(kind, D, N)
    fn = m.kernel
    kernel_run = run(lambda: fn(L), m, forced=True)
    reference_run = run(lambda: fn(L), m, forced=False)
    assert kernel_run[0][0].shape == (m.alpha.shape[0], L)
    assert_same_run(kernel_run, reference_run)


@pytest.mark.parametrize("kind", ["mega", "cema"])
def test_extreme_decays_stay_finite_and_exact(kind: str) -> None:
    """Logits of ±12 make q ≈ 1 (memory longer than L) and q ≈ 0 (log q ≈ −24): the powers
    exp(t · log q) neither overflow nor lose the lag-0 tap, and against the float64 reference
    the kernel is as close as the float32 reference (whose coefficients it shares)."""
    m = ema_module(kind, 8, 4)
    with torch.no_grad():
        m.alpha[:, :2] = -12.0
        m.delta[:, :2] = -12.0
        m.alpha[:, 2:] = 12.0
        m.delta[:, 2:] = 12.0
    kernel_run = run(lambda: m.kernel(300), m, forced=True)
    reference_run = run(lambda: m.kernel(300), m, forced=False)
    m64 = copy.deepcopy(m).double()
    args = (300, torch.float64) if kind == "cema" else (300,)
    exact_run = run(lambda: m64.kernel(*args), m64, forced=False)
    assert all(t.isfinite().all() for t in (*kernel_run[0], *kernel_run[1].values()))
    exact = {"output": exact_run[0][0], **exact_run[1]}
    kernel = {"output": kernel_run[0][0], **kernel_run[1]}
    reference = {"output": reference_run[0][0], **reference_run[1]}
    for name, e in exact.items():
        scale = e.abs().max().item()
        err_kernel = (kernel[name].double() - e).abs().max().item() / scale
        err_reference = (reference[name].double() - e).abs().max().item() / scale
        assert err_kernel <= 1.5 * err_reference + 1e-5, (name, err_kernel, err_reference)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_outputs_and_gradients(kind: str, dtype: torch.dtype) -> None:
    m = ema_module(kind, 8, 4)
    x = torch.randn(2, 45, 8).to(dtype)
    mask = torch.ones(2, 45, dtype=torch.bool)
    mask[1, 30:] = False
    kernel_run = run(lambda x: m(x, mask)[0], m, x, forced=True)
    reference_run = run(lambda x: m(x, mask)[0], m, x, forced=False)
    # bf16 outputs may round either way of a bf16 step; parameter gradients stay float32.
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert_same_run(kernel_run, reference_run, tol=tol, grad_tol=1e-4 if tol < 1e-3 else 2e-2)
    assert set(reference_run[1]) == {"input0", *(n for n, _ in m.named_parameters())}


@pytest.mark.parametrize("kind", ["mega", "cema"])
def test_carried_state_gradients_with_a_batch(kind: str) -> None:
    """Gradients of the decays, the input and a non-zero incoming state with B > 1: the case the
    authors' CUDA backward once got wrong for 2 ≤ B ≤ 8."""
    m = ema_module(kind, 8, 6)
    B, L = 3, 70
    x = torch.randn(B, L, 8)
    if kind == "mega":
        h0 = torch.randn(B, 8, 6)

        def fn(x: Tensor, h0: Tensor):
            return m(x, state=h0)
    else:
        h0 = torch.randn(B, 8, 6, dtype=torch.complex64)

        def fn(x: Tensor, h0: Tensor):
            y, state = m(x, state=CEMAState(h0))
            return y, state.h

    kernel_run = run(fn, m, x, h0, forced=True)
    reference_run = run(fn, m, x, h0, forced=False)
    assert "input1" in reference_run[1]
    assert_same_run(kernel_run, reference_run)


@pytest.mark.parametrize("kind", ["mega", "cema"])
def test_streaming_with_a_carried_state_equals_one_pass(kind: str) -> None:
    m = ema_module(kind, 8, 4).eval()
    x = torch.randn(2, 60, 8)
    with kernels.forced("ema"), torch.no_grad():
        full, _ = m(x)
        state = None
        outs = []
        for s, e in ((0, 17), (17, 18), (18, 60)):
            y, state = m(x[:, s:e], state=state, return_state=True)
            outs.append(y)
        # the eval-mode spectrum cache stays correct with the kernel building the spectrum
        again, _ = m(x)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-4, atol=1e-5)
    assert torch.equal(again, full)


def test_what_the_kernel_keeps_for_backward_does_not_grow_with_length() -> None:
    """The Triton kernel keeps the (D, N) coefficients for the backward, whatever L; the
    reference's blocked powers grow as O(D·N·√L)."""
    D, N = 4, 16
    m = perturbed(ComplexEMA(D, N))

    def saved_numel(L: int, forced: bool) -> int:
        total = 0

        def pack(t: Tensor) -> Tensor:
            nonlocal total
            total += t.numel() * (2 if t.is_complex() else 1)
            return t

        switch = kernels.forced("ema") if forced else kernels.disabled("ema")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), switch:
            m.kernel(L)
        return total

    kept = saved_numel(64, forced=True)
    assert kept == saved_numel(2048, forced=True) <= 20 * D * N  # the coefficients' own graph
    assert saved_numel(2048, forced=False) > 2 * saved_numel(64, forced=False) > 2 * kept


def _exact_decay(a: Tensor, d: Tensor) -> list[Tensor]:
    """log q and its two partial derivatives in float64 without cancellation: log1p(−σ(a)σ(d))
    for q ≥ 1/2, the log of 1 − σ(a)σ(d) = σ(−a) + σ(a)σ(−d) below; ∂ log q/∂a =
    −σ(a)σ(−a)σ(d)/q from logs."""
    a, d = a.double(), d.double()

    def log_sigmoid(x: Tensor) -> Tensor:
        return -F.softplus(-x, threshold=1000.0)

    p = torch.sigmoid(a) * torch.sigmoid(d)
    log_small_q = torch.logaddexp(log_sigmoid(-a), log_sigmoid(a) + log_sigmoid(-d))
    log_q = torch.where(p <= 0.5, torch.log1p(-p.clamp_max(0.5)), log_small_q)
    common = log_sigmoid(a) + log_sigmoid(d) - log_q
    return [log_q, -torch.exp(common + log_sigmoid(-a)), -torch.exp(common + log_sigmoid(-d))]


def test_decay_and_its_gradients_over_every_range_of_logits() -> None:
    """log q = log(1 − σ(a)σ(d)) and both gradients, for logits from −90 to 90 (q from 1 − e⁻¹³⁰
    to e⁻¹⁸⁰), relative to each value: log q near 0 included, where a long memory's powers q^t
    need its last digits. There the kernel is closer than the float32 reference, whose
    log-sum-exp of O(1) terms leaves an absolute error of float32 rounding (a log q of +2e-6,
    q > 1, for logits (−40, −12))."""
    from megalab.kernels import ema as triton_ema

    grid = torch.tensor([-90.0, -40.0, -17.0, -12.0, -3.0, -0.5, 0.0, 0.7, 4.0, 12.0, 40.0, 90.0])
    pairs = torch.meshgrid(grid, grid, indexing="ij")
    a, d = (t.reshape(-1).clone().requires_grad_() for t in pairs)
    with kernels.forced("ema"):
        log_q = triton_ema.log_decay(a, d)
    da, dd = torch.autograd.grad(log_q, (a, d), torch.ones_like(log_q))
    for name, value, exact, tol in zip(
        ("log q", "da", "dd"), (log_q, da, dd), _exact_decay(a, d), (1e-6, 2e-5, 2e-5)
    ):
        assert value.dtype == torch.float32 and value.isfinite().all(), name
        normal = exact.abs() > torch.finfo(torch.float32).tiny  # a GPU flushes subnormals
        err = (value.double() - exact).abs()
        assert (err[~normal] <= torch.finfo(torch.float32).tiny).all(), name
        assert (err[normal] / exact.abs()[normal]).max() <= tol, name
    # broadcast logits (a per-row α against a full δ) take the same path
    rows, full = a.detach()[:12].reshape(12, 1), d.detach().reshape(12, 12)
    with kernels.forced("ema"):
        broadcast = triton_ema.log_decay(rows, full)
    torch.testing.assert_close(broadcast, triton_ema.log_decay(rows.expand(12, 12), full))


def test_bad_inputs_are_refused() -> None:
    from megalab.kernels import ema as triton_ema

    with pytest.raises(ValueError, match="float32 or complex64"):
        triton_ema.ema_kernel(torch.ones(2, 3), torch.ones(2, 3), -torch.ones(2, 3).double(), 5)
    with pytest.raises(ValueError, match="float32 logits"):
        triton_ema.log_decay(torch.ones(2, 3).double(), torch.ones(2, 3))
    # float64 (and any non-float32) tensors are left to the reference
    assert ema_kernel.ema_ops(torch.ones(2).double()) is ema_kernel


def test_tiny_mega_and_megalodon_forward_backward() -> None:
    from megalab.models.mega.model import MegaConfig

    torch.manual_seed(0)
    mega = perturbed(
        MegaConfig(
            d_model=16, num_layers=2, z_dim=8, v_dim=24, ffn_dim=20, ema_dim=4, max_positions=64
        ).build()
    )
    torch.manual_seed(0)
    megalodon = perturbed(tiny_megalodon(z_dim=8, v_dim=12, chunk_size=8))
    x = torch.randn(2, 24, 16)
    for model in (mega.train(), megalodon.train()):
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        kernel_run = run(lambda x, model=model: model(x).y, model, x, forced=True)
        reference_run = run(lambda x, model=model: model(x).y, model, x, forced=False)
        assert_same_run(kernel_run, reference_run, tol=1e-4, grad_tol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_layers_match_the_reference_at_a_model_size(kind: str) -> None:
    """On a GPU the kernels are chosen without `forced`; a model-sized layer against PyTorch."""
    m = ema_module(kind, 256, 16).cuda()
    x = torch.randn(2, 2048, 256, device="cuda")
    mask = torch.ones(2, 2048, dtype=torch.bool, device="cuda")
    mask[1, 1500:] = False
    assert kernels.use_kernel("ema", x)
    kernel_run = run(lambda x: m(x, mask)[0], m, x, forced=True)
    reference_run = run(lambda x: m(x, mask)[0], m, x, forced=False)
    assert_same_run(kernel_run, reference_run, tol=1e-4, grad_tol=1e-3)
