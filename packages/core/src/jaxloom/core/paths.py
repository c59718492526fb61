"""One small path layer: a local path or an object-store URI (`gs://bucket/run`, and the other schemes
`etils.epath`/`fsspec` support), never `pathlib` on a URI.

`as_path` gives a `pathlib.Path` (absolute) for local paths and an `etils.epath.Path` for URIs; both answer
`/`, `exists`, `is_dir`, `iterdir`, `read_text`, `write_text`, `name`, `open`. What differs is here:
listing a tree with sizes (one listing request on an object store, not one per file), writing a small file
atomically, moving a folder and removing one.

Used by checkpoints (jaxloom-state), data files (jaxloom-data) and the trainer (its run directory). Object
stores need the store's fsspec package: `gcsfs` for gs:// (`pip install jaxloom-core[gcs]`), `s3fs` for
s3:// (`pip install jaxloom-core[s3]`). An S3-compatible store (MinIO, R2, Ceph) is named by its endpoint:
`AWS_ENDPOINT_URL=https://...` in the environment (read by s3fs/botocore and by jaxloom-state's
tensorstore spec), or the `storage_endpoint_url` setting of a run, which sets it.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

WORKING_SCHEMES = ("gs", "s3")


def is_uri(path: Any) -> bool:
    """Whether `path` names an object-store location (`scheme://...`) rather than a local path."""
    return "://" in os.fspath(path) if isinstance(path, str | os.PathLike) else False


def as_path(path: Any) -> Any:
    """`path` as a `pathlib.Path` (local, made absolute) or an `etils.epath.Path` (a URI)."""
    text = str(path) if is_uri(str(path)) else os.fspath(path)
    if not is_uri(text):
        return Path(text).absolute()
    _quiet_clients()
    from etils import epath

    return epath.Path(text)


def check_writable_target(path: Any, key: str) -> None:
    """Refuse, in one line naming `key`, a local directory `path` that cannot be made because a regular file
    stands where it or one of its parents should be (`save_directory=afile/run` with `afile` a file): found
    before anything is written, instead of a `NotADirectoryError` traceback from deep inside a run. URIs pass
    (an object store has no such thing)."""
    if path is None or is_uri(str(path)):
        return
    target = Path(os.fspath(path)).expanduser().absolute()
    for p in (target, *target.parents):
        if p.exists():
            if not p.is_dir():
                raise ValueError(
                    f"{key} = {os.fspath(path)!r}: {p} is a file where a directory is needed; expected a directory "
                    f"path (choose another path for {key}, or move the file {p} away)"
                )
            return


def open_binary(path: Any) -> Any:
    """`path` opened for reading bytes: a local file, or a seekable object-store file (fsspec)."""
    if not is_uri(str(path)):
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    fs, p = _fs(path)
    return fs.open(p, "rb")


def open_write(path: Any) -> Any:
    """`path` opened for writing bytes: a local file, or an object-store upload (fsspec; streamed in
    blocks, visible once closed)."""
    if not is_uri(str(path)):
        return open(path, "wb")  # noqa: SIM115 - the caller closes it
    fs, p = _fs(path)
    return fs.open(p, "wb")


def upload_tree(local: Any, dest: Any) -> None:
    """Copy the files of local folder `local` to `dest` (a URI or a local folder)."""
    for name in files_with_sizes(local):
        with open(os.path.join(local, name), "rb") as src, open_write(f"{os.fspath(dest).rstrip('/')}/{name}") as out:
            shutil.copyfileobj(src, out, 4 << 20)


class _OneLineRetries(logging.Filter):
    """An object-store client's "out of retries" records, kept as their one-line message: the traceback of each
    failed attempt (several per operation) said nothing the error that follows does not."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


class _LostConnectionTasks(logging.Filter):
    """asyncio's "Task exception was never retrieved" for an upload whose connection the store dropped: the
    client retried (or failed with its own error, which is reported); the abandoned task's traceback is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "never retrieved" not in str(record.msg):
            return True
        future = record.__dict__.get("future") or (
            record.args[0] if isinstance(record.args, tuple) and record.args else None
        )
        text = str(record.getMessage()) + repr(future)
        return not any(s in text for s in ("ConnectionReset", "closing transport", "ClientOSError", "Connection reset"))


_QUIET = _OneLineRetries()
_LOST = _LostConnectionTasks()


def _quiet_clients() -> None:
    for name in ("gcsfs", "s3fs"):
        client_log = logging.getLogger(name)
        if _QUIET not in client_log.filters:
            client_log.addFilter(_QUIET)
    asyncio_log = logging.getLogger("asyncio")
    if _LOST not in asyncio_log.filters:
        asyncio_log.addFilter(_LOST)


def _fs(path: Any) -> tuple[Any, str]:
    """The fsspec filesystem etils (and so orbax) uses for `path`, and the path within it: one instance, so
    a listing cached by one is invalidated by the other's changes."""
    from etils.epath import backend

    _quiet_clients()

    fs = backend.fsspec_backend.fs(str(path))
    return fs, fs._strip_protocol(str(path))


