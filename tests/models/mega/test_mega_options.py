"""The authors' Mega options megalab reproduces beyond the golden cases, in float64 against the
equations of the authors' code (gelu_accurate, non-affine norms, normalize_embedding, the EMA
truncation semantics), and the fairseq argument mapping that refuses what it cannot build."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from megalab.models.mega.convert import (
    check_fairseq_args,
    convert_lra_model,
    convert_mega_translation,
    maga_config_from_reference,
    mega_kwargs_from_fairseq,
    mega_translation_kwargs_from_fairseq,
)
from megalab.models.mega.model import MegaBlock, MegaConfig
from megalab.nn.ema import DampedEMA
from megalab.nn.ffn import ACTIVATIONS, gelu_accurate
from megalab.nn.norms import SequenceNorm

DT = torch.float64
D, S, E, N, F_DIM = 12, 6, 20, 4, 16
EPS = 1e-5
TOL = 1e-12


def perturbed(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`module` in float64 with every parameter and batch-norm statistic moved off its init."""
    torch.manual_seed(seed)
    module = module.to(DT)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
        for name, b in module.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.2 * torch.randn_like(b))
            elif name.endswith("running_var"):
                b.copy_(1.0 + 0.3 * torch.rand_like(b))
    return module.eval()


# ------------------------------------------------------------- the authors' formulas (notes §1)
def ref_activation(name: str, x: Tensor) -> Tensor:
    if name == "gelu_accurate":  # fairseq: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[name](x)


def ref_norm(norm: SequenceNorm, x: Tensor) -> Tensor:
    """The code's SequenceNorm types (eps 1e-5), with or without their learned parameters."""
    m = norm.norm
    w = getattr(m, "weight", None)
    b = getattr(m, "bias", None)
    if norm.norm_type == "layernorm":
        var = x.var(-1, unbiased=False, keepdim=True)
        y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(var + EPS)
    elif norm.norm_type in ("scalenorm", "rmsnorm"):
        y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + EPS)
        w = getattr(m, "scalar", None) if norm.norm_type == "scalenorm" else w
    else:  # batchnorm in eval: the running statistics
        y = (x - m.running_mean) / torch.sqrt(m.running_var + EPS)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def ref_ema_kernel(ema: DampedEMA, K: int) -> Tensor:
    """k[c, l] = Σ_n (γ·scale)·p·β·q^l with p = σ(code delta), q = 1 − p·σ(code alpha)."""
    p = torch.sigmoid(ema.alpha)
    q = 1 - p * torch.sigmoid(ema.delta)
    lags = torch.arange(K, dtype=DT)
    return torch.einsum("cn,cnl->cl", ema.eta * ema.scale * p * ema.beta, q.unsqueeze(-1) ** lags)


def ref_ema(ema: DampedEMA, x: Tensor, truncation: int | None) -> Tensor:
    """SiLU(EMA(x) + ω ⊙ x) by the explicit sums (both directions include lag 0)."""
    L = x.shape[1]
    K = L if truncation is None else min(truncation, L)
    k = ref_ema_kernel(ema, K)
    y = torch.zeros_like(x)
    for t in range(L):
        for m in range(K):
            if t - m >= 0:
                y[:, t] += k[:D, m] * x[:, t - m]
            if ema.bidirectional and t + m < L:
                y[:, t] += k[D:, m] * x[:, t + m]
    return F.silu(y + ema.omega * x)


