"""Adapters on an MoE layer's stacked expert weights (PEFT's `target_parameters`), kept apart from `lora` so that
the MoE modules that read them import nothing of LoRA's files and search.

An MoE module whose experts can take adapters names, in a class attribute `EXPERT_WEIGHTS`, the jaxloom weights
behind each of transformers' stacked expert weights (Mixtral: `gate_up_proj` is `w_gate` then `w_up`), in
`HF_EXPERTS` the name of transformers' experts module under it ("" when it is that module), and holds the
adapters of each in the attribute `EXPERT_PARAMETERS` names (None without); its forward pass reads its weights
through `expert_weights`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# transformers' stacked expert weights, in the order its experts module defines them (PEFT nests its wrappers in
# that order: the first adapted is the innermost, `base_layer` in the file's keys), and the attribute of a jaxloom
# MoE module holding each one's adapters.
EXPERT_PARAMETERS = {"gate_up_proj": "gate_up_lora", "down_proj": "down_lora"}


class ExpertLoRA(nnx.Module):
    """Low-rank adapters on a stacked expert weight (PEFT's `ParamWrapper`): for each expert `e`, `lora_a [E, in,
    r]` and `lora_b [E, r, out]`, and the weight the expert runs with is `W_e + A_e B_e · scaling`. `weights` are
    the jaxloom parameters behind one transformers weight, `[..., E, in, out_i]` each, whose outputs transformers
    concatenates (Mixtral's `gate_up_proj` is `w_gate` then `w_up`); B spans them all, A is shared."""

    def __init__(self, weights: list[nnx.Variable], r: int, scaling: float, key: jax.Array):
        *lead, experts, din, _ = weights[0].get_value().shape
        axes = weights[0].get_metadata().get("logical_axes") or (None,) * (len(lead) + 3)
        dout = sum(w.get_value().shape[-1] for w in weights)
        bound = 1.0 / math.sqrt(din)  # PEFT's kaiming_uniform_(a=sqrt(5)) on lora_A [r·E, in]
        self.lora_a = nnx.Param(
            jax.random.uniform(key, (*lead, experts, din, r), jnp.float32, -bound, bound),
            logical_axes=(*axes[:-1], None),
        )
        self.lora_b = nnx.Param(
            jnp.zeros((*lead, experts, r, dout), jnp.float32), logical_axes=(*axes[:-2], None, axes[-1])
        )
        self.sizes = tuple(w.get_value().shape[-1] for w in weights)
        self.scaling = scaling

    def deltas(self, dtype: Any, precision: Any = None) -> list[jax.Array]:
        """`A B · scaling` for each of the weights, `[..., E, in, out_i]` in `dtype` with the matmul `precision`
        (B split before the product, so each delta is sharded as its weight is)."""
        a = self.lora_a[...].astype(dtype)
        splits = np.cumsum(self.sizes)[:-1].tolist()
        parts = jnp.split(self.lora_b[...].astype(dtype), splits, axis=-1)
        scale = jnp.asarray(self.scaling, dtype)
        return [jnp.einsum("...ir,...ro->...io", a, b, precision=precision) * scale for b in parts]


def expert_weights(host: nnx.Module, name: str, dtype: Any, precision: Any = None) -> list[jax.Array]:
    """The stacked expert weights behind transformers' `name` (`gate_up_proj`, `down_proj`) in the MoE module `host`
    (its `EXPERT_WEIGHTS` names them), in `dtype`, with the adapters' `A B · scaling` added where it has them (their
    matmul at `precision`)."""
    weights = [getattr(host, attr)[...].astype(dtype) for attr in type(host).EXPERT_WEIGHTS[name]]
    adapters = getattr(host, EXPERT_PARAMETERS[name])
    if adapters is None:
        return weights
    return [w + d for w, d in zip(weights, adapters.deltas(dtype, precision), strict=True)]
