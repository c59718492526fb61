"""jaxloom.generation: KV-cache decoding, sampling, and `generate_unified` for jaxloom models."""

from .__about__ import __version__
from .config import GenerationConfig
from .decode import Generated, create_generate_function, generate
from .engine import CompletionOutput, LLMEngine, RequestOutput
from .sampling import filter_logits, next_token, sample_rows, sample_with_keys
from .server import OpenAIServer
from .streaming import stream
from .unified import (
    GenerationResults,
    encode_prompts,
    end_of_turn_ids,
    generate_aio,
    generate_unified,
    with_stop_ids,
)

__all__ = [
    "CompletionOutput",
    "GenerationConfig",
    "GenerationResults",
    "Generated",
    "LLMEngine",
    "OpenAIServer",
    "RequestOutput",
    "__version__",
    "create_generate_function",
    "encode_prompts",
    "end_of_turn_ids",
    "filter_logits",
    "generate",
    "generate_aio",
    "generate_unified",
    "next_token",
    "sample_rows",
    "sample_with_keys",
    "stream",
    "with_stop_ids",
]
