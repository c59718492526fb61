"""jaxloom.generation: KV-cache decoding, sampling, and `generate_unified` for jaxloom models."""

from .__about__ import __version__
from .config import GenerationConfig
from .decode import Generated, create_generate_function, generate, naive_greedy
from .sampling import filter_logits, next_token
from .streaming import stream
from .unified import GenerationResults, generate_aio, generate_unified

__all__ = [
    "GenerationConfig",
    "GenerationResults",
    "Generated",
    "__version__",
    "create_generate_function",
    "filter_logits",
    "generate",
    "generate_aio",
    "generate_unified",
    "naive_greedy",
    "next_token",
    "stream",
]
