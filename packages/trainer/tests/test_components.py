"""The component graph: each component built on first use by its builder in `components.py`, once, from the
components it names; the trainer's constructor builds none; the wiring is data (`Parts.wiring()`); no component
module imports the trainer or keeps it; the checkpoint path in a stop message is the run directory's (a URI)."""

import ast
import math
from pathlib import Path

import pytest
from util import TOK, TRAIN, mesh, tiny

import jaxloom.models as jm
from jaxloom.trainer import Trainer, TrainingArguments
from jaxloom.trainer.components import IfBuilt, Later, Parts
from jaxloom.trainer.stopping import NonFiniteLossError

SRC = Path(__file__).resolve().parents[1] / "src" / "jaxloom" / "trainer"
# the modules that define components (each a class owning its state), as opposed to the trainer and its drivers
COMPONENT_MODULES = [
    "batches.py",
    "callbacks.py",
    "checkpointing.py",
    "evaluation.py",
    "export.py",
    "functions.py",
    "monitor.py",
    "plan.py",
    "previews.py",
    "reference.py",
    "run_directory.py",
    "step.py",
    "stopping.py",
    "grpo/rollouts.py",
    "grpo/drawing.py",
    "grpo/pipeline.py",
    "grpo/sampler.py",
    "grpo/loss.py",
    "grpo/rewards.py",
]
TRAINER_CLASSES = {"BaseTrainer", "Trainer", "DPOTrainer", "GRPOTrainer", "ReferenceSurface"}


def test_parts_build_once_on_first_use_and_record_what_each_was_built_from():
    """A builder names its collaborators as keyword parameters: components, or the owner's inputs (`inputs`: the
    attribute each is read from); `Later` ones come as functions, built when called; `IfBuilt` ones only if
    something else built them."""
    calls = []

    def a(*, seed):
        calls.append("a")
        return ["a", seed]

    def b(*, a):
        calls.append("b")
        return ("b", a[0])

    class Owner:
        parts = Parts({"a": a, "b": b}, inputs={"seed": "given_seed"})
        given_seed = 7

    owner = Owner()
    assert not owner.parts.built("a") and owner.parts.wiring() == []
    assert owner.parts.get("b", owner) == ("b", "a") and owner.parts.get("b", owner) == ("b", "a")
    assert calls == ["b", "a"] or calls == ["a", "b"]  # each once: `b` asked for `a`, which was made first
    assert owner.parts.get("a", owner) == ["a", 7]  # the input read from the owner's attribute it names
    assert owner.parts.wiring() == [("a", "list", []), ("b", "tuple", ["a"])]
    owner.parts.forget(["b"])
    assert owner.parts.built("a") and not owner.parts.built("b")
    owner.parts.get("b", owner)
    assert calls.count("b") == 2 and calls.count("a") == 1

    def lazy(*, c: Later[list], b_if_built: IfBuilt[tuple]):  # `<name>_if_built`: beside a `Later` of the same
        return (c, b_if_built)

    def c():
        calls.append("c")
        return ["c"]

    owner.parts.builders.update(lazy=lazy, c=c)
    later, if_built = owner.parts.get("lazy", owner)
    assert "c" not in calls and if_built() == ("b", "a")  # nothing built for them until asked
    assert later() == ["c"] and calls.count("c") == 1
    owner.parts.forget(["b"])
    assert if_built() is None and not owner.parts.built("b")  # never built by an IfBuilt

    def loop(*, loop):
        return loop

    owner.parts.builders["loop"] = loop
    with pytest.raises(RuntimeError, match="component 'loop' needs itself: loop -> loop"):
        owner.parts.get("loop", owner)

    def unknown(*, trainer):
        return trainer

    owner.parts.builders["unknown"] = unknown
    with pytest.raises(TypeError, match="unknown\\(\\) names 'trainer', which is neither a component"):
        owner.parts.get("unknown", owner)


