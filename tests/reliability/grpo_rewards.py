"""Reward functions the GRPO process tests name by dotted path (`reward_funcs=grpo_rewards.letter_e`)."""


def letter_e(prompts, completions, **kwargs):
    """The share of a completion's characters that are the letter e."""
    return [c.count("e") / max(len(c), 1) for c in completions]


def says_the_answer(prompts, completions, answer, **kwargs):
    """1 when the completion contains the record's `answer` column, else 0."""
    return [float(a in c) for a, c in zip(answer, completions, strict=True)]


class Counter:
    """An environment (TRL's `environment_factory`): `add` is each row's tool; the target reached, its reward."""

    def reset(self, target, **row) -> str:
        self.total, self.target = 0, int(target)
        return f" Reach {target}."

    def add(self, amount: int) -> str:
        """Add an amount to the running total and return the new total.

        Args:
            amount: The amount to add.
        """
        self.total += amount
        return f"total {self.total}"

    def get_reward(self) -> float:
        return 1.0 if self.total == self.target else 0.0


def first_turn(prompts, trainer):
    """A `rollout_func` whose first turn calls `add` (with 1 or 2, by row): the tool runs, and the model
    continues after its answer (generated in process, sampled), so every row has a tool exchange to resume."""
    import json

    tok = trainer.tokenizer
    rows = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for i, p in enumerate(prompts):
        call = json.dumps({"name": "add", "arguments": {"amount": 1 + i % 2}})
        ids = tok.encode(f"<tool_call>\n{call}\n</tool_call><|im_end|>", add_special_tokens=False)
        rows["prompt_ids"].append(
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        rows["completion_ids"].append(ids)
        rows["logprobs"].append([-1.0] * len(ids))
    return rows
