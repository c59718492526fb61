"""PEFT's files for jaxloom's LoRA adapters: `adapter_config.json` and `adapter_model.safetensors` written as PEFT
writes them (`save_peft_adapter`: PEFT's module names, one per layer of a scanned stack; expert adapters under
PEFT's target parameters) and read back (`read_peft_config`, `load_peft_weights`) — a format apart from the
adapters themselves (`lora`) and from every family (module names come from `hf`'s table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .expert_adapters import EXPERT_PARAMETERS, ExpertLoRA
from .lora import LoRAConfig, LoRALinear, expert_hosts, hf_experts, linears, lora_config_of, peft_name, targets

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _hf_module(model: nnx.Module, path: tuple[str, ...]) -> list[str]:
    """The module name(s) PEFT gives the linear layer at `path` (one per layer of a scanned stack): its checkpoint
    name as transformers' model holds it (`peft_name`)."""
    from .hf import hf_sources

    src = hf_sources([*path, "kernel"], model.config)

    def names(s):
        if isinstance(s, list):
            return [n for x in s for n in names(x)]
        if len(s) == 3:
            raise ValueError(
                f"{type(model).__name__} fuses {path[-1]} into {s[0].rsplit('.', 1)[0]} in transformers: its "
                "adapters are not PEFT's; target the unfused modules of another family, or export with --merge"
            )
        return [peft_name(model, s[0].removesuffix(".weight"))]

    return names(src)


def peft_config(config: LoRAConfig, model: nnx.Module, base: str | None = None) -> dict[str, Any]:
    """`adapter_config.json` of `config` on `model`, as PEFT writes it."""
    # a module named by a number (`merger.mlp.0`, an `nn.Sequential` index) with its parent's name: PEFT matches names
    # as suffixes, and `0` alone would name every first block of a list
    modules = sorted({".".join(path[-2:]) if path[-1].isdigit() else path[-1] for _, _, path in targets(model, config)})
    exclude = config.exclude_modules
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if _saved_modules(model, config) else "CAUSAL_LM",
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": modules,
        "target_parameters": sorted(config.target_parameters) or None,
        "use_rslora": config.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": list(config.modules_to_save) or None,
        "exclude_modules": (exclude if isinstance(exclude, str) else list(exclude)) if exclude else None,
        "base_model_name_or_path": base,
        "inference_mode": True,
    }


