"""`DistillationTrainer`: on-policy distillation (TRL 1.16's `DistillationTrainer`, Agarwal et al.'s GKD) on the core
of `BaseTrainer` and GRPO's rollout stage.

Each step the student completes the step's prompts itself (GRPO's in-process rollouts, one completion a prompt,
sampled at `temperature` from its current weights), and is trained to match the teacher's next-token distribution
at every completion token under TRL's generalized Jensen-Shannon divergence (`beta`: 0 forward KL, 0.5 JSD, 1
reverse KL; both models' logits divided by `temperature`), averaged over the step's completion tokens. The teacher
is frozen: loaded once from `teacher_model_name_or_path` (or given as a model), sharded over the training mesh by
its own rules, never checkpointed, and run inside the train step (an argument of the jitted step, not a copy in
its program). Both models' output layers meet in blocks of positions (`jaxloom.models.linear_generalized_jsd`):
neither `[B, T, V]` logits are held. Teacher and student may differ in size; their vocabularies must agree.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import jaxloom.state as js

from .batches import DataSpec
from .components import Later, part, step_functions
from .plan import Plan
from .run_state import RunState
from .distillation_config import DistillationConfig
from .functions import StepFunctions
from .grpo.rollouts import Policy, Rollouts
from .grpo.kind import SamplingKind
from .trainer import BaseTrainer
from .reference import build_reference
from .step import Objective, StepConfig


# ---- the objective: pure functions, jitted inside the core's step ----------------------------------------
def distillation_loss(state: js.TrainState, params, batch, cfg: StepConfig, *, beta: float, temperature: float):
    """The generalized JSD between the student (`state` with `params`) and the teacher (`cfg.frozen`, a
    `TrainState`) summed over the completion tokens of one micro-batch of rollout rows, and its sums: `tokens`
    (those tokens, the loss's normaliser, as TRL divides by them) and `entropy_sum` (the student's entropy at
    `temperature`, TRL's `entropy` metric)."""
    from jaxloom.models import linear_generalized_jsd
    from jaxloom.models.losses import block_count

    student, teacher = state.replace(params=params).model, cfg.frozen.model
    ids, seg, pos = batch["input_ids"], batch["segment_ids"], batch["positions"]
    # position t predicts token t + 1: it counts when that token is a completion token the loss trains on
    weight = jnp.pad(batch["loss_mask"][:, 1:].astype(jnp.float32), ((0, 0), (0, 1)))
    out = student(ids, positions=pos, segment_ids=seg, return_hidden=True)
    taught = teacher(ids, positions=pos, segment_ids=seg, return_hidden=True)
    kernel, dtype, precision = student.output_projection()
    t_kernel, t_dtype, _ = teacher.output_projection()
    b, t = ids.shape
    blocks = block_count(max(1, b // cfg.data_shards), t, cfg.loss_block_size)
    loss_sum, entropy_sum = linear_generalized_jsd(
        out.hidden,
        kernel,
        jax.lax.stop_gradient(taught.hidden),
        jax.lax.stop_gradient(t_kernel),
        weight,
        beta=beta,
        temperature=temperature,
        blocks=blocks,
        dtype=dtype,
        precision=precision,
        softcap=getattr(student, "logit_softcap", None),
        teacher_dtype=t_dtype,
        teacher_softcap=getattr(teacher, "logit_softcap", None),
    )
    n = weight.sum()
    if out.aux_loss is not None and cfg.aux_loss_coef:
        loss_sum = loss_sum + cfg.aux_loss_coef * out.aux_loss * n
    return loss_sum, {"tokens": n, "entropy_sum": jax.lax.stop_gradient(entropy_sum)}


def distillation_metrics(sums):
    """TRL's step metrics: `entropy` (the student's, per completion token) and the completion `tokens`."""
    return {"entropy": sums["entropy_sum"] / jnp.maximum(sums["tokens"], 1.0), "tokens": sums["tokens"]}


# ---- the components it changes ------------------------------------------------------------------------------
class StudentRollouts(Rollouts):
    """GRPO's rollout stage as distillation uses it: one completion per prompt, sampled by the student, nothing
    scored; rows of tokens only (the teacher is read inside the step)."""

    def score(self, prompts, completions, columns, completion, completion_mask, where=None):
        return {}, {}

    def layout(self, rows: dict[str, np.ndarray], sampled: np.ndarray | None) -> dict[str, jax.Array]:
        return {k: self._put(rows[k][None]) for k in ("input_ids", "segment_ids", "positions", "loss_mask")}


def _no_log_probs(batch, *, reference: bool) -> jax.Array:
    raise AssertionError("distillation's rollouts keep no per-token log-probs")  # its layout asks for none


def student_rollouts(
    *,
    arguments: DistillationConfig,
    data_spec: Callable[[], DataSpec],
    mesh: Any,
    data_axes: Any,
    tokenizer: Later[Any],
    dataset_train: Any,
    dataset_eval: Any,
    run: RunState,
) -> StudentRollouts:
    """Distillation's batches component: the student's completions of the step's prompts."""
    return StudentRollouts(
        arguments,
        data_spec(),
        mesh=mesh,
        data_axes=data_axes,
        tokenizer=tokenizer,
        dataset_train=dataset_train,
        dataset_eval=dataset_eval,
        settings=arguments.distillation,
        policy=Policy(state=lambda: run.state, step=lambda: run.step, logps=_no_log_probs, rewards=lambda: ([], [])),
    )


def teacher_functions(
    *,
    arguments: DistillationConfig,
    plan: Plan,
    batches: Any,
    objective: Callable[[], Objective],
    teacher: js.TrainState,
) -> StepFunctions:
    """The train and eval steps with the teacher as their frozen first argument (`StepFunctions.build(frozen=)`)."""
    return step_functions(arguments, plan, batches, objective(), frozen=teacher)


# ---- the trainer -------------------------------------------------------------------------------------------
class DistillationTrainer(SamplingKind, BaseTrainer):
    """On-policy distillation of a teacher into the student `model`, as TRL 1.16's `DistillationTrainer` does it
    (see the module docstring), on jaxloom's core: one jitted step holding both models, exact resume (the prompt
    cursor is saved with each checkpoint; the teacher is reloaded from its source), the same outputs and
    commands.

    - `arguments`: a `DistillationConfig` (`teacher_model_name_or_path`, `beta`, `temperature`,
      `max_completion_length`, ...).
    - `teacher_model`: the teacher as a jaxloom model, an HF directory or a jaxloom run directory (default:
      `arguments.teacher_model_name_or_path`); its vocabulary must be the student's.
    - `dataset_train`: prompt records (`prompt`: text or chat messages), as GRPO reads them.
    - `dataset_eval`: held-out prompt records for the evaluation pass (`evaluate`, every `evaluation_steps`).
    - the rest as `BaseTrainer`.
    """

    arguments_class = DistillationConfig

    def take_inputs(self, *, teacher_model: Any = None) -> None:
        """`teacher_model` (default: `arguments.teacher_model_name_or_path`), loaded when the run trains."""
        if self.data_collator is not None:
            raise ValueError("DistillationTrainer builds its rows from rollouts: data_collator is not used; drop it")
        source = teacher_model if teacher_model is not None else self.arguments.teacher_model_name_or_path
        if source is None:
            raise ValueError(
                "distillation needs a teacher: teacher_model_name_or_path=DIR (a Hugging Face model directory or a "
                "jaxloom run directory), or teacher_model= a model"
            )
        self._teacher_source = source

    batches = part(student_rollouts)  # type: ignore[assignment]
    INPUTS: ClassVar[dict[str, str]] = {"teacher": "teacher"}
    functions = part(teacher_functions)  # type: ignore[assignment]

    @functools.cached_property
    def teacher(self) -> js.TrainState:
        """The teacher, loaded once (an HF or run directory, or the given model), sharded over the mesh by its own
        partition rules, with the run's runtime settings — or, with `teacher_model_init_kwargs={"load_in_4bit":
        True}` (or 8-bit), its linear layers stored quantized and the whole replicated; checked to share the
        student's vocabulary."""
        d, name = self.arguments.distillation, "teacher_model_name_or_path"
        return build_reference(
            self.plan, self.mesh, self.arguments.runtime, self._teacher_source, name, quantize=d.teacher_quantization
        )

    def objective(self) -> Objective:
        """TRL's generalized JSD of `beta` at `temperature`, averaged over the completion tokens; `entropy`."""
        d = self.arguments.distillation
        loss = functools.partial(distillation_loss, beta=d.beta, temperature=d.temperature)
        return Objective(loss=loss, metrics=distillation_metrics, weight="tokens", perplexity=False)

    def data_spec(self) -> DataSpec:
        """Rows `[prompt | completion]` of tokens, as wide as each step's data (GRPO's buckets)."""
        return DataSpec(row_width=self.arguments.max_sequence_length, settings={}, extra={})

    def prepare(self) -> None:
        """Once the student exists: its prompts checked, then the teacher (loaded, sharded and checked) before
        step 1."""
        self.check_rows(self.arguments.distillation)
        self.teacher  # noqa: B018 - loaded and checked before step 1

    def evaluate(self, state=None, metric_calculator=None) -> dict[str, float]:
        """The evaluation pass (TRL's, for distillation): the student (`state`, default the trainer's) completes the
        held-out prompts (`dataset_eval`) as in training, in order, `total_batch_size` a batch (each seeded by its
        index), over up to `eval_batches` batches; the divergence to the teacher and the student's entropy over
        their completion tokens (`loss`, `entropy`), the rollouts' `completions/*` metrics and `evaluation_time`.
        `metric_calculator` is not supported here (the batches are rollouts)."""
        if metric_calculator is not None:
            raise ValueError("DistillationTrainer.evaluate: metric_calculator is not supported (its pass is rollouts)")
        if self.dataset_eval is None:
            raise ValueError(f"no dataset_eval was given; {self.no_evaluation}")
        if self.state is None:
            self.initialize_trainer_utils()
        student = self.state if state is None else self.plan.as_own(state, lambda: self.model_state)  # never swapped in
        self.start_evaluation_hook()
        started = self.evaluator.started or time.monotonic()
        sums, rollouts = self._evaluation_sums(self.model_state if student is None else student)
        tokens = max(sums["tokens"], 1.0)
        means = {k: float(np.mean([m[k] for m in rollouts])) for k in rollouts[0] if k.startswith("completions/")}
        return {
            "loss": sums["loss_sum"] / tokens,
            "entropy": sums["entropy_sum"] / tokens,
            **means,
            "evaluation_time": time.monotonic() - started,
        }

    def _evaluation_sums(self, student: js.TrainState) -> tuple[dict[str, float], list[dict[str, float]]]:
        rollouts: Any = self.batches
        records, ids = rollouts.eval_prompts()
        per = self.arguments.total_batch_size
        if len(records) < per:
            raise ValueError(
                f"dataset_eval has {len(records)} prompts; an evaluation batch takes total_batch_size = {per}"
            )
        sums: dict[str, float] = {}
        metrics = []
        for i in range(min(self.arguments.eval_batches, len(records) // per)):
            key = jax.random.fold_in(jax.random.PRNGKey(self.arguments.seed), 1_000_003 + i)
            chosen = slice(i * per, (i + 1) * per)
            drawn = rollouts.drawer.draw(records[chosen], ids[chosen], key, model=student.model)
            rows, rollout_metrics, _ = rollouts.drawer.finish(drawn)
            batch = {k: v[0] for k, v in rollouts.layout(rows, None).items()}
            with jax.set_mesh(self.mesh):
                out = jax.device_get(self.functions.evaluate(student, batch))
            for k in ("loss_sum", "tokens", "entropy_sum"):
                sums[k] = sums.get(k, 0.0) + float(out[k])
            metrics.append(rollout_metrics)
        return sums, metrics
