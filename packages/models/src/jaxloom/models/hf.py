"""Hugging Face checkpoints: read a model directory into a (sharded) model, and write one back."""

from __future__ import annotations

import contextlib
import json
import weakref
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from . import safetensors_io
from .build import is_variable, variable_specs
from .configs import LlamaConfig, config_from_hf_dict
from .fp8 import fp8_tensors
from .mxfp4 import mxfp4_tensors
from .registry import TaskType, get_model_class
from .runtime import RuntimeConfig

log = logging.getLogger("jaxloom.models")
EXPORT_PROGRESS_EVERY_S = 10.0  # a long export logs how far it is this often

_EXPERT_LEAVES = ("w_gate", "w_down", "w_up")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# Phi-3's fused checkpoint tensors: our module → (HF module, position among the parts fused along the output axis)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def hf_sources(names: list[str], config: LlamaConfig):
    """Where one of our parameters lives in an HF checkpoint: a `(tensor name, stored transposed)` pair,
    a `(tensor name, stored transposed, (part, sizes))` triple for a part of a tensor that fuses several
    along its first axis (Phi-3's `qkv_proj`: part 0 of sizes `(q, k, v)` is q), or, for a parameter
    stacked on its first axis (a scanned layer stack, the experts of an MoE), a list with one such entry
    (itself possibly a list) per index of that axis. Names under the config's `checkpoint_prefixes` are placed
    where the family's files hold them."""
    places = getattr(config, "checkpoint_prefixes", ())
    src = _sources(names, config)
    return _placed(src, places) if places else src


def _placed(src, places):
    if isinstance(src, list):
        return [_placed(s, places) for s in src]
    name = next((new + src[0][len(old) :] for old, new in places if src[0].startswith(old)), src[0])
    return (name, *src[1:])


def _sources(names: list[str], config: LlamaConfig):
    if len(names) > 2 and names[:2] == ["model", "layers"] and not names[2].isdigit():  # scanned stack
        return [_sources([*names[:2], str(i), *names[2:]], config) for i in range(config.num_hidden_layers)]
    *module, leaf = names
    if hasattr(config, "expert_names") and "mlp" in module and (leaf in _EXPERT_LEAVES or "gate" in module):
        block, experts, files = config.expert_names
        module = [block if m == "mlp" else m for m in module]
        if leaf in _EXPERT_LEAVES:
            base, name = ".".join(module), files[_EXPERT_LEAVES.index(leaf)]
            return [(f"{base}.{experts}.{e}.{name}.weight", True) for e in range(config.num_experts)]
    if config.fused_projections and leaf in ("kernel", "bias") and module and module[-1] in _FUSED:
        fused, part = _FUSED[module[-1]]
        c = config
        sizes = (
            (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.num_key_value_heads * c.head_dim)
            if fused == "qkv_proj"
            else (c.intermediate_size, c.intermediate_size)
        )
        base = ".".join([*module[:-1], fused])
        return (f"{base}.{'weight' if leaf == 'kernel' else 'bias'}", leaf == "kernel", (part, sizes))
    base = ".".join(module)
    if leaf == "kernel":
        return (f"{base}.weight", True)
    if leaf == "embedding":
        return (f"{base}.weight", False)
    return (f"{base}.{leaf}", False)


def _source_names(src) -> list[str]:
    return [src[0]] if isinstance(src, tuple) else [n for s in src for n in _source_names(s)]


def _open_checkpoint(path: Path) -> dict[str, np.ndarray]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        tensors: dict[str, np.ndarray] = {}
        for file in sorted(set(weight_map.values())):
            tensors.update(safetensors_io.load(path / file))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{index}: names tensors that no shard holds: {missing[:10]}")
        return tensors
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"{path}: no model.safetensors or model.safetensors.index.json "
            f"(found {sorted(p.name for p in path.iterdir())})"
        )
    return safetensors_io.load(single)


