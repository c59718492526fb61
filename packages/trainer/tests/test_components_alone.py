"""Each component of the trainer used alone, wired by hand as `components.py` wires them — what a newcomer reads
to learn one: the plan, the batches, the step functions, the evaluator, stop control and the callbacks. No
trainer is built in this module."""

import jax
import numpy as np
import pytest
from util import EVAL, TOK, TRAIN, args, mesh, tiny

import jaxloom.models as jm
from jaxloom.trainer import DataSpec
from jaxloom.trainer.batches import Batches
from jaxloom.trainer.callbacks import Callback, Callbacks, RunView
from jaxloom.trainer.evaluation import Evaluator
from jaxloom.trainer.functions import StepFunctions
from jaxloom.trainer.plan import Plan
from jaxloom.trainer.step import StepConfig
from jaxloom.trainer.stopping import NonFiniteLossError, StopControl

ARGS = args(None, warmup_steps=0, max_training_steps=4, eval_batches=2)


def _batches(args=ARGS, plan=None, **kw):
    one = plan.mesh if plan is not None else mesh(1)
    axes = plan.data_axes if plan is not None else ("fsdp",)
    return Batches(
        args, DataSpec.tokens(args), mesh=one, data_axes=axes, tokenizer=lambda: TOK, dataset_train=TRAIN, **kw
    )


def test_plan_batches_steps_and_evaluator_train_without_a_trainer():
    """The plan (optimizer, shapes, shardings), the batches (global batches from this process's rows), the
    jitted steps and the evaluator, wired by hand: the loss falls on repeated steps and the evaluation reports
    the objective's metrics over `eval_batches` batches."""
    model = jm.create_model(tiny(), lazy=True)
    plan = Plan.build(ARGS, model, mesh=mesh(1), total_steps=ARGS.max_training_steps)
    assert plan.total_steps == 4 and float(plan.schedule(0)) == pytest.approx(3e-3)
    state = plan.initial_state()
    data = _batches(plan=plan, dataset_eval=EVAL)
    fns = StepFunctions.build(plan, data.spec, StepConfig(schedule=plan.schedule), accumulation=1, donate=False)
    local = next(data.train_loader())
    assert local["input_ids"].shape == (8, 32)  # this process's rows: [accumulation × rows, tokens]
    batch = data.global_batch(local)
    assert batch["input_ids"].shape == (1, 8, 32)  # the step's: [accumulation, global rows, tokens]
    losses = []
    for _ in range(4):  # the same batch: the loss must fall
        state, metrics = fns.train(state, batch)
        losses.append(float(jax.device_get(metrics["loss"])))
    assert losses[-1] < losses[0] and int(state.step) == 4
    evaluator = Evaluator(data, fns.evaluate, fns.config.objective, eval_batches=2, mesh=plan.mesh)
    result = evaluator.run(state)
    assert {"loss", "perplexity", "accuracy", "evaluation_time"} <= set(result)
    assert result["perplexity"] == pytest.approx(np.exp(result["loss"]), rel=1e-5)
    data.close()


def test_the_batches_save_their_position_and_continue_from_it():
    """The batches component is the data position's owner (`checkpoint_state`): a new one given that position
    (`load_checkpoint_state`, as a restore does) yields exactly the batches the first would have yielded next."""
    first = _batches()
    loader = first.train_loader()
    next(loader), next(loader)
    position = first.checkpoint_state()
    expected = [next(loader)["input_ids"] for _ in range(2)]
    again = _batches()
    again.load_checkpoint_state(position)
    resumed = again.train_loader()
    for want in expected:
        np.testing.assert_array_equal(next(resumed)["input_ids"], want)
    first.close(), again.close()
    assert _batches().checkpoint_state() is None  # no loader yet: nothing to save


def test_stop_control_agrees_on_why_training_stops():
    """A request stops after the step that carries it; a non-finite loss stops (naming the step and where the
    last checkpoint is) or, with `nan_policy="skip"`, is counted; the time limit ends training."""
    ok = {"step": 1, "finite": True, "loss": 2.0, "grad_norm": 1.0}
    stop = StopControl("stop", where=" in runs/a/checkpoints")
    stop.apply_training_hooks(ok)
    assert stop.reason is None
    stop.request_stop("enough for today")
    stop.apply_training_hooks({**ok, "step": 2})
    assert stop.reason == "enough for today" and not stop.by_signal
    with pytest.raises(NonFiniteLossError, match=r"loss is nan .* at step 3; .* checkpoint in runs/a/checkpoints"):
        StopControl("stop", where=" in runs/a/checkpoints").apply_training_hooks(
            {**ok, "step": 3, "finite": False, "loss": float("nan")}
        )
    skip = StopControl("skip")
    skip.apply_training_hooks({**ok, "finite": False, "loss": float("inf")})
    assert skip.skipped == 1 and skip.reason is None
    late = StopControl("stop", time_limit=1e-9)
    late.apply_training_hooks(ok)
    assert late.reason == "training_time_limit of 1e-09 s reached"


