"""LRA Pathfinder / Path-X: the release's metadata + PNG layout, reference order and split,
pixel scaling, malformed files, missing data and on-demand generation."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from megalab.data.download import DatasetMissingError
from megalab.data.lra.pathfinder import PathfinderDataModule, read_metadata
from megalab.data.lra.release import LRAFormatError
from megalab.testing.lra_pathfinder import write_difficulty

D14 = "curv_contour_length_14"


@pytest.fixture
def pf_root(fixture_data_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "lra" / "pathfinder"
    shutil.copytree(fixture_data_dir / "lra" / "pathfinder" / "pathfinder32", out / "pathfinder32")
    return out


def folder(root: Path, res: int = 32) -> Path:
    return root / f"pathfinder{res}" / D14


def test_datamodule_pixels_splits_and_order(pf_root: Path) -> None:
    dm = PathfinderDataModule(pf_root, batch_size=4, progress=False)
    assert dm.spec.max_len == 1024 and dm.spec.d_input == 1 and dm.spec.num_classes == 2
    dm.prepare_data()
    dm.setup()
    sizes = {k: len(v) for k, v in dm.datasets.items()}
    assert sizes == {"train": 32, "val": 4, "test": 4}
    samples = read_metadata(pf_root, 32)
    assert samples[0][0] == folder(pf_root) / "imgs" / "0" / "sample_0.png"
    assert samples[20][0] == folder(pf_root) / "imgs" / "1" / "sample_0.png"
    ref = torch.utils.data.random_split(
        range(40), [32, 4, 4], generator=torch.Generator().manual_seed(42)
    )
    for split, subset in zip(("train", "val", "test"), ref):
        assert dm.datasets[split].indices.tolist() == list(subset.indices)
    i = int(dm.datasets["val"].indices[1])
    path, label = samples[i]
    png = np.asarray(Image.open(path).convert("L"), dtype=np.float32).reshape(-1)
    item = dm.datasets["val"][1]
    assert item["inputs"].shape == (1024, 1) and item["targets"] == label
    np.testing.assert_allclose(item["inputs"][:, 0].numpy(), (png / 255 - 0.5) / 0.5, rtol=1e-6)
    assert float(item["inputs"].min()) >= -1.0 and float(item["inputs"].max()) <= 1.0


def test_metadata_sorted_by_integer_name(tmp_path: Path) -> None:
    root = tmp_path / "pf"
    write_difficulty(folder(root), 32, batches=11, per_batch=1)
    names = [p.parent.name for p, _ in read_metadata(root, 32)]
    assert names == [str(b) for b in range(11)]  # 0, 1, ..., 10 (not 0, 1, 10, 2, ...)


def test_pathx_resolution(fixture_data_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "pathfinder"
    shutil.copytree(
        fixture_data_dir / "lra" / "pathfinder" / "pathfinder128", root / "pathfinder128"
    )
    dm = PathfinderDataModule(root, resolution=128, batch_size=2, progress=False)
    dm.setup()
    assert {k: len(v) for k, v in dm.datasets.items()} == {"train": 16, "val": 2, "test": 2}
    assert dm.datasets["test"][0]["inputs"].shape == (16384, 1)
    with pytest.raises(ValueError, match="16384 pixels"):
        PathfinderDataModule(root, resolution=128, max_len=1024)


def test_blacklisted_file_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "pf"
    write_difficulty(folder(root), 32, batches=1, per_batch=5)
    (folder(root) / "imgs" / "0" / "sample_2.png").write_bytes(b"")  # the release's empty file
    bad = f"pathfinder32/{D14}/imgs/0/sample_2.png"
    assert len(read_metadata(root, 32, blacklist=[bad])) == 4
    dm = PathfinderDataModule(
        root, blacklist=[bad], val_fraction=0.25, test_fraction=0.25, progress=False
    )
    dm.setup()
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [2, 1, 1]
    with pytest.raises(LRAFormatError, match=r"sample_2.png: cannot read the image"):
        PathfinderDataModule(root, progress=False, val_fraction=0.25, test_fraction=0.25).setup()


def _break(root: Path, kind: str) -> str:
    f = folder(root)
    meta = f / "metadata" / "0.npy"
    lines = meta.read_text().splitlines(keepends=True)
    if kind == "missing":
        lines[2] = lines[2].replace("sample_2.png", "sample_99.png")
        meta.write_text("".join(lines))
        return r"0.npy:3: image .*sample_99.png does not exist"
    if kind == "label":
        fields = lines[1].split()
        fields[3] = "7"
        lines[1] = " ".join(fields) + "\n"
        meta.write_text("".join(lines))
        return r"0.npy:2: label 7 is not 0 or 1"
    if kind == "fields":
        lines[4] = "imgs/0 sample_4.png\n"
        meta.write_text("".join(lines))
        return r"0.npy:5: expected at least 4 space-separated fields"
    png = f / "imgs" / "0" / "sample_1.png"
    png.write_bytes(png.read_bytes()[:-30])  # truncated
    return r"imgs/0/sample_1.png: cannot read the image .*truncated or corrupt"


@pytest.mark.parametrize("kind", ["missing", "label", "fields", "truncated"])
def test_malformed_data_names_the_file(pf_root: Path, kind: str) -> None:
    error = _break(pf_root, kind)
    with pytest.raises(LRAFormatError, match=error):
        PathfinderDataModule(pf_root, progress=False).prepare_data()


def test_missing_data_says_download_or_generate(tmp_path: Path) -> None:
    dm = PathfinderDataModule(tmp_path / "data" / "lra" / "pathfinder", resolution=128)
    with pytest.raises(DatasetMissingError) as info:
        dm.prepare_data()
    msg = str(info.value)
    assert "megalab-data lra --task pathx --root " + str(tmp_path / "data") in msg
    assert "7.7 GB" in msg and "megalab-data pathfinder --resolution 128" in msg
    assert "data.generate_if_missing=true" in msg
    assert str(tmp_path / "data" / "lra" / "pathfinder" / "pathfinder128" / D14) in msg


def test_generate_if_missing(tmp_path: Path) -> None:
    root = tmp_path / "pathfinder"
    dm = PathfinderDataModule(
        root, generate_if_missing=True, generator_samples=10, generator_workers=1, progress=False
    )
    dm.prepare_data()
    dm.setup()
    assert sum(len(d) for d in dm.datasets.values()) == 10
    assert (folder(root) / "metadata" / "0.npy").is_file()
    key = dm.cache_path()
    # A second module with the same settings reuses both the images and the prepared pixels.
    again = PathfinderDataModule(
        root, generate_if_missing=True, generator_samples=10, generator_workers=1, progress=False
    )
    again.prepare_data()
    assert again.cache_path() == key
