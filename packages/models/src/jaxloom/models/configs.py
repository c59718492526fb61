"""Architecture configs with Hugging Face field names. No dtypes, meshes or kernels here: see `RuntimeConfig`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from jaxloom.core.schema import config

# HF config.json keys that carry no architecture and are accepted and dropped on load.
_IGNORED_HF_KEYS = {
    "architectures",
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "attention_dropout",
    "pretraining_tp",
    "output_router_logits",
    "router_jitter_noise",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "is_encoder_decoder",
    "chunk_size_feed_forward",
    "tie_encoder_decoder",
    "task_specific_params",
    "prefix",
    "sep_token_id",
    "decoder_start_token_id",
    "layer_types",
    "max_window_layers",
    "use_sliding_window",
    "model_type",
    "rope_parameters",
    # read by nothing in transformers' implementation of these families, so ignored there too
    "is_llama_config",  # SmolLM2 (nanotron's export)
    "rope_interleaved",  # SmolLM2 (nanotron's export)
    "use_mrope",  # Qwen2.5 / DeepSeek-R1-Distill-Qwen: false (true is Qwen2-VL's multimodal RoPE: refused by Qwen2)
}

# rope_scaling keys each RoPE type reads (transformers' modeling_rope_utils); any other key is refused by name, so a
# setting that changes the computation is never read and dropped. `required` keys must be there.
_ROPE_KEYS = {
    "linear": ({"factor"}, {"factor"}),
    "dynamic": ({"factor", "original_max_position_embeddings"}, {"factor"}),
    "llama3": (
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    ),
    "yarn": (
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        },
        {"original_max_position_embeddings"},
    ),
}


class FrozenDict(dict):
    """A dict that can be hashed (its values must be hashable); used for `rope_scaling`."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def _readonly(self, *a, **k):
        raise TypeError("this dict is frozen")

    __setitem__ = __delitem__ = update = pop = clear = setdefault = _readonly  # type: ignore[assignment]


@config
class LlamaConfig:
    """Llama architecture. Field names and meanings are those of `transformers.LlamaConfig`.

    Arguments, grouped:

    - `vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`: vocabulary, model width, MLP width
      and depth.
    - `num_attention_heads`, `num_key_value_heads`, `head_dim`: query heads, key/value heads (grouped-query
      attention; None: as many as query heads) and per-head width (None: hidden_size / heads).
    - `hidden_act`: the MLP activation (`silu`, `gelu`, ...).
    - `max_position_embeddings`: the longest sequence; RoPE tables and KV caches are sized from it.
    - `initializer_range`: standard deviation of the normal initialiser.
    - `rms_norm_eps`: RMSNorm epsilon.
    - `rope_theta`, `rope_scaling`: RoPE base and scaling (`{"rope_type": "llama3" | "linear" | ...}`).
    - `tie_word_embeddings`: the output projection reuses the input embedding.
    - `attention_bias`, `mlp_bias`: biases on the attention and MLP projections.
    - `sliding_window`: attend only to this many previous tokens (None: all).
    - `bos_token_id`, `eos_token_id`, `pad_token_id`: special tokens, kept for export and generation.
    """

    model_type: ClassVar[str] = "llama"

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        # Hashable forms: configs are static data under jit.
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", FrozenDict(self.rope_scaling))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{type(self).__name__}.{name} = {value!r}; expected a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{type(self).__name__}: num_attention_heads {self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads {self.num_key_value_heads}"
            )
        if self.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh", "relu"):
            raise ValueError(f"hidden_act {self.hidden_act!r}; expected silu, gelu, gelu_pytorch_tanh or relu")
        for name in ("rope_theta", "rms_norm_eps"):  # 0 gives NaN after a whole step, not an error
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ValueError(f"{type(self).__name__}.{name} = {value!r}; expected a positive finite number")
        if self.rope_scaling is not None:
            _check_rope_scaling(type(self).__name__, self.rope_scaling)

    # Which projections carry a bias, per family.
    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    def replace(self, **changes: Any):
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any]):
        """From `data`, a `config.json` dict (transformers 4 or 5 layout). Unknown keys are an error."""
        data = dict(data)
        rope = data.pop("rope_parameters", None)
        if rope:  # transformers 5: theta and scaling live together
            data.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default":
                data.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
        scaling = data.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            data["rope_scaling"] = None
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in fields and k not in _IGNORED_HF_KEYS)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown config key(s) {unknown}; expected some of {sorted(fields)}")
        data = cls.family_adjust(data)
        # Checked and converted by the fields' types ("1e-5" from YAML is a float; 3.5 is not an int).
        return cls(**{k: v for k, v in data.items() if k in fields})

    @classmethod
    def family_adjust(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Family-specific fix-ups of `data` (a `config.json` dict) before it is read; none for Llama."""
        return data

    def to_hf_dict(self) -> dict[str, Any]:
        """The config as a `transformers` config.json mapping (with `model_type`). A field that is None where
        the family's default is not (Mistral's `sliding_window: null`) is written out: left out, transformers
        would read the default back (a 4096-token window on a model trained without one)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out = {k: dict(v) if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v for k, v in out.items()}
        out["model_type"] = self.model_type
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope.update(dict(self.rope_scaling))
            rope["rope_type"] = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        out["rope_parameters"] = rope
        explicit = {f.name for f in dataclasses.fields(self) if f.default is not None}
        return {k: v for k, v in out.items() if v is not None or k in explicit}

    @classmethod
    def from_pretrained(cls, path: str | Path):
        """Read `path`: a model directory's `config.json`, or the file itself."""
        file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {file}")
        return cls.from_hf_dict(json.loads(file.read_text()))

    def save_pretrained(self, path: str | Path) -> Path:
        """Write `config.json` into directory `path` (created if needed)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        file = Path(path) / "config.json"
        file.write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True))
        return file


@config
class MistralConfig(LlamaConfig):
    """Mistral: Llama with sliding-window attention (`sliding_window`, default 4096); the other fields
    are `LlamaConfig`'s."""

    model_type: ClassVar[str] = "mistral"
    sliding_window: int | None = 4096


