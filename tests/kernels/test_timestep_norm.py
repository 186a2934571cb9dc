"""The Triton timestep norm (`megalab.kernels.timestep_norm`) against the PyTorch module in
float64, under Triton's interpreter: outputs, the state after the segment and the gradients of
x, γ, β and the carried state, with pads anywhere, several blocks per sequence, streaming, bf16,
and a Megalodon backbone with the kernel forced equal to without."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import golden
from golden import prefixed, rel_err
from megalab import kernels
from megalab.kernels import timestep_norm as tsk
from megalab.models.megalodon.convert import convert_timestep_norm
from megalab.models.megalodon.timestep_norm import TimestepNorm, TimestepNormState

from .tiny_models import tiny_megalodon

pytestmark = [
    pytest.mark.skipif(
        not (kernels.triton_available() and (kernels.interpreting() or torch.cuda.is_available())),
        reason="needs Triton (its interpreter without CUDA)",
    ),
    pytest.mark.usefixtures("kernel_device"),  # CUDA tensors when compiled (conftest)
]

B, L, D, G = 2, 300, 16, 2
BLOCK_T = 64  # 5 blocks of steps per sequence (the last one partial)


def norm(d: int = D, g: int = G) -> TimestepNorm:
    torch.manual_seed(0)
    m = TimestepNorm(d, g)
    with torch.no_grad():
        m.weight.normal_(0.0, 0.3)
        m.bias.normal_(0.0, 0.3)
    return m


def make_mask(kind: str) -> torch.Tensor | None:
    if kind == "none":
        return None
    mask = torch.ones(B, L, dtype=torch.bool)
    if kind == "right":
        mask[1, 211:] = False
    elif kind == "leading":  # pads before the first real step, past a block boundary
        mask[0, :45] = False
        mask[1, :3] = False
    elif kind == "whole_row":
        mask[1] = False
    elif kind == "random":
        mask = torch.rand(B, L, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[0, 64:130] = False  # whole blocks of pads in the middle
    return mask


def carried() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A state with steps seen in row 0 and none in row 1 (its mean and variance unused)."""
    g = torch.Generator().manual_seed(2)
    count = torch.tensor([37, 0])
    mean = 2.0 + torch.randn(B, G, generator=g)
    var = 0.5 + torch.rand(B, G, generator=g)
    return count, mean, var


def reference(m: TimestepNorm, x, mask, state, dy, dmean, dvar) -> list[torch.Tensor]:
    """The PyTorch path in float64: y, the state's mean and var, then the gradients of x, γ,
    β (and of the state's mean and var when one is carried)."""
    m64 = copy.deepcopy(m).double()
    x64 = x.detach().double().requires_grad_()
    st = None
    if state is not None:
        count, mean, var = state
        st = TimestepNormState(count, mean.double().requires_grad_(), var.double().requires_grad_())
    with kernels.disabled("timestep_norm"):
        y, new = m64(x64, mask, st)
    loss = (y * dy.double()).sum()
    leaves = [x64, m64.weight, m64.bias]
    outs = [y]
    if new is not None:
        assert st is not None
        loss = loss + (new.mean * dmean.double()).sum() + (new.var * dvar.double()).sum()
        leaves += [st.mean, st.var]
        outs += [new.mean, new.var]
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, leaves))


def kernel(m: TimestepNorm, x, mask, state, dy, dmean, dvar, block_t=BLOCK_T):
    """The same through the Triton kernel (float32 statistics)."""
    x = x.detach().requires_grad_()
    count = mean = var = None
    if state is not None:
        count, mean, var = (state[0], *(s.clone().requires_grad_() for s in state[1:]))
    y, new_mean, new_var = tsk.timestep_norm(
        x, m.weight, m.bias, mask, count, mean, var, G, m.eps, block_t=block_t
    )
    loss = (y.float() * dy).sum()
    leaves = [x, m.weight, m.bias]
    outs = [y]
    if state is not None:
        loss = loss + (new_mean * dmean).sum() + (new_var * dvar).sum()
        leaves += [mean, var]
        outs += [new_mean, new_var]
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, leaves))


NAMES = ["y", "mean", "var", "dx", "dweight", "dbias", "dmean0", "dvar0"]


