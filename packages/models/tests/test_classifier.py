"""Sequence classification (reward models) on every family against transformers' `*ForSequenceClassification`:
the same scores at each row's last non-pad token, read from transformers' files or from a causal LM's (a new
`score`), and an export `AutoModelForSequenceClassification` loads with the same scores."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_util import UNSCANNED, batch, make_hf

import jaxloom.models as jm

torch = pytest.importorskip("torch")
CLS = jm.TaskType.SEQUENCE_CLASSIFICATION
PAD = 0


def hf_scores(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(ids)), attention_mask=torch.tensor(np.asarray(mask)))
    return out.logits.float().numpy()


def ours(model, ids, mask):
    return np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits)


def classifier_of(family, tmp_path, labels=1):
    """transformers' classifier of a tiny `family` model (its `score` drawn by transformers), saved."""
    import transformers

    make_hf(family, tmp_path / "causal")
    torch.manual_seed(3)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "causal", num_labels=labels, pad_token_id=PAD
    ).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0.0, 0.5)  # scores well apart from zero
    hf.save_pretrained(tmp_path / "classifier")
    return hf


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mixtral", "deepseek_v3"])
def test_scores_equal_transformers_and_the_export_loads_there(tmp_path, family):
    import transformers

    hf = classifier_of(family, tmp_path)
    ids, mask, _ = batch("right")
    ids[0, 8] = PAD  # a real token that is the pad id (an EOS that doubles as pad): transformers reads the one before
    want = hf_scores(hf, ids, mask)
    runtime = jm.RuntimeConfig(scan_layers=family not in UNSCANNED)
    model = jm.from_pretrained(tmp_path / "classifier", runtime, task=CLS)
    assert type(model).__name__ == type(hf).__name__
    got = ours(model, ids, mask)
    assert got.shape == (4, 1)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    moved = ids.copy()
    moved[0, 7] = (ids[0, 7] % 90) + 1  # the token the score is read at: the score moves
    assert np.abs(ours(model, moved, mask)[0] - got[0]).max() > 1e-4

    jm.save_hf_model(model, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["architectures"] == [type(hf).__name__] and written["id2label"] == {"0": "LABEL_0"}
    again = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    np.testing.assert_allclose(hf_scores(again, ids, mask), want, atol=2e-5, rtol=2e-5)


def test_a_causal_lms_files_give_a_new_score_and_two_labels_by_default(tmp_path, caplog):
    """From a causal LM's files (what a reward model starts from): the decoder is the LM's, `score` is drawn new
    (said once), `lm_head` is not read; without `num_labels` there are transformers' two."""
    import transformers

    make_hf("llama", tmp_path / "causal")
    with caplog.at_level("WARNING"):
        model = jm.from_pretrained(tmp_path / "causal", task=CLS, config_overrides={"pad_token_id": PAD})
    assert "['score.weight'] are not in the checkpoint: drawn new" in caplog.text
    assert model.lm_head is None and model.score.kernel.shape == (64, 2)
    ids, mask, _ = batch("left")
    decoder = transformers.AutoModel.from_pretrained(tmp_path / "causal").eval()
    with torch.no_grad():
        hidden = decoder(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    want = hidden[:, -1] @ np.asarray(model.score.kernel[...])  # left padding: every row's last token is the last
    np.testing.assert_allclose(ours(model, ids, mask), want, atol=2e-5, rtol=2e-5)


def test_a_peft_seq_cls_adapter_loads_here_with_its_score(tmp_path):
    """PEFT's `SEQ_CLS` adapters (LoRA, and `score` trained whole: `modules_to_save`) made on transformers'
    classifier load here over the same base with PEFT's scores; the base's own `score` is replaced."""
    peft = pytest.importorskip("peft")
    hf = classifier_of("llama", tmp_path)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
    config.init_lora_weights = False  # B drawn too: the adapters act
    theirs = peft.get_peft_model(hf, config)
    with torch.no_grad():
        theirs.base_model.model.score.modules_to_save["default"].weight.normal_(0.0, 0.5)  # trained: differs
    theirs.eval().save_pretrained(tmp_path / "adapter")
    ids, mask, _ = batch("right")
    want = hf_scores(theirs, ids, mask)
    model = jm.from_pretrained(tmp_path / "classifier", task=CLS)
    before = ours(model, ids, mask)
    read = jm.read_peft_config(tmp_path / "adapter")
    assert read.modules_to_save == ("classifier", "score")
    jm.apply_lora(model, read)
    jm.load_peft_weights(model, tmp_path / "adapter")
    got = ours(model, ids, mask)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert np.abs(got - before).max() > 1e-2
