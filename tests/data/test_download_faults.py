"""Download faults against a local HTTP server that validates like a real one (ETag,
Last-Modified, `If-Range`, HEAD) and misbehaves on demand: a file replaced between attempts, a
server that ignores `If-Range` or `Range`, a transfer cut short without `Content-Length`."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megalab.data.download import DownloadError, UnverifiableDownloadError, download


@dataclass
class Server:
    """What is served and how: one file per path; ETag and Last-Modified follow its bytes."""

    files: dict[str, bytes] = field(default_factory=dict)
    validators: bool = True  # send ETag and Last-Modified
    honor_if_range: bool = True  # a changed file answers a conditional range with 200
    ignore_range: bool = False  # always 200 with the whole file
    content_length: bool = True  # False: close-delimited bodies (no Content-Length)
    head_length: bool = True  # HEAD announces the size
    cut_after: int | None = None  # body bytes sent before the connection drops (once)
    requests: list[dict] = field(default_factory=list)

    @staticmethod
    def etag(body: bytes) -> str:
        return f'"{hashlib.sha256(body).hexdigest()[:16]}"'

    @staticmethod
    def last_modified(body: bytes) -> str:
        return f"Tue, 0{1 + body[0] % 9} Jan 2019 00:00:00 GMT"


def _handler(srv: Server) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _headers(self, body: bytes) -> None:
            if srv.validators:
                self.send_header("ETag", Server.etag(body))
                self.send_header("Last-Modified", Server.last_modified(body))
            self.send_header("Accept-Ranges", "bytes")

        def do_HEAD(self) -> None:
            srv.requests.append({"method": "HEAD", "path": self.path})
            body = srv.files[self.path]
            self.send_response(200)
            self._headers(body)
            if srv.head_length:
                self.send_header("Content-Length", str(len(body)))
            else:
                self.close_connection = True
            self.end_headers()

        def do_GET(self) -> None:
            rng, cond = self.headers.get("Range"), self.headers.get("If-Range")
            record = {"method": "GET", "range": rng, "if_range": cond, "status": 200}
            srv.requests.append(record)
            body = srv.files[self.path]
            current = (Server.etag(body), Server.last_modified(body))
            start = 0
            if (
                rng
                and not srv.ignore_range
                and (cond is None or cond in current or not srv.honor_if_range)
            ):
                start = int(rng.split("=")[1].split("-")[0])
                record["status"] = 206
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            else:
                self.send_response(200)
            self._headers(body)
            payload = body[start:]
            if srv.content_length:
                self.send_header("Content-Length", str(len(payload)))
            self.close_connection = not srv.content_length or srv.cut_after is not None
            self.end_headers()
            if srv.cut_after is not None:
                payload, srv.cut_after = payload[: srv.cut_after], None
            self.wfile.write(payload)
            self.wfile.flush()
            if self.close_connection:
                self.connection.shutdown(socket.SHUT_RDWR)

    return Handler


@pytest.fixture
def server() -> Iterator[tuple[str, Server]]:
    srv = Server()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(srv))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", srv
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(autouse=True)
def _online(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MEGALAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)


def _get(srv: Server) -> list[dict]:
    return [r for r in srv.requests if r["method"] == "GET"]


def _interrupted(base: str, srv: Server, dest: Path, old: bytes, cut: int = 30_000) -> Path:
    """A first attempt cut after `cut` bytes: the .part and its sidecar stay."""
    srv.files["/f.bin"] = old
    srv.cut_after = cut
    with pytest.raises(DownloadError, match="resume"):
        download(f"{base}/f.bin", dest, progress=False, retries=0)
    part = dest.with_name(dest.name + ".part")
    assert part.stat().st_size == cut
    meta = json.loads(dest.with_name(dest.name + ".part.json").read_text())
    assert meta == {
        "url": f"{base}/f.bin",
        "size": len(old),
        "etag": Server.etag(old),
        "last_modified": Server.last_modified(old),
    }
    return part


def test_interrupted_transfer_resumes_with_if_range(tmp_path: Path, server) -> None:
    base, srv = server
    blob = os.urandom(100_000)
    dest = tmp_path / "f.bin"
    _interrupted(base, srv, dest, blob)
    download(f"{base}/f.bin", dest, progress=False, retries=0)  # no checksum: the ETag decides
    assert dest.read_bytes() == blob
    assert _get(srv)[1] == {
        "method": "GET",
        "range": "bytes=30000-",
        "if_range": Server.etag(blob),
        "status": 206,
    }
    assert not dest.with_name("f.bin.part.json").exists()


def test_file_changed_between_attempts_restarts(tmp_path: Path, server) -> None:
    """The server's file was replaced: `If-Range` fails, the server sends the new file whole,
    and the old bytes are not kept in front of it."""
    base, srv = server
    old, new = b"\x01" + os.urandom(99_999), b"\x02" + os.urandom(120_000)
    dest = tmp_path / "f.bin"
    _interrupted(base, srv, dest, old)
    srv.files["/f.bin"] = new
    download(f"{base}/f.bin", dest, progress=False, retries=0)
    assert dest.read_bytes() == new
    assert _get(srv)[1]["if_range"] == Server.etag(old) and _get(srv)[1]["status"] == 200


def test_server_ignoring_if_range_is_caught_by_the_etag(tmp_path: Path, server) -> None:
    """A server that answers 206 whatever `If-Range` says: its new ETag (or size) shows that
    the rest belongs to another file, and the download restarts from byte 0."""
    base, srv = server
    old, new = b"\x01" + os.urandom(99_999), b"\x02" + os.urandom(99_999)  # same size
    dest = tmp_path / "f.bin"
    _interrupted(base, srv, dest, old)
    srv.files["/f.bin"], srv.honor_if_range = new, False
    download(f"{base}/f.bin", dest, progress=False, retries=0)
    assert dest.read_bytes() == new
    assert [(r["range"], r["status"]) for r in _get(srv)[1:]] == [
        ("bytes=30000-", 206),
        (None, 200),
    ]


def test_server_ignoring_range_restarts_cleanly(tmp_path: Path, server) -> None:
    base, srv = server
    blob = os.urandom(100_000)
    dest = tmp_path / "f.bin"
    _interrupted(base, srv, dest, blob)
    srv.ignore_range = True
    download(f"{base}/f.bin", dest, progress=False, retries=0)
    assert dest.read_bytes() == blob  # not the first 30,000 bytes twice
    assert _get(srv)[1]["range"] == "bytes=30000-" and _get(srv)[1]["status"] == 200


def test_part_of_unknown_origin_restarts_without_a_checksum(tmp_path: Path, server) -> None:
    """A `.part` without its sidecar (or of another URL), and nothing to verify the result:
    its bytes cannot be trusted to be this file's start."""
    base, srv = server
    blob = os.urandom(50_000)
    srv.files["/f.bin"] = blob
    dest = tmp_path / "f.bin"
    dest.with_name("f.bin.part").write_bytes(b"\0" * 1_000)
    download(f"{base}/f.bin", dest, progress=False)
    other = tmp_path / "g.bin"
    other.with_name("g.bin.part").write_bytes(b"\0" * 1_000)
    other.with_name("g.bin.part.json").write_text(
        json.dumps({"url": f"{base}/elsewhere", "size": 50_000, "etag": Server.etag(blob)})
    )
    download(f"{base}/f.bin", other, progress=False)
    assert dest.read_bytes() == blob == other.read_bytes()
    assert [r["range"] for r in _get(srv)] == [None, None]


