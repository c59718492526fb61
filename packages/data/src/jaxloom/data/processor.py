"""Tokenizers ("processors"): loading with a pad-token fallback, and the bundled ones."""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

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
        _check_hub_reachable(text)
    if _plain_fast_tokenizer(Path(path)):
        # What AutoTokenizer would pick anyway, without importing its registry of every model
        # (which imports torch when it is installed: seconds of start-up and ~0.3 GB of memory).
        from transformers import PreTrainedTokenizerFast as cls
    else:
        from transformers import AutoTokenizer as cls
    try:
        tok = cls.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        if not Path(path).is_dir():
            raise
        have = sorted(p.name for p in Path(path).iterdir())[:12]
        raise ValueError(
            f"{path}: not a tokenizer transformers can load ({str(e).strip().splitlines()[0][:200]}); it holds "
            f"{have}; expected tokenizer.json (or tokenizer_config.json with its vocabulary files)"
        ) from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(
                f"tokenizer {path} has neither a pad token nor an eos token to pad with; "
                "set one (tokenizer.pad_token = ...)"
            )
        log.warning("tokenizer %s has no pad token; padding with its eos token %r", path, tok.eos_token)
        tok.pad_token = tok.eos_token
    return tok


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no", "off")


def _check_hub_reachable(repo_id: str) -> None:
    """For a Hub id: return when it is in the local Hugging Face cache or the Hub answers; otherwise one
    FileNotFoundError at once (huggingface_hub would retry for about a minute before failing)."""
    from huggingface_hub import try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(repo_id, f), str) for f in ("tokenizer_config.json", "tokenizer.json")):
        return  # in the local cache: transformers loads it from there
    if _offline():
        raise FileNotFoundError(
            f"tokenizer {repo_id!r} is not a local directory nor in the Hugging Face cache, and HF_HUB_OFFLINE "
            "is set: nothing is downloaded; give a local tokenizer directory"
        )
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # reached through a proxy: huggingface_hub reports in its own words
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=5).close()
    except OSError as e:
        raise FileNotFoundError(
            f"tokenizer {repo_id!r} is not a local directory nor in the Hugging Face cache, and the Hub "
            f"({endpoint}) cannot be reached: {e}; nothing is downloaded. Give a local tokenizer directory, "
            "or run where the Hub is reachable"
        ) from None


def adds_bos(tokenizer) -> bool:
    """Whether `tokenizer(text)` puts the BOS token first by itself (its own special-token policy, the one
    `transformers` and `jaxloom.generation.encode_prompts` follow)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return ids[:1] == [bos] and tokenizer("a", add_special_tokens=False)["input_ids"][:1] != [bos]


def match_bos(tokenizer, add_bos: bool = True):
    """`tokenizer`, or a copy of it whose own encoding adds BOS exactly when training does (`add_bos`,
    `DataConfig.add_bos`): what a trainer keeps, so that prompts at generation time, the run's copy of the
    tokenizer and an HF export encode text as the model saw it in training. EOS is left to the tokenizer:
    training ends each document with it, a prompt must not end with it. A tokenizer without a BOS token,
    or one whose policy cannot be set (no `add_bos_token`), is returned as it is, with a warning in the
    latter case."""
    if not callable(tokenizer) or getattr(tokenizer, "bos_token_id", None) is None or adds_bos(tokenizer) == add_bos:
        return tokenizer
    if not hasattr(tokenizer, "add_bos_token"):
        log.warning(
            "training %s BOS to each document, but the tokenizer's own encoding cannot be set to match; "
            "prompts encoded by it differ from training",
            "adds" if add_bos else "does not add",
        )
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_bos_token = add_bos
    return tokenizer


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
