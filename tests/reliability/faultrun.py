import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")
# The worker's run: a tiny model, a few steps, a checkpoint every 4.
TINY = [
    "max_training_steps=16",
    "save_steps=4",
    "logging_steps=4",
    "evaluation_steps=null",
    "total_batch_size=8",
    "max_sequence_length=32",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "progress_bar=false",
    "use_tensorboard=false",
    "plot_loss=false",  # matplotlib's 1-2 s at the end of each run (the tests that read loss.png turn it on)
    "generation_interval=null",
    "generation_prompts=[]",
]


def run_worker(
    out, *overrides, stop_after=None, sig=signal.SIGKILL, repeat=0, env=None, timeout=300, on_stop=None, stop_line=None
):
    """Run worker.py; with `stop_after=n`, send `sig` when it prints `STEP n` (and `repeat` more times, 50 ms
    apart, as an impatient user does), or call `on_stop(line, proc)` there instead (`sig=None`); `stop_line`: the
    line to act on instead of `STEP n` (`SAVING n`: a checkpoint just handed to the writer). Returns (proc, stdout,
    stderr)."""
    # the runs share one compilation cache (as restarts with `compilation_cache_dir` do): a resumed or
    # repeated run loads its compiled programs instead of compiling them again
    cache = str(Path(tempfile.gettempdir()) / f"jaxloom-reliability-xla-cache-{os.getuid()}")
    full_env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
        "TEST_XLA_CACHE": cache,
        **(env or {}),
    }
    # stderr goes to a file, not a pipe read only at the end: a failing save makes orbax print more than a
    # pipe holds (~64 KiB of event-loop tracebacks), and the worker would block on writing it for ever
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(out), *overrides], stdout=subprocess.PIPE, stderr=err, text=True, env=full_env
    )
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if stop_after is not None and line.strip() == (stop_line or f"STEP {stop_after}"):
            if sig is None:
                on_stop(line, proc)
                continue
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                break
            for _ in range(repeat):
                time.sleep(0.05)
                if proc.poll() is None:
                    proc.send_signal(sig)
    proc.wait(timeout=timeout)
    err.seek(0)
    with err:
        return proc, lines, err.read()
