"""Errors a user can act on, shown as one message at the end of the output.

The entry points (`megalab-train`, `megalab-eval`, `megalab-data`) wrap their work in `reported`:
an error megalab raised about the user's data, configuration, checkpoint or run folder is
printed as its message alone, last, without the chained library tracebacks it came through
(`hydra.utils.instantiate` wraps every constructor's error in its own); the full traceback goes
to the run's log file. `HYDRA_FULL_ERROR=1` shows everything instead. Other exceptions (bugs)
keep their tracebacks.

`explain_composition_error` adds what Hydra's message lacks when an override names a key that
does not exist: the closest valid keys.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("megalab")

_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])
_state = {"task_started": False}


class UserError(Exception):
    """Base of the errors whose message is the whole story for a user (bad input, not a bug).

    An error class defined anywhere in megalab derives from it (next to the code that raises
    it) to be shown as one message.
    """


class MissingExtraError(UserError, ImportError):
    """An optional package a setting needs is not installed; the message names the extra
    (`pip install 'megalab[...]'`) and the settings that do without it."""


class Interrupted(BaseException):
    """Base of the deliberate stops of a run (a signal, after saving): `message` is printed and
    `code` is the exit status (`megalab.utils.checkpointing.RunInterrupted`)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception classes whose message is the whole story for a user."""
    return (UserError,)


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from, outermost first."""
    out: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        out.append(current)
        seen.add(id(current))
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )
    return out


def _raised_in_megalab(err: BaseException) -> bool:
    """Whether the innermost frame of `err`'s traceback is megalab code (a `raise` of ours)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR)


class DataLoaderWorkerError(RuntimeError):
    """A data-loading worker process died (killed, most often for memory): what to do."""


# torch's messages: "DataLoader worker (pid 123) is killed by signal: Killed." and
# "DataLoader worker (pid(s) 123, 124) exited unexpectedly".
_WORKER_DIED = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? [^)]*\) (?:is killed by signal|exited)"
)


def _worker_died(err: BaseException) -> DataLoaderWorkerError | None:
    for e in _chain(err):
        text = str(e)
        if isinstance(e, RuntimeError) and _WORKER_DIED.search(text):
            first = text.strip().splitlines()[0].strip().rstrip(".")
            return DataLoaderWorkerError(
                f"a data-loading worker process died: {first}. A worker killed (SIGKILL) is "
                "most often the system's out-of-memory killer: lower data.num_workers or "
                "data.batch_size, or give the job more memory (a bus error: more shared "
                "memory, /dev/shm). A training run resumes from its last checkpoint with "
                "ckpt_path=auto in the same run folder"
            )
    return None


class ValidationIntervalError(UserError, ValueError):
    """`trainer.val_check_interval` is longer than an epoch while validation is per epoch."""


# Lightning internal (6 of 7, hence the `lightning<2.7` bound in pyproject.toml): its message
# (loops/fit_loop.py, setup_data) "`val_check_interval` (100) must be less than or equal to the
# number of the training batches (40). ..."
_VAL_CHECK_TOO_LONG = re.compile(
    r"`val_check_interval` \((\d+)\) must be less than or equal to the number of the "
    r"training batches \((\d+)\)"
)


def _val_check_too_long(err: BaseException) -> ValidationIntervalError | None:
    for e in _chain(err):
        found = _VAL_CHECK_TOO_LONG.search(str(e)) if isinstance(e, ValueError) else None
        if found:
            interval, batches = found.groups()
            return ValidationIntervalError(
                f"trainer.val_check_interval={interval} is more than the {batches} training "
                "batches of an epoch (per process), and validation runs within each epoch "
                "(trainer.check_val_every_n_epoch). Validate every "
                f"{interval} training batches across epochs with "
                "trainer.check_val_every_n_epoch=null, give an interval of at most "
                f"{batches} (or a fraction of an epoch, such as 0.5), or train without "
                "validation with trainer.limit_val_batches=0"
            )
    return None


class LoggerStartError(UserError, RuntimeError):
    """The experiment logger could not start its run (W&B: no API key, its server unreachable)."""


_OFFLINE = (
    "or log offline with logger.wandb.offline=true (the default) and upload later with "
    "`wandb sync <run folder>/wandb`"
)


def _wandb_refused(err: BaseException) -> LoggerStartError | None:
    """W&B's own refusals when a run goes online, as one message (they come under a traceback
    from inside the logger's first use)."""
    for e in _chain(err):
        cls = type(e)
        if not cls.__module__.startswith("wandb.errors"):
            continue
        text = " ".join(line.strip() for line in str(e).strip().splitlines()).rstrip(".")
        if cls.__name__ == "AuthenticationError" or (
            cls.__name__ == "UsageError" and "API key" in text
        ):
            login = (
                " (once; or set WANDB_API_KEY)"
                if "wandb login" in text
                else ". Log in once with `wandb login` (or set WANDB_API_KEY)"
            )
            return LoggerStartError(f"W&B would not start the run: {text}{login}, {_OFFLINE}")
        if cls.__name__ == "CommError":
            return LoggerStartError(
                f"W&B could not reach its server: {text}. Check the network (and WANDB_BASE_URL "
                f"for a server of your own), {_OFFLINE}"
            )
    return None