def ref_block(block: MegaBlock, x: Tensor, cfg: MegaConfig) -> Tensor:
    """The code's MAGA (notes §1.2, softmax, full attention, 'simple' bias) + NFFN (§1.8)."""
    maga, ffn = block.maga, block.ffn
    act = lambda t: ref_activation(cfg.activation, t)  # noqa: E731
    residual = x
    xn = ref_norm(maga.norm, x) if cfg.prenorm else x
    v = act(xn @ maga.v_proj.weight.T + maga.v_proj.bias)
    mx = ref_ema(maga.ema, xn, cfg.truncation)
    base = mx @ maga.mx_proj.weight.T + maga.mx_proj.bias
    u, zr, hx = torch.split(base, [D, S + E, D], dim=-1)
    z, r = torch.split(F.silu(zr), [S, E], dim=-1)
    q = z * maga.kappa[0] + maga.mu[0]
    k = z * maga.kappa[1] + maga.mu[1]
    L = x.shape[1]
    w = maga.attention.rel_pos_bias.weight
    M = (w.numel() + 1) // 2
    idx = torch.arange(L)
    bias = w[M - 1 + idx.view(1, -1) - idx.view(-1, 1)]  # bias[i, j] = w[M − 1 + j − i]
    attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(S) + bias, dim=-1)
    h = act(hx + (attn @ v * r) @ maga.h_proj.weight.T + maga.h_proj.bias)
    out = residual + torch.sigmoid(u) * (h - residual)
    if not cfg.prenorm:
        out = ref_norm(maga.norm, out)
    assert ffn is not None
    residual = out
    y = ref_norm(ffn.norm, out) if cfg.prenorm else out
    y = act(y @ ffn.fc1.weight.T + ffn.fc1.bias) @ ffn.fc2.weight.T + ffn.fc2.bias + residual
    return y if cfg.prenorm else ref_norm(ffn.norm, y)


# ------------------------------------------------------------------------------------ tests
def test_gelu_accurate_is_fairseqs_tanh_formula() -> None:
    x = torch.linspace(-6, 6, 1001, dtype=DT)
    want = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    assert torch.equal(gelu_accurate(x), want)
    assert torch.allclose(gelu_accurate(x), F.gelu(x, approximate="tanh"), atol=1e-15, rtol=0)
    assert ACTIVATIONS["gelu_accurate"] is gelu_accurate
    assert (gelu_accurate(x) - F.gelu(x)).abs().max() > 1e-5  # not the erf GELU


