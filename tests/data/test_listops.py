"""ListOps: the generator follows the LRA procedure; the reader checks the release format."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megalab.data.lra.listops import (
    CLS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB,
    ListOpsDataModule,
    ListOpsFormatError,
    ListOpsSettings,
    encode_tokens,
    generate_listops,
    read_listops,
)

SMALL = ListOpsSettings(max_depth=5, max_args=5, min_length=20, max_length=120)


def evaluate(source: str) -> int:
    """An independent ListOps evaluator: a stack machine over the token stream."""
    stack: list[list] = []
    for tok in source.replace("(", " ").replace(")", " ").split():
        if tok.startswith("["):
            stack.append([tok])
        elif tok == "]":
            op, *args = stack.pop()
            if op == "[MIN":
                val = min(args)
            elif op == "[MAX":
                val = max(args)
            elif op == "[SM":
                val = sum(args) % 10
            else:  # [MED: the median, truncated to an integer
                s = sorted(args)
                mid = len(s) // 2
                val = s[mid] if len(s) % 2 else int((s[mid - 1] + s[mid]) / 2)
            if not stack:
                return val
            stack[-1].append(val)
        else:
            if not stack:
                return int(tok)
            stack[-1].append(int(tok))
    raise AssertionError(f"unbalanced expression: {source[:80]}")


def read_rows(path: Path) -> list[tuple[str, int]]:
    with path.open() as f:
        reader = csv.reader(f, delimiter="\t")
        assert next(reader) == ["Source", "Target"]
        return [(src, int(tgt)) for src, tgt in reader]


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("listops")
    return generate_listops(out, 300, 40, 40, seed=3, settings=SMALL, progress=False)


def test_generator_is_deterministic_across_workers(generated: Path, tmp_path: Path) -> None:
    again = generate_listops(
        tmp_path, 300, 40, 40, seed=3, workers=2, settings=SMALL, progress=False
    )
    for split in ("train", "val", "test"):
        name = f"basic_{split}.tsv"
        assert (generated / name).read_bytes() == (again / name).read_bytes()
    other = generate_listops(
        tmp_path / "other", 300, 40, 40, seed=4, settings=SMALL, progress=False
    )
    assert (other / "basic_train.tsv").read_bytes() != (generated / "basic_train.tsv").read_bytes()


def test_generator_labels_lengths_and_splits(generated: Path) -> None:
    rows = {s: read_rows(generated / f"basic_{s}.tsv") for s in ("train", "val", "test")}
    assert [len(rows[s]) for s in ("train", "val", "test")] == [300, 40, 40]
    sources = [src for split in rows.values() for src, _ in split]
    assert len(set(sources)) == len(sources), "samples must be unique across splits"
    depths = []
    for src, label in (r for split in rows.values() for r in split):
        assert evaluate(src) == label
        tokens = src.replace("(", " ").replace(")", " ").split()
        assert SMALL.min_length <= len(tokens) <= SMALL.max_length
        depth = max_depth = 0
        for tok in tokens:
            depth += tok.startswith("[")
            depth -= tok == "]"
            max_depth = max(max_depth, depth)
        depths.append(max_depth)
        # LRA bracketing: every operator application is wrapped in parentheses.
        assert src.count("(") == src.count(")")
    assert max(depths) <= SMALL.max_depth
    labels = [label for split in rows.values() for _, label in split]
    assert len(set(labels)) >= 8


def test_default_settings_are_the_published_ones() -> None:
    s = ListOpsSettings()
    assert (s.max_depth, s.max_args, s.min_length, s.max_length, s.value_p) == (
        10,
        10,
        500,
        2000,
        0.25,
    )


def test_reader_tokenises_like_the_mega_code(generated: Path) -> None:
    ds = read_listops(generated / "basic_val.tsv")
    rows = read_rows(generated / "basic_val.tsv")
    assert len(ds) == len(rows)
    item = ds[0]
    tokens = rows[0][0].replace("(", " ").replace(")", " ").split()
    ids = item["inputs"].numpy()
    assert ids[-1] == EOS_ID and len(ids) == len(tokens) + 1
    assert [VOCAB[i] for i in ids[:-1]] == tokens
    assert item["targets"] == rows[0][1]
    # fairseq dictionary layout: <s>, <pad>, </s>, <unk>, symbols, <CLS>
    assert VOCAB[:4] == ("<s>", "<pad>", "</s>", "<unk>") and VOCAB[PAD_ID] == "<pad>"
    assert VOCAB[-1] == "<CLS>" and len(VOCAB) == 20
    short = read_listops(generated / "basic_val.tsv", max_len=8)
    assert short.lengths().max() == 8 and short[0]["inputs"][-1] == EOS_ID


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("Source\n( [MAX 1 2 ] )\n", "header"),
        ("Source\tTarget\n( ( [MAX 1 ) 2 ] )\n", "2 tab-separated columns"),
        ("Source\tTarget\n( ( [MAX 1 ) 2 ] )\t12\n", "label 12 out of range"),
        ("Source\tTarget\n( ( [MAX 1 ) 2 ] )\tseven\n", "is not an integer"),
        ("Source\tTarget\n( ( [MAX 1 ) 2 ] )\t2\n( ( [FOO 1 ) 2 ] )\t2\n", "unknown token '[FOO'"),
    ],
)
def test_malformed_files_name_file_line_and_problem(
    tmp_path: Path, content: str, message: str
) -> None:
    bad = _write(tmp_path / "basic_train.tsv", content)
    with pytest.raises(ListOpsFormatError, match=re.escape(message)) as err:
        read_listops(bad)
    assert str(bad) in str(err.value)
    if "FOO" in content:
        assert f"{bad}:3:" in str(err.value)


def test_datamodule_generates_missing_files_and_batches(tmp_path: Path) -> None:
    dm = ListOpsDataModule(
        tmp_path / "listops",
        batch_size=8,
        num_train=32,
        num_val=8,
        num_test=8,
        min_length=10,
        max_length=40,
        max_depth=3,
        max_args=3,
        generator_workers=1,
    )
    dm.prepare_data()
    assert (tmp_path / "listops" / "basic_train.tsv").exists()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].dtype.is_floating_point is False
    assert batch["inputs"].shape == batch["mask"].shape and batch["targets"].shape == (8,)
    lengths = batch["mask"].sum(1)
    for row, n in zip(batch["inputs"], lengths, strict=True):
        assert row[n - 1] == EOS_ID and (row[n:] == PAD_ID).all()
    # val/test never drop the last (partial) batch
    val = list(
        ListOpsDataModule(
            tmp_path / "listops", batch_size=8, eval_batch_size=3, generate_if_missing=False
        ).val_dataloader()
    )
    assert sum(len(b["targets"]) for b in val) == 8 and len(val[-1]["targets"]) == 2
    assert np.isin(batch["inputs"].numpy(), np.arange(len(VOCAB))).all()


def test_missing_files_without_generation_is_a_clear_error(tmp_path: Path) -> None:
    dm = ListOpsDataModule(tmp_path / "nowhere", generate_if_missing=False)
    with pytest.raises(FileNotFoundError, match="megalab-data listops"):
        dm.prepare_data()


def test_prepend_cls_starts_every_sequence_with_cls(generated: Path) -> None:
    assert CLS_ID == 19 and VOCAB[CLS_ID] == "<CLS>"
    plain = read_listops(generated / "basic_val.tsv")
    with_cls = read_listops(generated / "basic_val.tsv", prepend_cls=True)
    assert len(with_cls) == len(plain)
    for i in range(len(plain)):
        a, b = plain[i]["inputs"].numpy(), with_cls[i]["inputs"].numpy()
        assert b[0] == CLS_ID and b[-1] == EOS_ID and len(b) == len(a) + 1
        np.testing.assert_array_equal(b[1:], a)
        assert (b[1:] != CLS_ID).all()
    # truncation keeps <CLS> and EOS and cuts the expression: max_len counts both
    short = read_listops(generated / "basic_val.tsv", max_len=8, prepend_cls=True)
    assert short.lengths().max() == 8
    ids = short[0]["inputs"].numpy()
    assert ids[0] == CLS_ID and ids[-1] == EOS_ID
    np.testing.assert_array_equal(ids[1:-1], plain[0]["inputs"].numpy()[:6])


def test_encode_tokens_layout_and_limits() -> None:
    ids = np.arange(4, 14)
    assert encode_tokens(ids, 2002, prepend_cls=True).tolist() == [CLS_ID, *range(4, 14), EOS_ID]
    assert encode_tokens(ids, 5, prepend_cls=True).tolist() == [CLS_ID, 4, 5, 6, EOS_ID]
    assert encode_tokens(ids, 5).tolist() == [4, 5, 6, 7, EOS_ID]
    assert encode_tokens(ids, 5, append_eos=False).tolist() == [4, 5, 6, 7, 8]
    # the published bound: 2000 tokens + EOS + <CLS> = max_positions 2002, nothing cut
    full = encode_tokens(np.full(2000, 5), 2002, prepend_cls=True)
    assert len(full) == 2002 and full[0] == CLS_ID and full[-1] == EOS_ID
    with pytest.raises(ValueError, match="leaves no room"):
        encode_tokens(ids, 2, prepend_cls=True)


def test_datamodule_prepend_cls_batches_and_cache_key(tmp_path: Path) -> None:
    kwargs = dict(
        batch_size=4,
        num_train=16,
        num_val=4,
        num_test=4,
        min_length=10,
        max_length=40,
        max_depth=3,
        max_args=3,
        generator_workers=1,
    )
    plain = ListOpsDataModule(tmp_path / "listops", **kwargs)
    plain.prepare_data()
    plain.setup("fit")
    dm = ListOpsDataModule(tmp_path / "listops", prepend_cls=True, **kwargs)
    dm.setup("fit")  # same files, max_len and cache root: must not reuse the cache without <CLS>
    batch = next(iter(dm.val_dataloader()))
    lengths = batch["mask"].sum(1)
    assert (batch["inputs"][:, 0] == CLS_ID).all()
    for row, n in zip(batch["inputs"], lengths, strict=True):
        assert row[n - 1] == EOS_ID and (row[n:] == PAD_ID).all()
    ref = next(iter(plain.val_dataloader()))
    torch.testing.assert_close(lengths, ref["mask"].sum(1) + 1)
    assert (ref["inputs"][:, 0] != CLS_ID).all()
    keys = [
        json.loads(d.joinpath("params.json").read_text())["params"]
        for d in (Path(dm.cache_root) / "listops_val").iterdir()
    ]
    assert sorted(k["prepend_cls"] for k in keys) == [False, True]
    with pytest.raises(ValueError, match="leaves no room"):
        ListOpsDataModule(tmp_path / "listops", max_len=2, prepend_cls=True)
