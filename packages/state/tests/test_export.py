import numpy as np
import pytest
from state_util import make_state, mesh_of, train_steps

import jaxloom.models as jm
import jaxloom.state as js

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_sharded_state_exports_to_transformers(tmp_path):
    state = train_steps(make_state(mesh_of(fsdp=2, tp=2)), 2)
    js.save_pretrained(state, tmp_path / "hf", to_hf=True, max_shard_bytes=50_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = np.random.default_rng(0).integers(0, 64, (3, 10))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(state.model(ids).logits)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4
    back = jm.from_pretrained(tmp_path / "hf")
    a, b = jm.to_hf_state_dict(state.model), jm.to_hf_state_dict(back)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_to_hf_false_writes_our_checkpoint(tmp_path):
    state = make_state(mesh_of(fsdp=2))
    js.save_pretrained(state, tmp_path / "ck", to_hf=False)
    assert js.CheckpointManager(str(tmp_path / "ck")).latest_step() == 0
