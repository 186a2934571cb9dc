"""WikiText-103: Transformer-XL's vocabulary and streams, Hub parquet shards, clear failures."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from megalab.data.download import DatasetMissingError
from megalab.data.lm.wikitext import WikiText103DataModule, build_vocab
from megalab.testing.lm import WIKITEXT_VOCAB_SIZE, wikitext_lines, write_parquet


def module(root: Path, **kwargs) -> WikiText103DataModule:
    kwargs = {"vocab_size": WIKITEXT_VOCAB_SIZE, "batch_size": 2, "eval_batch_size": 3, **kwargs}
    return WikiText103DataModule(root, max_len=16, **kwargs)


def test_vocabulary_order_counts_and_eos() -> None:
    lines = [" b a \n", "", " c a b \n", " a <unk> \n"]
    vocab, tokens = build_vocab(iter(lines))
    # <eos> first, then by decreasing count; ties (c, <unk>) in order of first occurrence
    assert vocab == ["<eos>", "a", "b", "c", "<unk>"]
    assert tokens == 7 + 4, "words plus one <eos> per line, blank lines included"


def test_fixture_streams_match_the_lines(fixture_data_dir: Path) -> None:
    dm = module(fixture_data_dir / "wikitext")
    dm.setup()
    vocab = dm.vocabulary()
    assert len(vocab) == WIKITEXT_VOCAB_SIZE and vocab[0] == "<eos>"
    lines = wikitext_lines()
    for split, hub in (("train", "train"), ("val", "validation"), ("test", "test")):
        words = ["<eos>"] + [w for line in lines[hub] for w in [*line.split(), "<eos>"]]
        ids = np.asarray(dm.datasets[split].tokens)
        assert [vocab[i] for i in ids] == words, split
    # word-level: every scored token counts as a word, so word_ppl == ppl
    val = dm.batches("val")
    words = sum(float(val[(0, t)]["num_words"]) for t in range(len(val)))
    assert words == len(dm.datasets["val"]) - 1


def test_known_full_size_is_checked(tmp_path: Path, fixture_data_dir: Path) -> None:
    root = tmp_path / "wikitext"
    shutil.copytree(fixture_data_dir / "wikitext" / "wikitext-103-v1", root / "wikitext-103-v1")
    dm = module(root)
    train_tokens = sum(len(line.split()) + 1 for line in wikitext_lines()["train"])
    dm.known_train_tokens, dm.known_vocab_size = train_tokens, 267_735
    with pytest.raises(ValueError, match="not the known 267,735"):
        dm.prepare_data()
    dm.known_vocab_size = WIKITEXT_VOCAB_SIZE
    dm.prepare_data()
    with pytest.raises(ValueError, match=f"set data.vocab_size={WIKITEXT_VOCAB_SIZE}"):
        module(root, vocab_size=267_735).setup()


def test_unknown_word_missing_column_and_empty_split(tmp_path: Path) -> None:
    base = tmp_path / "wikitext" / "wikitext-103-v1"
    write_parquet(base / "train-00000-of-00001.parquet", {"text": [" a b \n", " b \n"]})
    write_parquet(base / "validation-00000-of-00001.parquet", {"text": [" a zebra \n"]})
    write_parquet(base / "test-00000-of-00001.parquet", {"text": [" a \n"]})
    with pytest.raises(ValueError, match=r"1 word.*of the val split are not in the training"):
        module(tmp_path / "wikitext", vocab_size=3).setup()
    write_parquet(base / "validation-00000-of-00001.parquet", {"content": [" a \n"]})
    with pytest.raises(ValueError, match="has no column 'text'"):
        module(tmp_path / "wikitext", vocab_size=3).setup()
    write_parquet(base / "validation-00000-of-00001.parquet", {"text": []})
    with pytest.raises(ValueError, match="val split has 1 token"):
        module(tmp_path / "wikitext", vocab_size=3).setup()


def test_offline_without_data_says_what_to_download(tmp_path: Path) -> None:
    with pytest.raises(DatasetMissingError) as err:
        module(tmp_path / "wikitext").setup()
    message = str(err.value)
    assert "Salesforce/wikitext" in message and "huggingface-cli download" in message
    assert str(tmp_path / "wikitext" / "wikitext-103-v1") in message
    assert "offline" in message


def test_reads_the_hub_when_online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    lines = {"train": [" a b \n", "", " b c \n"], "validation": [" c \n"], "test": [" a a \n"]}
    calls = []

    def load_dataset(name, config, split, revision=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict({"text": lines[split]})

    for var in ("MEGALAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    dm = module(tmp_path / "wikitext", vocab_size=4)
    dm.setup()
    assert ("Salesforce/wikitext", "wikitext-103-v1", "validation") in calls
    assert dm.vocabulary() == ["<eos>", "b", "a", "c"]
    assert np.asarray(dm.datasets["test"].tokens).tolist() == [0, 2, 2, 0]