@pytest.mark.parametrize(
    ("pads", "with_state"),
    [("none", False), ("right", True), ("leading", False), ("leading", True),
     ("whole_row", True), ("random", True)],
)  # fmt: skip
def test_forward_and_gradients_match_float64(
    pads: str, with_state: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tsk, "CHUNK", 4)  # the scans over blocks take them 4 at a time
    m = norm()
    g = torch.Generator().manual_seed(0)
    # Off-centre data with a drifting scale, so the shifted sums matter.
    scale = torch.linspace(0.5, 2.0, L).view(1, L, 1)
    x = 3.0 + torch.randn(B, L, D, generator=g) * scale
    mask = make_mask(pads)
    if mask is not None:
        x[~mask] = 1e4  # padded steps may hold anything
    dy = torch.randn(B, L, D, generator=g)
    dmean, dvar = torch.randn(B, G, generator=g), torch.randn(B, G, generator=g)
    state = carried() if with_state else None
    ref = reference(m, x, mask, state, dy, dmean, dvar)
    got = kernel(m, x, mask, state, dy, dmean, dvar)
    assert len(got) == len(ref)
    for name, a, r in zip(NAMES if with_state else NAMES[:1] + NAMES[3:6], got, ref):
        scale_r = r.abs().max().clamp_min(1.0)
        err = ((a.double() - r).abs().max() / scale_r).item()
        assert err < 2e-6, f"{name}: {err:.2e}"
    if mask is not None:
        dx = got[3] if with_state else got[1]
        assert (got[0][~mask] == 0).all() and (dx[~mask] == 0).all()


def test_padded_steps_may_hold_anything() -> None:
    """NaN at padded steps changes no output and no gradient (the kernel selects, never
    multiplies, what it reads there)."""
    m = norm()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, 100, D, generator=g)
    mask = torch.rand(B, 100, generator=g) > 0.4
    dy = torch.randn(B, 100, D, generator=g)
    zero = torch.zeros(B, G)
    runs = []
    for pad in (0.0, float("nan")):
        xp = x.masked_fill(~mask.unsqueeze(-1), pad)
        dyp = dy.masked_fill(~mask.unsqueeze(-1), pad)
        runs.append(kernel(m, xp, mask, None, dyp, zero, zero, block_t=32))
    for name, a, r in zip(["y", "dx", "dweight", "dbias"], *runs):
        assert torch.equal(a, r), name


