"""python run_worker.py OUT_DIR MODE [key=value ...]: a short deterministic run through the CLI's builder;
prints each step. OUT_DIR may be a URI (then final.npz goes to $FINAL_TO)."""

import os
import sys

import numpy as np

from jaxloom.mesh import gather, named_leaves
from jaxloom.trainer.compose import build_run


class Announce:
    def on_step_end(self, run, step, metrics):
        print(f"STEP {step}", flush=True)


out, mode = sys.argv[1], sys.argv[2]
trainer, resolved = build_run(
    None,
    [
        f"save_directory={out}",
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
        "plot_loss=false",
        f"async_checkpointing={mode == 'async'}",
        *sys.argv[3:],
    ],
)
trainer.run_config = resolved  # as `jaxloom train` does: the run directory rebuilds the run
trainer.hooks.append(Announce())
result = trainer.train()
final = os.environ.get("FINAL_TO", out)  # a local folder when OUT_DIR is on a store
np.savez(f"{final}/final.npz", **{k: gather(v) for k, v in named_leaves(result.state.params)})
print("RESUMED_FROM", result.resumed_from, flush=True)
if os.environ.get("EXPORT_TO"):  # a Hugging Face export of the final state (a path or a gs:// URI)
    trainer.save_pretrained(save_directory=os.environ["EXPORT_TO"], to_torch=True)
