"""`PartitionAxis`: which mesh axes each logical role is sharded over.

Models name the dimensions of their parameters and activations with logical names (`"batch"`,
`"embed"`, `"heads"`, ...). `PartitionAxis` is the one place that maps them to mesh axes, with a
separate mapping for parameters, activations and decoding (levanter's compute vs parameter mapping).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Union

from jax.sharding import PartitionSpec
from pydantic import BeforeValidator

from jaxloom.core.schema import config

AxisSpec = Union[str, tuple[str, ...], None]
Kind = Literal["param", "activation", "decode"]
_Axis = Annotated[AxisSpec, BeforeValidator(lambda v: _normalise(v))]

# Logical dimension names used by jaxloom models.
LOGICAL_NAMES: tuple[str, ...] = (
    "batch",
    "length",
    "query_length",
    "key_length",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "kv_head_dim",
    "mlp",
    "vocab",
    "expert",
    "expert_gate",
    "bias_heads",
    "bias_key_length",
    "norm",
)
"""The logical dimension names models use; `PartitionAxis.rules` maps each to mesh axes."""


@config
class PartitionAxis:
    """Logical role → mesh axis (or tuple of axes, or None for replicated).

    Field names and defaults follow EasyDeL's `PartitionAxis`, so configs written for it load here.
    Each field is a mesh axis name, a tuple of them, or None (replicated).

    Arguments, grouped:

    - `data_parallel_axis`, `fully_sharded_data_parallel_axis`, `tensor_parallel_axis`,
      `sequence_parallel_axis`, `expert_parallel_axis`: the mesh's axis for each kind of parallelism.
    - `batch_axis`, `sequence_axis`, `query_sequence_axis`, `key_sequence_axis`: activations' batch and
      sequence dimensions (training and prefill).
    - `head_axis`, `kv_head_axis`, `attention_dim_axis`, `attention_kv_dim_axis`: attention heads and
      their per-head dimension, for queries and for keys/values.
    - `hidden_state_axis`: the model dimension of activations (parameters use
      `fully_sharded_data_parallel_axis` for it).
    - `mlp_intermediate_axis`, `vocab_axis`, `expert_axis`, `expert_gate_axis`: MLP width, vocabulary,
      experts and the router's expert dimension.
    - `bias_head_sequence_axis`, `bias_key_sequence_axis`: attention-bias dimensions.
    - `decode_batch_axis`, `decode_query_sequence_axis`, `decode_head_axis`, `decode_kv_head_axis`,
      `decode_key_sequence_axis`, `decode_attention_dim_axis`, `decode_attention_kv_dim_axis`: the same
      roles while decoding with a KV cache.
    """

    data_parallel_axis: _Axis = "dp"
    fully_sharded_data_parallel_axis: _Axis = "fsdp"
    tensor_parallel_axis: _Axis = "tp"
    sequence_parallel_axis: _Axis = "sp"
    expert_parallel_axis: _Axis = "ep"
    batch_axis: _Axis = ("fsdp", "dp")
    sequence_axis: _Axis = "sp"
    query_sequence_axis: _Axis = "sp"
    head_axis: _Axis = "tp"
    kv_head_axis: _Axis = "tp"
    key_sequence_axis: _Axis = "sp"
    hidden_state_axis: _Axis = "tp"
    mlp_intermediate_axis: _Axis = "tp"
    vocab_axis: _Axis = "tp"
    expert_axis: _Axis = "ep"
    expert_gate_axis: _Axis = None
    attention_dim_axis: _Axis = None
    attention_kv_dim_axis: _Axis = None
    bias_head_sequence_axis: _Axis = None
    bias_key_sequence_axis: _Axis = None
    decode_batch_axis: _Axis = ("fsdp", "dp")
    decode_query_sequence_axis: _Axis = None
    decode_head_axis: _Axis = "tp"
    decode_kv_head_axis: _Axis = "tp"
    decode_key_sequence_axis: _Axis = "sp"
    decode_attention_dim_axis: _Axis = None
    decode_attention_kv_dim_axis: _Axis = None

    # ---- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: tuples become lists; `from_dict(to_dict())` is the same object."""
        return {
            f.name: (list(v) if isinstance(v, tuple) else v)
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PartitionAxis:
        """Inverse of `to_dict`: `data` maps field names to axes; unknown fields are an error."""
        return cls(**dict(data))

    def to_json(self) -> str:
        """The mapping as a JSON string (`from_json` reads it back)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PartitionAxis:
        """Inverse of `to_json`: `text` is a JSON object of fields."""
        return cls.from_dict(json.loads(text))

    # ---- logical names → mesh axes --------------------------------------------------------------
    def rules(self, kind: Kind = "activation") -> dict[str, AxisSpec]:
        """The mapping from every logical name to mesh axes; `kind` is `"param"`, `"activation"` or
        `"decode"`."""
        if kind == "param":
            # Parameters: the model dimension over fsdp (ZeRO-3 style), the parallel dims over tp/ep.
            return {
                "embed": self.fully_sharded_data_parallel_axis,
                "heads": self.head_axis,
                "kv_heads": self.kv_head_axis,
                "head_dim": None,
                "kv_head_dim": None,
                "mlp": self.mlp_intermediate_axis,
                "vocab": self.vocab_axis,
                "expert": self.expert_axis,
                "expert_gate": self.expert_gate_axis,
                "norm": None,
                "batch": None,
                "length": None,
                "query_length": None,
                "key_length": None,
                "bias_heads": None,
                "bias_key_length": None,
            }
        decode = kind == "decode"
        if kind not in ("activation", "decode"):
            raise ValueError(f"PartitionAxis.rules: kind {kind!r}; expected 'param', 'activation' or 'decode'")
        return {
            "batch": self.decode_batch_axis if decode else self.batch_axis,
            "length": self.decode_query_sequence_axis if decode else self.sequence_axis,
            "query_length": self.decode_query_sequence_axis if decode else self.query_sequence_axis,
            "key_length": self.decode_key_sequence_axis if decode else self.key_sequence_axis,
            "embed": self.hidden_state_axis,
            "heads": self.decode_head_axis if decode else self.head_axis,
            "kv_heads": self.decode_kv_head_axis if decode else self.kv_head_axis,
            "head_dim": self.decode_attention_dim_axis if decode else self.attention_dim_axis,
            "kv_head_dim": self.decode_attention_kv_dim_axis if decode else self.attention_kv_dim_axis,
            "mlp": self.mlp_intermediate_axis,
            "vocab": self.vocab_axis,
            "expert": self.expert_axis,
            "expert_gate": self.expert_gate_axis,
            "norm": None,
            "bias_heads": self.bias_head_sequence_axis,
            "bias_key_length": self.bias_key_sequence_axis,
        }

    def spec(self, names: Sequence[str | None], kind: Kind = "activation", mesh=None) -> PartitionSpec:
        """`PartitionSpec` for a tensor whose dims carry these logical `names` (None = replicated), with
        the table for `kind` (`"param"`, `"activation"` or `"decode"`).

        With `mesh`, mesh axes the mesh lacks are dropped, and a mesh axis already used by an earlier
        dim is not used twice (a dim gets it only once), so one `PartitionAxis` serves every mesh.
        """
        table = self.rules(kind)
        used: set[str] = set()
        out: list[AxisSpec] = []
        for name in names:
            if name is None:
                out.append(None)
                continue
            if name not in table:
                raise ValueError(f"unknown logical axis name {name!r}; expected one of {sorted(table)}")
            axes = table[name]
            axes = (axes,) if isinstance(axes, str) else (axes or ())
            keep = tuple(a for a in axes if a not in used and (mesh is None or a in mesh.shape))
            used.update(keep)
            out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
        return PartitionSpec(*out)


def _normalise(value: Any) -> AxisSpec:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError("expected a mesh axis name, a tuple of names, or None")
