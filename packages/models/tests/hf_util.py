"""Tiny Hugging Face models for parity tests (needs torch; tests importorskip it)."""

import numpy as np

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_tied_llama3rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            attention_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    # YaRN with every knob that changes the numbers: mscale / mscale_all_dim (the attention factor), no truncation
    "llama_yarn_mscale": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                mscale=1.0,
                mscale_all_dim=0.8,
                beta_fast=16,
                truncate=False,
            ),
        ),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    # Qwen2 with its window on every layer (max_window_layers = 0): the window must act (4 < 12 tokens)
    "qwen2_window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}


def make_hf(family: str, path, seed: int = 0):
    import torch
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**TINY, **extra)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # HF initialises norms to 1: perturb them so they are tested too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def hf_logits(model, ids, mask, positions):
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(np.asarray(ids)),
            attention_mask=torch.tensor(np.asarray(mask)),
            position_ids=torch.tensor(np.asarray(positions)),
        )
    return out.logits.float().numpy()


def batch(pad_side: str, lengths=(9, 5, 12, 1), total=12, vocab=97, seed=0):
    """Token ids of varied lengths padded to `total`, with masks and positions."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), total), np.int32)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        sl = slice(total - n, total) if pad_side == "left" else slice(0, n)
        ids[i, sl] = rng.integers(1, vocab, n)
        mask[i, sl] = 1
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    return ids, mask, positions
