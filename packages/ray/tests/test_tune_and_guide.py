"""A Ray Tune sweep over scaling_index, RayDistributedTrainer.train_on_ray, and every example of
easydel-ray-distributed-trainer-guide.md adapted to jaxloom's import paths and a tiny model."""

import math

import jax.numpy as jnp
import pytest
import ray
from util import EVAL, FIXED, SCALING, TRAIN, args, base_model_dir

from jaxloom.models import (
    AttentionMechanisms,
    EasyDeLGradientCheckPointers,
    LlamaConfig,
    LlamaForCausalLM,
    TaskType,
)
from jaxloom.ray import RayDistributedTrainer, ScalingConfig
from jaxloom.state import TrainState
from jaxloom.trainer import Trainer, TrainingArguments

TWO_DEVICES = {**FIXED, "sharding_axis_dims": (1, -1, 1, 1, 1)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_model_dir(tmp_path_factory.mktemp("guide"))


def test_tune_sweep_over_scaling_index_returns_the_better_trial(ray_cluster, base, tmp_path):
    t = RayDistributedTrainer(str(base), config_scaling_variables=SCALING, config_variables=TWO_DEVICES)
    a = args(tmp_path, total_batch_size=4, max_training_steps=3, eval_batches=1, evaluation_steps=1, save_steps=1)
    sweep = t.tune({"scaling_index": [1, 2]}, a, TRAIN, EVAL, scaling=ScalingConfig(num_workers=1))
    assert len(sweep.trials) == 2
    for trial in sweep.trials:  # progress while training (each checkpoint after an eval), then the summary
        assert trial["reported_steps"][:2] == [2, 3] and trial["reported_steps"][-1] == 3, trial
    losses = {tr["config"]["scaling_index"]: tr["metrics"]["eval_loss"] for tr in sweep.trials}
    assert all(math.isfinite(v) for v in losses.values()) and losses[1] != losses[2]
    best = min(losses, key=losses.get)
    assert sweep.best_config == {"scaling_index": best} and sweep.best_metrics["eval_loss"] == losses[best]
    assert (tmp_path / "sweep").is_dir() and sweep.best_checkpoint_dir.startswith(str(tmp_path / "sweep"))
    with pytest.raises(ValueError, match=r"param_space keys \['learning_rat'\]"):
        t.tune({"learning_rat": [1e-3]}, a, TRAIN, EVAL)


def test_train_on_ray_two_workers(ray_cluster, base, tmp_path):
    t = RayDistributedTrainer(str(base), config_scaling_variables=SCALING, config_variables=TWO_DEVICES)
    res = t.train_on_ray(
        1,
        args(tmp_path, total_batch_size=4, max_training_steps=3, eval_batches=1),
        TRAIN,
        EVAL,
        scaling=ScalingConfig(num_workers=2),
    )
    out = res.result
    assert res.attempts == 1 and out["step"] == 3 and math.isfinite(out["metrics"]["eval_loss"])
    assert out["report_path"] == str(tmp_path / "report.md") and (tmp_path / "report.md").is_file()
    assert "fsdp" in (tmp_path / "report.md").read_text()


# ---- the guide, section by section -----------------------------------------------------------------------
def test_guide_creating_a_trainer_instance(base):
    trainer = RayDistributedTrainer(
        pretrained_model_name_or_path=str(base),
        model_task=TaskType.CAUSAL_LM,
        model_type="llama",
        offload_backend="cpu",
    )
    assert trainer.model_class is LlamaForCausalLM
    trainer = RayDistributedTrainer(pretrained_model_name_or_path=str(base), model_class=LlamaForCausalLM)
    assert (trainer.model_type, trainer.model_task) == ("llama", TaskType.CAUSAL_LM)


def test_guide_configuration_management(base, tmp_path):
    trainer = RayDistributedTrainer(str(base), model_class=LlamaForCausalLM)
    trainer.save_config(tmp_path / "trainer_config.json")
    again = RayDistributedTrainer.from_config(tmp_path / "trainer_config.json", model_class=LlamaForCausalLM)
    assert again.to_config() == trainer.to_config()


def test_guide_scaling_variables(base):
    trainer = RayDistributedTrainer(
        pretrained_model_name_or_path=str(base),
        config_scaling_variables={
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
        },
        config_variables={
            "dtype": jnp.bfloat16,
            "max_position_embeddings": 8192,
            "attn_mechanism": AttentionMechanisms.FLASH,
            "gradient_checkpointing": EasyDeLGradientCheckPointers.SELECTIVE,
        },
    )
    config = trainer.create_config(scaling_index=2)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads) == (512, 2048, 8)
    assert config.max_position_embeddings == 8192
    assert (trainer.runtime().attn_mechanism, trainer.runtime().remat) == ("flash", "dots_saveable")


