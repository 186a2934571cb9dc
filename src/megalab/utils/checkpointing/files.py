"""Checkpoint files that survive interruptions: atomic writes, a SHA-256 in every file, verified
reads, and `AtomicCheckpointIO`, which puts both under every checkpoint Lightning writes or reads.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import struct
from pathlib import Path
from typing import IO, Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from megalab.utils.errors import UserError

log = logging.getLogger(__name__)

_EOCD = b"PK\x05\x06"  # zip end-of-central-directory signature
_EOCD_SIZE = 22
_TAG = b"megalab-sha256:"
_COMMENT_SIZE = len(_TAG) + 64
_CHUNK = 1 << 20
TEMP_SUFFIX = ".tmp"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used: corrupt, truncated, not a checkpoint, or not writable."""


class _HashingWriter:
    """A write-only file object that hashes what passes through and keeps the last bytes."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha, self.size, self.tail = f, hashlib.sha256(), 0, b""
        self.error: OSError | None = None  # torch re-raises write errors as RuntimeError

    def write(self, data: Any) -> int:
        data = bytes(data)
        try:
            self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise
        self.sha.update(data)
        self.size += len(data)
        self.tail = (self.tail + data[-_EOCD_SIZE:])[-_EOCD_SIZE:]
        return len(data)

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temporary_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (same folder, hidden)."""
    return path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")