def test_parts_build_each_component_once_across_threads_and_keep_each_threads_chain():
    """Setup builds in the background (the train step compiles while the state is made): two threads asking for
    one component get the same one, built once, and neither's chain of builds shows in the other's wiring."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    count, started = [], threading.Event()

    def slow():
        count.append(1)
        started.set()
        time.sleep(0.2)
        return object()

    def other(*, slow: Later[object]):
        started.wait()
        return ("other", slow())

    class Owner:
        parts = Parts({"slow": slow, "other": other, "plain": lambda: "plain"})

    owner = Owner()
    with ThreadPoolExecutor(3) as pool:
        a = pool.submit(owner.parts.get, "slow", owner)
        b = pool.submit(owner.parts.get, "other", owner)
        started.wait()
        c = pool.submit(owner.parts.get, "plain", owner)
        assert b.result()[1] is a.result() and c.result() == "plain"
    assert len(count) == 1
    assert dict((n, needs) for n, _, needs in owner.parts.wiring()) == {"slow": [], "plain": [], "other": ["slow"]}


def test_a_trainer_builds_no_component_until_one_is_used_then_shows_the_graph(tmp_path):
    trainer = Trainer(
        TrainingArguments(save_directory=str(tmp_path), max_training_steps=2, total_batch_size=8),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=TRAIN,
        processing_class=TOK,
        mesh=mesh(1),
    )
    assert trainer.parts.wiring() == []  # the constructor stores what it was given and nothing else
    trainer.functions  # noqa: B018
    wiring = {name: (cls, needs) for name, cls, needs in trainer.parts.wiring()}
    assert wiring["functions"] == ("StepFunctions", ["plan", "batches"])
    # max_training_steps given: the plan needs no data (without it, the epochs' steps are the batches' to count)
    assert wiring["plan"] == ("Plan", ["source_model"]) and wiring["batches"] == ("Batches", [])
    assert wiring["source_model"][1] == []  # the model given, as this kind trains it (a reward kind: a classifier)
    assert [n for n, _, _ in trainer.parts.wiring()] == ["source_model", "plan", "batches", "functions"]  # in order
    assert not trainer.parts.built("checkpointing") and not trainer.parts.built("run_directory")
    trainer.finish()  # releases only what was built: no run directory was taken
    assert not trainer.parts.built("run_directory")


@pytest.mark.parametrize("kind", ["sft", "dpo", "kto", "grpo", "rloo", "reward", "distillation"])
def test_every_builder_of_every_kind_names_collaborators_the_run_has_never_the_trainer(kind):
    """Issue 72: a component is built from the collaborators its builder names as keyword parameters — components,
    or the run's inputs the kind declares (`INPUTS`: the one table of trainer members given by name) — so the
    wiring reads from the code. Every name resolves for every kind, and each input names a member the kind has."""
    import inspect

    from jaxloom.trainer.kinds import KINDS
    from jaxloom.trainer.session import Session

    cls = KINDS[kind]
    parts = Parts.of(cls)
    assert {"plan", "batches", "functions", "setup", "checkpointing", "step_log"} <= set(parts.builders)
    for name, builder in [*parts.builders.items(), ("session", Session)]:
        for p in inspect.signature(builder).parameters.values():
            wanted = p.name.removesuffix("_if_built")
            assert p.kind is inspect.Parameter.KEYWORD_ONLY, (kind, name, p.name)
            assert p.name not in ("trainer", "_trainer", "owner", "self"), (kind, name)
            assert wanted in parts.builders or wanted in parts.inputs, (kind, name, p.name)
    instance_attributes = {"run", "dataset_train", "dataset_eval", "data_collator", "finetune", "hooks", "callbacks"}
    instance_attributes |= {"_state_in", "_tokenizer", "run_config", "reward_weights", "rollout_engine"}
    for given, attribute in parts.inputs.items():
        assert hasattr(cls, attribute) or attribute in instance_attributes, (kind, given, attribute)


def test_no_component_module_imports_the_trainer_or_keeps_it():
    for rel in COMPONENT_MODULES:
        tree = ast.parse((SRC / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = (node.module or "").split(".")[-1]
                names = {a.name for a in node.names}
                assert target != "trainer" and not (names & TRAINER_CLASSES), f"{rel} imports the trainer"
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name not in TRAINER_CLASSES):
            for node in ast.walk(cls):
                targets = node.targets if isinstance(node, ast.Assign) else []
                for t in targets:
                    kept = isinstance(t, ast.Attribute) and t.attr in ("trainer", "_trainer")
                    assert not kept, f"{path.relative_to(SRC)}: {cls.name} keeps the trainer"


def _readers(attribute: str) -> set[str]:
    """The source modules that read `<something>.attribute`."""
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == attribute and isinstance(node.ctx, ast.Load):
                found.add(str(path.relative_to(SRC)))
    return found


def test_each_setting_is_read_by_its_owner_and_the_composition_root_only():
    """`save_directory` by the run directory and the composition root (the builders, the command line, the
    arguments' own checks); `learning_rate` by the optimizer the plan builds. A component that needs the run's
    path asks the run directory."""
    assert _readers("save_directory") == {"run_directory.py", "components.py", "cli.py", "arguments.py"}
    assert _readers("learning_rate") == {"optim.py"}


def test_the_nan_stop_message_names_the_checkpoints_of_a_run_on_a_store():
    trainer = Trainer(
        TrainingArguments(save_directory="s3://bucket/run", nan_policy="stop"),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=TRAIN,
        processing_class=TOK,
        mesh=mesh(1),
    )
    metrics = {"step": 3, "finite": False, "loss": math.nan, "grad_norm": math.inf}
    with pytest.raises(NonFiniteLossError, match=r"The last checkpoint in s3://bucket/run/checkpoints is untouched"):
        trainer.stop_control.apply_training_hooks(metrics)


def test_callbacks_get_a_view_of_the_run_never_the_trainer(tmp_path, monkeypatch):
    """Every event and cadence callback is called with the run's `RunView`: the state of its step (which it may
    replace), the arguments, the checkpoint manager, the rows logged so far, and a stop request that ends the run
    after that step, saved. The start-up's order is wired: the initial state waits for the train step's trace, and
    the checkpoint callback imports orbax in the background after the first step."""
    from util import trainer as make_trainer

    from jaxloom.trainer import BaseTrainer
    from jaxloom.trainer.callbacks import RunView
    from jaxloom.trainer.plan import Plan

    made = Plan.initial_state
    waited = []

    def initial_state(self, after=None):
        state = made(self, after=after)
        waited.append(after is not None and after.is_set())
        return state

    monkeypatch.setattr(Plan, "initial_state", initial_state)

    seen = []

    class Watch:
        def on_step_start(self, run, step):
            seen.append(("start", step, type(run), int(run.state.step)))

        def on_step_end(self, run, step, metrics):
            seen.append(("end", step, type(run), int(run.state.step)))
            if step == 3:
                run.request_stop("enough")

        def on_save(self, run, step):
            seen.append(("save", step, type(run), run.checkpoints.directory.name))

    t = make_trainer(tmp_path, hooks=[Watch()], max_training_steps=8, save_steps=2, evaluation=None)
    rows = []
    t.add_callback(lambda run, step: rows.append((step, len(run.history), run.arguments.save_steps)), every=1)
    out = t.train()
    assert {kind for _, _, kind, _ in seen} == {RunView} and not any(issubclass(k, BaseTrainer) for *_, k, _ in seen)
    assert [s for e, s, *_ in seen if e == "start"] == [1, 2, 3]  # stopped after step 3, as the view asked
    assert [(s, n) for e, s, _, n in seen if e == "end"] == [(1, 1), (2, 2), (3, 3)]  # each step's own state
    assert [(s, d) for e, s, _, d in seen if e == "save"] == [(2, "checkpoints"), (3, "checkpoints")]
    assert out.stop_reason == "enough" and t.checkpoints.all_steps() == [2, 3]
    assert [s for s, _, _ in rows] == [1, 2, 3] and all(every == 2 for *_, every in rows)
    assert rows[-1][1] >= 2  # the rows logged before step 3's callback ran (logging_steps=1)
    assert waited == [True]  # made once, after the train step was traced
    assert t.checkpointing.preparing is not None and t.checkpointing.preparing.name == "jaxloom-orbax"


def test_one_constructor_and_one_registry_for_every_trainer_kind():
    """The kinds declare what differs (`arguments_class`, `take_inputs`); the constructor is BaseTrainer's, its
    signature shows each kind's own inputs, and `kinds.KINDS` is the one registry the composition root and the
    config reader use."""
    import inspect

    from jaxloom.trainer import DistillationConfig, DistillationTrainer, DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
    from jaxloom.trainer import RewardConfig
    from jaxloom.trainer import RewardTrainer, compose, kinds
    from jaxloom.trainer.grpo import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    for cls in (Trainer, DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer, RewardTrainer, DistillationTrainer):
        assert "__init__" not in vars(cls)
    assert compose.KINDS is kinds.KINDS
    assert kinds.TRAINERS == ("sft", "dpo", "kto", "grpo", "rloo", "reward", "distillation")
    assert {k: c.arguments_class for k, c in kinds.KINDS.items()} == {
        "sft": TrainingArguments,
        "dpo": DPOConfig,
        "kto": KTOConfig,
        "grpo": GRPOConfig,
        "rloo": RLOOConfig,
        "reward": RewardConfig,
        "distillation": DistillationConfig,
    }
    assert "teacher_model" in inspect.signature(DistillationTrainer).parameters
    assert isinstance(kinds.arguments_of({"trainer": "dpo", "beta": 0.3})[1], DPOConfig)
    params = inspect.signature(DPOTrainer).parameters
    assert (
        list(params)[-2:] == ["ref_model", "deprecated_kwargs"]
        and "reward_funcs" in inspect.signature(GRPOTrainer).parameters
    )
    model = jm.create_model(tiny(), lazy=True)
    with pytest.raises(TypeError, match="DPOTrainer takes a DPOConfig, got TrainingArguments"):
        DPOTrainer(TrainingArguments(), model=model, dataset_train=TRAIN)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['reward_funcs'\]"):
        DPOTrainer(DPOConfig(), model=model, dataset_train=TRAIN, reward_funcs=[len])
    dpo = DPOTrainer(DPOConfig(), model=model, dataset_train=TRAIN, ref_model="some/dir")
    assert dpo.reference.source == "some/dir" and dpo.parts.wiring() == []  # kept; nothing built, nothing read
    with pytest.raises(ValueError, match="data_collator is not used"):
        GRPOTrainer(GRPOConfig(), model=model, dataset_train=TRAIN, reward_funcs=[len], data_collator=lambda b: b)


def test_a_runs_model_is_read_with_the_arguments_every_kind_shares():
    from jaxloom.trainer.runs import common_arguments

    args = common_arguments({"trainer": "dpo", "beta": 0.5, "max_steps": 3, "sharding_axis_dims": [1, -1, 1, 1, 1]})
    assert type(args) is TrainingArguments and args.max_training_steps == 3


def test_checkpointing_saves_and_hands_back_what_its_collaborators_own(tmp_path):
    """`Checkpointing` alone: a save records the state, the data position its `data` collaborator reports and
    `metadata(step)`; a restore hands the position back to `data` (a params-only read does not); `saved(step)`
    says whether the final save is still due; a fence that refuses stops the save before anything is written."""
    import jaxloom.state as js
    from jaxloom.trainer.checkpointing import Checkpointing

    class Position:  # the Stateful protocol, as the batches component implements it
        def __init__(self):
            self.now, self.loaded = {"record": 0}, []

        def checkpoint_state(self):
            return dict(self.now)

        def load_checkpoint_state(self, state):
            self.loaded.append(state)

    args = TrainingArguments(save_directory=str(tmp_path), save_steps=2, async_checkpointing=False)
    plan_model = jm.create_model(tiny(), seed=0)
    from jaxloom.trainer.plan import Plan

    plan = Plan.build(args, plan_model, mesh=mesh(1), total_steps=4)
    state = plan.initial_state()
    data = Position()
    ckpt = Checkpointing(
        args.checkpoint, str(tmp_path / "checkpoints"), data=data, metadata=lambda step: {"tokens_seen": 10 * step}
    )
    assert ckpt.should_save(2) and not ckpt.should_save(3)
    data.now = {"record": 17}
    ckpt.save(2, state)
    assert ckpt.saved(2) and not ckpt.saved(4)
    assert ckpt.manager.read_meta(2)["metadata"]["tokens_seen"] == 20
    restored = ckpt.restore(plan.target())
    assert restored.step == 2 and data.loaded == [{"record": 17}]  # the position went back to its owner
    ckpt.restore(plan.target(), params_only=True)
    assert len(data.loaded) == 1  # reading weights moves no data position
    ckpt.close()

    def lost():
        raise js.LeaseLostError("taken by another run")

    fenced = Checkpointing(args.checkpoint, str(tmp_path / "checkpoints"), data=data, fence=lost)
    with pytest.raises(js.LeaseLostError):
        fenced.save(4, state)
    assert fenced.manager.all_steps() == [2]  # nothing written
    fenced.close()
