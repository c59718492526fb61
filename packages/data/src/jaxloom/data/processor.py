"""Tokenizers ("processors"): loading with a pad-token fallback, and the bundled ones."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)
_BUNDLED = Path(__file__).with_name("bundled")


def bundled_tokenizer_path() -> Path:
    """Directory of the bundled byte-level BPE tokenizer (4096 tokens, with a chat template)."""
    return _BUNDLED / "tokenizer"


def bundled_corpus_path() -> Path:
    """JSONL file of the bundled English corpus (Python documentation prose; see bundled/SOURCE.md)."""
    return _BUNDLED / "corpus.jsonl"


def load_processor(path_or_dir: str | Path | None = None, *, trust_remote_code: bool = False):
    """A `transformers` tokenizer from `path_or_dir`, a local directory (default: the bundled one). A
    missing pad token falls back to eos with a warning; with neither, a clear error. Code shipped with
    a tokenizer runs only when `trust_remote_code` is set."""
    from transformers import AutoTokenizer

    path = bundled_tokenizer_path() if path_or_dir is None else path_or_dir
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer {path} has neither a pad token nor an eos token to pad with; "
                             "set one (tokenizer.pad_token = ...)")
        log.warning("tokenizer %s has no pad token; padding with its eos token %r", path, tok.eos_token)
        tok.pad_token = tok.eos_token
    return tok
