"""S4D baseline backbone (Gu et al., NeurIPS 2022) in the S4 repository's residual block."""

from megalab.models.s4d.model import S4DBackbone, S4DBlock, S4DConfig, S4DState, TiedDropout

__all__ = ["S4DBackbone", "S4DBlock", "S4DConfig", "S4DState", "TiedDropout"]
