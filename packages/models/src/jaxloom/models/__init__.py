"""jaxloom.models: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Gemma 2, Gemma 3, Phi-3, OLMo 2, SmolLM3,
GPT-OSS and DeepSeek-V3 in Flax NNX, with HF configs and weights."""

from .__about__ import __version__
from .attention import (
    AttentionUnavailableError,
    attend,
    choose_implementation,
    cuda_capability,
    cudnn_packs,
    document_table,
    make_attention_mask,
)
from .build import count_params, create_model, flops_per_token, param_shardings, param_specs
from .classifier import SequenceClassifierOutput, as_sequence_classifier, is_classifier, last_token
from .configs import CONFIG_CLASSES, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, config_from_hf_dict
from .deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, expert_load, update_router_bias
from .gemma import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
)
from .gpt_oss import GptOssConfig, GptOssForCausalLM
from .mxfp4 import dequantize_mxfp4
from .hf import from_pretrained, pretrained_source, save_hf_model, to_hf_state_dict
from .expert_adapters import ExpertLoRA, expert_weights
from .dropout import dropout_key
from .lora import (
    Frozen,
    LoRAConfig,
    LoRALinear,
    apply_lora,
    quantize_frozen,
    lora_config_of,
    merge_lora,
)
from .peft import load_peft_weights, read_peft_config, save_peft_adapter
from .losses import (
    cross_entropy_gradient,
    linear_cross_entropy,
    linear_generalized_jsd,
    linear_log_probs,
    linear_token_log_probs,
    linear_token_scores,
)
from .decoder import CausalLMOutput, RouterLoad
from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from .mixtral import MixtralForCausalLM
from .moe import dispatch_tokens, expert_parallel_dispatch, grouped_matmul
from .olmo2 import Olmo2Config, Olmo2ForCausalLM
from .phi3 import Phi3Config, Phi3ForCausalLM
from .qwen3 import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from .qwen2_5_vl import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, rope_index
from .siglip import SiglipVisionConfig, SiglipVisionTransformer
from .vision import Qwen2_5_VisionTransformer, Qwen2_5_VLVisionConfig, VisionLayout, vision_layout
from .registry import TaskType, get_model_class, register, registered
from .smollm3 import SmolLM3Config, SmolLM3ForCausalLM
from .runtime import SCAN_ABOVE_LAYERS, AttentionMechanisms, EasyDeLGradientCheckPointers, RuntimeConfig

__all__ = [
    "SequenceClassifierOutput",
    "as_sequence_classifier",
    "is_classifier",
    "last_token",
    "Frozen",
    "ExpertLoRA",
    "expert_weights",
    "LoRAConfig",
    "LoRALinear",
    "apply_lora",
    "dropout_key",
    "quantize_frozen",
    "load_peft_weights",
    "lora_config_of",
    "merge_lora",
    "read_peft_config",
    "save_peft_adapter",
    "AttentionMechanisms",
    "AttentionUnavailableError",
    "EasyDeLGradientCheckPointers",
    "attend",
    "choose_implementation",
    "cuda_capability",
    "cudnn_packs",
    "document_table",
    "grouped_matmul",
    "dispatch_tokens",
    "expert_parallel_dispatch",
    "cross_entropy_gradient",
    "linear_cross_entropy",
    "linear_generalized_jsd",
    "linear_token_log_probs",
    "linear_token_scores",
    "linear_log_probs",
    "SCAN_ABOVE_LAYERS",
    "CONFIG_CLASSES",
    "CausalLMOutput",
    "RouterLoad",
    "expert_load",
    "update_router_bias",
    "Gemma2Config",
    "Gemma2ForCausalLM",
    "Gemma3Config",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Gemma3TextConfig",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "GptOssConfig",
    "GptOssForCausalLM",
    "dequantize_mxfp4",
    "Olmo2Config",
    "Olmo2ForCausalLM",
    "Phi3Config",
    "Phi3ForCausalLM",
    "Qwen3Config",
    "SmolLM3Config",
    "SmolLM3ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "Qwen2_5_VLConfig",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen2_5_VLVisionConfig",
    "Qwen2_5_VisionTransformer",
    "VisionLayout",
    "SiglipVisionConfig",
    "SiglipVisionTransformer",
    "rope_index",
    "vision_layout",
    "LlamaConfig",
    "LlamaForCausalLM",
    "MistralConfig",
    "MistralForCausalLM",
    "MixtralConfig",
    "MixtralForCausalLM",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    "RuntimeConfig",
    "TaskType",
    "__version__",
    "make_attention_mask",
    "config_from_hf_dict",
    "count_params",
    "create_model",
    "flops_per_token",
    "from_pretrained",
    "get_model_class",
    "param_shardings",
    "param_specs",
    "pretrained_source",
    "register",
    "registered",
    "save_hf_model",
    "to_hf_state_dict",
]
