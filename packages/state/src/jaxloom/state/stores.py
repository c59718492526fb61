"""What orbax needs to checkpoint on an object store: how a step is committed, and `s3://` for tensorstore.

**Commit.** Outside `gs://`, orbax commits a step by writing it under `<step>.orbax-checkpoint-tmp-*` and
renaming the folder. On a local disk a rename is atomic; on S3 it is a copy object by object, and a
half-copied step would be listed by its name. On every object store (`gs://`, `s3://`, ...) jaxloom makes
orbax write the step in place and add `commit_success.txt` last (`CommitFileTemporaryPath`, the mode orbax
uses on `gs://`): a step is listed as complete only once that marker exists, so a step cut off by a crash,
a lost connection or SIGKILL is never restored, and keep-N deletes only complete steps older than the newest.

**S3 arrays.** orbax 0.12's tensorstore layer knows `gs://` and local paths only (it normalises `s3://b/x`
to `s3:/b/x` and calls it relative). `prepare_orbax` teaches it `s3://`: the array store becomes
tensorstore's own `s3` driver (with the endpoint of `AWS_ENDPOINT_URL` for MinIO/R2-style stores and
credentials from the environment when they are set there), done once per process, only when an `s3://`
checkpoint directory is opened, and refused with the orbax version when orbax's layout is not the one this
was written for.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from jaxloom.core import paths


def temporary_path_class(directory: Any) -> Any:
    """The orbax `TemporaryPath` class for checkpoints in `directory`: commit by marker file on an object
    store, atomic rename on a local disk (None: orbax's default)."""
    if not paths.is_uri(str(directory)):
        return None
    from orbax.checkpoint._src.path import atomicity

    return atomicity.CommitFileTemporaryPath


def prepare_orbax(directory: Any) -> None:
    """Make orbax able to write and read arrays in `directory` (a no-op except for `s3://`)."""
    if str(directory).startswith("s3://"):
        _teach_orbax_s3()


def s3_kvstore(url: str) -> dict[str, Any]:
    """The tensorstore kvstore spec of `s3://bucket/key`: the endpoint from `AWS_ENDPOINT_URL` (or
    `AWS_ENDPOINT_URL_S3`), the region from `AWS_REGION`/`AWS_DEFAULT_REGION`, and environment credentials
    when `AWS_ACCESS_KEY_ID` is set (else tensorstore's default chain: profile, instance role)."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        spec["aws_credentials"] = {"type": "environment"}
    return spec


@functools.cache
def _teach_orbax_s3() -> None:
    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

    names = ("_normalize_path", "_use_gcs_driver")
    if not all(hasattr(tsu, n) for n in names) or not hasattr(gcs_utils, "get_kvstore_for_gcs"):
        from importlib import metadata

        raise RuntimeError(
            f"orbax-checkpoint {metadata.version('orbax-checkpoint')} lays out its tensorstore paths differently "
            "from the 0.12 series jaxloom teaches s3:// to; use orbax-checkpoint 0.12, or gs:// / a mounted bucket"
        )
    normalize, use_driver, kvstore = tsu._normalize_path, tsu._use_gcs_driver, gcs_utils.get_kvstore_for_gcs

    def _normalize_path(path: str) -> str:
        out = normalize(path)
        return "s3://" + out[len("s3:/") :] if out.startswith("s3:/") and not out.startswith("s3://") else out

    def _use_remote_driver(directory: str) -> bool:
        return directory.startswith("s3://") or use_driver(directory)

    def get_kvstore(path: str) -> dict[str, Any]:
        return s3_kvstore(path) if str(path).startswith("s3://") else kvstore(path)

    tsu._normalize_path = _normalize_path
    tsu._use_gcs_driver = _use_remote_driver
    gcs_utils.get_kvstore_for_gcs = get_kvstore
