"""Pathfinder image generator (Linsley et al., 2018), writing LRA's on-disk layout.

The Pathfinder task asks whether two circular markers are joined by one dashed curve. Each image
holds two *target* contours of ``contour_length`` paddles (short line segments; LRA uses 6, 9 and
14) and a set of shorter distractor contours. Consecutive paddles of a contour are separated by
a small gap and turn by a bounded angle, which gives smooth dashed curves. Both target contours
reserve room for a marker at each end, so the geometry does not depend on the label; then:

- label 1 (positive): both markers sit on the two ends of the *same* target contour;
- label 0 (negative): one marker sits on an end of each target contour; of the four such end
  pairs, the one whose distance is closest to the end-to-end distance of a target contour, so
  that the distance between the markers is not a cue to the label.

Contours never come closer than ``clearance`` to one another, and ``clearance`` exceeds the gap
inside a contour, so "connected" is unambiguous: following gaps of at most ``paddle_gap`` leads
from one marker to the other exactly when the label is 1. Paddles are flat-ended bars and
markers are discs, drawn white on black with 4x4 supersampling (anti-aliased grey levels
0-255, like the release).

Per-resolution settings, in pixels of the output image. A "step" is paddle length + gap, the
distance from one paddle's start to the next; the visible gap between two paddles of a contour
is at most ``gap``, and different contours stay at least ``clearance`` (> gap) apart.
Distractors are contours of ``contour_length // 3`` paddles, as many as fit in the budget of
distractor paddles (at 32 pixels with 14-paddle targets, typically 3-4 of the 4 fit):

=====  ======  ===  =========  ======  =========  ========  =======  ==========  ===========
image  paddle  gap  thickness  marker  clearance  max turn  step /   14-paddle   distractor
size   length                  radius             per step  width    path/width  paddles
=====  ======  ===  =========  ======  =========  ========  =======  ==========  ===========
32     1.8     1.2  1.0        1.5     1.4        50°       9.4 %    1.31        16
64     3.6     2.2  1.2        2.2     2.4        50°       9.1 %    1.27        24
128    6.5     3.5  1.5        3.0     4.0        50°       7.8 %    1.09        32
256    12.0    6.0  2.0        5.0     7.0        50°       7.0 %    0.98        40
=====  ======  ===  =========  ======  =========  ========  =======  ==========  ===========

Layout (the release's, so one reader handles both)::

    <root>/pathfinder{size}/curv_contour_length_{L}/imgs/<batch>/sample_<i>.png
    <root>/pathfinder{size}/curv_contour_length_{L}/metadata/<batch>.npy

Despite the suffix each metadata file is plain text, one line per image with space-separated
fields ``imgs/<batch> sample_<i>.png <i> <label> <contour_length> <distractors> <size>``: the
sub-directory (0), the file name (1) and the label at index 3, which is what LRA-style readers
use. Samples are numbered within their batch directory; sample ``i`` of batch ``b`` has global
index ``b * images_per_batch_dir + i``, and its random stream is derived from
``(seed, size, contour_length, global index)`` alone, so the output is byte-identical for any
number of worker processes. Within every batch directory the labels are an exact 50/50 split in
a seeded random order.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from megalab.data.cache import mark_prepared, prepared

__all__ = [
    "CONTOUR_LENGTHS",
    "SETTINGS",
    "PathfinderSample",
    "PathfinderSettings",
    "generate_pathfinder",
    "make_sample",
    "render",
]

#: Contour lengths (paddles per target contour) of LRA's three difficulties.
CONTOUR_LENGTHS = (6, 9, 14)

_GENERATOR_VERSION = 1
_SUPERSAMPLE = 4
_START_DIRECTIONS = 8  # initial directions tried from a contour's start point
_TURN_CANDIDATES = 6  # turns tried for each further paddle (with backtracking)
_TARGET_BUDGET = 4  # paddle evaluations per paddle of a target contour before it is abandoned
_DISTRACTOR_BUDGET = 2  # the same for distractor contours
_TARGET_TRIES = 60  # fresh starts per target contour before the whole image is restarted
_DISTRACTOR_TRIES = 6  # tries per distractor contour (fewer fit when the image is full)
_IMAGE_TRIES = 200
# Workers only need numpy and Pillow: forking avoids re-importing the caller's heavy modules.
_START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


@dataclass(frozen=True)
class PathfinderSettings:
    """Geometry of one resolution, in output pixels (see the table in the module docstring)."""

    resolution: int
    paddle_length: float
    paddle_gap: float
    paddle_thickness: float
    marker_radius: float
    clearance: float
    max_turn_deg: float
    distractor_paddles: int

    @property
    def step(self) -> float:
        """Distance between the starts of consecutive paddles."""
        return self.paddle_length + self.paddle_gap


#: LRA's four image sizes.
SETTINGS: dict[int, PathfinderSettings] = {
    32: PathfinderSettings(32, 1.8, 1.2, 1.0, 1.5, 1.4, 50.0, 16),
    64: PathfinderSettings(64, 3.6, 2.2, 1.2, 2.2, 2.4, 50.0, 24),
    128: PathfinderSettings(128, 6.5, 3.5, 1.5, 3.0, 4.0, 50.0, 32),
    256: PathfinderSettings(256, 12.0, 6.0, 2.0, 5.0, 7.0, 50.0, 40),
}


@dataclass
class PathfinderSample:
    """One image and the geometry it was drawn from (coordinates are (x, y) in pixels)."""

    image: np.ndarray  # (H, W) uint8, 0 background, up to 255 ink
    label: int  # 1: both markers on one contour
    contours: list[np.ndarray]  # each (n_paddles, 2, 2): start and end point of every paddle
    markers: np.ndarray  # (2, 2) marker centres
    marker_contours: tuple[int, int]  # index in ``contours`` of the contour each marker ends
    settings: PathfinderSettings
    num_targets: int = 2  # contours[:2] are the target contours, the rest distractors
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- geometry


def _point_segment(p: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance from points ``p`` to segments ``a``-``b`` (broadcasting over leading axes)."""
    ab = b - a
    ap = p - a
    denom = (ab * ab).sum(-1)
    t = (ap * ab).sum(-1) / np.where(denom > 0, denom, 1.0)
    t = np.minimum(np.maximum(t, 0.0), 1.0)
    d = ap - t[..., None] * ab
    return np.sqrt((d * d).sum(-1))


