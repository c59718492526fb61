"""`GRPOTrainer`: the core of `BaseTrainer` with GRPO's objective and its rollout stage (`RewardedRollouts`), and
the rollouts' builder of the kinds that sample like it (`rollouts_of`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any


from ..batches import DataSpec
from ..step import Objective
from ..components import Later, part
from ..run_state import RunState
from ..trainer import BaseTrainer
from .config import GRPOConfig
from .kind import RewardedRollouts
from .loss import grpo_loss, grpo_metrics
from .rollouts import Policy, Rollouts


log = logging.getLogger("jaxloom.trainer")


def rollouts_of(kind: type[Rollouts]) -> Callable[..., Rollouts]:
    """The batches component's builder of a kind that samples like GRPO: rollouts of the policy from the prompts,
    scored by the reward functions, made by `kind` (the rollout stage's class: a kind that scores otherwise gives
    its own)."""

    def rollouts(
        *,
        arguments: GRPOConfig,
        data_spec: Callable[[], DataSpec],
        mesh: Any,
        data_axes: Any,
        tokenizer: Later[Any],
        dataset_train: Any,
        dataset_eval: Any,
        run: RunState,
        rollout_engine: Callable | None,
        logps_of: Callable[..., Any],
        reward_functions: Later[list[Callable]],
        reward_weights: Later[list[float]],
        tool_set: Later[Any],
        environments: Later[Any],
        custom_rollout: Later[Any],
    ) -> Rollouts:
        """The run's rollouts (`Rollouts`): the policy's completions of the step's prompts, scored."""
        return kind(
            arguments,
            data_spec(),
            mesh=mesh,
            data_axes=data_axes,
            tokenizer=tokenizer,
            dataset_train=dataset_train,
            dataset_eval=dataset_eval,
            engine=rollout_engine,
            policy=Policy(
                state=lambda: run.state,
                step=lambda: run.step,
                logps=logps_of,
                rewards=lambda: (reward_functions(), reward_weights()),
                tools=tool_set,
                environments=environments,
                rollout=custom_rollout,
            ),
        )

    return rollouts


rollouts = rollouts_of(Rollouts)


class GRPOTrainer(RewardedRollouts, BaseTrainer):
    """Online RL with reward functions (TRL's `GRPOTrainer` names): `reward_funcs` are callables
    `(prompts, completions, **columns) -> list[float]` or dotted import paths (also `arguments.reward_funcs`),
    weighted by `reward_weights`; `dataset_train` holds prompt records (`prompt`: text or chat messages; other
    columns reach the rewards). Arguments otherwise as `BaseTrainer`'s; `arguments` is a `GRPOConfig`;
    `rollout_engine(prompt_ids, prompt_mask, key) -> (completion_ids, completion_mask)` replaces the
    in-process generation (the seam for an external engine); `tools` (also `arguments.tools`): functions the model
    may call during its completions of chat prompts (TRL's; `grpo.tools`, docs/rl.md); `environment_factory` (also
    `arguments.environment_factory`): environments whose methods are the tools of each rollout row, with their own
    reward (TRL's; `grpo.environments`); `rollout_func(prompts, trainer)` (also `arguments.rollout_func`): a custom
    rollout returning TRL's fields."""

    MATCH_BOS = True

    arguments_class = GRPOConfig
    batches = part(rollouts)  # type: ignore[assignment]

    def objective(self) -> Objective:
        """The GRPO loss of `loss_type`; TRL's metrics (`kl`, `clip_ratio`, `entropy`)."""
        rl = self.arguments.rl
        loss = functools.partial(grpo_loss, rl=rl, iterations=rl.num_iterations)
        return Objective(loss=loss, metrics=grpo_metrics, weight="units", perplexity=False)
