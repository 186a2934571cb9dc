"""Download, extraction and cache utilities against a local HTTP server (never the internet)."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import json
import os
import socket
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megalab.data.archives import UnsafeArchiveError, extract
from megalab.data.cache import cache_dir, mark_prepared, prepared
from megalab.data.download import (
    ChecksumError,
    DatasetMissingError,
    DownloadError,
    download,
    is_offline,
    require_files,
)
from megalab.data.files import file_digest

# --------------------------------------------------------------------------- local server


@dataclass
class ServerState:
    """What the test server serves and how it misbehaves; requests are recorded."""

    files: dict[str, bytes] = field(default_factory=dict)
    cut_after: int | None = None  # close the connection after this many body bytes (once)
    ignore_range: bool = False  # answer 200 with the whole body even when asked for a range
    corrupt: bool = False  # flip one byte of the body (a server with a wrong file)
    requests: list[dict] = field(default_factory=list)


def _handler(state: ServerState) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            record = {"path": self.path, "range": self.headers.get("Range"), "sent": 0}
            state.requests.append(record)
            body = state.files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            if state.corrupt:
                body = bytes([body[0] ^ 0xFF]) + body[1:]
            start = 0
            rng = self.headers.get("Range")
            if rng and not state.ignore_range:
                start = int(rng.split("=")[1].split("-")[0])
                if start >= len(body):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(body)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            else:
                self.send_response(200)
            payload = body[start:]
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if state.cut_after is not None:
                payload = payload[: state.cut_after]
                state.cut_after = None
                self.close_connection = True
            record["sent"] = len(payload)  # before writing: the client may finish first
            self.wfile.write(payload)
            self.wfile.flush()
            if self.close_connection:
                self.connection.shutdown(socket.SHUT_RDWR)

    return Handler


@pytest.fixture
def server() -> Iterator[tuple[str, ServerState]]:
    state = ServerState()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(autouse=True)
def _online(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MEGALAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)


def _fixture_archive(tmp_path: Path) -> tuple[bytes, dict[str, bytes]]:
    """A .tar.gz with a nested layout and an incompressible payload of ~200 KB."""
    contents = {
        "release/readme.txt": b"fixture\n",
        "release/data/blob.bin": os.urandom(200_000),
        "release/data/labels.tsv": b"a\t0\nb\t1\n",
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in contents.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue(), contents


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- download


def test_complete_download_checksum_and_extract(tmp_path, server):
    base, state = server
    blob, contents = _fixture_archive(tmp_path)
    state.files["/release.tar.gz"] = blob
    dest = tmp_path / "dl" / "release.tar.gz"

    out = download(
        f"{base}/release.tar.gz",
        dest,
        sha256=_sha256(blob),
        md5=hashlib.md5(blob).hexdigest(),
        progress=False,
        chunk_size=16_384,
    )
    assert out == dest and dest.read_bytes() == blob
    assert not dest.with_name("release.tar.gz.part").exists()
    assert len(state.requests) == 1 and state.requests[0]["range"] is None

    root = extract(dest, tmp_path / "x")
    for name, data in contents.items():
        assert (root / name).read_bytes() == data
    assert not any(p.name.endswith(".extracting") for p in root.iterdir())

    # Both steps are cached: no new request, no re-extraction.
    (root / "release" / "readme.txt").write_bytes(b"edited")
    download(f"{base}/release.tar.gz", dest, sha256=_sha256(blob), progress=False)
    extract(dest, tmp_path / "x")
    assert len(state.requests) == 1
    assert (root / "release" / "readme.txt").read_bytes() == b"edited"


def test_interrupted_download_resumes_from_part(tmp_path, server):
    base, state = server
    blob, _ = _fixture_archive(tmp_path)
    state.files["/a.tar.gz"] = blob
    state.cut_after = 50_000
    dest = tmp_path / "a.tar.gz"
    part = tmp_path / "a.tar.gz.part"

    with pytest.raises(DownloadError, match="resume"):
        download(f"{base}/a.tar.gz", dest, sha256=_sha256(blob), progress=False, retries=0)
    assert not dest.exists()
    assert part.stat().st_size == 50_000

    download(f"{base}/a.tar.gz", dest, sha256=_sha256(blob), progress=False, retries=0)
    assert dest.read_bytes() == blob and not part.exists()
    assert [r["range"] for r in state.requests] == [None, "bytes=50000-"]
    assert state.requests[1]["sent"] == len(blob) - 50_000


def test_cut_connection_is_retried_within_one_call(tmp_path, server):
    base, state = server
    blob = os.urandom(100_000)
    state.files["/f.bin"] = blob
    state.cut_after = 30_000
    dest = download(
        f"{base}/f.bin", tmp_path / "f.bin", sha256=_sha256(blob), progress=False, backoff=0.0
    )
    assert dest.read_bytes() == blob
    assert [r["range"] for r in state.requests] == [None, "bytes=30000-"]
    assert state.requests[1]["sent"] == 70_000


def test_server_ignoring_range_restarts_cleanly(tmp_path, server):
    base, state = server
    blob = os.urandom(80_000)
    state.files["/f.bin"] = blob
    state.ignore_range = True
    dest = tmp_path / "f.bin"
    # A stale partial file whose bytes are not even a prefix of the real file.
    (tmp_path / "f.bin.part").write_bytes(b"\0" * 1_000)

    download(f"{base}/f.bin", dest, sha256=_sha256(blob), progress=False)
    assert dest.read_bytes() == blob
    assert state.requests[0]["range"] == "bytes=1000-"
    assert state.requests[0]["sent"] == len(blob)
    assert len(state.requests) == 1


def test_complete_part_and_bad_resumed_prefix(tmp_path, server):
    base, state = server
    blob = os.urandom(30_000)
    state.files["/f.bin"] = blob
    # A partial file that already holds every byte: the server answers 416, nothing is re-sent.
    (tmp_path / "f.bin.part").write_bytes(blob)
    download(f"{base}/f.bin", tmp_path / "f.bin", sha256=_sha256(blob), progress=False)
    assert (tmp_path / "f.bin").read_bytes() == blob
    assert state.requests[-1]["range"] == "bytes=30000-" and state.requests[-1]["sent"] == 0

    # A partial file with wrong bytes: the resumed result fails the checksum, so the download
    # starts over once from byte 0 before giving up.
    state.requests.clear()
    (tmp_path / "g.bin.part").write_bytes(b"\xff" * 10_000)
    download(f"{base}/f.bin", tmp_path / "g.bin", sha256=_sha256(blob), progress=False)
    assert (tmp_path / "g.bin").read_bytes() == blob
    assert [r["range"] for r in state.requests] == ["bytes=10000-", None]


def test_checksum_mismatch_is_reported_and_file_not_used(tmp_path, server):
    base, state = server
    blob = os.urandom(10_000)
    state.files["/f.bin"] = blob
    state.corrupt = True  # the server hands out a damaged file
    dest = tmp_path / "f.bin"
    url = f"{base}/f.bin"
    good = _sha256(blob)
    bad = _sha256(bytes([blob[0] ^ 0xFF]) + blob[1:])

    with pytest.raises(ChecksumError) as info:
        download(url, dest, sha256=good, progress=False)
    msg = str(info.value)
    assert url in msg and good in msg and bad in msg
    assert "f.bin.corrupt" in msg and "run again" in msg
    assert not dest.exists()
    assert not (tmp_path / "f.bin.part").exists()
    assert (tmp_path / "f.bin.corrupt").exists()

    # Once the server is fixed, the next call succeeds.
    state.corrupt = False
    assert download(url, dest, sha256=good, progress=False).read_bytes() == blob


def test_md5_mismatch_and_bad_existing_file_is_replaced(tmp_path, server):
    base, state = server
    blob = os.urandom(5_000)
    state.files["/f.bin"] = blob
    dest = tmp_path / "f.bin"
    with pytest.raises(ChecksumError, match=r"md5: expected 0{32}"):
        download(f"{base}/f.bin", dest, md5="0" * 32, progress=False)
    # A damaged file under the final name is set aside and fetched again.
    dest.write_bytes(b"truncated")
    download(f"{base}/f.bin", dest, md5=hashlib.md5(blob).hexdigest(), progress=False)
    assert dest.read_bytes() == blob


def test_http_error_and_offline_and_unreachable(tmp_path, server, monkeypatch):
    base, state = server
    with pytest.raises(DownloadError, match="Unsupported URL scheme 'ftp'"):
        download("ftp://example.org/x.zip", tmp_path / "x.zip", progress=False)
    with pytest.raises(DownloadError, match="HTTP 404"):
        download(f"{base}/missing.bin", tmp_path / "m.bin", progress=False, retries=0)

    monkeypatch.setenv("MEGALAB_OFFLINE", "1")
    assert is_offline()
    url = "https://storage.example.invalid/lra/x.zip"  # never contacted: offline comes first
    with pytest.raises(DatasetMissingError) as info:
        download(url, tmp_path / "x.zip", progress=False, dataset="lra")
    msg = str(info.value)
    assert "'lra'" in msg and url in msg and str(tmp_path / "x.zip") in msg
    assert "offline" in msg and "paths.data_dir" in msg
    # A local mirror still works offline.
    state.files["/local.bin"] = b"mirror"
    assert (
        download(f"{base}/local.bin", tmp_path / "l.bin", progress=False).read_bytes() == b"mirror"
    )
    monkeypatch.delenv("MEGALAB_OFFLINE")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(DatasetMissingError, match="cannot reach the server"):
        download(f"http://127.0.0.1:{port}/x.zip", tmp_path / "y.zip", progress=False, retries=0)

    # A file put there by hand that fails its checksum: the message says so, not only that the
    # file is missing (it was moved aside), and how to use a trusted file as it is.
    mine = tmp_path / "z.zip"
    mine.write_bytes(b"my own copy")
    with pytest.raises(DatasetMissingError) as info:
        download(f"http://127.0.0.1:{port}/z.zip", mine, sha256="0" * 64, progress=False,
                 retries=0)  # fmt: skip
    msg = str(info.value)
    assert f"{mine} was there but failed its checksum (sha256: expected {'0' * 64}, got " in msg
    assert f"moved to {mine}.corrupt" in msg and "data.sha256=null" in msg
    assert "cannot reach the server" in msg and (tmp_path / "z.zip.corrupt").exists()


def test_file_url_with_resume(tmp_path):
    blob = os.urandom(40_000)
    src = tmp_path / "mirror" / "f.bin"
    src.parent.mkdir()
    src.write_bytes(blob)
    dest = tmp_path / "out" / "f.bin"
    dest.parent.mkdir()
    (tmp_path / "out" / "f.bin.part").write_bytes(blob[:10_000])
    download(src.as_uri(), dest, sha256=_sha256(blob), progress=False)
    assert dest.read_bytes() == blob
    with pytest.raises(DatasetMissingError, match="local file not found"):
        download((tmp_path / "nope.bin").as_uri(), tmp_path / "nope.bin", progress=False)


# --------------------------------------------------------------------------- extraction


def _tar_with(tmp_path: Path, name: str, add) -> Path:
    path = tmp_path / name
    with tarfile.open(path, "w:gz") as tf:
        add(tf)
    return path


def _add_file(tf: tarfile.TarFile, name: str, data: bytes = b"x") -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("member", ["../evil.txt", "ok/../../evil.txt", "/tmp/evil.txt"])
def test_tar_path_traversal_rejected(tmp_path, member):
    archive = _tar_with(
        tmp_path, "bad.tar.gz", lambda tf: (_add_file(tf, "fine.txt"), _add_file(tf, member))
    )
    dest = tmp_path / "out"
    with pytest.raises(UnsafeArchiveError, match="outside the destination"):
        extract(archive, dest)
    assert not (tmp_path / "evil.txt").exists()
    assert not (dest / "fine.txt").exists()  # nothing is written before the check


def test_tar_symlink_out_of_tree_rejected(tmp_path):
    def add(tf: tarfile.TarFile) -> None:
        link = tarfile.TarInfo("data/link")
        link.type = tarfile.SYMTYPE
        link.linkname = "../../outside"
        tf.addfile(link)

    with pytest.raises(UnsafeArchiveError, match="points outside"):
        extract(_tar_with(tmp_path, "link.tar.gz", add), tmp_path / "out")

    def add_ok(tf: tarfile.TarFile) -> None:
        _add_file(tf, "data/real.txt", b"real")
        link = tarfile.TarInfo("data/alias.txt")
        link.type = tarfile.SYMTYPE
        link.linkname = "real.txt"
        tf.addfile(link)

    out = extract(_tar_with(tmp_path, "ok.tar.gz", add_ok), tmp_path / "out2")
    assert (out / "data" / "alias.txt").read_bytes() == b"real"


def test_zip_traversal_rejected_and_zip_extracts(tmp_path):
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("../evil.txt", b"x")
    with pytest.raises(UnsafeArchiveError):
        extract(bad, tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists()

    good = tmp_path / "good.zip"
    with zipfile.ZipFile(good, "w") as zf:
        zf.writestr("d/a.txt", b"a")
        zf.writestr("d/sub/b.txt", b"b")
        zf.writestr("e/c.txt", b"c")
    out = extract(good, tmp_path / "z", members=["d/sub"])
    assert (out / "d" / "sub" / "b.txt").read_bytes() == b"b"
    assert not (out / "d" / "a.txt").exists() and not (out / "e").exists()


def test_single_gz_and_interrupted_extraction_is_redone(tmp_path):
    gz = tmp_path / "train.txt.gz"
    gz.write_bytes(gzip.compress(b"hello\n" * 100))
    out = extract(gz, tmp_path / "g")
    assert (out / "train.txt").read_bytes() == b"hello\n" * 100

    blob, contents = _fixture_archive(tmp_path)
    archive = tmp_path / "r.tgz"
    archive.write_bytes(blob)
    dest = tmp_path / "r"
    # Leftovers of an interrupted run: a temp dir and a truncated file, but no marker.
    (dest / ".r.tgz.extracting" / "release").mkdir(parents=True)
    (dest / "release" / "data").mkdir(parents=True)
    (dest / "release" / "data" / "blob.bin").write_bytes(b"partial")
    extract(archive, dest)
    assert (dest / "release" / "data" / "blob.bin").read_bytes() == contents[
        "release/data/blob.bin"
    ]
    assert not (dest / ".r.tgz.extracting").exists()
    assert (dest / ".r.tgz.complete").exists()


def test_suffixless_tarball_is_detected(tmp_path):
    # LRA's release is a tar.gz named ``lra_release.gz``.
    blob, contents = _fixture_archive(tmp_path)
    archive = tmp_path / "lra_release.gz"
    archive.write_bytes(blob)
    out = extract(archive, tmp_path / "o")
    for name, data in contents.items():
        assert (out / name).read_bytes() == data


# --------------------------------------------------------------------------- cache and messages


def test_cache_dir_keys_change_with_params(tmp_path):
    a = cache_dir(tmp_path, "listops", {"max_len": 2000, "append_eos": True})
    a2 = cache_dir(tmp_path, "listops", {"append_eos": True, "max_len": 2000})
    b = cache_dir(tmp_path, "listops", {"max_len": 4000, "append_eos": True})
    c = cache_dir(tmp_path, "listops", {"max_len": 2000, "append_eos": True}, version=1)
    assert a == a2 and len({a, b, c}) == 3
    assert a.parent == tmp_path.absolute() / "listops" and len(a.name) == 12
    assert json.loads((a / "params.json").read_text())["params"] == {
        "append_eos": True,
        "max_len": 2000,
    }
    assert not prepared(a)
    mark_prepared(a, {"rows": 3})
    assert prepared(a) and not prepared(b)
    assert cache_dir(tmp_path, "listops", {"max_len": 2000, "append_eos": True}) == a
    assert prepared(a)


def test_require_files_message(tmp_path):
    present = tmp_path / "basic_train.tsv"
    present.write_text("x")
    assert require_files([present], dataset="listops", how="-") == [present]
    missing = [tmp_path / "basic_val.tsv", tmp_path / "basic_test.tsv"]
    with pytest.raises(DatasetMissingError) as info:
        require_files(
            [present, *missing],
            dataset="lra_listops",
            how="Download lra_release.gz and move lra_release/listops-1000 to data/lra/listops.",
            url="https://storage.googleapis.com/long-range-arena/lra_release.gz",
            data_dir=tmp_path,
        )
    msg = str(info.value)
    assert "'lra_listops'" in msg and "2 required file(s) missing" in msg
    for p in missing:
        assert str(p) in msg
    assert str(present) not in msg
    assert "https://storage.googleapis.com/long-range-arena/lra_release.gz" in msg
    assert "listops-1000" in msg and "paths.data_dir" in msg and str(tmp_path) in msg


def test_file_digest(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    assert file_digest(p) == _sha256(b"abc")
    assert file_digest(p, "md5") == hashlib.md5(b"abc").hexdigest()
