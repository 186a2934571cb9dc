"""The S4D baseline (`megalab.models.s4d`) against its own equations, in float64.

The backbone contract (shapes, padding, streaming, gradients, compile) is checked for every
variant of configs/model/s4d.yaml by tests/models/test_backbone_contract.py; here the block is
computed by hand from the formulas of the module docstring.
"""

from __future__ import annotations

import pytest
import torch

from megalab.models.s4d import S4DBlock, S4DConfig

DT = torch.float64


def direct_kernel(ssm: torch.nn.Module, length: int) -> torch.Tensor:
    """𝒦[d, l] = 2 Re(Σ_n C (exp(ΔA) − 1)/A · exp(ΔA)^l), term by term: (rows, length)."""
    A = torch.complex(-ssm.log_A_real.exp(), ssm.A_imag)
    dtA = ssm.log_dt.exp()[:, None] * A
    C = torch.view_as_complex(ssm.C.contiguous())
    steps = torch.arange(length, dtype=DT)
    terms = (C * (dtA.exp() - 1) / A)[..., None] * torch.exp(dtA[..., None] * steps)
    return 2 * terms.sum(1).real


def by_hand(blk: S4DBlock, x: torch.Tensor, mask: torch.Tensor, bidirectional: bool):
    """The S4 residual block, one sum per output position."""
    L, D = x.shape[1:]
    z = blk.norm(x) if blk.prenorm else x
    zt = z * mask[..., None]
    k = direct_kernel(blk.ssm, L + 1)
    u = torch.zeros_like(z)
    for t in range(L):
        for m in range(t + 1):  # Σ_{m≥0} 𝒦[m] z̃_{t−m}
            u[:, t] += k[:D, m] * zt[:, t - m]
        if bidirectional:  # Σ_{m≥0} 𝒦_bwd[m] z̃_{t+1+m}
            for m in range(L - 1 - t):
                u[:, t] += k[D:, m] * zt[:, t + 1 + m]
    u = u + blk.ssm.omega * z  # D ⊙ z on the unmasked input
    v = 0.5 * u * (1 + torch.erf(u / 2**0.5))  # GELU
    W, b = blk.output_linear.weight, blk.output_linear.bias
    a, g = (v @ W[:D].T + b[:D]), (v @ W[D:].T + b[D:])
    y = x + a * torch.sigmoid(g)
    return y if blk.prenorm else blk.norm(y)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("norm_type", "prenorm"), [("layernorm", True), ("batchnorm", False)])
def test_block_is_the_s4_residual_block(bidirectional: bool, norm_type: str, prenorm: bool):
    torch.manual_seed(0)
    cfg = S4DConfig(d_model=3, state_dim=4, bidirectional=bidirectional, norm_type=norm_type,
                    prenorm=prenorm)  # fmt: skip
    blk = S4DBlock(cfg).to(DT).eval()
    with torch.no_grad():
        for p in blk.parameters():
            p.add_(0.3 * torch.randn_like(p))
        if norm_type == "batchnorm":
            bn = blk.norm.norm
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 7, 3, dtype=DT)
    mask = torch.arange(7) < torch.tensor([[7], [5]])
    y, _ = blk(x, mask)
    torch.testing.assert_close(y, by_hand(blk, x, mask.to(DT), bidirectional), rtol=1e-10,
                               atol=1e-10)  # fmt: skip


def test_causal_stream_equals_one_pass() -> None:
    torch.manual_seed(1)
    model = S4DConfig(d_model=4, num_layers=2, state_dim=4, bidirectional=False,
                        norm_type="layernorm").build().to(DT).eval()  # fmt: skip
    x = torch.randn(2, 11, 4, dtype=DT)
    full = model(x).y
    state = model.initial_state(2, x)
    outs = []
    for a, b in [(0, 4), (4, 5), (5, 11)]:
        out = model(x[:, a:b], None, state)
        outs.append(out.y)
        state = out.state
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


def test_bidirectional_model_refuses_a_state() -> None:
    model = S4DConfig(d_model=4, num_layers=1, state_dim=2).build()
    assert model.initial_state(1, torch.zeros(1)) is None
    with pytest.raises(ValueError, match="bidirectional=False"):
        model(torch.zeros(1, 3, 4), None, object())  # type: ignore[arg-type]


def test_listops_parameter_count_by_formula() -> None:
    """experiment=s4d/lra_listops: 6 post-norm blocks, D = 256, N = 4, bidirectional. Per block:
    norm 2D; S4D per direction Δ (D), A (D·N/2 real and imaginary), C (D·N/2 complex), and D's
    skip ω (D); GLU linear 2D² + 2D: 2D² + 7D + 4DN in all."""
    D, N, L = 256, 4, 6
    model = S4DConfig(d_model=D, num_layers=L, state_dim=N, prenorm=False).build()
    assert sum(p.numel() for p in model.parameters()) == L * (2 * D * D + 7 * D + 4 * D * N)


def test_config_is_validated_with_a_hint() -> None:
    with pytest.raises(ValueError, match="even state_dim"):
        S4DConfig(state_dim=3)
    with pytest.raises(ValueError, match="norm_type"):
        S4DConfig(norm_type="scalenorm").build()


def test_tied_dropout_shares_the_mask_over_time() -> None:
    torch.manual_seed(2)
    blk = S4DBlock(S4DConfig(d_model=8, state_dim=2, dropout=0.5, dropout_tied=True)).train()
    y = blk.dropout(torch.ones(3, 10, 8))
    assert ((y == 0).all(1) | (y != 0).all(1)).all()  # each (batch, channel) dropped or kept
