"""One config system: every user-facing config is a `@config` dataclass (jaxloom.core.schema), so values are
converted by their types and every bad value is one `ValueError` naming the config, the key and the value."""

import dataclasses

import pytest

from jaxloom.data import DataConfig
from jaxloom.generation import GenerationConfig
from jaxloom.mesh import MeshConfig, PartitionAxis
from jaxloom.core.schema import is_config
from jaxloom.models import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, RuntimeConfig
from jaxloom.ray import ScalingConfig
from jaxloom.state import CheckpointConfig

# Each config with one field given as text (converted by its type) and one bad value for that field.
CASES = [
    (MeshConfig, {"axis_dims": ["2", "-1", "1", "1", "1"]}, "axis_dims", (2, -1, 1, 1, 1), "x"),
    (PartitionAxis, {"head_axis": ["tp", "sp"]}, "head_axis", ("tp", "sp"), 3),
    (RuntimeConfig, {"attn_block_size": "64"}, "attn_block_size", 64, 0),
    (LlamaConfig, {"rms_norm_eps": "1e-5"}, "rms_norm_eps", 1e-5, "tiny"),
    (MistralConfig, {"sliding_window": "128"}, "sliding_window", 128, 1.5),
    (Qwen2Config, {"rope_theta": "1e6"}, "rope_theta", 1e6, "big"),
    (MixtralConfig, {"num_local_experts": "4"}, "num_local_experts", 4, "four"),
    (DataConfig, {"batch_size": "4"}, "batch_size", 4, 0),
    (CheckpointConfig, {"directory": "d", "save_minutes": "2.5"}, "save_minutes", 2.5, -1),
    (GenerationConfig, {"max_new_tokens": "7"}, "max_new_tokens", 7, 3.5),
    (ScalingConfig, {"num_workers": "2"}, "num_workers", 2, 0),
]


@pytest.mark.parametrize(("cls", "given", "key", "value", "bad"), CASES, ids=[c[0].__name__ for c in CASES])
def test_every_config_is_on_the_one_schema(cls, given, key, value, bad):
    assert is_config(cls)
    cfg = cls(**given)
    assert getattr(cfg, key) == value
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: {key} = {bad!r}; expected"):
        dataclasses.replace(cfg, **{key: bad})
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: unknown key '{key}x' \(did you mean '{key}'\?\)"):
        cls(**given, **{key + "x": 1})
    assert hash(cfg) == hash(cls(**given)) and cfg == cls(**given)
