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
    "cache_implementation",  # which KV cache class transformers' generate() builds (Gemma: "hybrid")
    "rope_parameters",
    # read by nothing in transformers' implementation of these families, so ignored there too
    "is_llama_config",  # SmolLM2 (nanotron's export)
    "rope_interleaved",  # SmolLM2 (nanotron's export)
    "use_mrope",  # Qwen2.5 / DeepSeek-R1-Distill-Qwen: false (true is Qwen2-VL's multimodal RoPE: refused by Qwen2)
}

# Keys whose only effect is dropout in training, which jaxloom does not implement: 0 (or absent) is accepted, any
# other value refused by name (a model trained with dropout would otherwise be silently trained without it).
_ZERO_ONLY_HF_KEYS = ("attention_dropout", "resid_pdrop", "embd_pdrop", "hidden_dropout", "embedding_dropout")

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
    "longrope": (
        {"long_factor", "short_factor", "original_max_position_embeddings", "factor", "attention_factor"},
        {"long_factor", "short_factor", "original_max_position_embeddings"},
    ),
}
_ROPE_LIST_KEYS = {"long_factor", "short_factor"}  # one positive number per rotated pair of a head


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
    - `bos_token_id`, `eos_token_id`, `pad_token_id`: special tokens, kept for export and generation (a sequence
      classifier reads its score at the last token that is not `pad_token_id`).
    - `num_labels`: the scores of a sequence classifier (`id2label` in config.json; None: transformers' 2).
    """

    model_type: ClassVar[str] = "llama"
    # The layer types `attention_types()` may name (transformers' `layer_types` values; SmolLM3 adds NoPE forms).
    attention_kinds: ClassVar[tuple[str, ...]] = ("full_attention", "sliding_attention")
    # How the family computes, beyond its fields (see `DecoderLayer`, `Attention`, `RMSNorm`):
    norm_style: ClassVar[str] = "llama"  # llama | olmo | gemma (1 + w)
    block_norms: ClassVar[str] = "pre"  # pre | sandwich (Gemma) | post (OLMo 2)
    qk_norm: ClassVar[str | None] = None  # None | head (Qwen3, Gemma 3) | projection (OLMo 2)
    fused_projections: ClassVar[bool] = False  # HF stores qkv_proj and gate_up_proj fused (Phi-3)
    attention_sinks: ClassVar[bool] = False  # a learned sink logit per head joins each softmax (GPT-OSS)
    # config.json keys transformers accepts for this family and never reads (beyond the common ones)
    ignored_keys: ClassVar[frozenset[str]] = frozenset()
    # `(prefix, file prefix)`: where parameters under `prefix` lie in the family's files (Gemma 3's language model
    # `model.` is `language_model.model.` there); the names `hf.hf_sources` gives, read and written
    checkpoint_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()

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
    num_labels: int | None = None

    def __post_init__(self) -> None:
        # Hashable forms: configs are static data under jit.
        if isinstance(self.rope_scaling, dict):
            frozen = {k: tuple(v) if isinstance(v, list) else v for k, v in self.rope_scaling.items()}
            object.__setattr__(self, "rope_scaling", FrozenDict(frozen))
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
            _check_rope_scaling(type(self).__name__, self.rope_scaling, self.head_dim or 0)
        for kind in dict.fromkeys(self.attention_types()):
            if kind not in self.attention_kinds:
                raise ValueError(
                    f"{type(self).__name__}: layer type {kind!r}; expected " + " or ".join(self.attention_kinds)
                )
        if len(self.attention_types()) != self.num_hidden_layers:
            raise ValueError(
                f"{type(self).__name__}: layer_types has {len(self.attention_types())} entries for "
                f"{self.num_hidden_layers} layers (num_hidden_layers); expected one per layer"
            )

    # ---- how the family computes (overridden per family) -------------------------------------------
    def attention_types(self) -> tuple[str, ...]:
        """Per decoder layer, `full_attention` or `sliding_attention` (transformers' `layer_types`)."""
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return (kind,) * self.num_hidden_layers

    def window_of(self, kind: str) -> int | None:
        """The attention window of a layer of type `kind` (None: the whole sequence)."""
        return self.sliding_window if kind == "sliding_attention" else None

    def rope_of(self, kind: str) -> tuple[float, Any]:
        """`(rope_theta, rope_scaling)` of a layer of type `kind` (Gemma 3's local layers have their own)."""
        del kind
        return self.rope_theta, self.rope_scaling

    def uses_rope(self, kind: str) -> bool:
        """Whether a layer of type `kind` rotates q and k (SmolLM3's NoPE layers do not)."""
        del kind
        return True

    @property
    def mlp_activation(self) -> str:
        """The feed-forward activation (Gemma reads `hidden_activation`)."""
        return self.hidden_act

    @property
    def embedding_multiplier(self) -> float | None:
        """Input embeddings are multiplied by this (Gemma: `sqrt(hidden_size)`); None: not scaled."""
        return None

    @property
    def attention_scale(self) -> float | None:
        """The attention logits' scale (None: `1/sqrt(head_dim)`)."""
        return None

    @property
    def attention_softcap(self) -> float | None:
        """Attention logits become `cap · tanh(logits / cap)` (Gemma 2); None: not capped."""
        return None

    @property
    def final_softcap(self) -> float | None:
        """Output logits become `cap · tanh(logits / cap)` (Gemma 2); None: not capped."""
        return None

    @property
    def kv_cache_dims(self) -> tuple[int, int]:
        """`(heads, width)` of each cached key (DeepSeek-V3 caches its compressed latent: one head of
        `kv_lora_rank + qk_rope_head_dim`)."""
        return int(self.num_key_value_heads or 0), int(self.head_dim or 0)

    @property
    def value_cache_dims(self) -> tuple[int, int]:
        """`(heads, width)` of each cached value (as the keys'; none for DeepSeek-V3, whose latent is both)."""
        return self.kv_cache_dims

    @property
    def attention_matmul_params(self) -> int:
        """The weights one layer's attention multiplies by (q, k, v, o), for `flops_per_token`."""
        d, n, kv, h = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        return d * (n * h) * 2 + d * (kv * h) * 2

    @property
    def attention_score_dims(self) -> int:
        """Per query head, the width of QK^T plus that of AV (`2 · head_dim`; MLA's differ), for `flops_per_token`."""
        return 2 * self.head_dim

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
        data = cls.family_adjust(data)
        labels = data.pop("id2label", None)
        data.pop("label2id", None)
        if labels and "num_labels" not in data:
            data["num_labels"] = len(labels)
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in _ZERO_ONLY_HF_KEYS:
            value = data.pop(key, 0)
            if value not in (0, 0.0, None):
                raise ValueError(
                    f"{cls.__name__}: {key} = {value!r}: dropout is not implemented (jaxloom trains without it); "
                    f"expected {key} 0"
                )
        ignored = _IGNORED_HF_KEYS | cls.ignored_keys
        unknown = sorted(k for k in data if k not in fields and k not in ignored)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown config key(s) {unknown}; expected some of {sorted(fields)}")
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
        labels = out.pop("num_labels")
        if labels is not None:  # as transformers writes it
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(labels)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(labels)}
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
    """Qwen2: Llama with biases on q, k and v (not o). With `use_sliding_window`, the window applies to the layers
    from `max_window_layers` on, or to those `layer_types` marks `sliding_attention` (as transformers reads it);
    without, to none (the `sliding_window` size a config keeps is then dropped, as transformers drops it)."""

    model_type: ClassVar[str] = "qwen2"
    attention_bias: bool = True
    use_sliding_window: bool = False
    max_window_layers: int = 28
    layer_types: tuple[str, ...] | None = None

    @property
    def o_bias(self) -> bool:
        return False

    def attention_types(self) -> tuple[str, ...]:
        if self.layer_types is not None:
            return tuple(self.layer_types)
        if self.sliding_window is None:
            return ("full_attention",) * self.num_hidden_layers
        first = self.max_window_layers
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(self.num_hidden_layers))

    @classmethod
    def family_adjust(cls, data: dict[str, Any]) -> dict[str, Any]:
        """`data` (a `config.json` dict) as transformers reads it: no window without `use_sliding_window`, and
        `use_mrope` (Qwen2-VL's multimodal RoPE) refused."""
        if data.get("use_mrope"):
            raise ValueError(
                f"{cls.__name__}: use_mrope = true is Qwen2-VL's multimodal RoPE, which jaxloom does not implement; "
                "expected use_mrope false (the text models' config says so)"
            )
        data.setdefault("attention_bias", cls.attention_bias)
        if not data.get("use_sliding_window", False):
            data["sliding_window"] = None
        elif "sliding_window" not in data:
            data["sliding_window"] = 4096
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
        check_top_k(self, "num_local_experts")

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    @property
    def expert_intermediate_size(self) -> int:
        """Each expert's feed-forward width."""
        return self.intermediate_size

    @property
    def normalize_top_k(self) -> bool:
        """The chosen experts' router probabilities are renormalised to sum to one."""
        return True

    @property
    def expert_names(self) -> tuple[str, str, tuple[str, str, str]]:
        """Where transformers keeps the experts: `(mlp module, experts module, (gate, down, up) names)`."""
        return "block_sparse_moe", "experts", ("w1", "w2", "w3")


