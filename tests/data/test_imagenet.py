"""ImageNet: patch order, PIL-only evaluation transform, ImageFolder and Hub sources, repeated
augmentation, Mixup/CutMix wiring, and errors for missing data or the missing `vision` extra."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.errors import InstantiationException
from PIL import Image

from megalab.data import imagenet as inet
from megalab.data.download import DatasetMissingError
from megalab.data.imagenet import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EvalTransform,
    ImageNetDataModule,
    ImageNetFormatError,
    MixupCollator,
    RepeatedAugSampler,
    patchify,
    unpatchify,
)
from megalab.nn.embedding import FeatureEmbedding
from megalab.testing.imagenet import WNIDS, write_folder
from megalab.utils.errors import actionable

NO_TIMM = dict(augment="none", mixup=0.0, cutmix=0.0)


def has_timm() -> bool:
    try:
        import timm.data  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("imagenet")
    write_folder(root, {"train": 4, "val": 2})
    return root


def test_cli_subset_with_other_class_count_names_its_own_flag(folder: Path, capsys) -> None:
    """`megalab-data imagenet` on a 3-class folder: one message naming --num-classes."""
    from megalab.cli.data import main

    root = folder.parent / "cli_root"
    (root / "imagenet").mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        link = root / "imagenet" / split
        if not link.exists():
            link.symlink_to(folder / split)
    assert main(["imagenet", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "set --num-classes 3 for this subset" in err and "data.num_classes" not in err
    assert "Traceback" not in err
    assert main(["imagenet", "--root", str(root), "--num-classes", "3"]) == 0
    assert "3 classes" in capsys.readouterr().out


def module(root: Path, **kwargs) -> ImageNetDataModule:
    kwargs = {"num_classes": 3, "batch_size": 4, **NO_TIMM, **kwargs}
    dm = ImageNetDataModule(root, **kwargs)
    dm.prepare_data()
    dm.setup()
    return dm


# --------------------------------------------------------------------------- patches
def test_patches_are_row_major_and_channel_major() -> None:
    C, H, W, p = 3, 32, 48, 16
    img = torch.arange(C * H * W, dtype=torch.float32).reshape(C, H, W)
    x = patchify(img, p)
    assert x.shape == (2 * 3, C * p * p)
    for i in range(2):
        for j in range(3):
            expected = img[:, i * p : (i + 1) * p, j * p : (j + 1) * p].reshape(-1)
            assert torch.equal(x[i * 3 + j], expected)
    batch = torch.stack([img, -img])
    assert torch.equal(patchify(batch, p)[1], -x)
    assert torch.equal(unpatchify(patchify(batch, p), p, H, W), batch)


def test_linear_over_patches_equals_conv_patch_embedding() -> None:
    torch.manual_seed(0)
    p, D = 16, 8
    conv = torch.nn.Conv2d(3, D, kernel_size=p, stride=p)
    embed = FeatureEmbedding(3 * p * p, D)
    with torch.no_grad():
        embed.proj.weight.copy_(conv.weight.reshape(D, -1))
        embed.proj.bias.copy_(conv.bias)
    images = torch.randn(2, 3, 64, 48)
    ref = conv(images).flatten(2).transpose(1, 2)  # (B, L, D), row-major over the grid
    torch.testing.assert_close(embed(patchify(images, p)), ref, rtol=1e-5, atol=1e-5)


def test_224_pixels_give_196_tokens_of_768(folder: Path) -> None:
    dm = module(folder)
    item = dm.datasets["val"][0]
    assert item["inputs"].shape == (196, 768) and item["inputs"].dtype == torch.float32
    assert dm.max_len == 196 and dm.spec.d_input == 768


def test_patch_size_is_configurable(folder: Path) -> None:
    dm = module(folder, img_size=224, patch_size=32, max_len=49, d_input=3072)
    assert dm.datasets["train"][0]["inputs"].shape == (49, 3072)
    with pytest.raises(ValueError, match="max_len=196 and d_input=768"):
        ImageNetDataModule(folder, patch_size=16, max_len=49, d_input=3072, **NO_TIMM)


# --------------------------------------------------------------------------- eval transform
def test_eval_transform_resizes_shorter_side_and_center_crops() -> None:
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (300, 420, 3), dtype=np.uint8))  # H 300, W 420
    tf = EvalTransform(224, crop_pct=0.875)
    assert tf.resize == 256
    out = tf(img)
    assert out.shape == (3, 224, 224)
    resized = img.resize((int(256 * 420 / 300), 256), Image.Resampling.BICUBIC)  # (358, 256)
    left, top = round((358 - 224) / 2), round((256 - 224) / 2)
    crop = np.asarray(resized.crop((left, top, left + 224, top + 224)), dtype=np.float32) / 255
    expected = (crop - np.array(IMAGENET_MEAN, np.float32)) / np.array(IMAGENET_STD, np.float32)
    np.testing.assert_allclose(out.numpy(), expected.transpose(2, 0, 1), rtol=1e-6, atol=1e-6)


def test_eval_transform_normalises_channels() -> None:
    img = Image.new("RGB", (230, 260), (255, 0, 128))
    out = EvalTransform(224, crop_pct=1.0)(img)
    for c, v in enumerate((255, 0, 128)):
        want = (v / 255 - IMAGENET_MEAN[c]) / IMAGENET_STD[c]
        torch.testing.assert_close(out[c], torch.full((224, 224), want), rtol=1e-5, atol=1e-5)


def test_eval_transform_handles_grayscale_and_small_images() -> None:
    out = EvalTransform(224)(Image.new("L", (40, 30), 100))
    assert out.shape == (3, 224, 224)


# --------------------------------------------------------------------------- DataModule
def test_image_folder_labels_follow_sorted_wnids(folder: Path) -> None:
    dm = module(folder)
    assert dm.classes == sorted(WNIDS)
    assert {s: len(ds) for s, ds in dm.datasets.items()} == {"train": 12, "val": 6, "test": 6}
    assert dm.datasets["test"] is dm.datasets["val"]
    val = dm.datasets["val"]
    for path, label in zip(val.images, val.labels):
        assert Path(path).parent.name == dm.classes[label]
    batch = next(iter(dm.val_dataloader()))
    assert batch["inputs"].shape == (4, 196, 768) and batch["mask"].all()
    assert batch["targets"].tolist() == [0, 0, 1, 1]


def test_basic_training_transform_runs_without_timm(folder: Path) -> None:
    dm = module(folder, augment="basic", repeated_aug=1)
    torch.manual_seed(0)
    a = dm.datasets["train"][0]["inputs"]
    b = dm.datasets["train"][0]["inputs"]
    assert a.shape == (196, 768) and not torch.equal(a, b)  # random crops differ


def test_class_count_must_match_config(folder: Path) -> None:
    dm = ImageNetDataModule(folder, **NO_TIMM)  # num_classes 1000
    with pytest.raises(ImageNetFormatError, match=r"3 classes .* num_classes=1000"):
        dm.setup()


def test_unreadable_image_names_the_file(tmp_path: Path) -> None:
    write_folder(tmp_path, {"train": 1, "val": 1})
    bad = tmp_path / "val" / WNIDS[0] / "ILSVRC2012_val_broken.JPEG"
    bad.write_bytes(b"not a jpeg")
    dm = module(tmp_path)
    idx = [str(p) for p in dm.datasets["val"].images].index(str(bad))
    with pytest.raises(ImageNetFormatError, match=r"ILSVRC2012_val_broken\.JPEG"):
        dm.datasets["val"][idx]


def test_missing_folders_explain_how_to_get_imagenet(tmp_path: Path) -> None:
    dm = ImageNetDataModule(tmp_path / "imagenet", **NO_TIMM)
    with pytest.raises(DatasetMissingError) as info:
        dm.prepare_data()
    msg = str(info.value)
    assert str(tmp_path / "imagenet" / "train") in msg and "paths.data_dir" in msg
    assert "image-net.org" in msg and "ILSVRC/imagenet-1k" in msg


def test_hub_without_token_says_it_is_gated(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(inet, "hub_token", lambda: None)
    dm = ImageNetDataModule(tmp_path, source="hub", **NO_TIMM)
    with pytest.raises(DatasetMissingError, match=r"gated.*HF_TOKEN"):
        dm.prepare_data()


def test_hub_source_reads_image_and_label_columns(tmp_path: Path, monkeypatch) -> None:
    import datasets

    images = [Image.new("RGB", (48 + 8 * i, 40), (60 * i, 20, 200)) for i in range(4)]
    fake = datasets.Dataset.from_dict(
        {"image": images, "label": [0, 1, 2, 1]},
        features=datasets.Features(
            {"image": datasets.Image(), "label": datasets.ClassLabel(names=list(WNIDS))}
        ),
    )
    calls = []

    def load_dataset(hub_id, split, token, cache_dir):
        calls.append((hub_id, split, token))
        return fake

    monkeypatch.setattr(inet, "hub_token", lambda: "hf_fake")
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    dm = module(tmp_path, source="hub")
    assert ("ILSVRC/imagenet-1k", "validation", "hf_fake") in calls
    assert dm.classes == list(WNIDS)
    item = dm.datasets["test"][3]
    assert item["inputs"].shape == (196, 768) and item["targets"] == 1


# --------------------------------------------------------------------------- recipe
def test_missing_timm_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)
    monkeypatch.setitem(sys.modules, "timm.data", None)
    with pytest.raises(ImportError, match=r"megalab\[vision\]") as info:
        ImageNetDataModule(tmp_path, augment="deit", mixup=0.0, cutmix=0.0)
    assert "data.augment=basic" in str(info.value)
    # Shown as its message alone (not a traceback), also when Hydra's instantiation wraps it.
    target = {"_target_": "megalab.data.imagenet.ImageNetDataModule", "augment": "deit"}
    with pytest.raises(InstantiationException) as wrapped:
        hydra.utils.instantiate({**target, "data_dir": str(tmp_path)})
    assert "megalab[vision]" in str(actionable(wrapped.value))
    with pytest.raises(ImportError, match=r"Mixup/CutMix.*megalab\[vision\]"):
        ImageNetDataModule(tmp_path, augment="basic", mixup=0.8, cutmix=1.0)
    ImageNetDataModule(tmp_path, **NO_TIMM)  # evaluation-only settings need no extra


def test_label_smoothing_in_the_loss_equals_timm_smoothed_mixup() -> None:
    """timm's Mixup(label_smoothing=e) mixes smoothed one-hots; the task smooths the mixed
    targets instead. Both give lam*s(a) + (1-lam)*s(b) with s(y) = (1-e)*y + e/C."""
    torch.manual_seed(0)
    C, e, lam = 7, 0.1, 0.37
    a, b = torch.randint(0, C, (5,)), torch.randint(0, C, (5,))
    off, on = e / C, 1 - e + e / C
    smooth = lambda y: F.one_hot(y, C).float() * (on - off) + off  # noqa: E731 (timm's one_hot)
    timm_targets = lam * smooth(a) + (1 - lam) * smooth(b)
    mixed = lam * F.one_hot(a, C).float() + (1 - lam) * F.one_hot(b, C).float()
    logits = torch.randn(5, C)
    ours = F.cross_entropy(logits, mixed, label_smoothing=e)
    theirs = -(timm_targets * logits.log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(ours, theirs)


def test_mixup_collator_mixes_images_not_patches() -> None:
    """A CutMix-like stand-in for timm's Mixup: the box must land on image pixels."""
    p, S = 16, 32

    def fake_mixup(x: torch.Tensor, y: torch.Tensor):
        assert x.shape == (4, 3, S, S)
        x = x.clone()
        x[:, :, :16, :16] = x.flip(0)[:, :, :16, :16]  # top-left quarter from the partner
        lam = 0.75
        soft = lam * F.one_hot(y, 3).float() + (1 - lam) * F.one_hot(y.flip(0), 3).float()
        return x, soft

    images = torch.randn(4, 3, S, S)
    items = [{"inputs": patchify(images[i], p), "targets": i % 3} for i in range(4)]
    batch = MixupCollator(fake_mixup, p, S)(items)
    assert batch["targets"].shape == (4, 3)
    torch.testing.assert_close(batch["targets"].sum(-1), torch.ones(4))
    mixed = unpatchify(batch["inputs"], p, S, S)
    assert torch.equal(mixed[0, :, :16, :16], images[3, :, :16, :16])
    assert torch.equal(mixed[0, :, 16:, :], images[0, :, 16:, :])
    with pytest.raises(ValueError, match="even batch"):
        MixupCollator(fake_mixup, p, S)(items[:3])