def test_callbacks_run_in_order_on_their_cadence_and_may_replace_metrics():
    """`Callbacks` fires each event in the order the callbacks were added; `due(step)` lists the callbacks
    whose cadence (`every`, `when`) falls on the step; an `on_step_end` that returns a dict replaces the
    metrics; a callback without a way to run, or a bad cadence, is refused when it is made."""
    seen = []
    state = {"value": 0}
    run = RunView(
        arguments=lambda: ARGS,
        state=(lambda: state["value"], lambda v: state.update(value=v)),
        checkpoints=lambda: None,
        history=lambda: [],
        evaluates=False,
        is_process_zero=True,
        request_stop=lambda reason: seen.append(("stop", reason)),
    )

    class Hook:
        def on_step_start(self, run, step):
            seen.append(("hook start", step))
            run.state = run.state + 1

        def on_step_end(self, run, step, metrics):
            return {**metrics, "seen_by_hook": True}

    every2 = Callback(lambda run, step: seen.append(("every 2", step)), every=2, name="every 2")
    odd = Callback(lambda run, step: seen.append(("odd", step)), when=lambda step: step % 2 == 1, name="odd")
    callbacks = Callbacks([every2, Callback.of(Hook()), odd])
    for step in (1, 2, 3):
        callbacks.step_start(run, step)
        metrics = callbacks.step_end(run, step, {"loss": 1.0})
        for cb in callbacks.due(step):
            cb.fn(run, step)
    assert metrics == {"loss": 1.0, "seen_by_hook": True} and state["value"] == 3
    assert [s for s in seen if s[0] != "hook start"] == [("odd", 1), ("every 2", 2), ("odd", 3)]
    with pytest.raises(ValueError, match="every=0; expected a positive integer"):
        Callback(lambda run, step: None, every=0)
    with pytest.raises(ValueError, match="give every=N steps and/or when=fn"):
        Callback(lambda run, step: None)
    with pytest.raises(TypeError, match="has none of on_step_start"):
        Callback.of(object())


def test_start_up_traces_the_step_first_and_imports_orbax_after_step_one(tmp_path):
    """The start-up's order (issue 70: the first step as soon as a bare loop's): `Compilation.traced` is set once the
    train step is lowered (and when lowering fails: nothing waits forever); `Plan.initial_state(after=)` traces its own
    program only then, with the values it makes without waiting; `Checkpointing.after_step` imports orbax in a
    background thread from the second step a process runs, never before it."""
    import sys
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from jaxloom.trainer.checkpointing import Checkpointing
    from jaxloom.trainer.functions import Compilation

    events: list[str] = []

    class Lowered:
        def compile(self):
            events.append("compiled")
            return "executable"

    def lower():
        time.sleep(0.2)
        events.append("lowered")
        return Lowered()

    with ThreadPoolExecutor(1) as pool:
        compilation = Compilation(pool, lower)
        compilation.traced.wait()
        assert events[0] == "lowered" and compilation.future.result() == "executable"

        def broken():
            raise RuntimeError("no lowering")

        failed = Compilation(pool, broken)
        assert failed.traced.wait(timeout=30)
        with pytest.raises(RuntimeError, match="no lowering"):
            failed.future.result()

    plan = Plan.build(ARGS, jm.create_model(tiny(), lazy=True), mesh=mesh(1), total_steps=4)
    traced = threading.Event()
    threading.Timer(0.2, lambda: (events.append("step traced"), traced.set())).start()
    state = plan.initial_state(after=traced)
    events.append("state made")
    assert events[-2:] == ["step traced", "state made"]
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(plan.initial_state()), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    ckpt = Checkpointing(ARGS.checkpoint, str(tmp_path / "checkpoints"))
    ckpt.after_step(7)  # the first step this process runs: nothing imported beside it
    assert ckpt.preparing is None
    ckpt.after_step(8)
    thread = ckpt.preparing
    assert thread is not None and thread.name == "jaxloom-orbax"
    thread.join(timeout=120)
    assert "orbax.checkpoint" in sys.modules
    ckpt.after_step(9)
    assert ckpt.preparing is thread  # once


def test_the_step_log_writes_window_means_with_throughput_and_continues_a_resumed_history(tmp_path):
    """`StepLog` alone: each `logging_steps` window becomes one row (the mean of its steps' metrics, perplexity,
    tokens seen, the data's `extra()` asked for only when a row is written); a second log opened at step 4 (a
    resumed segment) reads the first segment's rows and goes on counting tokens from them."""
    import json
    import math

    import jax.numpy as jnp

    from jaxloom.trainer.monitor import StepLog

    a = args(tmp_path, logging_steps=2, max_training_steps=6)
    config = jm.create_model(tiny(), lazy=True).config
    asked = []

    def extra():
        asked.append(1)
        return {"data/x": 1.0}

    def log():
        return StepLog(a, config=config, row_width=32, devices=1, is_process_zero=True, directory=tmp_path)

    first = log()
    first.open(0, 6, {"run": "first"})
    for step in range(1, 5):
        first.step(step, {"loss": jnp.float32(step), "grad_norm": jnp.float32(1), "learning_rate": 1e-3}, extra=extra)
    first.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [2, 4] and len(asked) == 2  # one row, one extra(), per window
    assert [r["train/loss"] for r in train] == [1.5, 3.5]  # each window's mean
    assert train[0]["train/perplexity"] == pytest.approx(math.exp(1.5))
    assert train[1]["train/tokens_seen"] == 4 * a.training_batch_size * 32 and train[1]["train/data/x"] == 1.0
    second = log()
    second.open(4, 6, {"run": "second"})
    assert [r["step"] for r in second.history if "train/loss" in r] == [2, 4]  # the first segment's rows
    for step in (5, 6):
        second.step(step, {"loss": jnp.float32(1), "learning_rate": 1e-3}, extra=dict)
    second.close()
    assert second.history[-1]["step"] == 6 and second.history[-1]["train/tokens_seen"] == 6 * 8 * 32