def remove_stale_temporaries(folder: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files a killed save left in `folder`; return them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.glob(f".*.ckpt.*{TEMP_SUFFIX}") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
        log.info("removed %s, left by an interrupted checkpoint save", p)
    return stale


def write_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """`torch.save` to `path` atomically, with the file's SHA-256 in its archive comment."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    writer: _HashingWriter | None = None
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(checkpoint, writer)  # type: ignore[arg-type]
            if writer.tail[:4] != _EOCD or writer.tail[-2:] != b"\0\0":
                raise CheckpointError(f"torch.save wrote no zip archive to {tmp}")
            # The comment length (the last two bytes) becomes the tag's, then the tag follows.
            comment = _TAG + writer.sha.hexdigest().encode()
            f.seek(writer.size - 2)
            f.write(struct.pack("<H", len(comment)) + comment)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        cause = writer.error if writer is not None and writer.error is not None else err
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            kept = f"; the previous {path.name} is kept" if path.exists() else ""
            raise CheckpointError(
                f"cannot write the checkpoint {path}: {os.strerror(cause.errno)}{kept}. Free "
                "space in that folder (or point paths.output_dir elsewhere) and resume"
            ) from None
        raise
    _fsync_dir(path.parent)


def stored_digest(path: str | os.PathLike[str]) -> str | None:
    """The SHA-256 recorded in a checkpoint written by `write_checkpoint` (None: none recorded)."""
    path = Path(path)
    size = path.stat().st_size
    if size < _EOCD_SIZE + _COMMENT_SIZE:
        return None
    with open(path, "rb") as f:
        f.seek(size - _EOCD_SIZE - _COMMENT_SIZE)
        tail = f.read()
    eocd, comment = tail[:_EOCD_SIZE], tail[_EOCD_SIZE:]
    if eocd[:4] != _EOCD or not comment.startswith(_TAG):
        return None
    if struct.unpack("<H", eocd[-2:])[0] != _COMMENT_SIZE:
        return None
    return comment[len(_TAG) :].decode("ascii", "replace")


def content_digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a checkpoint's bytes as `torch.save` wrote them (without the comment)."""
    path = Path(path)
    size = path.stat().st_size
    body = size - _COMMENT_SIZE - 2
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        left = body
        while left > 0:
            block = f.read(min(_CHUNK, left))
            if not block:
                break
            sha.update(block)
            left -= len(block)
    sha.update(b"\0\0")
    return sha.hexdigest()


def other_checkpoints(path: str | os.PathLike[str]) -> list[Path]:
    """The other checkpoints in the folder of `path` that pass their checksum, newest first."""
    path = Path(path)
    found = []
    for candidate in sorted(path.parent.glob("*.ckpt"), key=lambda p: -p.stat().st_mtime):
        if candidate.resolve() == path.resolve():
            continue
        with contextlib.suppress(OSError, CheckpointError):
            verify_checkpoint(candidate)
            found.append(candidate)
    return found


def _alternatives(path: Path) -> str:
    others = other_checkpoints(path)
    if not others:
        return (
            " No other checkpoint in that folder passes its checksum: the run has to start "
            "again (ckpt_path=null in a new folder)."
        )
    listed = "\n".join(f"  ckpt_path={p}" for p in others)
    return f" Resume from another checkpoint of the run instead:\n{listed}"


def verify_checkpoint(path: str | os.PathLike[str], allow_unverified: bool = False) -> bool:
    """Check a checkpoint's recorded SHA-256; True if verified.

    Raises `CheckpointError` for an empty file, a checksum mismatch, or a checksum that cannot
    be read (the file's end is damaged, or another program wrote it): a damaged tag must not
    turn verification off. With `allow_unverified` (the user's `ckpt_verify=false`) such a
    file is let through unverified (False).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"the checkpoint {path} is empty (0 bytes): it was never written")
    want = stored_digest(path)
    if want is None:
        if allow_unverified:
            return False
        raise CheckpointError(
            f"the checkpoint {path} has no readable checksum: the SHA-256 megalab records at the "
            "end of each checkpoint is missing or damaged (or another program wrote the file), "
            "so its content cannot be verified and it is not loaded. Only if you trust this "
            "file (one written by plain Lightning, say) load it unverified with ckpt_verify=false"
        )
    got = content_digest(path)
    if got != want:
        raise CheckpointError(
            f"the checkpoint {path} is corrupt: its content does not match the SHA-256 recorded "
            f"when it was written (expected {want[:16]}..., got {got[:16]}...)"
        )
    return True


def read_checkpoint(
    path: str | os.PathLike[str],
    map_location: Any = "cpu",
    offer_alternatives: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Verify and load a checkpoint with `torch.load(weights_only=True)`.

    Errors name the file and, with `offer_alternatives`, the run's other valid checkpoints.
    `verify=False` loads a file whose checksum cannot be read (never one that mismatches).
    """
    path = Path(path)
    try:
        verified = verify_checkpoint(path, allow_unverified=not verify)
        try:
            checkpoint = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as err:  # torch reports truncation and garbage in many ways
            kind = "truncated or corrupt" if verified is False else "unreadable"
            raise CheckpointError(
                f"the checkpoint {path} is {kind}: torch.load failed with "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            ) from None
        if not isinstance(checkpoint, dict):
            raise CheckpointError(
                f"{path} is not a checkpoint of a run (it holds a {type(checkpoint).__name__})"
            )
    except CheckpointError as err:
        if not offer_alternatives or not path.is_file():
            raise
        raise CheckpointError(f"{err}.{_alternatives(path)}") from None
    if not verified:
        log.warning("%s records no readable checksum: loaded unverified (ckpt_verify=false)", path)
    return checkpoint


# What Lightning reads from every checkpoint it resumes or tests (a dict without them fails
# deep inside Lightning with a KeyError).
LIGHTNING_KEYS = ("pytorch-lightning_version", "state_dict")


def check_lightning_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Raise `CheckpointError` naming `path` when `checkpoint` is not a Lightning run's."""
    missing = [k for k in LIGHTNING_KEYS if k not in checkpoint]
    if not missing:
        return
    held = ", ".join(repr(k) for k in list(checkpoint)[:5]) or "nothing"
    more = " ..." if len(checkpoint) > 5 else ""
    raise CheckpointError(
        f"{path} is not a checkpoint of a megalab run: it has no {' or '.join(map(repr, missing))} "
        f"(it holds {held}{more}). Pass a checkpoint a run wrote (<run>/checkpoints/last.ckpt "
        "or best-*.ckpt); an authors' checkpoint is converted first "
        "(megalab.models.<model>.convert)."
        f"{_alternatives(Path(path))}"
    )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with atomic, checksummed writes and verified safe reads.

    `verify=False` (the entry points' `ckpt_verify=false`) loads a checkpoint whose checksum
    cannot be read; one whose checksum does not match is refused all the same.
    """

    def __init__(self, verify: bool = True) -> None:
        super().__init__()
        self.verify = verify

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        write_checkpoint(checkpoint, path)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # weights_only is always True: a checkpoint is data and never runs code when loaded.
        location = map_location if map_location is not None else "cpu"
        checkpoint = read_checkpoint(path, location, verify=self.verify)
        check_lightning_checkpoint(checkpoint, path)
        return checkpoint


def set_verification(trainer: L.Trainer, verify: bool) -> None:
    """Apply the entry point's `ckpt_verify` to the trainer's checkpoint IO."""
    io = getattr(trainer.strategy, "checkpoint_io", None)
    if isinstance(io, AtomicCheckpointIO):
        io.verify = bool(verify)
    if not verify:
        log.warning(
            "ckpt_verify=false: a checkpoint without a readable checksum is loaded unverified"
        )
