"""Logits of our models equal transformers' for the same weights (float32, CPU)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jaxloom.models as jm  # noqa: E402
from hf_util import FAMILIES, UNSCANNED, batch, hf_logits, make_hf, rel_err  # noqa: E402

RTOL = 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("attn", "scan"), [("xla", False), ("chunked", True)])
def test_logits_match_transformers(tmp_path, family, attn, scan):
    """Every attention backend that runs on CPU, unrolled and scanned layer stacks (Mixtral: token
    dispatch through the tiled grouped matmul, CPU's default)."""
    hf = make_hf(family, tmp_path)
    # a block of 4 keys: the 12-token batches span several blocks, some fully masked for some queries
    scan = None if family in UNSCANNED else scan
    model = jm.from_pretrained(tmp_path, jm.RuntimeConfig(attn_mechanism=attn, attn_block_size=4, scan_layers=scan))
    assert model.scanned == bool(scan)
    assert type(model).__name__ == type(hf).__name__
    # DeepSeek's router bias is a buffer in transformers (no gradient), a parameter here (no gradient either)
    bias = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert jm.count_params(model) == sum(p.numel() for p in hf.parameters()) + bias
    windowed = any(k in family for k in ("mistral", "window", "gemma", "phi3"))
    sides = ["none", "right"] if windowed else ["none", "right", "left"]
    for side in sides:
        if side == "none":
            ids, mask, pos = batch("right", lengths=(12, 12, 12, 12))
        else:
            ids, mask, pos = batch(side)
        ref = hf_logits(hf, ids, mask, pos)
        ours = np.asarray(model(ids, attention_mask=mask, positions=pos).logits)
        err = rel_err(ours, ref, mask)
        print(f"{family} {attn} scan={scan} padding={side}: max relative error {err:.2e}")
        assert err < RTOL, (family, side, err)


def test_export_loads_in_transformers_and_back_bitwise(tmp_path):
    import transformers

    make_hf("qwen2", tmp_path / "src")
    model = jm.from_pretrained(tmp_path / "src")
    jm.save_hf_model(model, tmp_path / "out", max_shard_bytes=60_000)  # forces a sharded index
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids, mask, pos = batch("right")
    assert (
        rel_err(np.asarray(model(ids, attention_mask=mask, positions=pos).logits), hf_logits(hf, ids, mask, pos), mask)
        < RTOL
    )
    again = jm.from_pretrained(tmp_path / "out")
    a, b = jm.to_hf_state_dict(model), jm.to_hf_state_dict(again)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_streamed_export_casts_and_shards_tensor_by_tensor(tmp_path):
    """The export writes each tensor as it is gathered (a scanned stack's layers one by one), cast on the
    way out and split over size-capped files: the files hold exactly the model's HF tensors, in bf16."""
    import json

    import jax.numpy as jnp

    from jaxloom.models import safetensors_io

    cfg = jm.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = jm.create_model(cfg, jm.RuntimeConfig(scan_layers=True), seed=0)
    jm.save_hf_model(model, tmp_path / "hf", dtype="bfloat16", max_shard_bytes=4000)
    weight_map = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    got = {}
    for file in set(weight_map.values()):
        got.update(safetensors_io.load(tmp_path / "hf" / file))
    ref = {k: np.asarray(v.astype(jnp.bfloat16)) for k, v in jm.to_hf_state_dict(model).items()}
    assert len(set(weight_map.values())) > 5 and got.keys() == ref.keys() == weight_map.keys()
    for k in ref:
        assert got[k].dtype == ref[k].dtype and np.array_equal(got[k].view(np.uint16), ref[k].view(np.uint16)), k
