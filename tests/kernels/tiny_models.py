"""The tiny backbones the kernel tests run whole, small enough for Triton's interpreter."""

from __future__ import annotations

from megalab.models.megalodon import Megalodon, MegalodonConfig


def tiny_megalodon(z_dim: int, v_dim: int, chunk_size: int) -> Megalodon:
    """Two Megalodon layers at d 16: 2 heads, a SwiGLU of 20, CEMA dimension 4, 4 norm groups."""
    return MegalodonConfig(
        d_model=16, num_layers=2, z_dim=z_dim, v_dim=v_dim, num_heads=2, ffn_dim=20,
        swiglu=True, cema_dim=4, chunk_size=chunk_size, norm_groups=4,
    ).build()  # fmt: skip
