"""TRL's keys that are not jaxloom's own names: each answered, never a bare "unknown argument".

A TRL 1.16 config (`SFTConfig`, `DPOConfig`, `RewardConfig`, `GRPOConfig`, `RLOOConfig`, `KTOConfig`,
`DistillationConfig`, and the `transformers.TrainingArguments` keys they inherit) given to jaxloom's matching
class runs unchanged or is refused by name, before step 1. A key here is one of:

- honoured under jaxloom's name (`Answer.to`: the value becomes jaxloom's settings — `bf16=True` is
  `dtype=bfloat16`, `report_to=["wandb"]` turns W&B on, `gradient_checkpointing=True` is `remat=full`);
- accepted at the values that describe what jaxloom does anyway (`Answer.ok`: TRL's default, mostly — a
  torch-only switch left off, a Hub push not asked for), and refused at any other value, with what jaxloom does
  instead (`Answer.why`).

`docs/migration.md` holds the table of every key of those configs, generated from TRL's dataclasses by
`tools/trl_keys_table.py`; a test fails when a key is neither jaxloom's, an alias, nor answered here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["TRL_KEYS", "Answer", "answered"]


@dataclasses.dataclass(frozen=True)
class Answer:
    """How jaxloom answers a TRL key: `to(value) -> {jaxloom key: value}` when it is honoured (raising ValueError at a
    value it cannot honour), else the values it accepts as they are (`ok`) and, for any other, `why`."""

    why: str
    ok: tuple[Any, ...] = ()
    to: Callable[[Any], dict[str, Any]] | None = None


def _same(a: Any, b: Any) -> bool:
    """`a` and `b` are the same setting: booleans and None only as themselves, numbers by value, lists as tuples."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return list(a) == list(b)
    if type(a) is type(b) or (isinstance(a, int | float) and isinstance(b, int | float)):
        return bool(a == b)
    return False


