"""python worker.py OUT_DIR [key=value ...]: a short deterministic CLI-built run that prints `STEP n`
after each step, and `FSIZE_LIMIT_AT=step:bytes` in the environment caps file sizes from that step on
(a full disk, as a process sees it: writes fail). `TEST_PROCESS=rank/count/port` makes it one process of a
group joined over gloo on 127.0.0.1:port."""

import os
import resource
import signal
import sys

import jax
import numpy as np

from faultrun import TINY

from jaxloom.mesh import gather, named_leaves
from jaxloom.state import CheckpointSaveError
from jaxloom.trainer.cli import exit_after_training_error
from jaxloom.trainer.compose import build_run


class Announce:
    def __init__(self):
        at = os.environ.get("FSIZE_LIMIT_AT")
        self.limit = tuple(int(x) for x in at.split(":")) if at else None

    def on_step_start(self, run, step):
        if self.limit and step == self.limit[0]:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write is an error, not a dead process
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit[1], resource.RLIM_INFINITY))

    def on_step_end(self, run, step, metrics):
        print(f"STEP {step}", flush=True)

    def on_save(self, run, step):  # the checkpoint handed to the writer (in flight, with async checkpointing)
        print(f"SAVING {step}", flush=True)


out = sys.argv[1]
if os.environ.get("TEST_PROCESS"):
    from jaxloom.mesh import init_distributed

    rank, count, port = (int(x) for x in os.environ["TEST_PROCESS"].split("/"))
    init_distributed(f"127.0.0.1:{port}", count, rank, initialization_timeout=60, heartbeat_timeout_seconds=10)
cache = [f"compilation_cache_dir={os.environ['TEST_XLA_CACHE']}"] if os.environ.get("TEST_XLA_CACHE") else []
trainer, _ = build_run(None, [*TINY, f"save_directory={out}", *cache, *sys.argv[2:]])
trainer.hooks.append(Announce())
try:
    result = trainer.train()
except BaseException as e:  # as the jaxloom command does: report, then exit without waiting on orbax
    if isinstance(e, CheckpointSaveError):
        print(f"ERROR {e}", flush=True)
    exit_after_training_error(e)
trainer.finish()
final = {k: gather(v) for k, v in named_leaves(result.state.params)}  # every process gathers
if jax.process_index() == 0:  # one writer: the processes share `out` ($FINAL_TO when `out` is on a store)
    np.savez(f"{os.environ.get('FINAL_TO', out)}/final.npz", **final)
print("RESUMED_FROM", result.resumed_from, flush=True)
print("STOP_REASON", result.stop_reason, flush=True)
