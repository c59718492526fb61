"""jaxloom's array format: an orbax `CheckpointHandler` that writes each process's shards as raw bytes and
reads back only the bytes a restore needs, checking each piece as it is read.

An item directory (`<step>/params/`, `<step>/opt_state/`) holds:

- `process_<i>.bin`: the bytes of every shard process `i` saved (the shards it holds whose replica id is 0,
  so each byte of the state is written once, by one process), one after another, C order;
- `process_<i>.json`: where each of them is: the array's name, the box of global indices it covers, its
  offset and size in the `.bin` file, and the xxh3-64 digest of each piece of it (runs of whole rows of
  about `PIECE` bytes);
- `arrays.json` (process 0): every array's shape, dtype and place in the tree, and the number of processes.

A restore asks, for each of its devices, the box that device holds in the target sharding (any mesh, any
number of processes), reads from the saved shards the pieces that overlap it (one `pread` per run of
pieces, in a few threads) and hashes each piece it read: integrity costs no extra read, and no process
reads bytes it does not restore beyond the piece boundaries. A flipped, truncated or missing piece is a
`CheckpointCorruptError` naming the file, the bytes and the array.

Why not orbax's own arrays (tensorstore/zarr, OCDBT): on this machine they restore at 0.07x `numpy.load`
and save at 0.78x `numpy.save`; this format reads at the speed of the page cache (docs/performance.md).
Checkpoints written by jaxloom-state < 0.9 (orbax's format) are still restored: the handler hands a
directory without `arrays.json` to orbax's `StandardCheckpointHandler`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import threading
from typing import Any

import jax
import numpy as np

from jaxloom.core import paths
from jaxloom.mesh.rules import path_str

FORMAT = 1
PIECE = 4 << 20  # bytes hashed as one piece: the granularity of a partial read
INDEX = "arrays.json"
ALIGN = 4096  # where each shard starts in a `.bin` file
# Bytes per write call. Measured on the CI machine (Firecracker VM, Linux 6.18), 100 MiB into the page cache:
# 30-37 ms in calls of 64 KiB-1 MiB, 190-260 ms in calls of 2-4 MiB.
WRITE = 512 << 10


class CheckpointCorruptError(RuntimeError):
    """A checkpoint's files do not match what was written."""


def data_file(process: int) -> str:
    return f"process_{process}.bin"


def index_file(process: int) -> str:
    return f"process_{process}.json"


def _digest(view: memoryview) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(view)


# ---- saving -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Shard:
    name: str
    start: list[int]
    stop: list[int]
    data: np.ndarray  # a host copy, C-contiguous, in the saved dtype


def _key_code(key: Any) -> list:
    """A tree path entry as JSON: `["d", key]` (dict key), `["s", i]` (sequence index), `["a", name]`."""
    tu = jax.tree_util
    if isinstance(key, tu.DictKey):
        return ["d", key.key if isinstance(key.key, int | str) else str(key.key)]
    if isinstance(key, tu.SequenceKey):
        return ["s", key.idx]
    if isinstance(key, tu.GetAttrKey):
        return ["a", key.name]
    return ["d", str(getattr(key, "key", key))]