def test_the_exporter_writes_the_state_it_is_given_and_a_report_of_the_facts_it_is_given(tmp_path):
    """`Exporter` alone: `save_pretrained` writes the state `current()` gives (an HF directory `from_pretrained`
    reads back equal), or any state passed to it; `save_information` writes `facts()` to report.md in
    `directory()`. Nothing else of a run is needed."""
    from jaxloom.trainer.export import Exporter
    from jaxloom.trainer.resume import run_identity

    plan = Plan.build(ARGS, jm.create_model(tiny(), lazy=True), mesh=mesh(1), total_steps=4)
    state = plan.initial_state()
    facts = dict(
        identity=run_identity(ARGS, plan.config, TOK, TRAIN),
        dataset_train=TRAIN,
        dataset_eval=None,
        model=plan.abstract.model,
        n_params=plan.n_params,
        mesh=plan.mesh,
        arguments=ARGS,
        resumed_from=None,
        history=[{"step": 4, "train/loss": 2.5}],
    )
    exporter = Exporter(
        current=lambda: state,
        tokenizer=lambda: TOK,
        arguments=lambda: ARGS,
        directory=lambda: tmp_path,
        facts=lambda: facts,
    )
    out = exporter.save_pretrained(tmp_path / "hf", to_hf=True)
    from flax import nnx

    back = nnx.to_pure_dict(nnx.state(jm.from_pretrained(out), nnx.Param))
    mine = nnx.to_pure_dict(nnx.state(state.model, nnx.Param))
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), mine, back)
    report = exporter.save_information(final={"loss": 2.5}, stop_reason="max_training_steps reached")
    text = report.read_text()
    assert report == tmp_path / "report.md" and "max_training_steps reached" in text and f"{plan.n_params:,}" in text


def test_the_reference_holder_alone_gives_each_pair_batch_the_frozen_models_log_probs(tmp_path):
    """DPO's `Reference` alone, given its collaborators by name (the policy's state, the plan, the batches, the
    folder): the reference rebuilt from the plan (no `ref_model`: the starting policy) gives every pair batch its
    `[A, B, 2]` log-probs — equal to the policy's own at the start — and keeps them while the policy moves."""
    import functools

    from test_dpo import dpo_args, rule_pairs

    from jaxloom.trainer.dpo import REF_KEY, Reference, reference_logps

    a = dpo_args(tmp_path, max_training_steps=2)
    plan = Plan.build(a, jm.create_model(tiny(), lazy=True), mesh=mesh(1), total_steps=2)
    policy = {"state": plan.initial_state()}
    ref = Reference(None)
    spec = DataSpec.tokens(
        a,
        row_width=2 * a.max_sequence_length,
        settings={"packing": False, "pairs": True},
        extra={REF_KEY: ((2,), np.float32)},
        extend=ref.extend,
    )
    data = Batches(
        a, spec, mesh=plan.mesh, data_axes=plan.data_axes, tokenizer=lambda: TOK, dataset_train=rule_pairs(32, 0)
    )
    ref.ready(policy=lambda: policy["state"], plan=plan, batches=data, folder=lambda: tmp_path)
    assert ref.state is not None and ref.state is not policy["state"]  # its own copy, frozen
    local = next(data.train_loader())
    batch = data.global_batch(local)
    fuse = (a.loss_block_size, data.data_shards())
    own = jax.jit(functools.partial(reference_logps, fuse=fuse))(policy["state"], batch, policy["state"].step)
    assert batch[REF_KEY].shape == (1, a.total_batch_size, 2)
    np.testing.assert_allclose(np.asarray(batch[REF_KEY]), np.asarray(own), rtol=1e-6)
    plain = DataSpec.tokens(a, row_width=2 * a.max_sequence_length, settings={"packing": False, "pairs": True})
    fns = StepFunctions.build(plan, plain, StepConfig(schedule=plan.schedule), accumulation=1, donate=False)
    policy["state"], _ = fns.train(policy["state"], {k: v for k, v in batch.items() if k != REF_KEY})
    again = data.global_batch(local)  # the same pairs after a policy step: the reference has not moved
    np.testing.assert_array_equal(np.asarray(again[REF_KEY]), np.asarray(batch[REF_KEY]))
    data.close()