@config
class Qwen2Config(LlamaConfig):
    """Qwen2: Llama with biases on q, k and v (not o); the fields are `LlamaConfig`'s."""

    model_type: ClassVar[str] = "qwen2"
    attention_bias: bool = True

    @property
    def o_bias(self) -> bool:
        return False

    @classmethod
    def family_adjust(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Qwen2's `config.json` (`data`) keeps a window size even when `use_sliding_window` is false; with it
        true, the window applies to the layers from `max_window_layers` on (or those `layer_types` marks
        `sliding_attention`), as transformers reads it. Every layer windowed, or none, is a model jaxloom runs
        exactly; a mix of windowed and full layers is refused (not silently windowed everywhere)."""
        if data.get("use_mrope"):
            raise ValueError(
                "Qwen2Config: use_mrope = true is Qwen2-VL's multimodal RoPE, which jaxloom does not implement; "
                "expected use_mrope false (the text models' config says so)"
            )
        data.setdefault("attention_bias", True)
        window = data.get("sliding_window", 4096) if data.get("use_sliding_window", False) else None
        if window is None:
            data["sliding_window"] = None
            return data
        layers = int(data.get("num_hidden_layers", 32))
        first = int(data.get("max_window_layers", 28))
        kinds = data.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)
        ]
        windowed = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
        if not windowed:
            data["sliding_window"] = None
        elif len(windowed) != len(kinds):
            raise ValueError(
                f"Qwen2Config: use_sliding_window = true with a window on layers {windowed[0]}..{windowed[-1]} only "
                f"(max_window_layers = {first}, layer_types) and full attention on the others; jaxloom applies one "
                "attention pattern to every layer, so this model would be computed wrongly. Expected every layer "
                "windowed (max_window_layers = 0) or none (use_sliding_window = false)"
            )
        return data


@config
class MixtralConfig(LlamaConfig):
    """Mixtral: sparse MoE feed-forward, top-k routing over `num_local_experts` experts with
    `num_experts_per_tok` chosen per token and a load-balancing loss weighted by `router_aux_loss_coef`;
    the other fields are `LlamaConfig`'s."""

    model_type: ClassVar[str] = "mixtral"
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"MixtralConfig: num_experts_per_tok {self.num_experts_per_tok} must be in "
                f"[1, num_local_experts={self.num_local_experts}]"
            )

    @property
    def num_experts(self) -> int:
        return self.num_local_experts


def _check_rope_scaling(owner: str, scaling: Mapping[str, Any]) -> None:
    """`rope_scaling` names a type jaxloom implements, with the keys that type reads (all required ones, no
    other): one error naming the key otherwise, before a model is built."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return
    if kind not in _ROPE_KEYS:
        raise ValueError(f"{owner}: rope_scaling type {kind!r}; expected default, linear, dynamic, llama3 or yarn")
    known, required = _ROPE_KEYS[kind]
    given = set(scaling) - {"rope_type", "type", "rope_theta"}
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"{owner}: rope_scaling partial_rotary_factor = {partial!r}: rotating part of each head is not "
            "implemented; expected 1.0"
        )
    unknown = sorted(given - known - {"partial_rotary_factor"})
    if unknown:
        raise ValueError(
            f"{owner}: rope_scaling key(s) {unknown} for rope_type {kind!r}, which reads {sorted(known)}; a key that "
            "changes the computation is never ignored: remove it, or use a rope_type that reads it"
        )
    missing = sorted(required - given)
    if missing:
        raise ValueError(f"{owner}: rope_scaling of rope_type {kind!r} needs {missing} (it has {sorted(given)})")
    for key in given - {"truncate"}:
        value = scaling[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0):
            raise ValueError(f"{owner}: rope_scaling {key} = {value!r}; expected a positive number")


CONFIG_CLASSES: dict[str, type[LlamaConfig]] = {
    c.model_type: c for c in (LlamaConfig, MistralConfig, Qwen2Config, MixtralConfig)
}
"""`model_type` (as in `config.json`) → its config class."""


def config_from_hf_dict(data: Mapping[str, Any]) -> LlamaConfig:
    """The right config class for `data["model_type"]`."""
    kind = data.get("model_type")
    if kind not in CONFIG_CLASSES:
        raise ValueError(f"model_type {kind!r} is not supported; known: {sorted(CONFIG_CLASSES)}")
    return CONFIG_CLASSES[kind].from_hf_dict(data)
