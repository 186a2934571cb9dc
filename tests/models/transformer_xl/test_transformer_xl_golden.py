"""Transformer-XL vs the authors' code: `txl_3segments` (memory 8 > segment 6: the memory fills
up, then slides) and `txl_mem_eq_seg` (memory = segment, the training scripts' setting), from
`<shared>/golden/lamemo/` (see its README).

Per segment, with the memory carried: logits, NLL, the final hidden state, the sinusoid table,
every memory tensor, and per layer the attention probabilities and sub-layer outputs; the
gradients of ½·mean(NLL) (the reference trainer's objective) per segment and summed, for every
parameter. float64 at atol 1e-10, rtol 1e-9. Never skipped under CI (`tests/golden.py`).
"""

from __future__ import annotations

import pytest

import xl_golden

CASES = ["txl_3segments", "txl_mem_eq_seg"]


@pytest.mark.parametrize("name", CASES)
def test_golden_segments_and_gradients(name: str) -> None:
    xl_golden.check_case(name, lamemo=False)
