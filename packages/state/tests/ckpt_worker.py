"""Saves checkpoint 1 (and waits), then starts a large async save 2 and hangs: the test kills it."""

import sys
import time

import jax  # noqa: F401
from state_util import make_state, mesh_of, train_steps

import jaxloom.state as js

manager = js.CheckpointManager(sys.argv[1], async_save=True)
state = make_state(mesh_of(fsdp=2))
manager.save(1, state)
manager.wait_until_finished()
state = train_steps(state, 1)
print("SAVING 2", flush=True)
manager.save(2, state)
time.sleep(60)
