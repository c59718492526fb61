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
    # Qwen2 with windows on the upper layer only (max_window_layers = 1): local and global layers in one stack
    "qwen2_mixed_window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    # Qwen3: per-head q/k norm, head_dim not hidden / heads, tied embeddings
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=True)),
    # Qwen3-MoE: raw top-k router weights (norm_topk_prob false), layer 1 a dense MLP (mlp_only_layers)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1], head_dim=24),
    ),
    "qwen3_moe_normed": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    # Gemma 2: every soft-cap, window and scale small enough to act on 12 tokens of these weights
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=20,
            sliding_window=4,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=0.5,
        ),
    ),
    # Gemma 3: local layer 0 (base 100, no scaling), global layer 1 (base 1000, linear scaling)
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=20,
            sliding_window=4,
            sliding_window_pattern=2,
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=100.0),
            },
        ),
    ),
    # Phi-3 128k-style: LongRoPE past 8 positions, a window of 6
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            sliding_window=6,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            original_max_position_embeddings=8,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[1.0 + 0.7 * i for i in range(8)],
                original_max_position_embeddings=8,
            ),
        ),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # SmolLM3: layer 1 of 2 without RoPE (interval 2) and with a window of 4, biases on attention and the MLP
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=4,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # GPT-OSS: sinks, alternating windows of 4, biases everywhere, YaRN (its default), the SwiGLU clamp binding at 0.3
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.3),
    ),
    # DeepSeek-V3: MLA with a q bottleneck, interleaved RoPE, YaRN with mscale_all_dim (the softmax scale), a dense
    # layer then grouped routing (2 of 4 groups) with the correction bias, a shared expert, the routed scaling
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=12,
            routed_scaling_factor=1.5,
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
}
# families whose layers differ in structure (dense and sparse feed-forward): never scanned
UNSCANNED = {"qwen3_moe", "deepseek_v3"}


def make_hf(family: str, path, seed: int = 0):
    import torch
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**{**TINY, **extra})
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # re-drawn: HF initialises norms to 1 (Gemma's to 0) and biases to 0, which hides them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
        for name, buffer in model.named_buffers():  # DeepSeek's router bias is a buffer: moved off zero too
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(path)
    return model


def rel_err(ours, ref, mask):
    """The largest difference over the real tokens, relative to the largest reference logit there."""
    keep = mask.astype(bool)
    return float(np.abs(ours[keep] - ref[keep]).max() / np.abs(ref[keep]).max())


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
