"""Transformer baseline specifics: position limits and tables, shared layers, drop path, BERT
init (the shared contract suite covers causality, padding, bf16 and compile)."""

from __future__ import annotations

import pytest
import torch

from megalab.models.transformer.model import Transformer, TransformerConfig, sinusoidal_positions


def make(**kw) -> Transformer:
    torch.manual_seed(0)
    args = dict(d_model=16, num_layers=2, num_heads=4, ffn_dim=32, dropout=0.0)
    return TransformerConfig(**(args | kw)).build().double().eval()


def test_learned_positions_enforce_their_limit() -> None:
    model = make(positions="learned", max_len=8)
    assert model.max_len == 8
    model(torch.randn(1, 8, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"max_len=8 of Transformer \(its learned position"):
        model(torch.randn(1, 9, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="need `max_len`"):
        TransformerConfig(d_model=16, positions="learned").build()


def test_shared_layers_share_parameters() -> None:
    shared = make(share_layers=True, num_layers=4)
    separate = make(num_layers=4)
    assert sum(p.numel() for p in separate.parameters()) > 3 * sum(
        p.numel() for p in shared.layers[0].parameters()
    )
    assert (
        sum(p.numel() for p in shared.parameters())
        < sum(p.numel() for p in separate.parameters()) / 3
    )


def test_sinusoidal_table() -> None:
    table = sinusoidal_positions(5, 6)
    assert table.shape == (5, 6)
    torch.testing.assert_close(table[:, 0], torch.sin(torch.arange(5.0)))
    torch.testing.assert_close(table[:, 1], torch.cos(torch.arange(5.0)))


def test_drop_path_grows_over_depth_and_is_identity_in_eval() -> None:
    model = make(num_layers=3, drop_path=0.2)
    assert [layer.drop_path.p for layer in model.layers] == pytest.approx([0.0, 0.1, 0.2])
    x = torch.randn(4, 6, 16, dtype=torch.float64)
    torch.testing.assert_close(model(x).y, make(num_layers=3)(x).y)  # eval: no drop
    with pytest.raises(ValueError, match="share_layers"):
        TransformerConfig(d_model=16, num_heads=4, share_layers=True, drop_path=0.1).build()


def test_embed_norm_is_off_by_default() -> None:
    model = make()
    assert model.embed_norm is None
    assert not any("embed_norm" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_embed_norm_follows_the_positions_and_precedes_the_dropout(positions: str) -> None:
    # fairseq's TransformerLRAEncoder: embed -> + positions -> emb_layer_norm -> dropout.
    model = make(embed_norm=True, dropout=0.5, positions=positions, max_len=12).train()
    seen: dict[str, torch.Tensor] = {}
    model.embed_norm.register_forward_hook(
        lambda m, args, out: seen.update(norm_in=args[0], norm_out=out)
    )
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.update(layer_in=args[0]))
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    model(x)
    pos = (
        sinusoidal_positions(12, 16, dtype=torch.float64)
        if positions == "sinusoidal"
        else model.pos_embedding.weight[:12]
    )
    torch.testing.assert_close(seen["norm_in"], x + pos)  # positions first, nothing dropped
    expected = torch.nn.functional.layer_norm(x + pos, (16,))  # affine (1, 0) at init
    torch.testing.assert_close(seen["norm_out"], expected)
    kept = seen["layer_in"] != 0
    assert 0 < kept.double().mean() < 1  # the dropout acts after the norm...
    torch.testing.assert_close(seen["layer_in"][kept], 2 * expected[kept])  # ...on its output


def test_embed_norm_keeps_padding_invisible() -> None:
    model = make(embed_norm=True)
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    mask = torch.tensor([[True] * 6 + [False] * 3])
    y = model(x, mask).y
    alone = model(x[:, :6]).y
    torch.testing.assert_close(y[:, :6], alone)
    assert (y[~mask] == 0).all()


def test_bert_init_statistics() -> None:
    torch.manual_seed(0)
    model = TransformerConfig(d_model=64, num_layers=2, num_heads=4, ffn_dim=256, prenorm=False,
                              positions="learned", max_len=64, embed_norm=True,
                              init="bert").build()  # fmt: skip
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 4  # qkv, out, fc1, fc2 per layer
    for m in linears:
        assert m.weight.std().item() == pytest.approx(0.02, rel=0.1)
        assert abs(m.weight.mean().item()) < 0.002
        assert (m.bias == 0).all()
    assert model.pos_embedding.weight.std().item() == pytest.approx(0.02, rel=0.1)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * 2 + 1 and all(
        (n.weight == 1).all() and (n.bias == 0).all() for n in norms
    )
    # the default keeps PyTorch's Linear init: U(+-1/sqrt(fan_in)), std 1/sqrt(3 * 64) ~ 0.072
    default = make(d_model=64, ffn_dim=256)
    assert default.layers[0].attn.qkv.weight.std().item() == pytest.approx(0.072, rel=0.1)
    assert (default.layers[0].fc1.bias != 0).any()


def test_bert_init_with_shared_layers_and_bad_names() -> None:
    model = make(share_layers=True, num_layers=3, init="bert")
    assert (model.layers[0].fc1.bias == 0).all() and model.layers[0] is model.layers[2]
    with pytest.raises(ValueError, match="unknown init 'xavier'"):
        TransformerConfig(d_model=16, num_heads=4, init="xavier").build()
