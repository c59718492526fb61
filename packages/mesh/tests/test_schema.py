"""The mesh configs are `jaxloom.core.schema` configs: values converted by type, one clear error."""

import pytest

from jaxloom.core.schema import is_config
from jaxloom.mesh import MeshConfig, PartitionAxis


def test_the_mesh_configs_use_the_schema():
    assert is_config(MeshConfig) and is_config(PartitionAxis) and not is_config(int)
    assert MeshConfig(axis_dims=["2", "-1"], axis_names=["dp", "fsdp"]).axis_dims == (2, -1)
    with pytest.raises(ValueError, match=r"MeshConfig: axis_dims = 'abc'"):
        MeshConfig(axis_dims="abc")
