import jax
import pytest

from jaxloom.mesh import MeshConfig, resolve_dims


@pytest.mark.parametrize(
    "dims, expected",
    [
        ((1, -1, 1, 1, 1), {"dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}),
        ((2, 2, 1, 2, 1), {"dp": 2, "fsdp": 2, "ep": 1, "tp": 2, "sp": 1}),
        ((1, -1, 1, 2, 1), {"dp": 1, "fsdp": 4, "ep": 1, "tp": 2, "sp": 1}),
        ((1, 1, 2, -1, 2), {"dp": 1, "fsdp": 1, "ep": 2, "tp": 2, "sp": 2}),
    ],
)
def test_build_shapes(dims, expected):
    mesh = MeshConfig(axis_dims=dims).build()
    assert dict(mesh.shape) == expected
    assert mesh.axis_names == ("dp", "fsdp", "ep", "tp", "sp")
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_build_on_a_subset_of_devices_and_custom_names():
    mesh = MeshConfig(axis_dims=(-1, 2), axis_names=("data", "model")).build(jax.devices()[:4])
    assert dict(mesh.shape) == {"data": 2, "model": 2}


def test_from_axes_and_dict_round_trip():
    cfg = MeshConfig.from_axes(fsdp=4, tp=2)
    assert cfg.axis_dims == (1, 4, 1, 2, 1)
    assert MeshConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.shape(8) == {"dp": 1, "fsdp": 4, "ep": 1, "tp": 2, "sp": 1}


def test_dcn_dims_with_one_process_are_ignored():
    cfg = MeshConfig(axis_dims=(1, -1, 1, 2, 1), dcn_axis_dims=(1, -1, 1, 1, 1))
    assert cfg.resolve(8, 1) == ((1, 4, 1, 2, 1), (1, 1, 1, 1, 1))
    assert dict(cfg.build().shape)["fsdp"] == 4


def test_dcn_dims_multiply_per_axis():
    cfg = MeshConfig(axis_dims=(1, -1, 1, 2, 1), dcn_axis_dims=(2, -1, 1, 1, 1))
    assert cfg.resolve(16, 4) == ((1, 2, 1, 2, 1), (2, 2, 1, 1, 1))
    assert cfg.shape(16, 4) == {"dp": 2, "fsdp": 4, "ep": 1, "tp": 2, "sp": 1}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(axis_dims=(1, 3, 1, 1, 1)), "product is 3, but there are 8 devices"),
        (dict(axis_dims=(1, -1, 1, 3, 1)), "multiply to 3, which does not divide the 8 devices"),
        (dict(axis_dims=(1, -1, 1, -1, 1)), "at most one dim may be -1"),
        (dict(axis_dims=(1, 0, 1, 1, 1)), "positive integer or -1"),
        (dict(axis_dims=(1, -1, 1)), "has 3 entries, expected one per axis name"),
        (dict(axis_names=("a", "a", "b", "c", "d")), "repeated name"),
    ],
)
def test_impossible_meshes_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MeshConfig(**kwargs).build()


def test_unknown_axis_names():
    with pytest.raises(ValueError, match=r"unknown mesh axis \['xp'\]"):
        MeshConfig.from_axes(xp=2)
    with pytest.raises(ValueError, match=r"unknown key 'dims'"):
        MeshConfig.from_dict({"dims": [1, 2]})


def test_resolve_dims_property():
    from hypothesis import given, strategies as st

    @given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.integers(0, 4))
    def check(dims, hole):
        total = 1
        for d in dims:
            total *= d
        with_hole = list(dims)
        with_hole[hole % len(dims)] = -1
        assert resolve_dims(with_hole, total) == tuple(dims)
        assert resolve_dims(dims, total) == tuple(dims)

    check()
