"""Checkpoints that survive interruptions: verified atomic files, `last.ckpt` on its own schedule.

- `write_checkpoint` streams `torch.save` into a temporary file in the destination folder,
  fsyncs it, and renames it over the old file (then fsyncs the folder): a reader sees the
  previous complete file or the new complete file, never a partial one, whatever `$TMPDIR` is.
  A failed write (full disk, a kill) leaves the previous checkpoint and removes the temporary
  file (a kill leaves it for `remove_stale_temporaries`, called when a run starts).
- Each file carries the SHA-256 of its bytes in the zip archive comment (a `torch.save` file is a
  zip archive; the comment is its last bytes, which `torch.load` ignores), so a copied file stays
  verifiable on its own. `read_checkpoint` checks it before `torch.load(weights_only=True)`;
  a corrupt, truncated or foreign file fails with `CheckpointError` naming the file and the
  other checkpoints of the folder to resume from instead.
- `AtomicCheckpointIO` plugs both into Lightning (`trainer.plugins`), so every checkpoint a run
  writes or reads (best, last, evaluation) goes through them.
- `LastCheckpoint` writes `last.ckpt` every N steps and/or every M minutes, at the end of
  training, and when the run is interrupted (SIGINT, SIGTERM, and the requeue signal of a SLURM
  job with auto-requeue), independently of the best checkpoint. It saves only at points a
  resumed run continues exactly from: after the optimizer step, after the step's validation
  when one is due, before the epoch's end. It also keeps what Lightning does not save: the
  epoch-level accumulations of the training metrics, so a resumed epoch logs the same values.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import signal
import struct
import subprocess
import time
from pathlib import Path
from typing import IO, Any, cast

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

log = logging.getLogger(__name__)

_EOCD = b"PK\x05\x06"  # zip end-of-central-directory signature
_EOCD_SIZE = 22
_TAG = b"megalab-sha256:"
_COMMENT_SIZE = len(_TAG) + 64
_CHUNK = 1 << 20
TEMP_SUFFIX = ".tmp"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: corrupt, truncated, not a checkpoint, or not writable."""


class RunInterrupted(BaseException):
    """Training stopped on a signal after saving `last.ckpt`; `code` is the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message, self.code = message, code


# -- atomic, verified files -----------------------------------------------------------------------
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
        "or best-*.ckpt); an authors' checkpoint is converted first (megalab.convert)."
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


# -- what Lightning does not save: epoch accumulations of logged training values ----------------
_REDUCTIONS = {torch.mean: "mean", torch.max: "max", torch.min: "min", torch.sum: "sum"}


def snapshot_train_results(trainer: L.Trainer) -> list[dict[str, Any]]:
    """The training epoch's logged values being accumulated (Lightning keeps them in memory)."""
    results = trainer.fit_loop.epoch_loop._results
    out = []
    for key, metric in results.items():
        meta = metric.meta
        if not meta.on_epoch:
            continue
        entry: dict[str, Any] = {
            "key": key,
            "fx": meta.fx,
            "name": meta.name,
            "prog_bar": meta.prog_bar,
            "logger": meta.logger,
            "on_step": meta.on_step,
            "on_epoch": meta.on_epoch,
            "reduce_fx": _REDUCTIONS.get(meta.reduce_fx, "mean"),
            "enable_graph": meta.enable_graph,
            "add_dataloader_idx": meta.add_dataloader_idx,
            "metric_attribute": meta.metric_attribute,
            "sync_dist": bool(meta.sync.should),
            "rank_zero_only": bool(meta.sync.rank_zero_only),
            "is_tensor": bool(metric.is_tensor),
        }
        if metric.is_tensor:
            entry["value"] = metric.value.detach().clone().cpu()
            if meta.is_mean_reduction:
                entry["cumulated_batch_size"] = metric.cumulated_batch_size.detach().clone().cpu()
        out.append(entry)
    return out