def forget_clients() -> None:
    """Drop every cached object-store client (fsspec's instances, and the one etils keeps per scheme), so the
    next one reads the environment again: a new endpoint (`AWS_ENDPOINT_URL`, `STORAGE_EMULATOR_HOST`) or
    credentials take effect."""
    import contextlib

    with contextlib.suppress(ImportError):
        import fsspec

        fsspec.AbstractFileSystem.clear_instance_cache()
        for cls in fsspec.registry.values():
            with contextlib.suppress(AttributeError):
                cls.clear_instance_cache()
    with contextlib.suppress(ImportError, AttributeError):
        from etils.epath import backend

        type(backend.fsspec_backend)._get_filesystem.cache_clear()


def files_with_sizes(folder: Any) -> dict[str, int]:
    """`{path relative to folder (with /): size in bytes}` of every file under `folder`: `os.walk` locally,
    one recursive listing on an object store."""
    if not is_uri(str(folder)):
        out = {}
        for root, _, names in os.walk(folder):
            for name in names:
                full = os.path.join(root, name)
                out[os.path.relpath(full, folder).replace(os.sep, "/")] = os.stat(full).st_size
        return out
    fs, base = _fs(folder)
    base = base.rstrip("/")
    fs.invalidate_cache(base)  # another process (or host) may have written since this one last listed
    found = fs.find(base, detail=True)
    return {
        name[len(base) + 1 :]: int(info.get("size") or 0)
        for name, info in found.items()
        if info.get("type") != "directory" and name.startswith(base + "/")
    }


def write_atomic(path: Any, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old content or the new, never a part: a rename
    locally; on an object store one upload is already all or nothing."""
    if is_uri(str(path)):
        path.write_text(text)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def move(src: Any, dst: Any) -> None:
    """Rename folder `src` to `dst` (on an object store: a server-side copy of each object, then delete)."""
    if is_uri(str(src)):
        fs, a = _fs(src)
        b = _fs(dst)[1]
        if fs.isfile(a):
            fs.copy(a, b)
            fs.rm(a)
            return
        for name in files_with_sizes(src):
            fs.copy(f"{a.rstrip('/')}/{name}", f"{b.rstrip('/')}/{name}")
        fs.rm(a, recursive=True)
        return
    src.rename(dst)


def remove_tree(path: Any) -> None:
    """Remove folder or file `path` if it exists."""
    if is_uri(str(path)):
        fs, p = _fs(path)
        if fs.exists(p):
            fs.rm(p, recursive=True)
        return
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ---- conditional writes (a lease object on a store) -------------------------------------------------------
class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (create) or changed since it was read (replace)."""


def read_versioned(path: Any) -> tuple[bytes, str] | None:
    """`(content, version)` of object `path` (S3: its ETag; GCS: its generation), or None when there is none."""
    fs, p = _fs(path)
    fs.invalidate_cache(p)
    try:
        info = fs.info(p)
        data = fs.cat_file(p)
    except FileNotFoundError:
        return None
    version = info.get("ETag") or info.get("etag") if str(path).startswith("s3://") else info.get("generation")
    return data, str(version)


def write_if(path: Any, data: bytes, version: str | None) -> None:
    """Write object `path` only if it does not exist (`version` None) or is still at `version` (as
    `read_versioned` gave it); `PreconditionFailed` otherwise. One request; the store decides (S3
    `If-None-Match`/`If-Match`, GCS `ifGenerationMatch`), so of two writers racing exactly one wins."""
    scheme = str(path).split("://", 1)[0]
    if scheme not in ("s3", "gs", "gcs"):
        raise ValueError(f"{path}: no conditional write for {scheme}:// (expected s3:// or gs://)")
    fs, p = _fs(path)
    try:
        if scheme == "s3":
            condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
            fs.pipe_file(p, data, **condition)
        elif scheme in ("gs", "gcs"):
            from fsspec.asyn import sync

            bucket, key = p.split("/", 1)
            url = f"{fs._location}/upload/storage/v1/b/{bucket}/o"
            generation = 0 if version is None else int(version)
            sync(fs.loop, fs._call, "POST", url, uploadType="media", name=key, ifGenerationMatch=generation, data=data)
    except (FileExistsError, OSError) as e:
        if isinstance(e, FileExistsError) or "pre-condition" in str(e).lower() or "412" in str(e):
            raise PreconditionFailed(str(path)) from e
        raise
    finally:
        fs.invalidate_cache(p)


def remove_file(path: Any) -> None:
    """Remove file `path` (local or on a store) if it exists."""
    if not is_uri(str(path)):
        Path(path).unlink(missing_ok=True)
        return
    fs, p = _fs(path)
    try:
        fs.rm_file(p)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(p)


def download_tree(src: Any, local: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy the files under URI `src` into local folder `local` (created), but those whose relative path
    starts with one of `skip`; returns the relative paths copied."""
    copied = []
    for name in files_with_sizes(src):
        if name.startswith(skip):
            continue
        dest = Path(local) / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open_binary(f"{os.fspath(src).rstrip('/')}/{name}") as inp, open(dest, "wb") as out:
            shutil.copyfileobj(inp, out, 4 << 20)
        copied.append(name)
    return copied