def actionable(err: BaseException) -> BaseException | None:
    """The exception in `err`'s chain whose message a user can act on, or None (a bug)."""
    types = user_error_types()
    chain = _chain(err)
    for e in reversed(chain):  # innermost first: the original error, not a wrapper
        if isinstance(e, types):
            return e
    for e in reversed(chain):
        if type(e) in (ValueError, FileNotFoundError) and _raised_in_megalab(e):
            return e
    return _worker_died(err) or _val_check_too_long(err) or _wandb_refused(err)


def full_errors() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR", "").strip() not in ("", "0")


def _log_files() -> list[str]:
    files = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            files.append(handler.baseFilename)
    return files


def _to_log_files(err: BaseException) -> list[str]:
    """Write `err`'s full traceback to the log files only (not the console)."""
    files = []
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    record = logging.LogRecord("megalab", logging.ERROR, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
            handler.flush()
            files.append(handler.baseFilename)
    return files


def print_error(message: str, where: Sequence[str] = ()) -> None:
    """The message, last on stderr (after flushing what came before)."""
    sys.stdout.flush()
    sys.stderr.flush()
    text = f"\nError: {message.rstrip()}\n"
    if where:
        text += f"(full traceback in {', '.join(where)}; HYDRA_FULL_ERROR=1 prints it here)\n"
    sys.stderr.write(text)
    sys.stderr.flush()


@contextlib.contextmanager
def reported(exit_code: int = 1) -> Iterator[None]:
    """Turn actionable errors into their message and an exit status (`SystemExit`)."""
    _state["task_started"] = True
    try:
        yield
    except Interrupted as err:
        from megalab.utils.distributed import is_rank_zero

        if is_rank_zero():  # every DDP/FSDP process stops at the same step: rank zero says so
            print_error(err.message)
        raise SystemExit(err.code) from None
    except Exception as err:
        if full_errors():
            raise
        found = actionable(err)
        if found is None:
            raise
        where = _to_log_files(err)
        print_error(str(found), where)
        raise SystemExit(exit_code) from None


# -- misspelled keys ------------------------------------------------------------------------------
def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    from omegaconf import DictConfig

    keys = []
    if isinstance(node, DictConfig):
        for k in node:
            full = f"{prefix}.{k!s}" if prefix else str(k)
            keys.append(full)
            try:
                child = node._get_node(k)
            except Exception:
                continue
            if isinstance(child, DictConfig):
                keys.extend(_leaf_keys(child, full))
    return keys


def closest_keys(cfg: Any, key: str, n: int = 3) -> list[str]:
    """Keys of `cfg` close to the misspelled dotted `key`: the same name under another group
    first (`model.compile` -> `task.compile`), then close siblings, then close names anywhere."""
    keys = [k for k in _leaf_keys(cfg) if not k.startswith("hydra.")]
    parent, _, leaf = key.rpartition(".")
    siblings = [k for k in keys if k.rpartition(".")[0] == parent]
    near = [k for k in keys if k.rpartition(".")[2] == leaf and k != key]
    near += [k for k in difflib.get_close_matches(key, siblings, n=n, cutoff=0.6) if k not in near]
    by_leaf: dict[str, list[str]] = {}
    for k in keys:
        by_leaf.setdefault(k.rpartition(".")[2], []).append(k)
    for name in difflib.get_close_matches(leaf, list(by_leaf), n=n, cutoff=0.75):
        for k in by_leaf[name]:
            if k not in near:
                near.append(k)
    return near[: max(n, 3)]


def _bad_key(message: str) -> str | None:
    import re

    for pattern in (r"Could not override '([^']+)'", r"full_key: (\S+)", r"Key '([^']+)'"):
        m = re.search(pattern, message)
        if m:
            return m.group(1)
    return None


def explain_composition_error(
    config_name: str, argv: Sequence[str], keys_from: Any = None
) -> str | None:
    """After Hydra refused the overrides in `argv`: a hint listing the closest valid keys (of
    `keys_from` when it has the key's top-level group). Hydra names the first bad key only; the
    hint names each (composed again without the ones found)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    from megalab.utils.paths import CONFIG_DIR

    rest = [a for a in argv if "=" in a and not a.startswith("-")]
    bad: list[str] = []
    cfg = None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            for _ in range(len(rest) + 1):
                try:
                    cfg = compose(config_name, overrides=rest)
                    break
                except HydraException as err:
                    message = "\n".join(str(e) for e in _chain(err))
                missing = re.search(r"Could not find '([^'/]+)/([^']+)'", message)
                if missing and not bad:
                    return missing_option_hint(missing.group(1), missing.group(2))
                key = _bad_key(message)
                if key is None or key in bad or "Could not find" in message:
                    break  # another kind of error: hint at the keys found so far
                bad.append(key)
                rest = [o for o in rest if o.lstrip("+~").split("=")[0] != key]
    finally:
        GlobalHydra.instance().clear()
    lines = []
    for key in bad:
        source = keys_from if keys_from is not None and key.split(".")[0] in keys_from else cfg
        near = closest_keys(source, key) if source is not None else []
        line = f"'{key}' is not a key of this configuration"
        lines.append(line + ("; did you mean: " + ", ".join(near) + "?" if near else ""))
    return "\n".join(lines) or None


def missing_option_hint(group: str, name: str, n: int = 5) -> str | None:
    """After `group=name` named no config: the closest options of the group, nested folders
    included (Hydra's own list, "Available options", shows only the group's top folder, so
    `experiment=megalodon/enwik8` was told only of `quickstart`)."""
    from megalab.utils.paths import CONFIG_DIR

    folder = CONFIG_DIR / group
    if not folder.is_dir():
        return None
    options = sorted(
        p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml")
    )
    leaf = name.rpartition("/")[2]
    near = [o for o in options if o.rpartition("/")[2] == leaf]  # the same name elsewhere
    near += [o for o in difflib.get_close_matches(name, options, n=n, cutoff=0.6) if o not in near]
    hint = f"'{name}' is not an option of {group}"
    if near:
        hint += "; did you mean: " + ", ".join(f"{group}={o}" for o in near[:n]) + "?"
    here = name.rpartition("/")[0]
    inside = [o.rpartition("/")[2] for o in options if o.rpartition("/")[0] == here]
    if here and inside:
        hint += f"\nThe options under {group}/{here}/: " + ", ".join(inside)
    else:
        folders = sorted({o.partition("/")[0] for o in options if "/" in o})
        if folders:
            hint += f"\n(more options of {group} in its folders: " + ", ".join(folders) + ")"
    return hint


def task_started() -> bool:
    return bool(_state["task_started"])


def run_entry_point(hydra_main: Any, config_name: str, keys_from: Any = None) -> None:
    """Call a `@hydra.main` function; after a composition error, suggest the closest keys (of
    `keys_from` for its top-level groups: the run config an evaluation takes them from)."""
    _state["task_started"] = False
    try:
        hydra_main()
    except SystemExit as err:
        if err.code not in (0, None) and not task_started() and not full_errors():
            with contextlib.suppress(Exception):
                hint = explain_composition_error(config_name, sys.argv[1:], keys_from)
                if hint:
                    sys.stderr.write(hint + "\n")
        raise
