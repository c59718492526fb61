import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")


def run_worker(out, *overrides, stop_after=None, sig=signal.SIGKILL, env=None, timeout=300):
    """Run worker.py; with `stop_after=n`, send `sig` when it prints `STEP n`. Returns (proc, stdout, stderr)."""
    # the runs share one compilation cache (as restarts with `compilation_cache_dir` do): a resumed or
    # repeated run loads its compiled programs instead of compiling them again
    cache = str(Path(tempfile.gettempdir()) / f"jaxloom-reliability-xla-cache-{os.getuid()}")
    full_env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
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
        if stop_after is not None and line.strip() == f"STEP {stop_after}":
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                break
    proc.wait(timeout=timeout)
    err.seek(0)
    with err:
        return proc, lines, err.read()
