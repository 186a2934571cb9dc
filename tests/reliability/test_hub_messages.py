"""A Hub dataset that is missing and cannot be fetched: the actionable message is printed once,
last, without the Hub client's retry warnings (two per attempt, five attempts) above it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

OFFLINE_VARS = ("MEGALAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# `megalab-data imdb` in a child process; the client's backoff sleeps are skipped (what is
# tested is what gets printed, not the waiting).
SCRIPT = """
import sys, time
time.sleep = lambda seconds: None
from megalab.cli.data import main
sys.exit(main(sys.argv[1:]))
"""


@contextlib.contextmanager
def _closed_port() -> Iterator[int]:
    """A local port that refuses connections: bound (so no other process takes it meanwhile)
    but not listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def _check(err: str) -> str:
    """The message, once and last; no retry warnings; returns the message."""
    assert err.count("is not available") == 1, err
    assert "Retrying in" not in err, err
    message = err[err.index("Dataset 'LRA Text (IMDB)' is not available") :]
    assert err.count("thrown while requesting") == message.count("thrown while requesting") <= 1
    assert message.rstrip().endswith("`--out /your/folder` and put them there."), err
    assert "Traceback" not in err
    return message


def test_unreachable_hub_prints_one_message_last(tmp_path: Path) -> None:
    """No network (the Hub endpoint refuses connections): the client retries five times."""
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARS}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), HF_HOME=str(tmp_path / "hf"))
    with _closed_port() as port:
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"  # nothing listens: no network
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, "imdb", "--out", str(tmp_path / "imdb")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 1, proc.stderr[-3000:]
    message = _check(proc.stderr)
    # the client's retries, summarised once in the reason
    assert message.count("the Hub client retried 5 time(s)") == 1, message


def test_offline_hub_prints_one_message_last(tmp_path: Path, monkeypatch, capfd) -> None:
    from megalab.cli.data import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["imdb", "--out", str(tmp_path / "imdb")]) == 1
    message = _check(capfd.readouterr().err)
    assert "offline mode is on" in message
    # imdb and cifar10 take --out (the dataset's folder); they have no --root flag
    assert "--out /your/folder" in message and "--root" not in message
