import json

import numpy as np
import pytest

from jaxloom.mesh import (
    MeshConfig,
    RngStream,
    get_accumulate_grad_batches,
    get_local_global_micro_batch_size,
    local_batch_slice,
)


def test_rng_stream_resumes_exactly():
    a = RngStream(7)
    first = [np.asarray(a.gen_rng()) for _ in range(3)]
    saved = json.loads(json.dumps(a.state_dict()))
    later = [np.asarray(a.gen_model_step_rng()) for _ in range(3)]
    b = RngStream.from_state_dict(saved)
    assert [np.asarray(b.gen_rng()).tolist() for _ in range(3)] == [k.tolist() for k in later]
    keys = {tuple(k.tolist()) for k in first + later}
    assert len(keys) == 6  # all distinct
    assert np.asarray(RngStream(7).gen_rng()).tolist() == first[0].tolist()
    assert np.asarray(RngStream(8).gen_rng()).tolist() != first[0].tolist()


def test_rng_stream_bad_state():
    with pytest.raises(ValueError, match="expected keys 'seed' and 'count'"):
        RngStream.from_state_dict({"key": 1})
    with pytest.raises(TypeError, match="seed must be an int"):
        RngStream("1")


@pytest.mark.parametrize(
    "axes, per_device, expected",
    [
        (dict(fsdp=8), 2, (16, 16)),
        (dict(fsdp=4, tp=2), 2, (8, 8)),
        (dict(dp=2, fsdp=2, tp=2), 3, (12, 12)),
        (dict(tp=8), 4, (4, 4)),
    ],
)
def test_micro_batch_sizes(axes, per_device, expected):
    mesh = MeshConfig.from_axes(**axes).build()
    assert get_local_global_micro_batch_size(per_device, mesh) == expected
    assert local_batch_slice(mesh, expected[1]) == slice(0, expected[1])  # one process holds every row
    assert get_accumulate_grad_batches(expected[1] * 4, per_device, mesh) == 4


def test_batch_errors_name_the_numbers():
    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()
    with pytest.raises(ValueError, match=r"global_batch_size 12 must be a positive multiple of the global micro-b"):
        get_accumulate_grad_batches(12, 2, mesh)
    with pytest.raises(ValueError, match="global batch size 6 is not divisible by the data-parallel size 4"):
        local_batch_slice(mesh, 6)
    with pytest.raises(ValueError, match="per_device_batch_size must be positive"):
        get_local_global_micro_batch_size(0, mesh)


def test_batch_axes_have_one_source_the_loader_and_the_activations_agree():
    from jaxloom.mesh import DATA_AXES, MeshConfig, PartitionAxis, batch_spec

    assert DATA_AXES == tuple(PartitionAxis().batch_axis)
    mesh = MeshConfig.from_axes(dp=2, fsdp=2, tp=2).build()
    activation = PartitionAxis().spec(("batch", "length", "embed"), "activation", mesh=mesh)
    assert batch_spec(mesh)[0] == activation[0] == ("fsdp", "dp")
