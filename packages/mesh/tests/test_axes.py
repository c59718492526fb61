import json

import pytest
from jax.sharding import PartitionSpec as P

from jaxloom.mesh import MeshConfig, PartitionAxis

# The defaults printed in the EasyDeL reference (shared/seeds/easydel-ray-distributed-trainer-api.txt).
REFERENCE = dict(
    data_parallel_axis="dp",
    fully_sharded_data_parallel_axis="fsdp",
    tensor_parallel_axis="tp",
    sequence_parallel_axis="sp",
    expert_parallel_axis="ep",
    batch_axis=("fsdp", "dp"),
    sequence_axis="sp",
    query_sequence_axis="sp",
    head_axis="tp",
    kv_head_axis="tp",
    key_sequence_axis="sp",
    hidden_state_axis="tp",
    mlp_intermediate_axis="tp",
    vocab_axis="tp",
    expert_axis="ep",
    expert_gate_axis=None,
    attention_dim_axis=None,
    attention_kv_dim_axis=None,
    bias_head_sequence_axis=None,
    bias_key_sequence_axis=None,
    decode_batch_axis=("fsdp", "dp"),
    decode_query_sequence_axis=None,
    decode_head_axis="tp",
    decode_kv_head_axis="tp",
    decode_key_sequence_axis="sp",
    decode_attention_dim_axis=None,
    decode_attention_kv_dim_axis=None,
)


def test_defaults_match_the_reference():
    pa = PartitionAxis()
    assert {k: getattr(pa, k) for k in REFERENCE} == REFERENCE
    assert set(pa.to_dict()) == set(REFERENCE)


def test_json_round_trip_is_exact():
    pa = PartitionAxis(batch_axis=("dp", "fsdp"), head_axis=None, vocab_axis=("tp", "sp"))
    text = pa.to_json()
    back = PartitionAxis.from_json(text)
    assert back == pa and back.to_json() == text
    assert isinstance(back.batch_axis, tuple)
    assert json.loads(text)["vocab_axis"] == ["tp", "sp"]


def test_bad_fields_are_errors():
    with pytest.raises(ValueError, match=r"unknown key 'batch' \(did you mean 'batch_axis'\?\)"):
        PartitionAxis.from_dict({"batch": "dp"})
    with pytest.raises(ValueError, match=r"PartitionAxis: head_axis = 3; expected a mesh axis name"):
        PartitionAxis(head_axis=3)


def test_activation_param_and_decode_specs():
    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()
    pa = PartitionAxis()
    assert pa.spec(("batch", "length", "embed")) == P(("fsdp", "dp"), "sp", "tp")
    assert pa.spec(("batch", "length", "embed"), mesh=mesh) == P(("fsdp", "dp"), "sp", "tp")
    assert pa.spec(("embed", "mlp"), kind="param") == P("fsdp", "tp")
    assert pa.spec(("vocab", "embed"), kind="param") == P("tp", "fsdp")
    assert pa.spec(("batch", "length", "heads", "head_dim"), kind="decode") == P(("fsdp", "dp"), None, "tp", None)
    # an axis is used at most once per spec
    assert pa.spec(("heads", "mlp"), kind="param") == P("tp", None)


def test_axes_missing_from_the_mesh_are_dropped():
    mesh = MeshConfig(axis_dims=(-1, 2), axis_names=("fsdp", "tp")).build()
    assert PartitionAxis().spec(("batch", "length", "embed"), mesh=mesh) == P("fsdp", None, "tp")


def test_unknown_logical_name():
    with pytest.raises(ValueError, match="unknown logical axis name 'hidden'"):
        PartitionAxis().spec(("batch", "hidden"))
    with pytest.raises(ValueError, match="kind 'weights'"):
        PartitionAxis().rules("weights")
