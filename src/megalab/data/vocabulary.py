"""The vocabulary a run trained with, kept in its folder: the files that turn text into its ids.

A language model (or a translation model) holds one embedding row per token id, and the ids are
its data's: a tokenizer trained on the training split (PG-19, a corpus of one's own), a word list
(WikiText-103) or a dictionary with its BPE codes (WMT'16); each data module names these files
(`tokenizer_files()`). Training copies them into `<run>/vocabulary/`. Then

- `megalab-eval`, `megalab-generate` and the long-context evaluation give a data config that
  trains its tokenizer the run's copy instead (`data.tokenizer`), so data that changed since,
  moved, or is another corpus is read with the ids the model learned;
- they refuse data whose vocabulary still differs from the run's (a word list built from other
  files): scored with another vocabulary's ids, the numbers are meaningless however plausible
  they look; so does a resumed run whose data now gives another vocabulary;
- `megalab-export` ships the run's copy, which needs no data on the machine.

Runs written before this have no copy, and are read as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from megalab.utils.errors import UserError

__all__ = [
    "VOCABULARY",
    "SaveVocabulary",
    "VocabularyMismatchError",
    "check_vocabulary",
    "run_tokenizer",
    "run_vocabulary",
    "save_vocabulary",
]

log = logging.getLogger(__name__)

#: The folder of a run that holds its vocabulary's files.
VOCABULARY = "vocabulary"


class VocabularyMismatchError(UserError, ValueError):
    """The data's vocabulary is not the one the run trained with; the message says what to do."""


def run_vocabulary(run_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """The run's copy of its vocabulary (name -> file), empty for a run without one."""
    folder = Path(run_dir) / VOCABULARY
    if not folder.is_dir():
        return {}
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}


def run_tokenizer(run_dir: str | os.PathLike[str]) -> Path | None:
    """The run's trained tokenizer (`tokenizer.json`), which data configs with a `tokenizer`
    option read instead of training one."""
    return run_vocabulary(run_dir).get("tokenizer.json")


def _differing(ours: Mapping[str, Path], theirs: Mapping[str, Path]) -> list[str]:
    """The names whose files differ between two vocabularies (or are in one only)."""
    names = sorted(set(ours) | set(theirs))
    return [
        n
        for n in names
        if n not in ours or n not in theirs or _digest(ours[n]) != _digest(theirs[n])
    ]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fix(run_dir: Path, kept: Mapping[str, Path]) -> str:
    if "tokenizer.json" in kept:
        return f"read the data with the run's tokenizer: data.tokenizer={kept['tokenizer.json']}"
    return (
        "prepare the data as the run did: the same files and settings (the run's config.yaml "
        f"lists them; its vocabulary is in {run_dir / VOCABULARY})"
    )


def save_vocabulary(datamodule: Any, run_dir: str | os.PathLike[str]) -> None:
    """Copy the data's vocabulary files into `<run_dir>/vocabulary/`; a run that has a copy
    (resumed) keeps it, and its data must give the same files."""
    run_dir = Path(run_dir)
    files: dict[str, Path] = dict(datamodule.tokenizer_files())
    if not files:
        return
    kept = run_vocabulary(run_dir)
    if kept:
        differ = _differing(files, kept)
        if differ:
            raise VocabularyMismatchError(
                f"the data's vocabulary ({', '.join(str(files.get(n, n)) for n in differ)}) is "
                f"not the one this run started with ({run_dir / VOCABULARY}): resuming would "
                f"train the model's embeddings on other token ids. To fix it, {_fix(run_dir, kept)}"
            )
        return
    folder = run_dir / VOCABULARY
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=run_dir, prefix=f".{VOCABULARY}."))
    try:
        for name, path in files.items():
            shutil.copyfile(path, staging / name)
        os.replace(staging, folder)  # whole or absent
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_vocabulary(datamodule: Any, run_dir: str | os.PathLike[str], command: str) -> None:
    """Raise `VocabularyMismatchError` when the data's vocabulary is not the run's copy (nothing
    to check for a run without one). Data whose vocabulary is a product of its preparation (a
    word list) is prepared first; a given tokenizer file needs none (generation reads no
    more than the tokenizer)."""
    run_dir = Path(run_dir)
    kept = run_vocabulary(run_dir)
    if not kept:
        return
    files: dict[str, Path] = dict(datamodule.tokenizer_files())
    if not all(path.is_file() for path in files.values()):
        datamodule.prepare_data()
        files = dict(datamodule.tokenizer_files())
    differ = _differing(files, kept)
    if differ:
        given = ", ".join(str(files.get(n, f"no {n}")) for n in differ)
        raise VocabularyMismatchError(
            f"{command}: the data's vocabulary ({given}) is not the one {run_dir} trained with "
            f"({run_dir / VOCABULARY}): the model would read token ids it did not learn, and "
            f"its numbers would mean nothing. To fix it, {_fix(run_dir, kept)}"
        )


def warn_of_other_weights_vocabulary(
    datamodule: Any, source: str, vocabulary: Mapping[str, Path]
) -> None:
    """Warn when the weights a run starts from (`init_from`) were trained with another
    vocabulary than the run's data gives: their token embeddings and output layer read other
    ids (unless `init_skip` keeps those fresh)."""
    files: dict[str, Path] = dict(datamodule.tokenizer_files())
    if not vocabulary or not files or not _differing(files, vocabulary):
        return
    fix = (
        f"give data.tokenizer={vocabulary['tokenizer.json']} to read the data with theirs"
        if "tokenizer.json" in vocabulary
        else "prepare the data as their run did"
    )
    log.warning(
        "init_from=%s was trained with another vocabulary than this data's: its token "
        "embeddings and output layer read other ids. To fine-tune them, %s (or keep them "
        "fresh with init_skip, and this does not apply)",
        source,
        fix,
    )


class SaveVocabulary(Callback):
    """Saves the data's vocabulary into the run folder once the data is prepared (rank zero;
    before the first step), or checks a resumed run's data against its copy; warns when the
    weights the run starts from (`source`, with its `vocabulary`) read other ids."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        source: str | None = None,
        vocabulary: Mapping[str, Path] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.source, self.vocabulary = source, dict(vocabulary or {})

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if stage == "fit" and trainer.is_global_zero and datamodule is not None:
            save_vocabulary(datamodule, self.run_dir)
            if self.source is not None:
                warn_of_other_weights_vocabulary(datamodule, self.source, self.vocabulary)
