"""SigLIP's vision tower (Gemma 3's) against transformers' `SiglipVisionModel`: the last hidden state of a batch of
images, every weight redrawn wide enough to act; each part moves the output when taken away; bad shapes refused."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxloom.models.build import is_variable  # noqa: E402
from jaxloom.models.siglip import SiglipVisionConfig, SiglipVisionTransformer  # noqa: E402

# Gemma 3's published tower (google/gemma-3-4b-it: 27 layers of 1152, patches of 14 over 896 pixels) shrunk
HF_VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=4,
    layer_norm_eps=1e-6,
    vision_use_head=False,
    model_type="siglip_vision_model",
)


@pytest.fixture(scope="module")
def towers():
    hf = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**HF_VISION)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            norm = "norm" in name
            p.copy_(torch.randn_like(p) * (0.3 if norm else 0.15) + (1.0 if norm and name.endswith("weight") else 0.0))
    ours = SiglipVisionTransformer(SiglipVisionConfig.from_hf_dict(HF_VISION), rngs=nnx.Rngs(0))
    tensors = {k.removeprefix("vision_model."): v.numpy() for k, v in hf.state_dict().items()}
    state = nnx.state(ours, nnx.Param)

    def load(path, var):  # transformers' names, as hf.py's rules give them (kernels stored transposed)
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        *module, leaf = names
        key = ".".join(module) + (".weight" if leaf in ("kernel", "embedding") else f".{leaf}")
        value = tensors.pop(key)
        return var.replace(value=jnp.asarray(value.T if leaf == "kernel" else value))

    nnx.update(ours, nnx.State(jax_tree_map_with_path(load, state)))
    assert not {k for k in tensors if "position_ids" not in k}, tensors.keys()  # every weight read
    return hf, ours


def jax_tree_map_with_path(fn, state):
    import jax

    return jax.tree_util.tree_map_with_path(fn, state, is_leaf=is_variable)


def images(n=3, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 3, 32, 32)).astype(np.float32)


def test_last_hidden_state_equals_transformers(towers):
    hf, ours = towers
    pix = images()
    with torch.no_grad():
        ref = hf(pixel_values=torch.tensor(pix)).last_hidden_state.numpy()
    out = np.asarray(ours(jnp.asarray(pix)))
    assert out.shape == (3, 64, 32)
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5
    # the position embeddings act (patches of one image in another order would otherwise give the same rows)
    bare = nnx.clone(ours)
    bare.embeddings.position_embedding.embedding.set_value(jnp.zeros((64, 32)))
    assert np.abs(np.asarray(bare(jnp.asarray(pix))) - ref).max() / np.abs(ref).max() > 1e-2


def test_config_and_shapes_are_checked():
    with pytest.raises(ValueError, match="vision_use_head = true"):
        SiglipVisionConfig.from_hf_dict({**HF_VISION, "vision_use_head": True})
    with pytest.raises(ValueError, match="image_size 30 is not a multiple of patch_size 4"):
        SiglipVisionConfig.from_hf_dict({**HF_VISION, "image_size": 30})
    with pytest.raises(ValueError, match=r"unknown vision_config key\(s\) \['hiden_size'\]"):
        SiglipVisionConfig.from_hf_dict({**HF_VISION, "hiden_size": 3})
    tower = SiglipVisionTransformer(SiglipVisionConfig.from_hf_dict(HF_VISION), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"pixel_values has shape \(1, 3, 28, 28\); expected \[images, 3, 32, 32\]"):
        tower(jnp.zeros((1, 3, 28, 28)))
