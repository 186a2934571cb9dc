"""A corpus of one's own (`data=text_corpus`): .txt, .jsonl and .parquet documents per split."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from omegaconf import DictConfig, OmegaConf

import megalab.data.lm.subword as subword
from megalab.cli.data import main as data_main
from megalab.cli.eval import evaluate, merge_run_config
from megalab.cli.train import train
from megalab.data.download import DatasetMissingError
from megalab.data.lm.corpus import CorpusFormatError, TextCorpusDataModule
from megalab.data.vocabulary import VocabularyMismatchError, check_vocabulary, save_vocabulary
from megalab.pretrained import export_run
from megalab.testing.lm import PG19_VOCAB_SIZE, pg19_books, write_parquet


def documents() -> dict[str, list[str]]:
    """The PG-19 fixture's books as plain documents, with a non-ASCII one in training."""
    books = pg19_books()
    texts = {split: [b["text"] for b in books[hub]] for split, hub in _HUB.items()}
    texts["train"][0] = "Café — naïve “quotes”.\n\n" + texts["train"][0]
    return texts


_HUB = {"train": "train", "val": "validation", "test": "test"}


def write_corpus(root: Path) -> dict[str, list[str]]:
    """Training books as .txt files in train/, validation as .jsonl, test as parquet."""
    docs = documents()
    for i, text in enumerate(docs["train"]):
        (root / "train").mkdir(parents=True, exist_ok=True)
        (root / "train" / f"book{i:02d}.txt").write_text(text, encoding="utf-8")
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(docs["val"])]
    (root / "valid.jsonl").write_text("\n".join([*lines[:1], "", *lines[1:]]) + "\n")
    write_parquet(root / "test.parquet", {"text": docs["test"]})
    (root / ".notes.txt").write_text("not part of the corpus")
    return docs


def module(root: Path, **kwargs) -> TextCorpusDataModule:
    kwargs = {"vocab_size": PG19_VOCAB_SIZE, "batch_size": 2, "eval_batch_size": 3, **kwargs}
    return TextCorpusDataModule(root, max_len=32, **kwargs)


def decoded_documents(dm: TextCorpusDataModule, split: str) -> list[str]:
    tok = dm.tokenizer()
    eos = tok.token_to_id("<eos>")
    ids = np.asarray(dm.datasets[split].tokens).tolist()
    assert ids[0] == eos and ids[-1] == eos
    pieces, cur = [], []
    for i in ids[1:]:
        if i == eos:
            pieces.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    return pieces


def test_each_format_reads_as_documents_joined_by_eos(tmp_path: Path) -> None:
    docs = write_corpus(tmp_path / "corpus")
    dm = module(tmp_path / "corpus")
    dm.setup()
    for split in ("train", "val", "test"):
        assert decoded_documents(dm, split) == docs[split], split
    # Word counts for word-level perplexity, as PG-19's.
    for split in ("val", "test"):
        expected = sum(len(t.split()) for t in docs[split])
        ds = dm.batches(split)
        assert sum(float(ds[(0, t)]["num_words"]) for t in range(len(ds))) == expected
        assert dm.num_words(split) == expected
    assert dm.source.num_rows("val") == len(docs["val"])
    assert not any("notes" in str(f) for f in dm.source.source_files())


def test_the_prepared_tokens_can_go_outside_the_corpus_folder(tmp_path: Path) -> None:
    docs = write_corpus(tmp_path / "corpus")
    dm = module(tmp_path / "corpus", cache_root=tmp_path / "cache")
    dm.setup()
    assert decoded_documents(dm, "test") == docs["test"]
    assert not (tmp_path / "corpus" / "prepared").exists()
    assert list((tmp_path / "cache" / "tokens").glob("*/meta.json"))


