import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxloom.mesh import (
    MeshConfig,
    auto_partition_rules,
    gather,
    match_partition_rules,
    named_leaves,
    shard,
    specs_to_named_sharding,
)


def mlp_params():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    return {
        "embed": {"embedding": jax.random.normal(k[0], (64, 32))},
        "layers": [
            {
                "up": {"kernel": jax.random.normal(k[1], (32, 48)), "bias": jnp.zeros((48,))},
                "down": {"kernel": jax.random.normal(k[2], (48, 32))},
            }
        ],
        "norm": {"scale": jnp.ones((32,))},
        "step": jnp.array(3),
    }


RULES = [
    (r"embed/embedding", P("tp", "fsdp")),
    (r"up/kernel", P("fsdp", "tp")),
    (r"down/kernel", P("tp", "fsdp")),
    (r"bias", P("tp")),
    (r".*", P()),
]


def forward(params, x):
    h = params["embed"]["embedding"][x]
    for layer in params["layers"]:
        h = h + jax.nn.gelu(h @ layer["up"]["kernel"] + layer["up"]["bias"]) @ layer["down"]["kernel"]
    return (h * params["norm"]["scale"]).sum(-1)


def test_paths_and_first_match_wins():
    params = mlp_params()
    names = [n for n, _ in named_leaves(params)]
    assert "layers/0/up/kernel" in names and "embed/embedding" in names
    specs = match_partition_rules(RULES, params)
    assert specs["layers"][0]["up"]["kernel"] == P("fsdp", "tp")
    assert specs["layers"][0]["up"]["bias"] == P("tp")
    assert specs["norm"]["scale"] == P()
    assert specs["step"] == P()  # scalars are replicated whatever the rules say


def test_no_matching_rule_is_an_error():
    with pytest.raises(ValueError, match=r"no partition rule matches parameter 'norm/scale' \(shape \(32,\)\)"):
        match_partition_rules(RULES[:-1], mlp_params())


def test_spec_that_does_not_divide_names_the_parameter():
    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()
    params = {"w": jnp.zeros((6, 8))}
    with pytest.raises(ValueError, match=r"parameter 'w' with shape \(6, 8\).*dim 0 of size 6 is not divisible by 4"):
        match_partition_rules([("w", P("fsdp", "tp"))], params, mesh=mesh)
    with pytest.raises(ValueError, match=r"mesh axis \['model'\] not in the mesh"):
        match_partition_rules([("w", P("model"))], params, mesh=mesh)
    with pytest.raises(ValueError, match="the spec has 3 entries but the array has 2 dims"):
        shard(params, {"w": P(None, None, "tp")}, mesh)


def test_auto_rules_shard_the_largest_divisible_dim():
    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()
    params = {"a": np.zeros((12, 64)), "b": np.zeros((7, 5)), "c": np.zeros((6, 16)), "s": np.zeros(())}
    specs = match_partition_rules(auto_partition_rules(params, mesh, axes=("fsdp", "tp")), params, mesh=mesh)
    assert specs["a"] == P("tp", "fsdp")  # 64 is the largest → fsdp; 12 % 2 == 0 → tp
    assert specs["b"] == P(None, None)  # nothing divides: replicated
    assert specs["c"] == P("tp", "fsdp")
    assert specs["s"] == P()


def test_sharded_jit_equals_single_device():
    params, x = mlp_params(), jnp.arange(16).reshape(8, 2) % 64
    expected = jax.jit(forward)(params, x)  # one device: inputs are uncommitted single-device arrays
    for dims in [dict(fsdp=4, tp=2), dict(dp=2, fsdp=2, tp=2), dict(tp=8)]:
        mesh = MeshConfig.from_axes(**{k: v for k, v in dims.items()}).build()
        specs = match_partition_rules(RULES, params, mesh=mesh)
        sharded = shard(params, specs, mesh)
        assert sharded["layers"][0]["up"]["kernel"].sharding.spec == P("fsdp", "tp")
        xs = shard(x, P(("dp", "fsdp")), mesh)
        out = jax.jit(forward, in_shardings=(specs_to_named_sharding(specs, mesh), xs.sharding))(sharded, xs)
        np.testing.assert_allclose(gather(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
        back = gather(sharded)
        np.testing.assert_array_equal(back["embed"]["embedding"], np.asarray(params["embed"]["embedding"]))