def from_pretrained(
    path: str | Path,
    runtime: RuntimeConfig | None = None,
    *,
    mesh=None,
    task: TaskType = TaskType.CAUSAL_LM,
    config_overrides: dict[str, Any] | None = None,
):
    """Read `path`, an HF model directory (`config.json` + safetensors, sharded or not), into a model for
    `task`; `config_overrides` replace fields of its config (e.g. a longer `max_position_embeddings`). With
    `mesh`, each process reads only the slices its devices hold, placed directly on their shards.
    Weights are cast to `runtime.param_dtype`. Missing or unexpected weights are an error naming them, but for
    a sequence classifier read from a causal LM's files (`task=TaskType.SEQUENCE_CLASSIFICATION`), as transformers
    reads them: its `score` is drawn new (normal, `initializer_range`, seeded) and `lm_head` is left unread."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json)")
    try:
        raw = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise ValueError(f"{path / 'config.json'}: malformed JSON ({e}); expected the model's config.json") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path / 'config.json'}: a {type(raw).__name__}; expected a JSON object of settings")
    config = config_from_hf_dict(raw)
    if config_overrides:
        config = config.replace(**config_overrides)
    runtime = runtime or RuntimeConfig()
    cls = get_model_class(config.model_type, task)
    # published quantized weights, dequantized as they are read: GPT-OSS's MXFP4 experts, DeepSeek-V3's FP8 blocks
    tensors = fp8_tensors(mxfp4_tensors(_open_checkpoint(path)), raw.get("quantization_config"))
    tensors = _renamed(tensors, getattr(cls, "checkpoint_renames", ()))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(config, runtime, rngs=nnx.Rngs(0))))
    specs = variable_specs(abstract, runtime, mesh) if mesh is not None else None
    used, missing, drawn = set(), [], []

    def load(path_keys, var):
        names = _names(path_keys)
        sources = hf_sources(names, config)
        wanted = _source_names(sources)
        absent = [s for s in wanted if s not in tensors]
        if absent and all(s in cls.new_weights for s in absent):
            drawn.extend(absent)
            return _drawn(var, config.initializer_range, _lookup(specs, path_keys) if mesh is not None else None, mesh)
        if absent:
            missing.extend(absent)
            return var
        used.update(wanted)

        def lazy(src):
            if isinstance(src, tuple):
                tensor = tensors[src[0]]
                if len(src) == 3:  # one part of a fused tensor: its rows
                    part, sizes = src[2]
                    start = sum(sizes[:part])
                    tensor = tensor[start : start + sizes[part]]
                return tensor.T if src[1] else tensor
            return _Stacked([lazy(s) for s in src])

        src = lazy(sources)
        if tuple(src.shape) != tuple(var.shape):
            raise ValueError(
                f"weight {wanted[0]} has shape {tuple(src.shape)}, but parameter "
                f"{'/'.join(names)} of {cls.__name__} expects {tuple(var.shape)}"
            )
        dtype = var.get_value().dtype
        if mesh is None:
            return var.replace(value=jnp.asarray(np.asarray(src[...]).astype(dtype)))
        spec = _lookup(specs, path_keys)
        sharding = NamedSharding(mesh, spec)
        value = jax.make_array_from_callback(tuple(var.shape), sharding, lambda idx: np.asarray(src[idx]).astype(dtype))
        return var.replace(value=value)

    state = jax.tree_util.tree_map_with_path(load, abstract, is_leaf=is_variable)
    extra = _extra_layers(tensors, config) if getattr(config, "checkpoint_extra_layers", False) else set()
    if extra:
        log.info(
            "%s: skipped %d tensors of layers past the model's %d (multi-token prediction)",
            path,
            len(extra),
            config.num_hidden_layers,
        )
    unexpected = sorted(
        k
        for k in tensors
        if k not in used
        and k not in extra
        and not _IGNORED.search(k)
        and not (config.tie_word_embeddings and k == "lm_head.weight")
        and k not in cls.checkpoint_extras
    )
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint does not match {cls.__name__}: missing weights {sorted(missing)[:20]}"
            f"{' …' if len(missing) > 20 else ''}; unexpected weights {unexpected[:20]}"
            f"{' …' if len(unexpected) > 20 else ''}"
        )
    if drawn:
        log.warning("%s: %s are not in the checkpoint: drawn new, to be trained (as transformers does)", path, drawn)
    model = nnx.merge(graphdef, state)
    _SOURCES[model] = str(path.absolute())
    return model


def _renamed(tensors: dict[str, Any], renames: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """`tensors` with each name starting with a `renames` prefix read under its replacement (the other layout of one
    architecture's names: transformers' `model.language_model.*` for the Hub's `model.*`); a name given both ways is
    one error."""
    if not renames:
        return tensors
    out: dict[str, Any] = {}
    for name, tensor in tensors.items():
        new = next((repl + name[len(old) :] for old, repl in renames if name.startswith(old)), name)
        if new in out:
            raise ValueError(f"checkpoint holds {new} twice (as {new} and as {name}); expected one layout of names")
        out[new] = tensor
    return out


def _drawn(var, std: float, spec, mesh):
    """`var` (abstract) drawn from a normal of `std` with a fixed seed (the same on every process), on `mesh`."""
    shape, dtype = tuple(var.shape), var.get_value().dtype
    value = np.random.default_rng(0).normal(0.0, std, shape).astype(np.float32)
    if mesh is None:
        return var.replace(value=jnp.asarray(value).astype(dtype))
    sharding = NamedSharding(mesh, spec)
    return var.replace(value=jax.make_array_from_callback(shape, sharding, lambda idx: value[idx].astype(dtype)))


def _extra_layers(tensors: dict[str, Any], config: LlamaConfig) -> set[str]:
    """The tensors of `model.layers.N` with N past the model's layers (DeepSeek-V3's multi-token prediction)."""
    found = set()
    for k in tensors:
        m = re.match(r"model\.layers\.(\d+)\.", k)
        if m and int(m.group(1)) >= config.num_hidden_layers:
            found.add(k)
    return found


_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → the directory it was read from


def pretrained_source(model: Any) -> str | None:
    """The directory `from_pretrained` read `model` from (absolute), or None for a model built otherwise: what a
    PEFT adapter of it records as `base_model_name_or_path`."""
    try:
        return _SOURCES.get(model)
    except TypeError:  # not weakly referenceable: not ours
        return None


def _lookup(tree, path_keys):
    node = tree
    for k in path_keys:
        node = node[getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))]
    return node.get_value() if is_variable(node) else node


class _Stacked:
    """Lazy `np.stack(parts)` (parts are arrays or `_Stacked`): indexing reads only the slices asked
    for, so a process reads just the layers and experts its shards hold."""

    def __init__(self, parts):
        self.parts = parts
        self.shape = (len(parts), *parts[0].shape)

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if not idx or idx[0] is Ellipsis:
            first, rest = slice(None), ()
        else:
            first, rest = idx[0], idx[1:]
        return np.stack([np.asarray(p[rest]) for p in self.parts[first]])


def to_hf_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """`model`'s parameters under HF names and layouts, as host numpy arrays (gathered across processes)."""
    from jaxloom.mesh import gather

    config = model.config
    out: dict[str, np.ndarray] = {}
    state = nnx.state(model, nnx.Param)
    for path_keys, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]:
        value = gather(var.get_value())

        def emit(src, value):
            if isinstance(src, tuple) and len(src) == 3:  # a part of a fused tensor
                (part, sizes), rows = src[2], value.T if src[1] else value
                whole = out.setdefault(src[0], np.zeros((sum(sizes), *rows.shape[1:]), rows.dtype))
                whole[sum(sizes[:part]) : sum(sizes[: part + 1])] = rows
            elif isinstance(src, tuple):
                out[src[0]] = value.T if src[1] else value
            else:
                for i, s in enumerate(src):
                    emit(s, value[i])

        emit(hf_sources(_names(path_keys), config), value)
    return out


