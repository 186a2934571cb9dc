"""Where LRA's data comes from: the official release archive and two Hugging Face Hub datasets.

ListOps, Retrieval (AAN), Pathfinder and Path-X come from the LRA release, one 7.7 GB tarball
(``lra_release.gz``, linked from https://github.com/google-research/long-range-arena);
Text (IMDB) and Image (CIFAR-10) come from the Hub. :func:`prepare_release` downloads the
archive (resumable, see :mod:`megalab.data.download`), extracts only the members a task needs
and moves them into the layout below ``paths.data_dir`` that the data configs read::

    lra/listops/basic_{train,val,test}.tsv                     <- listops-1000/
    lra/aan/new_aan_pairs.{train,eval,test}.tsv                <- tsv_data/
    lra/pathfinder/pathfinder32/curv_contour_length_14/        <- the same path in the archive
    lra/pathfinder/pathfinder128/curv_contour_length_14/       <- the same path in the archive
    lra/imdb/plain_text/{train,test}-00000-of-00001.parquet    <- Hub stanfordnlp/imdb
    lra/cifar10/plain_text/{train,test}-00000-of-00001.parquet <- Hub uoft-cs/cifar10

The Pathfinder folders are the release's own (``metadata/*.npy`` + ``imgs/``), which is also
what our generator (:mod:`megalab.data.lra.pathfinder_gen`) writes, so one reader handles both.

There is no published checksum of ``lra_release.gz``, so none is enforced (pass ``sha256`` if
you have one): the download is checked to be a tar archive, and after extraction every task's
expected files must be present. The archive's members sit below ``lra_release/`` and, in the
copies most tools describe, below a nested ``lra_release/lra_release/``; both are searched.

The Hub datasets are stored as the Hub stores them (parquet shards under ``plain_text/``, with
the Hub's column names and types); a ``save_to_disk`` folder works too. They are fetched and read
by :mod:`megalab.data.hub` (see :func:`hub_dataset`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from megalab.data.archives import extract
from megalab.data.download import download
from megalab.data.hub import HubDataset
from megalab.utils.errors import UserError

log = logging.getLogger(__name__)

__all__ = [
    "RELEASE_PAGE",
    "RELEASE_TASKS",
    "RELEASE_URL",
    "LRAFormatError",
    "prepare_release",
]

RELEASE_URL = "https://storage.googleapis.com/long-range-arena/lra_release.gz"
RELEASE_PAGE = "https://github.com/google-research/long-range-arena"
ARCHIVE_NAME = "lra_release.gz"
# The release's SHA-256 and size: neither the LRA repository nor the paper publishes them, and
# they cannot be measured without fetching the archive (several GB from Google Cloud Storage),
# which this code was written without. So none is enforced: the transfer is checked against
# the length the server states (GET, else HEAD; `download` refuses a transfer of unknown
# length), the file must be a tar archive, and every task's files must be in it. Pass
# `sha256=` (`megalab-data lra --sha256`) to pin the copy you trust.
RELEASE_SHA256: str | None = None
# Where the release's folders may sit inside the archive, most likely first.
_PREFIXES = ("lra_release/lra_release/", "lra_release/", "")


class LRAFormatError(UserError, ValueError):
    """LRA data on disk that does not follow the official format; the message names the file."""


def binary_label(field: str | bytes, where: str, number: type[int] | type[float] = int) -> int:
    """A label field of the release that must be 0 or 1, read as `number` (Pathfinder writes
    integers, AAN floats); errors are `LRAFormatError`s that name `where` (file:line)."""
    try:
        value = number(field)
    except ValueError:
        kind = "an integer" if number is int else "a number"
        raise LRAFormatError(f"{where}: label {field[:20]!r} is not {kind}") from None
    if value not in (0, 1):
        raise LRAFormatError(f"{where}: label {value:g} is not 0 or 1")
    return int(value)


def hub_dataset(
    name: str, repo: str, data_dir: str | Path, columns: tuple[str, str], command: str
) -> HubDataset:
    """An LRA task's Hub dataset: its train and test splits (``columns``: input, label) as the Hub
    stores them under ``<data_dir>/plain_text/``; `command` is the `megalab-data` subcommand that
    fetches it."""
    return HubDataset(
        name=name,
        repo=repo,
        local_dir=Path(data_dir),
        columns=columns,
        splits=("train", "test"),
        fetch_dir="plain_text",
        command=f"megalab-data {command} --out {data_dir}",
        format_error=LRAFormatError,
    )


@dataclass(frozen=True)
class ReleasePart:
    """One folder of the release: where it is in the archive and where it goes below ``lra/``."""

    member: str
    target: str
    required: tuple[str, ...]


#: What each task takes from the archive.
RELEASE_PARTS: dict[str, tuple[ReleasePart, ...]] = {
    "listops": (
        ReleasePart(
            "listops-1000", "listops", ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv")
        ),
    ),
    "retrieval": (
        ReleasePart(
            "tsv_data",
            "aan",
            ("new_aan_pairs.train.tsv", "new_aan_pairs.eval.tsv", "new_aan_pairs.test.tsv"),
        ),
    ),
    "pathfinder": (
        ReleasePart(
            "pathfinder32/curv_contour_length_14",
            "pathfinder/pathfinder32/curv_contour_length_14",
            ("metadata", "imgs"),
        ),
    ),
    "pathx": (
        ReleasePart(
            "pathfinder128/curv_contour_length_14",
            "pathfinder/pathfinder128/curv_contour_length_14",
            ("metadata", "imgs"),
        ),
    ),
}
RELEASE_TASKS = tuple(RELEASE_PARTS)


def _tasks(tasks: Iterable[str]) -> list[str]:
    out: list[str] = []
    for t in tasks:
        if t == "all":
            out += [x for x in RELEASE_TASKS if x not in out]
        elif t in RELEASE_PARTS:
            if t not in out:
                out.append(t)
        else:
            choices = ", ".join((*RELEASE_TASKS, "all"))
            raise ValueError(f"unknown LRA release task {t!r}; choose from {choices}")
    return out


_MARKER = ".lra_release"  # written into every folder this module put in place


def _complete(target: Path, part: ReleasePart) -> bool:
    if not all((target / r).exists() for r in part.required):
        return False
    meta = target / "metadata"
    return not meta.is_dir() or any(meta.glob("*.npy"))


def prepare_release(
    root: str | os.PathLike[str],
    tasks: Iterable[str] = ("all",),
    *,
    url: str = RELEASE_URL,
    archive: str | os.PathLike[str] | None = None,
    sha256: str | None = RELEASE_SHA256,
    keep_archive: bool = True,
    progress: bool = True,
) -> dict[str, Path]:
    """Download the LRA release and put the folders of ``tasks`` into ``<root>/lra/...``.

    ``root`` is the data root (``paths.data_dir``). ``tasks`` are ``listops``, ``retrieval``,
    ``pathfinder`` (32x32), ``pathx`` (128x128) or ``all``. ``archive`` uses a copy of
    ``lra_release.gz`` already on disk instead of downloading ``url``. Tasks whose folders are
    already extracted here are skipped; any other folder in the way (generated ListOps or
    Pathfinder data, a copy placed by hand) is replaced by the release's. Returns
    ``{task: folder}``.
    """
    root = Path(root).expanduser().absolute()
    lra = root / "lra"
    wanted = _tasks(tasks)
    todo = [
        (task, part)
        for task in wanted
        for part in RELEASE_PARTS[task]
        if not ((lra / part.target / _MARKER).is_file() and _complete(lra / part.target, part))
    ]
    result = {task: lra / RELEASE_PARTS[task][0].target for task in wanted}
    if not todo:
        log.info("LRA release folders already in place under %s", lra)
        return result

    lra.mkdir(parents=True, exist_ok=True)
    if archive is not None:
        path = Path(archive).expanduser().absolute()
        if not path.exists():
            raise FileNotFoundError(f"LRA archive not found: {path}")
    else:
        path = download(
            url,
            lra / ARCHIVE_NAME,
            sha256=sha256,
            progress=progress,
            dataset="LRA release (lra_release.gz)",
        )
    if not tarfile.is_tarfile(path):
        raise LRAFormatError(
            f"{path} is not a tar archive; the LRA release is a gzip-compressed tarball. Delete "
            f"it and download it again from {url}"
        )

    staging = lra / ".release-extract"
    members = [prefix + part.member for _, part in todo for prefix in _PREFIXES]
    log.info("extracting %s from %s (reads the whole archive)", ", ".join(t for t, _ in todo), path)
    extract(path, staging, members=members)
    try:
        for task, part in todo:
            found = [staging / (p + part.member) for p in _PREFIXES]
            source = next((f for f in found if f.exists()), None)
            if source is None:
                raise LRAFormatError(
                    f"{path} has no folder {part.member!r} (searched below "
                    f"{', '.join(repr(p or '/') for p in _PREFIXES)}); is it the LRA release "
                    f"archive from {url}?"
                )
            target = lra / part.target
            if target.exists():
                log.info("replacing %s with the release's %s", target, part.member)
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)
            if not _complete(target, part):
                missing = [r for r in part.required if not (target / r).exists()]
                raise LRAFormatError(
                    f"the release's {part.member!r} for {task} lacks {missing or 'metadata/*.npy'}"
                    f" (now in {target}); the archive may be damaged: delete {path} and retry"
                )
            (target / _MARKER).write_text(f"{path.name}: {part.member}\n")
            log.info("%s: %s", task, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not keep_archive and archive is None:
        path.unlink(missing_ok=True)
    return result


def release_how(task: str, data_root: Path | None = None) -> str:
    """The instructions to fetch one task's release folder (for missing-data messages)."""
    root = str(data_root) if data_root is not None else "<paths.data_dir>"
    part = RELEASE_PARTS[task][0]
    return (
        f"Download and extract the LRA release with\n"
        f"  megalab-data lra --task {task} --root {root}\n"
        f"(fetches {RELEASE_URL}, 7.7 GB, and moves its {part.member} folder to "
        f"{root}/lra/{part.target}),\nor extract it yourself and move the folder there."
    )


def data_root_of(data_dir: Path, depth: int) -> Path | None:
    """The data root when ``data_dir`` follows the standard layout ``<root>/lra/...``."""
    parents = data_dir.expanduser().absolute().parents
    if len(parents) > depth and parents[depth - 1].name == "lra":
        return parents[depth]
    return None
