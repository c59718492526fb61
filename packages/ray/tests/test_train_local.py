"""RayDistributedTrainer.train in this process: where the starting parameters come from."""

import jax
import numpy as np
import pytest
from util import EVAL, FIXED, SCALING, TRAIN, args, base_model_dir

import jaxloom.models as jm
from jaxloom.ray import RayDistributedTrainer, params_fingerprint


class FirstParams:
    """Records the fingerprint of the parameters the first step starts from."""

    def __init__(self):
        self.value = None

    def on_step_start(self, run, step):
        if step == 1 and self.value is None:
            self.value = params_fingerprint(run.state.params)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("local")
    t = RayDistributedTrainer(str(base_model_dir(root)), config_scaling_variables=SCALING, config_variables=FIXED)
    return t, root


def _start(t, root, name, **kw):
    hook = FirstParams()
    out = t.train(1, args(root / name, max_training_steps=2), TRAIN, EVAL, hooks=[hook], **kw)
    return hook.value, out


def test_new_scaled_model_trains_and_reports(setup):
    t, root = setup
    first, out = _start(t, root, "new")
    assert out.stop_reason == "max_training_steps reached" and int(out.state.step) == 2
    assert np.isfinite(out.metrics["eval_loss"]) and (root / "new" / "report.md").is_file()
    shapes = jax.tree_util.tree_map(lambda x: x.shape, out.state.params)
    expect = jax.tree_util.tree_map(lambda x: x.shape, jm.create_model(t.create_config(1), lazy=True))
    assert shapes["model"]["embed_tokens"]["embedding"] == (t.create_config(1).vocab_size, 16)
    assert expect is not None and first is not None


def test_priority_state_over_model_over_bucket_over_new(setup):
    t, root = setup
    _, trained = _start(t, root, "bucket_src")
    bucket_params = params_fingerprint(trained.state.params)
    model = t.create_model_from_config(1)
    other = t.create_model(t.create_config(1), seed=99)
    state = t.convert_model_to_state(other)

    from_state, _ = _start(t, root, "p_state", model=model, state=state)
    from_model, _ = _start(t, root, "p_model", model=model)
    with_bucket = RayDistributedTrainer(
        t.pretrained_model_name_or_path,
        bucket_path=str(root / "bucket_src"),
        config_scaling_variables=SCALING,
        config_variables=FIXED,
    )
    from_bucket, _ = _start(with_bucket, root, "p_bucket")
    from_bucket_given_model, _ = _start(with_bucket, root, "p_bucket_model", model=model)

    assert from_state == params_fingerprint(state.params)
    assert from_model == params_fingerprint(t.convert_model_to_state(model).params)
    assert from_bucket == bucket_params
    assert from_bucket_given_model == from_model
    assert len({from_state, from_model, from_bucket}) == 3


def test_bucket_path_errors_and_hf_directory(setup):
    t, root = setup
    empty = root / "empty_bucket"
    empty.mkdir()
    bad = RayDistributedTrainer(
        t.pretrained_model_name_or_path,
        bucket_path=str(empty),
        config_scaling_variables=SCALING,
        config_variables=FIXED,
    )
    with pytest.raises(FileNotFoundError, match="no complete checkpoint and no config.json"):
        bad.train(1, args(root / "x"), TRAIN)
    hf = root / "hf"
    model = t.create_model_from_config(1)
    jm.save_hf_model(model, hf)
    from_hf = RayDistributedTrainer(
        t.pretrained_model_name_or_path, bucket_path=str(hf), config_scaling_variables=SCALING, config_variables=FIXED
    )
    first, _ = _start(from_hf, root, "p_hf")
    assert first == params_fingerprint(t.convert_model_to_state(model).params)


def test_resume_wins_and_data_collator_applies(setup):
    t, root = setup
    t.train(1, args(root / "resume", max_training_steps=2, save_steps=2), TRAIN)
    out = t.train(1, args(root / "resume", max_training_steps=3, resume_if_possible=True), TRAIN)
    assert out.resumed_from.endswith("checkpoints/2") and int(out.state.step) == 3
    seen = []

    def collator(record):
        seen.append(record)
        return {"text": record["question"] + " " + record["answer"]}

    qa = [{"question": f"What is {i}?", "answer": f"It is {i}."} for i in range(64)]
    out = t.train(1, args(root / "collate", max_training_steps=2), qa, data_collator=collator)
    assert int(out.state.step) == 2 and seen and set(seen[0]) == {"question", "answer"}


def test_trainer_module_dpo_trains_preference_pairs(tmp_path):
    """`RayDistributedTrainer(..., trainer_module=DPOTrainer)`: the documented way to run another trainer."""
    from jaxloom.trainer import DPOConfig, DPOTrainer

    t = RayDistributedTrainer(
        str(base_model_dir(tmp_path)),
        config_scaling_variables=SCALING,
        config_variables=FIXED,
        trainer_module=DPOTrainer,
    )
    pairs = [{"prompt": f"say {w}:", "chosen": f" {w}", "rejected": " no"} for w in ("red", "blue", "cat", "dog")] * 4
    a = args(tmp_path / "dpo", max_training_steps=2).to_dict()
    a.pop("packing"), a.pop("truncation_mode")
    out = t.train(1, DPOConfig(**{**a, "max_sequence_length": 16, "beta": 0.2}), pairs)
    assert isinstance(t.create_trainer(DPOConfig(), pairs, state=out.state), DPOTrainer)
    assert out.stop_reason == "max_training_steps reached" and int(out.state.step) == 2
    assert {"rewards/accuracies", "logps/rejected"} <= set(out.metrics)