def adapter_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """The adapters of `model` under PEFT's names (`base_model.model.<module>.lora_A.weight [r, in]`,
    `lora_B.weight [out, r]`), gathered to host, float32."""
    from jaxloom.mesh import gather

    out: dict[str, np.ndarray] = {}
    for parent, name, path in linears(model):
        layer = getattr(parent, name)
        if not isinstance(layer, LoRALinear) or layer.lora_a is None:
            continue
        a, b = np.asarray(gather(layer.lora_a[...])), np.asarray(gather(layer.lora_b[...]))
        modules = _hf_module(model, path)
        if a.ndim == 2:
            a, b = a[None], b[None]
        for i, module in enumerate(modules):
            out[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            out[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    for name, var, transposed in _saved_tensors(model, lora_config_of(model)):
        value = np.asarray(gather(var[...]))
        out[f"base_model.model.{name}"] = np.ascontiguousarray(value.T if transposed else value)
    for key, adapters, i in _expert_adapter_keys(model):
        a, b = np.asarray(gather(adapters.lora_a[...])), np.asarray(gather(adapters.lora_b[...]))
        a, b = (a, b) if i is None else (a[i], b[i])
        experts, din, r = a.shape
        out[f"{key}.lora_A.weight"] = np.ascontiguousarray(a.transpose(0, 2, 1).reshape(experts * r, din))
        out[f"{key}.lora_B.weight"] = np.ascontiguousarray(b.transpose(2, 1, 0).reshape(b.shape[-1], r * experts))
    return out


def _saved_modules(model: nnx.Module, config: LoRAConfig | None) -> list[tuple[str, nnx.Module]]:
    """`(name, module)` of the modules `config.modules_to_save` names that sit at the top of `model` (a classifier's
    `score`)."""
    names = config.modules_to_save if config is not None else ()
    return [(n, getattr(model, n)) for n in names if isinstance(getattr(model, n, None), nnx.Module)]


def _saved_tensors(model: nnx.Module, config: LoRAConfig | None):
    """`(HF tensor name, variable, transposed)` of the weights of the modules trained whole (`modules_to_save`)."""
    from .hf import hf_sources

    for name, module in _saved_modules(model, config):
        for leaf in sorted(vars(module)):
            var = getattr(module, leaf)
            if isinstance(var, nnx.Param):
                tensor, transposed = hf_sources([name, leaf], model.config)[:2]
                yield tensor, var, transposed


def _expert_adapter_keys(model: nnx.Module):
    """`(key, adapters, layer)` for each expert weight with adapters: PEFT's key up to `.lora_A.weight`, the
    `ExpertLoRA`, and the index into its leading layer axis (None outside a scanned stack). PEFT wraps a module's
    targeted parameters one inside the other in the module's order, so all but the last sit under `base_layer`s."""
    for host, path in expert_hosts(model):
        adapted = [(n, getattr(host, a)) for n, a in EXPERT_PARAMETERS.items() if getattr(host, a) is not None]
        modules = hf_experts(model, host, path)
        for j, (_, adapters) in enumerate(adapted):
            nesting = ".base_layer" * (len(adapted) - 1 - j)
            for i, module in enumerate(modules):
                yield f"base_model.model.{module}{nesting}", adapters, (i if len(modules) > 1 else None)


def save_peft_adapter(
    model: nnx.Module, directory: str | Path, *, base: str | None = None, tokenizer: Any = None
) -> Path:
    """Write `model`'s adapters as a PEFT adapter directory (`adapter_config.json`,
    `adapter_model.safetensors`, and `tokenizer`'s files when given), atomically; `base` is recorded as
    `base_model_name_or_path`."""
    from safetensors.numpy import save_file

    from .hf import atomic_directory

    config = lora_config_of(model)
    if config is None:
        raise ValueError("this model has no LoRA adapters")
    tensors = adapter_tensors(model)  # every process gathers; process 0 writes
    if jax.process_index() != 0:
        return Path(directory)
    with atomic_directory(directory) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(config, model, base), indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return Path(directory)


def read_peft_config(directory: str | Path) -> LoRAConfig:
    """The `LoRAConfig` of a PEFT adapter directory; what jaxloom cannot reproduce is an error naming it."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    raw = json.loads(path.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {raw.get('peft_type')!r}; expected LORA")
    for key, ok in (("bias", ("none", None)), ("fan_in_fan_out", (False, None))):
        if raw.get(key) not in ok:
            raise ValueError(f"{path}: {key} = {raw.get(key)!r}; jaxloom reads adapters with {key} = {ok[0]!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise ValueError(f"{path}: {key} = {raw[key]!r}; jaxloom reads one rank and alpha for every layer")
    modules = raw.get("target_modules") or ()
    return LoRAConfig(
        r=int(raw["r"]),
        alpha=float(raw.get("lora_alpha", 8)),
        target_modules=modules if isinstance(modules, str) else tuple(sorted(modules)),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_parameters=tuple(sorted(raw.get("target_parameters") or ())),
        modules_to_save=tuple(raw.get("modules_to_save") or ()),
        dropout=float(raw.get("lora_dropout") or 0.0),
        # PEFT's: absent excludes nothing (not the model's default: the adapters were made without one)
        exclude_modules=exclude if isinstance(exclude := raw.get("exclude_modules") or (), str) else tuple(exclude),
    )


def load_peft_weights(model: nnx.Module, directory: str | Path) -> nnx.Module:
    """Set `model`'s adapters (applied with the directory's config) from a PEFT adapter directory; an adapter
    missing, left over or of another shape than the base's layer is an error naming it. In place."""
    from safetensors.numpy import load_file

    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {ADAPTER_WEIGHTS}")
    prefix = "base_model.model."
    tensors = {  # adapters named by the checkpoint's layout are read too (`peft_name`)
        prefix + peft_name(model, k.replace(".default.", ".").removeprefix(prefix)): v
        for k, v in load_file(str(path)).items()
    }
    used = set()
    for parent, name, p in linears(model):
        layer = getattr(parent, name)
        if not isinstance(layer, LoRALinear) or layer.lora_a is None:
            continue
        pairs = []
        for module in _hf_module(model, p):
            keys = [f"base_model.model.{module}.lora_{x}.weight" for x in "AB"]
            missing = [k for k in keys if k not in tensors]
            if missing:
                raise ValueError(f"{path}: no tensor {missing[0]}; the adapter does not cover this base's {module}")
            used.update(keys)
            pairs.append((tensors[keys[0]].T, tensors[keys[1]].T))
        a = np.stack([x for x, _ in pairs]) if layer.lora_a.get_value().ndim == 3 else pairs[0][0]
        b = np.stack([y for _, y in pairs]) if layer.lora_b.get_value().ndim == 3 else pairs[0][1]
        for var, value, what in ((layer.lora_a, a, "lora_A"), (layer.lora_b, b, "lora_B")):
            if tuple(value.shape) != tuple(var.get_value().shape):
                raise ValueError(
                    f"{path}: {what} of {'.'.join(p)} has shape {tuple(value.shape)} (jaxloom's layout), the base's "
                    f"layer needs {tuple(var.get_value().shape)}: the adapter was made for another base model"
                )
            var.set_value(jnp.asarray(value, jnp.float32))
    expert_pairs: dict[int, tuple[ExpertLoRA, list[tuple[np.ndarray, np.ndarray]]]] = {}
    for key, adapters, _ in _expert_adapter_keys(model):
        keys = [f"{key}.lora_{x}.weight" for x in "AB"]
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise ValueError(f"{path}: no tensor {missing[0]}; the adapter does not cover this base's experts")
        used.update(keys)
        expert_pairs.setdefault(id(adapters), (adapters, []))[1].append((tensors[keys[0]], tensors[keys[1]]))
    for adapters, pairs in expert_pairs.values():
        *_, experts, din, r = adapters.lora_a.get_value().shape
        dout = adapters.lora_b.get_value().shape[-1]
        for x, y in pairs:
            if x.shape != (experts * r, din) or y.shape != (dout, r * experts):
                raise ValueError(
                    f"{path}: the experts' adapters are lora_A {x.shape}, lora_B {y.shape}; this base's {experts} "
                    f"experts need {(experts * r, din)} and {(dout, r * experts)}: it was made for another base"
                )
        a = np.stack([x.reshape(experts, r, din).transpose(0, 2, 1) for x, _ in pairs])
        b = np.stack([y.reshape(dout, r, experts).transpose(2, 1, 0) for _, y in pairs])
        adapters.lora_a.set_value(jnp.asarray(a.reshape(adapters.lora_a.get_value().shape), jnp.float32))
        adapters.lora_b.set_value(jnp.asarray(b.reshape(adapters.lora_b.get_value().shape), jnp.float32))
    for name, var, transposed in _saved_tensors(model, lora_config_of(model)):
        key = f"base_model.model.{name}"
        if key not in tensors:
            raise ValueError(f"{path}: no tensor {key}; the adapter does not hold the module it trains whole")
        value = tensors[key].T if transposed else tensors[key]
        if tuple(value.shape) != tuple(var.get_value().shape):
            raise ValueError(f"{path}: {key} has shape {tensors[key].shape}; this base's needs another: another base")
        used.add(key)
        var.set_value(jnp.asarray(value, var.get_value().dtype))
    left = sorted(set(tensors) - used)
    if left:
        raise ValueError(f"{path}: tensors for modules this model does not adapt: {left[:5]}")
    return model
