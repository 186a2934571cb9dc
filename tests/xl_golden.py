"""Running the golden cases of `<shared>/golden/lamemo/` (Transformer-XL and LaMemo) with our
modules: the reference weights through `megalab.models.lamemo.convert`, then segment by segment with
the memory carried, comparing every stored tensor (see the folder's README).

The reference is time-first (T, B, ...) with attention tensors as [query, key, batch, head];
ours is batch-first with (B, H, query, key) probabilities: `tf` and `attn_tf` convert ours.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import golden
from golden import prefixed
from megalab.models.lamemo.convert import convert_lm, task_kwargs_from_reference
from megalab.models.lamemo.model import LaMemo, LaMemoConfig
from megalab.models.transformer_xl.model import TransformerXLConfig
from megalab.nn.adaptive_xl import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from megalab.nn.relative_attention import relative_distances
from megalab.tasks.language_modeling import LanguageModelingTask

TOL64 = {"atol": 1e-10, "rtol": 1e-9}  # README §6, float64 files
TOL32 = {"atol": 2e-5, "rtol": 1e-5}  # README §6, the float32 file


def load(name: str) -> dict[str, Any]:
    return golden.load_case("lamemo", name)


def tolerance(d: dict[str, Any]) -> dict[str, float]:
    return TOL64 if d["dtype"] == "float64" else TOL32


def build(d: dict[str, Any], **overrides: Any) -> LanguageModelingTask:
    """Our encoder, backbone and head for a case, with its converted weights, in eval mode."""
    cfg = json.loads(d["config"])
    kw = task_kwargs_from_reference(cfg)
    config_cls = LaMemoConfig if cfg["attn_type"] in (3, 31) else TransformerXLConfig
    task = LanguageModelingTask(
        AdaptiveEmbedding(**kw["encoder"]),
        config_cls(**{**kw["backbone"], **overrides}).build(),
        ProjectedAdaptiveLogSoftmax(**kw["head"]),
        tie_weights=True,
    )
    dtype = torch.float64 if d["dtype"] == "float64" else torch.float32
    task = task.to(dtype)
    task.load_state_dict(convert_lm(prefixed(d, "state_dict.")), strict=True)
    return task.eval()


def tf(x: Tensor) -> Tensor:
    """Ours (B, T, ...) -> the reference's (T, B, ...)."""
    return x.transpose(0, 1)


def attn_tf(p: Tensor) -> Tensor:
    """Ours (B, H, Lq, Lk) -> the reference's (Lq, Lk, B, H)."""
    return p.permute(2, 3, 0, 1)


