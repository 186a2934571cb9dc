"""LaMemo vs the authors' code: every LaMemo case of `<shared>/golden/lamemo/` (its README).

- `lamemo_3segments`: memory 8 > segment 6, so segment 2 refreshes memory rows a second time
  (the carried log-normaliser accumulates over two look-ahead windows);
- `lamemo_mem_eq_seg`: memory = segment (every training script);
- `lamemo_clamp_len`: clamp_len 3, which also clamps the look-ahead distances;
- `lamemo_decode`: segments 6, 1, 1, 1, 3, 6, the code's generation loop (qlen = 1 takes the
  window of just the new token);
- `lamemo_3segments_fp32`: the unmodified reference in float32 (atol 2e-5, rtol 1e-5).

Per segment: logits, NLL, hidden state, sinusoid table, the memory (embeddings, running contexts
and log-normalisers), per layer the causal and look-ahead probabilities, α, and the segment's and
memory's sub-layer outputs; gradients of ½·mean(NLL) per segment and summed. Never skipped under
CI.
"""

from __future__ import annotations

import pytest

import xl_golden

CASES = [
    "lamemo_3segments",
    "lamemo_mem_eq_seg",
    "lamemo_clamp_len",
    "lamemo_decode",
    "lamemo_3segments_fp32",
]


@pytest.mark.parametrize("name", CASES)
def test_golden_segments_and_gradients(name: str) -> None:
    xl_golden.check_case(name, lamemo=True)


def test_epsilon_is_added_after_the_max_shift() -> None:
    """Without ε, or with ε outside the shift, α moves by ~1e-6: the float64 tolerance sees it."""
    d = xl_golden.load("lamemo_3segments")
    runs = xl_golden.run_case(d, xl_golden.build(d, eps=0.0))
    with pytest.raises(AssertionError):
        xl_golden.check_segment(d, 2, runs[2], lamemo=True)
