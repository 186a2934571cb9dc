"""Unlimited-context evaluation: equal to the full pass, bounded memory on a 1M-token document,
per-bucket perplexity and its plot, the timestep-norm refresh option, the eval command."""

from __future__ import annotations

import json
from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import Tensor, nn

from causal_models import STATEFUL_CASES, STATEFUL_IDS, VOCAB, build_lm
from megalab.cli.eval import evaluate
from megalab.cli.train import train
from megalab.long_context import bucket_edges, plot_buckets, score_stream, state_bytes
from megalab.models.base import Backbone, BackboneOutput
from megalab.models.mega.model import MegaConfig
from megalab.nn.embedding import SequenceEncoder
from megalab.nn.state import register_state
from megalab.tasks.language_modeling import LanguageModelingTask, LinearLMHead


def test_bucket_edges_double_from_the_first() -> None:
    assert bucket_edges(4096, 20_000) == [0, 4096, 8192, 16384, 20_000]
    assert bucket_edges(4, 4) == [0, 4]
    with pytest.raises(ValueError):
        bucket_edges(0, 10)


@pytest.mark.parametrize(("name", "variant"), STATEFUL_CASES, ids=STATEFUL_IDS)
def test_segments_with_the_carried_state_equal_one_pass(name: str, variant: str) -> None:
    task = build_lm(name, variant)
    tokens = np.random.default_rng(0).integers(0, VOCAB, 2 * 19 + 1)
    result = score_stream(task, tokens, segment_len=5, first_bucket=4, rows=2)
    seq = torch.as_tensor(tokens[:-1]).view(2, 19)
    target = torch.as_tensor(tokens[1:]).view(2, 19)
    with torch.no_grad():
        nll = task.head.nll(task(seq).y, target).sum(0)
    assert [b["end"] for b in result.buckets] == [4, 8, 16, 19]
    for b in result.buckets:
        assert b["tokens"] == 2 * (b["end"] - b["start"])
        torch.testing.assert_close(b["loss"] * b["tokens"], nll[b["start"] : b["end"]].sum().item())


def test_one_million_tokens_in_bounded_memory(tmp_path: Path) -> None:
    """A 1M-token document through a causal Mega-chunk: the carried state does not grow, the
    process's peak memory stays that of one segment, and the bucket plot is written."""
    torch.manual_seed(0)
    backbone = MegaConfig(d_model=16, num_layers=2, z_dim=8, v_dim=16, ffn_dim=16, ema_dim=4,
                    chunk_size=256, rel_pos_bias="rotary", prenorm=True, causal=True,
                    dropout=0.0).build()  # fmt: skip
    task = LanguageModelingTask(SequenceEncoder(16, vocab_size=VOCAB), backbone,
                                LinearLMHead(16, VOCAB)).eval()  # fmt: skip
    tokens = np.random.default_rng(1).integers(0, VOCAB, 1_000_001).astype(np.uint8)
    result = score_stream(task, tokens, segment_len=4096, first_bucket=4096)
    assert result.tokens == 1_000_000
    assert [b["end"] for b in result.buckets][-2:] == [524_288, 1_000_000]
    assert len(result.buckets) == 9
    # EMA states, plus the keys and values of the open chunk (< 256 tokens of z + v = 24 floats
    # per layer) after the last, partial segment: bounded whatever the length.
    assert 0 < result.state_bytes_first <= result.state_bytes_max
    assert result.state_bytes_max <= result.state_bytes_first + 2 * 255 * 24 * 4
    # One segment of this model holds a few MB; the 1M-token pass must not hold the document.
    assert result.peak_rss_mb - result.peak_rss_mb_before < 200
    png = plot_buckets(result, tmp_path / "long_context.png")
    assert png.stat().st_size > 10_000
    # Random tokens: every bucket near log(VOCAB) (an untrained model, nothing to learn).
    assert all(abs(b["loss"] - np.log(VOCAB)) < 1.0 for b in result.buckets)


def test_state_size_grows_for_a_kv_cache_and_not_for_mega() -> None:
    llama = build_lm("llama", "causal_mha")
    mega = build_lm("mega", "causal_softmax_rotary")
    tokens = np.random.default_rng(2).integers(0, VOCAB, 33)
    grow = score_stream(llama, tokens, segment_len=8, first_bucket=8)
    flat = score_stream(mega, tokens, segment_len=8, first_bucket=8)
    assert grow.state_bytes_max == 4 * grow.state_bytes_first
    assert flat.state_bytes_max == flat.state_bytes_first


