"""Sequence classification on every family (transformers' `*ForSequenceClassification`): the family's decoder
(`model`, the same weights as its causal LM) and `score`, a linear layer without bias from the hidden size to
`num_labels`, read at each row's last token. A reward model is one with `num_labels = 1`.

    model = jm.from_pretrained(path, task=jm.TaskType.SEQUENCE_CLASSIFICATION)  # a causal LM's files: new `score`
    scores = model(ids, attention_mask=mask).logits                               # [B, num_labels]

The row's last token is transformers' choice: the rightmost token that is not the pad token
(`config.pad_token_id`), among the real tokens (`attention_mask` / `segment_ids`). A classifier class is made
from the family's causal LM class the first time it is asked for (`registry.get_model_class(model_type,
TaskType.SEQUENCE_CLASSIFICATION)`), named as transformers names it, so an export loads in
`AutoModelForSequenceClassification`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import Linear
from .runtime import RuntimeConfig
from .tasks import TaskType

DEFAULT_LABELS = 2  # transformers' `PretrainedConfig.num_labels` when a config names none
# transformers' class names where the causal LM's name does not carry over (Gemma 3's text-only model)
_NAMES = {"Gemma3ForCausalLM": "Gemma3TextForSequenceClassification"}


@dataclasses.dataclass
class SequenceClassifierOutput:
    """What a sequence classifier returns: `logits [B, num_labels]` (float32, at each row's last token), the MoE
    `aux_loss` (None for dense models) and `expert_load` (as `CausalLMOutput`'s)."""

    logits: jax.Array
    aux_loss: jax.Array | None = None
    expert_load: dict[int, jax.Array] | None = None


def last_token(input_ids: jax.Array, token_mask: jax.Array, pad_token_id: int | None) -> jax.Array:
    """`[B]` int32: each row of `input_ids [B, T]`'s last token as transformers' sequence classifiers find it — the
    rightmost position whose id is not `pad_token_id` (None: any id), among the positions where `token_mask` is
    true; 0 when none is."""
    keep = token_mask if pad_token_id is None else token_mask & (input_ids != pad_token_id)
    positions = jnp.arange(input_ids.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(keep, positions, 0), axis=-1)


def num_labels_of(config: Any) -> int:
    """The labels a classifier of `config` scores: `config.num_labels`, or transformers' default (2)."""
    return config.num_labels if config.num_labels is not None else DEFAULT_LABELS


@functools.cache
def classifier_class(causal: Any) -> type:
    """The sequence-classification class of the causal LM class `causal`: its decoder without the output layer,
    and `score [hidden, num_labels]`; registered for its `model_type` under `TaskType.SEQUENCE_CLASSIFICATION`."""
    name = _NAMES.get(causal.__name__, causal.__name__.replace("ForCausalLM", "ForSequenceClassification"))

    def __init__(self, config, runtime: RuntimeConfig | None = None, *, rngs: nnx.Rngs):
        causal.__init__(self, config, runtime, rngs=rngs)
        labels, std = num_labels_of(config), config.initializer_range
        self.score = Linear(config.hidden_size, labels, ("embed", None), self.runtime, std=std, rngs=rngs)

    def __call__(self, input_ids, attention_mask=None, positions=None, segment_ids=None) -> SequenceClassifierOutput:
        """`input_ids [B, T]` with `attention_mask` or `segment_ids` and `positions` as the causal LM takes them;
        the scores at each row's last token (`last_token`)."""
        if segment_ids is None:
            b, t = input_ids.shape
            segment_ids = jnp.ones((b, t), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
        out = causal.__call__(self, input_ids, None, positions, segment_ids, return_hidden=True)
        index = last_token(input_ids, segment_ids != 0, self.config.pad_token_id)
        hidden = jnp.take_along_axis(out.hidden, index[:, None, None], axis=1)[:, 0]
        logits = self.score(hidden).astype(jnp.float32)
        return SequenceClassifierOutput(logits=logits, aux_loss=out.aux_loss, expert_load=out.expert_load)

    attrs: dict[str, Any] = {
        "__init__": __init__,
        "__call__": __call__,
        "__doc__": f"transformers' `{name}`: {causal.__name__}'s decoder and a `score` layer (see `classifier`).",
        "__module__": __name__,
        "__qualname__": name,
        "has_lm_head": False,
        "new_weights": ("score.weight",),
        "checkpoint_extras": ("lm_head.weight",),
    }
    cls = type(name, (causal,), attrs)
    cls.model_type, cls.task = causal.model_type, TaskType.SEQUENCE_CLASSIFICATION
    return cls


def is_classifier(model: nnx.Module) -> bool:
    """Whether `model` is a sequence classifier (a class `classifier_class` made)."""
    return getattr(type(model), "task", None) == TaskType.SEQUENCE_CLASSIFICATION


def as_sequence_classifier(
    model: nnx.Module, *, num_labels: int = 1, pad_token_id: int | None = None, seed: int = 0
) -> nnx.Module:
    """`model` as a sequence classifier of `num_labels` scores read at the last token that is not
    `pad_token_id` (None: the config's): a causal LM's decoder is kept (its arrays, not copies) and a `score` is
    drawn from `seed` (normal, `initializer_range`), its output layer left out — what transformers'
    `AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=...)` makes. A lazy model (from
    `create_model(lazy=True)`) gives a lazy classifier. A classifier is returned with `pad_token_id` set; its
    `num_labels` must be `num_labels`."""
    pad = model.config.pad_token_id if pad_token_id is None else pad_token_id
    config = model.config.replace(num_labels=num_labels, pad_token_id=pad)
    if is_classifier(model):
        if num_labels_of(model.config) != num_labels:
            raise ValueError(
                f"the model is a classifier of {num_labels_of(model.config)} labels; expected {num_labels} "
                "(a reward model scores one)"
            )
        model.config = config
        return model
    cls = classifier_class(type(model))
    old = nnx.state(model, nnx.Param)
    new = nnx.eval_shape(lambda: cls(config, model.runtime, rngs=nnx.Rngs(seed)))
    leaves = jax.tree_util.tree_leaves(old)
    if not leaves or isinstance(leaves[0], jax.ShapeDtypeStruct):  # a lazy model: a lazy classifier
        return new
    graphdef, params, rest = nnx.split(new, nnx.Param, ...)  # type: ignore[misc]
    kept = dict(nnx.to_flat_state(old))
    key = jax.random.PRNGKey(seed)

    def fill(path, var):
        if path in kept:
            return var.replace(value=kept[path].get_value())
        std = config.initializer_range
        return var.replace(value=(std * jax.random.normal(key, var.shape, jnp.float32)).astype(var.get_value().dtype))

    flat = [(path, fill(path, var)) for path, var in nnx.to_flat_state(params)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)
