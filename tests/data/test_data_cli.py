"""`megalab-data` prepares a dataset where training reads it, whatever the current folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from megalab.cli.data import main
from megalab.utils.paths import CONFIG_DIR

LISTOPS = [
    *("--num-train", "6", "--num-val", "3", "--num-test", "3"),
    *("--min-length", "5", "--max-length", "20", "--max-depth", "2", "--max-args", "3"),
    *("--workers", "1"),
]


def _training_reads(data: str) -> Path:
    """The folder `megalab-train data=<data>` reads, under the current environment."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"data={data}"])
    GlobalHydra.instance().clear()
    return Path(cfg.data.data_dir)


@pytest.mark.parametrize("where", ["MEGALAB_DATA_DIR", "MEGALAB_ROOT"])
def test_the_default_root_is_where_training_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The commands wrote below ./data (the current folder), while training reads
    MEGALAB_DATA_DIR, or data/ below the project root: a dataset prepared from another folder,
    or with the data elsewhere, was not found, and ListOps, IMDB, CIFAR-10 and Pathfinder took
    --out where the others took --root."""
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("MEGALAB_DATA_DIR", raising=False)
    monkeypatch.setenv(where, str(tmp_path / "chosen"))
    root = tmp_path / "chosen" / ("" if where == "MEGALAB_DATA_DIR" else "data")
    assert main(["listops", *LISTOPS]) == 0
    assert (root / "lra" / "listops" / "basic_train.tsv").is_file()
    assert _training_reads("lra_listops").resolve() == (root / "lra" / "listops").resolve()
    assert not (elsewhere / "data").exists()
    assert main(["listops", *LISTOPS, "--root", str(tmp_path / "given")]) == 0
    assert (tmp_path / "given" / "lra" / "listops" / "basic_val.tsv").is_file()


def test_verify_of_a_missing_folder_fails(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """It reported '0 prepared cache(s): 0 problem(s)' of a misspelled root."""
    with pytest.raises(SystemExit, match=f"no folder {tmp_path / 'nope'}"):
        main(["verify", "--root", str(tmp_path / "nope")])
    (tmp_path / "data").mkdir()
    assert main(["verify", "--root", str(tmp_path / "data")]) == 0
    assert "0 prepared cache(s)" in capsys.readouterr().out


def test_a_data_file_of_another_format_is_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A PG-19 shard without the text column ended in a traceback: the data's format errors
    were ValueErrors of their own, which the commands did not take for the user's."""
    from megalab.testing.lm import write_parquet

    for split in ("train", "validation", "test"):
        shard = tmp_path / "pg19" / "data" / f"{split}-00000-of-00001.parquet"
        write_parquet(shard, {"book": ["a b c"]})
    assert main(["pg19", "--root", str(tmp_path), "data.vocab_size=300"]) == 1
    err = capsys.readouterr().err
    # (Not "Traceback" at all: a handler an earlier test left on a closed stream may print
    # logging's own error here when the tests share a process.)
    assert "HubFormatError" not in err and "hub.py" not in err
    assert err.strip().splitlines()[-1].startswith("Error: PG-19: ")
    assert "missing column(s) ['text']" in err


@pytest.mark.parametrize(
    "where",
    [
        "megalab.data.hub:HubFormatError",
        "megalab.data.wmt.datamodule:WMTFormatError",
        "megalab.data.lra.release:LRAFormatError",
        "megalab.data.lra.listops:ListOpsFormatError",
        "megalab.data.speech_commands:SpeechCommandsFormatError",
        "megalab.data.base:TruncationError",
        "megalab.data.lm.corpus:CorpusFormatError",
    ],
)
def test_the_data_format_errors_are_the_users(where: str) -> None:
    import importlib

    from megalab.utils.errors import UserError, actionable

    module, _, name = where.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, UserError) and issubclass(cls, ValueError)
    err = cls("the file x has no column y")
    assert actionable(err) is err
