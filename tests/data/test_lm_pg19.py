"""PG-19: local tokenizer (trained and cached), book streams, exact word counts."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import megalab.data.lm.subword as subword
from megalab.data.download import DatasetMissingError
from megalab.data.lm.pg19 import PG19DataModule, word_counts
from megalab.testing.lm import PG19_VOCAB_SIZE, pg19_books, write_parquet


def module(root: Path, **kwargs) -> PG19DataModule:
    kwargs = {"vocab_size": PG19_VOCAB_SIZE, "batch_size": 2, "eval_batch_size": 3, **kwargs}
    return PG19DataModule(root, max_len=32, **kwargs)


@pytest.fixture
def pg19_dir(tmp_path: Path, fixture_data_dir: Path) -> Path:
    shutil.copytree(fixture_data_dir / "pg19" / "data", tmp_path / "pg19" / "data")
    return tmp_path / "pg19"


def test_word_attribution_on_a_hand_example() -> None:
    text = "Hi there,  you\nall"
    # tokens: "Hi" [0,2) " there" [2,8) "," [8,9) "  you" [9,14) "\nall" [14,18)
    ends = np.array([2, 8, 9, 14, 18])
    assert word_counts(text, ends).tolist() == [1, 1, 0, 1, 1]
    assert word_counts(text, ends).sum() == len(text.split())


def test_streams_are_books_separated_by_eos_and_decode_exactly(pg19_dir: Path) -> None:
    dm = module(pg19_dir)
    dm.setup()
    tok = dm.tokenizer()
    assert tok.get_vocab_size() <= PG19_VOCAB_SIZE and tok.token_to_id("<eos>") == 0
    ids = np.asarray(dm.datasets["test"].tokens).tolist()
    assert ids[0] == 0 and ids[-1] == 0
    pieces, cur = [], []
    for i in ids[1:]:
        if i == 0:
            pieces.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    assert pieces == [b["text"] for b in pg19_books()["test"]]


@pytest.mark.parametrize("stride", [None, 8])
def test_num_words_add_up_to_the_split_word_count(pg19_dir: Path, stride) -> None:
    dm = module(pg19_dir, eval_stride=stride)
    dm.setup()
    for split, hub in (("val", "validation"), ("test", "test")):
        expected = sum(len(b["text"].split()) for b in pg19_books()[hub])
        ds = dm.batches(split)
        got = sum(float(ds[(0, t)]["num_words"]) for t in range(len(ds)))
        assert got == expected == dm.num_words(split)
    assert not dm.datasets["train"].has_words


def test_tokenizer_is_cached_and_unigram_works(
    pg19_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module(pg19_dir).setup()

    def fail(*args, **kwargs):
        raise AssertionError("the cached tokenizer must be reused")

    monkeypatch.setattr(subword, "train_tokenizer", fail)
    module(pg19_dir).setup()
    monkeypatch.undo()
    uni = module(pg19_dir, tokenizer_model="unigram", vocab_size=150, tokenizer_sample_books=3)
    uni.setup()
    assert uni.tokenizer().get_vocab_size() <= 150
    assert len(list((pg19_dir / "prepared" / "tokenizer").glob("*/tokenizer.json"))) == 2


def test_tokenizer_from_a_file_and_vocabulary_checks(pg19_dir: Path, tmp_path: Path) -> None:
    dm = module(pg19_dir)
    path = tmp_path / "tok.json"
    dm.tokenizer().save(str(path))
    size = dm.tokenizer().get_vocab_size()
    assert module(pg19_dir, tokenizer=str(path)).tokenizer().get_vocab_size() == size
    with pytest.raises(ValueError, match=f"set data.vocab_size={size}"):
        module(pg19_dir, tokenizer=str(path), vocab_size=size - 1).tokenizer()
    with pytest.raises(ValueError, match="no '</s>' token"):
        module(pg19_dir, tokenizer=str(path), eos_token="</s>").tokenizer()
    with pytest.raises(DatasetMissingError, match="offline mode"):
        module(pg19_dir, tokenizer="some-org/some-tokenizer").tokenizer()


def test_missing_column_and_offline_without_data(tmp_path: Path) -> None:
    root = tmp_path / "pg19"
    for split in ("train", "validation", "test"):
        write_parquet(root / "data" / f"{split}-00000-of-00001.parquet", {"book": ["a b c"]})
    with pytest.raises(ValueError, match="has no column 'text'"):
        module(root).setup()
    with pytest.raises(DatasetMissingError) as err:
        module(tmp_path / "nothing").setup()
    assert "deepmind/pg19" in str(err.value) and str(tmp_path / "nothing") in str(err.value)


def test_evaluation_reads_the_tokenizer_training_made(
    pg19_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trained tokenizer's cache is marked finished, so an evaluation (which reads only
    finished caches from the data folder) uses it instead of training its own copy."""
    from tokenizers import Tokenizer

    from megalab.data.cache import MARKER, caches_written_under

    module(pg19_dir).setup()  # training: trains and caches the tokenizer
    (trained,) = (pg19_dir / "prepared" / "tokenizer").glob("*/tokenizer.json")
    assert (trained.parent / MARKER).is_file()

    def fail(*args, **kwargs):
        raise AssertionError("evaluation must read the tokenizer training cached")

    monkeypatch.setattr(subword, "train_tokenizer", fail)
    with caches_written_under(tmp_path / "eval"):
        dm = module(pg19_dir)
        dm.setup("test")
        assert dm.tokenizer().to_str() == Tokenizer.from_file(str(trained)).to_str()
    assert not (tmp_path / "eval" / "prepared" / "tokenizer").exists()


def test_a_tokenizer_cached_without_its_marker_is_adopted(
    pg19_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer.json an earlier version saved (atomically, but unmarked) is reused, and
    marked, by the next training run, not trained again."""
    from megalab.data.cache import MARKER

    module(pg19_dir).setup()
    (trained,) = (pg19_dir / "prepared" / "tokenizer").glob("*/tokenizer.json")
    (trained.parent / MARKER).unlink()
    for stamp in trained.parent.glob(".verified"):
        stamp.unlink()

    def fail(*args, **kwargs):
        raise AssertionError("the cached tokenizer must be reused")

    monkeypatch.setattr(subword, "train_tokenizer", fail)
    module(pg19_dir).tokenizer()
    assert (trained.parent / MARKER).is_file()


@pytest.mark.parametrize("model", ["bpe", "unigram"])
def test_a_second_run_finds_the_tokens_the_first_prepared(pg19_dir: Path, model: str) -> None:
    """The token cache is keyed on the tokenizer: the first run keyed it on the unigram model it
    had just trained, whose serialisation differs from the saved file's that later runs (and
    evaluations) read, so each of them tokenised the whole corpus again."""
    first = module(pg19_dir, tokenizer_model=model, tokenizer_sample_books=3)
    first.setup()
    again = module(pg19_dir, tokenizer_model=model, tokenizer_sample_books=3)
    assert again.cache() == first.cache()
    assert len(list((pg19_dir / "prepared" / "tokens").glob("*/meta.json"))) == 1