@pytest.mark.skipif(
    not has_timm(),
    reason="timm is not importable here (`pip install 'megalab[vision]'`; timm needs torchvision, "
    "which must match the installed torch)",
)
def test_timm_mixup_cutmix_gives_soft_targets(folder: Path) -> None:
    dm = module(folder, augment="deit", mixup=0.8, cutmix=1.0, repeated_aug=3, drop_last=True)
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].shape == (4, 196, 768)
    assert batch["targets"].shape == (4, 3) and batch["targets"].dtype == torch.float32
    torch.testing.assert_close(batch["targets"].sum(-1), torch.ones(4))
    assert (batch["targets"].max(-1).values < 1).any()  # mixed, not one-hot


def test_mixup_needs_even_batches_and_drop_last(folder: Path, monkeypatch) -> None:
    monkeypatch.setattr(inet, "require_timm", lambda what: None)
    dm = module(folder, augment="none", mixup=0.8, cutmix=1.0, batch_size=4, drop_last=False)
    with pytest.raises(ValueError, match="drop_last"):
        dm.train_dataloader()


# --------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_repeated_augmentation_sampler(world: int) -> None:
    N, R = 10, 3
    shards = [RepeatedAugSampler(N, R, seed=5, rank=r, world_size=world) for r in range(world)]
    per_rank = -(-N // world)
    assert all(len(s) == per_rank for s in shards)
    # Rebuild the global order: position k of rank r is global index k * world + r.
    glob = [shards[k % world].indices()[k // world] for k in range(per_rank * world)]
    for k in range(0, len(glob) - R + 1, R):  # each image R times on consecutive positions
        assert len(set(glob[k : k + R])) == 1
    distinct = len(set(glob))
    assert distinct == -(-len(glob) // R) or distinct == len(glob) // R
    again = RepeatedAugSampler(N, R, seed=5, rank=0, world_size=world)
    assert again.indices() == shards[0].indices()  # a pure function of (seed, epoch, rank)
    again.set_epoch(1)
    assert again.indices() != shards[0].indices()


def test_repeated_aug_loader_resumes(folder: Path) -> None:
    dm = module(folder, augment="none", repeated_aug=3, batch_size=4)
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, RepeatedAugSampler)
    full = [b["targets"].tolist() for b in loader]
    assert len(full) == 3  # 12 images per epoch, as without repetition
    loader.position = lambda: 1
    assert [b["targets"].tolist() for b in loader] == full[1:]
