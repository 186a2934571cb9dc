"""Reading the authors' checkpoints safely and fitting their vocabulary order to ours."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import xl_golden
from golden import prefixed
from megalab.models.lamemo.convert import (
    ReferenceVocab,
    convert_lm,
    lamemo_kwargs_from_reference,
    load_reference_checkpoint,
    permute_vocabulary,
    state_from_reference,
    vocabulary_permutation,
)


def test_trainer_checkpoint_loads_without_the_authors_code(tmp_path: Path) -> None:
    """A LaMemo trainer checkpoint pickles its args (Namespace) and its `utils.vocabulary.Vocab`:
    both are read as data (the vocabulary into the inert ReferenceVocab), nothing imported."""
    pkg = tmp_path / "src" / "utils"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "vocabulary.py").write_text(
        textwrap.dedent("""
        from collections import Counter
        class Vocab:
            def __init__(self):
                self.idx2sym = ["<eos>", "the"]
                self.counter = Counter({"the": 3})
            def __setstate__(self, state):
                raise RuntimeError("the authors' code ran")
    """)
    )
    sys.path.insert(0, str(tmp_path / "src"))
    try:
        from utils.vocabulary import Vocab  # the authors' class, only to write the file

        ckpt = {"args": argparse.Namespace(lr=2.5e-4), "model_state": {"r_w_bias": torch.ones(2)},
                "vocab": Vocab(), "model_config": {"attn_type": 3}}  # fmt: skip
        torch.save(ckpt, tmp_path / "checkpoint_best.pt")
    finally:
        sys.path.remove(str(tmp_path / "src"))
        for name in ("utils.vocabulary", "utils"):
            sys.modules.pop(name, None)
    loaded = load_reference_checkpoint(tmp_path / "checkpoint_best.pt")
    assert isinstance(loaded["vocab"], ReferenceVocab)
    assert loaded["vocab"].idx2sym == ["<eos>", "the"] and loaded["args"]["lr"] == 2.5e-4
    torch.save({"w": torch.ones(1)}, tmp_path / "state.pt")
    assert set(load_reference_checkpoint(tmp_path / "state.pt")["model_state"]) == {"w"}


def test_unknown_objects_are_refused(tmp_path: Path) -> None:
    torch.save({"model_state": {}, "fn": print}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="loads without running code"):
        load_reference_checkpoint(tmp_path / "bad.pt")


def test_vocabulary_permutation_keeps_the_model() -> None:
    """Reordering embedding and output rows to our ids gives the same distribution per symbol;
    symbols the reference lacks get probability 0."""
    d = xl_golden.load("lamemo_mem_eq_seg")
    sd = convert_lm(prefixed(d, "state_dict."))
    ref_symbols = [f"s{i}" for i in range(50)]
    ours = [*reversed(ref_symbols[10:]), "new", *ref_symbols[:10]]
    order = vocabulary_permutation(ref_symbols, ours)
    assert order[len(ours) - 11] == -1
    permuted = permute_vocabulary(sd, order)
    h = torch.randn(3, 16, dtype=torch.float64)
    logp = torch.log_softmax(
        h @ sd["head.out_layers.0.weight"].T + sd["head.out_layers.0.bias"], -1
    )
    ours_logp = torch.log_softmax(
        h @ permuted["head.out_layers.0.weight"].T + permuted["head.out_layers.0.bias"], -1
    )
    index = torch.tensor([o for o in order if o >= 0])
    keep = torch.tensor(order) >= 0
    torch.testing.assert_close(ours_logp[:, keep], logp[:, index])
    assert ours_logp[:, ~keep].exp().max() == 0


def test_reference_memory_and_config() -> None:
    d = xl_golden.load("lamemo_3segments")
    mems = [d[f"seg0.mems.{i}"] for i in range(5)]
    state = state_from_reference(mems)
    assert state.embeddings.shape == (2, 6, 16) and state.log_normalizers[1].shape == (2, 6, 2)
    import json

    kw = lamemo_kwargs_from_reference(json.loads(d["config"]))
    assert kw["rpe"] == "disentangled" and kw["mem_len"] == 8
    with pytest.raises(ValueError, match="not LaMemo"):
        lamemo_kwargs_from_reference({**json.loads(d["config"]), "attn_type": 0})