def _refuse(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{key} = {value!r}: {why}")


# ---- honoured: TRL's value as jaxloom's settings ---------------------------------------------------------
def _bf16(value: Any) -> dict[str, Any]:
    if value is None:  # TRL: bf16 where the device has it; jaxloom computes in the model's dtype
        return {}
    return {"dtype": "bfloat16"} if value else {"dtype": "float32"}


def _fp16(value: Any) -> dict[str, Any]:
    if value:
        raise _refuse(
            "fp16", value, "float16 training needs loss scaling, which jaxloom does not do; expected bf16=true "
            "(dtype=bfloat16) or fp16=false"
        )  # fmt: skip
    return {}


def _remat(key: str) -> Callable[[Any], dict[str, Any]]:
    def to(value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, bool):
            raise _refuse(key, value, "expected true (remat=full: each layer recomputed in the backward pass) or false")
        return {"remat": "full" if value else "none"}

    return to


def _report_to(value: Any) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    if names in (["all"],):
        return {"use_tensorboard": True, "use_wandb": True}
    unknown = [n for n in names if n not in ("none", "tensorboard", "wandb")]
    if unknown:
        raise _refuse(
            "report_to", value, f"jaxloom writes TensorBoard events and W&B runs, not {unknown}; expected "
            "'tensorboard', 'wandb', 'all' or 'none'"
        )  # fmt: skip
    return {"use_tensorboard": "tensorboard" in names, "use_wandb": "wandb" in names}


_OPTIMIZERS = {"adamw": "adamw", "adafactor": "adafactor", "lion": "lion", "sgd": "sgd"}


def _optim(value: Any) -> dict[str, Any]:
    name = str(value).lower()
    for prefix, optimizer in _OPTIMIZERS.items():
        if name.startswith(prefix) and "8bit" not in name and "paged" not in name and "anyprecision" not in name:
            return {"optimizer": optimizer}
    raise _refuse(
        "optim", value, "jaxloom's optimizers are optax's adamw, adafactor, lion and sgd (TRL's adamw_torch*, "
        "adafactor, lion_32bit and sgd map to them; 8-bit and paged optimizers are bitsandbytes' and CUDA's)"
    )  # fmt: skip


def _disable_tqdm(value: Any) -> dict[str, Any]:
    return {} if value is None else {"progress_bar": not value}


def _sampling(value: Any) -> dict[str, Any]:
    if value not in ("random", "sequential"):
        raise _refuse(
            "train_sampling_strategy", value, "jaxloom reads records shuffled ('random') or in order "
            "('sequential'); group_by_length is not done (rows are packed or padded to one width)"
        )  # fmt: skip
    return {"shuffle_train_dataset": value == "random"}


def _shuffle(value: Any) -> dict[str, Any]:
    return {"shuffle_train_dataset": bool(value)}


def _resume(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if value is True:
        return {"resume_if_possible": True}
    raise _refuse(
        "resume_from_checkpoint", value, "jaxloom resumes the newest checkpoint of save_directory "
        "(resume_if_possible=true, the default); to start from another run's weights, model.from_pretrained=RUN_DIR"
    )  # fmt: skip


def _max_length(value: Any) -> dict[str, Any]:
    if value is None:
        raise _refuse("max_length", value, "rows have one width: expected a number of tokens (max_sequence_length)")
    return {"max_sequence_length": value}


def _renamed(name: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {name: value}


# ---- the table ---------------------------------------------------------------------------------------------
_TORCH = "jaxloom runs on JAX: every step is compiled by XLA (jit); there is no torch model or kernel to switch"
_DISTRIBUTED = (
    "jaxloom shards with its device mesh (mesh_shape, data/fsdp/tensor axes) and joins processes with "
    "jax.distributed or `--ray`; torch's DDP/FSDP/DeepSpeed settings have no meaning there"
)
_LOADER = (
    "records stream through jaxloom's loader (a prefetch thread, an exactly resumable position): prefetch and "
    "shuffle_buffer_size are its settings"
)
_HUB = (
    "nothing leaves this machine during a run: `jaxloom convert --to-hf RUN OUT` writes a transformers directory, "
    "which `huggingface-cli upload` pushes"
)
_TRACKING = "jaxloom logs to metrics.jsonl, TensorBoard (use_tensorboard) and W&B (use_wandb); not to trackio"
_HF_EVAL = (
    "jaxloom evaluates every evaluation_steps on eval_batches batches (`jaxloom eval RUN` after training), "
    "keeping losses and TRL's metrics; HF's prediction loop settings do not apply"
)
_HF_LOGS = "jaxloom logs with Python's logging on process 0 (each process's own with JAXLOOM_LOG_EVERY_PROCESS=1)"
_CHECKPOINT = (
    "a jaxloom checkpoint holds the model, the optimizer state and the data position for an exact resume, "
    "written by process 0's orbax manager; `jaxloom convert` exports the model alone"
)
_DATASET = (
    "jaxloom tokenizes records as they stream (prompt/completion, messages, text, pre-tokenized input_ids); "
    "datasets.map's settings do not apply"
)
_SAMPLER = (
    "jaxloom samples rollouts with its own engine (generation_backend: static or paged, in process, on the "
    "training mesh); there is no vLLM server or colocated vLLM"
)
_NOT_IMPLEMENTED = "not implemented in jaxloom (docs/migration.md lists what is)"
_REF_SYNC = "the reference is frozen (TR-DPO's reference syncing is not implemented)"

TRL_KEYS: dict[str, Answer] = {
    # honoured: the same setting under jaxloom's name
    "bf16": Answer("bf16=true is dtype=bfloat16, false dtype=float32", to=_bf16),
    "fp16": Answer("float16 training needs loss scaling, which jaxloom does not do", ok=(False, None), to=_fp16),
    "gradient_checkpointing": Answer("true is remat=full, false remat=none", to=_remat("gradient_checkpointing")),
    "activation_checkpointing": Answer("true is remat=full, false remat=none", to=_remat("activation_checkpointing")),
    "report_to": Answer("tensorboard → use_tensorboard, wandb → use_wandb, none → neither", to=_report_to),
    "optim": Answer("adamw_torch*/adamw_hf → optimizer=adamw; adafactor, lion, sgd likewise", to=_optim),
    "disable_tqdm": Answer("true is progress_bar=false", to=_disable_tqdm),
    "train_sampling_strategy": Answer("random/sequential is shuffle_train_dataset=true/false", to=_sampling),
    "shuffle_dataset": Answer("shuffle_train_dataset", to=_shuffle),
    "resume_from_checkpoint": Answer("true is resume_if_possible=true", to=_resume),
    "max_length": Answer("max_sequence_length", to=_max_length),
    # what jaxloom does anyway, at TRL's default (or at either value)
    "full_determinism": Answer("jaxloom's runs are deterministic and resume bitwise", ok=(False, True)),
    "do_train": Answer("not read by HF's Trainer either", ok=(False, True)),
    "do_eval": Answer("not read by HF's Trainer either", ok=(False, True)),
    "do_predict": Answer("not read by HF's Trainer either", ok=(False, True)),
    "include_num_input_tokens_seen": Answer(
        "jaxloom logs tokens_seen every step", ok=("no", "all", "non_padding", True, False)
    ),
    "skip_memory_metrics": Answer("jaxloom logs host_peak_rss_gb; device memory is `jaxloom plan`'s", ok=(True,)),
    "average_tokens_across_devices": Answer(
        "jaxloom's loss is averaged over the tokens of every device and micro-batch", ok=(True,)
    ),
    "disable_dropout": Answer("jaxloom's models have no dropout (LoRA's lora_dropout aside)", ok=(True, False)),
    "gradient_checkpointing_kwargs": Answer(
        "remat names the policy (full, dots_saveable, ...); torch's checkpoint options do not apply", ok=(None, {})
    ),
    "activation_checkpointing_kwargs": Answer("remat names the policy (full, dots_saveable, ...)", ok=(None, {})),
    "max_tool_calling_iterations": Answer("distillation's rollouts call no tools", ok=(None,)),
    "remove_unused_columns": Answer(
        "jaxloom reads the columns it needs and names the others once; GRPO's reward functions get every column",
        ok=(True, False),
    ),
    "dataset_text_field": Answer(
        "jaxloom reads a 'text' column (or messages, or prompt + completion): rename the field", ok=("text",)
    ),
    "ignore_data_skip": Answer("a resume restores the data position exactly; nothing is skipped over", ok=(False,)),
    "save_strategy": Answer(
        "jaxloom saves every save_steps steps and at the end (save_steps=null: the end)", ok=("steps",)
    ),
    "logging_strategy": Answer("jaxloom logs every logging_steps steps", ok=("steps",)),
    "eval_strategy": Answer("jaxloom evaluates every evaluation_steps steps (null: never)", ok=("no", "steps")),
    "logging_first_step": Answer("step 1 is logged when logging_steps divides it (logging_steps=1)", ok=(False,)),
    "logging_nan_inf_filter": Answer(
        "a non-finite loss is logged as it is and skip_nonfinite keeps the old weights", ok=(True,)
    ),
    "save_only_model": Answer(_CHECKPOINT, ok=(False,)),
    "save_on_each_node": Answer(_CHECKPOINT, ok=(False,)),
    "restore_callback_states_from_checkpoint": Answer(
        "callbacks own their state; jaxloom's checkpoints restore the run, not callbacks", ok=(False,)
    ),
    "data_seed": Answer("the data order follows seed (exactly resumable)", ok=(None,)),
    "auto_find_batch_size": Answer(
        "`jaxloom plan` says before step 1 what a step needs and refuses one that cannot fit", ok=(False,)
    ),
    "label_smoothing_factor": Answer("label smoothing of the next-token loss is " + _NOT_IMPLEMENTED, ok=(0.0,)),
    "neftune_noise_alpha": Answer("NEFTune noise is " + _NOT_IMPLEMENTED, ok=(None,)),
    "lr_scheduler_kwargs": Answer("scheduler, warmup_steps and min_lr_ratio set the schedule", ok=(None, {})),
    "optim_args": Answer("the optimizer's settings are jaxloom's own keys (adam_beta1, weight_decay, ...)", ok=(None,)),
    "optim_target_modules": Answer("GaLore-style optimizers are " + _NOT_IMPLEMENTED, ok=(None,)),
    "use_cpu": Answer("the platform is JAX's: JAX_PLATFORMS=cpu runs on the CPU", ok=(False,)),
    "tf32": Answer(
        "matmul precision is XLA's (jax_default_matmul_precision=tensorfloat32 on NVIDIA GPUs)", ok=(None, False)
    ),
    "use_cache": Answer("training needs no KV cache; the generation engines keep their own", ok=(False, True)),
    "cast_lm_head_to_fp32": Answer("the output layer runs in the compute dtype, the loss in float32", ok=(False,)),
    "trust_remote_code": Answer("jaxloom runs its own model implementations; no Hub code is run", ok=(False,)),
    "model_init_kwargs": Answer("model.KEY=VALUE overrides a model directory's config", ok=(None,)),
    "teacher_model_init_kwargs": Answer("the teacher is read as its directory says", ok=(None,)),
    "teacher_model_revision": Answer("the teacher is a local directory; nothing is downloaded", ok=(None,)),
    "router_aux_loss_coef": Answer(
        "the model config's router_aux_loss_coef is read: model.router_aux_loss_coef=V sets it", ok=(None,)
    ),
    "chat_template_path": Answer("data.tokenizer=DIR (its template) chooses the chat template", ok=(None,)),
    "chat_template_kwargs": Answer("a record's chat_template_kwargs column is passed to the template", ok=(None,)),
    "pad_token": Answer("the tokenizer's own (jaxloom.data.load_processor adds one where it lacks it)", ok=(None,)),
    "eos_token": Answer("the tokenizer's own", ok=(None,)),
    "pad_to_multiple_of": Answer("rows have one width (max_sequence_length): nothing to pad to", ok=("auto", None)),
    "padding_free": Answer("packing=true packs without padding (segment ids keep documents apart)", ok=(False,)),
    "eval_packing": Answer("evaluation rows are packed as training's", ok=(None,)),
    "packing_strategy": Answer(
        "packing=true fills rows in order, splitting documents at the row's end (TRL's 'wrapped'); with packing "
        "off the strategy is not read",
        ok=("bfd", "wrapped"),
    ),  # fmt: skip
    "dataset_num_proc": Answer(_DATASET, ok=(None,)),
    "dataset_kwargs": Answer(_DATASET, ok=(None,)),
    "loss_type": Answer(
        "SFT's loss is the next-token cross-entropy (TRL's 'nll'); 'dft' is " + _NOT_IMPLEMENTED, ok=("nll",)
    ),  # fmt: skip
    "activation_offloading": Answer(
        "activation offloading is " + _NOT_IMPLEMENTED + "; remat trades compute", ok=(False,)
    ),
    "loss_weights": Answer("DPO's combined losses are " + _NOT_IMPLEMENTED, ok=(None,)),
    "use_weighting": Answer("WPO's weighting is " + _NOT_IMPLEMENTED, ok=(False,)),
    "ld_alpha": Answer("LD-DPO's length weighting is " + _NOT_IMPLEMENTED, ok=(None,)),
    "discopop_tau": Answer("loss_type discopop is " + _NOT_IMPLEMENTED + "; its tau is not read", ok=(0.05,)),
    "f_divergence_type": Answer("DPO's f-divergences are " + _NOT_IMPLEMENTED, ok=("reverse_kl",)),
    "f_alpha_divergence_coef": Answer("DPO's f-divergences are " + _NOT_IMPLEMENTED, ok=(0.5,)),
    "precompute_ref_batch_size": Answer("the reference's log-probs are computed in training's batches", ok=(None,)),
    "sync_ref_model": Answer(_REF_SYNC, ok=(False,)),
    "ref_model_mixup_alpha": Answer(_REF_SYNC, ok=(0.6,)),
    "ref_model_sync_steps": Answer(_REF_SYNC, ok=(512,)),
    "label_names": Answer(_HF_EVAL, ok=(None,)),
    "length_column_name": Answer("group_by_length is not done", ok=("length",)),
    "include_for_metrics": Answer(_HF_EVAL, ok=([],)),
    "batch_eval_metrics": Answer(_HF_EVAL, ok=(False,)),
    "prediction_loss_only": Answer(_HF_EVAL, ok=(False,)),
    "eval_accumulation_steps": Answer(_HF_EVAL, ok=(None,)),
    "eval_delay": Answer(_HF_EVAL, ok=(0, 0.0)),
    "eval_do_concat_batches": Answer(_HF_EVAL, ok=(True,)),
    "eval_use_gather_object": Answer(_HF_EVAL, ok=(False,)),
    "eval_on_start": Answer(_HF_EVAL, ok=(False,)),
    "load_best_model_at_end": Answer(_HF_EVAL + "; the last checkpoint is the run's", ok=(False,)),
    "metric_for_best_model": Answer(_HF_EVAL, ok=(None,)),
    "greater_is_better": Answer(_HF_EVAL, ok=(None,)),
    "bf16_full_eval": Answer("evaluation runs in the training dtype", ok=(False,)),
    "fp16_full_eval": Answer("evaluation runs in the training dtype", ok=(False,)),
    "log_level": Answer(_HF_LOGS, ok=("passive",)),
    "log_level_replica": Answer(_HF_LOGS, ok=("warning",)),
    "log_on_each_node": Answer(_HF_LOGS, ok=(True,)),
    "debug": Answer(_TORCH, ok=("", [], None)),
    "torch_compile": Answer(_TORCH, ok=(False,)),
    "torch_compile_backend": Answer(_TORCH, ok=(None,)),
    "torch_compile_mode": Answer(_TORCH, ok=(None,)),
    "torch_empty_cache_steps": Answer(_TORCH, ok=(None,)),
    "enable_jit_checkpoint": Answer(_TORCH, ok=(False,)),
    "use_liger_kernel": Answer(
        "the output layer and loss are fused by jaxloom's own kernel (loss_block_size)", ok=(False,)
    ),  # fmt: skip
    "liger_kernel_config": Answer("the output layer and loss are fused by loss_block_size", ok=(None,)),
    "accelerator_config": Answer(_DISTRIBUTED, ok=(None,)),
    "parallelism_config": Answer(_DISTRIBUTED, ok=(None,)),
    "deepspeed": Answer(_DISTRIBUTED, ok=(None,)),
    "fsdp": Answer(_DISTRIBUTED, ok=(None, "", [], False)),
    "fsdp_config": Answer(_DISTRIBUTED, ok=(None,)),
    "local_rank": Answer(_DISTRIBUTED, ok=(-1,)),
    "ddp_backend": Answer(_DISTRIBUTED, ok=(None,)),
    "ddp_timeout": Answer(_DISTRIBUTED, ok=(1800,)),
    "ddp_broadcast_buffers": Answer(_DISTRIBUTED, ok=(None,)),
    "ddp_bucket_cap_mb": Answer(_DISTRIBUTED, ok=(None,)),
    "ddp_find_unused_parameters": Answer(_DISTRIBUTED, ok=(None,)),
    "ddp_static_graph": Answer(_DISTRIBUTED, ok=(None,)),
    "ds3_gather_for_generation": Answer(_DISTRIBUTED, ok=(True,)),
    "dataloader_num_workers": Answer(_LOADER, ok=(0,)),
    "dataloader_pin_memory": Answer(_LOADER, ok=(True,)),
    "dataloader_persistent_workers": Answer(_LOADER, ok=(False,)),
    "dataloader_prefetch_factor": Answer(_LOADER, ok=(None,)),
    "dataloader_multiprocessing_context": Answer(_LOADER, ok=(None,)),
    "dataloader_drop_last": Answer(_LOADER + "; the last batch is padded, its padding rows weigh nothing", ok=(False,)),
    "dataloader_in_order": Answer(_LOADER, ok=(True,)),
    "push_to_hub": Answer(_HUB, ok=(False,)),
    "hub_model_id": Answer(_HUB, ok=(None,)),
    "hub_strategy": Answer(_HUB, ok=("every_save",)),
    "hub_token": Answer(_HUB, ok=(None,)),
    "hub_private_repo": Answer(_HUB, ok=(None,)),
    "hub_always_push": Answer(_HUB, ok=(False,)),
    "hub_revision": Answer(_HUB, ok=(None,)),
    "log_completions_hub_repo": Answer(_HUB, ok=(None,)),
    "project": Answer(_TRACKING, ok=("huggingface",)),
    "run_name": Answer(_TRACKING, ok=(None,)),
    "trackio_space_id": Answer(_TRACKING, ok=(None, "trackio")),
    "trackio_static_space_id": Answer(_TRACKING, ok=(None,)),
    "trackio_bucket_id": Answer(_TRACKING, ok=(None,)),
    # online RL: jaxloom's own sampler
    "use_vllm": Answer(_SAMPLER, ok=(False,)),
    "vllm_mode": Answer(_SAMPLER, ok=("colocate", "server")),
    "vllm_model_impl": Answer(_SAMPLER, ok=("vllm",)),
    "vllm_server_base_url": Answer(_SAMPLER, ok=(None,)),
    "vllm_server_host": Answer(_SAMPLER, ok=("0.0.0.0",)),
    "vllm_server_port": Answer(_SAMPLER, ok=(8000,)),
    "vllm_server_timeout": Answer(_SAMPLER, ok=(240.0,)),
    "vllm_group_port": Answer(_SAMPLER, ok=(51216,)),
    "vllm_gpu_memory_utilization": Answer(
        _SAMPLER + "; the paged engine's pool is sized from the memory left", ok=(0.3,)
    ),  # fmt: skip
    "vllm_tensor_parallel_size": Answer(_SAMPLER + "; it samples on the training mesh's shards", ok=(1,)),
    "vllm_enable_sleep_mode": Answer(_SAMPLER, ok=(False,)),
    "vllm_max_model_length": Answer(_SAMPLER, ok=(None,)),
    "vllm_structured_outputs_regex": Answer("constrained decoding is " + _NOT_IMPLEMENTED, ok=(None,)),
    "vllm_importance_sampling_cap": Answer(
        "vllm_importance_sampling_clip_max (TRL's newer name)",
        ok=(None,),
        to=_renamed("vllm_importance_sampling_clip_max"),
    ),
    "weight_sync_steps": Answer(
        "the sampler reads the policy's weights of every step (in place on the training mesh, or with "
        "sampling_devices copied device to device, cheaper than one rollout's generation); a sampler n steps behind "
        "would make a resumed run need weights no checkpoint holds — max_staleness lets rollouts lag instead",
        ok=(1,),
    ),
    "use_transformers_continuous_batching": Answer(
        "generation_backend=paged (jaxloom's paged engine) batches continuously", ok=(False,)
    ),
    "transformers_continuous_batching_config": Answer("generation_backend=paged has its own settings", ok=(None,)),
    "cache_implementation": Answer("the engines keep their own KV cache (static or paged)", ok=(None,)),
    "generation_kwargs": Answer("temperature, top_p, top_k set the sampler", ok=(None, {})),
    "min_p": Answer("min-p sampling is " + _NOT_IMPLEMENTED + " (temperature, top_p, top_k are)", ok=(None,)),
    "repetition_penalty": Answer("a repetition penalty is " + _NOT_IMPLEMENTED, ok=(1.0,)),
    "generation_batch_size": Answer("a step's rollouts are total_batch_size completions, sampled at once", ok=(None,)),
    "steps_per_generation": Answer("num_iterations reuses a batch of rollouts for several steps", ok=(None,)),
    "num_generations_eval": Answer("evaluation samples num_generations completions per prompt", ok=(None,)),
    "log_completions": Answer("completions are logged with the step's metrics (generation previews)", ok=(False,)),
    "num_completions_to_print": Answer("completions are logged with the step's metrics", ok=(None,)),
    "log_unique_prompts": Answer("completions are logged with the step's metrics", ok=(False,)),
    "log_multimodal": Answer("jaxloom's RL is text-only", ok=(True,)),
    "multi_objective_aggregation": Answer(
        "rewards are weighted, summed, then normalised per group (TRL's default)", ok=("sum_then_normalize",)
    ),
    "top_entropy_quantile": Answer("training on the high-entropy tokens only is " + _NOT_IMPLEMENTED, ok=(1.0,)),
    "entropy_coef": Answer("an entropy bonus is " + _NOT_IMPLEMENTED, ok=(0.0,)),
    "use_adaptive_entropy": Answer("an entropy bonus is " + _NOT_IMPLEMENTED, ok=(False,)),
    "entropy_target": Answer("an entropy bonus is " + _NOT_IMPLEMENTED, ok=(0.2,)),
    "entropy_coef_delta": Answer("an entropy bonus is " + _NOT_IMPLEMENTED, ok=(0.005,)),
    "entropy_coef_min": Answer("an entropy bonus is " + _NOT_IMPLEMENTED, ok=(0.0,)),
    "entropy_coef_max": Answer("an entropy bonus is " + _NOT_IMPLEMENTED, ok=(1.0,)),
}
"""Every TRL key that is not one of jaxloom's own names or `ALIASES`, and how jaxloom answers it (see `Answer`)."""


def answered(kwargs: dict[str, Any], own: set[str] | dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with the TRL keys of `TRL_KEYS` that are not in `own` (the class's own names win) answered:
    honoured ones become jaxloom's settings, accepted ones are dropped; any other value is a ValueError naming the
    key, the value, what jaxloom does and the values it takes."""
    out = dict(kwargs)
    for key in [k for k in kwargs if k not in own and k in TRL_KEYS]:
        value, answer = out.pop(key), TRL_KEYS[key]
        if answer.to is not None and not any(_same(value, ok) for ok in answer.ok):
            for name, setting in answer.to(value).items():
                if name in kwargs and not _same(kwargs[name], setting):
                    raise ValueError(
                        f"{key} = {value!r} and {name} = {kwargs[name]!r} are one setting ({key} is TRL's name of "
                        f"{name}); give one"
                    )
                out[name] = setting
        elif answer.to is None and not any(_same(value, ok) for ok in answer.ok):
            values = ", ".join(repr(v) for v in answer.ok)
            raise ValueError(f"{key} = {value!r}: {answer.why}; expected {values} (TRL's default here) or no {key}")
    return out
