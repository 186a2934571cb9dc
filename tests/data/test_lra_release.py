"""LRA release: download from a local HTTP server, extract only the needed folders into the
data layout, read them with the data modules; offline and malformed-archive errors."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from test_download import ServerState, server  # noqa: F401 - the local HTTP server fixture

from megalab.cli.data import main as cli_main
from megalab.data.download import DatasetMissingError
from megalab.data.lra.listops import ListOpsDataModule, ListOpsSettings, generate_listops
from megalab.data.lra.pathfinder import PathfinderDataModule
from megalab.data.lra.release import LRAFormatError, prepare_release
from megalab.data.lra.retrieval import AANDataModule
from megalab.testing.lra_pathfinder import write_difficulty
from megalab.testing.lra_retrieval import rows

D14 = "curv_contour_length_14"


def release_tree(root: Path) -> Path:
    """A tiny LRA release folder with every part we use and one we do not (curv_baseline)."""
    rel = root / "lra_release"
    generate_listops(
        rel / "listops-1000",
        12,
        4,
        4,
        seed=1,
        progress=False,
        settings=ListOpsSettings(max_depth=3, max_args=3, min_length=5, max_length=30),
    )
    (rel / "tsv_data").mkdir(parents=True)
    for split, n in (("train", 8), ("eval", 4), ("test", 4)):
        text = "".join("\t".join(r) + "\n" for r in rows(split, n))
        (rel / "tsv_data" / f"new_aan_pairs.{split}.tsv").write_text(text)
    write_difficulty(rel / "pathfinder32" / D14, 32, batches=2, per_batch=5)
    write_difficulty(rel / "pathfinder32" / "curv_baseline", 32, batches=1, per_batch=2)
    write_difficulty(rel / "pathfinder128" / D14, 128, batches=1, per_batch=10)
    return rel


def make_archive(tmp: Path, prefix: str = "lra_release/lra_release") -> bytes:
    tree = release_tree(tmp / "tree")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(tree, arcname=prefix)
    return buf.getvalue()


@pytest.fixture(scope="module")
def archive_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return make_archive(tmp_path_factory.mktemp("release"))


@pytest.fixture(autouse=True)
def _online(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MEGALAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)


def test_download_extract_and_read_every_task(
    tmp_path: Path,
    server: tuple[str, ServerState],  # noqa: F811 - the fixture imported above
    archive_bytes: bytes,
) -> None:
    base, state = server
    state.files["/long-range-arena/lra_release.gz"] = archive_bytes
    url = f"{base}/long-range-arena/lra_release.gz"
    root = tmp_path / "data"
    out = prepare_release(root, ["all"], url=url, progress=False)
    lra = root / "lra"
    assert out == {
        "listops": lra / "listops",
        "retrieval": lra / "aan",
        "pathfinder": lra / "pathfinder" / "pathfinder32" / D14,
        "pathx": lra / "pathfinder" / "pathfinder128" / D14,
    }
    assert (lra / "lra_release.gz").read_bytes() == archive_bytes  # kept for later tasks
    assert not (lra / "pathfinder" / "pathfinder32" / "curv_baseline").exists()
    assert not (lra / ".release-extract").exists()
    assert len(state.requests) == 1

    listops = ListOpsDataModule(lra / "listops", generate_if_missing=False)
    listops.prepare_data()
    listops.setup()
    assert [len(listops.datasets[s]) for s in ("train", "val", "test")] == [12, 4, 4]
    aan = AANDataModule(lra / "aan")
    aan.setup()
    assert [len(aan.datasets[s]) for s in ("train", "val", "test")] == [8, 4, 4]
    pf = PathfinderDataModule(lra / "pathfinder", progress=False)
    pf.setup()
    assert [len(pf.datasets[s]) for s in ("train", "val", "test")] == [8, 1, 1]
    px = PathfinderDataModule(lra / "pathfinder", resolution=128, progress=False)
    px.setup()
    assert px.datasets["train"][0]["inputs"].shape == (16384, 1)

    # Everything in place: nothing is downloaded or extracted again.
    prepare_release(root, ["retrieval", "pathx"], url=url, progress=False)
    assert len(state.requests) == 1


def test_one_task_and_plain_prefix_from_a_local_archive(tmp_path: Path) -> None:
    archive = tmp_path / "lra_release.gz"
    archive.write_bytes(make_archive(tmp_path, prefix="lra_release"))
    root = tmp_path / "data"
    assert (
        cli_main(["lra", "--task", "retrieval", "--root", str(root), "--archive", str(archive)])
        == 0
    )
    assert sorted(p.name for p in (root / "lra").iterdir()) == ["aan"]
    assert (root / "lra" / "aan" / "new_aan_pairs.eval.tsv").is_file()


def test_release_replaces_generated_data(tmp_path: Path) -> None:
    archive = tmp_path / "lra_release.gz"
    archive.write_bytes(make_archive(tmp_path))
    lra = tmp_path / "data" / "lra"
    target = lra / "pathfinder" / "pathfinder32" / D14
    write_difficulty(target, 32, batches=3, per_batch=2)  # complete, but not the release's
    (target / ".generator.json").write_text("{}")
    generate_listops(
        lra / "listops",
        5,
        2,
        2,
        progress=False,
        settings=ListOpsSettings(max_depth=2, max_args=2, min_length=3, max_length=9),
    )
    prepare_release(tmp_path / "data", ["pathfinder", "listops"], archive=archive)
    assert not (target / ".generator.json").exists()
    assert sorted(p.name for p in (target / "metadata").iterdir()) == ["0.npy", "1.npy"]
    assert len((lra / "listops" / "basic_train.tsv").read_text().splitlines()) == 13


def test_offline_and_malformed_archives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGALAB_OFFLINE", "1")
    with pytest.raises(DatasetMissingError) as info:
        prepare_release(tmp_path / "data", ["retrieval"], progress=False)
    msg = str(info.value)
    assert "lra_release.gz" in msg and "storage.googleapis.com/long-range-arena" in msg
    assert str(tmp_path / "data" / "lra" / "lra_release.gz") in msg

    not_tar = tmp_path / "junk.gz"
    not_tar.write_bytes(b"\x1f\x8b" + b"not really" * 10)
    with pytest.raises(LRAFormatError, match="is not a tar archive"):
        prepare_release(tmp_path / "data", ["listops"], archive=not_tar)

    other = tmp_path / "other.tar.gz"
    with tarfile.open(other, "w:gz") as tf:
        info_ = tarfile.TarInfo("something/else.txt")
        info_.size = 2
        tf.addfile(info_, io.BytesIO(b"hi"))
    with pytest.raises(LRAFormatError, match="has no folder 'tsv_data'"):
        prepare_release(tmp_path / "data", ["retrieval"], archive=other)
    with pytest.raises(ValueError, match="unknown LRA release task 'imdb'"):
        prepare_release(tmp_path / "data", ["imdb"], archive=other)
