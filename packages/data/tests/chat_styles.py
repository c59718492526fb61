"""Tokenizers with the chat formats of the families jaxloom loads, for tests: the bundled tokenizer with the
family's turn tokens added and a template of our own writing in that family's format. `gemma`: turns between
`<start_of_turn>` / `<end_of_turn>`, the assistant named `model`, no system role. `chatml` (Qwen2.5):
`<|im_start|>` / `<|im_end|>` with a default system prompt. `qwen3`: ChatML where the assistant turn after
the last user message opens with an empty `<think>` block and earlier ones do not (so a conversation's prefix is
not rendered as a prefix of the whole)."""

from __future__ import annotations

from pathlib import Path

import jaxloom.data as jd

TEMPLATES = {
    "gemma": (
        "{{ bos_token }}{%- for m in messages %}"
        "{%- if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
        "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
    ),
    "chatml": (
        "{%- if messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    "chatml_tools": (  # Qwen2.5's: the tool schemas in the system turn, as JSON lines inside <tools></tools>
        "{%- if tools %}{{ '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n\\n<tools>' }}"
        "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{%- endfor %}{{ '\\n</tools><|im_end|>\\n' }}"
        "{%- else %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    "qwen3": (
        "{%- set ns = namespace(last=-1) %}"
        "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}"
        "{%- endfor %}{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant\\n' }}{%- if loop.index0 > ns.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
        "{{ m['content'] + '<|im_end|>\\n' }}"
        "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
}
TURN_TOKENS = {
    "gemma": ["<start_of_turn>", "<end_of_turn>"],
    "chatml": ["<|im_start|>", "<|im_end|>"],
    "qwen3": ["<|im_start|>", "<|im_end|>"],
    "chatml_tools": ["<|im_start|>", "<|im_end|>"],
}
END_OF_TURN = {"gemma": "<end_of_turn>", "chatml": "<|im_end|>", "qwen3": "<|im_end|>", "chatml_tools": "<|im_end|>"}


def chat_tokenizer(style: str, directory: Path | None = None):
    """The bundled tokenizer in `style`'s chat format (saved into `directory` when given, for a model dir)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(jd.bundled_tokenizer_path()))
    tok.add_special_tokens({"additional_special_tokens": TURN_TOKENS[style]})
    if style == "qwen3":
        tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = TEMPLATES[style]
    if directory is not None:
        tok.save_pretrained(str(directory))
    return tok
