"""EasyDeL's BaseTrainer reference (shared/seeds/easydel-base-trainer-api.txt), member by member in the
doc's order, each checked for its effect on one tiny run. Also: constructing a trainer does nothing."""

import inspect
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from util import EVAL, TOK, TRAIN, args, mesh, tiny

import jaxloom.generation as jg
import jaxloom.models as jm
import jaxloom.state as js
from jaxloom.trainer import (
    BaseTrainer,
    NonFiniteLossError,
    Trainer,
    TrainerConfigureDataloaderOutput,
    TrainerConfigureFunctionOutput,
    TrainerConfigureModelOutput,
)


def test_constructing_a_trainer_does_no_io_no_threads_no_compile(tmp_path):
    """Until a builder, `train()` or `evaluate()` runs: no file or folder, no thread, no compilation,
    no change to JAX's configuration (the compilation cache belongs to the start of a run)."""
    model = jm.create_model(tiny(), lazy=True)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_a, **_k: compiles.append(name) if "compile" in name else None
    )
    threads, cache = threading.active_count(), jax.config.jax_compilation_cache_dir
    run = tmp_path / "run"
    t = Trainer(
        args(run, compilation_cache_dir=str(tmp_path / "cache")),
        model,
        dataset_train=TRAIN,
        dataset_eval=EVAL,
        processing_class=TOK,
        mesh=mesh(1),
    )
    assert not run.exists() and not (tmp_path / "cache").exists()
    assert threading.active_count() == threads and compiles == []
    assert jax.config.jax_compilation_cache_dir == cache
    # The documented attributes are there from construction, built on first access (as the docs show a user
    # inspecting them before training): the optimizer and schedule from the plan, the state on its shards.
    assert t.state is None
    assert t.optimizer is not None and t.scheduler is not None
    assert not run.exists()  # planning is abstract (shapes, shardings) and writes nothing
    state = t.model_state
    assert t.state is state and int(state.step) == 0 and type(t.model) is type(state.model)
    assert not run.exists()  # still nothing written: the run directory belongs to the start of training


