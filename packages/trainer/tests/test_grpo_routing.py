"""MoE routing replay in GRPO (`routing_replay`, the field's R3): the sampler records the experts each token went
to while decoding; the training forward measures how often it routes otherwise (`routing/disagreement`) or, with
replay on, sends every recorded token where sampling did (0 %). A step-stale rollout (`max_staleness=1`) is where
routers disagree: the sampler's weights are a version older than the trainer's."""

import pytest
from test_grpo import RECORDS, grpo_args, letter_e, rows
from util import TOK, mesh, tiny

import jaxloom.models as jm
from jaxloom.trainer import GRPOTrainer


def moe():
    return tiny(kind=jm.MixtralConfig, num_local_experts=4, num_experts_per_tok=2)


def run(tmp, **kw) -> list[dict]:
    trainer = GRPOTrainer(
        grpo_args(tmp, max_staleness=1, learning_rate=3e-2, max_training_steps=4, **kw),
        model=jm.create_model(moe(), lazy=True),
        dataset_train=RECORDS,
        processing_class=TOK,
        mesh=mesh(1),
        reward_funcs=[letter_e],
    )
    trainer.train()
    return [r for r in rows(tmp) if "train/routing/disagreement" in r]


def test_a_stale_moe_rollouts_experts_are_replayed_by_the_training_forward(tmp_path):
    free = run(tmp_path / "free")
    replayed = run(tmp_path / "replayed", routing_replay=True)
    assert len(free) == len(replayed) == 4
    off = [r["train/routing/disagreement"] for r in free]
    on = [r["train/routing/disagreement"] for r in replayed]
    assert off[0] == 0 and min(off[1:]) > 0, off  # fresh rows route alike; a version stale, some tokens do not
    assert on == [0, 0, 0, 0], on
    # step 1 (fresh rows: replaying the router's own choice) trains bit for bit as without; from step 2 the replayed
    # experts make other gradients
    assert free[0]["train/grad_norm"] == replayed[0]["train/grad_norm"]
    assert all(a["train/grad_norm"] != b["train/grad_norm"] for a, b in zip(free[1:], replayed[1:], strict=True))


def test_the_paged_engine_records_the_experts_too(tmp_path):
    """Through the paged engine (`generation_backend="paged"`), the fresh rows' recorded experts are the training
    forward's (0 at step 1) and the stale rows' differ."""
    off = [r["train/routing/disagreement"] for r in run(tmp_path, generation_backend="paged")]
    assert off[0] == 0 and min(off[1:]) > 0, off


def test_routing_replay_is_refused_where_no_experts_are_recorded(tmp_path):
    dense = GRPOTrainer(
        grpo_args(tmp_path, routing_replay=True),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=RECORDS,
        processing_class=TOK,
        reward_funcs=[letter_e],
    )
    with pytest.raises(ValueError, match=r"routing_replay = true, but the policy \(LlamaConfig\) routes no tokens"):
        dense.data_spec()
    with pytest.raises(ValueError, match="routing_replay = true with rollout_engine"):
        GRPOTrainer(
            grpo_args(tmp_path, routing_replay=True),
            model=jm.create_model(moe(), lazy=True),
            dataset_train=RECORDS,
            processing_class=TOK,
            reward_funcs=[letter_e],
            rollout_engine=lambda ids, mask, key: (ids, mask),
        )
