"""The pieces the kinds that sample their rows share, each a mixin with a home of its own (no kind subclasses
another kind): `SamplingKind` — rows sampled from the policy, as wide as each step's data (the step compiled per
width), the training mesh beside the sampling devices, the rollouts' metrics, the prompts checked before step 1 —
and `RewardedRollouts` — TRL's inputs of an RL kind (reward functions, tools, environments, a custom rollout, a
rollout engine), the policy's and the reference's per-token log-probs, the rewarded evaluation pass. `GRPOTrainer`
and `RLOOTrainer` are `RewardedRollouts` with their objectives; `DistillationTrainer` a `SamplingKind` with a
teacher."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import jaxloom.state as js
from jaxloom.mesh import MeshConfig

from .. import reference
from ..batches import DataSpec
from ..reference import build_reference
from .loss import ADV, OLD, REF, ROUTES, SAMPLED, token_logps
from .rewards import load_reward_function, load_tool
from .sampler import routes_shape, sampling_devices

if TYPE_CHECKING:
    from ..trainer import BaseTrainer as _Core
else:
    _Core = object

__all__ = ["RewardedRollouts", "SamplingKind"]
log = logging.getLogger("jaxloom.trainer")


class SamplingKind(_Core):
    """What a kind that samples its rows from the policy adds to the core (mixed in before `BaseTrainer`)."""

    no_evaluation = "expected held-out prompt records: dataset_eval= (data.eval=FILE on the command line)"
    WIDTH_PER_STEP: ClassVar[bool] = True

    @property
    def mesh(self):
        """The training mesh: with `sampling_devices = n` (and none given), the one the arguments describe built over
        the devices the sampler does not take — the first `n / processes` devices of each process (`Sampler.mesh`)."""
        n = getattr(getattr(self.arguments, "rl", None), "sampling_devices", 0)  # distillation's settings have none
        if n and self._mesh is None:
            if n >= jax.device_count():
                raise ValueError(
                    f"sampling_devices = {n} of {jax.device_count()} devices leaves none to train on; expected fewer"
                )
            a = self.arguments
            layout = MeshConfig(a.sharding_axis_dims, a.sharding_axis_names, a.sharding_dcn_axis_dims)
            sampling = set(sampling_devices(n))
            self._mesh = layout.build([d for d in jax.devices() if d not in sampling])
        return super().mesh

    def data_metrics(self, step: int | None = None) -> dict[str, float]:
        """The rollouts' metrics under TRL's names, for the log row of `step` (averaged over the steps since the last
        row): `completions/mean_length`, `completions/clipped_ratio`, `prompts/truncated`, `time/rollout_s`, and
        for rewarded rollouts `reward`, `reward_std`, `rewards/<func>/mean`, `time/reward_s`."""
        return self.batches.take_metrics(step)  # type: ignore[attr-defined]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Where a completion ends: the tokenizer's EOS and, for chat prompts, the template's end of turn."""
        return self.batches.stop_ids()  # type: ignore[attr-defined]

    def check_rows(self, settings) -> None:
        """Before step 1: the prompt records are read and checked, and the longest prompt plus `settings`'
        `max_completion_length` fits the model's positions (else one error naming the record and what to lower)."""
        self.batches.prompt_records()  # type: ignore[attr-defined]
        positions = self.plan.config.max_position_embeddings
        prompt = self.batches.longest_prompt()  # type: ignore[attr-defined]
        if prompt + settings.max_completion_length > positions:
            ids = self.batches.prompt_ids()  # type: ignore[attr-defined]
            which = max(range(len(ids)), key=lambda i: len(ids[i]))
            cap = settings.max_prompt_length
            said = (
                f"max_prompt_length = {cap}"
                if cap is not None and cap < len(ids[which])
                else f"the longest prompt (record {which}) is {prompt} tokens"
            )
            raise ValueError(
                f"{said}, + max_completion_length = {settings.max_completion_length} is "
                f"{prompt + settings.max_completion_length}; expected at most the model's max_position_embeddings "
                f"({positions}): lower max_completion_length, or set max_prompt_length to cut prompts (their start "
                "is dropped, and counted)"
            )


