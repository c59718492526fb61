"""Tokenizers ("processors"): loading with a pad-token fallback, and the bundled ones."""

from __future__ import annotations

import json
import logging
import os
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
    path = bundled_tokenizer_path() if path_or_dir is None else path_or_dir
    if not Path(path).exists():
        text = str(path)
        local = (
            isinstance(path, Path)
            or text.startswith((".", "/", "~"))
            or text.count("/") > 1
            or ("/" in text and Path(text).parent.is_dir())  # "data/tok" beside an existing data/: a typo
        )
        if local:  # never sent to the Hub: a typo would otherwise retry downloads for a minute
            raise FileNotFoundError(
                f"tokenizer directory {path} does not exist (nothing is downloaded for a local path)"
            )
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
            raise FileNotFoundError(f"tokenizer {path!r} is not a local directory and HF_HUB_OFFLINE is set")
    if _plain_fast_tokenizer(Path(path)):
        # What AutoTokenizer would pick anyway, without importing its registry of every model
        # (which imports torch when it is installed: seconds of start-up and ~0.3 GB of memory).
        from transformers import PreTrainedTokenizerFast as cls
    else:
        from transformers import AutoTokenizer as cls
    tok = cls.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(
                f"tokenizer {path} has neither a pad token nor an eos token to pad with; "
                "set one (tokenizer.pad_token = ...)"
            )
        log.warning("tokenizer %s has no pad token; padding with its eos token %r", path, tok.eos_token)
        tok.pad_token = tok.eos_token
    return tok


_PLAIN_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def _plain_fast_tokenizer(path: Path) -> bool:
    """True for a local directory whose tokenizer_config.json names the generic fast tokenizer
    class, with a tokenizer.json beside it and no custom code."""
    config = path / "tokenizer_config.json"
    if not (config.is_file() and (path / "tokenizer.json").is_file()):
        return False
    try:
        meta = json.loads(config.read_text())
    except (OSError, ValueError):
        return False  # AutoTokenizer reports a malformed config in its own words
    return isinstance(meta, dict) and meta.get("tokenizer_class") in _PLAIN_CLASSES and "auto_map" not in meta
