"""Per-family rows of `nox -s bench`: tokens/s of one training step (forward, backward, SGD update; fused loss)
of each model family at about the same parameter count, against Llama's in the same process, so a family whose
features cost more than they should shows. `python family_rows.py` (CPU) → one JSON line.

Each family is sized to ~Llama's parameter count (its own head_dim, experts, ...); the step is jitted once and
the median of 5 timed steps after 2 warm-up steps, best of two rounds over the families, is reported with the
parameter count beside it.
"""

from __future__ import annotations

import json
import statistics
import time

BASE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
BATCH, SEQ = 4, 256


def configs():
    import jaxloom.models as jm

    return {
        "llama": jm.LlamaConfig(**BASE),
        "qwen3": jm.Qwen3Config(**BASE, head_dim=64),
        "qwen3_moe (E=8, k=2)": jm.Qwen3MoeConfig(
            **BASE, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96
        ),
        "gemma2": jm.Gemma2Config(
            **BASE, head_dim=64, sliding_window=128, query_pre_attn_scalar=64, tie_word_embeddings=False
        ),
        "gemma3": jm.Gemma3TextConfig(
            **BASE, head_dim=64, sliding_window=128, sliding_window_pattern=2, tie_word_embeddings=False
        ),
        "phi3": jm.Phi3Config(**BASE, sliding_window=128),
        "olmo2": jm.Olmo2Config(**BASE),
        "smollm3": jm.SmolLM3Config(**BASE, tie_word_embeddings=False),
        "gpt_oss (E=8, k=2)": jm.GptOssConfig(
            **{**BASE, "intermediate_size": 96},
            head_dim=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=128,
            max_position_embeddings=4096,
        ),
        "deepseek_v3 (E=8, k=2, MLA)": jm.DeepseekV3Config(
            **{**BASE, "num_key_value_heads": 4},
            moe_intermediate_size=96,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            kv_lora_rank=128,
            q_lora_rank=192,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=64,
        ),
    }


def measure(config) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxloom.models as jm

    try:
        model = jm.create_model(config, jm.RuntimeConfig(scan_layers=True), seed=0)
    except ValueError:  # dense and sparse layers (DeepSeek-V3's first dense layer): one scan cannot run both
        model = jm.create_model(config, jm.RuntimeConfig(scan_layers=False), seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (BATCH, SEQ)), jnp.int32)
    weight = jnp.ones((BATCH, SEQ), jnp.float32).at[:, -1].set(0)
    targets = jnp.roll(ids, -1, axis=1)

    @jax.jit
    def step(params):
        def loss(p):
            m = nnx.merge(graphdef, p)
            out = m(ids, return_hidden=True)
            kernel, dtype, precision = m.output_projection()
            total, _ = jm.linear_cross_entropy(
                out.hidden,
                kernel,
                targets,
                weight,
                blocks=4,
                dtype=dtype,
                precision=precision,
                softcap=m.logit_softcap,
            )
            aux = 0.0 if out.aux_loss is None else 0.01 * out.aux_loss
            return total / weight.sum() + aux

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads), value

    for _ in range(2):
        params, value = step(params)
    jax.block_until_ready(value)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        params, value = step(params)
        jax.block_until_ready(value)
        times.append(time.perf_counter() - start)
    return {"params": jm.count_params(model), "tokens_per_second": BATCH * SEQ / statistics.median(times)}


def main() -> None:
    out: dict[str, dict] = {}
    for _ in range(2):  # two rounds, best of each: a family measured first is not penalised by a cold machine
        for name, config in configs().items():
            r = measure(config)
            if name not in out or r["tokens_per_second"] > out[name]["tokens_per_second"]:
                out[name] = r
    print(json.dumps(out))


if __name__ == "__main__":
    main()
