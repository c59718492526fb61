"""Build jaxloom-data's bundled corpus and tokenizer (run once; the outputs are committed).

Source: the reStructuredText sources of the Python 3.11 documentation, from Debian's
`python3.11-doc` package (PSF License Version 2; see packages/data/src/jaxloom/data/bundled/SOURCE.md).

    mkdir -p /tmp/pydoc && cd /tmp/pydoc && apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb x
    python tools/build_bundled_data.py /tmp/pydoc/x/usr/share/doc/python3.11/html/_sources
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "packages/data/src/jaxloom/data/bundled"
SECTIONS = ("tutorial", "howto", "faq", "reference", "using", "extending", "whatsnew")
VOCAB = 4096
SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def clean(rst: str) -> list[str]:
    """Paragraphs of prose: directives, tables, code blocks and heading underlines dropped."""
    paragraphs, lines, in_block = [], [], False
    for line in rst.splitlines() + [""]:
        stripped = line.strip()
        if in_block:
            if stripped and not line[:1].isspace():
                in_block = False
            else:
                continue
        if stripped.startswith(".. ") or stripped.endswith("::") and stripped == "::":
            in_block = True
            continue
        if re.fullmatch(r"[=\-~^*+#\"'`]{3,}", stripped) or stripped.startswith(("|", "+-", ">>>", "...")):
            continue
        if not stripped:
            if lines:
                text = " ".join(lines)
                text = re.sub(r":[a-z:]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", text)  # :role:`target`
                text = re.sub(r"`+([^`]+?)`+_?", r"\1", text).replace("::", ":")
                text = re.sub(r"\s+", " ", text).strip()
                if len(text) > 40 and sum(c.isalpha() for c in text) > 0.6 * len(text):
                    paragraphs.append(text)
            lines = []
            continue
        if line[:1].isspace() and not lines:
            continue  # indented literal text
        lines.append(stripped)
    return paragraphs


def main(src: Path) -> None:
    docs = []
    for section in SECTIONS:
        for f in sorted((src / section).rglob("*.rst.txt")):
            chunk: list[str] = []
            for p in clean(f.read_text(errors="replace")) + [None]:
                if chunk and (p is None or sum(map(len, chunk)) + len(p) > 4000):
                    docs.append({"source": f"python-3.11-docs/{f.relative_to(src)}", "text": "\n".join(chunk)})
                    chunk = []
                if p is not None:
                    chunk.append(p)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "corpus.jsonl", "w") as fh:
        for d in docs:
            fh.write(json.dumps(d) + "\n")
    total = sum(len(d["text"]) for d in docs)
    print(f"{len(docs)} documents, {total / 1e6:.2f} MB of text")

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator((d["text"] for d in docs), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=2048
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(OUT / "tokenizer")
    print("tokenizer:", len(fast), "tokens")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
