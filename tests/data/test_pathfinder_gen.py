"""Pathfinder generator: determinism, balance, pixel statistics, layout and connectivity."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from megalab.data.lra.pathfinder_gen import (
    SETTINGS,
    PathfinderSample,
    generate_pathfinder,
    make_sample,
)

# --------------------------------------------------------------------------- utilities


def _point_seg(p: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    ab, ap = b - a, p - a
    denom = float(ab @ ab)
    t = 0.0 if denom == 0 else min(max(float(ap @ ab) / denom, 0.0), 1.0)
    return float(np.linalg.norm(ap - t * ab))


def _seg_seg(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> float:
    """Exact distance between two segments (zero when they cross)."""

    def cross(u: np.ndarray, v: np.ndarray) -> float:
        return float(u[0] * v[1] - u[1] * v[0])

    o1, o2 = cross(b - a, c - a), cross(b - a, d - a)
    o3, o4 = cross(d - c, a - c), cross(d - c, b - c)
    if o1 * o2 < 0 and o3 * o4 < 0:
        return 0.0
    return min(_point_seg(a, c, d), _point_seg(b, c, d), _point_seg(c, a, b), _point_seg(d, a, b))


def _components(sample: PathfinderSample, link: float) -> tuple[list[int], int]:
    """Union-find over the drawn ink: paddles (as thick segments) and the two marker discs.

    Two items are linked when the gap between their ink is at most ``link``. Returns each
    item's component root and the offset of the two markers in the item list.
    """
    s = sample.settings
    items = [(p[0], p[1], 0.5 * s.paddle_thickness) for c in sample.contours for p in c]
    first_marker = len(items)
    items += [(m, m, s.marker_radius) for m in sample.markers]
    parent = list(range(len(items)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    lo = [np.minimum(a, b) - r for a, b, r in items]
    hi = [np.maximum(a, b) + r for a, b, r in items]
    for i, (a, b, r) in enumerate(items):
        for j in range(i):
            if (lo[i] > hi[j] + link).any() or (lo[j] > hi[i] + link).any():
                continue  # bounding boxes too far apart to be linked
            c, d, q = items[j]
            if _seg_seg(a, b, c, d) - r - q <= link:
                parent[find(i)] = find(j)
    return [find(i) for i in range(len(items))], first_marker


def _read_metadata(diff_dir: Path) -> list[list[str]]:
    """Parse metadata the way LRA-style readers do: whitespace split, label at index 3."""
    rows = []
    for meta in sorted((diff_dir / "metadata").glob("*.npy")):
        for line in meta.read_text().splitlines():
            rows.append(line.split())
    return rows


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


# --------------------------------------------------------------------------- samples


def test_make_sample_is_deterministic():
    a = make_sample(7, resolution=32, contour_length=14, seed=3)
    b = make_sample(7, resolution=32, contour_length=14, seed=3)
    c = make_sample(7, resolution=32, contour_length=14, seed=4)
    d = make_sample(8, resolution=32, contour_length=14, seed=3)
    assert np.array_equal(a.image, b.image) and a.label == b.label
    assert not np.array_equal(a.image, c.image)
    assert not np.array_equal(a.image, d.image)


@pytest.mark.parametrize(
    ("resolution", "length", "count"), [(32, 14, 24), (32, 6, 8), (128, 14, 4)]
)
def test_positives_connected_negatives_not(resolution, length, count):
    s = SETTINGS[resolution]
    assert s.clearance > s.paddle_gap  # what makes "connected" unambiguous
    for i in range(count):
        label = i % 2
        sample = make_sample(i, resolution=resolution, contour_length=length, seed=1, label=label)
        assert sample.label == label
        assert len(sample.contours[0]) == len(sample.contours[1]) == length
        for c in sample.contours:
            assert (c >= 0).all() and (c <= resolution).all()
        # Each marker sits at an end of the target contour it is said to belong to.
        for m, ci in zip(sample.markers, sample.marker_contours):
            ends = sample.contours[ci][[0, -1], [0, 1]]  # start of first, end of last paddle
            assert min(np.linalg.norm(ends - m, axis=1)) <= 0.5 * s.paddle_gap + 1e-6
        assert (sample.marker_contours[0] == sample.marker_contours[1]) == bool(label)
        if label:
            assert not np.allclose(sample.markers[0], sample.markers[1])

        # Following gaps no wider than the paddle gap joins the markers iff the label is 1.
        roots, m0 = _components(sample, link=s.paddle_gap)
        assert (roots[m0] == roots[m0 + 1]) == bool(label), f"sample {i}"
        # The linked component of a marker is exactly its contour (plus the marker(s)).
        n_linked = sum(r == roots[m0] for r in roots)
        assert n_linked == length + (2 if label else 1)


def test_image_statistics():
    for resolution, bg_range in ((32, (0.6, 0.9)), (128, (0.85, 0.98))):
        s = SETTINGS[resolution]
        for i in range(4):
            sample = make_sample(i, resolution=resolution, contour_length=14, seed=0)
            img = sample.image
            assert img.shape == (resolution, resolution) and img.dtype == np.uint8
            background = float((img == 0).mean())
            assert bg_range[0] < background < bg_range[1], background
            assert img.max() == 255
            # Both markers are drawn: the pixel under each centre is (almost) fully covered.
            for x, y in sample.markers:
                assert img[int(y), int(x)] >= 200
                assert s.marker_radius <= x <= resolution - s.marker_radius
            # Ink everywhere but the image is mostly background: grey levels come from edges.
            assert 0 < (img > 0).sum() < img.size


def test_contours_do_not_depend_on_label():
    pos = make_sample(3, resolution=64, contour_length=9, seed=2, label=1)
    neg = make_sample(3, resolution=64, contour_length=9, seed=2, label=0)
    assert len(pos.contours) == len(neg.contours)
    for a, b in zip(pos.contours, neg.contours):
        assert np.array_equal(a, b)
    assert not np.array_equal(pos.image, neg.image)  # only the markers moved
    # Negative markers: the cross-contour end pair whose distance best matches a contour's
    # end-to-end distance (the positive pair), so marker distance is no cue.
    ends = [np.stack([c[0, 0], c[-1, 1]]) for c in neg.contours[:2]]
    cross = [np.linalg.norm(a - b) for a in ends[0] for b in ends[1]]
    pos_d = np.linalg.norm(pos.markers[0] - pos.markers[1])
    neg_d = np.linalg.norm(neg.markers[0] - neg.markers[1])
    tol = neg.settings.paddle_gap  # contour ends above are paddle tips, half a gap from markers
    assert abs(neg_d - pos_d) <= min(abs(d - pos_d) for d in cross) + tol


def test_label_balance_and_random_labels():
    labels = [make_sample(i, resolution=32, contour_length=9).label for i in range(40)]
    assert 10 < sum(labels) < 30


# --------------------------------------------------------------------------- on-disk output


def test_generate_layout_metadata_and_balance(tmp_path):
    out = generate_pathfinder(
        tmp_path,
        resolution=32,
        contour_length=14,
        num_samples=25,
        seed=5,
        workers=1,
        images_per_batch_dir=10,
        progress=False,
    )
    assert out == tmp_path / "pathfinder32" / "curv_contour_length_14"
    assert sorted(p.name for p in (out / "metadata").iterdir()) == ["0.npy", "1.npy", "2.npy"]
    rows = _read_metadata(out)
    assert len(rows) == 25
    pngs = {p.relative_to(out) for p in (out / "imgs").rglob("*.png")}
    referenced = set()
    for fields in rows:
        assert fields[0].startswith("imgs/") and fields[1].startswith("sample_")
        path = out / fields[0] / fields[1]
        label = int(fields[3])
        assert label in (0, 1) and path.is_file()
        referenced.add(path.relative_to(out))
        with Image.open(path) as im:
            assert im.mode == "L" and im.size == (32, 32)
            arr = np.asarray(im)
        # The PNG is exactly the sample of that global index and label.
        batch, i = int(fields[0].split("/")[1]), int(fields[2])
        assert fields[1] == f"sample_{i}.png"
        ref = make_sample(batch * 10 + i, resolution=32, contour_length=14, seed=5, label=label)
        assert np.array_equal(arr, ref.image)
    assert referenced == pngs
    # Exact balance inside every batch directory (10, 10 and 5 images).
    per_batch: dict[str, list[int]] = {}
    for fields in rows:
        per_batch.setdefault(fields[0], []).append(int(fields[3]))
    assert sorted(sum(v) for v in per_batch.values()) in ([2, 5, 5], [3, 5, 5])


def test_same_bytes_for_any_worker_count(tmp_path):
    kwargs = dict(resolution=32, contour_length=6, num_samples=36, seed=11, images_per_batch_dir=12)
    a = generate_pathfinder(tmp_path / "a", workers=1, progress=False, **kwargs)
    b = generate_pathfinder(tmp_path / "b", workers=2, progress=False, **kwargs)
    ta, tb = _tree_bytes(a), _tree_bytes(b)
    assert len(ta) == 36 + 3 and ta == tb


def test_rerun_is_cached_resume_and_foreign_data(tmp_path):
    kwargs = dict(
        resolution=32,
        contour_length=9,
        num_samples=12,
        seed=0,
        workers=1,
        images_per_batch_dir=6,
        progress=False,
    )
    out = generate_pathfinder(tmp_path, **kwargs)
    before = _tree_bytes(out)
    stamp = (out / "metadata" / "0.npy").stat().st_mtime_ns
    assert generate_pathfinder(tmp_path, **kwargs) == out
    assert (out / "metadata" / "0.npy").stat().st_mtime_ns == stamp

    # An interrupted run (no completion marker, one batch unfinished) only redoes that batch.
    (out / ".complete").unlink()
    (out / "metadata" / "1.npy").unlink()
    (out / "imgs" / "1" / "sample_3.png").unlink()
    generate_pathfinder(tmp_path, **kwargs)
    assert (out / "metadata" / "0.npy").stat().st_mtime_ns == stamp
    assert _tree_bytes(out) == before

    # Other parameters regenerate our own output; data we did not write is never touched.
    generate_pathfinder(tmp_path, **{**kwargs, "seed": 1})
    assert _tree_bytes(out) != before
    foreign = tmp_path / "release"
    (foreign / "pathfinder32" / "curv_contour_length_9" / "metadata").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="did not write"):
        generate_pathfinder(foreign, **kwargs)


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError, match="resolution"):
        generate_pathfinder(tmp_path, resolution=48, num_samples=2)
    with pytest.raises(ValueError):
        generate_pathfinder(tmp_path, num_samples=0)
    assert math.isclose(SETTINGS[32].step, 3.0)
