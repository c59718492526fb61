"""`TrainingArguments`: EasyDeL's flat argument names, kept as small frozen groups, each a pydantic model:
one schema (types, defaults, checks) for the Python API, YAML/JSON files and `key=value` overrides alike."""

from __future__ import annotations

import dataclasses

import difflib
import inspect
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from jaxloom.core.schema import explain_validation_error

from .config_files import apply_overrides, load_config_file  # noqa: F401 - their home for the composition root

OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd")
SCHEDULERS = ("linear", "cosine", "constant")


def check_positive(obj, *names, allow_none=False, allow_zero=False):
    """Each of `obj`'s fields `names` is a finite number above 0 (`allow_zero`: at least 0; `allow_none`: or
    None), else one `ValueError` naming the field, its value and what was expected."""
    for n in names:
        v = getattr(obj, n)
        if v is None and allow_none:
            continue
        ok = isinstance(v, int | float) and not isinstance(v, bool) and (v >= 0 if allow_zero else v > 0)
        if not ok or v != v or v in (float("inf"), float("-inf")):
            raise ValueError(
                f"{n} = {v!r}; expected a {'non-negative' if allow_zero else 'positive'} finite number"
                + (" or None" if allow_none else "")
            )


class SettingsGroup(BaseModel):
    """One frozen group of arguments. Values are checked against the field types (pydantic's lax mode:
    `"1e-5"` is a float, `"3"` an int, `3.5` is not an int) and then by the group's own checks."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=False)

    @field_validator("*", mode="before")
    @classmethod
    def _paths_are_strings(cls, v, info: ValidationInfo):
        if isinstance(v, bool) and "bool" not in str(cls.model_fields[info.field_name].annotation):
            raise ValueError("expected a number or text, not true/false")  # lax mode would read True as 1
        v = os.fspath(v) if isinstance(v, os.PathLike) else v
        return expand_path(v, info.field_name) if info.field_name in PATH_ARGUMENTS else v


# Arguments that are paths: `~` and `$VARS` in them are expanded as a shell would (a YAML file or a Python
# string does not), so `save_directory: ~/runs/a` is a directory in the home directory, not one named `~`.
PATH_ARGUMENTS = {"save_directory", "checkpoint_directory", "compilation_cache_dir", "ref_model", "lora_from"}
PATH_ARGUMENTS |= {"eval_tasks_include_path"}


def expand_path(value: Any, key: str) -> Any:
    """`value` with a leading `~` and `$VAR` / `${VAR}` expanded, as a shell does for an unquoted path; a
    variable that is not set is an error naming `key` (it would become part of a directory's name)."""
    if not isinstance(value, str) or ("~" not in value[:1] and "$" not in value):
        return value
    out = os.path.expanduser(os.path.expandvars(value))
    unset = re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", out)
    if unset:
        raise ValueError(f"{key} = {value!r}: environment variable(s) {unset} not set; set them or write the path out")
    return out


class OptimizerArgs(SettingsGroup):
    learning_rate: float = Field(3e-4, description="peak learning rate of the schedule (0, as TRL takes it: no update)")
    optimizer: Literal["adamw", "adafactor", "lion", "sgd"] = Field("adamw", description="the optax optimizer")
    scheduler: Literal["linear", "cosine", "constant"] = Field(
        "cosine", description="learning-rate decay after the warmup, over the run's steps"
    )
    warmup_steps: int | None = Field(
        None, description="steps of linear warmup from init_learning_rate (None: warmup_ratio of the run)"
    )
    warmup_ratio: float = Field(
        0.0, description="warmup as a fraction of the run's steps, rounded up (as HF), when warmup_steps is None"
    )
    init_learning_rate: float = Field(0.0, description="learning rate at step 0, where the warmup starts")
    end_learning_rate: float = Field(0.0, description="learning rate at the last step")
    weight_decay: float = Field(0.0, description="decoupled weight decay (adamw, lion, adafactor)")
    decay_norms_and_biases: bool = Field(
        False,
        description="decay biases and norm weights too (HF Trainer, and jaxloom since trainer 0.17, skip them)",
    )
    max_grad_norm: float | None = Field(1.0, description="clip gradients to this global norm (None: no clipping)")
    adam_beta1: float = Field(0.9, description="first-moment decay (adamw, lion)")
    adam_beta2: float = Field(0.95, description="second-moment decay (adamw, lion)")
    adam_epsilon: float = Field(1e-8, description="adamw's epsilon")
    momentum: float = Field(0.0, description="sgd's momentum (0: none)")

    @model_validator(mode="after")
    def _check(self):
        check_positive(
            self,
            "weight_decay",
            "learning_rate",
            "warmup_ratio",
            "init_learning_rate",
            "end_learning_rate",
            allow_zero=True,
        )
        check_positive(self, "max_grad_norm", allow_none=True)
        check_positive(self, "warmup_steps", allow_none=True, allow_zero=True)
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio {self.warmup_ratio}; expected a value in [0, 1)")
        for name in ("adam_beta1", "adam_beta2", "momentum"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}; expected a value in [0, 1)")
        check_positive(self, "adam_epsilon")
        return self


class LoopArgs(SettingsGroup):
    # global rows per micro-batch
    total_batch_size: int = Field(
        8,
        description="rows (sequences) per micro-batch, over all devices (HF's total train batch size is this × "
        "gradient_accumulation_steps)",
    )
    gradient_accumulation_steps: int = Field(1, description="micro-batches per optimizer step")
    # optimizer steps; None: from num_train_epochs
    max_training_steps: int | None = Field(
        None, description="optimizer steps of the run (None: num_train_epochs over the data)"
    )
    num_train_epochs: int = Field(1, description="passes over the training data, when max_training_steps is None")
    evaluation_steps: int | None = Field(None, description="evaluate every this many steps (None: at the end only)")
    eval_batches: int = Field(8, description="batches per evaluation")
    # default: total_batch_size
    evaluation_batch_size: int | None = Field(None, description="rows per evaluation batch (None: total_batch_size)")
    # lm-evaluation-harness during training (the lm-eval extra; jaxloom.trainer.benchmarks)
    eval_tasks: list[str] | None = Field(
        None, description="lm-eval task names run on the state being trained, logged as lm_eval/<task>/<metric>"
    )
    eval_tasks_steps: int | None = Field(None, description="run eval_tasks every this many steps (None: at the end)")
    eval_tasks_limit: float | None = Field(None, description="documents per lm-eval task (a fraction if below 1)")
    eval_tasks_num_fewshot: int | None = Field(None, description="lm-eval few-shot examples (None: the task's)")
    eval_tasks_include_path: str | None = Field(None, description="a folder of one's own lm-eval task YAMLs")
    logging_steps: int = Field(10, description="a metrics row every this many steps")
    # seconds; then save and stop cleanly
    training_time_limit: float | None = Field(None, description="seconds; then save and stop cleanly")
    seed: int = Field(42, description="seed of the initial parameters, dropout and data order")
    nan_policy: Literal["stop", "skip"] = Field(
        "stop", description="a non-finite loss stops the run, or its update is skipped"
    )
    z_loss: float = Field(0.0, description="weight of the log(Z)^2 auxiliary loss (0: off)")
    # DeepSeek-V3's aux-loss-free balancing (its paper's bias update speed; Megatron's moe_router_bias_update_rate):
    # after each step a router's e_score_correction_bias moves this much up for experts that took fewer tokens than
    # the mean and down for those that took more. Models without such a router ignore it; 0 freezes the biases.
    router_bias_update_rate: float = Field(
        0.001, description="DeepSeek-V3 router bias step toward balanced experts after each step (0: frozen)"
    )
    loss_block_size: int = Field(
        2048,
        description="positions per device in each block of the fused output projection and loss (0: whole logits); "
        "a block holds positions x vocabulary float32 logits (256 MB at 32k tokens: lower it for a large vocabulary "
        "on a small device)",
    )

    @field_validator("eval_tasks", mode="before")
    @classmethod
    def _task_names(cls, value):
        """`eval_tasks=a,b` on the command line: lm-eval's comma-separated task names, as its `--tasks`."""
        return [t.strip() for t in value.split(",") if t.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self):
        check_positive(
            self, "total_batch_size", "gradient_accumulation_steps", "num_train_epochs", "logging_steps", "eval_batches"
        )
        check_positive(
            self,
            "max_training_steps",
            "evaluation_steps",
            "evaluation_batch_size",
            "training_time_limit",
            "eval_tasks_steps",
            "eval_tasks_limit",
            allow_none=True,
        )
        check_positive(self, "eval_tasks_num_fewshot", allow_none=True, allow_zero=True)
        if self.eval_tasks is not None and not self.eval_tasks:
            raise ValueError("eval_tasks = []; expected lm-eval task names (eval_tasks=arc_easy,hellaswag) or null")
        check_positive(self, "z_loss", "loss_block_size", "router_bias_update_rate", allow_zero=True)
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed = {self.seed}; expected an integer in [0, 2**32)")
        return self


class CheckpointArgs(SettingsGroup):
    # None: a new directory for every run, jaxloom-runs/run-<date>-<time>-<random> (logged at the start).
    save_directory: str | None = Field(
        None, description="the run's directory: checkpoints, logs, report (None: a new one per run)"
    )
    # Where checkpoints go: None is save_directory/checkpoints; a path or an object-store URI (gs://bucket/run)
    # puts them there, with the run's logs and report staying in save_directory.
    checkpoint_directory: str | None = Field(
        None,
        description="where checkpoints go: a path, gs:// or s3://bucket/path (None: save_directory/checkpoints)",
    )
    checkpoint_format: Literal["orbax", "raw"] = Field(
        "orbax",
        description="checkpoint arrays: orbax's standard format (orbax alone reads it) or jaxloom's raw format",
    )
    # An S3-compatible store (MinIO, R2, Ceph): its endpoint, set as AWS_ENDPOINT_URL for this run's
    # processes (s3fs and tensorstore read it). None: the environment's, else AWS.
    storage_endpoint_url: str | None = Field(
        None, description="the S3-compatible store's endpoint for s3:// paths (None: AWS_ENDPOINT_URL or AWS)"
    )
    storage_retry_seconds: float = Field(
        120.0, description="how long a checkpoint save retries a store out of reach (backoff) before the run stops"
    )
    # A run directory on a store is held by a lease object renewed every third of this; a run that did not renew
    # it for this long (paused, suspended, cut off) may be taken over, and then writes nothing more there.
    storage_lease_seconds: float = Field(
        60.0, description="a store run directory's lease: another run may take it over after this long unrenewed"
    )
    save_steps: int | None = Field(None, description="checkpoint every this many steps")
    save_minutes: float | None = Field(None, description="checkpoint every this many minutes")
    save_total_limit: int | None = Field(3, description="checkpoints kept (the newest)")
    resume_if_possible: bool = Field(True, description="continue the run found in save_directory")
    # A save_directory with checkpoints of an earlier run: continue it (resume_if_possible), or start over
    # only when this is true (its checkpoints and logs are removed). Never replaced silently.
    overwrite_output_dir: bool = Field(
        False, description="replace the run found in save_directory (its checkpoints and logs)"
    )
    async_checkpointing: bool = Field(True, description="write checkpoints in the background while training goes on")

    @model_validator(mode="after")
    def _check(self):
        check_positive(self, "save_steps", "save_minutes", "save_total_limit", allow_none=True)
        if not self.storage_lease_seconds >= 3:
            raise ValueError(
                f"storage_lease_seconds = {self.storage_lease_seconds}; expected at least 3 seconds "
                "(the lease is renewed every third of it)"
            )
        if self.storage_retry_seconds < 0:
            raise ValueError(f"storage_retry_seconds = {self.storage_retry_seconds}; expected a number of seconds >= 0")
        if self.save_directory is not None and not self.save_directory.strip():
            raise ValueError("save_directory = ''; expected a directory path")
        if self.checkpoint_directory is not None and not self.checkpoint_directory.strip():
            raise ValueError("checkpoint_directory = ''; expected a directory path or a gs:// / s3:// URI")
        for key in ("save_directory", "checkpoint_directory"):
            value = getattr(self, key)
            if value and "://" in value and value.split("://", 1)[0] not in ("gs", "s3"):
                raise ValueError(f"{key} = {value!r}: expected a local path, gs://bucket/path or s3://bucket/path")
        url = self.storage_endpoint_url
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"storage_endpoint_url = {url!r}; expected an http:// or https:// URL")
        return self


