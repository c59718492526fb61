"""A custom loop written only against Deployer: python deployer_worker.py WORKDIR N_EPOCHS."""

import os
import sys

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxloom.trainer import Deployer  # noqa: E402


def examples(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    y = (x[:, :4].sum(1) > 0).astype(np.int32) + 2 * (x[:, 4] > 0)
    return [{"x": a, "y": b} for a, b in zip(x, y, strict=True)]


def collate(batch):
    return {"x": np.stack([b["x"] for b in batch]), "y": np.array([b["y"] for b in batch])}


def loss_fn(rng, state, params, batch, is_training):
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    h = h * jax.random.bernoulli(rng, 0.9, h.shape) / 0.9 if is_training else h  # dropout from the step rng
    logits = h @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "w1": jax.random.normal(k1, (16, 64)) * 0.3,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 4)) * 0.3,
    }


if __name__ == "__main__":
    workdir, n_epochs = sys.argv[1], int(sys.argv[2])
    deployer = Deployer(jax_seed=7, n_model_shards=2, workdir=workdir, verbose=False)
    real_log = deployer.log_metrics
    deployer.log_metrics = lambda m, step: (real_log(m, step), print(f"EPOCH {step} loss {m['loss']:.4f}", flush=True))
    out = deployer.fit(
        loss_fn,
        init_params(),
        optax.adam(3e-3),
        examples(),
        per_device_batch_size=4,
        n_epochs=n_epochs,
        collate_fn=collate,
    )
    np.savez(f"{workdir}/final.npz", **{k: np.asarray(jax.device_get(v)) for k, v in out["params"].items()})
    print("LOSSES", " ".join(f"{v:.4f}" for v in out["losses"]), flush=True)
