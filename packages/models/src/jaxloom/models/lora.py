"""LoRA and QLoRA: low-rank adapters on a frozen (optionally quantized) base, interchangeable with PEFT.

    model = apply_lora(model, LoRAConfig(r=16, alpha=32, target_modules=("q_proj", "v_proj")))

Each targeted `Linear` becomes a `LoRALinear`: its base `kernel` (and bias) become `Frozen` variables — read
by the forward pass, never trained, kept out of `nnx.Param` so an optimizer never sees them — and two
`nnx.Param` adapters are added, `lora_a [in, r]` (PEFT's uniform init) and `lora_b [r, out]` (zeros), so
`y = x W + (x A) B · alpha / r` (`alpha / sqrt(r)` with `use_rslora`) equals the base model at the start.
The adapters carry the logical axes of the weight they adapt (A its input axis, B its output axis), so
they shard with it on any mesh; in a scanned layer stack they carry its leading layer axis. Adapters are
float32 whatever the base's dtype.

Experts (`target_parameters`, PEFT's name for adapting a parameter rather than a module): the stacked expert
weights of an MoE layer, named as transformers names them (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`),
get one low-rank pair per expert (`ExpertLoRA`: `lora_a [E, in, r]`, `lora_b [E, r, out]`), and the experts run
with `W + A B · scaling` through the same dispatch (dense, token dispatch, expert-parallel) as the base. The files
are PEFT's `ParamWrapper` layout (`lora_A [r·E, in]`, `lora_B [out, r·E]`, the second target of a module nested
under `base_layer`).

QLoRA (`quantize="int8"` or `"nf4"`): the base kernel is stored quantized — int8 with one float32 scale per
output column, or NF4 (QLoRA's 4-bit normal-float code, two codes a byte) with one float32 absmax per block
of `block_size` inputs — and dequantized in the forward pass, in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .dropout import dropped
from .expert_adapters import EXPERT_PARAMETERS, ExpertLoRA, expert_weights
from .layers import Linear

# QLoRA's NF4 code: the 16 quantiles of a standard normal, scaled to [-1, 1] (Dettmers et al., 2023).
NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)
QUANTIZATIONS = ("int8", "nf4")
ALL_LINEAR = "all-linear"
ROUTERS = ("gate", "router")  # an MoE block's router: a Linear here, not an `nn.Linear` in transformers (PEFT skips it)


class Frozen(nnx.Variable):
    """Weights the forward pass reads and training never changes (a LoRA run's base): not an `nnx.Param`, so
    `nnx.state(model, nnx.Param)` (what an optimizer and a checkpoint see) holds the adapters alone."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """The adapters: rank `r`, `alpha` (scale `alpha / r`, or `alpha / sqrt(r)` with `use_rslora`),
    `target_modules` (HF module names such as `q_proj`, or `"all-linear"`: every linear layer but the output
    layer), `target_parameters` (the stacked expert weights of MoE layers, as transformers names them:
    `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, or a suffix of those), and `quantize` the frozen base
    (`None`, `"int8"`, `"nf4"`; the experts' weights stay unquantized) in blocks of `block_size` inputs (NF4),
    and `modules_to_save` (modules trained whole beside the adapters and saved with them: a classifier's `score`,
    PEFT's `SEQ_CLS` default `("classifier", "score")`; names a model lacks are ignored, as PEFT ignores them),
    and `dropout` (PEFT's `lora_dropout`: the adapters' input dropped with this probability in the train step's
    forward — `dropout_key` — never in evaluation or generation), and `exclude_modules` (PEFT's: module names a
    targeted module's name must not end with, or one regular expression its whole name must not match — the name
    as transformers' model holds the module, as PEFT matches it: `model.visual.blocks.0.attn.qkv`; None: the
    model's default, which for a vision-language model leaves its vision tower out (`.*visual.*`), for any other
    excludes nothing). PEFT's names and meanings."""

    r: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    use_rslora: bool = False
    quantize: str | None = None
    block_size: int = 64
    target_parameters: tuple[str, ...] | str = ()
    modules_to_save: tuple[str, ...] = ()
    dropout: float = 0.0
    exclude_modules: tuple[str, ...] | str | None = None

    def __post_init__(self):
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise ValueError(f"lora_r = {self.r!r}; expected a positive integer (the adapters' rank)")
        if not self.alpha > 0:
            raise ValueError(f"lora_alpha = {self.alpha!r}; expected a positive number")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora_dropout = {self.dropout!r}; expected a probability in [0, 1) (PEFT's default 0)")
        if self.quantize not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantize = {self.quantize!r}; expected None or one of {QUANTIZATIONS}")
        if isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR:
            object.__setattr__(self, "target_modules", tuple(m for m in self.target_modules.split(",") if m))
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        names = self.target_parameters
        names = tuple(m for m in names.split(",") if m) if isinstance(names, str) else tuple(names or ())
        object.__setattr__(self, "target_parameters", names)
        object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save or ()))
        if isinstance(self.exclude_modules, list):
            object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))
        if isinstance(self.exclude_modules, str):
            try:
                re.compile(self.exclude_modules)
            except re.error as e:
                raise ValueError(
                    f"lora_exclude_modules = {self.exclude_modules!r}: not a regular expression ({e})"
                ) from None
        if not self.target_modules and not self.target_parameters:
            raise ValueError("lora_target_modules is empty; expected module names such as q_proj,v_proj or all-linear")
        if self.dropout and self.target_parameters:  # PEFT's ParamWrapper refuses it too
            raise ValueError(
                f"lora_dropout = {self.dropout} with lora_target_parameters: PEFT's adapters on expert weights take "
                "no dropout (its ParamWrapper refuses lora_dropout != 0); expected lora_dropout=0 with them"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


# ---- quantization ------------------------------------------------------------------------------------------
def quantize(w: jax.Array, kind: str, block_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """`(codes, scales)` of `w [..., in, out]`: int8 with a scale per output column (`scales [..., 1, out]`),
    or NF4 codes packed two a byte along the input axis (`[..., in/2, out]` uint8) with an absmax per block
    of `block_size` inputs (`scales [..., in/block, out]`)."""
    w = w.astype(jnp.float32)
    if kind == "int8":
        scale = jnp.max(jnp.abs(w), axis=-2, keepdims=True) / 127.0
        scale = jnp.where(scale == 0, 1.0, scale)
        return jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale
    *lead, din, dout = w.shape
    blocks = w.reshape(*lead, din // block_size, block_size, dout)
    absmax = jnp.max(jnp.abs(blocks), axis=-2, keepdims=True)
    absmax = jnp.where(absmax == 0, 1.0, absmax)
    middles = jnp.asarray((NF4_CODE[1:] + NF4_CODE[:-1]) / 2)
    codes = jnp.searchsorted(middles, (blocks / absmax).reshape(-1)).astype(jnp.uint8).reshape(*lead, din, dout)
    pairs = codes.reshape(*lead, din // 2, 2, dout)
    packed = pairs[..., 0, :] | (pairs[..., 1, :] << 4)
    return packed, absmax[..., 0, :]


def dequantize(codes: jax.Array, scales: jax.Array, kind: str, dtype: Any) -> jax.Array:
    """The `[..., in, out]` weight back from `quantize`'s `(codes, scales)`, in `dtype`."""
    if kind == "int8":
        return (codes.astype(jnp.float32) * scales).astype(dtype)
    *lead, half, dout = codes.shape
    both = jnp.stack([codes & 15, codes >> 4], axis=-2).reshape(*lead, 2 * half, dout)
    values = jnp.asarray(NF4_CODE)[both.astype(jnp.int32)]
    blocks = scales.shape[-2]
    values = values.reshape(*lead, blocks, (2 * half) // blocks, dout) * scales[..., :, None, :]
    return values.reshape(*lead, 2 * half, dout).astype(dtype)


# ---- the adapted layer ---------------------------------------------------------------------------------------
class LoRALinear(nnx.Module):
    """A frozen `Linear` (optionally quantized) plus low-rank adapters: `y = x W + b + (x A) B · scaling`."""

    def __init__(self, base: Linear, config: LoRAConfig, key: jax.Array | None, salt: int = 0):
        """`key` draws A; None: no adapters (a layer QLoRA quantizes but does not adapt). `salt` (from the layer's
        path) keys its dropout mask apart from other layers'."""
        kernel = base.kernel[...]
        axes = base.kernel.get_metadata().get("logical_axes") or (None,) * kernel.ndim
        *lead, din, dout = kernel.shape
        self.quantization = config.quantize
        if config.quantize:
            if config.quantize == "nf4" and (din % config.block_size or config.block_size % 2):
                raise ValueError(
                    f"load_in_4bit: a layer's input size {din} is not a multiple of the NF4 block size "
                    f"{config.block_size}; expected sizes that divide (or load_in_8bit)"
                )
            codes, scales = quantize(kernel, config.quantize, config.block_size)
            self.kernel_codes = Frozen(codes, logical_axes=tuple(axes))
            self.kernel_scales = Frozen(scales, logical_axes=(*axes[:-2], None, axes[-1]))
            self.kernel = None
        else:
            self.kernel = Frozen(kernel, logical_axes=tuple(axes))
            self.kernel_codes = self.kernel_scales = None
        self.bias = (
            None
            if base.bias is None
            else Frozen(base.bias[...], logical_axes=base.bias.get_metadata().get("logical_axes"))
        )
        a = b = None
        if key is not None:
            bound = 1.0 / math.sqrt(din)  # PEFT: kaiming_uniform_(a=sqrt(5)) on [r, in] is U(-1/sqrt(in), 1/sqrt(in))
            a = nnx.Param(
                jax.random.uniform(key, (*lead, din, config.r), jnp.float32, -bound, bound),
                logical_axes=(*axes[:-2], axes[-2], None),
            )
            b = nnx.Param(jnp.zeros((*lead, config.r, dout), jnp.float32), logical_axes=(*axes[:-2], None, axes[-1]))
        self.lora_a, self.lora_b = a, b
        self.scaling = config.scaling
        self.dropout, self.salt = float(config.dropout), int(salt)
        self.dtype, self.precision = base.dtype, base.precision
        self.fp8 = getattr(base, "fp8", "none")  # FP8 training: the frozen base's product as the plain layer's

    def weight(self, dtype: Any = None) -> jax.Array:
        """The frozen base kernel `[in, out]` (dequantized) in `dtype` (default: the compute dtype)."""
        dtype = dtype or self.dtype
        if self.quantization:
            return dequantize(self.kernel_codes[...], self.kernel_scales[...], self.quantization, dtype)
        return self.kernel[...].astype(dtype)

    def merged(self, dtype: Any = jnp.float32) -> jax.Array:
        """`W + A B · scaling` in `dtype`: the kernel of the merged model."""
        if self.lora_a is None:
            return self.weight(dtype)
        delta = jnp.matmul(self.lora_a[...], self.lora_b[...], precision=jax.lax.Precision.HIGHEST) * self.scaling
        return (self.weight(jnp.float32) + delta).astype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x, w = x.astype(self.dtype), self.weight()
        if getattr(self, "fp8", "none") != "none" and w.ndim == 2:
            from .fp8_training import fp8_dot

            y = fp8_dot(x, w, self.fp8, self.precision)
        else:
            y = jnp.dot(x, w, precision=self.precision)
        if self.lora_a is not None:
            inputs = dropped(x, self.dropout, self.salt)  # the adapters' input only (PEFT's lora_dropout)
            low = jnp.dot(inputs, self.lora_a[...].astype(self.dtype), precision=self.precision)
            up = jnp.dot(low, self.lora_b[...].astype(self.dtype), precision=self.precision)
            y = y + up * jnp.asarray(self.scaling, self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


# ---- applying, merging, finding -------------------------------------------------------------------------------
def _find(module: nnx.Module, wanted, prefix: tuple[str, ...] = ()):
    """`(parent, attribute, path)` of every value under `module` for which `wanted(value)` holds (not looking inside
    one), through submodules and lists of them, in a fixed order."""
    for name in sorted(vars(module)):
        value = getattr(module, name)
        path = (*prefix, name)
        if wanted(value):
            yield module, name, path
        elif isinstance(value, nnx.Module):
            yield from _find(value, wanted, path)
        elif isinstance(value, nnx.List | list | tuple):
            for i, item in enumerate(value):
                if isinstance(item, nnx.Module):
                    yield from _find(item, wanted, (*path, str(i)))


def linears(module: nnx.Module):
    """`(parent, attribute, path)` of every `Linear` / `LoRALinear` under `module`, in a fixed order."""
    return _find(module, lambda value: isinstance(value, Linear | LoRALinear))


def expert_hosts(module: nnx.Module):
    """`(host, path)` of every MoE module under `module` whose stacked expert weights can take adapters (its class
    names them in `EXPERT_WEIGHTS`), in a fixed order."""
    for parent, name, path in _find(module, lambda v: isinstance(v, nnx.Module) and hasattr(type(v), "EXPERT_WEIGHTS")):
        yield getattr(parent, name), path


def _expert_weight_names(host: nnx.Module, name: str) -> tuple[str, ...]:
    """The attributes of `host` holding the weights behind transformers' `name`."""
    return type(host).EXPERT_WEIGHTS[name]


def hf_experts(model: nnx.Module, host: nnx.Module, path: tuple[str, ...]) -> list[str]:
    """transformers' name(s) of the experts module `host` at `path` stands for (`model.layers.3.mlp.experts`), one
    per layer of a scanned stack."""
    suffix = tuple(filter(None, [type(host).HF_EXPERTS]))
    if len(path) > 2 and path[:2] == ("model", "layers") and not path[2].isdigit():  # a scanned stack
        return [".".join((*path[:2], str(i), *path[2:], *suffix)) for i in range(model.config.num_hidden_layers)]
    return [".".join((*path, *suffix))]


def expert_targets(model: nnx.Module, config: LoRAConfig) -> list[tuple[nnx.Module, tuple[str, ...], str]]:
    """`(host, path, name)` for each stacked expert weight `config.target_parameters` selects in `model`, matched
    as PEFT matches them (the full name, or a suffix after a dot); a name that selects nothing, or a part of a
    scanned stack, is an error listing what the model has."""
    if not config.target_parameters:
        return []
    hosts = list(expert_hosts(model))
    if not hosts:
        raise ValueError(
            f"lora_target_parameters {list(config.target_parameters)}: {type(model).__name__} has no stacked expert "
            "weights (only MoE layers do); adapt its linear layers with lora_target_modules"
        )
    found, used = [], set()
    for host, path in hosts:
        modules = hf_experts(model, host, path)
        for name in EXPERT_PARAMETERS:
            keys = [f"{m}.{name}" for m in modules]
            hits = {t for t in config.target_parameters for k in keys if k == t or k.endswith(f".{t}")}
            matched = [k for k in keys if any(k == t or k.endswith(f".{t}") for t in hits)]
            if matched and len(matched) != len(keys):
                raise ValueError(
                    f"lora_target_parameters {sorted(hits)} select some layers of a scanned stack ({matched[0]}, not "
                    f"{[k for k in keys if k not in matched][0]}); name every layer's, or run with scan_layers=false"
                )
            if matched:
                used |= hits
                found.append((host, path, name))
    unknown = [t for t in config.target_parameters if t not in used]
    if unknown:
        example = hf_experts(model, *hosts[0])[0]
        raise ValueError(
            f"lora_target_parameters {unknown}: {type(model).__name__} has no such parameter; its stacked expert "
            f"weights are {[f'{example}.{n}' for n in EXPERT_PARAMETERS]} in every MoE layer (a suffix such as "
            "mlp.experts.gate_up_proj selects them all)"
        )
    return found


def linear_names(model: nnx.Module) -> list[str]:
    """The module names `target_modules` can name in `model` (its linear layers; `lm_head` is the output)."""
    return sorted({path[-1] for _, _, path in linears(model)})


def peft_name(model: nnx.Module, name: str) -> str:
    """A module's checkpoint name `name` as transformers' model holds the module, which is what PEFT names adapters
    by: the same for most families; for one whose class has `peft_renames` (Qwen2.5-VL: the Hub's `model.layers.*`
    is `model.language_model.layers.*` in memory), renamed. A name already in memory's form is kept."""
    renames = getattr(type(model), "peft_renames", ())
    if any(name.startswith(new) for _, new in renames):
        return name
    return next((new + name[len(old) :] for old, new in renames if name.startswith(old)), name)


def with_model_defaults(config: LoRAConfig, model: nnx.Module) -> LoRAConfig:
    """`config` with `exclude_modules` None made the model's default (its class's `lora_exclude`: a vision-language
    model's tower; nothing for others)."""
    if config.exclude_modules is not None:
        return config
    return dataclasses.replace(config, exclude_modules=getattr(type(model), "lora_exclude", None) or ())


def excluded(model: nnx.Module, path: tuple[str, ...], exclude: tuple[str, ...] | str | None) -> bool:
    """Whether the linear layer at `path` is left out by `exclude` (PEFT's `exclude_modules`: a name the module's
    name ends with, or a regular expression its whole name matches), its name as transformers' model holds it, which
    is what PEFT matches (`peft_name`: Qwen2.5-VL's `model.visual.blocks.0.attn.qkv`).
    A scanned stack's layers are one parameter: an expression that leaves out some of them but not all is one
    error."""
    if not exclude:
        return False
    if len(path) > 2 and path[:2] == ("model", "layers") and not path[2].isdigit():
        names = [".".join(("model", "layers", str(i), *path[2:])) for i in range(model.config.num_hidden_layers)]
    else:
        names = [".".join(path)]
    names = [peft_name(model, n) for n in names]

    def out(name: str) -> bool:
        if isinstance(exclude, str):
            return re.fullmatch(exclude, name) is not None
        return any(name == m or name.endswith(f".{m}") for m in exclude)

    hits = {out(n) for n in names}
    if len(hits) > 1:
        raise ValueError(
            f"lora_exclude_modules = {exclude!r} leaves out some layers of {'.'.join(path)}, a scanned stack whose "
            "layers are one parameter; expected an expression for all of them, or scan_layers=False"
        )
    return hits.pop()


def targets(model: nnx.Module, config: LoRAConfig) -> list[tuple[nnx.Module, str, tuple[str, ...]]]:
    """The linear layers `config.target_modules` selects in `model`, less those `config.exclude_modules` leaves
    out (None: the model's default, `with_model_defaults`); an unknown name is an error listing the names the model
    has."""
    saved = set(config.modules_to_save)
    exclude = with_model_defaults(config, model).exclude_modules
    found = [f for f in linears(model) if not saved & set(f[2])]  # a module trained whole takes no adapters (PEFT)
    names = {path[-1] for _, _, path in found}
    if config.target_modules == ALL_LINEAR:
        return [
            f
            for f in found
            if f[2][-1] != "lm_head"
            and not (f[2][-1] in ROUTERS and "mlp" in f[2])
            and not excluded(model, f[2], exclude)
        ]
    if "lm_head" in config.target_modules:
        raise ValueError(
            "lora_target_modules names lm_head, the output layer; PEFT's all-linear leaves it out, and so does jaxloom"
        )

    def named(path: tuple[str, ...], name: str) -> bool:  # PEFT's rule: the module's name is `name` or ends with it
        full = peft_name(model, ".".join(path))
        return full == name or full.endswith(f".{name}")

    unknown = [m for m in config.target_modules if not any(named(f[2], m) for f in found)]
    if unknown:
        raise ValueError(
            f"lora_target_modules {list(unknown)}: {type(model).__name__} has no such linear layer; "
            f"its linear layers are {sorted(names)} (or all-linear)"
        )
    return [
        f for f in found if any(named(f[2], m) for m in config.target_modules) and not excluded(model, f[2], exclude)
    ]


def apply_lora(model: nnx.Module, config: LoRAConfig, *, seed: int = 0) -> nnx.Module:
    """`model` with adapters on the layers `config` targets (in place; also returned). Each layer's A is drawn
    from `seed` and the layer's path, so the same layer gets the same draw whatever else is targeted."""
    if any(isinstance(getattr(p, n), LoRALinear) for p, n, _ in linears(model)) or any(
        getattr(h, a) is not None for h, _ in expert_hosts(model) for a in EXPERT_PARAMETERS.values()
    ):
        raise ValueError("this model already has LoRA adapters")
    base_key = jax.random.PRNGKey(seed)
    experts = expert_targets(model, config)  # checked before anything changes
    chosen = {path for _, _, path in targets(model, config)}
    for parent, name, path in list(linears(model)):
        if path in chosen:
            salt = zlib.crc32(".".join(path).encode()) & 0x7FFFFFFF
            key = jax.random.fold_in(base_key, salt)
            setattr(parent, name, LoRALinear(getattr(parent, name), config, key, salt))
        elif config.quantize and name != "lm_head" and not set(config.modules_to_save) & set(path):
            # QLoRA stores every linear layer of the base quantized (not one trained whole)
            setattr(parent, name, LoRALinear(getattr(parent, name), config, None))
    for host, path, name in experts:
        key = jax.random.fold_in(base_key, zlib.crc32(".".join((*path, name)).encode()) & 0x7FFFFFFF)
        weights = [getattr(host, attr) for attr in _expert_weight_names(host, name)]
        setattr(host, EXPERT_PARAMETERS[name], ExpertLoRA(weights, config.r, config.scaling, key))
    freeze(model, keep=config.modules_to_save)
    model.lora_config = with_model_defaults(config, model)  # what was applied: the default exclusion made explicit
    return model


def quantize_frozen(model: nnx.Module, kind: str, *, block_size: int = 64) -> nnx.Module:
    """`model` as a frozen model whose linear layers (all but the output layer and MoE experts' stacked weights) are
    stored quantized as QLoRA stores a base (`kind`: `"nf4"` in blocks of `block_size` inputs, or `"int8"`), with no
    adapters, and every other weight `Frozen` (in place; also returned): a model only read, such as distillation's
    teacher, in about a quarter (NF4: an eighth) of its linear layers' float32 bytes."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantize = {kind!r}; expected one of {QUANTIZATIONS}")
    config = LoRAConfig(quantize=kind, block_size=block_size)
    for parent, name, _ in list(linears(model)):
        if name != "lm_head" and isinstance(getattr(parent, name), Linear):
            setattr(parent, name, LoRALinear(getattr(parent, name), config, None))
    freeze(model)
    return model


def freeze(module: nnx.Module, source: type = nnx.Param, target: type = Frozen, keep: tuple[str, ...] = ()) -> None:
    """Every `source` variable under `module` but the adapters and the modules named in `keep` becomes a `target` (by
    default, every parameter becomes `Frozen`: embeddings, norms, the output layer; only the adapters train)."""
    for name in sorted(vars(module)):
        value = getattr(module, name)
        if name in keep:
            continue
        if isinstance(value, source) and name not in ("lora_a", "lora_b"):
            setattr(module, name, target(value.get_value(), **value.get_metadata()))
        elif isinstance(value, nnx.Module):
            freeze(value, source, target, keep)
        elif isinstance(value, nnx.List | list | tuple):
            for item in value:
                if isinstance(item, nnx.Module):
                    freeze(item, source, target, keep)


def lora_config_of(model: nnx.Module) -> LoRAConfig | None:
    """The `LoRAConfig` `model` was adapted with, or None."""
    return getattr(model, "lora_config", None)


def merge_lora(model: nnx.Module) -> nnx.Module:
    """`model` with every adapted layer replaced by a plain `Linear` whose kernel is `W + A B · scaling` (the
    base dequantized), in the base's parameter dtype (float32 for a quantized base): what transformers loads
    alone. In place; also returned."""
    for parent, name, _ in list(linears(model)):
        layer = getattr(parent, name)
        if not isinstance(layer, LoRALinear):
            continue
        dtype = jnp.float32 if layer.quantization else layer.kernel.get_value().dtype
        kernel = layer.merged(dtype)
        source = layer.kernel_codes if layer.kernel_codes is not None else layer.kernel
        axes = source.get_metadata().get("logical_axes")
        runtime: Any = _Runtime(dtype)  # the fields Linear reads
        biased = layer.bias is not None
        plain = nnx.eval_shape(lambda r=runtime, b=biased: Linear(1, 1, (None, None), r, use_bias=b, rngs=nnx.Rngs(0)))
        plain.kernel = nnx.Param(kernel, logical_axes=axes)
        plain.bias = (
            None
            if layer.bias is None
            else nnx.Param(layer.bias[...], logical_axes=layer.bias.get_metadata().get("logical_axes"))
        )
        plain.dtype, plain.precision = layer.dtype, layer.precision
        setattr(parent, name, plain)
    for host, _ in expert_hosts(model):
        for name, attr in EXPERT_PARAMETERS.items():
            if getattr(host, attr) is None:
                continue
            merged = expert_weights(host, name, jnp.float32, jax.lax.Precision.HIGHEST)
            for weight, value in zip(_expert_weight_names(host, name), merged, strict=True):
                var = getattr(host, weight)
                setattr(host, weight, Frozen(value.astype(var.get_value().dtype), **var.get_metadata()))
            setattr(host, attr, None)
    freeze(model, Frozen, nnx.Param)  # a plain model again: every weight a parameter
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


@dataclasses.dataclass(frozen=True)
class _Runtime:  # the two fields `Linear.__init__` reads
    param_dtype: Any
    dtype: Any = jnp.float32
    precision: Any = None