def check_top_k(config: Any, experts_field: str) -> None:
    """`num_experts_per_tok` of a mixture-of-experts `config` is in `[1, experts]` (`experts_field` names the
    expert count as the family does): one error naming both otherwise (the config system puts the class name
    first)."""
    experts = getattr(config, experts_field)
    if not 0 < config.num_experts_per_tok <= experts:
        raise ValueError(f"num_experts_per_tok {config.num_experts_per_tok} must be in [1, {experts_field}={experts}]")


def _check_rope_scaling(owner: str, scaling: Mapping[str, Any], head_dim: int) -> None:
    """`rope_scaling` names a type jaxloom implements, with the keys that type reads (all required ones, no
    other): one error naming the key otherwise, before a model is built."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return
    if kind not in _ROPE_KEYS:
        raise ValueError(
            f"{owner}: rope_scaling type {kind!r}; expected default, linear, dynamic, llama3, yarn or longrope"
        )
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
    for key in given & _ROPE_LIST_KEYS:
        value = scaling[key]
        if (
            not isinstance(value, list | tuple)
            or len(value) != head_dim // 2
            or not all(isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in value)
        ):
            raise ValueError(
                f"{owner}: rope_scaling {key} = {str(value)[:60]}; expected {head_dim // 2} positive numbers "
                f"(one per rotated pair of a {head_dim}-wide head)"
            )
    for key in given - {"truncate"} - _ROPE_LIST_KEYS:
        value = scaling[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0):
            raise ValueError(f"{owner}: rope_scaling {key} = {value!r}; expected a positive number")


# what transformers writes into every nested config (`vision_config`) beside its fields
_BOOKKEEPING_KEYS = ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path")


def read_sub_config(cls: type, data: Mapping[str, Any], adjust=None, key: str = "vision_config") -> Any:
    """`cls` (a config dataclass) from `data`, a nested mapping of a `config.json` (`key`, e.g. `vision_config`):
    transformers' bookkeeping keys dropped, `adjust(data)` applied (the family's renames and refusals: it returns
    the mapping to read), and a key `cls` has no field for one error naming it."""
    fields = {k: v for k, v in data.items() if k not in _BOOKKEEPING_KEYS}
    fields = adjust(fields) if adjust is not None else fields
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown {key} key(s) {unknown}; expected some of {sorted(known)}")
    return cls(**fields)


def lift_text_config(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` (a vision-language model's `config.json` dict) with its `text_config`'s keys moved to the top, where
    `cls` (a config whose fields are the language model's) reads them: transformers 5 nests them, the Hub's older
    files keep them at the top. A key given at both levels with two values is one error naming it, but for the special
    tokens (`eos_token_id` …: the top level's, which generation reads, wins; Gemma 3's files give `[1, 106]` there and
    1 below) and `tie_word_embeddings` (true at either level is kept: transformers 5 moves it up, older saves keep it
    below)."""
    data = dict(data)
    text = dict(data.pop("text_config", None) or {})
    text.pop("model_type", None)
    for key, value in text.items():
        if data.setdefault(key, value) != value and key != "tie_word_embeddings" and not key.endswith("_token_id"):
            raise ValueError(f"{cls.__name__}: {key} = {data[key]!r} at the top and {value!r} in text_config")
    if text.get("tie_word_embeddings"):
        data["tie_word_embeddings"] = True
    return data


