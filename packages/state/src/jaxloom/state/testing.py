"""Test helpers, not part of the main API: a real Google Cloud Storage server and a real S3 server (moto) on
loopback, and a relay that takes a store out of reach for a while (`Outage`).

`gcs_emulator()` starts `gcp-storage-emulator` (pip, a test extra) on 127.0.0.1 and points tensorstore
(orbax's reads and writes), gcsfs/etils (listings, small files) and child processes at it through the
environment; nothing reaches the network. It yields the bucket's URI, `gs://<bucket>`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator


# The emulator, with two fidelity fixes: real GCS sends an object's generation in `x-goog-generation` (and
# `x-goog-metageneration`) on every media download, and tensorstore's OCDBT driver relies on it for its
# conditional writes ("Malformed StorageGeneration" without it); real GCS refuses an upload whose
# `ifGenerationMatch` is not the object's generation (0: the object must not exist) with 412, which the run
# directory's lease relies on.
_SERVER = """
import sys
from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])
    except Exception:
        pass
    return _download(request, response, storage, *args, **kwargs)


objects.download = download
_insert = objects.insert


def insert(request, response, storage, *args, **kwargs):
    wanted = request.query.get("ifGenerationMatch")
    if wanted:
        try:
            current = str(storage.get_file_obj(request.params["bucket_name"], request.query["name"][0])["generation"])
        except Exception:
            current = "0"
        if current != wanted[0]:
            from http import HTTPStatus

            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "a pre-condition you specified did not hold"}})
            return
    return _insert(request, response, storage, *args, **kwargs)


objects.insert = insert
from gcp_storage_emulator.__main__ import main

main(sys.argv[1:])
"""


def wait_until_up(url: str, bucket: str, server: subprocess.Popen | None = None, timeout: float = 60) -> None:
    """Wait until the emulator at `url` answers for `bucket` (RuntimeError after `timeout` s, or when `server`,
    its process, has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b/{bucket}", timeout=2).read()
            return
        except OSError:
            if (server is not None and server.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"the GCS emulator did not start on {url}") from None
            time.sleep(0.2)


def emulator_command(port: int, bucket: str, data_dir: str | None = None) -> list[str]:
    """The command that runs the GCS emulator on 127.0.0.1:`port` with `bucket`: in memory, or keeping its objects
    in `data_dir` (so a test can stop the server and start it again with the same objects)."""
    storage = ["-d", str(data_dir)] if data_dir else []
    memory = [] if data_dir else ["--in-memory"]
    return [
        sys.executable, "-c", _SERVER, *storage, "start", "--host=127.0.0.1", f"--port={port}", *memory, "--quiet",
        f"--default-bucket={bucket}",
    ]  # fmt: skip


@contextlib.contextmanager
def gcs_emulator(bucket: str = "jaxloom-test", data_dir: str | None = None) -> Iterator[str]:
    """Run a GCS emulator for the duration of the block, with `bucket` created, in memory (or its objects kept in
    `data_dir`); the block sees `STORAGE_EMULATOR_HOST`, `TENSORSTORE_GCS_HTTP_URL` and
    `GOOGLE_AUTH_TOKEN_FOR_TESTING` set, and the server's process id in `JAXLOOM_GCS_EMULATOR_PID`."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        emulator_command(port, bucket, data_dir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    keys = (
        "STORAGE_EMULATOR_HOST",
        "TENSORSTORE_GCS_HTTP_URL",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING",
        "NO_PROXY",
        "no_proxy",
        "JAXLOOM_GCS_EMULATOR_PID",
    )
    saved = {k: os.environ.get(k) for k in keys}
    loopback = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1,localhost"]))
    os.environ.update(NO_PROXY=loopback, no_proxy=loopback)  # never through a proxy
    os.environ["JAXLOOM_GCS_EMULATOR_PID"] = str(server.pid)  # a test can stop the server (a store that goes away)
    try:
        wait_until_up(url, bucket, server)
        os.environ.update(
            STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="testing"
        )
        _forget_filesystems()
        yield f"gs://{bucket}"
    finally:
        _stop(server, saved)


def _stop(server: subprocess.Popen, saved: dict[str, str | None]) -> None:
    """Stop a store server and put the environment back as it was before it started."""
    server.terminate()
    server.wait(timeout=30)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _forget_filesystems()


def _forget_filesystems() -> None:
    """fsspec (and etils) cache a filesystem per protocol: drop them, so the next one reads the new endpoint."""
    from jaxloom.core import paths

    paths.forget_clients()


S3_KEYS = (
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
    "NO_PROXY",
    "no_proxy",
    "JAXLOOM_S3_SERVER_PID",
)


def s3_server_command(port: int) -> list[str]:
    """The command that runs moto's S3 server (a real HTTP S3 API, objects in memory) on 127.0.0.1:`port`."""
    return [sys.executable, "-c", "import sys; from moto.server import main; main(sys.argv[1:])", "-H", "127.0.0.1",
            "-p", str(port)]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(bucket: str = "jaxloom-test") -> Iterator[str]:
    """Run moto's S3 server on loopback for the duration of the block, with `bucket` created; the block (and
    any child process) sees `AWS_ENDPOINT_URL`, test credentials and a region in the environment, and the
    server's process id in `JAXLOOM_S3_SERVER_PID`. Yields `s3://<bucket>`."""
    port = _free_port()
    server = subprocess.Popen(s3_server_command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in S3_KEYS}
    loopback = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1,localhost"]))
    os.environ.update(
        NO_PROXY=loopback, no_proxy=loopback, AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1", JAXLOOM_S3_SERVER_PID=str(server.pid),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                req = urllib.request.Request(f"{url}/{bucket}", method="PUT")
                urllib.request.urlopen(req, timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 server did not start on {url}") from None
                time.sleep(0.2)
        _forget_filesystems()
        yield f"s3://{bucket}"
    finally:
        _stop(server, saved)


class Outage:
    """A TCP relay on 127.0.0.1 in front of a store's endpoint, which a test can take down (`down()`: every
    connection, open or new, is cut) and bring back (`up()`): a store that cannot be reached for a while,
    with its objects kept. `url` is the relay's address; `refused` counts the connections cut while down;
    `stop()` ends it."""

    def __init__(self, upstream: str):
        import threading

        host, port = upstream.removeprefix("http://").rstrip("/").rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._available = threading.Event()
        self._available.set()
        self._open: set[socket.socket] = set()
        self._guard = threading.Lock()
        self._stopped = False
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def down(self) -> None:
        self._available.clear()
        with self._guard:
            for s in list(self._open):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
            self._open.clear()

    def up(self) -> None:
        self._available.set()

    def stop(self) -> None:
        self._stopped = True
        self.down()
        self._listener.close()

    def _accept(self) -> None:
        import threading

        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._available.is_set():
                client.close()
                self.refused += 1
                continue
            try:
                server = socket.create_connection(self._upstream, timeout=10)
            except OSError:
                client.close()
                continue
            with self._guard:
                self._open.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()
            with self._guard:
                self._open.discard(a)
                self._open.discard(b)