def test_an_edited_corpus_is_prepared_again(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus")
    first = module(tmp_path / "corpus")
    first.setup()
    before = first.cache()
    extra = tmp_path / "corpus" / "train" / "zz_more.txt"
    extra.write_text("one more document of the training split\n")
    again = module(tmp_path / "corpus")
    again.setup()
    assert again.cache() != before
    assert decoded_documents(again, "train")[-1] == extra.read_text()


def test_a_missing_split_names_what_to_put_where(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    write_corpus(root)
    (root / "valid.jsonl").unlink()
    with pytest.raises(DatasetMissingError) as err:
        module(root).setup()
    said = str(err.value)
    assert f"no file of the validation split below {root}" in said
    assert "train: 8, validation: 0, test: 1)" in said
    assert "valid.jsonl" in said and "data.data_dir" in said
    with pytest.raises(DatasetMissingError) as err:
        module(tmp_path / "nothing").setup()
    assert "no file of the train, validation and test splits at" in str(err.value)
    assert "there is no such folder" in str(err.value)


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (
            lambda root: (root / "valid.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n'),
            r"valid.jsonl, line 2: no field 'text' \(it has \['body'\]\); set data.text_column",
        ),
        (
            lambda root: (root / "valid.jsonl").write_text('{"text": "a"}\nnot json\n'),
            r"valid.jsonl, line 2: not a JSON object",
        ),
        (
            lambda root: (root / "valid.jsonl").write_text('{"text": 3}\n'),
            r"valid.jsonl, line 1: the field 'text' holds int, not text",
        ),
        (
            lambda root: (root / "train" / "latin1.txt").write_bytes("café".encode("latin-1")),
            r"latin1.txt is not UTF-8 text \(byte 3 is b'\\xe9'\)",
        ),
        (
            lambda root: write_parquet(root / "test.parquet", {"body": ["x"]}),
            r"test.parquet has no column 'text' \(it has \['body'\]\)",
        ),
        (
            lambda root: write_parquet(root / "test.parquet", {"text": [3, 4]}),
            r"test.parquet: the column 'text' holds int64, not text",
        ),
        (
            lambda root: (root / "test.parquet").write_text("not parquet"),
            r"cannot read .*test.parquet as parquet",
        ),
        (
            lambda root: (root / "train" / "test_notes.txt").write_text("x"),
            "test_notes.txt is of both the train and the test split",
        ),
    ],
)
def test_a_file_that_cannot_be_read_is_named(tmp_path: Path, write, message: str) -> None:
    root = tmp_path / "corpus"
    write_corpus(root)
    write(root)
    with pytest.raises(CorpusFormatError, match=message):
        module(root).setup()


TINY_LM = (
    "experiment=megalodon/pg19",
    "data=text_corpus",
    f"data.vocab_size={PG19_VOCAB_SIZE}",
    "data.max_len=32",
    "data.batch_size=2",
    "data.eval_batch_size=2",
    "model.d_model=32",
    "model.backbone.num_layers=1",
    "model.backbone.chunk_size=16",
    "model.backbone.z_dim=16",
    "model.backbone.v_dim=32",
    "model.backbone.ffn_dim=32",
    "model.backbone.norm_groups=4",
)


def test_megalab_data_prepares_it_and_training_reads_it(compose_cfg, tmp_path: Path) -> None:
    """The documented commands: `megalab-data text_corpus data.data_dir=...` prepares the cache
    a paper experiment with `data=text_corpus` trains and tests on, word perplexity included."""
    root = tmp_path / "corpus"
    write_corpus(root)
    size = f"data.vocab_size={PG19_VOCAB_SIZE}"
    assert data_main(["text_corpus", f"data.data_dir={root}", size]) == 0
    (cache,) = (root / "prepared" / "tokens").glob("*/meta.json")
    cfg = compose_cfg(*TINY_LM, f"data.data_dir={root}")
    assert cfg.data._target_.endswith("TextCorpusDataModule")
    record = train(cfg)
    assert record["global_step"] == 2
    assert "test/word_ppl" in record["metrics"]
    assert list((root / "prepared" / "tokens").glob("*/meta.json")) == [cache]


# -- the run's vocabulary (megalab.data.vocabulary) ------------------------------------------------
def trained_run(compose_cfg, root: Path, *overrides: str) -> tuple[Path, DictConfig]:
    """A 2-step run on the corpus at `root`, its folder laid out as `megalab-train` leaves it."""
    cfg = compose_cfg(*TINY_LM, f"data.data_dir={root}", *overrides)
    train(cfg)
    run = Path(cfg.paths.output_dir)
    saved = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(saved, dict)
    saved.pop("hydra")
    (run / ".hydra").mkdir(exist_ok=True)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    return run, cfg


def other_corpus(root: Path) -> None:
    """A corpus of other words: a tokenizer trained on it gives other ids."""
    (root / "train").mkdir(parents=True)
    (root / "train" / "x.txt").write_text("zebra quantum lattice harbour " * 300)
    (root / "valid.txt").write_text("quantum zebra harbour " * 40)
    (root / "test.txt").write_text("lattice zebra quantum " * 40)


def test_evaluation_reads_another_corpus_with_the_runs_tokenizer(
    compose_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """megalab-eval of a run on another corpus trained a new tokenizer on that corpus and
    scored the model on ids it never learned, with plausible-looking numbers."""
    write_corpus(tmp_path / "a")
    run, _ = trained_run(compose_cfg, tmp_path / "a")
    (data_tokenizer,) = (tmp_path / "a" / "prepared" / "tokenizer").glob("*/tokenizer.json")
    assert (run / "vocabulary" / "tokenizer.json").read_bytes() == data_tokenizer.read_bytes()
    other_corpus(tmp_path / "b")

    def fail(*args, **kwargs):
        raise AssertionError("evaluation must read the run's tokenizer, not train one")

    monkeypatch.setattr(subword, "train_tokenizer", fail)
    given = [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"data.data_dir={tmp_path / 'b'}"]
    cfg = compose_cfg(*given, f"paths.output_dir={tmp_path / 'eval'}", config="eval")
    merged = merge_run_config(cfg, given)
    assert merged.data.tokenizer == str(run / "vocabulary" / "tokenizer.json")
    assert "test/word_ppl" in evaluate(merged)["metrics"]
    # A tokenizer given on the command line that is not the run's is refused, naming the fix.
    (tmp_path / "mine.json").write_text(
        data_tokenizer.read_text().replace('"<eos>": 0', '"<eos>": 0 ')
    )
    # (Composed as megalab-eval composes it: the run's own keys are added to the command's.)
    cfg = compose_cfg(*given, f"paths.output_dir={tmp_path / 'eval2'}", config="eval")
    given.append(f"data.tokenizer={tmp_path / 'mine.json'}")
    with pytest.raises(VocabularyMismatchError) as err:
        evaluate(merge_run_config(cfg, given))
    said = str(err.value)
    assert f"the data's vocabulary ({tmp_path / 'mine.json'}) is not the one {run}" in said
    assert f"data.tokenizer={run / 'vocabulary' / 'tokenizer.json'}" in said


def test_a_resumed_run_keeps_its_tokenizer_when_the_corpus_grew(
    compose_cfg, tmp_path: Path
) -> None:
    """A file added to the corpus trains another tokenizer: resuming on it trained the model's
    embeddings on other ids, without a word."""
    root = tmp_path / "a"
    write_corpus(root)
    run, _ = trained_run(compose_cfg, root)
    (root / "train" / "more.txt").write_text("zebra quantum lattice harbour " * 300)
    resume = ("ckpt_path=last", "trainer.max_steps=4")
    with pytest.raises(VocabularyMismatchError, match="is not the one this run started with"):
        train(compose_cfg(*TINY_LM, f"data.data_dir={root}", *resume))
    kept = run / "vocabulary" / "tokenizer.json"
    cfg = compose_cfg(*TINY_LM, f"data.data_dir={root}", *resume, f"data.tokenizer={kept}")
    assert train(cfg)["global_step"] == 4


def test_an_export_ships_the_runs_tokenizer_without_the_data(compose_cfg, tmp_path: Path) -> None:
    root = tmp_path / "a"
    write_corpus(root)
    run, _ = trained_run(compose_cfg, root)
    kept = (run / "vocabulary" / "tokenizer.json").read_bytes()
    shutil.rmtree(root)  # the data is not on this machine any more
    out = export_run(run, tmp_path / "export", checkpoint="last")
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == kept


def test_a_vocabulary_of_other_files_is_refused(tmp_path: Path) -> None:
    """Data without a tokenizer option (a word list built from the files, as WikiText-103's)
    is checked against the run's copy."""

    class Words:
        def __init__(self, text: str) -> None:
            self.path = Path(tempfile.mkdtemp(dir=tmp_path)) / "vocab.txt"
            self.path.write_text(text)

        def prepare_data(self) -> None:
            pass

        def tokenizer_files(self) -> dict[str, Path]:
            return {"vocab.txt": self.path}

    run = tmp_path / "run"
    save_vocabulary(Words("<eos>\nthe\nof\n"), run)
    check_vocabulary(Words("<eos>\nthe\nof\n"), run, "megalab-eval")
    with pytest.raises(VocabularyMismatchError, match="prepare the data as the run did"):
        check_vocabulary(Words("<eos>\nof\nthe\nand\n"), run, "megalab-eval")
    check_vocabulary(Words("anything"), tmp_path / "old_run", "megalab-eval")  # no copy kept


def test_fine_tuning_on_another_corpus_names_the_tokenizer_of_the_weights(
    compose_cfg, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """init_from a run, on a corpus whose own tokenizer gives other ids: the embeddings it
    loads would read other tokens; it says so, and which tokenizer keeps them meaningful."""
    write_corpus(tmp_path / "a")
    run, _ = trained_run(compose_cfg, tmp_path / "a")
    other_corpus(tmp_path / "b")
    ckpt = run / "checkpoints" / "last.ckpt"
    kept = run / "vocabulary" / "tokenizer.json"
    tuned = (*TINY_LM, f"data.data_dir={tmp_path / 'b'}", f"init_from={ckpt}")
    with caplog.at_level(logging.WARNING, logger="megalab"):
        train(compose_cfg(*tuned, f"paths.output_dir={tmp_path / 'tuned'}"))
    assert f"give data.tokenizer={kept} to read the data with theirs" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megalab"):
        cfg = compose_cfg(*tuned, f"data.tokenizer={kept}", f"paths.output_dir={tmp_path / 'ok'}")
        assert train(cfg)["global_step"] == 2
    assert "another vocabulary" not in caplog.text


def test_a_file_of_another_format_is_named_before_the_tokenizer_is_trained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The validation file's wrong field was found after the tokenizer was trained and the
    training split tokenized: hours, on a real corpus."""
    root = tmp_path / "corpus"
    write_corpus(root)
    (root / "valid.jsonl").write_text('{"body": "a"}\n')

    def fail(*args, **kwargs):
        raise AssertionError("the files are checked first")

    monkeypatch.setattr(subword, "train_tokenizer", fail)
    with pytest.raises(CorpusFormatError, match=r"valid\.jsonl, line 1: no field 'text'"):
        module(root).prepare_data()


def test_generation_needs_no_more_than_the_runs_tokenizer(compose_cfg, tmp_path: Path) -> None:
    """The run keeps its tokenizer: generating from it needs neither the corpus nor its
    prepared tokens on this machine."""
    from megalab.cli.generate import generate

    root = tmp_path / "a"
    write_corpus(root)
    run, _ = trained_run(compose_cfg, root)
    shutil.rmtree(root)
    given = [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "prompt=The old house", "seed=1"]
    cfg = compose_cfg(*given, "max_new_tokens=6", "stream=false", config="generate", fast=False)
    out = generate(merge_run_config(cfg, given), print_fn=lambda s: None)
    assert out["new_tokens"] == 6 and out["samples"][0]
    assert not root.exists()