class DataArgs(SettingsGroup):
    max_sequence_length: int = Field(512, description="tokens per row")
    truncation_mode: Literal["keep_end", "keep_start"] = Field(
        "keep_end", description="which end of a too-long unpacked record is kept"
    )
    packing: bool = Field(True, description="pack documents into full rows (False: one record per row, padded)")
    skip_bad_records: bool = Field(
        False,
        description="a record that cannot be read or tokenized is skipped and counted (data/skipped_records) instead "
        "of stopping the run naming its file:line (a rerun can then go past it)",
    )
    shuffle_train_dataset: bool = Field(True, description="shuffle the training data (seeded, exactly resumable)")
    completion_only_loss: bool = Field(
        True, description="prompt/completion records train on the completion only (TRL's; false: every token)"
    )
    assistant_only_loss: bool = Field(
        True,
        description="chat records train on the assistant turns only (TRL's assistant_only_loss=true; false, TRL's "
        "default: every token of the conversation)",
    )
    shuffle_buffer_size: int = Field(
        8192, description="records read ahead per data stream and shuffled together (memory flat in dataset size)"
    )
    max_images_per_row: int = Field(
        1,
        description="a vision-language model's rows: images one record may hold (each row has that many image slots; "
        "a record with more is a bad record naming them)",
    )

    @field_validator("completion_only_loss", mode="before")
    @classmethod
    def _trl_none(cls, value: Any) -> Any:
        return True if value is None else value  # TRL's None: the completion only, for prompt/completion records

    @model_validator(mode="after")
    def _check(self):
        check_positive(self, "max_sequence_length", "shuffle_buffer_size", "max_images_per_row")
        if self.max_sequence_length < 2:  # one token predicts nothing: steps would train on no target at all
            raise ValueError(
                f"max_sequence_length = {self.max_sequence_length}; expected at least 2 (a row of one token has "
                "nothing to predict)"
            )
        return self


