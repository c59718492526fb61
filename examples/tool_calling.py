"""Tool calling learned from the reward alone: GRPO with an environment whose method is the model's tool.

A `Server` environment exposes one tool, `ping()`, and owns the reward (`get_reward`: 1 when the rollout pinged it
and the call came back). A tiny chat model first learns the chat format, tool calls included, from made-up chats in
which the assistant calls `ping` only now and then (one answer in five); GRPO then trains it on the reward alone —
no reward function, no labels — and the share of completions that make a well-formed call rises step by step (the
curve is printed: TRL's `tools/call_frequency` and `tools/failure_frequency`, and the reward). At the default 32
completion tokens the 23-token call nearly fills a completion, so the tool runs (the reward reads the environment's
state) but its turn is not appended (TRL's rule: no room for it and a reply); with `--max-completion-length 64` the
tool turn (`<tool_response>pong</tool_response>`) and the model's reply follow, the tool turn read but never trained
on.

The chat template is a Qwen2.5-style one (`<tool_call>` JSON calls, `<tool_response>` turns) written here so the
example needs nothing but jaxloom; with a Qwen2.5/Qwen3 or Llama 3.1 tokenizer its own template is used as it is.

    python examples/tool_calling.py --out runs/tools                      # a few minutes on CPU
    python examples/tool_calling.py --out /tmp/tools --tiny               # a minute or two (what the test runs)
"""

from __future__ import annotations

import argparse
import random

import jaxloom.data as jd
import jaxloom.models as jm
from jaxloom.trainer import GRPOConfig, GRPOTrainer, Trainer, TrainingArguments

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTIONS = ["Is the server up?", "Check the server.", "Can you reach the host?", "Is it online?", "Ping it."]
ANSWERS = ["I cannot tell.", "Maybe.", "It should be fine.", "No idea.", "Try again later."]


class Server:
    """A server to check: `ping` is the model's tool; the reward is having pinged it."""

    def __init__(self):
        self.pinged = False

    def reset(self, **row) -> None:
        self.pinged = False

    def ping(self) -> str:
        """Check that the server answers."""
        self.pinged = True
        return "pong"

    def get_reward(self) -> float:
        return float(self.pinged)


def chat_tokenizer():
    """The bundled tokenizer with chat and tool tokens and `TEMPLATE`."""
    tok = jd.load_processor()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"})
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.chat_template = TEMPLATE
    return tok


def prior_chats(tok, n: int, call_rate: float, seed: int) -> list[dict]:
    """Chats with the tool's schema in the prompt where the assistant calls `ping` in `call_rate` of them (then reads
    `pong` and says so) and answers without it otherwise: what the model may imitate before RL."""
    from transformers.utils import get_json_schema

    rng, schema, out = random.Random(seed), [get_json_schema(Server.ping)], []
    call = [{"type": "function", "function": {"name": "ping", "arguments": {}}}]
    for _ in range(n):
        user = {"role": "user", "content": rng.choice(QUESTIONS)}
        if rng.random() < call_rate:
            turns = [
                {"role": "assistant", "content": "", "tool_calls": call},
                {"role": "tool", "name": "ping", "content": "pong"},
                {"role": "assistant", "content": "It answered."},
            ]
        else:
            turns = [{"role": "assistant", "content": rng.choice(ANSWERS)}]
        out.append({"text": tok.apply_chat_template([user, *turns], tools=schema, tokenize=False)})
    return out


def llama(vocab: int, width: int, sizes: dict | None = None) -> jm.LlamaConfig:
    """A Llama of `width` (or of `sizes`: the benchmark's 8.4M model) over the tokenizer's `vocab`."""
    base = dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)  # fmt: skip
    return jm.LlamaConfig(**{**base, **(sizes or {}), "vocab_size": vocab, "max_position_embeddings": 256})


def main(argv: list[str] | None = None, sizes: dict | None = None) -> dict:
    p = argparse.ArgumentParser(description="Learn to call a tool from an environment's reward alone.")
    p.add_argument("--out", default="runs/tools")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default 12 with --tiny, else 40)")
    p.add_argument(
        "--prior-steps", type=int, default=None, help="steps of the prior (default 150 with --tiny, else 300)"
    )
    p.add_argument(
        "--max-completion-length", type=int, default=32, help="tokens a completion may hold, tool turns included"
    )
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)
    steps = a.steps or (12 if a.tiny else 40)

    tok = chat_tokenizer()
    prior_steps = a.prior_steps or (150 if a.tiny else 300)
    prior = Trainer(
        TrainingArguments(
            max_sequence_length=128,
            total_batch_size=16,
            max_training_steps=prior_steps,
            learning_rate=3e-3,
            warmup_steps=5,
            save_directory=f"{a.out}/prior",
            progress_bar=False,
            generation_prompts=[],
            seed=0,
        ),
        model=jm.create_model(llama(len(tok), 64 if a.tiny else 128, sizes), seed=0),
        dataset_train=prior_chats(tok, 2000, call_rate=0.2, seed=0),
        processing_class=tok,
    ).train()
    print(f"prior: {prior_steps} steps on chats that call the tool one time in five, loss {prior.metrics['loss']:.3f}")

    prompts = [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS * 8]
    run = GRPOTrainer(
        GRPOConfig(
            num_generations=8,
            total_batch_size=16,
            max_completion_length=a.max_completion_length,
            max_tool_calling_iterations=1,
            temperature=0.5,  # sharper samples: a 23-token JSON call from a tiny model is rarely intact at 1.0
            learning_rate=5e-4,
            warmup_steps=0,
            beta=0.0,
            max_training_steps=steps,
            logging_steps=1,
            save_directory=f"{a.out}/grpo",
            save_steps=steps,
            progress_bar=False,
            seed=0,
        ),
        model=prior.state.model,
        dataset_train=prompts,
        processing_class=tok,
        environment_factory=Server,  # no reward_funcs: Server.get_reward is the reward
    )
    out = run.train()
    rows = [r for r in run.step_log.history if "train/tools/call_frequency" in r]
    keys = ("tools/call_frequency", "tools/failure_frequency", "rewards/Server/mean")
    curve = [(r["step"], *(r[f"train/{k}"] for k in keys)) for r in rows]
    print("step  calls per completion  failed calls  reward (a well-formed call ran)")
    for step, calls, failed, reward in curve:
        print(f"{step:4d}  {calls:20.3f}  {failed:12.3f}  {reward:6.3f}")
    first, last = curve[0][3], sum(c[3] for c in curve[-3:]) / 3
    print(f"reward (completions whose call ran): {first:.3f} at step 1, {last:.3f} over the last 3 steps")
    return {"first": first, "last": last, "metrics": out.metrics, "history": rows}


if __name__ == "__main__":
    main()