def restore_train_results(trainer: L.Trainer, saved: list[dict[str, Any]]) -> None:
    """Re-register the saved accumulations, so the epoch-level values cover the whole epoch."""
    results = trainer.fit_loop.epoch_loop._results
    module = trainer.lightning_module
    attributes = dict(module.named_modules())
    if saved:
        # Lightning zeroes the plain-tensor accumulations of each hook at the first value that
        # hook logs in an epoch (`_first_loop_iter` True, `LightningModule.log`): a resumed epoch
        # looks like a new one, so the values restored here would be dropped (the torchmetrics
        # objects are spared, which is why classification kept its epoch metrics). Marking the
        # first batch as already under way keeps them; a new epoch resets as before.
        trainer._logger_connector._first_loop_iter = True
    for entry in saved:
        if entry["key"] in results:
            continue
        if entry["is_tensor"]:
            value: Any = entry["value"].to(module.device)
        else:
            value = attributes.get(entry["metric_attribute"] or "")
            if value is None:
                continue
        results.log(
            entry["fx"],
            entry["name"],
            value,
            prog_bar=entry["prog_bar"],
            logger=entry["logger"],
            on_step=entry["on_step"],
            on_epoch=entry["on_epoch"],
            reduce_fx=entry["reduce_fx"],
            enable_graph=entry["enable_graph"],
            sync_dist=entry["sync_dist"],
            sync_dist_fn=trainer.strategy.reduce,
            add_dataloader_idx=entry["add_dataloader_idx"],
            batch_size=1,
            metric_attribute=entry["metric_attribute"],
            rank_zero_only=entry["rank_zero_only"],
        )
        metric = results[entry["key"]]
        metric._forward_cache = None  # nothing of this was logged in the current step
        if entry["is_tensor"]:
            metric.value = entry["value"].to(metric.value.device, metric.value.dtype)
            if "cumulated_batch_size" in entry:
                metric.cumulated_batch_size = entry["cumulated_batch_size"].to(
                    metric.cumulated_batch_size.device
                )


