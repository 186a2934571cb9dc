"""Parameter counts of the published Mega configurations.

Accounting: learnable parameters only (BatchNorm running statistics are buffers, not counted),
BN/LN affine included, EMA parameters doubled for the bidirectional encoders, 'simple' bias of
size 2M − 1 (M = chunk size when chunked, else max_positions). Classifiers are our backbone +
`FeatureEmbedding(1, D)` (the authors' x·w + b) + `ClassificationHead(D_in, 2D, classes)`
(fc1 with bias, fc2 without), exactly the authors' LRA/SC model. The SC counts are the ones in
mega-code.md §2.1 (475,890 for SC-big, README "476k"; 343,134 for SC-base, reported "300k").
"""

from __future__ import annotations

import pytest

from megalab.models.mega.model import MegaConfig
from megalab.nn.embedding import FeatureEmbedding
from megalab.nn.heads import ClassificationHead


def count(*modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def formula(D, z, v, F, h, layers, M, norm="batchnorm", bidirectional=True, rotary=False):
    """Per-layer formula of mega-paper.md §7, summed over layers, plus the final norm."""
    norm_size = {"batchnorm": 2 * D, "layernorm": 2 * D, "scalenorm": 1, "rmsnorm": D}[norm]
    d_ema = 2 * D if bidirectional else D
    per_layer = (
        4 * d_ema * h + D  # EMA: α, δ, β, η and ω
        + D * v + v  # v_proj
        + D * (z + v + 2 * D) + (z + v + 2 * D)  # mx_proj
        + v * D + D  # h_proj
        + 4 * z  # κ, μ
        + (2 * z if rotary else 2 * M - 1)  # relative position bias
        + norm_size  # MAGA norm
        + 2 * D * F + F + D + norm_size  # FFN and its norm
    )  # fmt: skip
    return layers * per_layer


def sc_model(D: int):
    backbone = MegaConfig(
        D,
        6,
        D // 2,
        2 * D,
        2 * D,
        16,
        chunk_size=1000,
        truncation=1000,
        attention_activation="laplace",
        norm_type="batchnorm",
        prenorm=True,
    ).build()
    return backbone, FeatureEmbedding(1, D, init="mega"), ClassificationHead(D, 2 * D, 10)


@pytest.mark.parametrize("D, expected", [(72, 475_890), (60, 343_134)])
def test_speech_commands_counts(D: int, expected: int) -> None:
    backbone, embedding, head = sc_model(D)
    assert count(backbone, embedding, head) == expected
    assert count(backbone) == formula(D, D // 2, 2 * D, 2 * D, 16, 6, 1000) + 2 * D


def test_enwik8_backbone_count() -> None:
    """enwik8 (Table 9): 12 causal layers, d 512, z 128, v = F = 1024, rotary, non-affine final
    LayerNorm. The backbone has 39,031,296 parameters; the ~200-symbol tied byte embedding
    (≈0.1M) brings it to the reported 39M (39.1M)."""
    backbone = MegaConfig(
        512,
        12,
        128,
        1024,
        1024,
        16,
        chunk_size=2048,
        rel_pos_bias="rotary",
        norm_type="layernorm",
        prenorm=True,
        final_norm_affine=False,
        causal=True,
    ).build()
    n = count(backbone)
    assert n == formula(512, 128, 1024, 1024, 16, 12, 0, "layernorm", False, True)
    assert n == 39_031_296
    assert round((n + 204 * 512) / 1e6, 1) == 39.1


# (layers, D, z, v=F, norm, prenorm, classes, max_positions, approx. total in M from the notes)
LRA_PIXEL = {
    "image": (8, 160, 96, 320, "batchnorm", 10, 1024, 2.84),
    "pathfinder": (6, 128, 64, 256, "batchnorm", 2, 1024, 1.39),
    "pathx": (4, 64, 32, 128, "syncbatchnorm", 2, 16384, 0.38),
}


@pytest.mark.parametrize("task", sorted(LRA_PIXEL))
def test_lra_pixel_counts(task: str) -> None:
    """Full-attention Mega (chunk −1, 'simple' bias sized by max_positions), mega-paper.md §7."""
    layers, D, z, v, norm, classes, M, approx = LRA_PIXEL[task]
    backbone = MegaConfig(
        D,
        layers,
        z,
        v,
        v,
        16,
        chunk_size=-1,
        max_positions=M,
        attention_activation="laplace",
        norm_type=norm,
        prenorm=True,
    ).build()
    total = count(
        backbone, FeatureEmbedding(1, D, init="mega"), ClassificationHead(D, 2 * D, classes)
    )
    assert count(backbone) == formula(D, z, v, v, 16, layers, M) + 2 * D
    assert round(total / 1e6, 2) == approx


@pytest.mark.parametrize(
    "layers, D, z, v, norm, M",
    [(6, 80, 64, 160, "layernorm", 2002), (4, 128, 64, 256, "scalenorm", 4002)],
)
def test_lra_text_backbone_counts(layers, D, z, v, norm, M) -> None:
    """ListOps / Text backbones (post-norm, no final norm); the totals depend on the vocabulary."""
    backbone = MegaConfig(
        D, layers, z, v, v, 16, chunk_size=-1, max_positions=M, norm_type=norm, prenorm=False
    ).build()
    assert count(backbone) == formula(D, z, v, v, 16, layers, M, norm)
