"""Logits of our models equal transformers' for the same weights (float32, CPU)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jaxloom.models as jm  # noqa: E402
from hf_util import FAMILIES, batch, hf_logits, make_hf  # noqa: E402

RTOL = 1e-4


def rel_err(ours, ref, mask):
    keep = mask.astype(bool)
    return float(np.abs(ours[keep] - ref[keep]).max() / np.abs(ref[keep]).max())


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("attn", "scan"), [("xla", False), ("chunked", True)])
def test_logits_match_transformers(tmp_path, family, attn, scan):
    """Every attention backend that runs on CPU, unrolled and scanned layer stacks (Mixtral: token
    dispatch through the tiled grouped matmul, CPU's default)."""
    hf = make_hf(family, tmp_path)
    # a block of 4 keys: the 12-token batches span several blocks, some fully masked for some queries
    model = jm.from_pretrained(tmp_path, jm.RuntimeConfig(attn_mechanism=attn, attn_block_size=4, scan_layers=scan))
    assert model.scanned == scan
    assert type(model).__name__ == type(hf).__name__
    assert jm.count_params(model) == sum(p.numel() for p in hf.parameters())
    sides = ["none", "right"] if family == "mistral" else ["none", "right", "left"]
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
