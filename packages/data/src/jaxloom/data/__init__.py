"""jaxloom.data: sources, tokenization, packing, and a deterministic, resumable data loader."""

from .__about__ import __version__
from .collate import (
    create_collect_function,
    extract_column_names,
    process_messages_data,
    process_sample_data,
    to_global,
)
from .images import (
    check_image,
    expand_image_tokens,
    image_prompt,
    load_image_processor,
    load_model_processor,
    open_image,
    process_images,
)
from .mesh_loader import MeshLoader
from .pipeline import DataConfig, DataLoader, Mixture, first_bad_record
from .processor import adds_bos, bundled_corpus_path, bundled_tokenizer_path, load_processor, match_bos
from .sources import (
    HFDatasetSource,
    IterableSource,
    JsonlSource,
    ParquetSource,
    ShardedDataSource,
    TextSource,
    as_source,
    iter_shard,
)
from .store_prepare import prepare
from .store import TokenStore, is_store, tokenizer_hash
from .synthetic import addition_records, exact_match
from .tokenize import (
    record_images,
    refuse_images,
    shown_pixels,
    shown_prompt,
    tokenize_image_pair,
    tokenize_image_record,
    tokenize_labelled,
    tokenize_pair,
    tokenize_record,
)

__all__ = [
    "DataConfig",
    "DataLoader",
    "HFDatasetSource",
    "IterableSource",
    "JsonlSource",
    "MeshLoader",
    "Mixture",
    "ParquetSource",
    "ShardedDataSource",
    "TextSource",
    "TokenStore",
    "__version__",
    "addition_records",
    "adds_bos",
    "as_source",
    "bundled_corpus_path",
    "bundled_tokenizer_path",
    "create_collect_function",
    "exact_match",
    "check_image",
    "expand_image_tokens",
    "image_prompt",
    "load_image_processor",
    "load_model_processor",
    "open_image",
    "process_images",
    "extract_column_names",
    "first_bad_record",
    "is_store",
    "iter_shard",
    "load_processor",
    "match_bos",
    "process_messages_data",
    "prepare",
    "record_images",
    "refuse_images",
    "shown_pixels",
    "shown_prompt",
    "process_sample_data",
    "to_global",
    "tokenize_image_pair",
    "tokenize_image_record",
    "tokenize_labelled",
    "tokenize_pair",
    "tokenize_record",
    "tokenizer_hash",
]