CONFIG_CLASSES: dict[str, type[LlamaConfig]] = {}
"""`model_type` (as in `config.json`) → its config class (`register_config` adds to it)."""


def register_config(cls: type[LlamaConfig]) -> type[LlamaConfig]:
    """Class decorator: `cls` reads `config.json` files whose `model_type` is `cls.model_type`."""
    if CONFIG_CLASSES.get(cls.model_type, cls) is not cls:
        raise ValueError(f"model_type {cls.model_type!r} already has a config class")
    CONFIG_CLASSES[cls.model_type] = cls
    return cls


for _cls in (LlamaConfig, MistralConfig, Qwen2Config, MixtralConfig):
    register_config(_cls)


MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
"""Published `model_type`s whose files hold an architecture jaxloom has under another name: Moonshot's Kimi K2
(`kimi_k2`, its own remote code, `architectures: DeepseekV3ForCausalLM`) is DeepSeek-V3 tensor for tensor. Such a
model loads as that family and is exported under it (transformers then reads it without remote code)."""


def config_from_hf_dict(data: Mapping[str, Any]) -> LlamaConfig:
    """The right config class for `data["model_type"]` (or the family a `MODEL_TYPE_ALIASES` name is)."""
    kind = data.get("model_type")
    if kind in MODEL_TYPE_ALIASES:
        kind = MODEL_TYPE_ALIASES[kind]
        data = {**data, "model_type": kind}
    if kind not in CONFIG_CLASSES:
        raise ValueError(
            f"model_type {kind!r} is not supported; known: {sorted({*CONFIG_CLASSES, *MODEL_TYPE_ALIASES})}"
        )
    return CONFIG_CLASSES[kind].from_hf_dict(data)