class RuntimeArgs(SettingsGroup):
    # How the model computes. None: the model's own setting (its `RuntimeConfig`); a value replaces it for
    # this run, in the Python API and the `jaxloom` command alike (the trainer rebuilds the model with it).
    # computation dtype, e.g. "bfloat16"
    dtype: str | None = Field(None, description="computation dtype, e.g. bfloat16 (None: the model's)")
    # storage dtype of parameters (and optimizer state)
    param_dtype: str | None = Field(None, description="parameter and optimizer-state dtype (None: the model's)")
    # Attention backend: auto, xla, chunked (linear memory, any platform), cudnn, flash (GPU/TPU).
    attn_mechanism: str | None = Field(
        None, description="attention backend: auto, xla, chunked, cudnn, flash (EasyDeL's names too)"
    )
    attn_block_size: int | None = Field(None, description="query/key block of the chunked and flash backends")
    attn_max_documents: int | None = Field(
        None, description="documents a packed row that cudnn keeps apart (more: flash for that step); None: 32"
    )
    remat: str | None = Field(None, description="activation rematerialisation policy (None: the model's)")
    # Scan the decoder stack (compile time flat in depth); the model's default scans above 16 layers.
    scan_layers: bool | None = Field(
        None, description="scan the decoder stack: compile time flat in depth (None: above 16 layers)"
    )
    # Layers per iteration of a scanned stack: the stacked layout (and checkpoints) stay, the code is straight-line.
    scan_unroll: int | None = Field(
        None, description="layers per iteration of a scanned stack (None: all on CPU/GPU, 1 on TPU)"
    )
    # MoE experts: auto (ragged on GPU/TPU, tiled on CPU), ragged, tiled, dense (reference).
    moe_implementation: str | None = Field(None, description="MoE expert computation: auto, ragged, tiled, dense")
    fp8: Literal["none", "tensor", "row"] | None = Field(
        None,
        description="FP8 training of the decoder's linear layers: tensor or row scales (e4m3 forward, e5m2 "
        "gradients; NVIDIA compute capability 8.9 or newer, emulated on CPU); None/none: off",
    )
    # The mesh axes batch rows are split over, in order. None: the model's `partition_axis.batch_axis`
    # (fsdp, then dp). Add "ep" for expert parallelism that moves tokens: the ep devices then hold
    # different rows (data-parallel outside the experts) instead of repeating the same ones.
    batch_axis: tuple[str, ...] | None = Field(
        None,
        description="mesh axes the batch rows are split over (None: the model's; [fsdp,dp,ep]: tokens move to experts)",
    )
    sharding_axis_dims: tuple[int, ...] = Field(
        (1, -1, 1, 1, 1), description="mesh shape over (dp, fsdp, ep, tp, sp); -1 takes the remaining devices"
    )
    sharding_axis_names: tuple[str, ...] = Field(("dp", "fsdp", "ep", "tp", "sp"), description="mesh axis names")
    sharding_dcn_axis_dims: tuple[int, ...] | None = Field(
        None, description="mesh shape across hosts (multi-slice / multi-node)"
    )
    # Donate the state's buffers to the step (one copy of it in memory instead of two). None: on GPU/TPU
    # yes; on CPU no, where XLA runs a donated step ~6% slower (measured, docs/performance.md).
    donate_state: bool | None = Field(
        None, description="donate the state's buffers to the step (None: yes on GPU/TPU, no on CPU)"
    )
    # JAX's persistent compilation cache: a rerun or a restart after a crash loads the compiled train
    # step (and every other program) from here instead of compiling it. Process-wide: `train()` turns
    # it on when it starts (never the constructor, nor commands that only read a run).
    compilation_cache_dir: str | None = Field(None, description="JAX's persistent compilation cache directory")

    @field_validator("dtype", "param_dtype", "attn_mechanism", "remat", mode="before")
    @classmethod
    def _names(cls, v):  # dtypes and enum members by their names: one spelling in files and in Python
        if v is None or isinstance(v, str):
            return v
        import jax.numpy as jnp

        value = getattr(v, "value", None)
        if isinstance(value, str):
            return value
        try:
            return jnp.dtype(v).name
        except TypeError:
            return v

    @model_validator(mode="after")
    def _check(self):
        overrides = self.runtime_overrides()
        if overrides:
            from jaxloom.models import RuntimeConfig

            RuntimeConfig(**overrides)  # the same checks the model applies, now: one clear error
        if self.batch_axis is not None:
            unknown = [a for a in self.batch_axis if a not in self.sharding_axis_names]
            if not self.batch_axis or unknown or len(set(self.batch_axis)) != len(self.batch_axis):
                raise ValueError(
                    f"batch_axis {tuple(self.batch_axis)}; expected distinct names of mesh axes, some of "
                    f"sharding_axis_names {self.sharding_axis_names}, e.g. ('fsdp', 'dp', 'ep')"
                )
        if len(self.sharding_axis_dims) != len(self.sharding_axis_names):
            raise ValueError(
                f"sharding_axis_dims {self.sharding_axis_dims} and sharding_axis_names "
                f"{self.sharding_axis_names}; expected the same length"
            )
        return self

    def runtime_overrides(self) -> dict[str, Any]:
        """The `RuntimeConfig` fields these arguments set (the ones that are not None)."""
        names = (
            "dtype",
            "param_dtype",
            "attn_mechanism",
            "attn_block_size",
            "attn_max_documents",
            "remat",
            "scan_layers",
            "scan_unroll",
            "moe_implementation",
            "fp8",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def apply(self, runtime: Any) -> Any:
        """`runtime` (a model's `RuntimeConfig`) with these arguments' settings applied: the overridden
        fields, and `batch_axis` into its `partition_axis`."""
        runtime = runtime.replace(**self.runtime_overrides())
        if self.batch_axis is not None:
            axes = dataclasses.replace(runtime.partition_axis, batch_axis=tuple(self.batch_axis))
            runtime = runtime.replace(partition_axis=axes)
        return runtime


class LoggingArgs(SettingsGroup):
    use_tensorboard: bool = Field(True, description="write TensorBoard events in save_directory/tensorboard")
    use_wandb: bool = Field(False, description="log to Weights & Biases (resumed runs continue their W&B run)")
    wandb_project: str | None = Field(None, description="the W&B project (None: jaxloom)")
    progress_bar: bool = Field(True, description="a progress bar on a terminal; step lines with ETA otherwise")
    plot_loss: bool = Field(
        True, description="draw save_directory/loss.png (reward, loss, learning rate against the step) at the end"
    )
    log_weight_distribution: bool = Field(False, description="parameter histograms to TensorBoard at each log row")
    # override the table used for MFU
    peak_flops_per_device: float | None = Field(
        None, description="peak FLOP/s per device for MFU (None: from the device table)"
    )
    # (first, last): a JAX profiler trace of these steps
    profile_steps: tuple[int, ...] | None = Field(
        None, description="[first, last]: a JAX profiler trace of these steps"
    )

    @model_validator(mode="after")
    def _check(self):
        steps = self.profile_steps
        if steps is not None and (len(steps) != 2 or not all(s > 0 for s in steps) or steps[0] > steps[1]):
            raise ValueError(f"profile_steps {list(steps)!r}; expected [first, last] with 0 < first <= last")
        check_positive(self, "peak_flops_per_device", allow_none=True)
        return self


class GenerationArgs(SettingsGroup):
    generation_interval: int | None = Field(None, description="generate previews every this many steps")
    generation_prompts: tuple[str, ...] = Field((), description="prompts of the previews")
    generation_max_new_tokens: int = Field(32, description="tokens per preview")
    generation_num_samples: int = Field(1, description="previews per prompt")
    generation_temperature: float = Field(0.0, description="sampling temperature of the previews (0: greedy)")

    @model_validator(mode="after")
    def _check(self):
        check_positive(self, "generation_interval", allow_none=True)
        check_positive(self, "generation_max_new_tokens", "generation_num_samples")
        check_positive(self, "generation_temperature", allow_zero=True)
        return self


class AdapterArgs(SettingsGroup):
    """LoRA and QLoRA (TRL's `ModelConfig` names): only the adapters train; the base is frozen, and with
    `load_in_8bit` / `load_in_4bit` stored quantized."""

    use_peft: bool = Field(False, description="train LoRA adapters on the frozen model (TRL's use_peft)")
    lora_r: int = Field(16, description="LoRA: the adapters' rank")
    lora_alpha: float = Field(32.0, description="LoRA: the scale is lora_alpha / lora_r (/ sqrt(lora_r) with rsLoRA)")
    lora_dropout: float = Field(
        0.0, description="LoRA: dropout on the adapters' input in training (PEFT's; TRL's recipes use 0.05)"
    )
    lora_target_modules: tuple[str, ...] | str | None = Field(
        None, description="LoRA: HF module names (q_proj,v_proj, ...) or all-linear (None: q_proj,v_proj)"
    )
    lora_target_parameters: tuple[str, ...] | str | None = Field(
        None,
        description="LoRA on MoE experts (PEFT's target_parameters): transformers' stacked expert weights, "
        "mlp.experts.gate_up_proj,mlp.experts.down_proj (None: the experts stay frozen)",
    )
    lora_exclude_modules: tuple[str, ...] | str | None = Field(
        None,
        description="LoRA: modules left out (PEFT's exclude_modules: names, or a regular expression on transformers' "
        "module names); None: the model's default (a vision-language model's tower and projector), () none",
    )
    use_rslora: bool = Field(False, description="LoRA: rank-stabilised scale lora_alpha / sqrt(lora_r)")
    load_in_8bit: bool = Field(False, description="QLoRA: the frozen base stored int8 (a scale per output column)")
    load_in_4bit: bool = Field(False, description="QLoRA: the frozen base stored 4-bit (bnb_4bit_quant_type)")
    bnb_4bit_quant_type: Literal["nf4"] = Field("nf4", description="QLoRA 4-bit code: nf4 (blocks of 64)")
    lora_from: str | None = Field(
        None, description="a PEFT adapter directory to continue training or generate from (sets use_peft)"
    )

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.lora_r, bool) or self.lora_r <= 0:
            raise ValueError(f"lora_r = {self.lora_r!r}; expected a positive integer (the adapters' rank)")
        check_positive(self, "lora_alpha")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout = {self.lora_dropout}; expected a probability in [0, 1) (PEFT's default 0)")
        if self.lora_dropout and self.lora_target_parameters:
            raise ValueError(
                f"lora_dropout = {self.lora_dropout} with lora_target_parameters: PEFT's adapters on expert weights "
                "take no dropout (its ParamWrapper refuses lora_dropout != 0); expected lora_dropout=0 with them"
            )
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("load_in_8bit and load_in_4bit are both set; expected one quantization of the base")
        if (self.load_in_8bit or self.load_in_4bit) and not self.peft:
            raise ValueError(
                f"{'load_in_8bit' if self.load_in_8bit else 'load_in_4bit'} = true without use_peft: a quantized "
                "base cannot be trained; set use_peft=true (QLoRA)"
            )
        return self

    @property
    def peft(self) -> bool:
        """Whether the run trains adapters (`use_peft`, or an adapter to continue from)."""
        return self.use_peft or self.lora_from is not None

    def lora_config(self) -> Any:
        """The `jaxloom.models.LoRAConfig` of these settings, or None without adapters. With `lora_from`, the
        adapter directory's rank, alpha and modules (the quantization stays this run's)."""
        if not self.peft:
            return None
        from jaxloom.models import LoRAConfig, read_peft_config

        quantize = "int8" if self.load_in_8bit else self.bnb_4bit_quant_type if self.load_in_4bit else None
        if self.lora_from is not None:
            return dataclasses.replace(read_peft_config(self.lora_from), quantize=quantize)
        modules = self.lora_target_modules or ("q_proj", "v_proj")
        return LoRAConfig(
            r=self.lora_r,
            alpha=self.lora_alpha,
            target_modules=modules,
            use_rslora=self.use_rslora,
            quantize=quantize,
            target_parameters=self.lora_target_parameters or (),
            dropout=self.lora_dropout,
            exclude_modules=self.lora_exclude_modules,
        )


GROUPS: dict[str, type[SettingsGroup]] = {
    "optim": OptimizerArgs,
    "loop": LoopArgs,
    "checkpoint": CheckpointArgs,
    "data": DataArgs,
    "runtime": RuntimeArgs,
    "logging": LoggingArgs,
    "generation": GenerationArgs,
    "adapter": AdapterArgs,
}
_OWNER = {name: g for g, cls in GROUPS.items() for name in cls.model_fields}


class TrainingArguments:
    """All training arguments, written flat as EasyDeL users write them:

        TrainingArguments(learning_rate=1e-4, total_batch_size=8, max_training_steps=100, save_directory="out")

    Inside, each argument lives in one frozen group (`args.optim`, `args.loop`, `args.checkpoint`,
    `args.data`, `args.runtime`, `args.logging`, `args.generation`), a pydantic model validated on
    creation; reading `args.learning_rate` works too. Unknown names are rejected with the closest known
    one. `TrainingArguments.fields()` lists every argument with its group, type and default.
    """

    GROUPS: dict[str, type[SettingsGroup]] = GROUPS

    def __init__(self, **kwargs: Any):
        from .trl_keys import answered

        owner = self._owner()
        kwargs = answered(_aliased(kwargs), owner)
        unknown = [k for k in kwargs if k not in owner]
        if unknown:
            hints = {
                k: f"use {RENAMED[k]}"
                if k in RENAMED
                else "".join(f"did you mean {h!r}?" for h in difflib.get_close_matches(k, list(owner), n=1))
                for k in unknown
            }
            text = "; ".join(f"{k!r}" + (f" ({h})" if h else "") for k, h in hints.items())
            raise ValueError(f"unknown training argument(s): {text}")
        for group, cls in self.GROUPS.items():
            values = {k: v for k, v in kwargs.items() if k in cls.model_fields}
            try:
                object.__setattr__(self, group, cls(**values))
            except ValidationError as e:
                raise explain_validation_error(e) from None

    @classmethod
    def _owner(cls) -> dict[str, str]:
        return {name: g for g, group in cls.GROUPS.items() for name in group.model_fields}

    def __getattr__(self, name: str) -> Any:
        owner = type(self)._owner()
        if name in owner:
            return getattr(object.__getattribute__(self, owner[name]), name)
        raise AttributeError(f"{type(self).__name__} has no argument {name!r}")

    def __setattr__(self, name, value):
        raise AttributeError("TrainingArguments is frozen; use .replace(**changes)")

    def to_dict(self) -> dict[str, Any]:
        """Every argument by its flat name."""
        return {name: getattr(getattr(self, g), name) for g, cls in self.GROUPS.items() for name in cls.model_fields}

    def replace(self, **changes: Any) -> TrainingArguments:
        """A copy with `changes` (flat names) applied and validated."""
        return type(self)(**{**self.to_dict(), **changes})

    def __eq__(self, other):
        return type(other) is type(self) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        defaults = {name: f.default for cls in self.GROUPS.values() for name, f in cls.model_fields.items()}
        changed = {k: v for k, v in self.to_dict().items() if defaults[k] != v}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in changed.items())})"

    @classmethod
    def fields(cls) -> list[dict[str, Any]]:
        """Every argument: `{"name", "group", "type", "default", "doc"}`, in group order (the schema the
        command line, files and the Python API share)."""
        return [
            {
                "name": name,
                "group": g,
                "type": _type_text(f.annotation),
                "default": f.default,
                "doc": f.description or "",
            }
            for g, group in cls.GROUPS.items()
            for name, f in group.model_fields.items()
        ]

    # ---- derived --------------------------------------------------------------------------------------
    @property
    def training_batch_size(self) -> int:
        """Rows per optimizer step: `total_batch_size × gradient_accumulation_steps`."""
        return self.total_batch_size * self.gradient_accumulation_steps

    @property
    def eval_batch_size(self) -> int:
        return self.evaluation_batch_size or self.total_batch_size

    # ---- files ----------------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path, overrides: list[str] | None = None) -> TrainingArguments:
        """Read a YAML or JSON file at `path`, then apply `overrides` (`["key=value", ...]`)."""
        return cls(**apply_overrides(load_config_file(path), overrides or []))