def test_base_trainer_members_in_the_reference_order(tmp_path):
    model = jm.create_model(tiny(), seed=1)
    seen = []

    def collator(batch):  # data_collator: applied to this process's rows of each batch
        seen.append(batch["input_ids"].shape)
        return batch

    # The constructor's signature, in the reference's order (a module given as model_state is the model).
    names = list(inspect.signature(BaseTrainer).parameters)
    assert names[:8] == [
        "arguments",
        "model_state",
        "model",
        "dataset_train",
        "dataset_eval",
        "data_collator",
        "finetune",
        "processing_class",
    ]
    t = Trainer(
        args(
            tmp_path,
            max_training_steps=2,
            save_steps=2,
            evaluation_steps=None,
            eval_batches=1,
            generation_prompts=("The",),
            generation_interval=2,
            generation_max_new_tokens=3,
        ),
        None,
        model,
        TRAIN,
        EVAL,
        collator,
        True,
        TOK,
        mesh=mesh(2),
    )
    with pytest.raises(TypeError, match="unknown argument"):
        Trainer(args(tmp_path), model=model, dataset_train=TRAIN, not_an_argument=1)
    # arguments, model_state, dataset_train, dataset_eval, data_collator, finetune
    assert t.arguments.max_training_steps == 2 and t.dataset_train is TRAIN and t.dataset_eval is EVAL
    assert t.data_collator is collator and t.finetune is True
    # mesh, checkpoint_manager, _train_source, _eval_source
    assert dict(t.mesh.shape)["fsdp"] == 2
    assert t._train_source.shard_names and t._eval_source.shard_names
    # configure_dataloaders / configure_functions / configure_model return the reference's types
    fns = t.configure_functions()
    assert isinstance(fns, TrainerConfigureFunctionOutput) and fns.mesh is t.mesh
    assert isinstance(fns.checkpoint_manager, js.CheckpointManager) and t.checkpoint_manager is fns.checkpoint_manager
    out = t.configure_model()
    assert isinstance(out, TrainerConfigureModelOutput) and out.state is t.model_state is t._model_state
    assert out.tx is t.optimizer and out.scheduler is t.scheduler and out.config == model.config
    # finetune=True: the given parameters are trained (copied onto the mesh)
    given = np.asarray(nnx_param(model))
    np.testing.assert_array_equal(np.asarray(out.state.params["lm_head"]["kernel"]), given)
    loaders = t.configure_dataloaders()
    assert isinstance(loaders, TrainerConfigureDataloaderOutput)
    assert loaders.max_training_steps == 2 and loaders.max_evaluation_steps == 1
    assert next(iter(loaders.dataloader_eval))["input_ids"].shape == (8, 32)
    # apply_training_hooks: metrics in, metrics out; NaN stops naming the step
    t.start_training_hook()
    ok = {"step": 1, "finite": True, "loss": 1.0, "grad_norm": 1.0}
    assert t.apply_training_hooks(ok) is ok
    with pytest.raises(NonFiniteLossError, match="at step 5"):
        t.apply_training_hooks({**ok, "step": 5, "finite": False, "loss": float("nan")})
    # calculate_number_total_flops: counted from params; training is 3x a forward pass
    flops = t.calculate_number_total_flops(out.state.params)
    assert flops == 3 * t.calculate_number_total_flops(out.state.params, is_training=False) > 0
    half = jax.tree_util.tree_map(lambda x: x[..., : max(1, x.shape[-1] // 2)], out.state.params)
    assert t.calculate_number_total_flops(half) < flops
    # compile_aot: True when it compiled now, False once compiled
    assert t.compile_aot() is True and t.compile_aot() is False
    # count_model_parameters: static, counts numbers
    assert BaseTrainer.count_model_parameters(out.state.params) == jm.count_params(model)
    # create_collect_function (and its grain/tfds variants): truncate and pad
    for make in (t.create_collect_function, t.create_grain_collect_function, t.create_tfds_collect_function):
        batch = make(4, "keep_end")([{"input_ids": [1, 2, 3, 4, 5, 6]}, {"input_ids": [7]}])
        assert batch["input_ids"].tolist() == [
            [3, 4, 5, 6],
            [7, TOK.pad_token_id or 0, TOK.pad_token_id or 0, TOK.pad_token_id or 0],
        ]
    assert t.create_collect_function(2, "keep_start")([{"input_ids": [1, 2, 3]}])["input_ids"].tolist() == [[1, 2]]
    # create_generate_function: fn(state, ids, mask) -> (sequences, completion ids, completion mask)
    ids = np.array([TOK.encode("The", add_special_tokens=False)], np.int32)
    seqs, comp, cmask = t.create_generate_function(max_new_tokens=3)(out.state, ids, np.ones_like(ids))
    assert comp.shape == (1, 3) and seqs.shape == (1, ids.shape[1] + 3)
    # create_progress_bar: a bar with update/close, a no-op one when disabled
    bar = t.create_progress_bar(10, desc="x", disabled=True)
    bar.update(1)
    bar.close()
    # evaluation_batch_size, training_batch_size, is_enable, is_process_zero
    assert t.evaluation_batch_size == 8 and t.training_batch_size == 8
    assert t.is_enable and t.is_process_zero
    # finish is static: callable on the class
    BaseTrainer.finish()
    # generate_aio / generate_unified (GenerationResults is a NamedTuple)
    aio = t.generate_aio(ids, max_new_tokens=2, state=out.state)
    assert aio[1].shape == (1, 2)
    (_, _, _), meta = t.generate_aio(ids, max_new_tokens=2, return_metadata=True)
    assert meta["prompt_length"] == ids.shape[1]
    res = t.generate_unified(prompts="The", max_new_tokens=3)
    assert isinstance(res, tuple) and res._fields == (
        "generation_results",
        "prompt_ids",
        "prompt_mask",
        "sequences",
        "completion_ids",
        "completion_mask",
        "decoded_prompts",
        "completion_prompts",
    )
    with pytest.raises(ValueError, match="no eSurge"):
        t.generate_unified(prompts="The", use_esurge=True)
    # initialize_trainer_utils: idempotent; the rest of the builders' work (callbacks by cadence)
    t.initialize_trainer_utils()
    # every callback in the order it runs: the built-ins by cadence, the trainer's own hooks, then users'
    assert [c.name for c in t.all_callbacks().items] == ["checkpoint", "run files", "preview", "trainer"]
    # log_metrics / log_weight_distribution / maybe_generate / on_step_* / start_* hooks run in train()
    result = t.train()
    assert seen and seen[0] == (8, 32)  # the collator saw each batch
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any('"train/loss"' in r for r in rows) and any('"samples"' in r for r in rows)
    assert t.maybe_generate(result.state, 1) is None and t.maybe_generate(result.state, 2)
    # model: the trained state's
    np.testing.assert_array_equal(np.asarray(nnx_param(t.model)), np.asarray(result.state.params["lm_head"]["kernel"]))
    # save_information, save_pretrained (to_torch: a transformers directory; else an orbax checkpoint)
    assert t.save_information(tmp_path / "info.md").read_text().startswith("#")
    hf = t.save_pretrained(
        result.state, str(tmp_path / "hf"), to_torch=True, easystate_to_huggingface_model_kwargs={"dtype": "bfloat16"}
    )
    raw = (hf / "model.safetensors").read_bytes()
    header = __import__("json").loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert (hf / "config.json").is_file() and {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    native = t.save_pretrained(str(tmp_path / "native"))  # the protocol's (ckpt_path, state) order
    assert js.CheckpointManager(str(native)).latest_step() == 2
    # the checkpoint records the training arguments with the state (EasyDeL keeps them with its checkpoint)
    recorded = js.CheckpointManager(str(native)).read_meta(2)["metadata"]["arguments"]
    assert recorded["learning_rate"] == t.arguments.learning_rate and recorded["seed"] == t.arguments.seed
    with pytest.raises(ValueError, match="gather_fns"):
        t.save_pretrained(result.state, str(tmp_path / "x"), gather_fns={})
    with pytest.raises(ValueError, match="unsupported export option"):
        t.save_pretrained(result.state, str(tmp_path / "x"), torch_save_pretrained_kwargs={"push_to_hub": True})
    # specs_to_name_sharding
    named = t.specs_to_name_sharding({"a": PartitionSpec("fsdp")})
    assert named["a"] == NamedSharding(t.mesh, PartitionSpec("fsdp"))
    t.finish()


def nnx_param(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)["lm_head"]["kernel"][...]


def test_subclass_hooks_are_called_and_their_results_used(tmp_path):
    """Overriding on_step_start / on_step_end / start_training_hook / start_evaluation_hook takes effect:
    the loop calls them, and the state and metrics they return are the ones it goes on with."""
    calls = []

    class Custom(Trainer):
        def start_training_hook(self):
            super().start_training_hook()
            calls.append("start_training")

        def start_evaluation_hook(self):
            super().start_evaluation_hook()
            calls.append("start_evaluation")

        def on_step_start(self, state, step):
            calls.append(("start", step))
            if step == 2:  # zero the parameters before step 2: the update is then from zero
                state = state.replace(params=jax.tree_util.tree_map(jnp.zeros_like, state.params))
            return state

        def on_step_end(self, state, metrics, step):
            calls.append(("end", step))
            return state, {**metrics, "loss": metrics["loss"] * 0 + 123.0}

    t = Custom(
        args(tmp_path, max_training_steps=2, logging_steps=1),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=TRAIN,
        dataset_eval=EVAL,
        processing_class=TOK,
        mesh=mesh(1),
    )
    mine = []
    t.add_callback(lambda run, step: mine.append((step, int(run.state.step))), every=2, name="mine")
    with pytest.raises(ValueError, match="every=0"):
        t.add_callback(lambda run, step: None, every=0)
    out = t.train()
    assert mine == [(2, 2)]  # on its cadence, with its own step's state
    assert calls[:5] == ["start_training", ("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    assert "start_evaluation" in calls  # the final evaluation
    assert out.metrics["loss"] == 123.0
    kernel = np.asarray(out.state.params["lm_head"]["kernel"])
    assert np.abs(kernel).max() < 0.05  # one small update away from zero, not the random init
    t.finish()


def test_finetune_false_draws_new_parameters(tmp_path):
    model = jm.create_model(tiny(), seed=3)
    t = Trainer(args(tmp_path), model=model, dataset_train=TRAIN, finetune=False, processing_class=TOK, mesh=mesh(1))
    fresh = np.asarray(t.configure_model().state.params["lm_head"]["kernel"])
    seeded = np.asarray(nnx_param(jm.create_model(tiny(), seed=0)))
    assert not np.array_equal(fresh, np.asarray(nnx_param(model)))
    np.testing.assert_allclose(fresh, seeded, rtol=1e-6)


def test_train_from_a_given_state_or_parameters_and_evaluate_a_state(tmp_path):
    """`train(state=...)` keeps the state's optimizer state and step; `train(model_parameters=...)` trains
    those parameters; `evaluate(state, metric_calculator)` scores the state given and adds custom metrics."""
    base = Trainer(
        args(tmp_path / "a", max_training_steps=2),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=TRAIN,
        dataset_eval=EVAL,
        processing_class=TOK,
        mesh=mesh(1),
    )
    first = base.train().state
    base.finish()
    cont = Trainer(
        args(tmp_path / "b", max_training_steps=3),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=TRAIN,
        dataset_eval=EVAL,
        processing_class=TOK,
        mesh=mesh(1),
    )
    out = cont.train(state=first)
    assert int(out.state.step) == 3  # continued from step 2: one step trained
    scored = cont.evaluate(first, metric_calculator=lambda state, batch: {"rows": batch["input_ids"].shape[0]})
    assert scored["rows"] == 8 and scored["loss"] != cont.evaluate()["loss"]
    cont.finish()
    params = jax.tree_util.tree_map(jnp.zeros_like, jax.device_get(first.params))
    zero = Trainer(
        args(tmp_path / "c", max_training_steps=1, learning_rate=1e-9),
        model=jm.create_model(tiny(), seed=0),
        dataset_train=TRAIN,
        processing_class=TOK,
        mesh=mesh(1),
    )
    res = zero.train(model_parameters=params)
    assert np.abs(np.asarray(res.state.params["lm_head"]["kernel"])).max() < 1e-6
    zero.finish()


def test_generation_results_is_a_named_tuple():
    assert issubclass(jg.GenerationResults, tuple) and jg.GenerationResults._fields[0] == "generation_results"


@pytest.mark.parametrize("param_dtype", ["bfloat16", None])
def test_dtype_arguments_set_the_compiled_step_and_the_stored_parameters(tmp_path, param_dtype):
    """`dtype="bfloat16"` through the Python API computes in bf16 (the compiled step's matmuls) and keeps
    parameters in `param_dtype` (float32 master weights when it is not set)."""
    model = jm.create_model(tiny(), seed=0)  # float32
    t = Trainer(
        args(tmp_path, dtype="bfloat16", param_dtype=param_dtype, max_training_steps=1),
        model=model,
        dataset_train=TRAIN,
        processing_class=TOK,
        mesh=mesh(1),
    )
    assert t.dtype == jnp.bfloat16 and t.param_dtype == (jnp.dtype(param_dtype or "float32"))
    # The program as jaxloom lowers it (XLA's CPU backend later widens bf16 dots to f32; GPUs keep them).
    dots = [line for line in t.lower_train_step().as_text().splitlines() if "stablehlo.dot_general" in line]
    bf16 = [line for line in dots if line.rstrip().endswith("bf16>")]
    assert dots and len(bf16) >= 0.8 * len(dots), (len(bf16), len(dots))
    state = t.train().state
    assert {x.dtype for x in jax.tree_util.tree_leaves(state.params)} == {jnp.dtype(param_dtype or "float32")}
    t.finish()


def test_runtime_arguments_rebuild_the_model_in_the_python_api(tmp_path):
    """attn_mechanism, attn_block_size and remat given as arguments replace the model's own."""
    model = jm.create_model(tiny(), lazy=True)
    t = Trainer(
        args(tmp_path, attn_mechanism="chunked", attn_block_size=8, remat="full", max_training_steps=1),
        model=model,
        dataset_train=TRAIN,
        processing_class=TOK,
        mesh=mesh(1),
    )
    assert (t.runtime.attn_mechanism, t.runtime.attn_block_size, t.runtime.remat) == ("chunked", 8, "full")
    rt = t.configure_model().model.runtime
    assert (rt.attn_mechanism, rt.attn_block_size, rt.remat) == ("chunked", 8, "full")
    with pytest.raises(ValueError, match="attn_mechanism = 'nope'; expected one of"):
        args(tmp_path, attn_mechanism="nope")
    with pytest.raises(ValueError, match="change the layout"):
        Trainer(
            args(tmp_path, scan_layers=True),
            model=jm.create_model(tiny(), seed=0),
            dataset_train=TRAIN,
            processing_class=TOK,
            mesh=mesh(1),
        ).configure_model()
