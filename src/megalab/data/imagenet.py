"""ImageNet-1k (ILSVRC 2012) as sequences of image patches: readers, transforms, DataModule.

Images come from the standard ImageFolder layout (`train/<wnid>/*.JPEG`, `val/<wnid>/*.JPEG`;
labels are the indices of the sorted wnids) or from the Hub's gated `ILSVRC/imagenet-1k` (same
label order; its `validation` split serves as val and test, as for the folder layout).

Each image becomes non-overlapping `patch_size` x `patch_size` patches in row-major order, each
flattened channel-major to `3 * p * p` features: `(L=196, C=768)` at 224 px and p = 16. A
`FeatureEmbedding` (a Linear) over these features equals a stride-p convolutional patch
embedding whose weight is the Linear weight reshaped to `(D, 3, p, p)`.

Training follows the DeiT recipe the Mega paper uses (Table 11): RandAugment
`rand-m9-mstd0.5-inc1`, random erasing 0.25, Mixup 0.8 / CutMix 1.0 (timm, an optional extra:
`pip install megalab[vision]`), repeated augmentation x3 (:class:`RepeatedAugSampler`) and label
smoothing 0.1 (set on the task: smoothing the mixed soft targets in the loss gives exactly the
targets of timm's Mixup with `label_smoothing=0.1`). Evaluation resizes the shorter side to
`img_size / crop_pct` (256 for 224 at 0.875, bicubic) and center-crops, with PIL and NumPy
only; `augment: basic` (random-resized crop and flip) and `none` need no extra either.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from megalab.data import download as dl
from megalab.data.base import (
    SequenceCollator,
    SequenceDataModule,
    ShardedSampler,
)
from megalab.utils.errors import MissingExtraError, UserError

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HUB_ID = "ILSVRC/imagenet-1k"
IMG_EXTENSIONS = (".jpeg", ".jpg", ".png", ".ppm", ".bmp", ".webp", ".tif", ".tiff")
SOURCES = ("folder", "hub")
AUGMENTS = ("deit", "basic", "none")
INTERPOLATIONS = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
}
VISION_EXTRA = "pip install 'megalab[vision]'"
_IMAGEFOLDER_HOW = """\
ImageNet cannot be downloaded automatically from image-net.org (registration required).
Either (1) download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from
https://image-net.org/download-images, extract them into train/<wnid>/*.JPEG and
val/<wnid>/*.JPEG (the val images sorted into class folders, e.g. with the PyTorch examples'
extract_ILSVRC.sh), or (2) use the Hub copy with `data.source=hub` / `megalab-data imagenet
--from-hub` after accepting its terms at https://huggingface.co/datasets/ILSVRC/imagenet-1k."""


class ImageNetFormatError(UserError, ValueError):
    """An ImageNet folder, file or setting that cannot be used; the message names it."""


# ---------------------------------------------------------------------------------------------
# Patches
# ---------------------------------------------------------------------------------------------
def patchify(images: Tensor, patch_size: int) -> Tensor:
    """(..., C, H, W) -> (..., L, C*p*p): row-major patches, each flattened as (C, p, p)."""
    *lead, C, H, W = images.shape
    p = patch_size
    if H % p or W % p:
        raise ValueError(f"image size {H}x{W} is not a multiple of the patch size {p}")
    x = images.reshape(*lead, C, H // p, p, W // p, p)
    n = len(lead)
    x = x.permute(*range(n), n + 1, n + 3, n, n + 2, n + 4)
    return x.reshape(*lead, (H // p) * (W // p), C * p * p)


def unpatchify(patches: Tensor, patch_size: int, height: int, width: int) -> Tensor:
    """The inverse of :func:`patchify`: (..., L, C*p*p) -> (..., C, H, W)."""
    *lead, L, F = patches.shape
    p = patch_size
    gh, gw = height // p, width // p
    if gh * gw != L or F % (p * p):
        raise ValueError(f"{L} patches of {F} features do not tile a {height}x{width} image")
    C = F // (p * p)
    x = patches.reshape(*lead, gh, gw, C, p, p)
    n = len(lead)
    x = x.permute(*range(n), n + 2, n, n + 3, n + 1, n + 4)
    return x.reshape(*lead, C, height, width)


# ---------------------------------------------------------------------------------------------
# Transforms (PIL + NumPy)
# ---------------------------------------------------------------------------------------------
def _resample(name: str) -> Image.Resampling:
    if name not in INTERPOLATIONS:
        raise ValueError(f"unknown interpolation {name!r}; use {sorted(INTERPOLATIONS)}")
    return INTERPOLATIONS[name]


def resize_shorter(img: Image.Image, size: int, interpolation: str = "bicubic") -> Image.Image:
    """Resize so the shorter side is `size` (the longer one truncated, as torchvision)."""
    w, h = img.size
    if w <= h:
        new = (size, int(size * h / w))
    else:
        new = (int(size * w / h), size)
    return img if new == (w, h) else img.resize(new, _resample(interpolation))


def center_crop(img: Image.Image, size: int) -> Image.Image:
    """The central `size` x `size` window (offsets rounded as torchvision's CenterCrop)."""
    w, h = img.size
    if w < size or h < size:
        raise ValueError(f"cannot center-crop {size}x{size} from a {w}x{h} image")
    top = round((h - size) / 2.0)
    left = round((w - size) / 2.0)
    return img.crop((left, top, left + size, top + size))


def to_normalized_tensor(
    img: Image.Image,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> Tensor:
    """RGB PIL image -> float32 (3, H, W): x / 255, then (x - mean) / std per channel."""
    x = np.asarray(img.convert("RGB"), dtype=np.float32) / np.float32(255.0)
    x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


class EvalTransform:
    """Resize the shorter side to int(img_size / crop_pct), center-crop img_size, normalise."""

    def __init__(
        self,
        img_size: int = 224,
        crop_pct: float = 0.875,
        interpolation: str = "bicubic",
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        if not 0 < crop_pct <= 1:
            raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
        _resample(interpolation)
        self.img_size = img_size
        self.resize = math.floor(img_size / crop_pct)
        self.interpolation = interpolation
        self.mean, self.std = tuple(mean), tuple(std)

    def __call__(self, img: Image.Image) -> Tensor:
        img = resize_shorter(img.convert("RGB"), self.resize, self.interpolation)
        return to_normalized_tensor(center_crop(img, self.img_size), self.mean, self.std)


class BasicTrainTransform:
    """Random-resized crop (scale 0.08-1, ratio 3/4-4/3) and horizontal flip; PIL + torch RNG.

    The crop box follows torchvision's RandomResizedCrop; randomness comes from torch's
    generator, which the DataLoader seeds per worker.
    """

    def __init__(
        self,
        img_size: int = 224,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        hflip: float = 0.5,
        interpolation: str = "bicubic",
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        _resample(interpolation)
        self.img_size, self.scale, self.ratio, self.hflip = img_size, scale, ratio, hflip
        self.interpolation = interpolation
        self.mean, self.std = tuple(mean), tuple(std)

    def crop_box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(left, top, w, h) of a random crop."""
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * torch.empty(1).uniform_(*self.scale).item()
            aspect = math.exp(torch.empty(1).uniform_(*log_ratio).item())
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, (1,)).item())
                left = int(torch.randint(0, width - w + 1, (1,)).item())
                return left, top, w, h
        in_ratio = width / height  # fallback: the largest central crop within the ratio range
        if in_ratio < min(self.ratio):
            w, h = width, round(width / min(self.ratio))
        elif in_ratio > max(self.ratio):
            w, h = round(height * max(self.ratio)), height
        else:
            w, h = width, height
        return (width - w) // 2, (height - h) // 2, w, h

    def __call__(self, img: Image.Image) -> Tensor:
        img = img.convert("RGB")
        left, top, w, h = self.crop_box(*img.size)
        img = img.resize(
            (self.img_size, self.img_size),
            _resample(self.interpolation),
            box=(left, top, left + w, top + h),
        )
        if torch.rand(1).item() < self.hflip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_normalized_tensor(img, self.mean, self.std)


def require_timm(what: str) -> Any:
    """Import `timm.data`, or fail with a message naming the `vision` extra and the fallback."""
    try:
        import timm.data
    except Exception as e:  # ImportError, or a torchvision build that does not match torch
        raise MissingExtraError(
            f"{what} needs timm (with torchvision): {VISION_EXTRA}. Importing it failed with "
            f"{type(e).__name__}: {e}. Without it, train with `data.augment=basic` (or none), "
            "`data.mixup=0` and `data.cutmix=0`; evaluation needs no extra."
        ) from e
    return timm.data


def deit_train_transform(
    img_size: int = 224,
    auto_augment: str | None = "rand-m9-mstd0.5-inc1",
    color_jitter: float = 0.3,
    reprob: float = 0.25,
    interpolation: str = "bicubic",
) -> Callable[[Image.Image], Tensor]:
    """DeiT's training transform (timm `create_transform` with DeiT's arguments)."""
    timm_data = require_timm("The DeiT training transform (RandAugment, random erasing)")
    return timm_data.create_transform(
        input_size=img_size,
        is_training=True,
        color_jitter=color_jitter,
        auto_augment=auto_augment,
        interpolation=interpolation,
        re_prob=reprob,
        re_mode="pixel",
        re_count=1,
    )


# ---------------------------------------------------------------------------------------------
# Sources and datasets
# ---------------------------------------------------------------------------------------------
def find_classes(folder: str | Path) -> list[str]:
    """Sorted class-folder names (wnids) of an ImageFolder split."""
    folder = Path(folder)
    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir())
    if not classes:
        raise ImageNetFormatError(
            f"{folder} holds no class folders: expected {folder}/<wnid>/*.JPEG"
        )
    return classes


def scan_image_folder(folder: str | Path, classes: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """(image paths, labels) of an ImageFolder split, sorted; labels index `classes`."""
    folder = Path(folder)
    index = {c: i for i, c in enumerate(classes)}
    found = find_classes(folder)
    unknown = [c for c in found if c not in index]
    if unknown:
        raise ImageNetFormatError(
            f"{folder} has class folder(s) {unknown[:5]} that the training split lacks; both "
            "splits must use the same wnid folders"
        )
    paths: list[str] = []
    labels: list[int] = []
    for c in found:
        names = sorted(n for n in os.listdir(folder / c) if n.lower().endswith(IMG_EXTENSIONS))
        paths.extend(str(folder / c / n) for n in names)
        labels.extend([index[c]] * len(names))
    if not paths:
        raise ImageNetFormatError(f"{folder} holds no images ({', '.join(IMG_EXTENSIONS)})")
    return paths, np.asarray(labels, dtype=np.int64)


def load_image(path: str) -> Image.Image:
    """Open an image file as RGB; errors name the file."""
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except Exception as e:
        raise ImageNetFormatError(f"{path}: cannot read the image ({e})") from e


class ImagePatches(Dataset):
    """Images (from files or a Hub dataset) -> transform -> `(L, 3*p*p)` patch sequences."""

    def __init__(
        self,
        images: Sequence[str] | Any,
        labels: np.ndarray | None,
        transform: Callable[[Image.Image], Tensor],
        patch_size: int,
    ) -> None:
        self.images = images  # file paths, or a Hub dataset with `image`/`label` columns
        self.labels = labels
        self.transform = transform
        self.patch_size = patch_size

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.labels is not None:
            img, label = load_image(self.images[i]), int(self.labels[i])
        else:
            row: Any = self.images[int(i)]
            img, label = row["image"].convert("RGB"), int(row["label"])
        x = self.transform(img)
        return {"inputs": patchify(x, self.patch_size), "targets": label}


class MixupCollator(SequenceCollator):
    """Stacks patch sequences, then applies timm's Mixup/CutMix on the images they tile.

    Targets become soft (B, num_classes) rows. timm mixes a batch with its reverse, so the
    per-device batch must be even.
    """

    def __init__(
        self,
        mixup: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
        patch_size: int,
        img_size: int,
    ) -> None:
        super().__init__(pad_id=0)
        self.mixup, self.patch_size, self.img_size = mixup, patch_size, img_size

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Tensor]:
        batch = super().__call__(items)
        if batch["inputs"].shape[0] % 2:
            raise ValueError(
                f"Mixup/CutMix needs an even batch, got {batch['inputs'].shape[0]}: use an even "
                "per-device batch size and data.drop_last=true"
            )
        images = unpatchify(batch["inputs"], self.patch_size, self.img_size, self.img_size)
        images, targets = self.mixup(images.contiguous(), batch["targets"])
        batch["inputs"] = patchify(images, self.patch_size)
        batch["targets"] = targets.float()
        return batch


class RepeatedAugSampler(ShardedSampler):
    """DeiT's repeated augmentation: each image `repeats` times per epoch, copies on
    consecutive global positions (so on different processes), epoch length kept at ~N.

    A pure function of (seed, epoch, rank) like :class:`ShardedSampler`, and resumable through
    its `skip`. Each process takes ceil(N / world_size) indices per epoch (DeiT additionally
    rounds N down to a multiple of 256).
    """

    def __init__(
        self, size: int, repeats: int = 3, seed: int = 0, rank: int = 0, world_size: int = 1
    ) -> None:
        super().__init__(size, shuffle=True, seed=seed, rank=rank, world_size=world_size)
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.repeats = repeats

    def indices(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + 7919 * self.epoch)
        order = torch.randperm(self.size, generator=g).repeat_interleave(self.repeats).tolist()
        per_rank = -(-self.size // self.world_size)
        total = -(-len(order) // self.world_size) * self.world_size
        order += order[: total - len(order)]
        return order[self.rank : total : self.world_size][:per_rank]


def hub_token() -> str | None:
    """The Hugging Face token (HF_TOKEN or a stored login), or None."""
    try:
        from huggingface_hub import get_token
    except ImportError:
        return os.environ.get("HF_TOKEN") or None
    return get_token()


def load_hub_split(hub_id: str, split: str, cache_dir: Path) -> Any:
    """One split of the gated Hub dataset; a missing token or download gives a clear error."""
    token = hub_token()
    if token is None:
        raise dl.DatasetMissingError(
            f"{hub_id} is gated on the Hugging Face Hub and no access token was found. Accept "
            f"its terms at https://huggingface.co/datasets/{hub_id}, then log in with "
            "`hf auth login` (or `huggingface-cli login`) or set HF_TOKEN. Alternatively use "
            "the ImageFolder layout (data.source=folder).\n" + _IMAGEFOLDER_HOW
        )
    import datasets

    from megalab.data.hub import client_summary, quiet_hub_client

    try:
        with quiet_hub_client() as messages:
            return datasets.load_dataset(hub_id, split=split, token=token, cache_dir=str(cache_dir))
    except Exception as e:
        detail = f"; {client_summary(messages)}" if messages else ""
        raise dl.DatasetMissingError(
            f"loading the {split!r} split of {hub_id} failed ({type(e).__name__}: {e}{detail}). "
            "Check that your account accepted the dataset's terms, that you are online (or that "
            f"{cache_dir} already holds it), and the token in HF_TOKEN / your login."
        ) from e


# ---------------------------------------------------------------------------------------------
# DataModule
# ---------------------------------------------------------------------------------------------
class ImageNetDataModule(SequenceDataModule):
    """ImageNet-1k as `(L, 3*p*p)` patch sequences; val doubles as test (no public test labels)."""

    def __init__(
        self,
        data_dir: str | Path,
        source: str = "folder",
        hub_id: str = HUB_ID,
        img_size: int = 224,
        patch_size: int = 16,
        crop_pct: float = 0.875,
        interpolation: str = "bicubic",
        augment: str = "deit",
        auto_augment: str | None = "rand-m9-mstd0.5-inc1",
        color_jitter: float = 0.3,
        reprob: float = 0.25,
        mixup: float = 0.8,
        cutmix: float = 1.0,
        mixup_prob: float = 1.0,
        mixup_switch_prob: float = 0.5,
        repeated_aug: int = 3,
        max_len: int = 196,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("num_classes", 1000)
        kwargs.setdefault("d_input", 3 * patch_size * patch_size)
        super().__init__(data_dir=data_dir, max_len=max_len, **kwargs)
        if source not in SOURCES:
            raise ValueError(f"unknown ImageNet source {source!r}; use {SOURCES}")
        if augment not in AUGMENTS:
            raise ValueError(f"unknown augment {augment!r}; use {AUGMENTS}")
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
        length, width = (img_size // patch_size) ** 2, 3 * patch_size**2
        if max_len != length or self.spec.d_input != width:
            raise ValueError(
                f"{img_size}px images in {patch_size}px patches give max_len={length} and "
                f"d_input={width}; the config says max_len={max_len}, d_input="
                f"{self.spec.d_input}: set both in the data config"
            )
        if self.spec.vocab_size is not None:
            raise ValueError("image patches are real-valued: set vocab_size: null")
        if repeated_aug < 1:
            raise ValueError(f"repeated_aug must be >= 1 (1: off), got {repeated_aug}")
        _resample(interpolation)
        self.source, self.hub_id = source, hub_id
        self.img_size, self.patch_size = img_size, patch_size
        self.crop_pct, self.interpolation = crop_pct, interpolation
        self.augment, self.auto_augment = augment, auto_augment
        self.color_jitter, self.reprob = color_jitter, reprob
        self.mixup_alpha, self.cutmix_alpha = mixup, cutmix
        self.mixup_prob, self.mixup_switch_prob = mixup_prob, mixup_switch_prob
        self.repeated_aug = repeated_aug
        self.classes: list[str] = []
        # Fail at construction, not hours later in a worker, when the recipe needs timm.
        if augment == "deit":
            require_timm("data.augment=deit (RandAugment, random erasing)")
        if self.mixup_active:
            require_timm("Mixup/CutMix (data.mixup / data.cutmix > 0)")

    @property
    def mixup_active(self) -> bool:
        return self.mixup_prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)

    # -- transforms -----------------------------------------------------------------------------
    def eval_transform(self) -> EvalTransform:
        return EvalTransform(self.img_size, self.crop_pct, self.interpolation)

    def train_transform(self) -> Callable[[Image.Image], Tensor]:
        if self.augment == "deit":
            return deit_train_transform(
                self.img_size,
                self.auto_augment,
                self.color_jitter,
                self.reprob,
                self.interpolation,
            )
        if self.augment == "basic":
            return BasicTrainTransform(self.img_size, interpolation=self.interpolation)
        return self.eval_transform()

    def mixup_fn(self) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """timm's Mixup with DeiT's settings; smoothing is left to the task's loss."""
        timm_data = require_timm("Mixup/CutMix")
        return timm_data.Mixup(
            mixup_alpha=self.mixup_alpha,
            cutmix_alpha=self.cutmix_alpha,
            prob=self.mixup_prob,
            switch_prob=self.mixup_switch_prob,
            mode="batch",
            label_smoothing=0.0,
            num_classes=self.spec.num_classes,
        )

    # -- data -----------------------------------------------------------------------------------
    def folder(self, split: str) -> Path:
        return self.data_dir / split

    def prepare_data(self) -> None:
        """Check the ImageFolder layout, or download the Hub copy (rank 0)."""
        if self.source == "hub":
            for split in ("train", "validation"):
                load_hub_split(self.hub_id, split, self.data_dir / "hub")
            return
        dl.require_files(
            [self.folder("train"), self.folder("val")],
            dataset="ImageNet-1k",
            how=_IMAGEFOLDER_HOW,
            url="https://image-net.org/download-images",
            data_dir=self.data_dir,
        )

    def _check_classes(self, n: int, where: str) -> None:
        if n != self.spec.num_classes:
            raise ImageNetFormatError(
                f"{where} has {n} classes but the config says num_classes="
                f"{self.spec.num_classes}; set data.num_classes={n} for this subset"
            )

    def build_datasets(self) -> dict[str, ImagePatches]:
        train_tf, eval_tf = self.train_transform(), self.eval_transform()
        if self.source == "hub":
            train = load_hub_split(self.hub_id, "train", self.data_dir / "hub")
            val = load_hub_split(self.hub_id, "validation", self.data_dir / "hub")
            names = getattr(train.features.get("label"), "names", None)
            self.classes = list(names) if names else []
            self._check_classes(train.features["label"].num_classes, self.hub_id)
            train_ds = ImagePatches(train, None, train_tf, self.patch_size)
            val_ds = ImagePatches(val, None, eval_tf, self.patch_size)
        else:
            self.prepare_data()  # the same existence check, with its message, on every rank
            self.classes = find_classes(self.folder("train"))
            self._check_classes(len(self.classes), str(self.folder("train")))
            train_paths, train_labels = scan_image_folder(self.folder("train"), self.classes)
            val_paths, val_labels = scan_image_folder(self.folder("val"), self.classes)
            train_ds = ImagePatches(train_paths, train_labels, train_tf, self.patch_size)
            val_ds = ImagePatches(val_paths, val_labels, eval_tf, self.patch_size)
        return {"train": train_ds, "val": val_ds, "test": val_ds}

    # -- loaders --------------------------------------------------------------------------------
    def sampler(self, split: str, batch_size: int) -> Sampler[int]:
        """Repeated augmentation for training when configured; the base sharding otherwise."""
        if split != "train" or self.repeated_aug == 1:
            return super().sampler(split, batch_size)
        rank, world = self.rank_and_world()
        size = len(self.datasets["train"])
        return RepeatedAugSampler(size, self.repeated_aug, self.seed, rank, world)

    def collate_fn(self, split: str = "train") -> Callable:
        """Mixup/CutMix on training batches when configured."""
        if split != "train" or not self.mixup_active:
            return super().collate_fn(split)
        size = self.per_device_batch_size(self.batch_size)
        if size % 2 or not self.drop_last:
            raise ValueError(
                f"Mixup/CutMix mixes each batch with its reverse and needs even batches: the "
                f"per-device batch is {size} and drop_last={self.drop_last}; use an even size "
                "and data.drop_last=true"
            )
        return MixupCollator(self.mixup_fn(), self.patch_size, self.img_size)
