"""Learning-rate schedules and optimizers (optax)."""

from __future__ import annotations


import math

import jax
import optax

from .arguments import OptimizerArgs


def get_lr_schedule_fn(
    train_size: int | None = None,
    per_device_batch_size: int | None = None,
    n_epochs: int | None = None,
    learning_rate: float = 3e-4,
    schedule_type: str = "linear",
    warmup_ratio: float = 0.0,
    warmup_steps: int | None = None,
    init_learning_rate: float = 0.0,
    end_learning_rate: float = 0.0,
    *,
    total_steps: int | None = None,
):
    """RedCo's `get_lr_schedule_fn`: warmup from `init_learning_rate` to `learning_rate`, then linear or
    cosine decay to `end_learning_rate` (or constant), by `schedule_type`. Warmup lasts `warmup_steps`,
    or `warmup_ratio` of the steps. Give `total_steps`, or the data sizes to derive it: `n_epochs` over
    `train_size` examples in whole batches of `per_device_batch_size` (RedCo's global micro-batch; the
    remainder dropped, as the batches drop it)."""
    if total_steps is None:
        if None in (train_size, per_device_batch_size, n_epochs):
            raise ValueError("give total_steps, or train_size, per_device_batch_size and n_epochs")
        # Whole batches only, as training drops the remainder (RedCo's count).
        total_steps = n_epochs * (train_size // per_device_batch_size)
    if total_steps <= 0:
        raise ValueError(f"total_steps {total_steps}; expected > 0")
    warmup = warmup_steps if warmup_steps is not None else int(warmup_ratio * total_steps)
    warmup = min(warmup, total_steps)
    decay = max(total_steps - warmup, 1)
    if schedule_type == "linear":
        after = optax.linear_schedule(learning_rate, end_learning_rate, decay)
    elif schedule_type == "cosine":
        alpha = (
            end_learning_rate / learning_rate if learning_rate else 0.0
        )  # learning_rate=0: constant 0 (TRL takes it)
        after = optax.cosine_decay_schedule(learning_rate, decay, alpha=alpha)
    elif schedule_type == "constant":
        after = optax.constant_schedule(learning_rate)
    else:
        raise ValueError(f"schedule_type {schedule_type!r}; expected linear, cosine or constant")
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(init_learning_rate, learning_rate, warmup), after], [warmup])


def decays(path) -> bool:
    """Whether weight decay applies to the parameter at `path` (a pytree key path or names): not to biases (any
    name holding `bias`: GPT-OSS's `gate_up_proj_bias`, a router's bias) or norm weights (`*norm`, `*layernorm`), as
    HF Trainer's `get_decay_parameter_names` excludes them."""
    names = [str(getattr(k, "key", getattr(k, "name", k))).lower() for k in path]
    return not any("bias" in n or n.endswith("norm") for n in names)


def decay_mask(params):
    """`params` with each leaf replaced by `decays(its path)`: optax's `mask` for weight decay."""
    return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)


def make_optimizer(args: OptimizerArgs, total_steps: int) -> tuple[optax.GradientTransformation, object]:
    """`(tx, schedule)` for `args` (the optimizer group of `TrainingArguments`) over `total_steps`:
    gradient clipping (if `max_grad_norm`) then the optimizer on the schedule. As HF Trainer: `warmup_ratio` is
    rounded up to whole steps, and weight decay skips biases and norm weights (`decay_norms_and_biases=true`
    decays every parameter, as jaxloom did before trainer 0.17)."""
    warmup = args.warmup_steps if args.warmup_steps is not None else math.ceil(args.warmup_ratio * total_steps)
    mask = None if args.decay_norms_and_biases else decay_mask
    schedule = get_lr_schedule_fn(
        learning_rate=args.learning_rate,
        schedule_type=args.scheduler,
        warmup_steps=warmup,
        init_learning_rate=args.init_learning_rate,
        end_learning_rate=args.end_learning_rate,
        total_steps=total_steps,
    )
    if args.optimizer == "adamw":
        opt = optax.adamw(
            schedule,
            b1=args.adam_beta1,
            b2=args.adam_beta2,
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
            mask=mask,
        )
    elif args.optimizer == "lion":
        opt = optax.lion(schedule, b1=args.adam_beta1, b2=args.adam_beta2, weight_decay=args.weight_decay, mask=mask)
    elif args.optimizer == "adafactor":
        opt = optax.adafactor(schedule, weight_decay_rate=args.weight_decay or None, weight_decay_mask=mask)
    else:
        opt = optax.sgd(schedule, momentum=args.momentum or None)
        if args.weight_decay:
            opt = optax.chain(optax.add_decayed_weights(args.weight_decay, mask=mask), opt)
    parts = [optax.clip_by_global_norm(args.max_grad_norm)] if args.max_grad_norm else []
    return optax.chain(*parts, opt), schedule
