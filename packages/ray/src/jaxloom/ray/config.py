"""`RayDistributedConfig`: what a `RayDistributedTrainer` is, as JSON (pydantic)."""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from jaxloom.state.serialization import decode_variables, encode_variables  # the one JSON codec


class RayDistributedConfig(BaseModel):
    """The persisted form of a `RayDistributedTrainer`. JAX dtypes in `config_variables` become their
    names and `PartitionAxis` a dict on saving (`_saving_preprocess`); loading turns them back
    (`_loading_postprocess`). `model_task` is stored as its value string. The fields are
    `RayDistributedTrainer`'s constructor arguments of the same names: `pretrained_model_name_or_path`,
    `model_task`, `model_type`, `offload_backend`, `config_scaling_variables`, `config_variables`."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    pretrained_model_name_or_path: str
    model_task: str | None = None
    model_type: str | None = None
    offload_backend: str | None = None
    config_scaling_variables: dict[str, int] | None = None
    config_variables: dict[str, Any] | None = None

    @field_validator("model_task", mode="before")
    @classmethod
    def _task_value(cls, v):
        return v.value if isinstance(v, enum.Enum) else v

    def _saving_preprocess(self) -> RayDistributedConfig:
        """Make `config_variables` JSON data in place (dtypes → names, PartitionAxis → dict, enums →
        values, tuples → lists), as EasyDeL does before saving; returns this config."""
        self.config_variables = encode_variables(self.config_variables)
        return self

    def _loading_postprocess(self) -> RayDistributedConfig:
        """The inverse of `_saving_preprocess`, in place (after loading); returns this config."""
        self.config_variables = decode_variables(self.config_variables)
        return self

    def save(self, path: str | Path) -> Path:
        """Write the config as JSON (after `_saving_preprocess`) atomically; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(
            json.dumps(self.model_copy(deep=True)._saving_preprocess().model_dump(), indent=2, sort_keys=True)
        )
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> RayDistributedConfig:
        """Read a config written by `save` at `path`; a clear error when it is missing or malformed."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no RayDistributedTrainer config at {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None
        return cls.model_validate(data)._loading_postprocess()
