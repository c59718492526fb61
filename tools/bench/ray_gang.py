"""Bench rows for jaxloom-ray: the same run as a 2-worker gang (2 JAX processes × 1 CPU device, over
gloo) and as one plain process with 2 devices (`jaxloom train`, the same mesh), with the user-facing
defaults on (logging every step, TensorBoard, progress bar). Prints one JSON line: wall times, the
steady-state step time of each, whether the losses agree, and the driver's CPU time per worker-step
(what supervising the gang costs the head node)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = int(os.environ.get("BENCH_RAY_STEPS", "60"))
MODEL = [
    "model.hidden_size=128",
    "model.intermediate_size=384",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.max_position_embeddings=256",
]
RUN = [*MODEL, "total_batch_size=8", "max_sequence_length=128", f"max_training_steps={STEPS}", "save_steps=1000"]
RUN += ["evaluation_steps=null", "generation_interval=null", "generation_prompts=[]", "sharding_axis_dims=[1,-1,1,1,1]"]


def losses(directory: Path) -> list[float]:
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def step_time(directory: Path) -> float:
    """Median step time over the second half of the run (after compilation and warm-up)."""
    import statistics

    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["train/step_time"] for r in rows if "train/step_time" in r]
    return statistics.median(times[len(times) // 2 :])


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="jaxloom-bench-ray-"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "jaxloom.trainer.cli", "train", *RUN, f"save_directory={root / 'one'}"],
        env=env,
        check=True,
        capture_output=True,
    )
    one_wall = time.perf_counter() - t0

    from jaxloom.ray import ScalingConfig, init_ray, launch, train_from_config

    init_ray(num_cpus=2, log_to_driver=False)
    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    res = launch(
        train_from_config, None, [*RUN, f"save_directory={root / 'two'}"], scaling=ScalingConfig(num_workers=2)
    )
    two_wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    driver_cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    a, b = losses(root / "two"), losses(root / "one")
    print(
        json.dumps(
            {
                "steps": STEPS,
                "one_process_wall_s": one_wall,
                "gang_wall_s": two_wall,
                "one_process_step_s": step_time(root / "one"),
                "gang_step_s": step_time(root / "two"),
                "max_loss_diff": max(abs(x - y) for x, y in zip(a, b, strict=True)),
                "driver_cpu_s": driver_cpu,
                "driver_cpu_ms_per_worker_step": 1000 * driver_cpu / (2 * STEPS),
                "attempts": res.attempts,
            }
        )
    )


if __name__ == "__main__":
    main()