class _Canvas:
    """Placed ink items (paddles and marker discs) for collision tests, in supersampled units.

    Item ``i`` is the set of points within ``r`` of the segment from ``(ax, ay)`` to
    ``(ax + dx, ay + dy)`` (a disc when the segment is a point). Items are appended in order,
    so rolling back is ``canvas.n = old_n``. ``seg`` holds ax, ay, dx, dy, 1/|d|², r per item;
    ``mx``, ``my``, ``reach`` their bounding circles, used to skip far items cheaply.
    """

    def __init__(self, size: float, capacity: int = 256) -> None:
        self.size = size
        self.seg = np.zeros((capacity, 6))
        self.mx = np.zeros(capacity)
        self.my = np.zeros(capacity)
        self.reach = np.zeros(capacity)
        self.n = 0

    def add(self, ax: float, ay: float, bx: float, by: float, r: float) -> None:
        if self.n == len(self.mx):
            self.seg = np.concatenate([self.seg, np.zeros_like(self.seg)])
            self.mx, self.my, self.reach = (
                np.concatenate([v, np.zeros_like(v)]) for v in (self.mx, self.my, self.reach)
            )
        dx, dy = bx - ax, by - ay
        len2 = dx * dx + dy * dy
        i = self.n
        self.seg[i] = (ax, ay, dx, dy, 1.0 / len2 if len2 > 0 else 0.0, r)
        self.mx[i], self.my[i] = ax + 0.5 * dx, ay + 0.5 * dy
        self.reach[i] = 0.5 * math.sqrt(len2) + r
        self.n += 1

    def clear(
        self,
        x: np.ndarray,
        y: np.ndarray,
        upto: int,
        cx: float,
        cy: float,
        radius: float,
        need: float,
    ) -> np.ndarray:
        """Whether each row of points ``(x, y)`` (shape (c, m)) keeps ``need`` from all ink.

        Only items ``< upto`` count (a contour's own latest paddles may come closer). All points
        lie within ``radius`` of ``(cx, cy)``, so items whose bounding circle is farther than
        ``radius + need`` from it are skipped. Returns a bool array of shape (c,).
        """
        n = min(self.n, upto)
        if n <= 0:
            return np.ones(x.shape[0], dtype=bool)
        near = np.hypot(self.mx[:n] - cx, self.my[:n] - cy) < self.reach[:n] + (radius + need)
        seg = self.seg[:n][near]
        if len(seg) == 0:
            return np.ones(x.shape[0], dtype=bool)
        ax, ay, dx, dy, inv, r = seg.T
        px = x[..., None] - ax
        py = y[..., None] - ay
        t = (px * dx + py * dy) * inv
        np.minimum(np.maximum(t, 0.0, out=t), 1.0, out=t)  # cheaper than np.clip on tiny arrays
        px -= t * dx
        py -= t * dy
        lim = r + need
        return ~(px * px + py * py < lim * lim).any(axis=(1, 2))


