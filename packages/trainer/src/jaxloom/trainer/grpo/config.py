"""`GRPOConfig`: the arguments of online RL (`GRPOTrainer`), TRL's names: every `TrainingArguments` argument
and the `rl` group (`RLArgs`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..arguments import GROUPS, TrainingArguments, SettingsGroup, check_positive, config_signature
from .pipeline import depth_of


ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class RLArgs(SettingsGroup):
    """The settings of online RL (`GRPOConfig`), TRL's names, meanings and defaults (TRL 1.16)."""

    reward_funcs: tuple[str, ...] = Field(
        (), description="GRPO: reward functions as dotted import paths (my_rewards.accuracy); Python callables too"
    )
    reward_weights: tuple[float, ...] | None = Field(None, description="GRPO: a weight per reward function (None: 1)")
    reward_timeout: float | None = Field(
        300.0, description="GRPO: seconds a reward function may take on one step's completions (None: no limit)"
    )
    num_generations: int = Field(8, description="GRPO: completions per prompt (a group)")
    max_prompt_length: int | None = Field(
        None,
        description="GRPO: prompt tokens kept (longer prompts lose their start, counted; None: all, as TRL 1.16)",
    )
    max_completion_length: int = Field(512, description="GRPO: tokens generated per completion at most")
    temperature: float = Field(1.0, description="GRPO: sampling temperature (also divides the logits in the loss)")
    top_p: float = Field(1.0, description="GRPO: nucleus sampling (1: off)")
    top_k: int = Field(0, description="GRPO: keep the k most likely tokens (0: off)")
    beta: float = Field(0.0, description="GRPO: weight of the KL to the reference (0: no reference is held)")
    epsilon: float = Field(0.2, description="GRPO: clipping of the probability ratio, 1 - epsilon below")
    epsilon_high: float | None = Field(None, description="GRPO: 1 + epsilon_high above (None: epsilon; DAPO: 0.28)")
    num_iterations: int = Field(1, description="GRPO: optimizer steps on each batch of rollouts (old log-probs kept)")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo",
        description="GRPO: the loss (TRL 1.16's eight): grpo, bnpo, dr_grpo, dapo, luspo (clipped ratio, averaged "
        "per completion, per token, per max length, per token, summed per completion), cispo (capped importance "
        "weights on log-probs), sapo (a soft gate), vespo (a gamma weight per sequence); docs/rl.md",
    )
    delta: float | None = Field(
        None, description="GRPO: the ratio capped at delta in the clipped losses (INTELLECT-2's two-sided clip)"
    )
    sapo_temperature_pos: float = Field(1.0, description="GRPO sapo: the gate's temperature where the advantage > 0")
    sapo_temperature_neg: float = Field(1.05, description="GRPO sapo: the gate's temperature where the advantage <= 0")
    vespo_k_pos: float = Field(2.0, description="GRPO vespo: the gamma weight's power for advantages >= 0")
    vespo_lambda_pos: float = Field(3.0, description="GRPO vespo: the gamma weight's decay for advantages >= 0")
    vespo_k_neg: float = Field(3.0, description="GRPO vespo: the gamma weight's power for advantages < 0")
    vespo_lambda_neg: float = Field(2.0, description="GRPO vespo: the gamma weight's decay for advantages < 0")
    vllm_importance_sampling_correction: bool = Field(
        False,
        description="GRPO: weight each token's loss by exp(old - sampler) log-prob, as TRL corrects vLLM's samples "
        "(here the in-process sampler's: bf16 sampling, staleness); off by default: the sampler is the trainer's model",
    )
    vllm_importance_sampling_mode: ISMode = Field(
        "sequence_mask", description="GRPO: the correction per token or per sequence, truncated or masked (TRL's)"
    )
    vllm_importance_sampling_clip_max: float | None = Field(
        3.0, description="GRPO: the correction's upper bound (truncate: clamp; mask: 0 above)"
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        None, description="GRPO: the correction's lower bound (truncate: clamp; mask: 0 below; None: none)"
    )
    use_bias_correction_kl: bool = Field(
        True,
        description="GRPO: the KL term weighted by the importance ratio (its gradient the unbiased reverse-KL's, "
        "DeepSeek-V3.2's; TRL's default), with beta > 0",
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        description="GRPO: drop a sequence with advantage < 0 whose mean (sampler - current) log-prob passes this "
        "(DeepSeek-V3.2's off-policy mask, TRL's; None: off)",
    )
    tools: tuple[str, ...] = Field(
        (), description="GRPO: functions the model may call, as dotted import paths (TRL's tools; Python callables too)"
    )
    max_tool_calling_iterations: int | None = Field(
        None, description="GRPO: tool turns a completion may take at most (None: while the model calls tools)"
    )
    tool_timeout: float | None = Field(
        60.0,
        description="GRPO: seconds one tool call may take before it is cut and reported as an error (None: no limit)",
    )
    tool_workers: int = Field(
        16,
        description="GRPO: threads that run a tool turn's calls, rows concurrently (a call that never returns holds "
        "one; they stay bounded)",
    )
    environment_factory: str | dict[str, str] | None = Field(
        None,
        description="GRPO: environments of the rollouts (TRL's environment_factory): a dotted path to a class or "
        "factory, or {name: path} routed by each record's `environment` field (Python callables too)",
    )
    rollout_func: str | None = Field(
        None,
        description="GRPO: a custom rollout (TRL's rollout_func(prompts, trainer) -> {prompt_ids, completion_ids, "
        "logprobs, ...}) as a dotted path (a Python callable too)",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="GRPO: the probability ratio per token, or per sequence (GSPO: exp of the mean log-ratio over "
        "the completion's tokens, TRL's formula)",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="GRPO: advantages divided by the std of the group, of the batch, or not"
    )
    mask_truncated_completions: bool = Field(
        False, description="GRPO: completions cut at max_completion_length (no EOS) take no part in the loss"
    )
    generation_backend: Literal["static", "paged"] = Field(
        "static",
        description="GRPO: the in-process sampler: static (one batch, rows compacted as they end) or paged "
        "(jaxloom.generation.LLMEngine: a paged KV cache, each completion's cost its own; one process)",
    )
    use_transformers_paged: bool = Field(
        False, description="GRPO: TRL's name for sampling with paged attention: true means generation_backend=paged"
    )
    ref_model: str | None = Field(
        None, description="GRPO: the KL reference, an HF directory (None: the initial policy; with LoRA, the base)"
    )
    max_staleness: int = Field(
        0,
        description="GRPO: optimizer steps a rollout may lag the policy it trains (TRL's AsyncGRPOConfig): 0 samples "
        "each step's rows with its own weights (synchronous); k >= 1 draws the next k steps' rollouts ahead, their "
        "rewards scored on threads while the current step trains; an older rollout is dropped, counted (docs/rl.md)",
    )
    sampling_devices: int = Field(
        0,
        description="GRPO: devices given to sampling (n / processes of each process's): the training mesh is built "
        "over the others, the policy's weights copied to them once per version; with max_staleness >= 1 a rollout is "
        "drawn there while the step trains (0: sampling on the training mesh)",
    )
    max_inflight_tasks: int = Field(
        -1,
        description="GRPO, max_staleness >= 1: completions drawn and not yet scored at most (TRL's; -1: max_staleness "
        "x total_batch_size); fewer than a step's rows is refused",
    )
    queue_maxsize: int = Field(
        1024,
        description="GRPO, max_staleness >= 1: completions held drawn and not yet trained at most (TRL's); bounds how "
        "many steps ahead rollouts are drawn",
    )
    partial_rollout_tokens: int = Field(
        0,
        description="GRPO, max_staleness >= 2: partial rollouts (AReaL's, slime's): a rollout drawn ahead draws at "
        "most this many tokens per completion under each policy version; a completion still running when the policy "
        "changes continues under the new one (re-prefilled with its weights), each token tagged with the version that "
        "drew it and corrected by its own sampler log-prob; the step before the rollout's own finishes what still "
        "runs, so it is scored while that step trains (0: off, each rollout drawn whole by one version)",
    )

    routing_replay: bool = Field(
        False,
        description="GRPO/RLOO, MoE policies: the training forward sends each token to the experts the sampler chose "
        "(recorded while decoding; the field's R3), so sampling and training route alike; off, their disagreement is "
        "measured (routing/disagreement). Needs jaxloom's own generation (static or paged)",
    )

    @field_validator("reward_funcs", "tools", mode="before")
    @classmethod
    def _one_function(cls, v):  # TRL takes one reward function as well as a list
        return (v,) if isinstance(v, str) else v

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _bool_scale(cls, v):  # TRL < 0.22 took true/false
        return {True: "group", False: "none"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="before")
    @classmethod
    def _trl_paged(cls, values):  # TRL's switch for paged sampling names jaxloom's paged engine
        if isinstance(values, dict) and values.get("use_transformers_paged"):
            if values.get("generation_backend", "paged") != "paged":
                given = values["generation_backend"]
                raise ValueError(f"use_transformers_paged = true with generation_backend = {given!r}; give one")
            values = {**values, "generation_backend": "paged"}
        return values

    @model_validator(mode="after")
    def _check(self):
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations = {self.num_generations}; expected at least 2 (advantages compare completions "
                "of one prompt)"
            )
        check_positive(self, "max_completion_length", "num_iterations", "epsilon", "tool_workers")
        check_positive(
            self, "max_prompt_length", "reward_timeout", "max_tool_calling_iterations", "tool_timeout", allow_none=True
        )
        check_positive(self, "temperature", "beta", allow_zero=True)
        check_positive(self, "sapo_temperature_pos", "sapo_temperature_neg")
        check_positive(self, "max_staleness", "sampling_devices", "partial_rollout_tokens", allow_zero=True)
        if self.partial_rollout_tokens and not self.max_staleness:
            raise ValueError(
                f"partial_rollout_tokens = {self.partial_rollout_tokens} with max_staleness = 0: a synchronous rollout "
                "is drawn whole by the weights it trains; expected max_staleness >= 2 (or partial_rollout_tokens = 0)"
            )
        if self.partial_rollout_tokens and self.partial_rollout_tokens >= self.max_completion_length:
            raise ValueError(
                f"partial_rollout_tokens = {self.partial_rollout_tokens} with max_completion_length = "
                f"{self.max_completion_length}: every completion would end under one version; expected fewer tokens "
                "per version than max_completion_length (or 0: off)"
            )
        check_positive(self, "queue_maxsize")
        if self.max_inflight_tasks != -1 and self.max_inflight_tasks < 1:
            raise ValueError(f"max_inflight_tasks = {self.max_inflight_tasks}; expected -1 (auto) or at least 1")
        check_positive(self, "delta", allow_none=True)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}; expected a value in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}; expected >= 0 (0: off)")
        if self.reward_weights is not None and self.reward_funcs and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward_funcs; "
                "expected one weight per function"
            )
        return self


