"""The enwik8 decoder's converter (`convert_lm_model`) on a state dict in the authors' names.

No reference tensors exist for the SeqBoat LM (the golden cases cover the unit and the LRA
encoder), so this builds the state dict an official `slag_lm_enwik8_base_v2` checkpoint holds,
name by name from the authors' modules (renll/SeqBoat `fairseq/models/seqboat_lm.py`,
`fairseq/modules/seqboat_layer.py`, `seqboat_unit.py`; docs/reference/seqboat-code.md §1.1 and
golden README §4), independently of the converter, and checks the round trip: every tensor lands
where it came from, `load_state_dict(strict=True)` takes it and the model computes the same logits.

    decoder.embed_tokens.weight                 (V, D)  tied to decoder.output_projection.weight
    decoder.version                             fairseq's version buffer
    decoder.layers.{i}.slag_layer.move.{delta, alpha, beta} (D, N, 1), move.gamma (D, N),
        move.omega (D,)                         the causal EMA (one kernel)
    decoder.layers.{i}.slag_layer.{gamma, beta} (2, Z)      Q/K scale and offset
    decoder.layers.{i}.slag_layer.q_router.temp (1,)        log τ
    decoder.layers.{i}.slag_layer.{mx_proj, hx_proj, h_proj}.{weight, bias}
    decoder.layers.{i}.slag_layer.norm.norm.{weight, bias}  pre-norm LayerNorm
    (no rel_pos_bias: RoPE has no parameters; no final_norm entries: --no-affine-final-norm;
    decoder.layers.{i}.nffn.* only with --decoder-ffn-embed-dim > 0)
"""

from __future__ import annotations

import hydra
import pytest
import torch

from megalab.models.seqboat.convert import convert_lm_model

SMALL = (
    "experiment=seqboat/enwik8",
    "model.d_model=24",
    "model.backbone.num_layers=2",
    "model.backbone.z_dim=8",
    "model.backbone.v_dim=40",
    "model.backbone.ema_dim=4",
    "model.backbone.chunk_size=4",
    "model.backbone.truncation=16",
    "data.max_len=32",
)


def authors_state_dict(task: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our `LanguageModelingTask` state dict written in the authors' names and layouts."""
    ours = task.state_dict()
    layers = sorted({int(k.split(".")[2]) for k in ours if k.startswith("backbone.layers.")})
    sd: dict[str, torch.Tensor] = {
        "decoder.version": torch.tensor([3.0]),
        "decoder.embed_tokens.weight": ours["encoder.embed.embedding.weight"],
        "decoder.output_projection.weight": ours["head.proj.weight"],  # tied: the same table
    }
    for i in layers:
        src, dst = f"backbone.layers.{i}.", f"decoder.layers.{i}."
        layer = {k[len(src) :]: v for k, v in ours.items() if k.startswith(src)}
        unit = dst + "slag_layer."
        for name, t in layer.items():
            if name.startswith("layer.ssm."):
                ema = name[len("layer.ssm.") :]
                # The authors' MultiHeadEMA (golden README §4): p = σ(move.delta) is the input
                # weight (our α), a = σ(move.alpha) the damping (our δ), move.gamma our η;
                # delta, alpha, beta are (D, N, 1).
                key = {"alpha": "delta", "delta": "alpha", "eta": "gamma"}.get(ema, ema)
                if key in ("delta", "alpha", "beta"):
                    t = t.unsqueeze(-1)
                sd[unit + "move." + key] = t
            elif name == "layer.kappa":
                sd[unit + "gamma"] = t
            elif name == "layer.mu":
                sd[unit + "beta"] = t
            elif name == "layer.router.log_tau":
                sd[unit + "q_router.temp"] = t.reshape(1)
            elif name.startswith(
                ("layer.mx_proj.", "layer.hx_proj.", "layer.h_proj.", "layer.norm.")
            ):
                sd[unit + name[len("layer.") :]] = t
            elif name.startswith("ffn."):
                sd[dst + "nffn." + name[len("ffn.") :]] = t
            else:
                raise AssertionError(f"unexpected parameter {src + name}")
    for name, t in ours.items():
        if name.startswith("backbone.final_norm."):
            sd["decoder." + name[len("backbone.") :]] = t
    return sd


@pytest.fixture
def lm_task(compose_cfg):
    def build(*extra: str) -> torch.nn.Module:
        cfg = compose_cfg(*SMALL, *extra)
        torch.manual_seed(0)
        task = hydra.utils.instantiate(cfg.task)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # away from the init, so that a swapped tensor shows
            for p in task.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        return task.eval()

    return build


@pytest.mark.parametrize("extra", [(), ("model.backbone.ffn_dim=48",)], ids=["paper", "ffn"])
def test_lm_converter_round_trip_in_the_authors_names(lm_task, extra: tuple[str, ...]) -> None:
    task = lm_task(*extra)
    ours = task.state_dict()
    authors = authors_state_dict(task)
    names = set(authors)
    # The paper's config: no relative-bias table (RoPE) and no final-norm parameters.
    assert not any("rel_pos_bias" in n or "final_norm" in n for n in names)
    assert any(".nffn." in n for n in names) == bool(extra)
    converted = convert_lm_model(authors)
    assert set(converted) == set(ours)
    for name, t in converted.items():
        assert torch.equal(t, ours[name]), name

    torch.manual_seed(5)
    fresh = lm_task(*extra)
    fresh.load_state_dict(converted, strict=True)
    assert fresh.head.proj.weight is fresh.encoder.embed.embedding.weight  # still tied
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, ours[name]), name
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = task.head.log_probs(task.backbone(task.encoder(tokens)).y)
        b = fresh.head.log_probs(fresh.backbone(fresh.encoder(tokens)).y)
    torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_lm_converter_rejects_names_it_does_not_know(lm_task) -> None:
    authors = authors_state_dict(lm_task())
    for bad in ("decoder.layers.0.slag_layer.rel_pos_bias.alpha", "decoder.embed_positions.w"):
        with pytest.raises((KeyError, ValueError), match=r"rel_pos_bias|embed_positions"):
            convert_lm_model({**authors, bad: torch.zeros(1)})
