"""Megalodon's long-context hooks: the carried modules of chunk parallelism, the evaluation-time
re-estimation of the timestep-norm statistics (the authors' `inference.py`), the FSDP block
class, and `megalab.cli.eval mode=long_context` with the option on."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import hydra
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from causal_models import CAUSAL_CASES, STATEFUL_CASES, VOCAB, build_backbone, build_lm
from megalab.cli.eval import evaluate
from megalab.cli.train import train
from megalab.long_context import score_stream
from megalab.models import block_classes
from megalab.models.megalodon.model import MegalodonBlock, MegalodonState
from megalab.models.megalodon.timestep_norm import TimestepNorm
from megalab.utils.paths import CONFIG_DIR

VARIANT = "chunked_swiglu_two_heads"  # c = 8
CHUNK = 8
# The reference's schedule (inference.py): segments of 2 chunks (MAX_CHUNKS_PER_BATCH = 2);
# once the statistics cover 8 chunks (TRUNCATE_CHUNKS = 8) they are re-estimated over the
# last 6 chunks.
SEGMENT, AFTER, WINDOW = 2 * CHUNK, 8 * CHUNK, 6 * CHUNK


def _stream(task, tokens: torch.Tensor, segment: int) -> MegalodonState:
    """The state after feeding `tokens` (B, L) segment by segment."""
    state = task.backbone.initial_state(tokens.shape[0], next(task.parameters()))
    for a in range(0, tokens.shape[1], segment):
        state = task(tokens[:, a : a + segment], None, state).state
    return state


def test_causal_lm_is_covered_by_the_generation_and_long_context_suites() -> None:
    """tests/test_generate.py and tests/test_long_context.py run on these cases."""
    assert ("megalodon", VARIANT) in CAUSAL_CASES
    assert ("megalodon", "full_attention") in STATEFUL_CASES
    assert not any(name == "megalodon_classifier" for name, _ in CAUSAL_CASES)


def test_carried_modules_are_the_blocks_then_the_final_norm() -> None:
    backbone = build_backbone("megalodon", VARIANT)
    modules = backbone.carried_modules()
    assert len(modules) == 3
    assert all(isinstance(m, MegalodonBlock) for m in modules[:2])
    assert modules[2] is backbone.final_norm and isinstance(modules[2], TimestepNorm)
    classifier = build_backbone("megalodon_classifier", "chunked_two_heads")
    with pytest.raises(ValueError, match="causal=True to stream"):
        classifier.carried_modules()


def test_megalodon_block_is_an_fsdp_and_checkpointing_unit() -> None:
    assert MegalodonBlock in block_classes()


def test_refresh_swaps_the_norm_statistics_and_keeps_cema_and_keys() -> None:
    task = build_lm("megalodon", VARIANT)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        carried = _stream(task, tokens, SEGMENT)
        fresh = _stream(task, tokens[:, -24:], 100)  # a fresh pass over the last 24
    refreshed = task.backbone.refresh_norm_state(carried, fresh)
    assert isinstance(refreshed, MegalodonState)
    for old, new, got in zip(carried.layers, fresh.layers, refreshed.layers, strict=True):
        assert got.norm is new.norm and got.cema is old.cema and got.kv is old.kv
        assert int(old.norm.count[0]) == 40 and int(got.norm.count[0]) == 24
        assert not torch.allclose(got.norm.mean, old.norm.mean)
    assert refreshed.final_norm is fresh.final_norm
    with pytest.raises(TypeError, match="two MegalodonState"):
        task.backbone.refresh_norm_state(carried, carried.layers[0])
    short = MegalodonState(fresh.layers[:1], fresh.final_norm)
    with pytest.raises(ValueError, match="layers"):
        task.backbone.refresh_norm_state(carried, short)


def test_norm_refresh_follows_the_reference_schedule_and_is_off_by_default() -> None:
    """score_stream with the reference's 8/6-chunk refresh equals the loop of its inference.py
    (statistics re-estimated by a fresh pass over the last 6 chunks, swapped into every layer
    and the final norm; CEMA state and keys/values kept); without the option it is exactly the
    one pass with the carried state."""
    task = build_lm("megalodon", VARIANT)
    length = 12 * CHUNK
    tokens = np.random.default_rng(4).integers(0, VOCAB, 2 * length + 1)
    seq = torch.as_tensor(tokens[:-1]).view(2, length)
    target = torch.as_tensor(tokens[1:]).view(2, length)

    off = score_stream(task, tokens, segment_len=SEGMENT, first_bucket=4 * CHUNK, rows=2)
    with torch.no_grad():
        one_pass = task.head.nll(task(seq).y, target).double().sum()
    torch.testing.assert_close(off.loss * off.tokens, one_pass.item())

    on = score_stream(task, tokens, segment_len=SEGMENT, first_bucket=4 * CHUNK, rows=2,
                      norm_refresh_after=AFTER, norm_refresh_window=WINDOW)  # fmt: skip
    # The reference's loop, written out.
    expected = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        state = task.backbone.initial_state(2, next(task.parameters()))
        covered = 0
        refreshes = 0
        for a in range(0, length, SEGMENT):
            out = task(seq[:, a : a + SEGMENT], None, state)
            expected += task.head.nll(out.y, target[:, a : a + SEGMENT]).double().sum()
            state, covered = out.state, covered + SEGMENT
            if covered >= AFTER:
                recent = seq[:, a + SEGMENT - WINDOW : a + SEGMENT]
                fresh = task(recent, None, task.backbone.initial_state(2, recent)).state
                state = MegalodonState(
                    [type(o)(f.norm, o.cema, o.kv) for o, f in zip(state.layers, fresh.layers)],
                    fresh.final_norm,
                )
                covered, refreshes = WINDOW, refreshes + 1
    assert refreshes == 3  # after 8, 10 and 12 chunks
    torch.testing.assert_close(on.loss * on.tokens, expected.item())
    # Identical up to the first refresh (8 chunks), different after it.
    assert on.buckets[0]["loss"] == pytest.approx(off.buckets[0]["loss"], rel=1e-12)
    assert on.buckets[1]["loss"] == pytest.approx(off.buckets[1]["loss"], rel=1e-12)
    assert on.buckets[2]["loss"] != pytest.approx(off.buckets[2]["loss"], rel=1e-6)
    assert on.settings["norm_refresh_after"] == AFTER


def test_eval_long_context_with_norm_refresh(compose_cfg, tmp_path: Path) -> None:
    """`megalab.cli.eval mode=long_context long_context.norm_refresh_after=...` on a Megalodon
    checkpoint: the option reaches the backbone and changes the scores after the refresh."""
    overrides = [
        "data=pg19", "data.vocab_size=400", "data.tokenizer_sample_books=null", "data.max_len=32",
        "data.batch_size=4", "data.eval_batch_size=2", "task=language_modeling",
        "model=megalodon", "model.d_model=16", "model.backbone.num_layers=1",
        "model.backbone.z_dim=8", "model.backbone.v_dim=16", "model.backbone.ffn_dim=16",
        "model.backbone.cema_dim=4", "model.backbone.norm_groups=4",
        "model.backbone.chunk_size=16",
    ]  # fmt: skip
    run_cfg = compose_cfg(*overrides)
    train(run_cfg)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(exist_ok=True)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(run_cfg))
    records = {}
    for refresh in ("null", "128"):
        cfg = compose_cfg(
            f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
            *overrides,
            "mode=long_context",
            "long_context.segment_len=32",
            "long_context.first_bucket=128",
            "long_context.max_tokens=512",
            f"long_context.norm_refresh_after={refresh}",
            f"long_context.norm_refresh_window={'null' if refresh == 'null' else 96}",
            config="eval",
        )
        records[refresh] = evaluate(cfg)
        saved = json.loads((run / "long_context.json").read_text())
        assert saved["settings"]["norm_refresh_after"] == (None if refresh == "null" else 128)
    off, on = records["null"]["buckets"], records["128"]["buckets"]
    assert [b["end"] for b in off] == [128, 256, 512]
    assert on[0]["loss"] == pytest.approx(off[0]["loss"], rel=1e-9)  # before the first refresh
    assert on[2]["loss"] != pytest.approx(off[2]["loss"], rel=1e-7)
    # The state stays bounded either way (CEMA h, statistics, the open chunk's keys/values).
    assert records["128"]["state_bytes_max"] == records["null"]["state_bytes_max"]


PRESETS = sorted(p.stem for p in (CONFIG_DIR / "model" / "megalodon").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_fsdp_blocks_composes_with_every_preset(compose_cfg, preset: str) -> None:
    """`trainer=fsdp_blocks model=megalodon/<preset>`: every MegalodonBlock (and nothing inside
    one) is an FSDP unit and an activation-checkpointing region."""
    cfg = compose_cfg("trainer=fsdp_blocks", f"model=megalodon/{preset}", "data=pg19",
                      "task=language_modeling", fast=False)  # fmt: skip
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert MegalodonBlock in hydra.utils.instantiate(cfg.trainer.strategy.auto_wrap_policy)
    assert strategy._activation_checkpointing_kwargs  # a policy is set
    assert cfg.trainer.precision == "bf16-mixed"
    with torch.device("meta"):
        backbone = hydra.utils.instantiate(cfg.model.backbone).build()
    units = tuple(block_classes())
    blocks = [m for m in backbone.modules() if isinstance(m, units)]
    assert len(blocks) == backbone.config.num_layers
    assert all(isinstance(b, MegalodonBlock) for b in blocks)
    assert not any(isinstance(m, units) for b in blocks for m in list(b.modules())[1:])


def test_fsdp_blocks_activation_checkpointing_keeps_outputs_and_gradients(compose_cfg) -> None:
    """Lightning's activation checkpointing with the strategy's policy (what FSDPStrategy
    applies; FSDP itself needs an accelerator): each block is recomputed in backward, with the
    same loss, gradients and streaming state."""
    from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    cfg = compose_cfg("trainer=fsdp_blocks", "model=megalodon", fast=False)
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    plain = build_lm("megalodon", VARIANT).train()
    wrapped = copy.deepcopy(plain)
    _setup_activation_checkpointing(wrapped.backbone, strategy._activation_checkpointing_kwargs)
    assert sum(isinstance(m, CheckpointWrapper) for m in wrapped.backbone.modules()) == 2
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    results = []
    for task in (plain, wrapped):
        out = task(tokens[:, :-1], None, task.backbone.initial_state(2, tokens))
        loss = task.head.nll(out.y, tokens[:, 1:]).sum() + out.state.layers[1].cema.h.abs().sum()
        loss.backward()
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in
                 task.named_parameters()}  # fmt: skip
        results.append((loss.detach(), grads))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=0)
    assert results[1][1].keys() == results[0][1].keys()
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-10, atol=1e-12, msg=name)