# ------------------------------------------------------------------- timestep-norm refresh
@register_state
@dataclass
class _NormState:
    count: Tensor
    mean: Tensor


class _RunningNorm(Backbone):
    """x - (running mean of x over the stream): a causal norm with carried statistics."""

    causal = True

    def __init__(self, d: int) -> None:
        super().__init__()
        self.d_model = d
        self.scale = nn.Parameter(torch.ones(d))
        self.refreshed: list[int] = []

    def initial_state(self, batch_size: int, like: Tensor) -> _NormState:
        return _NormState(like.new_zeros(batch_size, 1), like.new_zeros(batch_size, self.d_model))

    def forward(self, x, mask=None, state=None):
        B, L, D = x.shape
        c0, m0 = (x.new_zeros(B, 1), x.new_zeros(B, D)) if state is None else astuple(state)
        n = c0.unsqueeze(1) + torch.arange(1, L + 1, dtype=x.dtype).view(1, L, 1)
        mean = (c0.unsqueeze(1) * m0.unsqueeze(1) + x.cumsum(1)) / n
        new = None if state is None else _NormState(n[:, -1], mean[:, -1])
        return BackboneOutput((x - mean) * self.scale, new)

    def refresh_norm_state(self, state: _NormState, fresh: _NormState) -> _NormState:
        self.refreshed.append(int(fresh.count[0, 0]))
        return fresh


def test_norm_refresh_swaps_in_statistics_of_the_recent_window() -> None:
    backbone = _RunningNorm(4)
    task = LanguageModelingTask(SequenceEncoder(4, vocab_size=VOCAB), backbone,
                                LinearLMHead(4, VOCAB)).eval()  # fmt: skip
    tokens = np.random.default_rng(3).integers(0, VOCAB, 41)
    plain = score_stream(task, tokens, segment_len=4, first_bucket=8)
    assert backbone.refreshed == []
    refreshed = score_stream(
        task, tokens, segment_len=4, first_bucket=8, norm_refresh_after=16, norm_refresh_window=12
    )
    # Statistics cover 4, 8, 12, 16 -> refresh to 12, then 16 -> refresh ... after every segment.
    assert backbone.refreshed == [12] * 7
    assert refreshed.buckets[0]["loss"] == pytest.approx(plain.buckets[0]["loss"])
    assert refreshed.loss != pytest.approx(plain.loss)
    mega = build_lm("mega", "causal_softmax_rotary")
    with pytest.raises(ValueError, match="no timestep-norm statistics"):
        score_stream(mega, tokens, segment_len=4, norm_refresh_after=16, norm_refresh_window=12)
    assert state_bytes(backbone.initial_state(2, torch.zeros(1))) == 2 * 5 * 4


def test_eval_long_context_mode_writes_the_record_and_plot(compose_cfg, tmp_path: Path) -> None:
    overrides = [
        "data=pg19", "data.vocab_size=400", "data.tokenizer_sample_books=null", "data.max_len=32",
        "data.batch_size=4", "data.eval_batch_size=2", "task=language_modeling", "model=mega",
        "model.d_model=16", "model.backbone.num_layers=1", "model.backbone.z_dim=8",
        "model.backbone.v_dim=16", "model.backbone.ffn_dim=16", "model.backbone.causal=true",
        "model.backbone.prenorm=true", "model.backbone.chunk_size=16",
        "model.backbone.rel_pos_bias=rotary",
    ]  # fmt: skip
    run_cfg = compose_cfg(*overrides)
    train(run_cfg)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(exist_ok=True)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(run_cfg))
    cfg = compose_cfg(
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        *overrides,
        "mode=long_context",
        "long_context.segment_len=64",
        "long_context.first_bucket=128",
        "long_context.max_tokens=1000",
        config="eval",
    )
    record = evaluate(cfg)
    assert record["tokens"] == 1000 and record["buckets"][0]["end"] == 128
    assert "word_ppl" in record["buckets"][0]  # PG-19 counts words
    assert set(record["metrics"]) == {"long_context/loss", "long_context/ppl"}
    saved = json.loads((run / "long_context.json").read_text())
    # The open chunk's keys and values (< 16 tokens of z + v = 24 floats) on top of the EMA state.
    assert saved["state_bytes_first"] <= saved["state_bytes_max"]
    assert saved["state_bytes_max"] <= saved["state_bytes_first"] + 15 * 24 * 4
    assert (run / "long_context.png").stat().st_size > 10_000
