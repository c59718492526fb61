"""Attention: the layer (`module`: `Attention`, `self_attention`) apart from its backends (`backends`: `attend`
over segment ids and positions with `xla`, `chunked`, `cudnn` and `flash`, and how `auto` chooses)."""

from .backends import (
    IMPLEMENTATIONS,
    AttentionUnavailableError,
    attend,
    choose_implementation,
    cuda_capability,
    cudnn_branch,
    cudnn_packs,
    document_table,
    make_attention_mask,
    packed_tables,
)
from .module import Attention, self_attention

__all__ = [
    "IMPLEMENTATIONS",
    "Attention",
    "AttentionUnavailableError",
    "attend",
    "choose_implementation",
    "cuda_capability",
    "cudnn_branch",
    "cudnn_packs",
    "document_table",
    "make_attention_mask",
    "packed_tables",
    "self_attention",
]