# What an export writes; anything else already in the directory (a README, ...) is carried over.
_EXPORT_FILE = re.compile(
    r"(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json"
    r"|tokenizer(_config)?\.json|special_tokens_map\.json|chat_template\.(jinja|json)|added_tokens\.json"
    r"|vocab\.json|merges\.txt|tokenizer\.model|processor_config\.json|preprocessor_config\.json)$"
)


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Write a directory all at once: yields a temporary directory beside `path`; on success it replaces
    `path` (files there that an export does not write are carried over; stale shards and indexes are
    not), on failure it is removed and `path` is untouched. A crash leaves at worst a hidden
    `.NAME.tmp-PID` (or the previous export as `.NAME.old-PID`) beside it. On an object store (`gs://`) the
    same steps run as server-side copies: not one atomic step, but the previous export is only removed once
    the new one is complete, and is kept as `.NAME.old-PID` if the swap itself is cut. A `path` that is a
    symbolic link is written where it points, and stays a link."""
    from jaxloom.core import paths

    if paths.is_uri(str(path)):
        yield from _atomic_remote_directory(paths.as_path(str(path)))
        return
    path = Path(path).absolute()
    if path.is_symlink():  # write where the link points (readers of the target see the new export); keep the link
        path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists() and not path.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
        raise NotADirectoryError(f"{path} exists and is not a directory; expected a directory to export into")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.is_dir():
        for entry in path.iterdir():
            if not _EXPORT_FILE.match(entry.name) and not (tmp / entry.name).exists():
                entry.rename(tmp / entry.name)
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _atomic_remote_directory(path: Any) -> Iterator[Any]:
    from jaxloom.core import paths

    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    paths.remove_tree(tmp)
    try:
        yield tmp
    except BaseException:
        paths.remove_tree(tmp)
        raise
    if path.exists() and not path.is_dir():
        paths.remove_tree(tmp)
        raise NotADirectoryError(f"{path} exists and is not a directory; expected a directory to export into")
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    if path.is_dir():
        written = set(paths.files_with_sizes(tmp))
        for entry in path.iterdir():  # the user's own files (a README, ...) are carried over
            if not _EXPORT_FILE.match(entry.name) and entry.name not in written:
                paths.move(entry, tmp / entry.name)
        paths.move(path, old)
    paths.move(tmp, path)
    paths.remove_tree(old)


def save_hf_model(
    model: nnx.Module, path: str | Path, *, max_shard_bytes: int = 5 * 2**30, dtype: Any = None
) -> Path | str:
    """Write `model`'s `config.json` and `model.safetensors` (sharded with an index past
    `max_shard_bytes`) into directory `path`, cast to `dtype` if given, loadable by `transformers` and
    by `from_pretrained`. Only process 0 writes; tensors are gathered and written one at a time
    (`write_hf_export`). The directory is replaced at once (`atomic_directory`): an interrupted export
    leaves the previous one intact. `path` may be an object-store URI (`gs://bucket/model`)."""
    from jaxloom.core import paths

    path = path if paths.is_uri(str(path)) else Path(path)
    if jax.process_index() != 0:
        write_hf_export(model, None, dtype=dtype, max_shard_bytes=max_shard_bytes)  # its part of each gather
        return path
    with atomic_directory(path) as tmp:
        write_hf_export(model, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return path


def _cast(dtype: Any, have: np.dtype) -> np.dtype:
    if dtype is not None and (np.issubdtype(have, np.floating) or have == jnp.bfloat16):
        return np.dtype(jnp.dtype(dtype))
    return np.dtype(have)


def export_plan(
    model: nnx.Module, dtype: Any = None
) -> list[tuple[str, list[tuple[int, tuple[int, ...], bool]], tuple, np.dtype]]:
    """Every HF tensor of `model`, in the order an export writes them, from shapes alone (nothing is
    gathered): `(name, parts, shape, dtype)`, `parts` the `(parameter leaf, indices into its stacked axes,
    transposed)` whose rows make the tensor, in order (one part, or several for a fused tensor such as
    Phi-3's `qkv_proj`)."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param), is_leaf=is_variable)[0]
    plan: list[tuple[str, list[tuple[int, tuple[int, ...], bool]], tuple, np.dtype]] = []
    fused: dict[str, dict[int, tuple[int, tuple[int, ...], bool]]] = {}

    def walk(src, leaf: int, index: tuple[int, ...], shape: tuple[int, ...], out_dtype: np.dtype) -> None:
        if isinstance(src, tuple):
            hf_shape = tuple(reversed(shape)) if src[1] else shape
            if len(src) == 3:
                (part, sizes), name = src[2], src[0]
                if name not in fused:
                    fused[name] = {}
                    plan.append((name, [], (sum(sizes), *hf_shape[1:]), out_dtype))
                fused[name][part] = (leaf, index, src[1])
            else:
                plan.append((src[0], [(leaf, index, src[1])], hf_shape, out_dtype))
        else:
            for i, s in enumerate(src):
                walk(s, leaf, (*index, i), shape[1:], out_dtype)

    for leaf, (path_keys, var) in enumerate(leaves):
        value = var.get_value()
        walk(hf_sources(_names(path_keys), model.config), leaf, (), tuple(value.shape), _cast(dtype, value.dtype))
    for name, parts, _, _ in plan:
        if name in fused:
            parts.extend(fused[name][i] for i in sorted(fused[name]))
    return plan


def _host_views(model: nnx.Module, plan) -> Iterator[np.ndarray]:
    """For each entry of `plan` in order, the tensor as a host array in HF layout, possibly a
    non-contiguous view (a transpose, a slice of a stacked leaf): gathered across processes one tensor
    at a time (every process must iterate: the gathers are collective). On one CPU device a leaf is
    viewed where it lies, without a copy; elsewhere a stacked leaf is sliced on the device first, so
    the host holds one layer's tensor, not the stack."""
    from jaxloom.mesh import gather

    leaves = [v for _, v in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param), is_leaf=is_variable)[0]]

    def view(leaf: int, index: tuple[int, ...], transposed: bool) -> np.ndarray:
        value = leaves[leaf].get_value()
        devices = getattr(getattr(value, "sharding", None), "device_set", set())
        if len(devices) == 1 and next(iter(devices)).platform == "cpu":
            host = np.asarray(value)  # the device buffer itself
            for i in index:
                host = host[i]
        else:
            for i in index:
                value = value[i]
            host = gather(value)
        return host.T if transposed else host

    for _, parts, _, _ in plan:
        host = view(*parts[0]) if len(parts) == 1 else np.concatenate([view(*p) for p in parts])
        yield host
        del host  # written by the caller: nothing of this tensor is kept while the next is gathered


