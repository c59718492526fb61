import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from util import args, losses, mesh, params_of, tiny, trainer

from jaxloom.mesh import gather

import jaxloom.models as jm
import jaxloom.state as js
from jaxloom.trainer import BaseTrainerProtocol, NonFiniteLossError, StepConfig, train_step


def test_eval_loss_falls_on_the_corpus(tmp_path):
    t = trainer(
        tmp_path,
        max_training_steps=60,
        logging_steps=20,
        learning_rate=1e-2,
        total_batch_size=16,
        evaluation_steps=60,
        generation_interval=30,
        generation_prompts=("The interpreter",),
        generation_max_new_tokens=6,
        plot_loss=True,
    )
    assert isinstance(t, BaseTrainerProtocol)
    before = t.evaluate()["loss"]
    out = t.train()
    assert out.stop_reason == "max_training_steps reached"
    after = out.metrics["eval_loss"]
    print(f"eval loss {before:.3f} -> {after:.3f}")
    assert after < before - 1.5
    assert "| eval_loss |" in (tmp_path / "report.md").read_text()
    previews = [
        r
        for r in map(__import__("json").loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
        if "samples" in r
    ]
    assert [r["step"] for r in previews] == [30, 60]  # every 30 steps; the final sample is step 60's
    assert out.samples and out.samples[0].startswith("The interpreter")
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert jm.count_params(t.model) == t.n_params


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    a = trainer(tmp_path / "a", total_batch_size=8, gradient_accumulation_steps=1, max_training_steps=3).train()
    b = trainer(tmp_path / "b", total_batch_size=4, gradient_accumulation_steps=2, max_training_steps=3).train()
    pa, pb = params_of(a.state), params_of(b.state)
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=2e-4, atol=2e-6, err_msg=k)
    np.testing.assert_allclose(losses(tmp_path / "a"), losses(tmp_path / "b"), rtol=1e-5)


