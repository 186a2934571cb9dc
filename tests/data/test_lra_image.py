"""LRA Image (CIFAR-10 grayscale): Hub parquet source, luma pixels, normalisation, 45K/5K split."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from megalab.data.download import DatasetMissingError
from megalab.data.lra.image import CIFAR10DataModule, random_split_indices
from megalab.data.lra.release import LRAFormatError
from megalab.testing.lra_image import SIZES, images


@pytest.fixture
def cifar_dir(fixture_data_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "cifar10"
    shutil.copytree(fixture_data_dir / "lra" / "cifar10" / "plain_text", out / "plain_text")
    return out


def test_split_reproduces_random_split() -> None:
    tr, va = random_split_indices(50_000, [45_000, 5_000], 42)
    ref = torch.utils.data.random_split(
        range(50_000), [45_000, 5_000], generator=torch.Generator().manual_seed(42)
    )
    assert tr.tolist() == list(ref[0].indices) and va.tolist() == list(ref[1].indices)
    with pytest.raises(ValueError, match="do not add up"):
        random_split_indices(10, [5, 4], 0)


def test_datamodule_pixels_normalisation_and_splits(cifar_dir: Path) -> None:
    dm = CIFAR10DataModule(cifar_dir, batch_size=4)
    assert dm.spec.d_input == 1 and dm.spec.num_classes == 10 and dm.spec.max_len == 1024
    dm.prepare_data()
    dm.setup()
    train, val, test = (dm.datasets[s] for s in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (45, 5, SIZES["test"])
    tr, va = random_split_indices(50, [45, 5], 42)
    assert train.indices.tolist() == tr.tolist() and val.indices.tolist() == va.tolist()
    arrays, labels = images("train", SIZES["train"])
    j = int(tr[0])
    luma = np.asarray(Image.fromarray(arrays[j]).convert("L"), dtype=np.float32).reshape(-1)
    item = train[0]
    assert item["inputs"].shape == (1024, 1) and item["inputs"].dtype == torch.float32
    np.testing.assert_allclose(item["inputs"][:, 0].numpy(), (luma / 255 - 0.48) / 0.24, rtol=1e-6)
    assert item["targets"] == labels[j]
    batch = next(iter(dm.test_dataloader()))
    assert batch["inputs"].shape == (4, 1024, 1) and batch["mask"].all()


def test_normalisation_is_configurable(cifar_dir: Path) -> None:
    dm = CIFAR10DataModule(cifar_dir, mean=0.0, std=1.0)
    dm.setup()
    x = dm.datasets["test"][0]["inputs"]
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    with pytest.raises(ValueError, match="1024 pixels"):
        CIFAR10DataModule(cifar_dir, max_len=4096)


def test_missing_column_and_truncated_png(cifar_dir: Path) -> None:
    path = cifar_dir / "plain_text" / "train-00000-of-00001.parquet"
    table = pq.read_table(path)
    pq.write_table(table.rename_columns(["image", "label"]), path)
    with pytest.raises(LRAFormatError, match=r"missing column\(s\) \['img'\]"):
        CIFAR10DataModule(cifar_dir).prepare_data()
    imgs = table.column("img").to_pylist()
    imgs[3]["bytes"] = imgs[3]["bytes"][:60]  # cut inside the image data
    fixed = table.set_column(0, "img", [imgs])
    pq.write_table(fixed, path)
    with pytest.raises(LRAFormatError, match=r"\(train, row 3\): cannot decode the image"):
        CIFAR10DataModule(cifar_dir).prepare_data()
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, format="PNG")
    imgs[3]["bytes"] = buf.getvalue()
    pq.write_table(table.set_column(0, "img", [imgs]), path)
    with pytest.raises(LRAFormatError, match="row 3\\): image is 16x16, not 32x32"):
        CIFAR10DataModule(cifar_dir).prepare_data()


def test_offline_without_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGALAB_OFFLINE", "1")
    with pytest.raises(DatasetMissingError) as info:
        CIFAR10DataModule(tmp_path / "cifar10").prepare_data()
    msg = str(info.value)
    assert "uoft-cs/cifar10" in msg and "megalab-data cifar10" in msg and "offline" in msg
    assert "test-00000-of-00001.parquet" in msg


def test_hub_settings_and_their_defaults(tmp_path: Path) -> None:
    dm = CIFAR10DataModule(tmp_path)
    assert dm.hub_id == dm.source.repo == "uoft-cs/cifar10"
    assert (dm.val_fraction, dm.split_seed) == (0.1, 42)
    assert dm.download and dm.hf_cache_dir is None
    other = CIFAR10DataModule(
        tmp_path, hub_id="me/cifar", download=False, hf_cache_dir="hf", split_seed=1
    )
    assert (other.source.repo, other.download, other.hf_cache_dir) == ("me/cifar", False, "hf")
    assert other.split_seed == 1
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\)"):
        CIFAR10DataModule(tmp_path, val_fraction=1.0)