@pytest.mark.parametrize(
    "norm_type, prenorm, activation, truncation",
    [
        ("layernorm", False, "gelu_accurate", None),
        ("layernorm", True, "silu", 5),
        ("scalenorm", False, "silu", None),
        ("scalenorm", True, "gelu_accurate", 3),
        ("rmsnorm", True, "silu", None),
        ("batchnorm", True, "gelu_accurate", None),
        ("batchnorm", False, "silu", 4),
    ],
)
@pytest.mark.parametrize("norm_affine", [False, True])
def test_block_matches_the_codes_equations(
    norm_type: str, prenorm: bool, activation: str, truncation: int | None, norm_affine: bool
) -> None:
    cfg = MegaConfig(
        d_model=D, z_dim=S, v_dim=E, ffn_dim=F_DIM, ema_dim=N, max_positions=16,
        norm_type=norm_type, prenorm=prenorm, norm_affine=norm_affine, activation=activation,
        truncation=truncation,
    )  # fmt: skip
    block = perturbed(MegaBlock(cfg))
    norm_params = [n for n, _ in block.named_parameters() if ".norm." in n]
    assert bool(norm_params) == norm_affine, norm_params  # non-affine: no gain, no bias
    x = torch.randn(2, 11, D, dtype=DT, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y, _ = block(x)
        assert torch.allclose(y, ref_block(block, x, cfg), atol=TOL, rtol=0)


@pytest.mark.parametrize("norm_type", ["layernorm", "scalenorm", "rmsnorm", "batchnorm"])
def test_non_affine_norms_have_no_parameters(norm_type: str) -> None:
    norm = perturbed(SequenceNorm(norm_type, D, affine=False))
    assert list(norm.parameters()) == []
    x = torch.randn(3, 5, D, dtype=DT)
    assert torch.allclose(norm(x), ref_norm(norm, x), atol=TOL, rtol=0)


def test_truncation_zero_is_the_codes_empty_kernel() -> None:
    """Causal: min(0, L) = 0 taps, so the stateless pass is SiLU(ω ⊙ x); the streaming path is
    the exact recurrence (the code's `step` ignores truncation). Bidirectional: refused."""
    ema = perturbed(DampedEMA(D, N, bidirectional=False, truncation=0))
    x = torch.randn(2, 9, D, dtype=DT)
    with torch.no_grad():
        y, _ = ema(x)
        assert torch.allclose(y, F.silu(ema.omega * x), atol=TOL, rtol=0)
        full = perturbed(DampedEMA(D, N, bidirectional=False, truncation=None))
        full.load_state_dict(ema.state_dict())
        streamed, _ = ema(x, state=ema.initial_state(2, x))
        assert torch.allclose(streamed, full(x)[0], atol=TOL, rtol=0)
        assert torch.allclose(full(x)[0], ref_ema(full, x, None), atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="truncation=0 gives a bidirectional EMA an empty kernel"):
        DampedEMA(D, N, bidirectional=True, truncation=0)
    with pytest.raises(ValueError, match="truncation must be a kernel length >= 0"):
        DampedEMA(D, N, truncation=-1)


@pytest.mark.parametrize("truncation", [None, 4, 50])
def test_truncation_keeps_min_truncation_l_taps(truncation: int | None) -> None:
    """None: K = L; otherwise K = min(truncation, L), both directions."""
    ema = perturbed(DampedEMA(D, N, bidirectional=True, truncation=truncation))
    x = torch.randn(2, 10, D, dtype=DT)
    with torch.no_grad():
        assert torch.allclose(ema(x)[0], ref_ema(ema, x, truncation), atol=TOL, rtol=0)


def test_embed_norm_normalises_the_embedding_before_its_dropout() -> None:
    kw = dict(d_model=D, num_layers=2, z_dim=S, v_dim=E, ffn_dim=F_DIM, ema_dim=N,
              max_positions=16, prenorm=False)  # fmt: skip
    model = perturbed(MegaConfig(**kw, embed_norm=True).build())
    plain = MegaConfig(**kw).build().to(DT).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "embed_norm" not in k})
    x = torch.randn(2, 7, D, dtype=DT)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    with torch.no_grad():
        want = plain(ref_norm(model.embed_norm, x) * mask.unsqueeze(-1), mask).y
        assert torch.allclose(model(x, mask).y, want, atol=TOL, rtol=0)
    # The dropout follows the norm: in training, zeroed entries of Norm(x) stay zero at the input
    # of the first block.
    drop = MegaConfig(**kw, embed_norm=True, embed_dropout=0.5).build().to(DT).train()
    seen: list[Tensor] = []
    drop.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    torch.manual_seed(0)
    drop(x)
    torch.manual_seed(0)
    want = F.dropout(drop.embed_norm(x), 0.5, training=True)
    assert torch.equal(seen[0], want)
    with pytest.raises(ValueError, match=r"normalize_embedding.*post-norm"):
        MegaConfig(**kw | {"prenorm": True}, embed_norm=True).build()
    with pytest.raises(ValueError, match="embed_dropout only"):
        MegaConfig(**kw, embed_dropout=0.1).build()


# -------------------------------------------------------------------------- fairseq arguments
def golden_args() -> dict:
    """The full arg namespace of a small Mega LRA text model (after its arch defaults)."""
    return {
        "act_dropout": 0.0, "activation_fn": "silu", "adaptive_input": False,
        "apply_bert_init": False, "attention_activation_fn": "softmax", "attention_dropout": 0.0,
        "chunk_size": 8, "classifier_activation_fn": "gelu", "classifier_in_dim": D,
        "classifier_layers": 1, "classifier_out_dim": 2 * D, "decoder_embed_dim": D,
        "dropout": 0.1, "encoder_attention_heads": 8, "encoder_embed_dim": D,
        "encoder_ffn_embed_dim": F_DIM, "encoder_hidden_dim": E, "encoder_layers": 2,
        "encoder_learned_pos": False, "encoder_normalize_before": False, "feature_dropout": False,
        "input_type": "text", "layer_type": "mega", "max_positions": 64,
        "max_source_positions": 64, "n_dim": N, "no_token_positional_embeddings": False,
        "norm_type": "layernorm", "normalize_embedding": False, "rel_pos_bias": "simple",
        "sen_rep_type": "mp", "sent_loss": True, "sentence_class_num": 3,
        "share_encoder_input_output_embed": False, "truncation_length": 16, "use_p": False,
        "z_dim": S,
        # trainer options of a checkpoint's namespace: they do not shape the model
        "lr": [0.001], "optimizer": "adam", "seed": 1, "max_update": 90000,
    }  # fmt: skip


