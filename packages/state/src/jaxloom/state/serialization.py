"""The one JSON codec for configs: dataclasses, pydantic models, JAX dtypes, enums, tuples and `PartitionAxis`.

`to_jsonable` turns a value into plain JSON data with markers where a type must come back;
`from_jsonable` turns it back. `encode_variables` / `decode_variables` write a flat dict of model config
variables the way EasyDeL's `RayDistributedConfig` persists them (dtypes as names, keyed by `DTYPE_KEYS`).
No pickle, and no arbitrary imports: only the types listed here.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxloom.mesh import PartitionAxis

_DTYPE, _TUPLE, _PA = "__dtype__", "__tuple__", "__partition_axis__"
# Model config variables holding dtypes: stored as their names ("bfloat16") by `encode_variables`.
DTYPE_KEYS = ("dtype", "param_dtype", "attn_dtype", "attn_softmax_dtype")


def _is_dtype(value: Any) -> bool:
    if isinstance(value, np.dtype):
        return True
    try:
        return isinstance(value, type) and issubclass(value, np.generic) or value in (jnp.bfloat16,)
    except TypeError:
        return False


def to_jsonable(value: Any) -> Any:
    """Plain JSON data for `value`: dataclasses, pydantic models, dtypes, enums, tuples, `PartitionAxis`."""
    if isinstance(value, PartitionAxis):
        return {_PA: value.to_dict()}
    if _is_dtype(value) or type(value).__name__ == "_ScalarMeta":
        return {_DTYPE: jnp.dtype(value).name}
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "model_dump"):  # pydantic
        return {k: to_jsonable(getattr(value, k)) for k in type(value).model_fields}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {_TUPLE: [to_jsonable(v) for v in value]}
    if isinstance(value, list):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"cannot store {type(value).__name__} {value!r} in a JSON config")


def from_jsonable(value: Any) -> Any:
    """The inverse of `to_jsonable` for `value`: dtypes, tuples and `PartitionAxis` come back."""
    if isinstance(value, dict):
        if set(value) == {_DTYPE}:
            return jnp.dtype(value[_DTYPE])
        if set(value) == {_TUPLE}:
            return tuple(from_jsonable(v) for v in value[_TUPLE])
        if set(value) == {_PA}:
            return PartitionAxis.from_dict(value[_PA])
        return {k: from_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_jsonable(v) for v in value]
    return value


def save_json(value: Any, path: str | Path) -> Path:
    """Write `value` (through `to_jsonable`) to `path` atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(to_jsonable(value), indent=2, sort_keys=True))
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def load_json(path: str | Path) -> Any:
    """Read `path`, a JSON file written by `save_json`; a clear error for a missing or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no JSON file at {path}")
    try:
        return from_jsonable(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def encode_variables(variables: dict[str, Any] | None) -> dict[str, Any] | None:
    """A flat dict of model config variables as EasyDeL persists them (`RayDistributedConfig`): dtypes under
    `DTYPE_KEYS` as their names, `precision` as its name, `PartitionAxis` as a dict, enums as their values,
    tuples as lists. The inverse is `decode_variables`."""
    import jax.numpy as jnp

    if variables is None:
        return None
    out = {}
    for key, value in variables.items():
        if key in DTYPE_KEYS and value is not None:
            value = jnp.dtype(value).name
        elif key == "precision" and isinstance(value, enum.Enum):
            value = value.name.lower()  # jax.lax.Precision.DEFAULT → "default"
        elif isinstance(value, PartitionAxis):
            value = value.to_dict()
        elif isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


def decode_variables(variables: dict[str, Any] | None) -> dict[str, Any] | None:
    """The inverse of `encode_variables`; a name that is not a dtype or precision is an error naming the key."""
    import jax.numpy as jnp

    if variables is None:
        return None
    out = {}
    for key, value in variables.items():
        if key in DTYPE_KEYS and isinstance(value, str):
            try:
                value = jnp.dtype(value)
            except TypeError:
                raise ValueError(
                    f"config_variables[{key!r}] = {value!r} is not a dtype; expected e.g. 'float32' or 'bfloat16'"
                ) from None
        elif key == "precision" and isinstance(value, str):
            import jax

            try:
                value = jax.lax.Precision[value.upper()]
            except KeyError:
                raise ValueError(
                    f"config_variables['precision'] = {value!r}; expected 'default', 'high' or 'highest'"
                ) from None
        elif key == "partition_axis" and isinstance(value, dict):
            value = PartitionAxis.from_dict(value)
        elif key.startswith("sharding_") and isinstance(value, list):
            value = tuple(value)
        out[key] = value
    return out
