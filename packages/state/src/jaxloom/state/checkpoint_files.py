"""What a checkpoint folder holds and how it is checked: the manifest of file sizes and hashes, each process's
array digests, and a restore target checked against the stored shapes before anything is read. Used by
`checkpoint.CheckpointManager`; `verify_folder` reads a folder with no manager."""

from __future__ import annotations

import hashlib
import json
import logging
import types
from pathlib import Path
from typing import Any

import jax

from jaxloom.core import paths

from . import arrays, integrity, stores
from .arrays import CheckpointCorruptError
from .train_state import TrainState

log = logging.getLogger("jaxloom.state.checkpoint")
CHECKSUMS = "jaxloom_checksums.json"
DIGESTS = "jaxloom_digests.process_"  # + "<process index>.json": that process's partial array digests


def verify_folder(folder: Any) -> dict[str, list]:
    """`CheckpointManager.verify` of the checkpoint in `folder` (see there)."""
    manifest = folder / CHECKSUMS
    if not manifest.exists():
        log.warning("checkpoint %s has no checksums (written before finalisation ended); not verified", folder)
        return {}
    try:
        written = json.loads(manifest.read_text())
        if not isinstance(written, dict):
            raise ValueError(f"expected a JSON object, found {type(written).__name__}")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"checkpoint {folder}: checksum manifest {CHECKSUMS} is unreadable ({e})") from e
    expected = written["files"] if "files" in written else written  # state < 0.8: {path: [size, sha256]}
    listed = paths.files_with_sizes(folder)
    actual = _checksums(folder, listed)
    for name, (size, digest) in sorted(expected.items()):
        if name not in actual:
            raise CheckpointCorruptError(f"checkpoint {folder}: file {name} is missing")
        if actual[name][0] != size:
            raise CheckpointCorruptError(
                f"checkpoint {folder}: file {name} is corrupt (size {actual[name][0]} vs {size} written)"
            )
        if actual[name][1] is not None and actual[name][1] != digest:  # array data: checked as read
            raise CheckpointCorruptError(f"checkpoint {folder}: file {name} is corrupt (checksum differs)")
    return _saved_digests(folder, listed)


def _saved_digests(folder: Any, listed: dict[str, int]) -> dict[str, list]:
    """The arrays' digests: every saving process's part added up; `{}` (not checked, with a warning)
    when a part is missing (a process stopped before writing it)."""
    names = sorted(n for n in listed if n.startswith(DIGESTS))
    if not names:  # jaxloom's array format: each piece is checked against its digest as it is read
        return {}
    try:
        parts = [json.loads((folder / n).read_text()) for n in names]
        count = parts[0]["process_count"] if parts else 0
        if not parts or len(parts) != count:
            log.warning("checkpoint %s has %d of %d digest parts; array data not verified", folder, len(parts), count)
            return {}
        return integrity.combine([p["arrays"] for p in parts])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"checkpoint {folder}: array digests unreadable ({e})") from e


def write_checksums(folder_of: Any, steps: list[int], digests: dict[int, Any]) -> None:
    """Process 0's integrity record of each of `steps` still without one, in its folder (`folder_of(step)`): the
    arrays' digests (orbax's format: `jaxloom_digests.process_0.json`, every process's part added up at save time;
    `digests` maps a step to a function returning them, and loses the steps written) and the manifest
    `{"files": {path: [size, sha256 or None]}}` (its presence marks a verified checkpoint). Array data files get
    only their size: their digests are in the digest file (orbax's format) or the item's index files (raw), which
    the manifest hashes. A step is written in its in-progress folder when it has not been committed yet
    (`in_progress`), so that it commits with its record."""
    if jax.process_index() != 0:
        digests.clear()  # every process's part is process 0's to write
        return
    for step in steps:
        write_integrity(folder_of(step), digests.pop(step, None))
    for step in [s for s in digests if steps and s < min(steps)]:  # removed by keep-N
        del digests[step]


def commit_records(directory: Any, digests: dict[int, Any], name_of: Any = str) -> None:
    """Before orbax commits (process 0): the integrity record of each step of `digests` into its in-progress folder
    (`write_integrity`; `name_of(step)`: the folder name this writer saves it under); the steps written are removed
    from `digests`."""
    for step in sorted(digests):
        folder = in_progress(directory, name_of(step))
        if folder is not None and write_integrity(folder, digests[step]):
            del digests[step]