def completion_rows(kwargs: dict[str, Any], group: type, kind: str) -> dict[str, Any]:
    """The arguments `kwargs` of a kind whose rows are a prompt and a generated completion (GRPO, distillation;
    `group` holds its `max_prompt_length` and `max_completion_length`) with `max_sequence_length` set from those two
    (an other value given is refused) and `packing` off."""
    kwargs = dict(kwargs)
    prompt = kwargs.get("max_prompt_length", group.model_fields["max_prompt_length"].default)
    completion = kwargs.get("max_completion_length", group.model_fields["max_completion_length"].default)
    if isinstance(prompt, int | None) and isinstance(completion, int):
        length = (prompt or 0) + completion
        given = kwargs.get("max_sequence_length")
        if given is not None and given != length:
            what = (
                f"max_prompt_length + max_completion_length ({length}); set those two"
                if prompt is not None
                else f"max_completion_length ({length}) with no max_prompt_length, each prompt's own length "
                "added; set max_prompt_length to cut prompts"
            )
            raise ValueError(f"max_sequence_length = {given}: with {kind} it is {what}")
        kwargs["max_sequence_length"] = length
    if kwargs.setdefault("packing", False):
        raise ValueError(f"packing = true: a {kind} row holds one prompt and its completion; set packing=false")
    return kwargs


