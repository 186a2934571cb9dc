"""WMT'16 En-De: preparation on a fixture in the Hub's format, batching, errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from megalab.data.download import DatasetMissingError
from megalab.data.wmt import (
    BPE,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    UNK_ID,
    TextPipeline,
    TokenBatchSampler,
    TranslationCollator,
    WMT16EnDeDataModule,
    WMTFormatError,
    batch_by_size,
    build_dictionary,
    learn_bpe,
    normalize,
    remove_bpe,
    tokenize,
)
from megalab.testing import wmt as fixture


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wmt")
    fixture.write(root)
    return root / "wmt"


def module(root: Path, **kw) -> WMT16EnDeDataModule:
    kw = {"vocab_size": 256, "workers": 1, "batch_size": 8, "eval_batch_size": 8, **kw}
    dm = WMT16EnDeDataModule(root, cache_root=root.parent / "prepared", **kw)
    dm.prepare_data()
    dm.setup()
    return dm


def test_layout_is_the_hubs(data_root: Path) -> None:
    import pyarrow.parquet as pq

    train = data_root / "wmt16" / "de-en" / "train-00000-of-00001.parquet"
    schema = pq.read_schema(train)
    assert schema.names == ["translation"]
    assert {f.name for f in schema.field("translation").type} == {"de", "en"}
    for split in ("validation", "test"):
        assert (data_root / "wmt14" / "de-en" / f"{split}-00000-of-00001.parquet").is_file()


def test_moses_normalisation_and_tokenisation() -> None:
    # Typographic quotes become ASCII, a zero-width space a blank; -no-escape keeps quotes.
    text = normalize("„Das ist\u200b gut“, sagte er.", "de")
    assert "\u200b" not in text
    assert tokenize(text, "de").split()[0] == '"'
    assert "&quot;" not in tokenize('He said "yes".', "en")
    assert tokenize("The e-mail arrived.", "en") == "The e-mail arrived ."


def test_bpe_merges_and_subword_notation() -> None:
    lines = ["the lower lowest newer newest"] * 3 + ["a wide widest lower"] * 2
    model = json.loads(learn_bpe(lines, merges=7))["model"]
    assert len(model["merges"]) == 7
    bpe = BPE(learn_bpe(lines, merges=7))
    pieces = bpe.segment(["lowest widest"])[0]
    # Non-final pieces end with @@: the pieces after the last word-final one spell "widest".
    final = [i for i, p in enumerate(pieces) if not p.endswith("@@")]
    assert final[-1] == len(pieces) - 1 and len(final) == 2
    assert "".join(p.removesuffix("@@") for p in pieces[: final[0] + 1]) == "lowest"
    assert remove_bpe(pieces) == "lowest widest"
    assert remove_bpe(["new@@", "est", "wid@@", "e"]) == "newest wide"


def test_dictionary_is_fairseqs() -> None:
    counts = Counter({"b": 3, "a": 3, "c": 5, "d": 1})
    symbols = build_dictionary(counts, 10)
    assert symbols[:4] == list(SPECIALS)
    assert symbols[4:8] == ["c", "a", "b", "d"]  # by count, ties alphabetical
    assert symbols[8:] == ["madeupword0000", "madeupword0001"]
    assert build_dictionary(counts, 6)[4:] == ["c", "a"]


def test_prepared_splits_and_pipeline(data_root: Path) -> None:
    dm = module(data_root)
    info = json.loads((dm.cache_path() / ".complete").read_text())
    # Three training pairs fail clean-corpus-n (one side under 3 subwords; over 150; ratio).
    assert info["sizes"] == {"train_raw": 160, "train": 157, "val": 24, "test": 24}
    assert {s: len(d) for s, d in dm.datasets.items()} == {"train": 157, "val": 24, "test": 24}
    pipeline = dm.pipeline()
    assert len(pipeline.symbols) == 256 and pipeline.symbols[:4] == list(SPECIALS)
    item = dm.datasets["test"][3]
    assert item["source"][-1] == EOS_ID and item["target"][-1] == EOS_ID
    # Ids decode to the Moses-tokenized reference; the raw reference is kept for SacreBLEU.
    raw = dm.references("test")[3]
    assert pipeline.decode(item["target"].tolist()) == tokenize(raw, "de")
    assert pipeline.detokenize(pipeline.decode(item["target"].tolist())) == raw
    # Characters never seen in training become <unk> (the test split's first sentence).
    assert UNK_ID in dm.datasets["test"][0]["target"].tolist()
    again = TextPipeline.from_state(pipeline.state())
    assert again.encode(["The house is big."]) == pipeline.encode(["The house is big."])


def test_other_direction_shares_the_preparation_of_the_text(data_root: Path) -> None:
    en_de, de_en = module(data_root), module(data_root, source_lang="de", target_lang="en")
    a, b = en_de.datasets["val"][5], de_en.datasets["val"][5]
    assert torch.equal(a["source"], b["target"]) and torch.equal(a["target"], b["source"])
    assert en_de.pipeline().symbols == de_en.pipeline().symbols


def test_batch_by_size_is_fairseqs() -> None:
    lengths = np.array([5] * 20 + [9] * 3)
    batches = batch_by_size(list(range(23)), lengths, max_tokens=60, max_sentences=None,
                            multiple=8)  # fmt: skip
    # 12 x 5 fits 60; the 13th would exceed it: the batch is cut to a multiple of 8 (8) and
    # the 4 left start the next one.
    assert [len(b) for b in batches[:2]] == [8, 8]
    assert sum(len(b) for b in batches) == 23
    for b in batches:
        assert len(b) * lengths[b].max() <= 60
    assert [len(b) for b in batch_by_size(range(10), np.ones(10, int), None, 4)] == [4, 4, 2]
    with pytest.raises(ValueError, match="max_tokens=8"):
        batch_by_size([0], np.array([9]), 8, None)


def test_token_batches_shuffle_per_epoch_shard_and_resume() -> None:
    batches = [[i] for i in range(10)]
    s = TokenBatchSampler(batches, shuffle=True, seed=3)
    first = list(s)
    s.set_epoch(1)
    assert sorted(map(tuple, first)) == sorted(map(tuple, list(s))) and first != list(s)
    ranks = [TokenBatchSampler(batches, True, 3, rank=r, world_size=3) for r in range(3)]
    assert {len(r) for r in ranks} == {4}  # wrapped to equal length
    assert {b[0] for r in ranks for b in r} == set(range(10))
    resumed = TokenBatchSampler(batches, True, 3, position=lambda: 4)
    assert list(resumed) == first[4:]
    evals = [TokenBatchSampler(batches, False, rank=r, world_size=3) for r in range(3)]
    assert sorted(b[0] for e in evals for b in e) == list(range(10))


def test_collator_pads_sources_left_and_targets_right() -> None:
    items = [
        {"source": torch.tensor([5, 6, EOS_ID]), "target": torch.tensor([7, EOS_ID]), "index": 4},
        {"source": torch.tensor([8, EOS_ID]), "target": torch.tensor([9, 9, EOS_ID]), "index": 1},
    ]
    batch = TranslationCollator(PAD_ID, left_pad_source=True)(items)
    assert batch["inputs"].tolist() == [[5, 6, EOS_ID], [PAD_ID, 8, EOS_ID]]
    assert batch["mask"].tolist() == [[True, True, True], [False, True, True]]
    assert batch["targets"].tolist() == [[7, EOS_ID, PAD_ID], [9, 9, EOS_ID]]
    assert batch["index"].tolist() == [4, 1]
    right = TranslationCollator(PAD_ID, left_pad_source=False)(items)
    assert right["inputs"][1].tolist() == [8, EOS_ID, PAD_ID]


def test_loaders_batch_by_tokens_and_serve_a_bleu_subset(data_root: Path) -> None:
    dm = module(data_root, max_tokens=64, batch_size=1024, val_bleu_subset=10)
    for batch in dm.train_dataloader():
        assert batch["inputs"].numel() <= 64 or batch["targets"].shape[0] == 1
    loss_loader, bleu_loader = dm.val_dataloader()
    assert sum(len(b["index"]) for b in loss_loader) == 24
    seen = [i for b in bleu_loader for i in b["index"].tolist()]
    assert len(seen) == len(set(seen)) == 10


def test_a_sentence_longer_than_max_len_fails_early(data_root: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.max_len=12"):
        module(data_root, max_len=12)


def test_missing_data_offline_says_what_to_fetch(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dm = WMT16EnDeDataModule(tmp_path / "wmt", vocab_size=64, workers=1)
    with pytest.raises(DatasetMissingError) as err:
        dm.prepare_data()
    msg = str(err.value)
    assert "wmt/wmt16" in msg and "de-en" in msg
    assert str(tmp_path / "wmt" / "wmt16" / "de-en" / "train-00000-of-00001.parquet") in msg
    assert "megalab-data wmt16" in msg and "offline" in msg


def test_fetch_writes_the_hub_files_then_prepares(tmp_path: Path, monkeypatch) -> None:
    """Online path: `datasets.load_dataset` (here serving the fixture) fills the Hub layout."""
    import datasets

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "MEGALAB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    src = tmp_path / "src"
    fixture.write(src)
    calls = []

    def load_dataset(repo, config, split, **kwargs):
        calls.append((repo, config, split))
        folder = src / "wmt" / repo.split("/")[1] / config
        return datasets.Dataset.from_parquet(str(folder / f"{split}-00000-of-00001.parquet"))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    dm = module(tmp_path / "wmt")
    assert sorted(calls) == [
        ("wmt/wmt14", "de-en", "test"),
        ("wmt/wmt14", "de-en", "validation"),
        ("wmt/wmt16", "de-en", "train"),
    ]
    assert (tmp_path / "wmt" / "wmt14" / "de-en" / "validation-00000-of-00001.parquet").is_file()
    assert len(dm.datasets["train"]) == 157


def test_a_file_without_the_translation_column_is_named(tmp_path: Path) -> None:
    import datasets

    fixture.write(tmp_path)
    bad = tmp_path / "wmt" / "wmt14" / "de-en" / "test-00000-of-00001.parquet"
    datasets.Dataset.from_dict({"text": ["a"]}).to_parquet(str(bad))
    with pytest.raises(WMTFormatError, match="translation"):
        module(tmp_path / "wmt")


def test_fairseq_special_ids_are_fixed(data_root: Path) -> None:
    with pytest.raises(ValueError, match="<pad>=1"):
        WMT16EnDeDataModule(data_root, pad_id=0)
    with pytest.raises(ValueError, match="en->de or de->en"):
        WMT16EnDeDataModule(data_root, source_lang="en", target_lang="fr")