def _type_text(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


# help() shows every argument by group, from the schema itself (so the list cannot go stale).
TrainingArguments.__doc__ = (
    (TrainingArguments.__doc__ or "")
    + "\n    Arguments (name: type = default), by group:\n"
    + "".join(
        f"\n    - `{g}`: "
        + ", ".join(f"`{n}: {_type_text(f.annotation)} = {f.default!r}`" for n, f in cls.model_fields.items())
        for g, cls in GROUPS.items()
    )
)


def config_signature(groups: dict[str, type[SettingsGroup]]) -> inspect.Signature:
    """The signature of an arguments class made of `groups`: help(), IDEs and inspect see every argument with its
    type and default (a kind's config sets it: `RLOOConfig.__signature__ = config_signature(RLOOConfig.GROUPS)`)."""
    return inspect.Signature(
        [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.annotation)
            for cls in groups.values()
            for name, f in cls.model_fields.items()
        ]
    )


TrainingArguments.__signature__ = config_signature(GROUPS)  # type: ignore[attr-defined]


# Other frameworks' names with the same meaning, accepted for jaxloom's (the reference guides write some of them).
ALIASES = {
    "total_steps": "max_training_steps",  # EasyDeL's Ray guide
    "max_steps": "max_training_steps",  # HF Trainer / TRL
    "batch_size": "total_batch_size",  # EasyDeL's Ray guide: rows per step over all devices
    "output_dir": "save_directory",  # HF Trainer / TRL
    "lr_scheduler_type": "scheduler",  # HF Trainer: linear, cosine, constant mean the same here
    "eval_steps": "evaluation_steps",  # HF Trainer / TRL
}
# Names whose meaning differs from every jaxloom argument: refused, naming the one to use.
RENAMED = {
    "per_device_train_batch_size": "total_batch_size (rows over all devices, not per device)",
    "per_device_eval_batch_size": "evaluation_batch_size (rows over all devices, not per device)",
    "logging_dir": "save_directory (TensorBoard events are written to save_directory/tensorboard)",
}


def _aliased(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with `ALIASES` replaced by jaxloom's names; an alias given together with its name is an error."""
    out = dict(kwargs)
    if out.get("max_steps") == -1:  # HF's and TRL's default: no step limit (num_train_epochs decides)
        out["max_steps"] = None
    for alias, name in ALIASES.items():
        if alias in out:
            if name in out:
                raise ValueError(f"{alias} and {name} are one setting ({alias} is another name of {name}); give one")
            out[name] = out.pop(alias)
    return out
