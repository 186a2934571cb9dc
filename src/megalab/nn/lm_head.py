"""What a language model's output head offers the code that uses it.

The LM task computes its loss with `nll`, sampling and evaluation read `log_probs`, and
`task.tie_weights` calls `tie_encoder`. megalab's heads: `LinearLMHead`
(`megalab.tasks.language_modeling`), `AdaptiveSoftmax` (`megalab.nn.adaptive`) and
`ProjectedAdaptiveLogSoftmax` (`megalab.nn.adaptive_xl`).
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["LMHead"]


class LMHead(nn.Module):
    """An output head over the vocabulary for (B, L, D) hidden states."""

    def nll(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Per-token negative log-likelihood (B, L) in nats of `targets` (B, L)."""
        raise NotImplementedError

    def log_probs(self, hidden: Tensor) -> Tensor:
        """Log-probabilities (B, L, V) of every token."""
        raise NotImplementedError

    def tie_encoder(self, encoder: nn.Module) -> None:
        """Share the output weights with the task's encoder (`task.tie_weights`); a head that
        cannot says why."""
        raise ValueError(
            f"{type(self).__name__} cannot share its weights with an encoder: set "
            "task.tie_weights=false"
        )