def write_hf_export(
    model: nnx.Module,
    path: Any,
    *,
    dtype: Any = None,
    max_shard_bytes: int = 5 * 2**30,
    generation: dict[str, Any] | None = None,
) -> None:
    """Write `config.json`, `generation_config.json` (the model's special-token ids, updated by
    `generation`) and safetensors files of at most `max_shard_bytes` (with an index when there are
    several) into directory `path`, streaming: each tensor is gathered, cast to `dtype`, written and
    dropped before the next, so host memory grows by about the largest tensor, not the model.
    `path=None`: take part in the gathers only (processes other than 0)."""
    plan = export_plan(model, dtype)
    files: list[list[int]] = [[]]
    size = 0
    for i, (_, _, shape, dt) in enumerate(plan):
        nbytes = int(np.prod(shape)) * dt.itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    )
    views = _host_views(model, plan)
    if path is None:
        for _ in views:
            pass
        return
    config = model.config.to_hf_dict()
    config["architectures"] = [type(model).__name__]
    config["dtype"] = str(plan[0][3]) if plan else "float32"
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    special = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    given = {k: v for k, v in (generation or {}).items() if v is not None}
    if special or given:  # what transformers writes beside a model's config, so generate() stops where it should
        fields = {**special, "_from_model_config": not given, **given}
        (path / "generation_config.json").write_text(json.dumps(fields, indent=2, sort_keys=True))
    weight_map, total = {}, 0
    whole = sum(int(np.prod(shape)) * dt.itemsize for _, _, shape, dt in plan)
    started = last = time.monotonic()
    for file, members in zip(names, files, strict=True):
        entries = [(plan[i][0], plan[i][2], plan[i][3]) for i in members]
        with safetensors_io.StreamWriter(path / file, entries, {"format": "pt"}) as writer:
            for i in members:
                name, dt = plan[i][0], plan[i][3]
                view = next(views)
                writer.write(name, view, dtype=dt)  # cast and made contiguous a few MB at a time
                total += view.size * dt.itemsize
                weight_map[name] = file
                del view  # the next tensor is gathered only now
                if time.monotonic() - last >= EXPORT_PROGRESS_EVERY_S:
                    last = time.monotonic()
                    log.info(
                        "exporting %s: %d of %d tensors, %.2f of %.2f GB",
                        path,
                        len(weight_map),
                        len(plan),
                        total / 1e9,
                        whole / 1e9,
                    )
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    log.info("exported %d tensors, %.2f GB, in %.1f s", len(plan), total / 1e9, time.monotonic() - started)
