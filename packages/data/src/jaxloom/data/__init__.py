"""jaxloom.data: sources, tokenization, packing, and a deterministic, resumable data loader."""

from .__about__ import __version__
from .collate import (
    create_collect_function,
    extract_column_names,
    process_messages_data,
    process_sample_data,
    to_global,
)
from .mesh_loader import MeshLoader
from .pipeline import DataConfig, DataLoader
from .processor import adds_bos, bundled_corpus_path, bundled_tokenizer_path, load_processor, match_bos
from .sources import (
    HFDatasetSource,
    IterableSource,
    JsonlSource,
    ParquetSource,
    ShardedDataSource,
    TextSource,
    as_source,
)
from .synthetic import addition_records, exact_match
from .tokenize import tokenize_record

__all__ = [
    "DataConfig",
    "DataLoader",
    "HFDatasetSource",
    "IterableSource",
    "JsonlSource",
    "MeshLoader",
    "ParquetSource",
    "ShardedDataSource",
    "TextSource",
    "__version__",
    "addition_records",
    "adds_bos",
    "as_source",
    "bundled_corpus_path",
    "bundled_tokenizer_path",
    "create_collect_function",
    "exact_match",
    "extract_column_names",
    "load_processor",
    "match_bos",
    "process_messages_data",
    "process_sample_data",
    "to_global",
    "tokenize_record",
]