def in_progress(directory: Any, name: str) -> Any:
    """The folder the checkpoint named `name` (`step_names.step_name`) is being written in before orbax commits it:
    `<name>.orbax-checkpoint-tmp*` beside the final folder (atomic rename, a local disk), or the final folder itself
    (commit by marker file, on an object store); None when neither exists."""
    from orbax.checkpoint._src.path import atomicity

    found = sorted(directory.glob(f"{name}{atomicity.TMP_DIR_SUFFIX}*"), key=str)
    if found:
        return found[-1]
    final = directory / name
    return final if final.exists() else None


def write_integrity(folder: Any, digests: Any = None) -> bool:
    """Write `folder`'s integrity record unless it has one: the arrays' digests (`digests()`, when given) and the
    manifest, each atomically, the manifest last. False when the folder is gone (deleted by keep-N meanwhile)."""
    try:
        if (folder / CHECKSUMS).exists():
            return True
        if digests is not None:
            part = {"process_count": 1, "arrays": digests()}
            paths.write_atomic(folder / f"{DIGESTS}0.json", json.dumps(part, sort_keys=True))
        paths.write_atomic(folder / CHECKSUMS, json.dumps({"files": _checksums(folder)}, sort_keys=True))
        return True
    except FileNotFoundError:  # not there yet, or deleted by keep-N meanwhile
        return False


def read_items(folder: Any, trees: dict[str, Any], verify: bool) -> Any:
    """The items `trees` names (read onto their shapes and shardings) and `meta` of the checkpoint in `folder`:
    directly in jaxloom's format (each piece checked against its digest as it is read when `verify`), through
    orbax for a checkpoint of jaxloom-state < 0.9."""
    meta = json.loads((folder / "meta" / "metadata").read_text())
    if arrays.is_ours(folder / "params"):
        out = {k: arrays.restore(folder / k, _as_abstract(v), verify=verify) for k, v in trees.items()}
        return types.SimpleNamespace(meta=meta, **out)
    import orbax.checkpoint as ocp

    stores.prepare_orbax(folder.parent)
    read = {
        k: ocp.StandardCheckpointHandler().restore(folder / k, args=ocp.args.StandardRestore(_as_abstract(v)))
        for k, v in trees.items()
    }
    return types.SimpleNamespace(meta=meta, **read)


def set_aside(folder: Any, step: int) -> Any:
    """Rename the corrupt checkpoint `folder` (of `step`) to `<name>.corrupt` (process 0; every process waits for
    it), so that it is never chosen again and a new checkpoint of that step can be written. Returns the new path."""
    dest, n = folder.with_name(f"{folder.name}.corrupt"), 1
    while dest.exists():
        dest, n = folder.with_name(f"{folder.name}.corrupt.{n}"), n + 1
    if jax.process_index() == 0:
        paths.move(folder, dest)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"jaxloom-set-aside-{step}")
    return dest


def _as_abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


