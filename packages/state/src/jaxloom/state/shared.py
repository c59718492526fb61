"""`check_shared_directory`: every process of a multi-process run sees the same run directory.

Every process writes its shards of a checkpoint into the run directory and, after a restart (perhaps on
other hosts), reads them back. A directory that is node-local (a relative path under a different working
directory, a local disk path on each host) would let each host write its own partial checkpoint and
fail, or silently differ, on resume. This check finds that before step 1.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path


def check_shared_directory(directory: str | Path, what: str = "save_directory") -> None:
    """Raise ValueError on every process when some process of this JAX run cannot see a file process 0
    writes in `directory` (named `what` in the error, with each blind process's host). One process:
    nothing to check. Collective: every process must call it."""
    import jax

    if jax.process_count() < 2:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    token = _broadcast_text(secrets.token_hex(8) if jax.process_index() == 0 else "")
    where = _broadcast_text(str(Path(directory).absolute()) if jax.process_index() == 0 else "", 1024)
    marker = Path(directory) / f".jaxloom-shared-{token}"
    if jax.process_index() == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(token)
        os.replace(tmp, marker)
    multihost_utils.sync_global_devices("jaxloom-shared-directory-written")
    try:
        seen = marker.read_text() == token
    except OSError:
        seen = False
    host = np.zeros(64, np.uint8)
    raw = socket.gethostname().encode()[:64]
    host[: len(raw)] = np.frombuffer(raw, np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(np.concatenate([[np.uint8(seen)], host])))
    multihost_utils.sync_global_devices("jaxloom-shared-directory-read")
    if jax.process_index() == 0:
        marker.unlink(missing_ok=True)
    rows = everyone.reshape(jax.process_count(), -1)
    blind = [f"process {i} on {_text(row[1:])}" for i, row in enumerate(rows) if not row[0]]
    if blind:
        raise ValueError(
            f"{what} {directory} is not shared by the processes of this run: {', '.join(blind)} cannot see "
            f"the file process 0 wrote there (on process 0: {where}). "
            "Every process writes its part of each checkpoint there and reads it back after a restart: give "
            "an absolute path on a filesystem every host mounts at the same place (NFS, a mounted bucket)."
        )


def _broadcast_text(text: str, size: int = 64) -> str:
    import numpy as np
    from jax.experimental import multihost_utils

    buf = np.zeros(size, np.uint8)
    raw = text.encode()[:size]
    buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    return _text(np.asarray(multihost_utils.broadcast_one_to_all(buf)))


def _text(buf) -> str:
    return bytes(buf).rstrip(b"\0").decode(errors="replace")
