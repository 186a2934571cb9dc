"""Options of the authors' `MemTransformerLM` (Transformer-XL and LaMemo) beyond the golden
cases: untied input and output tables, and the refusal of what megalab cannot build."""

from __future__ import annotations

import json

import pytest
import torch

import xl_golden
from golden import prefixed
from megalab.models.lamemo.convert import convert_lm, task_kwargs_from_reference
from megalab.models.lamemo.model import LaMemoConfig
from megalab.models.transformer_xl.convert import check_reference_config
from megalab.models.transformer_xl.model import TransformerXLConfig
from megalab.nn.adaptive_xl import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from megalab.tasks.language_modeling import LanguageModelingTask

DT = torch.float64


@pytest.mark.parametrize("case", ["txl_3segments", "lamemo_3segments"])
def test_untied_reference_model_converts_exactly(case: str) -> None:
    """tie_weight=False: the output table is the checkpoint's own `crit.out_layers.0.weight`
    (not the embedding), and the log-probabilities are log_softmax(h Wᵀ + b) with it."""
    d = xl_golden.load(case)
    cfg = json.loads(d["config"]) | {"tie_weight": False}
    sd = prefixed(d, "state_dict.")
    g = torch.Generator().manual_seed(0)
    out_table = torch.randn(sd["crit.out_layers.0.weight"].shape, generator=g, dtype=DT)
    sd = sd | {"crit.out_layers.0.weight": out_table}
    kw = task_kwargs_from_reference(cfg)
    assert kw["head"]["tie_weight"] is False
    config_cls = LaMemoConfig if cfg["attn_type"] == 3 else TransformerXLConfig
    task = LanguageModelingTask(
        AdaptiveEmbedding(**kw["encoder"]), config_cls(**kw["backbone"]).build(),
        ProjectedAdaptiveLogSoftmax(**kw["head"]), tie_weights=True,
    ).to(DT)  # fmt: skip
    task.load_state_dict(convert_lm(sd), strict=True)
    task.eval()
    head_w = task.head.out_layers[0].weight
    emb_w = task.encoder.emb_layers[0].weight
    assert head_w is not emb_w  # two parameters
    assert torch.equal(head_w, out_table) and torch.equal(emb_w, sd["word_emb.emb_layers.0.weight"])
    # The same backbone and embedding as the tied golden model, with the untied output layer.
    tied = xl_golden.build(d)
    tokens = d["seg0.input"].transpose(0, 1)
    with torch.no_grad():
        h = task.backbone(task.encoder(tokens)).y
        torch.testing.assert_close(h, tied.backbone(tied.encoder(tokens)).y, rtol=0, atol=0)
        want = torch.log_softmax(h @ out_table.T + sd["crit.out_layers.0.bias"], dim=-1)
        torch.testing.assert_close(task.head.log_probs(h), want, rtol=0, atol=1e-12)
    # Training moves the two tables apart.
    task.train()
    task.head.nll(
        task.backbone(task.encoder(tokens)).y, d["seg0.target"].transpose(0, 1)
    ).sum().backward()
    assert head_w.grad is not None and emb_w.grad is not None
    assert not torch.equal(head_w.grad, emb_w.grad)


def test_untied_tables_still_share_tied_projections() -> None:
    """As the code: tie_weight=False keeps the tables apart, tie_projs still shares projections."""
    enc = AdaptiveEmbedding(50, 16, d_embed=8)
    head = ProjectedAdaptiveLogSoftmax(16, 50, d_embed=8, tie_projs=[True], tie_weight=False)
    head.tie_encoder(enc)
    assert head.out_projs[0] is enc.emb_projs[0]
    assert head.out_layers[0].weight is not enc.emb_layers[0].weight
    tied = ProjectedAdaptiveLogSoftmax(16, 50, d_embed=8, tie_projs=[False])
    tied.tie_encoder(enc)
    assert tied.out_layers[0].weight is enc.emb_layers[0].weight
    assert tied.out_projs[0] is not enc.emb_projs[0]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"half_loss": True}, "half_loss=True is not supported"),
        ({"enhance_recurrence": True}, "enhance_recurrence=True is not supported"),
        ({"sample_softmax": 1000}, "sample_softmax=1000"),
        ({"n_rel_layer": 2}, "unknown model_config option n_rel_layer=2"),
        ({"attn_type": 33}, "attn_type 33 is not a model of the XL or LaMemo papers"),
    ],
)
def test_reference_config_refuses_what_megalab_cannot_build(change: dict, message: str) -> None:
    cfg = json.loads(xl_golden.load("txl_3segments")["config"])
    check_reference_config(cfg)  # the golden config itself is fine
    # Options without an effect on the outputs are accepted.
    check_reference_config(cfg | {"adapt_inp": True, "attn_norm_type": 2, "save_analysis": True})
    with pytest.raises(ValueError, match=message):
        task_kwargs_from_reference(cfg | change)