@pytest.mark.parametrize("segments", [[300], [37, 1, 100, 162], [31, 33, 236]])
def test_streaming_in_segments_equals_one_pass(
    segments: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tsk, "TILE", 512)  # blocks of 64 steps: several per segment
    monkeypatch.setattr(tsk, "CHUNK", 2)
    m = norm()
    g = torch.Generator().manual_seed(3)
    x = 1.0 + torch.randn(B, L, D, generator=g)
    mask = make_mask("random")
    assert mask is not None
    with torch.no_grad(), kernels.forced("timestep_norm"):
        full, last = m(x, mask, m.initial_state(B, x))
        state, outs, s = m.initial_state(B, x), [], 0
        for n in segments:
            y, state = m(x[:, s : s + n], mask[:, s : s + n], state)
            outs.append(y)
            s += n
    assert state is not None and last is not None
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=2e-6, atol=2e-6)
    assert torch.equal(state.count, mask.sum(1))
    torch.testing.assert_close(state.mean, last.mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state.var, last.var, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_keep_float32_statistics(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 (fp16) in, out and dx, statistics in float32: as the PyTorch path computes."""
    monkeypatch.setattr(tsk, "TILE", 512)
    m = norm()
    g = torch.Generator().manual_seed(4)
    x = (2.0 + torch.randn(B, L, D, generator=g)).to(dtype)
    mask = make_mask("leading")
    dy = torch.randn(B, L, D, generator=g).to(dtype)
    count, mean, var = carried()
    outs = []
    for run in (kernels.disabled, kernels.forced):
        xr = x.clone().requires_grad_()
        for p in m.parameters():
            p.grad = None
        with run("timestep_norm"):
            y, st = m(xr, mask, TimestepNormState(count, mean, var))
        (y * dy).float().sum().backward()
        assert st is not None and y.dtype == xr.grad.dtype == dtype
        assert st.mean.dtype == st.var.dtype == torch.float32
        outs.append([y, st.mean, st.var, xr.grad, m.weight.grad, m.bias.grad])
    for name, a, r in zip(["y", "mean", "var", "dx", "dweight", "dbias"], *outs):
        tol = 1e-5 if a.dtype == torch.float32 else 1e-2  # a bf16 rounding apart at most
        torch.testing.assert_close(a.float(), r.float(), rtol=tol, atol=tol, msg=name)


def test_module_takes_the_kernel_only_where_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    apply = tsk._TimestepNormFn.apply
    monkeypatch.setattr(tsk._TimestepNormFn, "apply", lambda *a: calls.append(1) or apply(*a))
    m = norm(8, 2)
    x = torch.randn(2, 5, 8)
    m(x)
    auto = int(x.is_cuda)  # CUDA tensors take the kernel; CPU ones the PyTorch path unless forced
    assert len(calls) == auto
    with kernels.forced("timestep_norm"):
        y, _ = m(x)
        assert len(calls) == auto + 1
        m.double()(x.double())  # float64 stays on the PyTorch path
        assert len(calls) == auto + 1
    with kernels.disabled("timestep_norm"):
        ref, _ = m.float()(x)
    torch.testing.assert_close(y, ref)


def test_an_empty_segment_passes_the_state_through() -> None:
    count, mean, var = carried()
    mean, var = mean.requires_grad_(), var.requires_grad_()
    x = torch.zeros(B, 0, D)
    y, new_mean, new_var = tsk.timestep_norm(x, None, None, None, count, mean, var, G, 1e-5)
    assert y.shape == (B, 0, D)
    torch.testing.assert_close((new_mean, new_var), (mean, var), rtol=1e-6, atol=0)
    (2 * new_mean.sum() + 3 * new_var.sum()).backward()
    assert mean.grad is not None and var.grad is not None
    assert (mean.grad == 2).all() and (var.grad == 3).all()


def test_bad_inputs_fail_early() -> None:
    m = norm(8, 2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="mask must be"):
        tsk.timestep_norm(x, m.weight, m.bias, torch.ones(2, 4, dtype=torch.bool), None, None,
                          None, 2, 1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="the state must be"):
        tsk.timestep_norm(x, None, None, None, torch.zeros(2, dtype=torch.int64),
                          torch.zeros(2, 3), torch.ones(2, 3), 2, 1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        tsk.timestep_norm(x, None, None, None, None, None, None, 2, 1e-5, block_t=24)
    with pytest.raises(ValueError, match="float32, bf16 or fp16"):
        tsk.timestep_norm(x.double(), None, None, None, None, None, None, 2, 1e-5)
    with kernels.forced("timestep_norm"), pytest.raises(ValueError, match="expects 8 features"):
        m(torch.randn(2, 5, 4))


def test_the_authors_golden_case_with_the_kernel() -> None:
    """The authors' float32 run (carried counts 7, 0, 12, right pads; then leading and middle
    pads, forward only) within the golden tests' float32 tolerances: outputs and state 1e-5,
    gradients 5e-5 (tests/models/megalodon/test_megalodon_golden.py)."""
    dev = torch.get_default_device()  # CUDA when compiled (conftest)
    d = {k: v.to(dev) if isinstance(v, torch.Tensor) else v
         for k, v in golden.load_case("megalodon", "timestep_norm").items()}  # fmt: skip
    cfg = json.loads(d["config"])
    m = TimestepNorm(cfg["num_features"], cfg["num_groups"], eps=cfg["eps"])
    m.load_state_dict(convert_timestep_norm(prefixed(d, "state_dict.")))
    x = d["input.x"].float().clone().requires_grad_(True)
    prev_mean = d["input.prev_mean"].float().clone().requires_grad_(True)
    prev_var = d["input.prev_var"].float().clone().requires_grad_(True)
    count = d["input.prev_count"]
    with kernels.forced("timestep_norm"):
        y, new = m(x, ~d["input.padding_mask"], TimestepNormState(count, prev_mean, prev_var))
        with torch.no_grad():
            mid = TimestepNormState(count, prev_mean, prev_var)
            y_mid, new_mid = m(x, ~d["input.midpad_padding_mask"], mid)
    assert new is not None and new_mid is not None
    outputs = {"output.y": y, "output.mean": new.mean, "output.var": new.var,
               "midpad.output.y": y_mid, "midpad.output.mean": new_mid.mean,
               "midpad.output.var": new_mid.var}  # fmt: skip
    for name, got in outputs.items():
        assert rel_err(got, d[name]) <= 1e-5, name
    assert torch.equal(new.count, d["output.count"])
    assert torch.equal(new_mid.count, d["midpad.output.count"])
    loss = sum((t * d[f"grad_weight.{n}"].float()).sum()
               for n, t in (("y", y), ("mean", new.mean), ("var", new.var)))  # fmt: skip
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    for got, name in ((x.grad, "x"), (prev_mean.grad, "prev_mean"), (prev_var.grad, "prev_var"),
                      (m.weight.grad, "weight"), (m.bias.grad, "bias")):  # fmt: skip
        assert got is not None and rel_err(got, d[f"grad.{name}"]) <= 5e-5, name


def test_megalodon_backbone_with_the_kernel_equals_without() -> None:
    torch.manual_seed(0)
    model = tiny_megalodon(z_dim=8, v_dim=12, chunk_size=4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x = torch.randn(2, 24, 16)
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, 20:] = False
    dy = torch.randn(2, 24, 16)
    results = []
    for run in (kernels.disabled, kernels.forced):
        model.zero_grad()
        with run("timestep_norm"):
            y = model(x, mask).y
        (y * dy).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((y.detach(), grads))
    (y0, g0), (y1, g1) = results
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.slow
def test_a_million_steps_stay_close_to_float64() -> None:
    """1M steps (D = 4, G = 2, mean 1000, σ drifting 0.5 → 2) in float32: the kernel's state
    after the segment within 1e-6 of float64 in the variance, where a sequential float32 cumsum
    of the same shifted sums drifts to about 4e-5 (docs/kernels.md); every step's statistics
    within float32's own floor for data near 1000."""
    n_steps, d, g = 1_000_000, 4, 2
    gen = torch.Generator().manual_seed(0)
    spread = torch.linspace(0.5, 2.0, n_steps, dtype=torch.float64)[:, None]
    x = (1000.0 + torch.randn(1, n_steps, d, generator=gen, dtype=torch.float64) * spread).float()
    xg = x.double().view(n_steps, g, d // g)
    k = xg[0].mean(-1)  # float64 reference, shifted by the first step's mean
    n = torch.arange(1, n_steps + 1, dtype=torch.float64)[:, None]
    mu = k + (xg.mean(-1) - k).cumsum(0) / n
    var = (xg - k[:, None]).square().mean(-1).cumsum(0) / n - (mu - k).square()
    y, mean_out, var_out = tsk.timestep_norm(
        x.requires_grad_(), None, None, None, None, None, None, g, 1e-5
    )
    assert ((mean_out[0].double() - mu[-1]).abs() / var[-1].sqrt()).max() < 1e-4
    assert ((var_out[0].double() - var[-1]).abs() / var[-1]).max() < 1e-6
    mu_k, rstd_k = (t[0].double() for t in y.grad_fn.saved_tensors[7:9])
    var_k = rstd_k.square().reciprocal() - 1e-5
    assert ((mu_k - mu).abs() / var.sqrt()).max() < 2e-4
    assert ((var_k - var).abs() / var).max() < 1e-4
    assert ((var_k[-1] - var[-1]).abs() / var[-1]).max() < 1e-6


def test_the_learned_prior_starts_a_fresh_stream_in_the_kernel_too() -> None:
    """prior_count > 0: a stream without a state starts from the learned prior mean and
    log-variance on both paths, and their gradients agree."""
    torch.manual_seed(5)
    m = TimestepNorm(D, G, prior_count=3)
    assert m.prior_mean is not None and m.prior_logv is not None
    with torch.no_grad():
        m.prior_mean.normal_(0.0, 0.5)
        m.prior_logv.normal_(0.0, 0.5)
    g = torch.Generator().manual_seed(6)
    x = 1.0 + torch.randn(B, L, D, generator=g)
    dy = torch.randn(B, L, D, generator=g)
    outs = []
    for run in (kernels.disabled, kernels.forced):
        for p in m.parameters():
            p.grad = None
        with run("timestep_norm"):
            y, _ = m(x, make_mask("right"))
        (y * dy).sum().backward()
        outs.append([y, m.prior_mean.grad, m.prior_logv.grad])
    for name, a, r in zip(["y", "dprior_mean", "dprior_logv"], *outs):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=name)
