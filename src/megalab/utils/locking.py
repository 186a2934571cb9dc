"""One run per run folder: an exclusive lock on `<run>/.megalab.lock` while a run writes there.

Two runs started into the same folder (the same `hydra.run.dir`, a copied folder resumed twice)
would otherwise overwrite each other's checkpoints and logs. The lock is an `flock` on a file in
the folder, held by the process of global rank 0 for the run's lifetime; the operating system
releases it when that process ends however it ends (a kill included), so a stale lock never
blocks a resume. The lock file records who holds it, for the error message. `flock` is local to
one machine on some network filesystems: two hosts writing into one folder are not detected there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from megalab.utils.distributed import is_rank_zero
from megalab.utils.errors import UserError

LOCK_NAME = ".megalab.lock"

# Folder -> (file descriptor, how many holders in this process).
_HELD: dict[Path, list[int]] = {}


class RunFolderLockedError(UserError, RuntimeError):
    """Another process is running in this run folder."""


def _describe_holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("time", 0)))
    who = f"process {info.get('pid', '?')} on {info.get('host', '?')} since {since}"
    command = info.get("command")
    return who + (f" ({command})" if command else "")


def lock_run_folder(folder: str | os.PathLike[str]) -> None:
    """Take the run folder's lock (re-entrant within a process; only on global rank 0).

    Raises `RunFolderLockedError` naming the holder when another process has it.
    """
    if not is_rank_zero():
        return
    folder = Path(folder).absolute()
    if folder in _HELD:
        _HELD[folder][1] += 1
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunFolderLockedError(
            f"the run folder {folder} is in use by {_describe_holder(path)}. Two runs in one "
            "folder would overwrite each other's checkpoints and logs: wait for that run to end "
            "(then resume it with ckpt_path=last), or start this one in another folder "
            "(a new hydra.run.dir)"
        ) from None
    info: dict[str, Any] = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": time.time(),
        "command": " ".join(sys.argv),
    }
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(info).encode())
    _HELD[folder] = [fd, 1]


def unlock_run_folder(folder: str | os.PathLike[str]) -> None:
    """Release one hold of the lock taken by `lock_run_folder` in this process."""
    folder = Path(folder).absolute()
    held = _HELD.get(folder)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD[folder]
    with contextlib.suppress(OSError):
        fcntl.flock(held[0], fcntl.LOCK_UN)
    os.close(held[0])


def is_locked_here(folder: str | os.PathLike[str]) -> bool:
    return Path(folder).absolute() in _HELD


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency
    _HydraCallback = object  # type: ignore[assignment,misc]


class HydraRunFolderLock(_HydraCallback):  # type: ignore[misc,valid-type]
    """Hydra callback: lock the run folder before Hydra writes `.hydra/` into it.

    In a single run the lock is taken when the run starts (before Hydra saves its copy of the
    config there); in a multirun each job's folder is locked when the job starts. A refused lock
    prints why and exits with status 1 without touching the folder.
    """

    def _take(self, folder: Any) -> None:
        from megalab.utils.errors import print_error

        try:
            lock_run_folder(str(folder))
        except RunFolderLockedError as err:
            print_error(str(err))
            raise SystemExit(1) from None

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._take(config.hydra.run.dir)

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        unlock_run_folder(str(config.hydra.run.dir))

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        self._take(config.hydra.runtime.output_dir)

    def on_job_end(self, config: Any, job_return: Any = None, **kwargs: Any) -> None:
        unlock_run_folder(str(config.hydra.runtime.output_dir))