def test_fairseq_args_map_the_options() -> None:
    args = golden_args() | {"activation_fn": "gelu_fast", "normalize_embedding": True,
                            "truncation_length": None}  # fmt: skip
    kw = mega_kwargs_from_fairseq(args)
    assert kw["activation"] == "gelu_accurate"  # fairseq's deprecated alias
    assert kw["embed_norm"] is True and kw["embed_dropout"] == 0.1
    assert kw["truncation"] is None  # the code's kernel length L
    MegaConfig(**kw).build()  # builds
    assert mega_kwargs_from_fairseq(golden_args())["truncation"] == 16


@pytest.mark.parametrize(
    "change, message",
    [
        ({"feature_dropout": True}, "feature_dropout=True is not supported"),
        ({"layer_type": "luna"}, "layer_type='luna' is not supported"),
        ({"sen_rep_type": "cls"}, "sen_rep_type='cls' is not supported"),
        ({"classifier_layers": 2}, "classifier_layers=2 is not supported"),
        ({"apply_bert_init": True}, "apply_bert_init=True is not supported"),
        ({"use_p": True}, "use_p=True is not supported"),
        ({"activation_fn": "tanh"}, "activation_fn='tanh' is not supported"),
        ({"truncation_length": 0}, "truncation_length=0"),
        ({"encoder_window_size": 4}, "unknown fairseq model arg encoder_window_size=4"),
        ({"normalize_embedding": True, "encoder_normalize_before": True}, "exclusive"),
    ],
)
def test_fairseq_args_refuse_what_megalab_cannot_build(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mega_kwargs_from_fairseq(golden_args() | change)
    with pytest.raises(ValueError, match=message):
        check_fairseq_args(golden_args() | change)


def test_reference_layer_kwargs_map_norm_affine_truncation_and_refuse_unknowns() -> None:
    kw = {
        "embed_dim": D, "zdim": S, "hdim": E, "ndim": N, "dropout": 0.0,
        "attention_dropout": 0.0, "hidden_dropout": 0.0, "activation": "gelu_accurate",
        "attention_activation": "softmax", "bidirectional": False, "chunk_size": -1,
        "truncation": 0, "norm_type": "scalenorm", "prenorm": True, "norm_affine": False,
        "feature_dropout": False, "rel_pos_bias": "simple", "max_positions": 16, "export": False,
    }  # fmt: skip
    cfg = maga_config_from_reference(kw)
    assert (cfg.truncation, cfg.norm_affine, cfg.causal) == (0, False, True)
    with pytest.raises(ValueError, match="unknown Mega layer argument 'window'"):
        maga_config_from_reference(kw | {"window": 3})
    with pytest.raises(ValueError, match="feature_dropout=True"):
        maga_config_from_reference(kw | {"feature_dropout": True})
    with pytest.raises(ValueError, match="truncation=0 gives a bidirectional EMA"):
        MegaBlock(maga_config_from_reference(kw | {"bidirectional": True}))


def test_lra_checkpoint_with_normalize_embedding_loads_strictly() -> None:
    """`encoder.encoder.embed_norm.norm.*` becomes the backbone's embed_norm."""
    from megalab.nn.embedding import TokenEmbedding
    from megalab.nn.heads import ClassificationHead
    from megalab.tasks.classification import ClassificationTask

    args = golden_args() | {"normalize_embedding": True, "dropout": 0.0}
    ours = ClassificationTask(
        TokenEmbedding(30, D, pad_id=1), MegaConfig(**mega_kwargs_from_fairseq(args)).build(),
        ClassificationHead(D, 2 * D, 3), num_classes=3, pooling="mean",
    )  # fmt: skip
    sd = ours.state_dict()
    # The same weights under the authors' names.
    theirs = {"encoder.encoder.embed_tokens.embed.weight": sd["encoder.embedding.weight"]}
    for name, t in sd.items():
        if name.startswith("backbone.embed_norm."):
            theirs["encoder.encoder." + name[len("backbone.") :]] = t
    assert len(theirs) == 3  # the embedding and the embed norm's weight and bias
    converted = convert_lra_model(theirs)
    assert set(converted) == {"encoder.embedding.weight", "backbone.embed_norm.norm.weight",
                              "backbone.embed_norm.norm.bias"}  # fmt: skip
    for k, v in converted.items():
        assert torch.equal(v, sd[k])
    assert json.dumps(mega_kwargs_from_fairseq(args))  # plain values only


def test_translation_normalize_embedding_is_refused_by_name() -> None:
    """The translation model's embedding norm has no place in MegaEncoderDecoder: refused."""
    with pytest.raises(KeyError, match=r"encoder\.embed_norm\.norm\.weight.*--normalize-embedding"):
        convert_mega_translation({"encoder.embed_norm.norm.weight": torch.ones(D)})


MT_ARGS = {
    "encoder_embed_dim": D, "encoder_layers": 2, "decoder_layers": 2, "encoder_z_dim": S,
    "encoder_hidden_dim": E, "encoder_ffn_embed_dim": F_DIM, "encoder_n_dim": N,
    "encoder_chunk_size": -1, "decoder_chunk_size": -1, "truncation_length": 0,
    "attention_activation_fn": "softmax", "rel_pos_bias": "simple", "max_source_positions": 64,
    "max_target_positions": 64, "normalization_type": "layernorm", "normalize_before": False,
    "dropout": 0.1, "attention_dropout": 0.1, "hidden_dropout": 0.1, "activation_dropout": 0.1,
    "activation_fn": "gelu_fast", "share_all_embeddings": True,
    # the arch defaults of a real namespace
    "encoder_embed_path": None, "decoder_embed_path": None, "decoder_embed_dim": D,
    "decoder_input_dim": D, "decoder_hidden_dim": E, "decoder_ffn_embed_dim": F_DIM,
    "decoder_z_dim": S, "decoder_n_dim": N, "feature_dropout": False,
    "normalize_embedding": False, "no_scale_embedding": False, "adaptive_softmax_cutoff": None,
    "adaptive_softmax_dropout": 0, "share_decoder_input_output_embed": True,
    "adaptive_input": False, "tie_adaptive_weights": False, "lr": [5e-4],
}  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decoder_z_dim": 2 * S}, "decoder_z_dim=12 differs from encoder_z_dim=6"),
        ({"no_scale_embedding": True}, "no_scale_embedding=True is not supported"),
        ({"normalize_embedding": True}, "normalize_embedding=True is not supported"),
        ({"adaptive_softmax_cutoff": "1000"}, "adaptive_softmax_cutoff='1000' is not supported"),
        ({"feature_dropout": True}, "feature_dropout=True is not supported"),
        ({"decoder_learned_pos": True}, "unknown fairseq model arg decoder_learned_pos=True"),
        ({"activation_fn": "tanh"}, "activation_fn='tanh' is not supported"),
    ],
)
def test_translation_args_map_and_refuse_by_name(change: dict, message: str) -> None:
    kw = mega_translation_kwargs_from_fairseq(MT_ARGS)
    assert kw["activation"] == "gelu_accurate" and kw["truncation"] is None
    with pytest.raises(ValueError, match=message):
        mega_translation_kwargs_from_fairseq(MT_ARGS | change)
