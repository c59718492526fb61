"""RayDistributedConfig and RayDistributedTrainer's configuration side (no Ray cluster needed)."""

import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from util import FIXED, SCALING, TOK, base_model_dir

import jaxloom.models as jm
from jaxloom.mesh import PartitionAxis
from jaxloom.ray import RayDistributedConfig, RayDistributedTrainer


def test_config_json_round_trip_with_dtypes_and_partition_axis(tmp_path):
    pa = PartitionAxis(tensor_parallel_axis="mp", head_axis="mp")
    cfg = RayDistributedConfig(
        pretrained_model_name_or_path="/m",
        model_task=jm.TaskType.CAUSAL_LM,
        model_type="llama",
        offload_backend="cpu",
        config_scaling_variables={"hidden_size": 64},
        config_variables={
            "dtype": jnp.bfloat16,
            "param_dtype": np.float32,
            "partition_axis": pa,
            "sharding_axis_dims": (1, -1, 1, 1, 1),
        },
    )
    pre = cfg._saving_preprocess()  # in place, as EasyDeL's: "use it before saving"
    assert pre is cfg
    assert pre.config_variables["dtype"] == "bfloat16" and pre.config_variables["param_dtype"] == "float32"
    assert pre.config_variables["partition_axis"] == pa.to_dict()
    assert pre.model_task == "causal-language-model"
    back = RayDistributedConfig.load(cfg.save(tmp_path / "c.json"))
    assert back.config_variables["dtype"] == jnp.dtype("bfloat16")
    assert back.config_variables["partition_axis"] == pa
    assert back.config_variables["sharding_axis_dims"] == (1, -1, 1, 1, 1)
    assert back.pretrained_model_name_or_path == "/m" and back.offload_backend == "cpu"
    assert pre._loading_postprocess().config_variables == back.config_variables


def test_config_rejects_unknown_fields_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="bucket"):
        RayDistributedConfig(pretrained_model_name_or_path="/m", bucket="x")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="malformed JSON at line 1"):
        RayDistributedConfig.load(bad)
    with pytest.raises(FileNotFoundError, match="no RayDistributedTrainer config"):
        RayDistributedConfig.load(tmp_path / "missing.json")


def test_model_resolution(tmp_path):
    base = base_model_dir(tmp_path)
    by_class = RayDistributedTrainer(str(base), model_class=jm.MistralForCausalLM)
    assert (by_class.model_type, by_class.model_task) == ("mistral", jm.TaskType.CAUSAL_LM)
    by_file = RayDistributedTrainer(str(base))  # model_type from config.json
    assert by_file.model_class is jm.LlamaForCausalLM
    nameless = tmp_path / "nameless"
    nameless.mkdir()
    (nameless / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="cannot resolve the model"):
        RayDistributedTrainer(str(nameless))
    with pytest.raises(ValueError, match="no model registered for model_type='gpt9'"):
        RayDistributedTrainer(str(base), model_type="gpt9")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        RayDistributedTrainer("meta-llama/Llama-2-7b-hf")


def test_create_config_scales_and_fixes(tmp_path):
    t = RayDistributedTrainer(
        str(base_model_dir(tmp_path)),
        config_scaling_variables=SCALING,
        config_variables={**FIXED, "initializer_range": 0.05},
    )
    for k in (1, 3):
        c = t.create_config(k)
        assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads) == (
            16 * k,
            32 * k,
            2 * k,
            k,
        )
        assert c.head_dim == 8 and c.num_hidden_layers == 2 and c.vocab_size == len(TOK)
        assert c.max_position_embeddings == 64 and c.initializer_range == 0.05
    m = t.create_model_from_config(2)
    assert jm.count_params(m) == jm.count_params(jm.create_model(t.create_config(2)))
    assert t.runtime().dtype == jnp.float32
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="scaling_index"):
            t.create_config(bad)


def test_bad_variables_are_named(tmp_path):
    base = str(base_model_dir(tmp_path))
    with pytest.raises(ValueError, match=r"unknown config_variables \['hiden_size'\]"):
        RayDistributedTrainer(base, config_variables={"hiden_size": 3})
    with pytest.raises(ValueError, match="config_scaling_variables"):
        RayDistributedTrainer(base, config_scaling_variables={"hidden_size": 0})
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        RayDistributedTrainer(base, config_variables={"gradient_checkpointing": "sometimes"})
    with pytest.raises(ValueError, match="not a dtype"):
        RayDistributedTrainer(base, config_variables={"dtype": "float33"})
    with pytest.raises(ValueError, match="offload_backend"):
        RayDistributedTrainer(base, offload_backend="disk")


