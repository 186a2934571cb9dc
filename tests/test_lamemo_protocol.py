"""The training protocol of the LaMemo/Transformer-XL papers: XL's per-row roll of the training
streams, the memory reset at each epoch start, and the code's halved loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megalab.data.lm.stream import EvalBatches, StreamBatches, TokenStream
from megalab.models.lamemo.model import LaMemoConfig
from megalab.nn.adaptive_xl import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from megalab.tasks.language_modeling import LanguageModelingTask


def test_rows_roll_within_themselves() -> None:
    stream = TokenStream(np.arange(101, dtype=np.int64), name="train")
    batches = StreamBatches(stream, rows_per_device=4, seq_len=10, roll="rows", seed=3)
    assert batches.row_len == 25
    for epoch in (0, 1):
        segs = [batches[(epoch, i)] for i in range(len(batches))]
        inputs = torch.cat([s["inputs"] for s in segs], 1)
        targets = torch.cat([s["targets"] for s in segs], 1)
        assert segs[0]["reset"] and not segs[1]["reset"]  # the memory restarts every epoch
        torch.testing.assert_close(targets, inputs + 1)  # pairs stay adjacent tokens
        for r in range(4):
            row = inputs[r].numpy()
            assert sorted(row) == list(range(25 * r, 25 * r + 25))  # the row keeps its part
            shift = row[0] - 25 * r
            assert list(row) == [25 * r + (shift + j) % 25 for j in range(25)]
    first = [batches[(e, 0)]["inputs"][:, 0].tolist() for e in range(4)]
    assert len({tuple(f) for f in first}) > 1  # new rotations every epoch
    assert batches[(2, 1)]["inputs"].tolist() == batches[(2, 1)]["inputs"].tolist()
    with pytest.raises(ValueError, match="unknown roll"):
        StreamBatches(stream, 4, 10, roll="tokens")


def test_loss_scale_halves_the_optimised_loss_not_the_logged_one() -> None:
    torch.manual_seed(0)

    def task(scale: float) -> LanguageModelingTask:
        torch.manual_seed(0)
        return LanguageModelingTask(
            AdaptiveEmbedding(20, 16),
            LaMemoConfig(
                d_model=16, num_layers=1, num_heads=2, head_dim=8, ffn_dim=8, mem_len=4, dropout=0.0
            ).build(),
            ProjectedAdaptiveLogSoftmax(16, 20),
            tie_weights=True,
            carry_state=True,
            loss_scale=scale,
        )

    batch = {"inputs": torch.randint(0, 20, (2, 6)), "targets": torch.randint(0, 20, (2, 6))}
    full, half = task(1.0), task(0.5)
    a, b = full._step(batch, "train"), half._step(batch, "train")
    torch.testing.assert_close(b, 0.5 * a)
    with pytest.raises(ValueError, match="loss_scale"):
        task(0.0)


# -- ext_len: Transformer-XL's extended context, provided by the data --------------------------


def xl_task(ext_len: int, mem_len: int, backbone_ext_len: int | None = None):
    """A tiny float64 Transformer-XL language model (no dropout) that carries its memory."""
    from megalab.models.transformer_xl.model import TransformerXLConfig

    torch.manual_seed(0)
    backbone = TransformerXLConfig(
        d_model=16,
        num_layers=2,
        num_heads=2,
        head_dim=8,
        ffn_dim=32,
        dropout=0.0,
        mem_len=mem_len,
        ext_len=ext_len if backbone_ext_len is None else backbone_ext_len,
    ).build()
    task = LanguageModelingTask(
        AdaptiveEmbedding(VOCAB, 16),
        backbone,
        ProjectedAdaptiveLogSoftmax(16, VOCAB),
        tie_weights=True,
        carry_state=True,
    )
    return task.double().eval()


VOCAB = 23


def ext_stream(n: int = 61, seed: int = 5) -> TokenStream:
    return TokenStream(np.random.default_rng(seed).integers(0, VOCAB, n), name="train")


def test_stream_batches_prepend_ext_len_unscored_tokens() -> None:
    stream = ext_stream()
    for roll in (False, "rows"):
        batches = StreamBatches(stream, rows_per_device=2, seq_len=5, roll=roll, seed=1, ext_len=3)
        plain = StreamBatches(stream, rows_per_device=2, seq_len=5, roll=roll, seed=1)
        assert len(batches) == len(plain) == 6  # row_len 30: six segments of 5
        for i in range(len(batches)):
            got, want = batches[(0, i)], plain[(0, i)]
            e = 0 if i == 0 else 3  # the first segment of a row has nothing before it
            assert got["inputs"].shape == (2, 5 + e)
            assert got["target_mask"].tolist() == [[False] * e + [True] * 5] * 2
            assert bool(got["mask"].all())
            # The scored part is exactly the plain segment; the context is what precedes it.
            assert torch.equal(got["inputs"][:, e:], want["inputs"])
            assert torch.equal(got["targets"][:, e:], want["targets"])
            if e:
                before = plain[(0, i - 1)]
                assert torch.equal(got["inputs"][:, :e], before["inputs"][:, -e:])
                assert torch.equal(got["targets"][:, :e], before["targets"][:, -e:])
    with pytest.raises(ValueError, match="ext_len must be >= 0"):
        StreamBatches(stream, 2, 5, ext_len=-1)


def test_eval_batches_with_ext_len_score_every_token_once() -> None:
    stream = ext_stream(n=48)
    batches = EvalBatches(stream, rows=3, seq_len=6, ext_len=4)
    plain = EvalBatches(stream, rows=3, seq_len=6)
    seen = []
    for t in range(len(batches)):
        got, want = batches[(0, t)], plain[(0, t)]
        e = got["inputs"].shape[1] - want["inputs"].shape[1]
        assert e == (0 if t == 0 else 4)
        assert torch.equal(got["target_mask"][:, e:], want["target_mask"])
        assert not bool(got["target_mask"][:, :e].any())
        rows_alive = want["mask"].any(1)
        # Context only for streams that go on; an ended row stays fully masked.
        assert torch.equal(got["mask"][:, :e].all(1), rows_alive) if e else True
        assert not bool(got["mask"][~rows_alive].any())
        seen.append(got["targets"][got["target_mask"]])
    assert sum(len(s) for s in seen) == len(stream) - 1
    with pytest.raises(ValueError, match="exclude each other"):
        EvalBatches(stream, rows=3, seq_len=6, stride=2, ext_len=1)


def xl_code_loop_nll(task: LanguageModelingTask, row: np.ndarray, tgt_len: int, ext_len: int):
    """Per-target NLL of one stream as the Transformer-XL code computes it: segments
    data[max(0, i − ext_len) : i + tgt_len], the memory carried, the last tgt_len hidden
    states scored (`MemTransformerLM.forward`: pred_hid = hidden[-tgt_len:])."""
    tokens = torch.as_tensor(row)[None]
    state = task.initial_state(1)
    nll = []
    for i in range(0, len(row) - 1, tgt_len):
        seq = min(tgt_len, len(row) - 1 - i)
        data = tokens[:, max(0, i - ext_len) : i + seq]
        target = tokens[:, i + 1 : i + 1 + seq]
        out = task(data, None, state)
        state = out.state
        nll.append(task.head.nll(out.y[:, -seq:], target))
    return torch.cat(nll, 1)


def test_ext_len_is_seen_by_the_model_and_only_targets_are_scored() -> None:
    stream = ext_stream(n=41)  # one row of 40 predictions
    tgt, ext = 6, 3
    batches = StreamBatches(stream, rows_per_device=1, seq_len=tgt, roll=False, ext_len=ext)
    row = stream.tokens[:41]
    for mem_len in (0, 4, 64):
        task = xl_task(ext, mem_len)
        with torch.no_grad():
            reference = xl_code_loop_nll(task, row, tgt, ext)
            total, count = 0.0, 0
            for i in range(len(batches)):
                batch = batches[(0, i)]
                loss = task._step(batch, "train")
                scored = int(batch["target_mask"].sum())
                total, count = total + float(loss) * scored, count + scored
        assert count == 40
        torch.testing.assert_close(total / count, float(reference.mean()), rtol=1e-12, atol=0)
    # Memory over the whole stream: with the context left out of the memory and re-read, every
    # segment sees each earlier token exactly once, so the streamed NLL equals one pass.
    task = xl_task(ext, 64)
    tokens = torch.as_tensor(row)[None]
    with torch.no_grad():
        one_pass = task.head.nll(task(tokens[:, :-1]).y, tokens[:, 1:])
        torch.testing.assert_close(xl_code_loop_nll(task, row, tgt, ext), one_pass)
        # A memory that kept the context too would see it twice: the outputs then differ.
        doubled = xl_task(ext, 64, backbone_ext_len=0)
        assert not torch.allclose(xl_code_loop_nll(doubled, row, tgt, ext), one_pass)
    # Without memory the context is the only view of the previous segment: changing a context
    # token changes the scored predictions, and the loss is the mean over scored tokens only.
    task = xl_task(ext, 0)
    batch = batches[(0, 1)]
    with torch.no_grad():
        out = task(batch["inputs"])
        nll = task.head.nll(out.y, batch["targets"])
        loss = task._step(batch, "val")
        torch.testing.assert_close(loss, nll[:, ext:].mean())
        changed = dict(batch, inputs=batch["inputs"].clone())
        changed["inputs"][:, 0] = (changed["inputs"][:, 0] + 1) % VOCAB
        assert not torch.allclose(task._step(changed, "val"), loss)


def test_ext_len_must_match_between_data_and_model() -> None:
    from types import SimpleNamespace

    from megalab.tasks.language_modeling import check_ext_len

    check_ext_len(xl_task(2, 4).backbone, SimpleNamespace(ext_len=2))
    with pytest.raises(ValueError, match=r"set model\.backbone\.ext_len to data\.ext_len"):
        check_ext_len(xl_task(0, 4).backbone, SimpleNamespace(ext_len=2))
    lamemo = LaMemoConfig(
        d_model=16, num_layers=1, num_heads=2, head_dim=8, ffn_dim=8, mem_len=4
    ).build()
    check_ext_len(lamemo, SimpleNamespace(ext_len=0))
    with pytest.raises(ValueError, match="only Transformer-XL supports"):
        check_ext_len(lamemo, SimpleNamespace(ext_len=2))


def test_decoding_paths_refuse_a_memory_that_leaves_out_ext_len() -> None:
    """Generation and long-context scoring feed contiguous segments without extended context:
    an XL whose memory leaves out the last ext_len positions would lose them, so both stop
    and say how to run the same weights (ext_len 0)."""
    from megalab.generation.sampling import IncrementalDecoder
    from megalab.long_context import score_stream

    task = xl_task(2, 4)
    with pytest.raises(ValueError, match=r"model\.backbone\.ext_len=0"):
        IncrementalDecoder(task, 1)
    with pytest.raises(ValueError, match="long-context scoring"):
        score_stream(task, np.arange(20) % VOCAB, segment_len=5, first_bucket=5)
    decoder = IncrementalDecoder(xl_task(0, 4), 1)  # the same model without ext_len decodes
    assert decoder.feed(torch.tensor([[1, 2, 3]])).shape == (1, VOCAB)