def test_truncated_transfer_without_content_length_is_not_complete(tmp_path: Path, server) -> None:
    """No Content-Length, connection closed early, no checksum: the HEAD request's size shows
    the transfer is short; the next attempt resumes it."""
    base, srv = server
    blob = os.urandom(80_000)
    srv.files["/f.bin"], srv.content_length, srv.cut_after = blob, False, 20_000
    dest = tmp_path / "f.bin"
    with pytest.raises(DownloadError, match="ended after 20000 of 80000 bytes"):
        download(f"{base}/f.bin", dest, progress=False, retries=0)
    assert not dest.exists()
    assert [r["method"] for r in srv.requests] == ["GET", "HEAD"]
    download(f"{base}/f.bin", dest, progress=False, retries=0)
    assert dest.read_bytes() == blob and _get(srv)[1]["range"] == "bytes=20000-"


def test_no_length_anywhere_and_no_checksum_is_refused(tmp_path: Path, server) -> None:
    base, srv = server
    blob = os.urandom(40_000)
    srv.files["/f.bin"] = blob
    srv.content_length = srv.head_length = False
    srv.cut_after = 10_000  # silently short: nothing could tell
    dest = tmp_path / "f.bin"
    with pytest.raises(UnverifiableDownloadError) as err:
        download(f"{base}/f.bin", dest, progress=False, retries=0)
    message = str(err.value)
    assert "cannot tell whether that is the whole file" in message and "sha256" in message
    assert not dest.exists() and dest.with_name("f.bin.unverified").stat().st_size == 10_000
    assert not dest.with_name("f.bin.part").exists()
    # With a checksum (or a known size) the same server is fine.
    sha = hashlib.sha256(blob).hexdigest()
    assert download(f"{base}/f.bin", dest, sha256=sha, progress=False).read_bytes() == blob
    assert download(f"{base}/f.bin", tmp_path / "g.bin", size=40_000, progress=False).exists()


def test_expected_size_is_checked(tmp_path: Path, server) -> None:
    base, srv = server
    srv.files["/f.bin"] = os.urandom(1_000)
    with pytest.raises(DownloadError, match="gave 1000 bytes; the file has 999"):
        download(f"{base}/f.bin", tmp_path / "f.bin", size=999, progress=False, retries=0)
    assert not (tmp_path / "f.bin").exists()