def _grow_contour(
    rng: np.random.Generator,
    canvas: _Canvas,
    n_paddles: int,
    s: PathfinderSettings,
    scale: float,
    end_discs: bool,
    budget: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Place one contour on ``canvas``; return (paddles (n,2,2), end points (2,2)) or None.

    The contour is a random walk of paddles whose direction turns by at most ``max_turn_deg``
    per paddle. All candidate turns of a paddle are tested at once; when none fits (image
    border, other ink) the walk backs up and takes another candidate of an earlier paddle, for
    at most ``budget`` paddle evaluations. With ``end_discs`` a marker-sized disc is reserved at
    both ends (target contours). On failure the canvas is rolled back.

    Every paddle keeps at least ``clearance`` from the ink of other contours (and of its own
    contour except its neighbours): the test samples the paddle's centre line every
    ``clearance / 4`` or less and adds half that spacing to the required distance, so it is
    exact or conservative, never lenient.
    """
    step = s.step * scale
    half_gap = 0.5 * s.paddle_gap * scale
    half_w = 0.5 * s.paddle_thickness * scale
    radius = s.marker_radius * scale
    clear = s.clearance * scale
    max_turn = math.radians(s.max_turn_deg)
    size = canvas.size
    edge = (radius if end_discs else half_w) + 0.5 * scale
    lo = half_w + 0.5 * scale
    hi = size - lo
    length = step - 2 * half_gap
    n_pts = max(math.ceil(length / (0.25 * clear)) + 1, 2)
    offsets = half_gap + np.linspace(0.0, length, n_pts)  # sample points, distance from joint
    need = half_w + clear + 0.5 * length / (n_pts - 1)
    disc_need = radius + clear
    start_n = canvas.n

    x0, y0 = (float(v) for v in rng.uniform(edge, size - edge, size=2))
    if end_discs:
        if not canvas.clear(np.array([[x0]]), np.array([[y0]]), canvas.n, x0, y0, 0.0, disc_need)[
            0
        ]:
            return None
        canvas.add(x0, y0, x0, y0, radius)
    base_n = canvas.n  # paddle k of this contour is canvas item base_n + k
    joints = [(x0, y0)] + [(0.0, 0.0)] * n_paddles
    headings = [0.0] * n_paddles
    options: list[list[float]] = [[] for _ in range(n_paddles)]
    k = 0
    fresh = True  # whether paddle k's candidates still have to be drawn and tested
    while k < n_paddles:
        px, py = joints[k]
        if fresh:
            fresh = False
            if budget <= 0:
                canvas.n = start_n
                return None
            budget -= 1
            if k == 0:
                turns = rng.uniform(0.0, 2.0 * math.pi, size=_START_DIRECTIONS).tolist()
            else:
                h = headings[k - 1]
                turns = (h + rng.uniform(-max_turn, max_turn, size=_TURN_CANDIDATES)).tolist()
            last_disc = end_discs and k == n_paddles - 1
            inside: list[float] = []
            trig: list[tuple[float, float]] = []
            for t in turns:
                c, sn = math.cos(t), math.sin(t)
                ax, ay = px + half_gap * c, py + half_gap * sn
                bx, by = px + (step - half_gap) * c, py + (step - half_gap) * sn
                if not (lo <= ax <= hi and lo <= ay <= hi and lo <= bx <= hi and lo <= by <= hi):
                    continue
                if last_disc:
                    qx, qy = px + step * c, py + step * sn
                    if not (edge <= qx <= size - edge and edge <= qy <= size - edge):
                        continue
                inside.append(t)
                trig.append((c, sn))
            if inside:
                cs = np.array(trig)[:, :, None]
                xy = cs * offsets  # (candidates, 2, sample points) offsets from the joint
                # Ignore the previous paddle, and the start disc for the first two paddles.
                upto = canvas.n - (2 if end_discs and k == 1 else 1 if end_discs or k else 0)
                ok = canvas.clear(px + xy[:, 0], py + xy[:, 1], upto, px, py, step, need)
                if last_disc and ok.any():
                    q = cs * step
                    ok &= canvas.clear(
                        px + q[:, 0], py + q[:, 1], canvas.n - 1, px, py, step, disc_need
                    )
                options[k] = [t for t, good in zip(inside, ok.tolist()) if good]
        if not options[k]:
            if k == 0:
                canvas.n = start_n
                return None
            k -= 1  # back up: forget paddle k and use its next candidate
            canvas.n = base_n + k
            continue
        t = options[k].pop()
        c, sn = math.cos(t), math.sin(t)
        canvas.add(
            px + half_gap * c,
            py + half_gap * sn,
            px + (step - half_gap) * c,
            py + (step - half_gap) * sn,
            half_w,
        )
        joints[k + 1] = (px + step * c, py + step * sn)
        headings[k] = t
        k += 1
        fresh = True
    if end_discs:
        xe, ye = joints[-1]
        canvas.add(xe, ye, xe, ye, radius)
    paddles = canvas.seg[base_n : base_n + n_paddles, :4].copy()
    paddles[:, 2:] += paddles[:, :2]  # (ax, ay, bx, by)
    return paddles.reshape(n_paddles, 2, 2), np.array([joints[0], joints[-1]])


def _label_order(seed: int, resolution: int, contour_length: int, batch: int, n: int) -> np.ndarray:
    """Labels of the ``n`` samples of one batch directory: an exact 50/50 split, shuffled."""
    rng = np.random.default_rng([seed, resolution, contour_length, 1, batch])
    return rng.permutation((np.arange(n) + int(rng.integers(2))) % 2).astype(np.int64)


def render(
    items: Sequence[tuple[np.ndarray, np.ndarray, float]], resolution: int, supersample: int = 4
) -> np.ndarray:
    """Draw ink items ``(a, b, half_width)`` given in pixel units as a uint8 image.

    An item with ``a != b`` is a paddle: the rectangle of width ``2 * half_width`` along the
    segment ``a``-``b`` (flat ends, so the gaps between paddles stay visible at 32 pixels). An
    item with ``a == b`` is a marker disc of radius ``half_width``. Each pixel's value is the
    fraction of its ``supersample``² sub-pixels covered by ink, scaled to 0-255.
    """
    ss = supersample
    size = resolution * ss
    hi = np.zeros((size, size), dtype=bool)
    for a, b, r in items:
        a = np.asarray(a, dtype=np.float64) * ss
        b = np.asarray(b, dtype=np.float64) * ss
        rr = r * ss
        x0 = max(math.floor(min(a[0], b[0]) - rr), 0)
        x1 = min(math.ceil(max(a[0], b[0]) + rr) + 1, size)
        y0 = max(math.floor(min(a[1], b[1]) - rr), 0)
        y1 = min(math.ceil(max(a[1], b[1]) + rr) + 1, size)
        if x0 >= x1 or y0 >= y1:
            continue
        px = (np.arange(x0, x1) + 0.5)[None, :] - a[0]
        py = (np.arange(y0, y1) + 0.5)[:, None] - a[1]
        ab = b - a
        length = math.hypot(ab[0], ab[1])
        if length == 0.0:
            hi[y0:y1, x0:x1] |= px * px + py * py <= rr * rr
            continue
        ux, uy = ab / length
        along = px * ux + py * uy
        across = np.abs(py * ux - px * uy)
        hi[y0:y1, x0:x1] |= (along >= 0.0) & (along <= length) & (across <= rr)
    cover = hi.reshape(resolution, ss, resolution, ss).sum(axis=(1, 3))
    return ((cover * 255 + (ss * ss) // 2) // (ss * ss)).astype(np.uint8)


def make_sample(
    index: int,
    *,
    resolution: int = 32,
    contour_length: int = 14,
    seed: int = 0,
    label: int | None = None,
    settings: PathfinderSettings | None = None,
) -> PathfinderSample:
    """Generate sample ``index`` deterministically from ``(seed, resolution, contour_length)``.

    ``label`` forces the class (by default it is drawn from the sample's own random stream);
    :func:`generate_pathfinder` passes the balanced per-directory labels. The contours do not
    depend on the label: the positive and the negative version of a sample differ only in
    where the two markers sit.
    """
    s = settings or SETTINGS[resolution]
    if s.resolution != resolution:
        raise ValueError(f"settings are for {s.resolution} px, not {resolution}")
    rng = np.random.default_rng([seed, resolution, contour_length, 0, index])
    coin = int(rng.integers(2))  # drawn even when ``label`` is given: same contours either way
    label = coin if label is None else int(label)
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label}")
    scale = float(_SUPERSAMPLE)
    for _ in range(_IMAGE_TRIES):
        canvas = _Canvas(resolution * scale)
        targets = []
        for _t in range(2):
            for _try in range(_TARGET_TRIES):
                got = _grow_contour(
                    rng, canvas, contour_length, s, scale, True, _TARGET_BUDGET * contour_length
                )
                if got is not None:
                    targets.append(got)
                    break
            else:
                break
        if len(targets) == 2:
            break
    else:  # pragma: no cover - only with settings that cannot fit two contours
        raise RuntimeError(f"could not place two contours of {contour_length} paddles: {s}")

    distractor_len = max(contour_length // 3, 1)
    distractors = []
    for _d in range(max(s.distractor_paddles // distractor_len, 0)):
        for _try in range(_DISTRACTOR_TRIES):
            got = _grow_contour(
                rng, canvas, distractor_len, s, scale, False, _DISTRACTOR_BUDGET * distractor_len
            )
            if got is not None:
                distractors.append(got[0])
                break

    # The same draws for both labels, so the label only decides where the markers go.
    which = int(rng.integers(2))
    if label == 1:
        markers = targets[which][1]
        marker_contours = (which, which)
    else:
        # One end of each contour: the pair whose distance is closest to the end-to-end
        # distance of a contour, so that marker distance does not give the label away (short
        # contours have nearly constant end-to-end distances).
        ref = float(np.linalg.norm(targets[which][1][0] - targets[which][1][1]))
        e0, e1 = targets[0][1], targets[1][1]
        _, i0, i1 = min(
            (abs(float(np.linalg.norm(e0[i] - e1[j])) - ref), i, j) for i in (0, 1) for j in (0, 1)
        )
        markers = np.stack([e0[i0], e1[i1]])
        marker_contours = (0, 1)

    contours = [t[0] / scale for t in targets] + [d / scale for d in distractors]
    markers = markers / scale
    items = [(p[0], p[1], 0.5 * s.paddle_thickness) for c in contours for p in c]
    items += [(m, m, s.marker_radius) for m in markers]
    image = render(items, resolution, _SUPERSAMPLE)
    return PathfinderSample(
        image=image,
        label=int(label),
        contours=contours,
        markers=markers,
        marker_contours=marker_contours,
        settings=s,
        extra={"distractors": len(distractors)},
    )


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class _Job:
    root: str
    resolution: int
    contour_length: int
    seed: int
    batch: int
    start: int  # first sample number within the batch
    stop: int
    per_batch: int
    labels: tuple[int, ...]  # labels of samples start..stop-1


def _run_job(job: _Job) -> tuple[int, list[tuple[int, int, int]]]:
    """Write the PNGs of one job; return (batch, [(sample number, label, distractors)])."""
    out = Path(job.root) / "imgs" / str(job.batch)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, label in zip(range(job.start, job.stop), job.labels):
        sample = make_sample(
            job.batch * job.per_batch + i,
            resolution=job.resolution,
            contour_length=job.contour_length,
            seed=job.seed,
            label=label,
        )
        Image.fromarray(sample.image).save(out / f"sample_{i}.png", format="PNG")
        rows.append((i, sample.label, sample.extra["distractors"]))
    return job.batch, rows


def _default_workers() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # pragma: no cover - not on Linux
        return max(os.cpu_count() or 1, 1)


def _progress(total: int, initial: int, desc: str, enabled: bool):  # type: ignore[no-untyped-def]
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit="img",
        disable=not (enabled and sys.stderr.isatty()),
        leave=False,
    )


def generate_pathfinder(
    root: str | os.PathLike[str],
    *,
    resolution: int = 32,
    contour_length: int = 14,
    num_samples: int = 200_000,
    seed: int = 0,
    workers: int | None = None,
    images_per_batch_dir: int = 1000,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Generate a Pathfinder difficulty in LRA's layout and return its directory.

    Writes ``num_samples`` images to ``<root>/pathfinder{resolution}/curv_contour_length_{L}/``
    (``imgs/<batch>/sample_<i>.png`` plus one ``metadata/<batch>.npy`` text file per batch of
    ``images_per_batch_dir`` images, label in field 3). ``resolution`` is 32, 64, 128 or 256 and
    ``contour_length`` the paddles per target contour (LRA: 6, 9, 14; the release's size is 200k
    images per difficulty). Output depends only on the arguments, not on ``workers`` (processes;
    default: all available CPUs).

    A finished directory with the same parameters is returned as is. An interrupted run is
    resumed batch by batch. A directory holding other data (for example the downloaded release)
    is left alone unless ``overwrite`` is set.
    """
    if resolution not in SETTINGS:
        raise ValueError(f"resolution must be one of {sorted(SETTINGS)}, got {resolution}")
    if contour_length < 1 or num_samples < 1 or images_per_batch_dir < 1:
        raise ValueError("contour_length, num_samples and images_per_batch_dir must be positive")
    workers = _default_workers() if workers is None else max(int(workers), 1)
    out = Path(root).expanduser().absolute() / f"pathfinder{resolution}"
    out = out / f"curv_contour_length_{contour_length}"
    params = {
        "generator": "megalab.pathfinder_gen",
        "version": _GENERATOR_VERSION,
        "resolution": resolution,
        "contour_length": contour_length,
        "num_samples": num_samples,
        "seed": seed,
        "images_per_batch_dir": images_per_batch_dir,
        "settings": asdict(SETTINGS[resolution]),
    }
    params_file = out / ".generator.json"
    if prepared(out) and _read_json(out / ".complete") == params:
        return out
    stored = _read_json(params_file)
    has_data = (out / "metadata").exists() or (out / "imgs").exists()
    if has_data and stored != params:
        if stored is None and not overwrite:
            raise FileExistsError(
                f"{out} already holds Pathfinder data that this generator did not write (the "
                f"downloaded release?). Choose another root, or pass overwrite=True to replace it."
            )
        # Our own output made with other parameters (or overwrite requested): start afresh.
        for sub in ("imgs", "metadata"):
            shutil.rmtree(out / sub, ignore_errors=True)
    (out / ".complete").unlink(missing_ok=True)
    (out / "metadata").mkdir(parents=True, exist_ok=True)
    (out / "imgs").mkdir(parents=True, exist_ok=True)
    params_file.write_text(json.dumps(params, sort_keys=True, indent=2) + "\n")

    n_batches = -(-num_samples // images_per_batch_dir)
    todo = [b for b in range(n_batches) if not (out / "metadata" / f"{b}.npy").exists()]
    done_count = sum(_batch_size(b, num_samples, images_per_batch_dir) for b in range(n_batches))
    done_count -= sum(_batch_size(b, num_samples, images_per_batch_dir) for b in todo)
    chunk = max(1, min(images_per_batch_dir, 50))
    jobs = list(
        _jobs(out, todo, num_samples, images_per_batch_dir, resolution, contour_length, seed, chunk)
    )

    pending_rows: dict[int, list[tuple[int, int, int]]] = {b: [] for b in todo}
    bar = _progress(num_samples, done_count, f"pathfinder{resolution} L={contour_length}", progress)

    def finish(batch: int, rows: list[tuple[int, int, int]]) -> None:
        pending_rows[batch].extend(rows)
        bar.update(len(rows))
        if len(pending_rows[batch]) == _batch_size(batch, num_samples, images_per_batch_dir):
            _write_metadata(out, batch, sorted(pending_rows.pop(batch)), contour_length, resolution)

    try:
        if workers == 1 or len(jobs) <= 1:
            for job in jobs:
                finish(*_run_job(job))
        else:
            ctx = multiprocessing.get_context(_START_METHOD)
            with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
                # Keep a bounded number of jobs in flight so progress and memory stay smooth.
                it = iter(jobs)
                running = {pool.submit(_run_job, j) for j in _take(it, 2 * workers)}
                while running:
                    finished, running = wait(running, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        finish(*fut.result())
                        running |= {pool.submit(_run_job, j) for j in _take(it, 1)}
    finally:
        bar.close()
    # A generated dataset (200K images), not a cache: its marker records the parameters only.
    mark_prepared(out, params, checksums=False)
    return out


def _take(it: Iterator[_Job], n: int) -> list[_Job]:
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def _batch_size(batch: int, num_samples: int, per_batch: int) -> int:
    return min(per_batch, num_samples - batch * per_batch)


def _jobs(
    out: Path,
    batches: Sequence[int],
    num_samples: int,
    per_batch: int,
    resolution: int,
    contour_length: int,
    seed: int,
    chunk: int,
) -> Iterator[_Job]:
    for b in batches:
        n = _batch_size(b, num_samples, per_batch)
        labels = _label_order(seed, resolution, contour_length, b, n)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            yield _Job(
                str(out),
                resolution,
                contour_length,
                seed,
                b,
                start,
                stop,
                per_batch,
                tuple(int(x) for x in labels[start:stop]),
            )


def _write_metadata(
    out: Path, batch: int, rows: list[tuple[int, int, int]], contour_length: int, resolution: int
) -> None:
    lines = [
        f"imgs/{batch} sample_{i}.png {i} {label} {contour_length} {n_distr} {resolution}\n"
        for i, label, n_distr in rows
    ]
    path = out / "metadata" / f"{batch}.npy"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