def test_save_config_and_from_config_with_overrides(tmp_path):
    t = RayDistributedTrainer(
        str(base_model_dir(tmp_path)),
        config_scaling_variables=SCALING,
        config_variables={**FIXED, "partition_axis": PartitionAxis(head_axis="fsdp")},
        offload_backend="cpu",
    )
    path = t.save_config(tmp_path / "trainer_config.json")
    assert json.loads(path.read_text())["config_variables"]["dtype"] == "float32"
    back = RayDistributedTrainer.from_config(path, model_class=jm.LlamaForCausalLM, bucket_path="/ckpt")
    assert back.bucket_path == "/ckpt" and back.offload_backend == "cpu"
    assert back.config_variables == t.config_variables
    assert back.create_config(2) == t.create_config(2)


def test_processor_and_sample_processing(tmp_path, caplog):
    base = base_model_dir(tmp_path)
    t = RayDistributedTrainer(str(base))
    assert t.processor is t.processor  # cached
    left = t.process_sample_data("A list is", max_length=16, padding_side="left")
    right = t.process_sample_data({"text": "A list is"}, max_length=16, padding_side="right")
    assert left["input_ids"].shape == (16,) and right["attention_mask"].shape == (16,)
    assert left["attention_mask"][-1] == 1 and right["attention_mask"][0] == 1 and right["attention_mask"][-1] == 0
    chat = t.process_messages_data(
        [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi"}], max_length=64
    )
    assert chat["input_ids"].shape == (64,) and chat["attention_mask"].sum() > 4
    import datasets

    assert t.extract_column_names(datasets.Dataset.from_list([{"text": "a", "id": 1}])) == ["text", "id"]
    # pad falls back to eos, with a warning
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg.pop("pad_token", None)
    (base / "tokenizer_config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING):
        tok = RayDistributedTrainer(str(base)).load_processor()
    assert tok.pad_token == tok.eos_token


def test_progress_board_remembers_when_training_began():
    """A gang that finishes before the driver reads the board still says when it made its first step
    (the driver's restart-to-first-step time after a failure needs it)."""
    import time

    from jaxloom.ray.worker import ProgressBoard

    board = ProgressBoard()
    board.beat(0, 0, "joined")
    assert board.snapshot()[2] is None
    board.beat(0, 1, "step", {"step": 1})
    time.sleep(0.05)
    board.beat(0, 3, "step")
    beats, reports, first_step_ago = board.snapshot()
    assert beats[0][1:] == (3, "step") and reports == [{"step": 1}]
    assert first_step_ago is not None and first_step_ago >= 0.05 > beats[0][0]


def test_a_step_that_saves_reports_once_with_its_checkpoint(tmp_path):
    """Rank 0's beat hook: a step's interval beat waits for the next step's start, so a step that saves
    sends one report (with its checkpoint), and a step that does not is still reported."""
    import types

    from jaxloom.ray.worker import WorkerContext
    from jaxloom.trainer.callbacks import RunView

    import jaxloom.state as js

    sent, manager = [], js.CheckpointManager(str(tmp_path / "checkpoints"))  # no folder yet: nothing opened
    board = types.SimpleNamespace(beat=types.SimpleNamespace(remote=lambda *a: sent.append(a)))
    (hook,) = WorkerContext(rank=0, world_size=1, attempt=0, board=board, report_interval_s=0.0).hooks()
    history = []
    run = RunView(  # what the trainer gives its callbacks
        arguments=lambda: None,
        state=(lambda: None, lambda value: None),
        checkpoints=lambda: manager,
        history=lambda: history,
        evaluates=False,
        is_process_zero=True,
        request_stop=lambda reason: None,
    )
    for step, saves in ((1, True), (2, False), (3, True)):
        hook.on_step_start(run, step)
        history.append({"step": step, "train/loss": 1.0 / step})
        hook.on_step_end(run, step, {})
        if saves:
            hook.on_save(run, step)
    hook.on_step_start(run, 4)
    reports = [(step, report["step"], report["checkpoint_dir"]) for _, step, _, report in sent]
    folder = tmp_path / "checkpoints"  # each saved step's folder (`CheckpointManager.step_folder`)
    assert reports == [(1, 1, str(folder / "1")), (2, 2, str(folder / "1")), (3, 3, str(folder / "3"))]
