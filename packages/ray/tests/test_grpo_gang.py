"""Asynchronous GRPO (`max_staleness=1`) over a Ray gang of two workers: a worker killed after step 5 restarts the
gang, which resumes from step 3's checkpoint — the rollout drawn then by step 2's weights restored from it and
scored again — and ends with the uninterrupted gang's parameters, bit for bit. With two devices a worker and
`sampling_devices=2`, each worker gives one device to the sampler's mesh and trains on the other."""

import json

import pytest
from util import TINY_OVERRIDES

from jaxloom.ray import ScalingConfig, launch, train_from_config
from jaxloom.ray.testing import FaultInjector

WORDS = ["red", "blue", "green", "cat", "dog", "tree", "sun", "moon"]


@pytest.mark.parametrize("split", [False, True], ids=["one-mesh", "sampling-devices"])
def test_an_asynchronous_grpo_gang_killed_mid_run_resumes_bitwise(ray_cluster, tmp_path, split):
    (tmp_path / "letters.py").write_text(
        "def letter_e(prompts, completions, **kwargs):\n"
        "    return [c.count('e') / max(len(c), 1) for c in completions]\n"
    )
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"say {w}:"}) + "\n" for w in WORDS * 4))

    def run(name, faults=(), **scaling):
        overrides = [
            *TINY_OVERRIDES,
            "trainer=grpo",
            "data.train=p.jsonl",
            "reward_funcs=letters.letter_e",
            "num_generations=2",
            "max_prompt_length=16",
            "max_completion_length=16",
            "max_staleness=1",
            "max_training_steps=6",
            "save_steps=3",
            f"save_directory={tmp_path / name}",
            "resume_if_possible=false",
            f"compilation_cache_dir={tmp_path / 'xla-cache'}",
            *(["sampling_devices=2"] if split else []),
        ]
        cfg = ScalingConfig(num_workers=2, devices_per_worker=2 if split else None, **scaling)
        return launch(train_from_config, None, overrides, tuple(faults), str(tmp_path), scaling=cfg)

    reference = run("reference")
    killed = run("killed", [FaultInjector(at_step=5, rank=1, kind="kill", wait_for_checkpoint=True)], max_failures=1)
    assert killed.attempts == 2 and killed.failures[0].kind == "died"
    assert killed.result["resumed_from"].endswith("checkpoints/3")
    assert killed.result["params_sha256"] == reference.result["params_sha256"]
    stale = [r["train/sample/staleness_max"] for r in reference.result["history"] if "train/sample/staleness_max" in r]
    assert stale == [0, 1, 1, 1, 1, 1], stale
