"""One benchmark process: `python train_run.py {trainer|bare} STEPS JSON_CONFIG` → one JSON line.

Both variants train the same jaxloom Llama with the same optimizer, batch and dtype. `bare` is a
hand-written loop: one jitted step over a pre-tokenized numpy array, nothing else.
"""

import time

T0 = time.perf_counter()  # as close to process start as Python allows

import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402


def main():
    kind, steps, cfg = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    import jax
    import numpy as np

    import jaxloom.models as jm

    import contextlib

    from jax.sharding import NamedSharding, PartitionSpec

    from jaxloom.mesh import MeshConfig

    b, length = cfg["batch"], cfg["seq"]
    # {"fsdp": 8}: both loops on that mesh (activations constrained by the model's logical axes)
    mesh = MeshConfig.from_axes(**cfg["mesh"]).build() if cfg.get("mesh") else None

    def mesh_context():
        return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()

    config = jm.LlamaConfig(**cfg["model"])
    runtime = jm.RuntimeConfig(dtype=cfg["dtype"], param_dtype="float32", attn_mechanism="auto")
    times = []
    if kind == "bare":
        import optax
        from flax import nnx

        rng = np.random.default_rng(0)
        data = rng.integers(0, config.vocab_size, (steps + 1, b, length)).astype(np.int32)
        model = jm.create_model(config, runtime, seed=0, mesh=mesh)   # with a mesh: created on its shards
        graphdef, params = nnx.split(model, nnx.Param)
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(cfg["lr"], b1=0.9, b2=0.95))
        opt = tx.init(params)

        seg = np.ones((b, length), np.int32)
        pos = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length))
        if mesh is not None:  # the batch split over the data axes, the state kept where it is
            rows = NamedSharding(mesh, PartitionSpec(("dp", "fsdp")))
            seg, pos = jax.device_put(seg, rows), jax.device_put(pos, rows)
            keep = jax.tree_util.tree_map(lambda x: x.sharding if isinstance(x.sharding, NamedSharding)
                                          else NamedSharding(mesh, PartitionSpec()), (params, opt))
            params, opt = jax.device_put((params, opt), keep)   # e.g. Adam's step count: replicated
        else:
            rows, keep = None, None

        # segment ids and positions are arguments, as in any loop over packed data: captured as
        # constants, XLA would fold the attention mask and RoPE tables into the program.
        def loss_fn(p, ids, seg, pos):  # the same masked next-token loss the trainer computes
            logits = nnx.merge(graphdef, p)(ids, positions=pos, segment_ids=seg).logits[:, :-1]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jax.numpy.float32), ids[:, 1:])
            valid = (seg[:, 1:] == seg[:, :-1]).astype(jax.numpy.float32)
            return (ce * valid).sum() / valid.sum()

        def step(p, o, ids, seg, pos):
            loss, g = jax.value_and_grad(loss_fn)(p, ids, seg, pos)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o, loss

        step = jax.jit(step) if mesh is None else jax.jit(step, out_shardings=(*keep, None))
        for i in range(steps):
            ids = data[i] if rows is None else jax.device_put(data[i], rows)
            with mesh_context():
                params, opt, loss = step(params, opt, ids, seg, pos)
            float(loss)  # same one-value sync per step as the trainer's NaN check
            times.append(time.perf_counter())
    else:
        import jaxloom.data as jd
        from jaxloom.trainer import Trainer, TrainingArguments

        class Clock:
            def on_step_end(self, trainer, step, metrics):
                if step == 1:
                    jax.block_until_ready(metrics["loss"])
                times.append(time.perf_counter())

        rng = np.random.default_rng(0)
        records = [{"text": " ".join(map(str, rng.integers(0, 1000, 400)))} for _ in range(400)]
        args = TrainingArguments(learning_rate=cfg["lr"], warmup_steps=0, scheduler="constant", total_batch_size=b,
                                 max_sequence_length=length, max_training_steps=steps, logging_steps=10**9,
                                 save_directory=cfg["out"], resume_if_possible=False, use_tensorboard=False,
                                 progress_bar=False, dtype=cfg["dtype"], adam_beta2=0.95)
        model = jm.create_model(config, runtime, lazy=True)
        trainer = Trainer(args, model, dataset_train=records, processing_class=jd.load_processor(),
                          mesh=mesh or MeshConfig().build(), hooks=[Clock()])
        trainer.train()
    steady = np.diff(times[cfg["warmup"]:])
    print(json.dumps({"kind": kind, "tokens_per_second": b * length / float(np.median(steady)),
                      "first_step_s": times[0] - T0,
                      "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                      "devices": jax.device_count(), "platform": jax.devices()[0].platform}))


if __name__ == "__main__":
    main()
