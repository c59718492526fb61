import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxloom.generation as jg  # noqa: E402
import jaxloom.models as jm  # noqa: E402


def _sibling(part: str, name: str):
    """A test helper of another part (`packages/PART/tests/NAME.py`), so the families and chat formats are
    defined in one place."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / part / "tests" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{part}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_families():
    """The tiny families of jaxloom-models' parity tests (its tests/hf_util.py)."""
    return _sibling("models", "hf_util")


@pytest.mark.parametrize("style", ["gemma", "chatml", "qwen3"])
def test_the_family_chat_formats_stop_at_their_end_of_turn_token(style):
    """Gemma's `<end_of_turn>`, ChatML's and Qwen3's `<|im_end|>`: what a chat reply ends with, so generation
    with the template stops there (not only at EOS)."""
    styles = _sibling("data", "chat_styles")
    tok = styles.chat_tokenizer(style)
    eot = tok.convert_tokens_to_ids(styles.END_OF_TURN[style])
    assert jg.end_of_turn_ids(tok) == (eot,) and eot != tok.eos_token_id


FAMILIES = [
    "llama",
    "mistral",
    "mixtral",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "qwen2_mixed_window",
    "smollm3",
    "gpt_oss",
    "deepseek_v3",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate_for_each_family(tmp_path, family):
    """Prompts of 7 tokens and 12 new ones: the KV cache crosses every window (4 or 6) and Phi-3's original
    length (8), so per-layer windows, soft-caps and LongRoPE's switch to its long factors all act in decoding."""
    util = _model_families()
    hf = util.make_hf(family, tmp_path)
    model = jm.from_pretrained(tmp_path)
    ids = np.random.default_rng(0).integers(3, 97, (3, 7)).astype(np.int32)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor(ids, dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones(ids.shape, dtype=torch.long),
        )
    out = jg.generate(model, ids, None, jg.GenerationConfig(max_new_tokens=12))
    np.testing.assert_array_equal(np.asarray(out.completion_ids), ref[:, 7:].numpy())
    if model.cache_refresh_position is not None:  # LongRoPE: the engine refuses it by name (test_engine.py)
        return
    # the paged engine: 2 slots for 3 prompts, pages of 8 positions, chunks of 5 steps — so a sequence waits for
    # a slot, its cache spans pages (19 positions: 3) and its decoding spans chunks
    engine = jg.LLMEngine(model, max_num_seqs=2, decode_chunk=5, page_size=8)
    outs = engine.generate(ids.tolist(), max_new_tokens=12)
    np.testing.assert_array_equal([o.outputs[0].token_ids for o in outs], ref[:, 7:].numpy())