def test_same_curve_with_fsdp_alone_and_fsdp_x_tp(tmp_path):
    # The data of a step depends on the data-parallel size (one stream per shard): keep it at 4.
    trainer(tmp_path / "one", mesh_=mesh(4, fsdp=4), max_training_steps=5).train()
    t = trainer(tmp_path / "eight", mesh_=mesh(8, fsdp=4, tp=2), max_training_steps=5)
    kernel = t.configure_model().state.params["model"]["layers"][0]["mlp"]["up_proj"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")
    t.train()
    np.testing.assert_allclose(losses(tmp_path / "one"), losses(tmp_path / "eight"), rtol=1e-4)


class Poison:
    """A hook that puts NaN into the parameters before step 3."""

    def on_step_start(self, run, step):
        if step == 3:
            run.state = run.state.replace(params=jax.tree_util.tree_map(lambda p: p * jnp.nan, run.state.params))


@pytest.mark.parametrize("donate", [None, True])  # state kept (CPU default) or donated (GPU/TPU default)
def test_nan_loss_stops_naming_the_step(tmp_path, donate):
    t = trainer(tmp_path, hooks=[Poison()], save_steps=2, max_training_steps=8, donate_state=donate)
    with pytest.raises(NonFiniteLossError, match="loss is nan .* at step 3"):
        t.train()
    assert t.checkpoints.all_steps() == [2]  # the earlier checkpoint is untouched


def test_the_nan_stop_names_the_checkpoints_where_they_are(tmp_path):
    """Issue 53: the stop message names the run directory's checkpoint path, a URI included (it read
    `s3:/bucket/run/checkpoints` when the path was rebuilt with pathlib). Nothing is read or written: a
    trainer's constructor does no I/O."""
    assert trainer(tmp_path).stop_control.where == f" in {tmp_path / 'checkpoints'}"
    assert trainer("s3://bucket/run").stop_control.where == " in s3://bucket/run/checkpoints"
    assert trainer(tmp_path, checkpoint_directory="gs://b/ck").stop_control.where == " in gs://b/ck"


def test_out_of_memory_points_to_jaxloom_plan(tmp_path):
    """What the device raises when it runs out of memory (raised here by a hook at step 3) ends training with
    the usual note (the step, the newest checkpoint) and one saying how to see and shrink the memory."""

    class OutOfMemory:
        def on_step_start(self, run, step):
            if step == 3:
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.00GiB.")

    t = trainer(tmp_path, hooks=[OutOfMemory()], save_steps=2, max_training_steps=8, evaluation=None)
    with pytest.raises(jax.errors.JaxRuntimeError) as e:
        t.train()
    notes = "\n".join(e.value.__notes__)
    assert "training stopped during step 3" in notes and "jaxloom plan CONFIG" in notes and "remat" in notes
    assert t.checkpoints.all_steps() == [2]


def test_one_step_stays_in_flight_and_the_next_batch_is_staged_before_the_host_reads(tmp_path):
    """Step n+1 is dispatched, its batch already on the device, before the host reads step n's metrics
    (checks, the metrics row, the progress bar); a step with a checkpoint is settled before it saves."""
    events = []

    class Order:
        def on_step_end(self, run, step, metrics):
            events.append(("dispatched", step))

    t = trainer(tmp_path, hooks=[Order()], max_training_steps=6, save_steps=4, logging_steps=2, evaluation=None)
    stage, check, save = t.batches.global_batch, t.stop_control.apply_training_hooks, t.save_checkpoint
    t.batches.global_batch = lambda local, **kw: (events.append(("staged", None)), stage(local, **kw))[1]
    t.stop_control.apply_training_hooks = lambda m: (events.append(("checked", m["step"])), check(m))[1]
    t.save_checkpoint = lambda step: (events.append(("saved", step)), save(step))[1]
    t.train()
    assert events[:9] == [
        ("staged", None),
        ("dispatched", 1),
        ("staged", None),
        ("dispatched", 2),
        ("checked", 1),
        ("staged", None),
        ("dispatched", 3),
        ("checked", 2),
        ("staged", None),
    ]
    assert events[9:14] == [("dispatched", 4), ("checked", 3), ("checked", 4), ("saved", 4), ("staged", None)]
    assert events[-4:] == [("dispatched", 6), ("checked", 5), ("checked", 6), ("saved", 6)]  # the final save
    assert [
        r["step"]
        for r in map(__import__("json").loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in r
    ] == [2, 4, 6]


def test_skip_policy_keeps_the_old_parameters():
    model = jm.create_model(tiny(), seed=0)
    state = js.TrainState.create(model, __import__("optax").adamw(1e-3))
    batch = {k: jnp.ones((1, 2, 8), jnp.int32) for k in ("input_ids", "segment_ids", "positions", "loss_mask")}
    bad = StepConfig(z_loss=float("nan"))
    new, m = jax.jit(lambda s, b: train_step(s, b, dataclasses.replace(bad, skip_nonfinite=True)))(state, batch)
    assert not bool(m["finite"])
    assert all(
        np.array_equal(x, y)
        for x, y in zip(jax.tree_util.tree_leaves(new.params), jax.tree_util.tree_leaves(state.params), strict=True)
    )
    new2, _ = jax.jit(lambda s, b: train_step(s, b, bad))(state, batch)
    assert np.isnan(np.asarray(new2.params["lm_head"]["kernel"])).all()


def tiny_deepseek():
    """Two layers (dense, then four routed experts in two groups with a shared one): one bias-balanced router."""
    return jm.DeepseekV3Config(
        vocab_size=len(util.TOK),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        moe_intermediate_size=16,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
    )


def test_a_step_moves_deepseek_router_biases_toward_balance():
    """DeepSeek-V3's aux-loss-free balancing, one step exactly: the router's `e_score_correction_bias` moves by the
    rate up for experts that took fewer of the step's real tokens than the mean and down for those that took more
    (the loads the forward routed, padding excluded); the optimizer adds nothing to it (rate 0 leaves it: the run
    test below)."""
    model = jm.create_model(tiny_deepseek(), seed=0)
    state = js.TrainState.create(model, __import__("optax").adamw(1e-2, weight_decay=0.1))
    rng = np.random.default_rng(0)
    seg = np.ones((1, 4, 16), np.int32)
    seg[0, 1, 10:] = 0  # padding routes nothing
    batch = {
        "input_ids": jnp.asarray(rng.integers(1, 40, (1, 4, 16)), jnp.int32),
        "segment_ids": jnp.asarray(seg),
        "positions": jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (1, 4, 16)),
        "loss_mask": jnp.ones((1, 4, 16), jnp.int32),
    }
    routed = jax.jit(lambda ids, pos, seg: model(ids, positions=pos, segment_ids=seg).expert_load)
    loads = routed(batch["input_ids"][0], batch["positions"][0], batch["segment_ids"][0])
    assert set(loads) == {1}  # the dense layer 0 routes nothing
    load = np.asarray(loads[1])
    assert load.sum() == (seg != 0).sum() * 2  # every real token chose two experts
    rate = 0.01
    new, metrics = jax.jit(lambda s, b: train_step(s, b, StepConfig(router_bias_update_rate=rate)))(state, batch)
    bias = np.asarray(new.params["model"]["layers"][1]["mlp"]["gate"]["e_score_correction_bias"])
    np.testing.assert_allclose(bias, rate * np.sign(load.mean() - load), atol=1e-7)
    assert float(metrics["router_imbalance"]) == pytest.approx(load.max() / load.mean(), rel=1e-5)
    kernel = new.params["model"]["layers"][1]["mlp"]["gate"]["kernel"]  # the router's weights do train
    assert not np.array_equal(
        np.asarray(kernel), np.asarray(state.params["model"]["layers"][1]["mlp"]["gate"]["kernel"])
    )


def test_a_scanned_stack_moves_each_layers_router_bias_by_its_own_load():
    """Every layer sparse, scanned: the stacked bias `[L, E]` moves row by row, each by its own layer's load."""
    config = dataclasses.replace(tiny_deepseek(), first_k_dense_replace=0)
    model = jm.create_model(config, jm.RuntimeConfig(scan_layers=True), seed=0)
    assert model.scanned
    state = js.TrainState.create(model, __import__("optax").sgd(1e-2))
    rng = np.random.default_rng(1)
    batch = {
        "input_ids": jnp.asarray(rng.integers(1, 40, (1, 4, 16)), jnp.int32),
        "segment_ids": jnp.ones((1, 4, 16), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (1, 4, 16)),
        "loss_mask": jnp.ones((1, 4, 16), jnp.int32),
    }
    routed = jax.jit(lambda ids, pos, seg: model(ids, positions=pos, segment_ids=seg).expert_load)
    loads = routed(batch["input_ids"][0], batch["positions"][0], batch["segment_ids"][0])
    load = np.stack([np.asarray(loads[i]) for i in range(config.num_hidden_layers)])
    rate = 0.01
    new, _ = jax.jit(lambda s, b: train_step(s, b, StepConfig(router_bias_update_rate=rate)))(state, batch)
    bias = np.asarray(new.params["model"]["layers"]["mlp"]["gate"]["e_score_correction_bias"])
    np.testing.assert_allclose(bias, rate * np.sign(load.mean(-1, keepdims=True) - load), atol=1e-7)


def test_router_bias_update_rate_takes_effect_in_a_run(tmp_path):
    """Through the Trainer: each of three steps moves each bias by -rate, 0 or +rate (so they end on multiples of
    the rate, not all zero); `router_bias_update_rate=0` keeps them at zero; the imbalance is logged."""
    rate = 0.01
    moved = trainer(tmp_path / "moved", tiny_deepseek(), router_bias_update_rate=rate, max_training_steps=3).train()
    bias = np.asarray(gather(moved.state.params["model"]["layers"][1]["mlp"]["gate"]["e_score_correction_bias"]))
    units = bias / rate
    np.testing.assert_allclose(units, np.round(units), atol=1e-3)
    assert np.abs(units).max() <= 3 and np.any(units != 0)
    frozen = trainer(tmp_path / "frozen", tiny_deepseek(), router_bias_update_rate=0.0, max_training_steps=3).train()
    np.testing.assert_array_equal(
        np.asarray(gather(frozen.state.params["model"]["layers"][1]["mlp"]["gate"]["e_score_correction_bias"])), 0
    )
    rows = [__import__("json").loads(x) for x in (tmp_path / "moved" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/router_imbalance" in r for r in rows)


def test_time_limit_saves_and_stops(tmp_path):
    out = trainer(tmp_path, max_training_steps=100000, training_time_limit=3.0, logging_steps=50).train()
    assert out.stop_reason == "training_time_limit of 3.0 s reached"
    step = int(out.state.step)
    assert 0 < step < 100000 and js.CheckpointManager(out.checkpoint_dir).latest_step() == step


def test_profiler_trace_of_chosen_steps(tmp_path):
    trainer(tmp_path, max_training_steps=3, profile_steps=[2, 3]).train()
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
    with pytest.raises(ValueError, match=r"profile_steps \[3, 2\]; expected \[first, last\]"):
        args(tmp_path, profile_steps=[3, 2])


def test_bad_setups_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="the dataset is empty"):
        trainer(tmp_path / "a", train=[]).train()
    with pytest.raises(ValueError, match="dataset_train is empty"):
        trainer(tmp_path / "b", train=[], max_training_steps=None).configure_model()
    with pytest.raises(ValueError, match="global batch size 4 is not divisible by the data-parallel size 8"):
        trainer(tmp_path / "c", mesh_=mesh(8), total_batch_size=4).configure_dataloaders()
    with pytest.raises(ValueError, match="no dataset_eval was given"):
        trainer(tmp_path / "d", evaluation=None).evaluate()


def test_sft_trains_only_on_completions(tmp_path):
    import jaxloom.data as jd

    records = jd.addition_records(400, seed=0)
    t = trainer(
        tmp_path,
        train=records,
        evaluation=records[:64],
        packing=False,
        max_sequence_length=16,
        total_batch_size=64,
        max_training_steps=200,
        learning_rate=1e-2,
        logging_steps=100,
        evaluation_steps=200,
        config=tiny(hidden=64),
    )
    before = t.evaluate()["accuracy"]
    out = t.train()
    print("addition: token accuracy on completions", before, "->", out.metrics["eval_accuracy"])
    assert before < 0.2 and out.metrics["eval_accuracy"] > 0.5


def test_state_is_donated_to_the_step_except_on_cpu_unless_asked(tmp_path):
    """XLA's CPU backend runs a donated step slower (docs/performance.md), so on CPU the state is kept
    unless `donate_state=True`; donated buffers are consumed by the step."""
    for donate, consumed in ((None, False), (True, True), (False, False)):
        t = trainer(tmp_path / str(donate), evaluation=None, max_training_steps=1, donate_state=donate)
        first = jax.tree_util.tree_leaves(t.configure_model().state.params)[0]
        t.train()
        t.finish()
        assert first.is_deleted() == consumed, donate


def test_given_model_survives_a_donated_run_and_seed_init_matches_the_jitted_one(tmp_path):
    """The state copies a concrete model's parameters (a donated step never consumes the caller's arrays);
    from a seed, the op-by-op state on one device equals the jitted one on a 2-device mesh."""
    from jaxloom.trainer import Trainer
    from util import EVAL, TOK, TRAIN

    from flax import nnx

    model = jm.create_model(tiny(), seed=0)
    t = Trainer(
        args(tmp_path / "given", max_training_steps=1, donate_state=True),
        model,
        dataset_train=TRAIN,
        processing_class=TOK,
        mesh=mesh(1),
    )
    t.train()
    t.finish()
    kernel = nnx.state(model, nnx.Param)["lm_head"]["kernel"][...]
    assert not kernel.is_deleted() and np.isfinite(np.asarray(kernel)).all()
    one = trainer(tmp_path / "one", evaluation=EVAL)
    two = trainer(tmp_path / "two", mesh_=mesh(2))
    for (name, a), (_, b) in zip(
        params_of(one.configure_model().state).items(), params_of(two.configure_model().state).items(), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=name)


def test_attention_backend_is_checked_at_setup_before_anything_compiles(tmp_path):
    """An explicit kernel that cannot run here is refused by the first builder (before anything compiles,
    not at step 1, not silently replaced); cuDNN with packed rows too."""
    flash = jm.create_model(tiny(), jm.RuntimeConfig(attn_mechanism="flash"), lazy=True)
    with pytest.raises(jm.AttentionUnavailableError, match="'flash' needs a GPU or TPU"):
        trainer_from(tmp_path, flash).configure_model()
    cudnn = jm.create_model(tiny(), jm.RuntimeConfig(attn_mechanism="cudnn"), lazy=True)
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        trainer_from(tmp_path, cudnn).configure_model()
    # what runs is known at setup: `auto` resolved for this platform and length, an explicit choice kept
    assert trainer_from(tmp_path, jm.create_model(tiny(), lazy=True)).plan.attention == "xla"
    chunked = jm.create_model(tiny(), jm.RuntimeConfig(attn_mechanism="blockwise"), lazy=True)  # EasyDeL's name
    assert trainer_from(tmp_path, chunked).plan.attention == "chunked"


# `jaxloom` command overrides for a tiny Mixtral run without evaluation, previews or TensorBoard.
MIXTRAL_CLI = [
    "model.model_type=mixtral",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.num_local_experts=4",
    "progress_bar=false",
    "use_tensorboard=false",
    "plot_loss=false",
    "evaluation_steps=null",
    "generation_prompts=[]",
]


def test_runtime_settings_from_the_command_reach_the_model(tmp_path):
    """`scan_layers`, `attn_mechanism`, `attn_block_size`, `moe_implementation` given as arguments
    (as `jaxloom train key=value` does) build the model they name, and it trains."""
    from jaxloom.trainer.compose import build_run

    overrides = [
        f"save_directory={tmp_path}",
        "max_training_steps=2",
        "total_batch_size=8",
        "max_sequence_length=32",
        "scan_layers=true",
        "attn_mechanism=chunked",
        "attn_block_size=8",
        "moe_implementation=dense",
        *MIXTRAL_CLI,
    ]
    t, _ = build_run(None, overrides)
    rt = t.runtime
    assert (type(t.model).__name__, rt.scan_layers, rt.attn_mechanism, rt.attn_block_size, rt.moe_implementation) == (
        "MixtralForCausalLM",
        True,
        "chunked",
        8,
        "dense",
    )
    out = t.train()
    assert t.model.scanned
    assert np.isfinite(out.metrics["loss"])
    t.finish()


def trainer_from(tmp, model):
    from jaxloom.trainer import Trainer

    from util import EVAL, TOK, TRAIN

    return Trainer(args(tmp), model, dataset_train=TRAIN, dataset_eval=EVAL, processing_class=TOK, mesh=mesh(1))


def test_fused_loss_blocks_train_as_the_whole_logits_do_without_holding_them(tmp_path):
    """`loss_block_size` fuses the output projection and the loss in blocks of positions: on fsdp x tp (the
    vocabulary split) with a z-loss it trains the same curve as the whole logits (`loss_block_size=0`), and
    its compiled step needs less temporary memory: at least the logits of a micro-batch less."""
    runs = {}
    for name, size in (("whole", 0), ("blocks", 8)):  # 2 rows per data shard x 4 positions per block
        t = trainer(
            tmp_path / name, mesh_=mesh(8, fsdp=4, tp=2), max_training_steps=4, z_loss=1e-3, loss_block_size=size
        )
        runs[name] = (t.compiled_train_step().memory_analysis().temp_size_in_bytes, t.train())
    np.testing.assert_allclose(losses(tmp_path / "whole"), losses(tmp_path / "blocks"), rtol=1e-5)
    pw, pb = params_of(runs["whole"][1].state), params_of(runs["blocks"][1].state)
    for k in pw:
        np.testing.assert_allclose(pw[k], pb[k], rtol=1e-4, atol=1e-6, err_msg=k)
    logits_per_device = 2 * 32 * (len(util.TOK) // 2) * 4  # rows x positions x vocabulary shard, float32
    assert runs["whole"][0] - runs["blocks"][0] > logits_per_device, (runs["whole"][0], runs["blocks"][0])


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_new_families_train_fused_as_with_whole_logits(tmp_path, family):
    """Gemma 2 (output logits soft-capped: the fused loss caps its blocks the same way) and Qwen3-MoE (raw top-k
    router weights, a dense layer among sparse ones, its router_aux_loss_coef) train through the Trainer on
    fsdp x tp: the fused loss gives the curve and weights of the whole logits."""
    base = dict(
        vocab_size=len(util.TOK),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if family == "gemma2":
        config = jm.Gemma2Config(**base, head_dim=8, sliding_window=8, final_logit_softcapping=0.5)
    else:
        config = jm.Qwen3MoeConfig(
            **base, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,)
        )
    runs = {}
    for name, size in (("whole", 0), ("blocks", 8)):
        t = trainer(tmp_path / name, config, mesh_=mesh(8, fsdp=4, tp=2), max_training_steps=3, loss_block_size=size)
        runs[name] = t.train()
    whole, blocks = losses(tmp_path / "whole"), losses(tmp_path / "blocks")
    np.testing.assert_allclose(whole, blocks, rtol=1e-5)
    assert whole[-1] < whole[0]
    pw, pb = params_of(runs["whole"].state), params_of(runs["blocks"].state)
    for k in pw:  # Adam divides by sqrt(v): a near-zero gradient's float32 rounding moves its weight by ~1e-6 too
        np.testing.assert_allclose(pw[k], pb[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_expert_parallel_mixtral_trains_as_fully_sharded_with_its_tokens_moving(tmp_path):
    """A Mixtral whose batch rows are split over `ep` too (`partition_axis.batch_axis=("fsdp", "dp", "ep")`):
    the loaders lay the rows out over fsdp × ep, each device keeps 2 of the 8 experts and the tokens travel
    to them (an all-gather and a reduce-scatter in the step); it trains the curve and weights of the same
    run fully sharded over fsdp=8 (the same 8 data shards, every expert's weights gathered)."""
    from jaxloom.mesh import PartitionAxis
    from jaxloom.trainer import Trainer

    config = jm.MixtralConfig(
        vocab_size=len(util.TOK),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    runs = {}
    for name, axes, batch_axis in (
        ("fsdp", dict(fsdp=8), ("fsdp", "dp")),
        ("ep", dict(fsdp=2, ep=4), ("fsdp", "dp", "ep")),
    ):
        runtime = jm.RuntimeConfig(moe_implementation="tiled", partition_axis=PartitionAxis(batch_axis=batch_axis))
        t = Trainer(
            util.args(tmp_path / name, max_training_steps=3),
            jm.create_model(config, runtime, lazy=True),
            dataset_train=util.TRAIN,
            processing_class=util.TOK,
            mesh=mesh(8, **axes),
        )
        hlo = t.compiled_train_step().as_text()
        assert t.data_shards() == 8 and t.data_axes == batch_axis
        runs[name] = (hlo, t.train())
    hlo = runs["ep"][0]
    assert "reduce-scatter" in hlo and "all-gather" in hlo
    np.testing.assert_allclose(losses(tmp_path / "ep"), losses(tmp_path / "fsdp"), rtol=1e-5)
    pf, pe = params_of(runs["fsdp"][1].state), params_of(runs["ep"][1].state)
    for k in pf:
        np.testing.assert_allclose(pe[k], pf[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_batch_axis_from_the_command_moves_a_mixtures_tokens(tmp_path):
    """`jaxloom train batch_axis=[fsdp,dp,ep]` on an fsdp=2 × ep=4 mesh: the rows are split over ep too, the
    experts stay on their devices and the tokens travel (all-gather and reduce-scatter in the step)."""
    from jaxloom.trainer.compose import build_run

    overrides = [
        f"save_directory={tmp_path}",
        "max_training_steps=2",
        "total_batch_size=8",
        "max_sequence_length=32",
        "sharding_axis_dims=[1,2,4,1,1]",
        "batch_axis=[fsdp,dp,ep]",
        "moe_implementation=tiled",
        *MIXTRAL_CLI,
    ]
    t, _ = build_run(None, overrides)
    assert t.data_axes == ("fsdp", "dp", "ep")
    hlo = t.compiled_train_step().as_text()
    assert t.data_shards() == 8 and "reduce-scatter" in hlo
    out = t.train()
    assert np.isfinite(out.metrics["loss"]) and t.model.model.layers[0].mlp.w_up[...].sharding.spec[0] == "ep"
    t.finish()


def test_a_new_trainer_kind_is_an_objective_and_a_data_spec(tmp_path):
    """A kind the core has never seen arrives through the public extension points alone (no private method
    overridden): its data spec adds a per-row array to every batch (`extend`), its objective reads it. Here
    each row's token loss is scaled by that array (2.0): the logged loss is twice next-token training's on
    the same data and seed, and evaluation goes through the same spec."""
    import jax.numpy as jnp

    from util import TOK

    from jaxloom.trainer import DataSpec, Objective, Trainer, token_loss

    def scaled_loss(state, params, batch, cfg):
        tokens = {k: batch[k] for k in DataSpec.TOKEN_KEYS}
        loss_sum, sums = token_loss(state, params, tokens, cfg)
        return loss_sum * batch["row_scale"][0, 0], sums

    def add_scale(local, batch, training):  # laid out like the token arrays (rows over the data axes)
        rows = batch["input_ids"].shape[:-1]
        batch["row_scale"] = jax.device_put(jnp.full((*rows, 1), 2.0, jnp.float32), batch["input_ids"].sharding)
        return batch

    class Scaled(Trainer):
        def objective(self):
            return Objective(loss=scaled_loss)

        def data_spec(self):
            return DataSpec.tokens(self.arguments, extra={"row_scale": ((1,), np.float32)}, extend=add_scale)

    plain = trainer(tmp_path / "plain", max_training_steps=1, logging_steps=1).train()
    t = trainer(tmp_path / "scaled", max_training_steps=1, logging_steps=1)
    kw = dict(dataset_train=t.dataset_train, dataset_eval=t.dataset_eval, processing_class=TOK, mesh=t.mesh)
    scaled = Scaled(t.arguments, t.model, **kw).train()
    assert scaled.metrics["loss"] == pytest.approx(2 * plain.metrics["loss"], rel=1e-5)
    assert scaled.metrics["eval_loss"] == pytest.approx(2 * plain.metrics["eval_loss"], rel=1e-5)


def test_the_user_is_told_what_the_run_waits_for(tmp_path, caplog, monkeypatch):
    """Progress where a user waits (issue 42): the train step's compile (how long it took), a restore (what,
    how much, how long) and an HF export (tensors and bytes as it goes, then the total)."""
    import logging

    from jaxloom.models import hf

    monkeypatch.setattr(hf, "EXPORT_PROGRESS_EVERY_S", 0.0)  # a line per tensor
    with caplog.at_level(logging.INFO, logger="jaxloom"):
        first = trainer(tmp_path / "run", max_training_steps=2, save_steps=2)
        first.train()
        first.finish()
        again = trainer(tmp_path / "run", max_training_steps=3, resume_if_possible=True)
        again.train()
        again.save_pretrained(tmp_path / "hf", to_torch=True)
        again.finish()
    text = caplog.text
    assert "train step compiled in" in text
    assert f"restoring checkpoint {tmp_path / 'run'}" in text and "restored checkpoint" in text and " GB in " in text
    assert "exporting " in text and "tensors," in text and "exported " in text


def test_a_bad_record_stops_once_naming_it_or_is_skipped_and_counted(tmp_path):
    """A record that cannot be read stopped the run at the same record on every rerun: a crash loop (issue 43).
    It stops the run once naming file:line; with skip_bad_records a rerun goes past it (and past a malformed
    line), counting what it skipped in the metrics."""
    import json as _json

    path = tmp_path / "data.jsonl"
    lines = [_json.dumps({"text": f"document {i} " + "word " * 20}) for i in range(40)]
    lines[5] = _json.dumps({"text": 12345})  # a column of the wrong type
    lines[9] = '{"text": "unterminated'  # malformed JSON
    path.write_text("\n".join(lines) + "\n")
    kw = dict(max_training_steps=3, shuffle_train_dataset=False, packing=True, logging_steps=1)
    with pytest.raises(ValueError, match=rf"{path}:(6|10)"):
        trainer(tmp_path / "stop", train=str(path), evaluation=None, **kw).train()
    out = trainer(tmp_path / "skip", train=str(path), evaluation=None, skip_bad_records=True, **kw).train()
    assert out.state is not None and int(out.state.step) == 3
    rows = [_json.loads(r) for r in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("train/skipped_records", 0) for r in rows) >= 1


@pytest.mark.parametrize("packing", [False, True])
def test_records_longer_than_a_row_are_counted_in_the_metrics_and_the_report(tmp_path, caplog, packing):
    """~60-token records in 32-token rows were cut with no word (issue 51): the first is said in the log with the
    setting to raise, and every one is counted in the metrics and the report (unpacked: the tokens dropped)."""
    import json as _json

    path = tmp_path / "long.jsonl"
    path.write_text("".join(_json.dumps({"text": f"document {i} " + "word " * 50}) + "\n" for i in range(24)))
    with caplog.at_level("INFO", logger="jaxloom"):
        t = trainer(tmp_path / "run", train=str(path), evaluation=None, packing=packing, max_training_steps=2)
        t.train()
    said = [r for r in caplog.records if "is longer than max_sequence_length 32" in r.getMessage()]
    assert said and "raise max_sequence_length" in said[0].getMessage()
    assert said[0].levelname == ("INFO" if packing else "WARNING")  # split over packed rows is pretraining's norm
    rows = [_json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["train/truncated_records"] >= (8 if not packing else 1), last
    assert (last["train/truncated_tokens"] > 0) == (not packing), last  # packing splits, nothing is dropped
    report = (tmp_path / "run" / "report.md").read_text()
    assert f"- records longer than max_sequence_length: {int(last['train/truncated_records'])}" in report


def test_a_step_that_cannot_fit_is_refused_before_step_1(tmp_path):
    """A sequence length that cannot fit ended in an out-of-memory traceback after the compile (issue 43): the
    compiled step's memory (XLA's count) is checked against each device's limit before step 1. CPU devices report
    no limit; here a device that reports 1 MiB stands for a GPU too small for the step."""
    from jaxloom.trainer.functions import check_fits

    t = trainer(tmp_path, max_training_steps=1)
    executable = t.compiled_train_step()

    class Small:
        def memory_stats(self):
            return {"bytes_limit": 2**20}

    class Large:
        def memory_stats(self):
            return {"bytes_limit": 2**40}

    with pytest.raises(ValueError, match=r"the train step needs [\d.]+ GiB per device .* a device has 0.00 GiB"):
        check_fits(executable, [Large(), Small()])
    check_fits(executable, [Large()])  # fits
    check_fits(executable, jax.local_devices())  # CPU: no limit reported, nothing checked
