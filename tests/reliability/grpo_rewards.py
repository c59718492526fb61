"""Reward functions the GRPO process tests name by dotted path (`reward_funcs=grpo_rewards.letter_e`)."""


def letter_e(prompts, completions, **kwargs):
    """The share of a completion's characters that are the letter e."""
    return [c.count("e") / max(len(c), 1) for c in completions]


def says_the_answer(prompts, completions, answer, **kwargs):
    """1 when the completion contains the record's `answer` column, else 0."""
    return [float(a in c) for a, c in zip(answer, completions, strict=True)]