def close(ours: Tensor, ref: Tensor, tol: dict[str, float], what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    torch.testing.assert_close(ours.to(ref.dtype), ref, msg=lambda m: f"{what}: {m}", **tol)


@dataclass
class SegmentRun:
    """What one segment gave: our tensors in the reference's layout, and the gradients."""

    logits: Tensor
    nll: Tensor
    hidden: Tensor
    table: Tensor
    memory: list[Tensor]
    layers: list[dict[str, Tensor]]
    grads: dict[str, Tensor] = field(default_factory=dict)


def memory_list(state: Any) -> list[Tensor]:
    """Our memory in the reference's list order and time-first layout."""
    if hasattr(state, "hidden"):  # XLMemory
        return [tf(t) for t in state.hidden]
    out = [tf(state.embeddings)]
    for c, s in zip(state.contexts, state.log_normalizers):
        out += [tf(c), tf(s)]
    return out


def run_case(d: dict[str, Any], task: LanguageModelingTask | None = None) -> list[SegmentRun]:
    """Every segment of a case with the memory carried; ½·mean(nll) back-propagated per
    segment (the reference trainer's objective, which the stored gradients are of)."""
    task = task or build(d)
    backbone = task.backbone
    lengths = json.loads(d["seg_lens"])
    state = backbone.initial_state(d["batch_size"], next(task.parameters()))
    runs = []
    for k, _ in enumerate(lengths):
        tokens = d[f"seg{k}.input"].transpose(0, 1)
        targets = d[f"seg{k}.target"].transpose(0, 1)
        m = backbone.memory_length(state)
        task.zero_grad(set_to_none=True)
        x = task.encoder(tokens)
        out, details = backbone.forward_details(x, None, state)
        logits = task.head.logits(out.y)
        nll = task.head.nll(out.y, targets)
        (0.5 * nll.mean()).backward()
        cfg = backbone.config
        future = m if isinstance(backbone, LaMemo) else 0
        sign = -1 if getattr(cfg, "rpe", "disentangled") == "xl" else 1
        distances = relative_distances(
            m + tokens.shape[1], future, sign, cfg.clamp_len, dtype=x.dtype
        )
        layers = []
        for det in details:
            layer = {k_: v for k_, v in det.items()}
            layers.append(layer)
        runs.append(
            SegmentRun(
                logits=tf(logits.detach()),
                nll=tf(nll.detach()),
                hidden=tf(out.y.detach()),
                table=backbone.positions(distances).unsqueeze(1),
                memory=memory_list(out.state),
                layers=layers,
                grads={
                    n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                    for n, p in task.named_parameters(remove_duplicate=False)
                },
            )
        )
        state = out.state
    return runs


def check_segment(d: dict[str, Any], k: int, run: SegmentRun, lamemo: bool) -> None:
    """Every stored tensor of segment k against ours."""
    tol = tolerance(d)
    close(run.logits, d[f"seg{k}.logits"], tol, f"seg{k}.logits")
    close(run.nll, d[f"seg{k}.nll"], tol, f"seg{k}.nll")
    close(run.hidden, d[f"seg{k}.hidden"], tol, f"seg{k}.hidden")
    close(run.table, d[f"seg{k}.pos_emb"], tol, f"seg{k}.pos_emb")
    mems = prefixed(d, f"seg{k}.mems.")
    assert len(run.memory) == len(mems), f"seg{k}: {len(run.memory)} memory tensors"
    for i, ours in enumerate(run.memory):
        close(ours, mems[str(i)], tol, f"seg{k}.mems.{i}")
    for l_, layer in enumerate(run.layers):
        p = f"seg{k}.layer{l_}."
        close(attn_tf(layer["attn_prob"]), d[p + "attn_prob"], tol, p + "attn_prob")
        close(tf(layer["attn_out"]), d[p + "attn_out"], tol, p + "attn_out")
        close(tf(layer["out"]), d[p + "out"], tol, p + "out")
        if not lamemo:
            continue
        if d[p + "attn_mem_out"].numel() == 0:  # no memory yet: no look-ahead, no α
            assert "attn_mem_out" not in layer and d[p + "mem_out"].shape[0] == 0
            assert p + "alpha" not in d and p + "attn_prob_mem" not in d
            continue
        close(attn_tf(layer["attn_prob_mem"]), d[p + "attn_prob_mem"], tol, p + "attn_prob_mem")
        close(tf(layer["alpha"]), d[p + "alpha"], tol, p + "alpha")
        close(tf(layer["attn_mem_out"]), d[p + "attn_mem_out"], tol, p + "attn_mem_out")
        close(tf(layer["mem_out"]), d[p + "mem_out"], tol, p + "mem_out")


def check_gradients(d: dict[str, Any], runs: list[SegmentRun]) -> None:
    """Per-segment gradients and their sum, for every parameter (tied alias included)."""
    tol = tolerance(d)
    total: dict[str, Tensor] = {}
    for k, run in enumerate(runs):
        ref = convert_lm(prefixed(d, f"grad_seg{k}."))
        assert set(ref) == set(run.grads), sorted(set(ref) ^ set(run.grads))
        for name, g in run.grads.items():
            close(g, ref[name], tol, f"grad_seg{k}.{name}")
            total[name] = total.get(name, 0) + g
    ref = convert_lm(prefixed(d, "grad."))
    for name, g in total.items():
        close(g, ref[name], tol, f"grad.{name}")


def check_case(name: str, lamemo: bool) -> None:
    """Run a golden case segment by segment: every segment's outputs, memories and attention
    match the reference's, and so do the per-segment gradients and their sum."""
    d = load(name)
    runs = run_case(d)
    assert len(runs) == d["n_segments"]
    for k, run in enumerate(runs):
        check_segment(d, k, run, lamemo=lamemo)
    check_gradients(d, runs)