class RewardedRollouts(SamplingKind):
    """TRL's RL inputs and the rewarded rollouts' machinery (see the module docstring), for a kind whose `batches`
    are `Rollouts` (`grpo.trainer.rollouts_of`)."""

    def take_inputs(
        self,
        *,
        reward_funcs: Any = None,
        rollout_engine: Callable | None = None,
        tools: Any = None,
        environment_factory: Any = None,
        rollout_func: Any = None,
    ) -> None:
        """`reward_funcs` (default: `arguments.reward_funcs`): callables, checked now, or dotted paths, imported
        when the run trains; `tools` (default: `arguments.tools`): functions the model may call (TRL's), callables
        or dotted paths; `environment_factory` and `rollout_func` (defaults: the arguments'), TRL's, likewise
        callables or dotted paths (imported, and the environments made, when the run trains); `rollout_engine`:
        see the class. GRPO builds its rows from rollouts: a `data_collator` is refused."""
        if self.data_collator is not None:
            raise ValueError("GRPOTrainer builds its rows from rollouts: data_collator is not used; drop it")
        rl = self.arguments.rl
        if rl.loss_type == "luspo" and rl.importance_sampling_level != "sequence":
            log.warning("loss_type='luspo' is the paper's with importance_sampling_level='sequence'")  # as TRL warns
        if rl.loss_type == "vespo" and rl.importance_sampling_level != "token":
            log.warning(  # as TRL warns
                "loss_type='vespo' makes its own weight per sequence: importance_sampling_level should be 'token'"
            )
        if rl.importance_sampling_level == "sequence" and rl.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            log.warning(  # as TRL warns
                "importance_sampling_level='sequence' with loss_type=%r sums per-token terms, weighting each "
                "sequence by its length rather than GSPO's per-sequence objective; loss_type='grpo' is GSPO's setup",
                rl.loss_type,
            )
        self._environment_spec = environment_factory if environment_factory is not None else rl.environment_factory
        self._rollout_spec = rollout_func if rollout_func is not None else rl.rollout_func
        given = reward_funcs if reward_funcs is not None else rl.reward_funcs
        given = [given] if callable(given) or isinstance(given, str) else list(given or [])
        if not given and self._environment_spec is None:
            raise ValueError(
                "GRPO needs reward_funcs: callables or dotted paths (reward_funcs=my_rewards.accuracy), or an "
                "environment_factory whose environment defines get_reward"
            )
        for f in given:  # callables are checked now; paths are imported when the run trains (see reward_functions)
            if not isinstance(f, str):
                load_reward_function(f)
        self._reward_specs = given
        weights = rl.reward_weights
        if weights is not None and len(weights) != len(given):
            raise ValueError(f"reward_weights has {len(weights)} weights for {len(given)} reward functions")
        self.reward_weights = list(weights) if weights is not None else [1.0] * len(given)
        self.rollout_engine = rollout_engine
        self._reference: js.TrainState | None = None
        given_tools = tools if tools is not None else rl.tools
        self._tool_specs = (
            [given_tools] if callable(given_tools) or isinstance(given_tools, str) else list(given_tools or [])
        )
        custom = [n for n, v in (("tools", self._tool_specs), ("environment_factory", self._environment_spec)) if v]
        if custom and rollout_engine is not None:
            raise ValueError(
                f"{' and '.join(custom)} run in jaxloom's own rollouts: a rollout_engine with them is not supported"
            )
        if rl.max_staleness and not rl.vllm_importance_sampling_correction and rollout_engine is None:
            log.warning(
                "max_staleness = %d without vllm_importance_sampling_correction: rows sampled by an older policy are "
                "trained on uncorrected; set vllm_importance_sampling_correction=true (e.g. with "
                "vllm_importance_sampling_mode='token_truncate'; docs/rl.md)",
                rl.max_staleness,
            )
        if self._rollout_spec is not None and rollout_engine is not None:
            raise ValueError("rollout_func and rollout_engine both replace the generation: give one")
        replaced = [n for n, v in (("rollout_engine", rollout_engine), ("rollout_func", self._rollout_spec)) if v]
        if rl.routing_replay and replaced:
            raise ValueError(
                f"routing_replay = true with {' and '.join(replaced)}: the experts are recorded by jaxloom's own "
                "sampler; drop routing_replay, or sample in process"
            )
        drawn_whole = {
            "rollout_engine": rollout_engine,
            "rollout_func": self._rollout_spec,
            "tools": self._tool_specs,
            "environment_factory": self._environment_spec,
            "routing_replay": rl.routing_replay,
        }
        whole = [name for name, given in drawn_whole.items() if given]
        if rl.partial_rollout_tokens and whole:
            raise ValueError(
                f"partial_rollout_tokens = {rl.partial_rollout_tokens} with {' and '.join(whole)}: a partial rollout "
                "continues jaxloom's own sampler's completions under each new version, one generation per version "
                "(no tool turn, no recorded experts); drop partial_rollout_tokens, or those"
            )
        corrections = ["vllm_importance_sampling_correction"] if rl.vllm_importance_sampling_correction else []
        corrections += ["off_policy_mask_threshold"] if rl.off_policy_mask_threshold is not None else []
        if corrections and rollout_engine is not None:
            raise ValueError(
                f"{' and '.join(corrections)} correct the sampler by its log-probs, which a rollout_engine does not "
                "give; drop them, or sample in process"
            )

    INPUTS: ClassVar[dict[str, str]] = {
        name: name
        for name in ("rollout_engine", "logps_of", "reward_functions", "reward_weights", "tool_set", "environments")
    } | {"custom_rollout": "custom_rollout"}

    @functools.cached_property
    def reward_functions(self) -> list[Callable]:
        """The reward functions, dotted paths imported (user code runs): only when the run trains (at setup,
        before step 1) or is evaluated — never by a command that only reads a run (`convert`, `generate`, `plan`),
        so a run directory from elsewhere cannot make those import anything. A reward model's directory is read
        sharded over the training mesh (`RewardModel`). An environment that owns its reward (`get_reward`) adds
        one, of weight 1, named after its class (TRL's)."""
        funcs = [load_reward_function(f, mesh=self.mesh, data_axes=self.data_axes) for f in self._reward_specs]
        owned = self.environments.reward_functions() if self.environments is not None else []
        if not funcs and not owned:
            raise ValueError(
                "GRPO needs a reward: reward_funcs, or an environment_factory whose environment defines get_reward "
                "(its environments define none)"
            )
        self.reward_weights = [*self.reward_weights[: len(funcs)], *[1.0] * len(owned)]
        return [*funcs, *owned]

    @functools.cached_property
    def tool_set(self) -> Any:
        """The tools the model may call (`grpo.tools.ToolSet`: their schemas for the chat template, its tool-call
        format, calls with `tool_timeout`), dotted paths imported when the run trains; None without tools (or
        with environments: their `Environments` holds the tools of each row)."""
        if not self._tool_specs or self._environment_spec is not None:
            return None
        from .tools import ToolSet

        rl = self.arguments.rl
        return ToolSet(self._standalone_tools, self.tokenizer, timeout=rl.tool_timeout, workers=self._tool_workers)

    @functools.cached_property
    def _standalone_tools(self) -> list[Callable]:
        return [load_tool(t) for t in self._tool_specs]

    @functools.cached_property
    def _tool_workers(self) -> Any:
        """The threads of the run's tool calls (`grpo.tools.ToolWorkers`, `tool_workers` of them at most)."""
        from .tools import ToolWorkers

        return ToolWorkers(self.arguments.rl.tool_workers)

    @functools.cached_property
    def environments(self) -> Any:
        """The environments of the rollouts (`grpo.environments.Environments`, TRL's `environment_factory`), dotted
        paths imported and one instance of each made and checked when the run trains; None without them."""
        spec = self._environment_spec
        if spec is None:
            return None
        from .environments import Environments

        what = "environment_factory"
        factories = (
            {str(k): load_tool(v, f"{what}[{k!r}]") for k, v in spec.items()}
            if isinstance(spec, dict)
            else load_tool(spec, what)
        )
        envs = Environments(
            factories,
            tools=self._standalone_tools,
            tokenizer=self.tokenizer,
            timeout=self.arguments.rl.tool_timeout,
            workers=self._tool_workers,
        )
        envs.probe()
        return envs

    @functools.cached_property
    def custom_rollout(self) -> Callable | None:
        """TRL's `rollout_func` bound to this trainer (`prompts -> dict`), imported when the run trains; or None."""
        if self._rollout_spec is None:
            return None
        fn = load_tool(self._rollout_spec, "rollout_func")

        def bound(prompts: list) -> Any:
            return fn(prompts, self)

        bound.__name__ = getattr(fn, "__name__", type(fn).__name__)  # errors name the user's function
        return bound

    def data_spec(self) -> DataSpec:
        """Rows `[prompt | completion]`, with the advantage per row and the old, reference and (in-process
        generation) sampler log-probs per token. `row_width` is `max_sequence_length`, the widest row the caps
        allow; each step's rows are as wide as its data (`row_buckets`), its step compiled per width."""
        a = self.arguments
        width = a.max_sequence_length
        extra = {ADV: ((), np.float32), OLD: ((width,), np.float32), REF: ((width,), np.float32)}
        if self.rollout_engine is None:
            extra[SAMPLED] = ((width,), np.float32)
            routed = routes_shape(self.model.config)  # the model's config, not the plan's: the plan counts the steps
            if routed is not None:  # the sampler records the experts
                extra[ROUTES] = ((width, *routed), np.int16)
        if a.rl.routing_replay and ROUTES not in extra:
            raise ValueError(
                f"routing_replay = true, but the policy ({type(self.model.config).__name__}) routes no tokens to "
                "experts; expected a mixture-of-experts model (Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS) or "
                "routing_replay = false"
            )
        spec = DataSpec(row_width=width, settings={}, extra=extra)
        if hasattr(self.model, "image_shape"):  # image prompts, shown in each group's one prefill
            given = {"rollout_engine": self.rollout_engine, "tools": a.rl.tools, "rollout_func": a.rl.rollout_func,
                     "environment_factory": a.rl.environment_factory}  # fmt: skip
            unsupported = [n for n, v in given.items() if v]
            if unsupported or a.rl.max_staleness or a.rl.generation_backend != "static":
                raise ValueError(
                    f"{type(self.model).__name__}'s image prompts are rolled out by the static sampler, synchronously "
                    "and without tools, environments, a rollout_func or a rollout_engine (so far); got "
                    f"{unsupported + (['max_staleness'] if a.rl.max_staleness else [])} "
                    f"generation_backend={a.rl.generation_backend!r}"
                )
            spec = self.with_images(spec)
        return spec

    def evaluate(self, state: js.TrainState | None = None, metric_calculator=None) -> dict[str, float]:
        """GRPO's evaluation pass (TRL's): completions of the held-out prompts (`dataset_eval`) sampled from
        `state` (default: the trainer's) as in training, scored by the reward functions, over up to
        `eval_batches` groups of prompts; TRL's rollout metrics (`reward`, `reward_std`, `rewards/<func>/mean`,
        `completions/mean_length`, `completions/clipped_ratio`) and `evaluation_time`. `metric_calculator` is
        not supported here (there is no loss batch to give it)."""
        if metric_calculator is not None:
            raise ValueError("GRPOTrainer.evaluate: metric_calculator is not supported (its pass scores rollouts)")
        if self.dataset_eval is None:
            raise ValueError(f"no dataset_eval was given; {self.no_evaluation}")
        if self.state is None:
            self.initialize_trainer_utils()
        model = None if state is None else self.plan.as_own(state, lambda: self.model_state).model  # never swapped in
        self.start_evaluation_hook()
        started = self.evaluator.started
        metrics = self.batches.evaluate(self.arguments.eval_batches, model)  # type: ignore[attr-defined]
        return {**metrics, "evaluation_time": time.monotonic() - (started or time.monotonic())}

    def prepare(self) -> None:
        """Once the policy exists: the environments, the custom rollout, the prompts' check, the reward functions
        (imported and checked before step 1), then (with `beta > 0`) the reference: the base with the adapters off
        under LoRA (no copy), `ref_model`, or the initial policy (rebuilt from its source on every start, never
        checkpointed)."""
        a = self.arguments
        self.environments  # noqa: B018 - made and checked before step 1, as the tools and rewards below
        self.custom_rollout  # noqa: B018
        self.check_rows(a.rl)
        self.reward_functions  # noqa: B018 - imported and checked before step 1
        if a.rl.beta and self._reference is None and self.plan.lora is None:
            self._reference = build_reference(self.plan, self.mesh, a.runtime, a.rl.ref_model)

    @functools.cached_property
    def _logps_fn(self):
        temperature = self.arguments.rl.temperature
        fused = dict(block_size=self.arguments.loss_block_size, data_shards=self.data_shards())

        def fn(state, batch, adapters_off, replay):
            if adapters_off:
                state = reference.adapters_off(state)
            rows = {k: batch[k][0] for k in ("input_ids", "positions", "segment_ids", ROUTES) if k in batch}
            logp, _, _ = token_logps(state.model, rows, temperature, **fused, replay=replay)
            return jnp.pad(logp, ((0, 0), (1, 0)))[None]  # aligned with the row's tokens: column 0 predicts nothing

        return jax.jit(fn, static_argnums=(2, 3))

    def logps_of(self, batch: dict[str, jax.Array], *, reference: bool) -> jax.Array:
        """Per-token log-probs `[1, B, L]` of the rollout rows of `batch`: the policy's now (the old log-probs
        of `num_iterations`, the sampler's experts replayed with `routing_replay`), or with `reference` the
        reference's (its own routing)."""
        with jax.set_mesh(self.mesh):
            if not reference:
                return self._logps_fn(self.state, batch, False, self.arguments.rl.routing_replay)
            if self._reference is None:  # LoRA: the base is the policy with its adapters off
                return self._logps_fn(self.state, batch, True, False)
            return self._logps_fn(self._reference, batch, False, False)
