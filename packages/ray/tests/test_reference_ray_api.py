"""easydel-ray-distributed-trainer-api.txt, member by member in the document's order: each member exists
under its documented name and behaves as the document says (no Ray cluster needed)."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from util import FIXED, SCALING, TRAIN, args, base_model_dir

import jaxloom.models as jm
from jaxloom.mesh import PartitionAxis
from jaxloom.ray import RayDistributedConfig, RayDistributedTrainer
from jaxloom.state import TrainState
from jaxloom.trainer import BaseTrainerProtocol


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_model_dir(tmp_path_factory.mktemp("api"))


# ---- RayDistributedConfig ---------------------------------------------------------------------------------
def test_config_fields_are_the_documented_keyword_only_fields():
    params = inspect.signature(RayDistributedConfig).parameters
    assert list(params) == [
        "pretrained_model_name_or_path",
        "model_task",
        "model_type",
        "offload_backend",
        "config_scaling_variables",
        "config_variables",
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    assert isinstance(RayDistributedConfig.model_config, dict)
    with pytest.raises(ValueError):
        RayDistributedConfig()  # pretrained_model_name_or_path is required


def test_config_preprocess_before_saving_and_postprocess_after_loading_work_in_place():
    cfg = RayDistributedConfig(
        pretrained_model_name_or_path="/m",
        model_task=jm.TaskType.CAUSAL_LM,
        config_variables={"dtype": jnp.bfloat16, "partition_axis": PartitionAxis(head_axis="fsdp")},
    )
    assert cfg._saving_preprocess() is cfg
    assert cfg.config_variables == {"dtype": "bfloat16", "partition_axis": PartitionAxis(head_axis="fsdp").to_dict()}
    assert cfg._loading_postprocess() is cfg
    assert cfg.config_variables["dtype"] == jnp.bfloat16
    assert cfg.config_variables["partition_axis"] == PartitionAxis(head_axis="fsdp")


# ---- RayDistributedTrainer --------------------------------------------------------------------------------
def test_constructor_signature_and_attributes(base):
    names = list(inspect.signature(RayDistributedTrainer).parameters)
    assert names == [
        "pretrained_model_name_or_path",
        "bucket_path",
        "model_task",
        "model_type",
        "model_class",
        "state_class",
        "offload_backend",
        "trainer_module",
        "config_scaling_variables",
        "config_variables",
    ]
    t = RayDistributedTrainer(str(base), offload_backend="cpu")
    assert (t.model_task, t.model_type, t.model_class) == (jm.TaskType.CAUSAL_LM, "llama", jm.LlamaForCausalLM)
    assert t.state_class is TrainState and t.offload_backend == "cpu"
    from jaxloom.trainer import Trainer

    assert t.trainer_module is Trainer


def test_class_variables_are_the_documented_defaults():
    assert RayDistributedTrainer.CONFIG_SCALING_VARIABLES == {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "moe_intermediate_size": 512,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    v = RayDistributedTrainer.CONFIG_VARIABLES
    assert v["gradient_checkpointing"] == jm.EasyDeLGradientCheckPointers.NONE
    assert v["attn_mechanism"] == jm.AttentionMechanisms.AUTO and v["attn_softmax_dtype"] == jnp.bfloat16
    assert v["precision"] == jax.lax.Precision.DEFAULT and v["partition_axis"] == PartitionAxis()
    assert v["partition_axis"].batch_axis == ("fsdp", "dp")
    assert v["dtype"] == v["param_dtype"] == jnp.bfloat16 and v["seed"] == 654 and v["max_position_embeddings"] == 8192
    assert v["sharding_axis_names"] == ("dp", "fsdp", "ep", "tp", "sp") and v["sharding_axis_dims"] == (1, -1, 1, 1, 1)
    assert v["sharding_dcn_axis_dims"] == (1, -1, 1, 1, 1)


def test_config_scaling_variables_merge_with_the_defaults(base):
    t = RayDistributedTrainer(str(base), config_scaling_variables={"hidden_size": 16})
    assert t.config_scaling_variables == {**RayDistributedTrainer.CONFIG_SCALING_VARIABLES, "hidden_size": 16}
    c = t.create_config(2)
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads) == (32, 2048, 4, 2)


def test_convert_model_to_state_uses_state_class_and_does_not_shard(base):
    class MyState(TrainState):
        pass

    t = RayDistributedTrainer(str(base), state_class=MyState, config_scaling_variables=SCALING, config_variables=FIXED)
    state = t.convert_model_to_state(t.create_model_from_config(1))
    assert type(state) is MyState
    leaf = jax.tree_util.tree_leaves(state.params)[0]
    assert len(leaf.sharding.device_set) == 1  # not sharded: that is the trainer's job


def test_create_config_scales_and_needs_no_config_json_when_model_type_is_given(tmp_path):
    t = RayDistributedTrainer(
        str(tmp_path / "nothing-here"),
        model_type="llama",
        model_task=jm.TaskType.CAUSAL_LM,
        config_scaling_variables=SCALING,
        config_variables={**FIXED, "num_hidden_layers": 2, "vocab_size": 64},
    )
    c = t.create_config(scaling_index=2)
    assert isinstance(c, jm.LlamaConfig)
    assert (c.hidden_size, c.num_attention_heads, c.num_hidden_layers, c.vocab_size) == (32, 4, 2, 64)
    assert c.rms_norm_eps == jm.LlamaConfig().rms_norm_eps  # the rest: the config class's defaults


def test_create_model_dtypes_seed_and_lazy(base):
    t = RayDistributedTrainer(str(base), config_scaling_variables=SCALING, config_variables=FIXED)
    cfg = t.create_config(1)
    m = t.create_model(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, precision=jax.lax.Precision.HIGHEST)
    leaf = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x: x, m))[0]
    assert leaf.dtype == jnp.bfloat16 and m.runtime.dtype == jnp.bfloat16 and m.runtime.precision == "highest"
    a, b = t.create_model(cfg, seed=1), t.create_model(cfg, seed=2)
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert any(not np.array_equal(x, y) for x, y in zip(la, lb, strict=True))
    lazy = t.create_model(cfg, lazy=True)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(lazy))


def test_create_model_from_config(base):
    t = RayDistributedTrainer(str(base), config_scaling_variables=SCALING, config_variables=FIXED)
    m = t.create_model_from_config(2)
    assert m.config == t.create_config(2)


def test_create_trainer_returns_the_trainer_module(base, tmp_path):
    t = RayDistributedTrainer(str(base), config_scaling_variables=SCALING, config_variables=FIXED)
    state = t.convert_model_to_state(t.create_model_from_config(1))
    trainer = t.create_trainer(args(tmp_path, max_training_steps=1), TRAIN, None, None, state)
    assert isinstance(trainer, t.trainer_module) and isinstance(trainer, BaseTrainerProtocol)
    trainer.finish()


def test_extract_column_names_is_static():
    assert isinstance(inspect.getattr_static(RayDistributedTrainer, "extract_column_names"), staticmethod)
    assert RayDistributedTrainer.extract_column_names([{"prompt": "a", "completion": "b"}]) == ["prompt", "completion"]


def test_from_config_round_trip(base, tmp_path):
    t = RayDistributedTrainer(str(base), config_scaling_variables=SCALING, config_variables=FIXED)
    t.save_config(tmp_path / "c.json")
    again = RayDistributedTrainer.from_config(tmp_path / "c.json", model_class=jm.LlamaForCausalLM)
    assert again.to_config() == t.to_config() and again.model_class is jm.LlamaForCausalLM


def test_load_processor_and_the_cached_processor_property(base):
    t = RayDistributedTrainer(str(base))
    tok = t.load_processor()
    assert tok.pad_token is not None
    assert t.processor is t.processor and isinstance(
        inspect.getattr_static(RayDistributedTrainer, "processor"), property
    )


def test_process_messages_data_pads_on_the_side_asked(base):
    t = RayDistributedTrainer(str(base))
    chat = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there!"}]
    left = t.process_messages_data(chat, max_length=64, padding_side="left")
    right = t.process_messages_data(chat, max_length=64, padding_side="right")
    n = int(left["attention_mask"].sum())
    assert left["input_ids"].shape == (64,) and left["attention_mask"][-1] == 1 and left["attention_mask"][0] == 0
    assert right["attention_mask"][0] == 1 and right["attention_mask"][-1] == 0
    assert left["input_ids"][-n:].tolist() == right["input_ids"][:n].tolist()


def test_process_sample_data_pads_on_the_side_asked(base):
    t = RayDistributedTrainer(str(base))
    left = t.process_sample_data("A list is", max_length=16, padding_side="left")
    right = t.process_sample_data("A list is", max_length=16, padding_side="right")
    assert left["attention_mask"][0] == 0 and right["attention_mask"][0] == 1


def test_train_keeps_a_custom_state_class(base, tmp_path):
    @dataclasses.dataclass(frozen=True)
    class MyState(TrainState):
        note: jax.Array | None = None

        @classmethod
        def create(cls, model, tx, *, seed=0):
            return super().create(model, tx, seed=seed).replace(note=jnp.zeros(()))

    t = RayDistributedTrainer(str(base), state_class=MyState, config_scaling_variables=SCALING, config_variables=FIXED)
    out = t.train(1, args(tmp_path, max_training_steps=2), TRAIN)
    assert type(out.state) is MyState and int(out.state.step) == 2 and out.state.note is not None


class _ProtocolOnlyTrainer:
    """A trainer of a user's own: EasyDeL's constructor arguments and `train()`, no jaxloom base class."""

    def __init__(self, arguments, model_state, dataset_train, dataset_eval=None, data_collator=None):
        self.arguments, self.model_state = arguments, model_state

    def train(self, model_parameters=None, state=None):
        state = state or self.model_state
        leaves = jax.tree_util.tree_leaves(state.params)
        assert all(isinstance(x, jax.Array) for x in leaves)  # concrete: it can compute with them
        grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
        return state.replace(tx=optax.sgd(0.1), opt_state=optax.sgd(0.1).init(state.params)).apply_gradients(grads)


def test_train_with_a_protocol_only_trainer_module(base, tmp_path):
    t = RayDistributedTrainer(
        str(base), trainer_module=_ProtocolOnlyTrainer, config_scaling_variables=SCALING, config_variables=FIXED
    )
    out = t.train(1, args(tmp_path), TRAIN)
    assert int(out.step) == 1
    with pytest.raises(TypeError, match="need a jaxloom BaseTrainer"):
        t.create_trainer(args(tmp_path), TRAIN, state=out, hooks=[object()])