def test_guide_model_initialization_options(base, tmp_path):
    trainer = RayDistributedTrainer(str(base), config_scaling_variables=SCALING, config_variables=FIXED)
    training_args = args(tmp_path / "a", max_training_steps=1)
    existing_state = trainer.convert_model_to_state(trainer.create_model_from_config(1))
    assert (
        int(
            trainer.train(
                scaling_index=1, arguments=training_args, dataset_train=TRAIN, state=existing_state
            ).state.step
        )
        == 1
    )
    initialized_model = trainer.create_model_from_config(1)
    trainer.train(
        scaling_index=1,
        arguments=args(tmp_path / "b", max_training_steps=1),
        dataset_train=TRAIN,
        model=initialized_model,
    )
    from_bucket = RayDistributedTrainer(
        str(base), bucket_path=str(tmp_path / "a"), config_scaling_variables=SCALING, config_variables=FIXED
    )
    from_bucket.train(scaling_index=1, arguments=args(tmp_path / "c", max_training_steps=1), dataset_train=TRAIN)
    out = trainer.train(scaling_index=2, arguments=args(tmp_path / "d", max_training_steps=1), dataset_train=TRAIN)
    assert out.state.params["model"]["embed_tokens"]["embedding"].shape[1] == 2 * SCALING["hidden_size"]


def test_guide_data_processing(base):
    trainer = RayDistributedTrainer(str(base))
    processed = trainer.process_sample_data(sample="This is a text sample", max_length=512, padding_side="left")
    assert processed["input_ids"].shape == (512,)
    messages = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there!"}]
    processed = trainer.process_messages_data(messages=messages, max_length=512, padding_side="left")
    assert processed["attention_mask"].shape == (512,)
    assert trainer.extract_column_names([{"text": "a"}]) == ["text"]


def test_guide_training_with_automatic_resume(base, tmp_path):
    trainer = RayDistributedTrainer(str(base), config_scaling_variables=SCALING, config_variables=FIXED)
    arguments = TrainingArguments(
        resume_if_possible=True,
        save_directory=str(tmp_path),
        max_training_steps=2,
        total_batch_size=8,
        learning_rate=1e-4,
        max_sequence_length=32,
        save_steps=2,
        progress_bar=False,
        use_tensorboard=False,
    )
    trainer.train(scaling_index=1, arguments=arguments, dataset_train=TRAIN, dataset_eval=EVAL)
    out = trainer.train(
        scaling_index=1, arguments=arguments.replace(max_training_steps=3), dataset_train=TRAIN, dataset_eval=EVAL
    )
    assert out.resumed_from.endswith("checkpoints/2") and int(out.state.step) == 3


def test_guide_integration_with_ray(ray_cluster, base, tmp_path):
    @ray.remote
    class Worker:
        def __init__(self, scaling_index):
            self.trainer = RayDistributedTrainer(
                pretrained_model_name_or_path=str(base),
                model_type="llama",
                model_task=TaskType.CAUSAL_LM,
                config_scaling_variables=SCALING,
                config_variables={**FIXED, "sharding_axis_dims": (1, 1, 1, 1, 1)},
            )
            self.scaling_index = scaling_index

        def train_model(self, dataset, args):
            import os

            os.environ["JAX_PLATFORMS"] = "cpu"
            import jax

            jax.config.update("jax_num_cpu_devices", 1)
            out = self.trainer.train(scaling_index=self.scaling_index, arguments=args, dataset_train=dataset)
            return int(out.state.step), out.state.params["model"]["embed_tokens"]["embedding"].shape[1]

    workers = [Worker.remote(scaling_index=i) for i in [1, 2]]
    results = ray.get(
        [
            w.train_model.remote(TRAIN[:50], args(tmp_path / str(i), max_training_steps=1, total_batch_size=2))
            for i, w in enumerate(workers)
        ]
    )
    assert results == [(1, 16), (1, 32)]
    for w in workers:
        ray.kill(w)


def test_guide_custom_model_state_and_trainer_classes(base, tmp_path):
    class CustomModel(LlamaForCausalLM):
        _model_type = "custom"
        _model_task = TaskType.CUSTOM
        config_class = LlamaConfig  # what create_config builds for this model type

    class CustomState(TrainState):
        pass

    class CustomTrainer(Trainer):
        pass

    trainer = RayDistributedTrainer(
        pretrained_model_name_or_path=str(base),
        model_class=CustomModel,
        state_class=CustomState,
        trainer_module=CustomTrainer,
        config_scaling_variables=SCALING,
        config_variables=FIXED,
    )
    assert (trainer.model_type, trainer.model_task) == ("custom", TaskType.CUSTOM)
    state = trainer.convert_model_to_state(trainer.create_model_from_config(1))
    assert isinstance(state, CustomState) and isinstance(state.model, CustomModel)
    t = trainer.create_trainer(args(tmp_path / "a", max_training_steps=1), TRAIN, state=state)
    assert isinstance(t, CustomTrainer)
    t.finish()
    out = trainer.train(1, args(tmp_path / "b", max_training_steps=1), TRAIN)  # the classes are kept in training
    assert type(out.state) is CustomState and isinstance(out.state.model, CustomModel)


def test_guide_troubleshooting(base):
    trainer = RayDistributedTrainer(
        pretrained_model_name_or_path=str(base),
        model_type="llama",
        model_task=TaskType.CAUSAL_LM,
        config_scaling_variables=SCALING,
        config_variables=FIXED,
    )
    tokenizer = trainer.load_processor()
    tokenizer.pad_token = tokenizer.eos_token
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    model = trainer.create_model(config=trainer.create_config(1), lazy=True)
    import jax

    assert isinstance(jax.tree_util.tree_leaves(model)[0], jax.ShapeDtypeStruct)
