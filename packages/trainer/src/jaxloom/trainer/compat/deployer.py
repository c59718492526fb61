"""`Deployer`: RedCo's low-level API for people who write their own loop. Thin: every method hands
its concern to the part that owns it (mesh, state, data, trainer)."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import jaxloom.mesh as jmesh
import jaxloom.state as js

from ..optim import get_lr_schedule_fn

log = logging.getLogger("jaxloom.deployer")


class Deployer:
    """RedCo's `Deployer`: mesh, sharding, rng, batching, schedules, logging and checkpoints for a
    hand-written loop (`fit` runs one). See the README for the method list.

    Arguments, grouped:

    - `jax_seed`: seed of the RNG stream (`gen_rng`, `gen_model_step_rng`).
    - `n_model_shards`: size of the model-parallel (tp) axis; the rest of the devices are data parallel.
    - `verbose`: log what it does.
    - `workdir`: where logs, outputs and `fit`'s checkpoints go (None: nowhere).
    - `n_processes`, `host0_address`, `host0_port`, `process_id`, `n_local_devices`: a multi-process run; passed to
      `jaxloom.mesh.init_distributed` when `n_processes > 1`.
    - `run_tensorboard`: write metrics as TensorBoard events under `workdir`.
    - `wandb_init_kwargs`: log to Weights & Biases with these `wandb.init` arguments.
    - `mesh_config`: any `MeshConfig`, instead of the one `n_model_shards` describes.
    """

    def __init__(
        self,
        jax_seed: int,
        n_model_shards: int = 1,
        verbose: bool = True,
        workdir: str | None = None,
        n_processes: int | None = None,
        host0_address: str | None = None,
        host0_port: int | None = None,
        process_id: int | None = None,
        n_local_devices: int | None = None,
        run_tensorboard: bool = False,
        wandb_init_kwargs: dict | None = None,
        mesh_config: jmesh.MeshConfig | None = None,
    ):
        if n_processes and n_processes > 1:
            jmesh.init_distributed(
                f"{host0_address}:{host0_port}",
                n_processes,
                process_id,
                list(range(n_local_devices)) if n_local_devices else None,
            )
        n = jax.device_count()
        if mesh_config is None:
            if n_model_shards <= 0 or n % n_model_shards:
                raise ValueError(f"n_model_shards {n_model_shards} must divide the {n} devices")
            mesh_config = jmesh.MeshConfig(axis_dims=(-1, 1, 1, n_model_shards, 1))
        self._mesh = mesh_config.build()
        self.n_model_shards = self._mesh.shape.get("tp", 1)
        self.rng = jmesh.RngStream(jax_seed)
        self._workdir = workdir
        self.verbose = verbose
        self._writer = None
        if workdir and (run_tensorboard or wandb_init_kwargs):
            from ..metrics import MetricsWriter

            self._writer = MetricsWriter(
                workdir,
                tensorboard=run_tensorboard,
                use_wandb=bool(wandb_init_kwargs),
                wandb_project=(wandb_init_kwargs or {}).get("project"),
                progress_bar=False,
            )

    mesh = property(lambda self: self._mesh)
    workdir = property(lambda self: self._workdir)

    # ---- randomness and batch sizes (jaxloom.mesh) -------------------------------------------------------
    def gen_rng(self):
        """A fresh PRNG key from the deployer's stream."""
        return self.rng.gen_rng()

    def gen_model_step_rng(self):
        """A fresh PRNG key for one model step."""
        return self.rng.gen_model_step_rng()

    def get_local_global_micro_batch_size(self, per_device_batch_size: int) -> tuple[int, int]:
        """(this process's, global) micro-batch rows for `per_device_batch_size`."""
        return jmesh.get_local_global_micro_batch_size(per_device_batch_size, self._mesh)

    def get_accumulate_grad_batches(self, global_batch_size: int, per_device_batch_size: int) -> int:
        """Micro-batches of `per_device_batch_size` per device per step, so that a step holds
        `global_batch_size` rows."""
        return jmesh.get_accumulate_grad_batches(global_batch_size, per_device_batch_size, self._mesh)

    def get_lr_schedule_fn(
        self,
        train_size,
        per_device_batch_size,
        n_epochs,
        learning_rate,
        schedule_type="linear",
        warmup_ratio=0.0,
        warmup_steps=None,
        init_learning_rate=0.0,
        end_learning_rate=0.0,
    ):
        """RedCo's learning-rate schedule (see `jaxloom.trainer.get_lr_schedule_fn`): `n_epochs` over
        `train_size` examples in micro-batches of `per_device_batch_size` per device; warmup
        (`warmup_steps`, or `warmup_ratio` of the steps) from `init_learning_rate` to `learning_rate`,
        then `schedule_type` (`linear`, `cosine`, `constant`) to `end_learning_rate`."""
        _, global_micro = self.get_local_global_micro_batch_size(per_device_batch_size)
        return get_lr_schedule_fn(
            train_size,
            global_micro,
            n_epochs,
            learning_rate,
            schedule_type,
            warmup_ratio,
            warmup_steps,
            init_learning_rate,
            end_learning_rate,
        )

    def get_model_input_batches(
        self,
        examples: Sequence,
        per_device_batch_size: int,
        collate_fn: Callable,
        shuffle: bool,
        shuffle_rng,
        desc: str = "",
        is_train: bool = False,
        accumulate_grad_batches: int | None = None,
    ) -> Iterator[dict]:
        """Global micro-batches (`jax.Array`s on the mesh's data axes) of `examples`,
        `per_device_batch_size` rows per device: shuffled with `shuffle_rng` when `shuffle`, this process
        collating only its rows with `collate_fn`. With `is_train` only whole optimizer steps are yielded
        (`accumulate_grad_batches` micro-batches each, the remainder dropped); for evaluation the last
        batch is padded by wrapping around. `desc` labels the progress bar shown when `verbose`."""
        local_micro, global_micro = self.get_local_global_micro_batch_size(per_device_batch_size)
        accum = accumulate_grad_batches or 1
        step_rows = global_micro * accum
        order = np.asarray(jax.random.permutation(shuffle_rng, len(examples))) if shuffle else np.arange(len(examples))
        rows = jmesh.local_batch_slice(self._mesh, global_micro)
        if is_train:
            n_batches = (len(examples) // step_rows) * accum
        else:
            n_batches = math.ceil(len(examples) / global_micro)
        if n_batches == 0:
            raise ValueError(
                f"{len(examples)} examples make no full batch of {step_rows} "
                f"(per-device {per_device_batch_size} × data-parallel × accumulation {accum})"
            )
        sharding = NamedSharding(self._mesh, jmesh.batch_spec(self._mesh))
        bar = self._progress(n_batches, desc)
        for b in range(n_batches):
            idx = order[b * global_micro : (b + 1) * global_micro]
            if len(idx) < global_micro:  # evaluation's last batch: wrap around
                idx = np.concatenate([idx, order[: global_micro - len(idx)]])
            local = collate_fn([examples[i] for i in idx[rows]])
            yield {
                k: jax.make_array_from_process_local_data(sharding, np.asarray(v), (global_micro, *np.shape(v)[1:]))
                for k, v in local.items()
            }
            bar.update(1)
        bar.close()

    def _progress(self, total: int, desc: str):
        from ..metrics import create_progress_bar

        return create_progress_bar(total, desc, disabled=not self.verbose or jax.process_index() != 0)

    def _say(self, text: str) -> None:
        """What `verbose` shows: printed on process 0 (and always sent to the `jaxloom.deployer` log)."""
        log.info("%s", text)
        if self.verbose and jax.process_index() == 0:
            print(text, flush=True)

    # ---- sharding (jaxloom.mesh) ----------------------------------------------------------------------
    def get_sharding_rules(self, params_shape_or_params) -> list | None:
        """Rules from the shapes of `params_shape_or_params` (largest divisible dim over the model axis);
        None with one model shard."""
        if self.n_model_shards == 1:
            return None
        return jmesh.auto_partition_rules(params_shape_or_params, self._mesh, axes=("tp",))

    def get_params_spec(self, params_shape_or_params, params_sharding_rules):
        """Partition specs for `params_shape_or_params` by `params_sharding_rules` (None: replicated)."""
        rules = params_sharding_rules or [(".*", PartitionSpec())]
        return jmesh.match_partition_rules(rules, params_shape_or_params, mesh=self._mesh)

    def get_opt_state_spec(self, params_shape_or_params, params_spec, optimizer):
        """Partition specs for `optimizer`'s state over `params_shape_or_params` sharded by `params_spec`."""
        abstract = jax.eval_shape(optimizer.init, params_shape_or_params)
        return optax.tree_map_params(
            optimizer,
            lambda _, s: s,
            abstract,
            params_spec,
            transform_non_params=lambda _: PartitionSpec(),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def shard_params(self, params, params_spec, desc: str = "params"):
        """Place `params` on the mesh by `params_spec`; `desc` names them in the log."""
        self._say(f"sharding {desc} over {dict(self._mesh.shape)}")
        return jmesh.shard(params, params_spec, self._mesh)

    def run_model_step(self, step_fn: Callable, input_args: tuple):
        """`step_fn(*input_args)` (a jitted step) with this mesh set, so logical sharding constraints
        apply inside it."""
        with jax.set_mesh(self._mesh):
            return step_fn(*input_args)

    # ---- checkpoints (jaxloom.state) --------------------------------------------------------------------
    def save_ckpt(self, ckpt_dir: str, params, opt_state=None, float_dtype=None, **kwargs) -> None:
        """Save params (and opt_state) at `ckpt_dir`, with `kwargs` (step, epoch, ...) as JSON info and the
        RNG position; floating params are cast to `float_dtype` if given. Waits until the checkpoint is
        complete, so `load_last_ckpt` never sees half of it."""
        state = js.TrainState(
            step=np.int32(kwargs.get("step", 0)),
            params=params,
            opt_state=opt_state if opt_state is not None else {},
            rng=jax.random.fold_in(jax.random.PRNGKey(self.rng.seed), self.rng.count),
        )
        name = None if float_dtype is None else np.dtype(float_dtype).name  # RedCo passes a dtype (jnp.bfloat16)
        manager = js.CheckpointManager(ckpt_dir, async_save=False, float_dtype=name, save_total_limit=None)
        manager.save(
            int(kwargs.get("step", 0)),
            state,
            metadata={"info": js.to_jsonable(kwargs), "rng_stream": self.rng.state_dict()},
        )
        manager.close()

    def load_params_shape(self, ckpt_dir: str):
        """Shapes and dtypes of the parameters stored in `ckpt_dir`, without reading them."""
        return js.CheckpointManager(ckpt_dir).restore_shapes()

    def load_ckpt(
        self,
        ckpt_dir: str,
        params_sharding_rules=None,
        optimizer=None,
        float_dtype=None,
        load_params: bool = True,
        load_opt_state: bool = True,
        update_rng: bool = False,
    ):
        """Read the checkpoint in `ckpt_dir`: `({"params": ..., "opt_state": ...}, info)`, placed by
        `params_sharding_rules` on the mesh. `load_params` / `load_opt_state` choose what is read (the
        optimizer state needs `optimizer` for its structure); `float_dtype` casts floating params;
        `update_rng` continues this deployer's RNG stream from the saved position."""
        # a reader: it never sets a step aside or cleans up (the run that writes `ckpt_dir` may be training), and it
        # reads the arrays as saved, so their digests are checked before any cast to `float_dtype`
        manager = js.CheckpointManager(ckpt_dir, read_only=True)
        shapes = manager.restore_shapes()
        specs = self.get_params_spec(shapes, params_sharding_rules)
        shard = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self._mesh, s))  # noqa: E731
        params_t = jax.tree_util.tree_map(shard, shapes, specs)
        opt_t = {}
        if load_opt_state and optimizer is not None:
            opt_t = jax.tree_util.tree_map(
                shard, jax.eval_shape(optimizer.init, shapes), self.get_opt_state_spec(shapes, specs, optimizer)
            )
        repl = NamedSharding(self._mesh, PartitionSpec())
        target = js.TrainState(
            step=jax.ShapeDtypeStruct((), np.int32, sharding=repl),
            params=params_t,
            opt_state=opt_t,
            rng=jax.ShapeDtypeStruct((2,), np.uint32, sharding=repl),
        )
        restored = manager.restore(target, params_only=not (load_opt_state and optimizer is not None))
        meta = restored.metadata
        if update_rng and "rng_stream" in meta:
            self.rng = jmesh.RngStream.from_state_dict(meta["rng_stream"])
        params = restored.state.params
        if float_dtype is not None:
            params = jax.tree_util.tree_map(
                lambda x: x.astype(float_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
            )
        ckpt = {
            "params": params if load_params else None,
            "opt_state": restored.state.opt_state if load_opt_state and optimizer is not None else None,
        }
        return ckpt, js.from_jsonable(meta.get("info", {}))

    def load_last_ckpt(
        self,
        optimizer=None,
        params_sharding_rules=None,
        float_dtype=None,
        load_params=True,
        load_opt_state=True,
        update_rng=True,
    ):
        """The newest complete checkpoint under `workdir/ckpts/` (by saved step), or `(None, None)`; the
        arguments (`optimizer`, `params_sharding_rules`, `float_dtype`, `load_params`, `load_opt_state`,
        `update_rng`) are `load_ckpt`'s."""
        root = Path(self._workdir or ".") / "ckpts"
        found = []
        for d in sorted(root.glob("*")) if root.is_dir() else []:
            step = js.CheckpointManager(str(d)).latest_step()
            if step is not None:
                found.append((step, str(d)))
        if not found:
            return None, None
        _, ckpt_dir = max(found, key=lambda x: (x[0], _natural(x[1])))
        log.warning("loading last checkpoint %s", ckpt_dir)
        return self.load_ckpt(
            ckpt_dir, params_sharding_rules, optimizer, float_dtype, load_params, load_opt_state, update_rng
        )

    # ---- logging (trainer.metrics) ----------------------------------------------------------------------
    def log_info(self, info: Any, title: str | None = None, step: int | None = None) -> None:
        """Log `info` (process 0 only; printed when `verbose`), under `title` and `step` when given; also a
        TensorBoard/wandb text when those are on."""
        if jax.process_index() != 0:
            return
        text = info if isinstance(info, str) else json.dumps(info, indent=2, default=str)
        self._say(f"{f'[{title}] ' if title else ''}{f'step {step}: ' if step is not None else ''}{text}")
        if self._writer is not None:
            self._writer.text(step or 0, title or "info", text)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write `metrics` at `step` to the metrics file, TensorBoard and wandb when on; printed when `verbose`."""
        metrics = {k: float(v) for k, v in metrics.items()}
        if self._writer is not None:
            self._writer.write(step, metrics, prefix="metrics")
        self._say(f"step {step}: " + ", ".join(f"{k}={v:.6g}" for k, v in metrics.items()))

    def save_outputs(self, outputs: Any, desc: str, step: int) -> Path | None:
        """Write `outputs` as JSON to `<workdir>/outputs/<desc>_step<step>.json` (process 0)."""
        if jax.process_index() != 0 or not self._workdir:
            return None
        path = Path(self._workdir) / "outputs" / f"{desc}_step{step}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(js.to_jsonable(outputs), indent=2))
        return path

    # ---- a minimal loop --------------------------------------------------------------------------------------
    def fit(
        self,
        loss_fn: Callable,
        params,
        optimizer,
        train_examples: Sequence,
        *,
        per_device_batch_size: int,
        n_epochs: int,
        collate_fn: Callable,
        accumulate_grad_batches: int | None = None,
    ) -> dict:
        """RedCo's `fit`: `loss_fn(rng, state, params, batch, is_training) -> scalar` is all it needs.
        Shards params by shape, jits the step with `optimizer` (an optax transformation), trains
        `n_epochs` over `train_examples` in micro-batches of `per_device_batch_size` per device made by
        `collate_fn` (`accumulate_grad_batches` of them per update), checkpoints each epoch under
        `workdir/ckpts/epoch_N`, and resumes after the newest one. Returns `{"params", "opt_state", "losses"}`."""
        if accumulate_grad_batches and accumulate_grad_batches > 1:
            # One update per `accumulate_grad_batches` micro-batches (the batches arrive one at a time).
            optimizer = optax.MultiSteps(optimizer, every_k_schedule=accumulate_grad_batches)
        rules = self.get_sharding_rules(params)
        specs = self.get_params_spec(params, rules)
        opt_state, start, losses = None, 0, []
        ckpt, info = (
            self.load_last_ckpt(optimizer=optimizer, params_sharding_rules=rules) if self._workdir else (None, None)
        )
        if ckpt is not None:
            params, opt_state, start, losses = ckpt["params"], ckpt["opt_state"], info["epoch"] + 1, info["losses"]
        else:
            params = self.shard_params(params, specs)
        if opt_state is None:
            opt_shard = jax.tree_util.tree_map(
                lambda s: NamedSharding(self._mesh, s), self.get_opt_state_spec(params, specs, optimizer)
            )
            opt_state = jax.jit(optimizer.init, out_shardings=opt_shard)(params)

        def step(params, opt_state, batch, rng):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(rng, None, p, batch, True))(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        step = jax.jit(step, donate_argnums=(0, 1))
        for epoch in range(start, n_epochs):
            shuffle_rng = jax.random.fold_in(jax.random.PRNGKey(self.rng.seed), epoch)
            epoch_losses = []
            for batch in self.get_model_input_batches(
                train_examples,
                per_device_batch_size,
                collate_fn,
                True,
                shuffle_rng,
                f"epoch {epoch}",
                True,
                accumulate_grad_batches,
            ):
                rng = jax.random.fold_in(shuffle_rng, len(epoch_losses))
                params, opt_state, loss = self.run_model_step(step, (params, opt_state, batch, rng))
                epoch_losses.append(loss)
            losses.append(float(np.mean(jax.device_get(epoch_losses))))
            self.log_metrics({"loss": losses[-1]}, step=epoch)
            if self._workdir:
                self.save_ckpt(
                    f"{self._workdir}/ckpts/epoch_{epoch}", params, opt_state, step=epoch, epoch=epoch, losses=losses
                )
        return {"params": params, "opt_state": opt_state, "losses": losses}


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