# -- signals -----------------------------------------------------------------------------------
def _requeue_slurm_job() -> None:
    """Requeue this SLURM job (as Lightning's auto-requeue does)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job_id = os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job_id):
        raise ValueError(f"unexpected SLURM job id {job_id!r}")
    result = subprocess.call(["scontrol", "requeue", job_id])
    if result == 0:
        log.info("requeued SLURM job %s", job_id)
    else:
        log.warning("requeueing SLURM job %s failed (scontrol exit status %d)", job_id, result)


def _any_rank(trainer: L.Trainer, flags: list[bool]) -> list[bool]:
    """Element-wise OR of `flags` over all processes (one small all-reduce when distributed)."""
    if trainer.world_size <= 1 or not torch.distributed.is_initialized():
        return flags
    device = trainer.strategy.root_device
    if torch.distributed.get_backend() == "gloo":
        device = torch.device("cpu")
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


# -- last.ckpt ------------------------------------------------------------------------------------
class LastCheckpoint(Checkpoint):
    """Write `<dirpath>/last.ckpt` on a schedule, at the end of training and on interruption.

    `every_n_train_steps` and `every_n_minutes` (either may be null) set the schedule; the clock
    is rank 0's. A save is written at the end of the training batch, or, when that step's
    validation is due, at the end of the validation: the points Lightning's loops resume
    exactly from (a checkpoint written before a due validation would skip it on resume).

    On SIGINT or SIGTERM (all processes stop at the same step) it saves at the next such point,
    prints how to resume and raises `RunInterrupted` (exit status 128 + signal). A second signal
    stops at once without saving. In a SLURM job with Lightning's auto-requeue, the requeue
    signal (SIGUSR1 unless configured) saves the same way and requeues the job.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        filename: str = "last.ckpt",
        every_n_train_steps: int | None = None,
        every_n_minutes: float | None = 5.0,
        save_on_signal: bool = True,
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1 or null, got {every_n_train_steps}")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"every_n_minutes must be > 0 or null, got {every_n_minutes}")
        self.dirpath = Path(dirpath)
        self.filename = filename
        self.every_n_train_steps = every_n_train_steps
        self.every_n_minutes = every_n_minutes
        self.save_on_signal = save_on_signal
        self._last_save_time = time.monotonic()
        self._last_saved_step = -1
        self._pending = False
        self._signal: int | None = None
        self._requeue = False
        self._previous_handlers: dict[int, Any] = {}
        self._resume_state: dict[str, Any] | None = None
        self._saved_results: list[dict[str, Any]] = []
        self._where: str | None = None

    @property
    def path(self) -> Path:
        return self.dirpath / self.filename

    @property
    def state_key(self) -> str:
        return "LastCheckpoint"

    # -- state ---------------------------------------------------------------------------------
    # Besides the epoch accumulations, a checkpoint records where the loggers stand: the rows
    # of each file logger, the latest metrics (what `metrics.json` reports when the resumed
    # run has nothing left to train), and the step metrics of the saved batch, which Lightning
    # logs only after the batch-end hooks (they are logged when the run resumes).
    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "_trainer", None)
        if trainer is None or trainer.state.fn != "fit":
            return {}
        loop = trainer.fit_loop.epoch_loop
        where = self._where
        if where is None:  # another callback's checkpoint (the best one, after validation)
            progress = loop.batch_progress.total
            where = (
                "batch_end" if progress.completed == progress.processed - 1 else "validation_end"
            )
        step = loop._batches_that_stepped
        pending: dict[str, float] | None = None
        if where == "batch_end":
            connector = trainer._logger_connector
            if connector.should_update_logs and trainer.loggers:
                pending = {
                    k: float(v) for k, v in connector.metrics["log"].items() if v.numel() == 1
                }
        rows = {}
        for i, logger in enumerate(trainer.loggers):
            if callable(getattr(logger, "row_count", None)):
                rows[str(i)] = logger.row_count()
        return {
            "train_results": snapshot_train_results(trainer),
            "saved_step": trainer.global_step,
            "callback_metrics": {
                k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1
            },
            "pending_log": pending,
            "pending_log_step": step,
            "pending_log_epoch": trainer.current_epoch,
            "logger_rows": rows,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_state = dict(state_dict)
        self._last_saved_step = int(state_dict.get("saved_step", -1))

    def _continue_logs(self, trainer: L.Trainer) -> None:
        """Put the loggers and Lightning's logging step where the checkpoint left them."""
        state, self._resume_state = self._resume_state, None
        if state is None:
            if trainer.ckpt_path is None:  # a fresh run: its files start empty
                for logger in trainer.loggers:
                    if callable(getattr(logger, "truncate", None)):
                        cast(Any, logger).truncate(0)  # duck-typed, checked above
            return
        self._saved_results = state.get("train_results") or []
        metrics = state.get("callback_metrics") or {}
        connector = trainer._logger_connector
        for key, value in metrics.items():  # what metrics.json reports if no step follows
            connector._callback_metrics.setdefault(key, torch.tensor(value))
        rows = state.get("logger_rows") or {}
        for i, logger in enumerate(trainer.loggers):
            if str(i) in rows and callable(getattr(logger, "truncate", None)):
                cast(Any, logger).truncate(int(rows[str(i)]))  # duck-typed, checked above
        pending = state.get("pending_log")
        if pending:
            metrics = {**pending, "epoch": state.get("pending_log_epoch", trainer.current_epoch)}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=int(state["pending_log_step"]))
                logger.save()

    # -- set-up --------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage == "fit" and trainer.is_global_zero:
            remove_stale_temporaries(self.dirpath)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install_handlers(trainer)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After the checkpoint was restored, before anything is logged (even when the resumed
        # run has nothing left to train and goes straight to its test).
        self._continue_logs(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install_handlers(trainer)
        self._last_save_time = time.monotonic()
        if self._saved_results:
            restore_train_results(trainer, self._saved_results)
        self._saved_results = []

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handlers()

    # -- signals -----------------------------------------------------------------------------------
    def _signals(self, trainer: L.Trainer) -> list[int]:
        signals: list[int] = [signal.SIGINT, signal.SIGTERM]
        env = trainer._accelerator_connector.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal:
            signals.append(int(env.requeue_signal))
        return signals

    def _install_handlers(self, trainer: L.Trainer) -> None:
        import threading

        if not self.save_on_signal or self._previous_handlers:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        # Lightning's own SIGTERM handler (installed before this hook) makes the loops exit
        # with status 0 at the next batch, before anything is saved: it is replaced here and
        # put back at teardown.
        for signum in self._signals(trainer):
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            # Only where ours is still installed: Lightning's teardown, which runs before this
            # callback's, has put its own original back already, and restoring the handler it
            # had replaced (Lightning's, holding its trainer, model and data) would keep every
            # finished run of the process alive, each one's handler holding the one before.
            if signal.getsignal(signum) != self._on_signal:
                continue
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal is not None:
            # A second signal: stop now, without waiting for the next safe point.
            self._restore_handlers()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signal = signum
        self._requeue = signum not in (signal.SIGINT, signal.SIGTERM)
        name = signal.Signals(signum).name
        log.warning(
            "%s received: saving %s after the current step, then stopping (send it again to "
            "stop at once without saving)",
            name,
            self.path,
        )

    # -- schedule ------------------------------------------------------------------------------
    def _decide(self, trainer: L.Trainer) -> tuple[bool, bool]:
        """(save now?, stop after saving?) for the step that just finished, on every rank."""
        step = trainer.global_step
        by_steps = self.every_n_train_steps is not None and step % self.every_n_train_steps == 0
        by_time = (
            self.every_n_minutes is not None
            and trainer.is_global_zero
            and time.monotonic() - self._last_save_time >= 60.0 * self.every_n_minutes
        )
        signalled, by_time = _any_rank(trainer, [self._signal is not None, bool(by_time)])
        return by_steps or by_time or signalled or self._pending, signalled

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        # Trainer sets fast_dev_run in its debugging-flag setup; its class does not declare it.
        if trainer.fast_dev_run:  # type: ignore[attr-defined]  # a debugging run: no checkpoints
            return
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return  # mid-accumulation: the optimizer has not stepped
        due, stop = self._decide(trainer)
        if not due:
            return
        if self._validation_due(trainer):
            self._pending = True  # saved at the end of this step's validation
            return
        if trainer.fit_loop.epoch_loop._num_ready_batches_reached():
            # The epoch's last batch, before its epoch-end hooks and metrics: a resume from
            # here would start the next epoch without them (other data order, no epoch row).
            # Saved after the next step instead (or at the end of training).
            self._pending = True
            return
        self._save(trainer, stop, "batch_end")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking or trainer.fast_dev_run:  # type: ignore[attr-defined]
            return
        # A signal during validation is acted on once the validation is complete.
        (signalled,) = _any_rank(trainer, [self._signal is not None])
        if self._pending or signalled:
            self._save(trainer, signalled, "validation_end")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The final state, after the last epoch-end hooks: evaluating last.ckpt evaluates the
        # trained model, and resuming a finished run goes straight to its test.
        if not trainer.fast_dev_run:  # type: ignore[attr-defined]
            self._save(trainer, False, "train_end")

    @staticmethod
    def _validation_due(trainer: L.Trainer) -> bool:
        loop = trainer.fit_loop.epoch_loop
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is None or not trainer.enable_validation:
            return False
        return bool(loop._should_check_val_fx(fetcher))

    # -- saving --------------------------------------------------------------------------------
    def _save(self, trainer: L.Trainer, stop: bool, where: str) -> None:
        self._pending = False
        for logger in trainer.loggers:  # rows up to this step are on disk with the checkpoint
            logger.save()
        self._where = where
        try:
            trainer.save_checkpoint(self.path)
        finally:
            self._where = None
        self._last_saved_step = trainer.global_step
        self._last_save_time = time.monotonic()
        if trainer.is_global_zero:
            log.info("saved %s at step %d", self.path, trainer.global_step)
        if stop:
            self._stop(trainer)

    def _stop(self, trainer: L.Trainer) -> None:
        signum = self._signal if self._signal is not None else signal.SIGTERM
        name = signal.Signals(signum).name
        if self._requeue and trainer.is_global_zero:
            _requeue_slurm_job()
        message = (
            f"{name} received: training stopped at step {trainer.global_step}; {self.path} holds it"
        )
        self._restore_handlers()
        raise RunInterrupted(message, 128 + int(signum))


class BestCheckpoint(ModelCheckpoint):
    """Lightning's `ModelCheckpoint` for the best checkpoint(s) of a run, made relocatable.

    A run folder copied or moved elsewhere resumes with its best-so-far record: the paths the
    checkpoint recorded are rebased onto the new folder (Lightning would drop the record, and
    then write a second best file beside the first). `enable_version_counter` is off, so no
    `-v1` copies appear next to a file of the same name.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        old = state_dict.get("dirpath")
        if old and self.dirpath and old != self.dirpath:
            state_dict = _rebase_paths(state_dict, str(old), str(self.dirpath))
        super().load_state_dict(state_dict)
        self._confine_paths()

    def _confine_paths(self) -> None:
        """Forget recorded paths outside this run's checkpoint folder: a checkpoint is data, and
        the top-k bookkeeping deletes the files it records (megalab.utils.safe_config)."""
        if not self.dirpath:
            return
        root = Path(self.dirpath).resolve()

        def inside(path: Any) -> bool:
            return isinstance(path, str) and root in Path(path).resolve().parents

        outside = [p for p in self.best_k_models if not inside(p)]
        for path in outside:
            del self.best_k_models[path]
        named = [getattr(self, a) for a in ("best_model_path", "kth_best_model_path")]
        if not outside and all(not p or inside(p) for p in named):
            return
        log.warning(
            "the checkpoint records files outside %s (%s): forgotten, never deleted",
            root,
            ", ".join(str(p) for p in [*outside, *named] if p and not inside(p)),
        )
        if self.last_model_path and not inside(self.last_model_path):
            self.last_model_path = ""
        best, kth = (min, max) if self.mode == "min" else (max, min)
        if self.best_k_models:
            scores = self.best_k_models
            self.best_model_path = best(scores, key=lambda path: float(scores[path]))
            self.kth_best_model_path = kth(scores, key=lambda path: float(scores[path]))
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        else:
            self.best_model_path = self.kth_best_model_path = ""


def _rebase_paths(state: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """The recorded checkpoint paths under `old` moved to `new` (files that exist there)."""

    def move(path: Any) -> Any:
        if not isinstance(path, str) or not path.startswith(old.rstrip("/") + "/"):
            return path
        moved = str(Path(new) / Path(path).relative_to(old))
        return moved if Path(moved).exists() else path

    out = dict(state)
    for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
        if key in out:
            out[key] = move(out[key])
    if isinstance(out.get("best_k_models"), dict):
        out["best_k_models"] = {move(k): v for k, v in out["best_k_models"].items()}
    out["dirpath"] = new
    log.info("the run folder moved from %s to %s: best-checkpoint paths rebased", old, new)
    return out
