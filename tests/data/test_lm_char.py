"""enwik8 and text8: official zip format, Transformer-XL split, vocabularies, clear failures."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from megalab.data.download import DatasetMissingError
from megalab.data.files import file_digest
from megalab.data.lm.char import (
    ENWIK8_SHA256,
    ENWIK8_URL,
    TEXT8_SHA256,
    TEXT8_URL,
    Enwik8DataModule,
    Text8DataModule,
)
from megalab.testing.lm import CHAR_SPLIT, enwik8_bytes, text8_bytes, zip_member


def enwik8(root: Path, **kwargs) -> Enwik8DataModule:
    kwargs = {"sha256": None, **CHAR_SPLIT, "batch_size": 2, **kwargs}
    return Enwik8DataModule(root / "enwik8", max_len=16, **kwargs)


def tokens(dm) -> dict[str, np.ndarray]:
    dm.setup()
    return {s: np.asarray(dm.datasets[s].tokens) for s in ("train", "val", "test")}


def test_enwik8_fixture_is_split_like_transformer_xl(fixture_data_dir: Path) -> None:
    data = np.frombuffer(enwik8_bytes(), dtype=np.uint8)
    got = tokens(enwik8(fixture_data_dir))
    assert [len(got[s]) for s in ("train", "val", "test")] == [24_000, 3_000, 3_000]
    np.testing.assert_array_equal(np.concatenate([got["train"], got["val"], got["test"]]), data)
    assert data.max() > 127, "multi-byte UTF-8 characters are kept as their bytes"


def test_enwik8_drop_newlines_and_cache_keyed_by_settings(tmp_path: Path) -> None:
    zip_member(tmp_path / "enwik8" / "enwik8.zip", "enwik8", enwik8_bytes())
    keep = enwik8(tmp_path)
    drop = enwik8(tmp_path, drop_newlines=True)
    kept, dropped = tokens(keep), tokens(drop)
    assert (kept["train"] == 10).sum() > 0 and (dropped["train"] == 10).sum() == 0
    np.testing.assert_array_equal(dropped["train"], kept["train"][kept["train"] != 10])
    prepared = sorted(
        p.parent.name for p in (tmp_path / "enwik8" / "prepared" / "tokens").glob("*/meta.json")
    )
    assert len(prepared) == 2, "each preprocessing setting has its own cache"


def test_enwik8_downloads_through_the_helper_and_verifies_the_checksum(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror" / "enwik8.zip"
    zip_member(mirror, "enwik8", enwik8_bytes())
    digest = file_digest(mirror)
    dm = enwik8(tmp_path / "data", url=mirror.as_uri(), sha256=digest)
    dm.prepare_data()
    assert (tmp_path / "data" / "enwik8" / "enwik8.zip").exists()
    assert len(tokens(dm)["test"]) == 3_000
    bad = enwik8(tmp_path / "other", url=mirror.as_uri(), sha256="0" * 64)
    with pytest.raises(Exception, match="Checksum mismatch"):
        bad.prepare_data()


def test_text8_alphabet_and_split(fixture_data_dir: Path) -> None:
    dm = Text8DataModule(fixture_data_dir / "text8", max_len=16, sha256=None, **CHAR_SPLIT)
    got = tokens(dm)
    text = text8_bytes().decode()
    assert dm.spec.vocab_size == 27
    decoded = "".join(" abcdefghijklmnopqrstuvwxyz"[i] for i in got["test"])
    assert decoded == text[-3000:]
    assert len(got["train"]) == 24_000 and got["train"].max() <= 26


def test_text8_rejects_other_characters(tmp_path: Path) -> None:
    zip_member(tmp_path / "text8" / "text8.zip", "text8", b" abc def Ghi" * 1000)
    dm = Text8DataModule(tmp_path / "text8", max_len=8, sha256=None, **CHAR_SPLIT)
    with pytest.raises(
        ValueError, match=r"character 'G' \(byte 71\) at offset 9 of the train split"
    ):
        dm.setup()


def test_corrupt_zip_missing_member_and_bad_split_sizes(tmp_path: Path) -> None:
    archive = tmp_path / "enwik8" / "enwik8.zip"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"PK\x03\x04 this is not a zip archive")
    with pytest.raises(ValueError, match=r"not a readable zip archive.*Delete it"):
        enwik8(tmp_path).setup()
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("enwik9", b"x" * 100)
    with pytest.raises(ValueError, match="no member 'enwik8'"):
        enwik8(tmp_path).setup()
    zip_member(archive, "enwik8", b"x" * 5000)
    with pytest.raises(ValueError, match="cannot split 5,000 characters"):
        enwik8(tmp_path, valid_size=5_000_000, test_size=5_000_000).setup()


def test_offline_without_data_names_the_file_url_and_place(tmp_path: Path) -> None:
    dm = Enwik8DataModule(tmp_path / "enwik8", max_len=16)
    with pytest.raises(DatasetMissingError) as err:
        dm.setup()
    message = str(err.value)
    assert str(tmp_path / "enwik8" / "enwik8.zip") in message
    assert ENWIK8_URL in message and "paths.data_dir" in message


def test_cli_prepares_with_the_data_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megalab.cli.data import main

    zip_member(tmp_path / "text8" / "text8.zip", "text8", text8_bytes())
    main(
        [
            "text8",
            "--root",
            str(tmp_path),
            "data.sha256=null",
            "data.valid_size=3000",
            "data.test_size=3000",
        ]
    )
    out = capsys.readouterr().out
    assert "text8 ready" in out and "train: 24,000 tokens" in out
    assert list((tmp_path / "text8" / "prepared" / "tokens").glob("*/meta.json"))
    assert main(["enwik8", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "enwik8.zip" in err and "--root" in err and "paths.data_dir" not in err
    assert "Traceback" not in err


def test_each_corpus_defaults_to_its_official_zip_and_vocabulary(tmp_path: Path) -> None:
    enwik, text8 = Enwik8DataModule(tmp_path, 16), Text8DataModule(tmp_path, 16)
    assert (enwik.url, enwik.sha256, enwik.vocab_size) == (ENWIK8_URL, ENWIK8_SHA256, 256)
    assert (text8.url, text8.sha256, text8.vocab_size) == (TEXT8_URL, TEXT8_SHA256, 27)
    assert not enwik.drop_newlines
    mirror = Text8DataModule(tmp_path, 16, "file:///text8.zip", None, vocab_size=30)
    assert (mirror.url, mirror.sha256, mirror.vocab_size) == ("file:///text8.zip", None, 30)