def check_target(manager: Any, target: TrainState, step: int, params_only: bool) -> None:
    """Before reading anything of checkpoint `step` of `manager`: `target`'s shapes are the stored ones (the params,
    and the optimizer state unless `params_only`), and its shardings divide them; else one error naming them."""
    items = {"params": target.params}
    if not params_only and jax.tree_util.tree_leaves(target.opt_state):
        items["opt_state"] = target.opt_state
    for item, tree in items.items():
        try:
            found = manager.restore_shapes(step, item)
        except (ValueError, OSError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointCorruptError(
                f"checkpoint {manager.step_folder(step)}: metadata unreadable ({type(e).__name__}: {str(e)[:200]})"
            ) from e
        stored = {k: v.shape for k, v in flat_leaves(found).items()} if found is not None else {}
        wanted = {k: v.shape for k, v in flat_leaves(tree).items()}
        problems = [
            f"{k}: stored {stored.get(k, 'nothing')} vs this run's {wanted.get(k, 'nothing')}"
            for k in sorted(set(stored) | set(wanted))
            if stored.get(k) != wanted.get(k)
        ]
        if problems:
            what = "model shape" if item == "params" else "optimizer (its state differs)"
            raise ValueError(
                f"checkpoint {manager.step_folder(step)} was written for another configuration, another "
                f"{what}: "
                + "; ".join(problems[:10])
                + (" …" if len(problems) > 10 else "")
                + ". Train into a new save_directory, or set overwrite_output_dir=true to start over in this one."
            )
    for name, leaf in flat_leaves(target.params).items():
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            raise ValueError(
                f"restore target parameter {name} has no sharding; build the target with "
                "jax.eval_shape and attach shardings (see state_shardings)"
            )
        if hasattr(sharding, "spec"):
            from jaxloom.mesh import validate_specs

            try:
                validate_specs({name: sharding.spec}, {name: leaf}, sharding.mesh)
            except ValueError as e:
                raise ValueError(
                    f"parameter {name} with shape {tuple(leaf.shape)} cannot be placed on the target mesh: {e}"
                ) from None


def _is_array_data(relative: Path) -> bool:
    """Array bytes (jaxloom's `process_<i>.bin`, or orbax/OCDBT `d/` files of jaxloom-state < 0.9): checked by
    their digests as they are read, not hashed."""
    return relative.suffix == ".bin" or "d" in relative.parts[:-1]


# Files orbax may rewrite after a step is committed on an object store (the commit time stamped into
# _CHECKPOINT_METADATA, OCDBT manifests updated as the per-process databases are merged): not in the manifest.
# Nothing is restored from the first two; a damaged OCDBT manifest fails the read itself (-> corrupt).
_ORBAX_BOOKKEEPING = ("_CHECKPOINT_METADATA", "commit_success.txt", "manifest.ocdbt")


def _checksums(folder: Any, listed: dict[str, int] | None = None) -> dict[str, list]:
    """`{relative path: [size, sha256 or None]}`: array data files get only their size (from the listing).
    jaxloom's own files (the manifest, the digest parts, written beside it) are not listed."""
    out: dict[str, list] = {}
    listed = paths.files_with_sizes(folder) if listed is None else listed
    for name, size in sorted(listed.items()):
        base = name.rsplit("/", 1)[-1]
        if base.startswith("jaxloom_") or base in _ORBAX_BOOKKEEPING:
            continue
        digest = None
        if not _is_array_data(Path(name)):
            h = hashlib.sha256()
            with (folder / name).open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):  # noqa: B023 - consumed at once
                    h.update(chunk)
            digest = h.hexdigest()
        out[name] = [size, digest]
    return out


def flat_leaves(tree: Any) -> dict[str, Any]:
    """`tree`'s leaves by their path names (`jaxloom.mesh.named_leaves`), as digests and manifests name them."""
    from jaxloom.mesh import named_leaves

    return dict(named_leaves(tree))


def fenced_steps(steps: list[int], read_meta: Any) -> list[tuple[int, int, int]]:
    """`(step, its lease generation, the newer generation)` of each of `steps` written by an older lease generation
    than a lower step's (`read_meta(step)["lease_generation"]`): a run paused past its lease that wrote after
    another run took the directory over. Checkpoints without a generation (a local disk) are never fenced out;
    an unreadable one is left to the restore to report."""
    newest, out = 0, []
    for s in sorted(steps):
        try:
            generation = read_meta(s).get("lease_generation")
        except (OSError, ValueError):
            continue
        if generation is None:
            continue
        if generation < newest:
            out.append((s, generation, newest))
        newest = max(newest, generation)
    return out


def stored_shapes(folder: Any, item: str) -> Any:
    """The stored shapes and dtypes (`jax.ShapeDtypeStruct` tree) of `item` of the checkpoint in `folder`, without
    reading weights; None when it has no such item (either array format: jaxloom's or orbax's own)."""
    where = folder / item
    if arrays.is_ours(folder / "params"):
        return arrays.shapes(where) if where.exists() else None
    if not where.exists():
        return None
    import orbax.checkpoint as ocp

    stores.prepare_orbax(folder.parent)
    tree = ocp.StandardCheckpointHandler().metadata(where)
    tree = getattr(tree, "tree", tree)
    return jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype),
        tree,
        is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"),
    )