def _box(index: tuple, shape: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """`(start, stop)` of a shard's index (a tuple of slices) in an array of `shape`."""
    start, stop = [], []
    for sl, dim in zip(index, shape, strict=False):
        a, b, _ = sl.indices(dim)
        start.append(a)
        stop.append(b)
    return start, stop


def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


class Staging:
    """Host buffers for the shards of one save, reused by the next (`take` / `give_back`). A fresh buffer
    costs page faults that, on a VM, take longer than the copy itself (measured here: 100 MiB copied into
    fresh memory 120-320 ms, into reused memory 12-35 ms). Holds at most one save's worth."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, x: Any) -> np.ndarray:
        """A C-ordered host copy of `x` (a device array or numpy), in a reused buffer when one fits."""
        key = (tuple(x.shape), np.dtype(x.dtype))
        with self._lock:
            free = self._free.get(key)
            buf = free.pop() if free else None
        if buf is None:
            return np.array(x, copy=True, order="C")
        np.copyto(buf, np.asarray(x))
        return buf

    def give_back(self, shards: list[_Shard]) -> None:
        with self._lock:
            self._free.clear()  # what the last save used, nothing older
            for s in shards:
                self._free.setdefault((s.data.shape, s.data.dtype), []).append(s.data)


def host_copy(tree: Any, staging: Staging | None = None, *, copy: bool = True) -> tuple[dict, list[_Shard]]:
    """The synchronous part of a save: `(arrays.json content, this process's shards on the host)`.
    Transfers start on every device at once, then are collected, copied into `staging`'s buffers when
    given (two at a time); training may continue (and donate the arrays) once this returns. `copy=False`
    (a save that finishes before training continues): the host views of the device buffers themselves,
    no copy on the CPU backend."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    info: dict[str, Any] = {"format": FORMAT, "process_count": jax.process_count(), "arrays": {}}
    pending = []
    for path, leaf in flat:
        name = path_str(path)
        entry: dict[str, Any] = {"path": [_key_code(k) for k in path]}
        if _is_key(getattr(leaf, "dtype", None)):
            entry["key_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        if not isinstance(leaf, jax.Array):
            leaf = np.asarray(leaf)
            entry.update(shape=list(leaf.shape), dtype=str(leaf.dtype))
            if jax.process_index() == 0:
                pending.append((name, [0] * leaf.ndim, list(leaf.shape), leaf))
        else:
            entry.update(shape=list(leaf.shape), dtype=str(leaf.dtype))
            for shard in leaf.addressable_shards:
                if shard.replica_id == 0:
                    shard.data.copy_to_host_async()
                    pending.append((name, *_box(shard.index, leaf.shape), shard.data))
        info["arrays"][name] = entry
    if not copy:
        take: Any = np.asarray
    else:
        take = staging.take if staging is not None else (lambda x: np.array(x, copy=True, order="C"))
    hosts = _all_or_raise(_pool(2, "copy"), [functools.partial(take, x) for _, _, _, x in pending])
    return info, [_Shard(name, a, b, host) for (name, a, b, _), host in zip(pending, hosts, strict=True)]


def _as_bytes(x: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(x).reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _rows(shape: list[int] | tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """`(rows, bytes per row)` of a C-ordered box: rows along the first axis (one row for a scalar)."""
    if not shape:
        return 1, itemsize
    return shape[0], math.prod(shape[1:]) * itemsize


def write(directory: Any, info: dict, shards: list[_Shard], *, threads: int = 2) -> None:
    """The background part of a save: this process's `.bin` and `.json` (and process 0's `arrays.json`).
    Each shard starts page-aligned (mapped on restore, it is used in place). On a local disk the shards are
    hashed and written by `threads` threads at once (`pwrite` at offsets laid out first); to an object
    store, streamed in order."""
    me = jax.process_index()
    chunks, offset = [], 0
    for s in shards:
        offset += -offset % ALIGN
        chunks.append({"name": s.name, "start": s.start, "stop": s.stop, "offset": offset, "nbytes": s.data.nbytes})
        offset += s.data.nbytes
    target = directory / data_file(me)
    if paths.is_uri(str(target)):
        with paths.open_write(target) as f:
            at = 0
            for s, c in zip(shards, chunks, strict=True):
                f.write(b"\0" * (c["offset"] - at))
                c["pieces"] = _write_piecewise(s.data, lambda view, f=f: f.write(view))
                at = c["offset"] + c["nbytes"]
    else:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, offset)

            def one(pair: tuple[_Shard, dict]) -> None:
                s, c = pair
                at = [c["offset"]]

                def put(view: memoryview) -> None:
                    while len(view):
                        n = os.pwrite(fd, view[:WRITE], at[0])
                        view, at[0] = view[n:], at[0] + n

                c["pieces"] = _write_piecewise(s.data, put)

            _all_or_raise(
                _pool(threads, "write"), [functools.partial(one, p) for p in zip(shards, chunks, strict=True)]
            )
        finally:
            os.close(fd)
    text = json.dumps({"format": FORMAT, "piece_bytes": PIECE, "chunks": chunks})
    with paths.open_write(directory / index_file(me)) as f:
        f.write(text.encode())
    if me == 0:
        with paths.open_write(directory / INDEX) as f:
            f.write(json.dumps(info, sort_keys=True).encode())


def _write_piecewise(data: np.ndarray, put: Any) -> list[str]:
    """Hash `data` piece by piece (runs of whole rows of about `PIECE` bytes), handing each piece to `put`:
    the digests."""
    view = _as_bytes(data)
    _, row_bytes = _rows(data.shape, data.itemsize)
    step = max(1, max(1, PIECE // max(row_bytes, 1)) * row_bytes)
    pieces = []
    for i in range(0, len(view), step):
        pieces.append(_digest(view[i : i + step]))
        put(view[i : i + step])
    return pieces


# ---- reading ----------------------------------------------------------------------------------------
def is_ours(directory: Any) -> bool:
    return (directory / INDEX).exists()


def read_info(directory: Any) -> dict:
    try:
        info = json.loads((directory / INDEX).read_text())
        if info.get("format") != FORMAT:
            raise ValueError(f"format {info.get('format')!r}, this jaxloom-state reads format {FORMAT}")
        return info
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointCorruptError(f"{directory / INDEX} is unreadable ({e})") from e


def shapes(directory: Any) -> Any:
    """The saved tree (nested dicts, and lists where the keys were sequence indices) of
    `jax.ShapeDtypeStruct`s, read from `arrays.json` alone."""
    root: dict = {}
    for entry in read_info(directory)["arrays"].values():
        node, path = root, entry["path"]
        for _, key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1][1] if path else ""] = jax.ShapeDtypeStruct(tuple(entry["shape"]), np.dtype(entry["dtype"]))
    return _lists(root)


def _lists(tree: Any) -> Any:
    """Dicts whose keys are exactly the ints 0..n-1 (sequence indices) back to lists."""
    if not isinstance(tree, dict):
        return tree
    out = {k: _lists(v) for k, v in tree.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


_mapped = 0  # bytes of mapped files this process has taken (not counted by the kernel's rchar)


def mapped_bytes() -> int:
    """Bytes of local checkpoint files this process has used by mapping them (instead of reading them),
    since it started: with `/proc/self/io`'s rchar, what a restore read."""
    return _mapped


class _Reader:
    """Byte ranges of the `.bin` files. A local file is mapped (private, copy-on-write): a range is a view of
    the page cache, with no copy, and on the CPU backend the restored arrays use it in place. An object
    store's range is one ranged read into a fresh buffer."""

    def __init__(self, directory: Any):
        self.directory = directory
        self.local = not paths.is_uri(str(directory))
        self._maps: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _map(self, process: int) -> Any:
        import mmap

        with self._lock:
            if process not in self._maps:
                fd = os.open(self.directory / data_file(process), os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    self._maps[process] = (
                        mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                        if size
                        else b""
                    )
                finally:
                    os.close(fd)  # the mapping stays valid
            return self._maps[process]

    def region(self, process: int, offset: int, nbytes: int) -> np.ndarray:
        """`nbytes` bytes at `offset` (uint8; fewer when the file is shorter)."""
        if self.local:
            mapped = self._map(process)
            count = max(0, min(nbytes, len(mapped) - offset))
            global _mapped
            with self._lock:
                _mapped += count
            return np.frombuffer(mapped, np.uint8, count, offset) if count else np.empty(0, np.uint8)
        out = _aligned_empty([nbytes], np.dtype(np.uint8))
        with paths.open_binary(self.directory / data_file(process)) as f:
            f.seek(offset)
            data = f.read(nbytes)
        out[: len(data)] = np.frombuffer(data, np.uint8)
        return out[: len(data)]


def _overlap(a0: list[int], a1: list[int], b0: list[int], b1: list[int]) -> tuple[list[int], list[int]] | None:
    lo = [max(x, y) for x, y in zip(a0, b0, strict=True)]
    hi = [min(x, y) for x, y in zip(a1, b1, strict=True)]
    return None if any(h <= low for low, h in zip(lo, hi, strict=True)) else (lo, hi)


def restore(directory: Any, abstract: Any, *, verify: bool = True, threads: int | None = None) -> Any:
    """`abstract` (a tree of `jax.ShapeDtypeStruct` with shardings) read from `directory`: each process
    reads the pieces its devices hold, checks them against their digests (unless `verify=False`) and places
    them. A target dtype other than the saved one (e.g. bfloat16 stored, float32 wanted) is cast on the
    host. `threads`: reads in flight (default 4 on a local disk, 16 on an object store)."""
    info = read_info(directory)
    chunks: dict[str, list[tuple[int, dict]]] = {}
    for process in range(int(info["process_count"])):
        try:
            index = json.loads((directory / index_file(process)).read_text())
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise CheckpointCorruptError(f"{directory / index_file(process)} is unreadable or missing ({e})") from e
        for c in index["chunks"]:
            c["piece_bytes"] = index["piece_bytes"]
            chunks.setdefault(c["name"], []).append((process, c))
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    jobs: list[_Job] = []
    for leaf_index, (path, leaf) in enumerate(flat):
        name = path_str(path)
        entry = info["arrays"].get(name)
        if entry is None:
            raise KeyError(f"array {name} is not in {directory / INDEX}")
        shape, dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
        boxes = {
            tuple(map(tuple, _box(i, shape))) for i in _sharding(leaf).addressable_devices_indices_map(shape).values()
        }
        for start, stop in sorted(boxes):
            jobs.append(_Job(name, leaf_index, list(start), list(stop), dtype, chunks.get(name, []), directory))
    reader = _Reader(directory)
    workers = threads or (4 if reader.local else 16)
    done = _all_or_raise(_pool(workers), [lambda job=job: job.run(reader, verify) for job in jobs])
    hosts: list[dict] = [{} for _ in flat]
    for job, host in zip(jobs, done, strict=True):
        hosts[job.leaf][(tuple(job.start), tuple(job.stop))] = host
    return jax.tree_util.tree_unflatten(
        treedef, _place([leaf for _, leaf in flat], [info["arrays"][path_str(p)] for p, _ in flat], hosts)
    )


def _all_or_raise(pool: concurrent.futures.ThreadPoolExecutor, calls: list) -> list:
    """Run `calls` in `pool`: their results, or the first error, raised only once no call is still running
    (a reader still touching a mapped file after the restore gave up could meet that file cut short by the
    caller, a fatal SIGBUS; a writer could write through a descriptor already closed and reused)."""
    futures = [pool.submit(call) for call in calls]
    concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    failed = next((f for f in futures if f.done() and f.exception() is not None), None)
    if failed is not None:
        for f in futures:
            f.cancel()  # not started yet: never will
        concurrent.futures.wait(futures)  # the running ones end
        raise failed.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


@functools.cache
def _pool(workers: int, role: str = "read") -> concurrent.futures.ThreadPoolExecutor:
    """Threads kept between saves and restores (starting them costs more than a small restore's reads);
    one pool per `role` ("read", "copy", "write"), so a background write never delays a restore or the
    next save's host copy."""
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"jaxloom-{role}")


def _sharding(leaf: Any) -> Any:
    return getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])


@dataclasses.dataclass
class _Job:
    """One box of one array that this process restores (what some of its devices hold)."""

    name: str
    leaf: int
    start: list[int]
    stop: list[int]
    dtype: np.dtype
    saved: list[tuple[int, dict]]  # (process, chunk) of every saved shard of the array
    directory: Any

    def run(self, reader: _Reader, verify: bool) -> np.ndarray:
        """The box's host array: the saved shard itself when it is exactly this box (a view of the mapped
        file), else assembled from the pieces of the shards that overlap it."""
        shape = [b - a for a, b in zip(self.start, self.stop, strict=True)]
        parts, covered = [], 0
        for process, c in self.saved:
            both = _overlap(c["start"], c["stop"], self.start, self.stop)
            if both is not None:
                parts.append((process, c, *both))
                covered += math.prod(h - low for low, h in zip(*both, strict=True))
        if covered != math.prod(shape):
            raise CheckpointCorruptError(
                f"checkpoint {self.directory}: the saved shards of {self.name} cover {covered} of the "
                f"{math.prod(shape)} elements [{self.start}, {self.stop}) this process restores"
            )
        if len(parts) == 1 and parts[0][1]["start"] == self.start and parts[0][1]["stop"] == self.stop:
            process, c, _, _ = parts[0]
            return self._pieces(reader, verify, process, c, 0, shape[0] if shape else 1)[1].reshape(shape)
        dest = _aligned_empty(shape, self.dtype)
        for process, c, lo, hi in parts:
            first_row = lo[0] - c["start"][0] if shape else 0
            first, rows = self._pieces(reader, verify, process, c, first_row, hi[0] - c["start"][0] if shape else 1)
            origin = [s + (first if k == 0 else 0) for k, s in enumerate(c["start"])]  # rows[0, 0, ...]
            src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin, strict=True))
            dest[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, self.start, strict=True))] = rows[src]
        return dest

    def _pieces(self, reader: _Reader, verify: bool, process: int, c: dict, r0: int, r1: int) -> tuple[int, np.ndarray]:
        """Rows `r0:r1` of chunk `c`, widened to whole pieces, read and checked: `(the chunk row they
        start at, the rows)`."""
        shape = [b - a for a, b in zip(c["start"], c["stop"], strict=True)]
        rows, row_bytes = _rows(shape, self.dtype.itemsize)
        per = max(1, c["piece_bytes"] // max(row_bytes, 1))
        p0, p1 = r0 // per, -(-r1 // per)
        first, last = p0 * per, min(p1 * per, rows)
        offset, nbytes = c["offset"] + first * row_bytes, (last - first) * row_bytes
        raw = reader.region(process, offset, nbytes)
        where = f"{self.directory / data_file(process)} bytes {offset}..{offset + nbytes} ({self.name})"
        if len(raw) != nbytes:
            raise CheckpointCorruptError(f"{where} are cut short: {len(raw)} of {nbytes} bytes found")
        step = per * row_bytes
        for i, expected in enumerate(c["pieces"][p0:p1] if verify else []):
            if _digest(memoryview(raw[i * step : (i + 1) * step])) != expected:  # type: ignore[arg-type]
                raise CheckpointCorruptError(f"{where}: piece {p0 + i} differs from what was written")
        return first, raw.view(self.dtype).reshape([last - first, *shape[1:]] if shape else [])


def _aligned_empty(shape: list[int], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised host array whose data starts at a multiple of `align` bytes: on the CPU backend,
    `jax.device_put` then uses it in place instead of copying it."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _place(leaves: list, entries: list[dict], hosts: list[dict[tuple, np.ndarray]]) -> list:
    """Each array's host boxes put on its target devices (one batched `device_put` for all of them), then
    assembled into global arrays."""
    plans, buffers, devices = [], [], []
    for leaf, entry, boxes in zip(leaves, entries, hosts, strict=True):
        shape, sharding, key = tuple(entry["shape"]), _sharding(leaf), "key_impl" in entry
        first = len(buffers)
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            start, stop = _box(index, shape)
            host = np.asarray(boxes[(tuple(start), tuple(stop))])
            buffers.append(host if key or host.dtype == np.dtype(leaf.dtype) else host.astype(leaf.dtype))
            devices.append(device)
        plans.append((shape, sharding, entry.get("key_impl"), first, len(buffers)))
    singles = jax.device_put(buffers, devices)
    out = []
    for shape, sharding, impl, a, b in plans:
        array = jax.make_array_from_single_device_arrays(shape, sharding, singles[a:b])
        out.append(jax.random.wrap_key_data(array, impl=impl) if impl else array)
    return out


# ---- orbax ------------------------------------------------------------------------------------------
@functools.cache
def orbax_types() -> tuple[type, type, type]:
    """`(ArrayHandler, Save, Restore)`: the orbax handler of this format and its save/restore arguments
    (built on first use: importing orbax costs ~0.4 s)."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.futures import future

    class ArrayHandler(ocp.AsyncCheckpointHandler):
        """Saves a tree of arrays in jaxloom's format; restores it, or an orbax `StandardCheckpointHandler`
        item (jaxloom-state < 0.9), onto the target's shardings."""

        def __init__(self) -> None:
            self._staging = Staging()  # the host copies of one async save, reused by the next

        async def async_save(self, directory, item=None, args=None):
            info, shards = host_copy(args.item, self._staging, copy=args.copy)

            async def commit():
                write(directory, info, shards)
                if args.copy:
                    self._staging.give_back(shards)

            return [future.CommitFutureAwaitingContractedSignals(commit(), name="jaxloom_arrays_save")]

        def save(self, directory, item=None, args=None):
            info, shards = host_copy(args.item, copy=False)  # written before the caller continues
            write(directory, info, shards)

        def restore(self, directory, item=None, args=None):
            if is_ours(directory):
                return restore(directory, args.item, verify=args.verify)
            return ocp.StandardCheckpointHandler().restore(directory, args=ocp.args.StandardRestore(args.item))

        def metadata(self, directory):
            if is_ours(directory):
                return shapes(directory)
            return ocp.StandardCheckpointHandler().metadata(directory)

    @ocp.args.register_with_handler(ArrayHandler, for_save=True)
    @dataclasses.dataclass
    class Save(ocp.args.CheckpointArgs):
        """`item`: the tree of arrays. `copy=False` only for a save the caller waits for (orbax's sync
        checkpointer): the write reads the device buffers' host views, with no staging copy."""

        item: Any
        copy: bool = True

    @ocp.args.register_with_handler(ArrayHandler, for_restore=True)
    @dataclasses.dataclass
    class Restore(ocp.args.CheckpointArgs):
        item: Any = None
        verify: bool = True

    return ArrayHandler, Save, Restore
