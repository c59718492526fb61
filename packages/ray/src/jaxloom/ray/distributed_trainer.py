"""`RayDistributedTrainer`: EasyDeL's scaling trainer — a model family scaled by `scaling_index`, built
from a base config, trained by the trainer package — plus `train_on_ray` and `tune`, which run it as a
supervised gang of Ray workers."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

import jaxloom.data as jd
import jaxloom.models as jm
import jaxloom.state as js
from jaxloom.mesh import MeshConfig, PartitionAxis

from jaxloom.state.serialization import DTYPE_KEYS, decode_variables

from .config import RayDistributedConfig

log = logging.getLogger("jaxloom.ray")

# EasyDeL's attention and gradient-checkpointing names (and the `AttentionMechanisms` /
# `EasyDeLGradientCheckPointers` members) are read by `jaxloom.models.runtime`: its Pallas kernels are our
# `flash`, its cuDNN/SDPA paths our `cudnn`; an explicit kernel that cannot run here is an error.
_RUNTIME_KEYS = {"dtype", "param_dtype", "precision", "attn_mechanism", "gradient_checkpointing", "partition_axis"}
_MESH_KEYS = {"sharding_axis_names", "sharding_axis_dims", "sharding_dcn_axis_dims"}
# Accepted for EasyDeL compatibility: attention runs in `dtype` with a float32 softmax here.
_COMPAT_KEYS = {"attn_dtype", "attn_softmax_dtype"}


def _name(value: Any) -> str:
    return (getattr(value, "name", None) or getattr(value, "value", None) or str(value)).lower()


class RayDistributedTrainer:
    """Args (as EasyDeL's):
    pretrained_model_name_or_path: a local Hugging Face directory (`config.json`, tokenizer files)
      giving the base config and the tokenizer. Nothing is downloaded.
    bucket_path: a checkpoint to start from — a jaxloom run directory (or its `checkpoints/`) or a
      Hugging Face model directory. Local paths here; orbax reads other URLs it supports.
    model_task / model_type: the registry key; inferred from `model_class`, else `model_type` from
      the base `config.json`, task defaulting to causal LM.
    state_class: builds states (`.create(model, tx, seed=)`); default `jaxloom.state.TrainState`.
    offload_backend: 'cpu' / 'gpu' / 'tpu': where `create_model` materialises parameters.
    trainer_module: the trainer class (default `jaxloom.trainer.Trainer`).
    config_scaling_variables: config fields multiplied by `scaling_index`.
    config_variables: fixed settings: config fields, runtime (dtype, param_dtype, precision,
      attn_mechanism, gradient_checkpointing, partition_axis), mesh (sharding_axis_*) and seed.
    """

    CONFIG_SCALING_VARIABLES: ClassVar[dict[str, int]] = {
        "hidden_size": 256,
        "intermediate_size": 256 * 4,
        "moe_intermediate_size": 256 * 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    CONFIG_VARIABLES: ClassVar[dict[str, Any]] = {
        "dtype": jnp.bfloat16,
        "param_dtype": jnp.bfloat16,
        "precision": jax.lax.Precision.DEFAULT,
        "seed": 654,
        "max_position_embeddings": 2**13,
        "gradient_checkpointing": jm.EasyDeLGradientCheckPointers.NONE,
        "initializer_range": 0.02,
        "partition_axis": PartitionAxis(),
        "attn_mechanism": jm.AttentionMechanisms.AUTO,
        "attn_dtype": jnp.bfloat16,
        "attn_softmax_dtype": jnp.bfloat16,
        "sharding_axis_names": ("dp", "fsdp", "ep", "tp", "sp"),
        "sharding_axis_dims": (1, -1, 1, 1, 1),
        "sharding_dcn_axis_dims": (1, -1, 1, 1, 1),
    }

    def __init__(
        self,
        pretrained_model_name_or_path: str,
        bucket_path: str | None = None,
        model_task=None,
        model_type: str | None = None,
        model_class: type | None = None,
        state_class: type | None = None,
        offload_backend: str | None = None,
        trainer_module: type | None = None,
        config_scaling_variables: dict[str, int] | None = None,
        config_variables: dict[str, Any] | None = None,
    ):
        self.pretrained_model_name_or_path = str(pretrained_model_name_or_path)
        self.bucket_path = bucket_path
        if model_class is not None:  # EasyDeL's `_model_type` / `_model_task` when declared, else ours
            model_type = (
                model_type or getattr(model_class, "_model_type", None) or getattr(model_class, "model_type", None)
            )
            model_task = model_task or getattr(model_class, "_model_task", None) or getattr(model_class, "task", None)
        if model_type is None:  # then the directory's config.json must name it
            model_type = self._base_config_dict().get("model_type")
        if model_type is None:
            raise ValueError(
                "cannot resolve the model: give model_class, or model_type (and model_task); "
                f"{self.pretrained_model_name_or_path}/config.json names no model_type either"
            )
        self.model_type, self.model_task = model_type, jm.TaskType(model_task or jm.TaskType.CAUSAL_LM)
        self.model_class = model_class or jm.get_model_class(self.model_type, self.model_task)
        self.state_class = state_class or js.TrainState
        if offload_backend not in (None, "cpu", "gpu", "tpu"):
            raise ValueError(f"offload_backend {offload_backend!r}; expected 'cpu', 'gpu', 'tpu' or None")
        self.offload_backend = offload_backend
        if trainer_module is None:
            from jaxloom.trainer import Trainer

            trainer_module = Trainer
        self.trainer_module: type = trainer_module
        # Merged over the defaults, as `config_variables` are: a given dict changes or adds variables.
        scaling = {**self.CONFIG_SCALING_VARIABLES, **(config_scaling_variables or {})}
        bad = {k: v for k, v in scaling.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0}
        if bad:
            raise ValueError(f"config_scaling_variables {bad}; expected positive integers")
        self.config_scaling_variables = scaling
        self.config_variables: dict[str, Any] = (
            decode_variables({**self.CONFIG_VARIABLES, **(config_variables or {})}) or {}
        )
        self._check_variables()

    # ---- configuration ---------------------------------------------------------------------------------
    def _base_config_dict(self) -> dict[str, Any]:
        path = Path(self.pretrained_model_name_or_path) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: pretrained_model_name_or_path must be a local Hugging Face "
                "model directory (jaxloom never downloads), or give model_type (or model_class) to start "
                "from the config class's defaults"
            )
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None

    def _config_class(self) -> type | None:
        """The model's config class: `model_class.config_class` when it names one, else the registry's."""
        return getattr(self.model_class, "config_class", None) or jm.CONFIG_CLASSES.get(self.model_type)

    def _check_variables(self) -> None:
        config_class = self._config_class()
        config_fields = set(config_class.__dataclass_fields__) if config_class is not None else set()
        known = config_fields | _RUNTIME_KEYS | _MESH_KEYS | _COMPAT_KEYS | {"seed"}
        unknown = sorted(set(self.config_variables) - known)
        if unknown:
            raise ValueError(
                f"unknown config_variables {unknown}; expected fields of {self.model_type}'s config or "
                f"{sorted(_RUNTIME_KEYS | _MESH_KEYS | _COMPAT_KEYS | {'seed'})}"
            )
        v = self.config_variables
        try:
            jm.runtime.remat_policy(v["gradient_checkpointing"])
        except ValueError as e:
            raise ValueError(f"config_variables['gradient_checkpointing']: {e}") from None
        jm.runtime.attn_backend(v["attn_mechanism"])
        for key in DTYPE_KEYS:
            if key in v:
                jm.runtime.to_dtype(v[key])

    def to_config(self) -> RayDistributedConfig:
        """This trainer's settings as a `RayDistributedConfig`."""
        return RayDistributedConfig(
            pretrained_model_name_or_path=self.pretrained_model_name_or_path,
            model_task=self.model_task,
            model_type=self.model_type,
            offload_backend=self.offload_backend,
            config_scaling_variables=self.config_scaling_variables,
            config_variables=self.config_variables,
        )

    def save_config(self, path: str | Path) -> Path:
        """Write this trainer's configuration as JSON at `path` (dtypes and PartitionAxis as strings/dicts)."""
        return self.to_config().save(path)

    @classmethod
    def from_config(
        cls,
        path: str | Path,
        model_class: type | None = None,
        state_class: type | None = None,
        trainer_module: type | None = None,
        **overrides: Any,
    ) -> RayDistributedTrainer:
        """A trainer from `save_config`'s JSON at `path`; keyword `overrides` replace saved fields (e.g.
        `bucket_path`). `model_class`, `state_class` and `trainer_module` are not saved: pass them again."""
        loaded = RayDistributedConfig.load(path)
        cfg = {name: getattr(loaded, name) for name in RayDistributedConfig.model_fields}
        return cls(
            **{**cfg, **overrides}, model_class=model_class, state_class=state_class, trainer_module=trainer_module
        )

    def create_config(self, scaling_index: int):
        """The base config with every scaling variable × `scaling_index` and the fixed fields set. The base
        is `pretrained_model_name_or_path/config.json` when there is one, else the defaults of the model's
        config class (`model_type` given, or inferred from `model_class`)."""
        if not isinstance(scaling_index, int) or isinstance(scaling_index, bool) or scaling_index <= 0:
            raise ValueError(f"scaling_index {scaling_index!r}; expected a positive integer")
        config_class = self._config_class()
        if config_class is None:
            raise ValueError(
                f"no config class for model_type {self.model_type!r}: register one in "
                "jaxloom.models.CONFIG_CLASSES or give the model class a `config_class` attribute"
            )
        has_file = (Path(self.pretrained_model_name_or_path) / "config.json").is_file()
        data = dict(self._base_config_dict()) if has_file else {}
        data.pop("model_type", None)
        fields = config_class.__dataclass_fields__
        scaled = {k: v * scaling_index for k, v in self.config_scaling_variables.items() if k in fields}
        fixed = {k: v for k, v in self.config_variables.items() if k in fields}
        if {"hidden_size", "num_attention_heads"} & set(scaled) and "head_dim" not in fixed:
            data.pop("head_dim", None)  # follows hidden_size / heads
        return config_class.from_hf_dict({**data, **scaled, **fixed})

    def runtime(self) -> jm.RuntimeConfig:
        """The `RuntimeConfig` (dtypes, precision, attention, remat, partition axes) from `config_variables`."""
        v = self.config_variables
        precision = v.get("precision")
        return jm.RuntimeConfig(
            dtype=v["dtype"],
            param_dtype=v["param_dtype"],
            precision=None if precision is None else _name(precision),
            attn_mechanism=jm.runtime.attn_backend(v["attn_mechanism"]),
            remat=jm.runtime.remat_policy(v["gradient_checkpointing"]),
            partition_axis=v.get("partition_axis") or PartitionAxis(),
        )

    def mesh_config(self) -> MeshConfig:
        """The `MeshConfig` from `config_variables['sharding_axis_*']` (DCN dims only with many processes)."""
        v = self.config_variables
        dcn = v.get("sharding_dcn_axis_dims")
        if dcn is not None and jax.process_count() == 1:
            dcn = None  # one process: nothing crosses hosts
        return MeshConfig(tuple(v["sharding_axis_dims"]), tuple(v["sharding_axis_names"]), dcn)

    # ---- models and states ------------------------------------------------------------------------------
    def create_model(self, config, dtype=None, param_dtype=None, precision=None, seed: int = 684, lazy: bool = False):
        """A model for `config`; `dtype`, `param_dtype` and `precision` default to `config_variables`.
        Weights come from `seed`; `lazy=True` gives an abstract model (no memory). Concrete models are
        created on `offload_backend`'s first device when one is set."""
        runtime = self.runtime()
        changes = {k: val for k, val in (("dtype", dtype), ("param_dtype", param_dtype)) if val is not None}
        if precision is not None:
            changes["precision"] = _name(precision)
        runtime = runtime.replace(**changes)
        if lazy or self.offload_backend is None:
            return jm.create_model(config, runtime, seed=seed, lazy=lazy, model_class=self.model_class)
        with jax.default_device(jax.devices(self.offload_backend)[0]):
            return jm.create_model(config, runtime, seed=seed, model_class=self.model_class)

    def create_model_from_config(self, scaling_index: int, *, lazy: bool = False):
        """A model of `create_config(scaling_index)`, seeded by `config_variables['seed']` (abstract with
        `lazy`)."""
        return self.create_model(
            self.create_config(scaling_index), seed=self.config_variables.get("seed", 684), lazy=lazy
        )

    def convert_model_to_state(self, model):
        """A state of `state_class` for `model`, unsharded (the trainer shards it); identity optimizer."""
        import optax

        return self.state_class.create(model, optax.identity(), seed=self.config_variables.get("seed", 0))

    def _state_from_bucket(self, scaling_index: int):
        path = Path(str(self.bucket_path))
        if (path / "config.json").is_file():  # a Hugging Face directory
            return self.convert_model_to_state(jm.from_pretrained(path, self.runtime(), task=self.model_task))
        ckpt = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        manager = js.CheckpointManager(js.CheckpointConfig(directory=str(ckpt)))
        try:
            if manager.latest_step() is None:
                raise FileNotFoundError(f"bucket_path {self.bucket_path}: no complete checkpoint and no config.json")
            abstract = self.convert_model_to_state(self.create_model_from_config(scaling_index, lazy=True))
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
            step = manager.latest_step()
            restored = manager.restore(target, step, params_only=True)
            log.warning("initial parameters from %s (checkpoint %d)", ckpt, step)
            # On the host: the trainer places them on its own mesh.
            return restored.state.replace(params=jax.device_get(restored.state.params))
        finally:
            manager.close()

    # ---- data helpers -----------------------------------------------------------------------------------
    def load_processor(self):
        """The tokenizer of `pretrained_model_name_or_path`; pad falls back to eos with a warning."""
        return jd.load_processor(self.pretrained_model_name_or_path)

    @property
    def processor(self):
        """The tokenizer, loaded once (and not shipped to Ray workers: each loads its own)."""
        if self.__dict__.get("_processor") is None:
            self._processor = self.load_processor()
        return self._processor

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_processor", "last_trainer")}

    extract_column_names = staticmethod(jd.extract_column_names)

    def process_sample_data(self, sample: Any, max_length: int, padding_side: str = "left") -> dict:
        """`jaxloom.data.process_sample_data(tokenizer, sample, max_length, padding_side)` with this
        trainer's tokenizer."""
        return jd.process_sample_data(self.processor, sample, max_length, padding_side)

    def process_messages_data(self, messages: Any, max_length: int, padding_side: str = "left") -> dict:
        """`jaxloom.data.process_messages_data(tokenizer, messages, max_length, padding_side)` with this
        trainer's tokenizer."""
        return jd.process_messages_data(self.processor, messages, max_length, padding_side)

    # ---- training ---------------------------------------------------------------------------------------
    def create_trainer(
        self, arguments, dataset_train, dataset_eval=None, data_collator=None, state=None, *, hooks: list | None = None
    ):
        """A `trainer_module` over `state` on the mesh from `config_variables`, training on
        `dataset_train` (evaluating on `dataset_eval`) with `arguments` and `hooks`. `data_collator`, when
        given, maps each raw record to one the data loader reads (text, prompt/completion, messages or
        input_ids) before tokenization."""
        if state is None:
            raise ValueError("create_trainer needs a state (see train() for how one is chosen)")
        if not self._own_trainer():
            # A trainer of the user's own that follows `BaseTrainerProtocol`: the reference's arguments.
            if hooks:
                raise TypeError(
                    f"hooks (used by train_on_ray's supervision) need a jaxloom BaseTrainer; "
                    f"{self.trainer_module.__name__} is not one"
                )
            return self.trainer_module(
                arguments=arguments,
                model_state=state,
                dataset_train=dataset_train,
                dataset_eval=dataset_eval,
                data_collator=data_collator,
            )
        if data_collator is not None:
            dataset_train = _Mapped(jd.as_source(dataset_train), data_collator)
            if dataset_eval is not None:
                dataset_eval = _Mapped(jd.as_source(dataset_eval), data_collator)
        mesh = self.mesh_config().build()
        return self.trainer_module(
            arguments,
            model_state=state,
            dataset_train=dataset_train,
            dataset_eval=dataset_eval,
            processing_class=self.processor,
            mesh=mesh,
            hooks=hooks,
        )

    def _own_trainer(self) -> bool:
        from jaxloom.trainer import BaseTrainer

        return isinstance(self.trainer_module, type) and issubclass(self.trainer_module, BaseTrainer)

    def train(
        self,
        scaling_index: int,
        arguments,
        dataset_train,
        dataset_eval=None,
        data_collator=None,
        model=None,
        state=None,
        *,
        hooks: list | None = None,
    ):
        """Train; the starting point is, in order: `state`, `model`, the checkpoint at `bucket_path`, a new
        model scaled by `scaling_index`. With `arguments.resume_if_possible` an existing checkpoint in
        `arguments.save_directory` wins over all of them (the run continues). `dataset_train`,
        `dataset_eval`, `data_collator` and `hooks` as in `create_trainer`. Returns the `TrainerOutput`."""
        if state is None and model is not None:
            state = self.convert_model_to_state(model)
        if state is None and self.bucket_path:
            state = self._state_from_bucket(scaling_index)
        if state is None:
            # Abstract for jaxloom's trainers (they initialise it on its shards from the seed); concrete for
            # a trainer of the user's own, which may expect one.
            lazy = self._own_trainer()
            state = self.convert_model_to_state(self.create_model_from_config(scaling_index, lazy=lazy))
        trainer = self.create_trainer(arguments, dataset_train, dataset_eval, data_collator, state, hooks=hooks)
        try:
            out = trainer.train()
        finally:
            finish = getattr(trainer, "finish", None)  # not part of BaseTrainerProtocol
            if callable(finish):
                finish()
        self.last_trainer = trainer
        return out

    def train_on_ray(
        self,
        scaling_index: int,
        arguments,
        dataset_train,
        dataset_eval=None,
        data_collator=None,
        *,
        scaling=None,
        faults: tuple = (),
    ):
        """`train(scaling_index, arguments, dataset_train, dataset_eval, data_collator)` as a gang of Ray
        workers (`scaling`: a `ScalingConfig`; `faults`: `jaxloom.ray.testing.FaultInjector`s), one JAX
        process each, joined into one global mesh; restarted from the newest checkpoint on failure. Returns
        a `LaunchResult` whose `.result` is rank 0's summary (metrics, report and checkpoint paths, loss history)."""
        from .launcher import ScalingConfig, launch

        return launch(
            _train_job,
            self,
            scaling_index,
            arguments,
            dataset_train,
            dataset_eval,
            data_collator,
            tuple(faults),
            scaling=scaling or ScalingConfig(),
        )

    def tune(self, param_space: dict[str, Any], arguments, dataset_train, dataset_eval, **kwargs):
        """A Ray Tune sweep over `param_space` (`scaling_index` and/or any training argument), each trial
        training on `dataset_train` with `arguments` and judged on `dataset_eval`; `kwargs` and the
        result as in `jaxloom.ray.tune_sweep`."""
        from .tune import tune_sweep

        return tune_sweep(self, param_space, arguments, dataset_train, dataset_eval, **kwargs)


def _train_job(
    ctx, launcher: RayDistributedTrainer, scaling_index, arguments, dataset_train, dataset_eval, data_collator, faults
):
    """One worker's share of `RayDistributedTrainer.train_on_ray`: `launcher` (the `RayDistributedTrainer`, which
    builds this worker's trainer) trains, resuming on a restart; returns `jobs.summarize`'s summary."""
    from .jobs import summarize

    if ctx.attempt > 0:
        arguments = arguments.replace(resume_if_possible=True)
    hooks = ctx.hooks() + [b for f in faults if (b := f.bind(ctx)) is not None]
    out = launcher.train(scaling_index, arguments, dataset_train, dataset_eval, data_collator, hooks=hooks)
    return summarize(out, launcher.last_trainer.writer.history)


class _Mapped:
    """A data source whose records pass through `fn` when read."""

    def __init__(self, source, fn):
        self.source, self.fn = source, fn

    @property
    def shard_names(self):
        return self.source.shard_names

    def read_shard(self, name):
        return [self.fn(r) for r in self.source.read_shard(name)]

    def open_shard(self, name, cursor=0):
        from jaxloom.data import iter_shard

        return ((self.fn(r), after) for r, after in iter_shard(self.source, name, cursor))

    def describe(self, name, cursor):
        from jaxloom.data.sources import describe

        return describe(self.source, name, cursor)