class GRPOConfig(TrainingArguments):
    """The arguments of `GRPOTrainer`: every `TrainingArguments` argument and the `rl` group (TRL's names):
    `reward_funcs`, `reward_weights`, `num_generations`, `max_prompt_length`, `max_completion_length`,
    `temperature`, `top_p`, `top_k`, `beta`, `epsilon`, `epsilon_high`, `delta`, `num_iterations`, `loss_type` (TRL
    1.16's eight) with `sapo_temperature_pos`, `sapo_temperature_neg`, `vespo_k_pos`, `vespo_k_neg`,
    `vespo_lambda_pos` and `vespo_lambda_neg`, the sampler's corrections (`vllm_importance_sampling_correction`,
    `vllm_importance_sampling_mode`, `vllm_importance_sampling_clip_max`, `vllm_importance_sampling_clip_min`,
    `off_policy_mask_threshold`: TRL's, applied to jaxloom's own sampler), `use_bias_correction_kl`, `scale_rewards`,
    `mask_truncated_completions`, `ref_model`, `importance_sampling_level` (GSPO), `use_transformers_paged` (or
    jaxloom's `generation_backend="paged"`: rollouts through the paged `LLMEngine`), `tools` and
    `max_tool_calling_iterations` (tool calls in the rollouts), `environment_factory` and `rollout_func` (dotted paths
    here; `GRPOTrainer` also takes the objects), and jaxloom's `reward_timeout` (seconds a reward
    function may take on a step's completions before the run stops naming it), `tool_timeout` (seconds a tool turn's
    calls may take) and `tool_workers` (the threads that run them, rows concurrently); asynchronous rollouts with
    TRL's `AsyncGRPOConfig` names: `max_staleness` (0: synchronous; k: the next k steps' rollouts drawn ahead and
    scored on threads while a step trains), `max_inflight_tasks` and `queue_maxsize`; partial rollouts,
    `partial_rollout_tokens` (a completion drawn ahead continues under each new policy version); jaxloom's
    `sampling_devices`
    (devices given to sampling, the training mesh built over the rest; docs/rl.md); MoE routing replay,
    `routing_replay` (an MoE policy's training forward sends each token to the experts its sampler chose). A step
    trains on
    `total_batch_size` completions: `total_batch_size / num_generations` prompts, each completed `num_generations`
    times. A step's rows are as wide as its longest prompt and its longest completion, each rounded up to a bucket
    (`jaxloom.trainer.grpo.drawing.row_buckets`), not as the caps: `max_sequence_length` is the widest row the caps
    allow, `max_prompt_length + max_completion_length`, or with no `max_prompt_length` (TRL 1.16: prompts are never
    cut) `max_completion_length`, the prompts' own lengths being added from the data and checked against the model's
    positions before step 1. `packing` is off.

        GRPOConfig(num_generations=8, max_completion_length=128, learning_rate=1e-6, reward_funcs=["m.acc"])
    """

    GROUPS = {**GROUPS, "rl": RLArgs}

    def __init__(self, **kwargs: Any):
        super().__init__(**completion_rows(kwargs, RLArgs, type(self).__name__.removesuffix("Config")))
        rows, group = self.total_batch_size, self.rl.num_generations
        if rows % group:
            raise ValueError(
                f"total_batch_size = {rows} is not a multiple of num_generations = {group}; expected whole groups "
                f"(a step trains on total_batch_size completions: total_batch_size / num_generations prompts)"
            )
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps = {self.gradient_accumulation_steps}: GRPO rolls out one batch a step "
                "here; expected 1 (raise total_batch_size instead)"
            )
        self.check_asynchronous(rows)

    def check_asynchronous(self, rows: int) -> None:
        """`max_staleness >= 1`: one rollout (`rows` completions) fits `queue_maxsize` and `max_inflight_tasks`, and
        a rollout trains one step (`num_iterations = 1`)."""
        rl = self.rl
        if not rl.max_staleness:
            return
        if rl.partial_rollout_tokens and depth_of(rl, rows) < 2:
            raise ValueError(
                f"partial_rollout_tokens = {rl.partial_rollout_tokens} with rollouts drawn {depth_of(rl, rows)} step "
                f"ahead (max_staleness = {rl.max_staleness}, queue_maxsize = {rl.queue_maxsize}, max_inflight_tasks = "
                f"{rl.max_inflight_tasks}, {rows} completions a step): a rollout is finished the step before its own, "
                "so it is scored while that step trains; expected max_staleness >= 2 (and room for 2 steps' "
                "completions), its parts then drawn under 2 versions or more"
            )
        if rl.num_iterations > 1:
            raise ValueError(
                f"num_iterations = {rl.num_iterations} with max_staleness = {rl.max_staleness}: an asynchronous "
                "rollout trains one step; expected num_iterations = 1 (or max_staleness = 0)"
            )
        for name in ("queue_maxsize", "max_inflight_tasks"):
            value = getattr(rl, name)
            if value != -1 and value < rows:
                raise ValueError(
                    f"{name} = {value} with max_staleness = {rl.max_staleness}: a step's rollout is total_batch_size "
                    f"= {rows} completions; expected at least {rows} (or max_staleness = 0)"
                )


GRPOConfig.__signature__ = config_signature(GRPOConfig.GROUPS)  # type: ignore[attr-defined]
