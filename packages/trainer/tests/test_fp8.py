"""`fp8=tensor|row` (FP8 training, emulated by XLA on a CPU): a run trains as the unquantized one does (the losses
within a few per cent, not equal), its checkpoints hold the same float parameters and restore the same with FP8 on or
off, and a device without FP8 products is refused before anything runs."""

import numpy as np
import pytest
from util import losses, params_of, trainer

from jaxloom.trainer import TrainingArguments


@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_an_fp8_run_trains_as_the_unquantized_one_and_its_checkpoint_restores_either_way(tmp_path, mode):
    steps = dict(max_training_steps=12, learning_rate=3e-3, save_steps=12, warmup_steps=0)
    plain = trainer(tmp_path / "plain", **steps)
    plain.train()
    fp8 = trainer(tmp_path / "fp8", fp8=mode, **steps)
    fp8.train()
    a, b = losses(tmp_path / "plain"), losses(tmp_path / "fp8")
    print(mode, a[-1], b[-1])
    assert a != b and abs(a[-1] - b[-1]) < 0.03 * a[-1] and b[-1] < b[0] - 0.2  # FP8 products: close, learning
    saved = params_of(fp8.state)
    assert all(v.dtype == np.float32 for v in saved.values())  # master weights unchanged
    for setting in (mode, "none"):  # the same checkpoint, read back with FP8 on or off
        again = trainer(tmp_path / "fp8", fp8=setting, **steps)
        again.restore_checkpoint()
        restored = params_of(again.state)
        assert sorted(restored) == sorted(saved)
        for k in saved:
            np.testing.assert_array_equal(restored[k], saved[k], err_msg=k)


def test_fp8_is_refused_on_a_device_without_fp8_products():
    from types import SimpleNamespace

    from jaxloom.trainer.plan import _check_fp8

    assert TrainingArguments(fp8="row").runtime.runtime_overrides()["fp8"] == "row"
    with pytest.raises(ValueError, match="fp8"):
        TrainingArguments(fp8="block")
    a100 = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    mesh = SimpleNamespace(devices=np.array([a100]))
    with pytest.raises(ValueError, match=r"fp8 = 'tensor' on NVIDIA A100.*compute capability 8.0.*8.9 or newer"):
        _check_fp8(SimpleNamespace(fp8="tensor"), mesh)
    h100 = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100 80GB HBM3")
    _check_fp8(SimpleNamespace(fp8="tensor"), SimpleNamespace(devices=np.array([h100])))  # Hopper: runs
