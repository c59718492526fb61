"""The composition root: a resolved config (a file, a run directory or the demo, with `key=value`
overrides) becomes a trainer of the right kind with its model, data and tokenizer. The `jaxloom` command,
`jaxloom.ray` and every trainer kind use this; nothing imports the command line module.

    trainer, resolved = build_run("configs/demo.yaml", ["max_training_steps=20"])
    trainer = restored("runs/a", params_only=True)      # a run's newest checkpoint, nothing else set up
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from jaxloom.core import paths

from .arguments import ALIASES, expand_path
from .config_files import apply_overrides, load_config_file
from .kinds import KINDS, TRAINERS, arguments_of
from .run_directory import RUN_CONFIG, staging_folder, use_endpoint
from .runs import model_of, own_tokenizer, tokenizer_of

__all__ = ["DATA_KEYS", "DEMO_CONFIG", "KINDS", "READ_ONLY", "TRAINERS", "build_run", "restored", "split_target"]

log = logging.getLogger("jaxloom.trainer")
DEMO_CONFIG = Path(__file__).with_name("configs") / "demo.yaml"
DATA_KEYS = {
    "train": "training data: 'bundled'; a path / glob / list of .jsonl, .parquet or .txt files; a token store "
    "(`jaxloom data prepare`); or a mixture: a list of {path, weight}",
    "eval": "evaluation data, as train (default: none; with train=bundled, a held-out part of it)",
    "eval_fraction": "with train=bundled: the fraction of its documents held out for evaluation",
    "tokenizer": "'bundled', a local tokenizer directory or a Hugging Face Hub id",
}
DATA_TYPES = {  # each data key's type and default, as `jaxloom config keys` shows them
    "train": ("str | list[str] | list[{path, weight}]", "bundled"),
    "eval": ("str | list[str] | None", None),
    "eval_fraction": ("float", 0.05),
    "tokenizer": ("str", "bundled"),
}
# A run directory is data: commands that read one never take process-level or write-location settings
# from it (where compiled code is cached, profiles or W&B runs are written).
READ_ONLY = [
    "resume_if_possible=true",
    "overwrite_output_dir=false",
    "compilation_cache_dir=null",
    "profile_steps=null",
    "use_wandb=false",
    "use_tensorboard=false",
]


def split_target(items: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG | RUN_DIR] key=value ...` → (config file, overrides). A run directory stands for its
    resolved config, with its own save_directory and its copy of the tokenizer; resuming it never deletes
    it: the `overwrite_output_dir` recorded there is not applied again (only one given now is)."""
    items = list(items)
    first = items.pop(0) if items and "=" not in items[0] else None
    if first is not None and paths.is_uri(first) and not first.endswith((".yaml", ".yml", ".json")):
        return _run_on_a_store(first, items)
    if first is not None and Path(first).is_dir():
        run = Path(first)
        if not (run / RUN_CONFIG).is_file():
            raise FileNotFoundError(
                f"{run} is a directory without {RUN_CONFIG}; expected a run directory or a config file"
            )
        pinned = [f"save_directory={run}", "overwrite_output_dir=false"]
        if (run / "tokenizer").is_dir():
            pinned.append(f"data.tokenizer={(run / 'tokenizer').absolute()}")
        return str(run / RUN_CONFIG), pinned + items
    return first, items


def _run_on_a_store(uri: str, items: list[str]) -> tuple[str, list[str]]:
    """`split_target` of a run directory on a store: its config and tokenizer copied to a local folder."""
    for item in items:
        if item.startswith("storage_endpoint_url="):
            use_endpoint(item.split("=", 1)[1])
    if not paths.as_path(f"{uri.rstrip('/')}/{RUN_CONFIG}").exists():
        raise FileNotFoundError(f"{uri} holds no {RUN_CONFIG}; expected a run directory or a config file")
    local = staging_folder(uri).with_suffix(".config")
    shutil.rmtree(local, ignore_errors=True)
    got = paths.download_tree(
        uri, local, skip=("checkpoints/", ".", "metrics", "tensorboard", "report", "loss", "ref_logps")
    )
    pinned = [f"save_directory={uri}", "overwrite_output_dir=false"]
    if any(name.startswith("tokenizer/") for name in got):
        pinned.append(f"data.tokenizer={local / 'tokenizer'}")
    return str(local / RUN_CONFIG), pinned + items


# A run from `model.from_pretrained=DIR` with no config file fine-tunes: TRL's defaults for the job (SFTConfig,
# DPOConfig: learning rate, linear decay, no warmup, no weight decay), the data's epochs (HF's num_train_epochs)
# rather than the demo's 300 steps, TRL's 8 rows and logging every 10 steps, HF's save every 500 steps (and the
# final save), no evaluation cadence or previews. Any of them given on the command line wins; a config file gets
# none of them.
_FINETUNE_RUN = {
    "max_training_steps": None,
    "num_train_epochs": 3,
    "total_batch_size": 8,
    "logging_steps": 10,
    "save_steps": 500,
    "save_total_limit": None,  # HF keeps every checkpoint
    "seed": 42,  # HF's
    "adam_beta2": 0.999,  # HF's AdamW (jaxloom's pretraining default is 0.95)
    "evaluation_steps": None,
    "generation_interval": None,
    "generation_prompts": [],
}
# The demo's settings a fine-tune does not inherit (the argument's own default applies, or nothing: a preview's
# length with no previews, the bundled corpus's held-out share with data of one's own).
_FINETUNE_DROPS = ("generation_max_new_tokens", "eval_batches")
_FINETUNE_DATA_DROPS = ("eval_fraction",)
# What a fine-tune still does differently from TRL at TRL's defaults, said in the banner of such a run and listed
# in docs/migration.md (a test keeps the two in step).
_FINETUNE_SOURCE = "fine-tuning defaults (TRL's)"
FINETUNE_DIFFERENCES = {
    "total_batch_size": "rows over all devices (TRL's per_device_train_batch_size=8 is 8 rows per device)",
    "eval_batches": "8 batches an evaluation (TRL evaluates the whole eval set)",
    "dtype": "the model's dtype, float32 for a float32 checkpoint (TRL computes in bf16 where the device has it)",
    "remat": "the model's (none: TRL's gradient_checkpointing is on by default)",
    "assistant_only_loss": "true: chat records train on the assistant turns (TRL's default false: every token)",
}
FINETUNE_DEFAULTS: dict[str, dict[str, Any]] = {
    "sft": {
        "learning_rate": 2e-5,
        "scheduler": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        **_FINETUNE_RUN,
        "packing": False,  # TRL's SFTConfig
        "save_directory": "jaxloom-runs/finetune",
    },
    "grpo": {
        "learning_rate": 1e-6,
        "scheduler": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        **_FINETUNE_RUN,
        "save_directory": "jaxloom-runs/grpo",
    },
    "rloo": {
        "learning_rate": 1e-6,  # TRL's RLOOConfig
        "scheduler": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        **_FINETUNE_RUN,
        "save_directory": "jaxloom-runs/rloo",
    },
    "dpo": {
        "learning_rate": 1e-6,
        "scheduler": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        **_FINETUNE_RUN,
        "save_directory": "jaxloom-runs/dpo",
    },
    "kto": {
        "learning_rate": 1e-6,  # TRL's KTOConfig
        "scheduler": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        **_FINETUNE_RUN,
        "save_directory": "jaxloom-runs/kto",
    },
    "distillation": {
        "learning_rate": 1e-6,  # TRL's DistillationConfig
        "scheduler": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        **_FINETUNE_RUN,
        "save_directory": "jaxloom-runs/distillation",
    },
    "reward": {
        "learning_rate": 1e-4,  # TRL's RewardConfig
        "scheduler": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        **_FINETUNE_RUN,
        "save_directory": "jaxloom-runs/reward",
    },
}
# The demo config's settings a trainer kind defines otherwise (without a config file): a GRPO row is
# `max_prompt_length + max_completion_length` tokens; a reward model's sequence is TRL's `max_length` (1024), and a
# classifier generates nothing (no previews).
_KIND_DROPS = {
    "grpo": ("max_sequence_length",),
    "rloo": ("max_sequence_length",),
    "distillation": ("max_sequence_length",),
    "reward": ("max_sequence_length", "generation_prompts", "generation_interval"),
}
FINETUNE_MAX_LENGTH = 1024
"""A fine-tune's row length when none is given: TRL's `max_length` (SFT, DPO), capped at the model's positions."""


def _finetune_defaults(data: dict, config_path: str | None, overrides: list[str]) -> dict:
    """`data` (the demo config with `overrides` applied) with `FINETUNE_DEFAULTS` for its trainer kind when
    the run fine-tunes a pretrained model without a config file (`_fine_tunes`), less the demo's row length (the
    model's positions decide it: `resolve_settings`). The run says what it chose (`announce_settings`)."""
    if not _fine_tunes(config_path, overrides):
        return data
    given = {o.split("=", 1)[0] for o in overrides}
    chosen = {k: v for k, v in FINETUNE_DEFAULTS.get(str(data.get("trainer", "sft")), {}).items() if k not in given}
    out = {**data, **chosen}
    if "max_sequence_length" not in given and "max_length" not in given:
        out.pop("max_sequence_length", None)
    for key in _FINETUNE_DROPS:
        if key not in given:
            out.pop(key, None)
    if isinstance(out.get("data"), dict):
        out["data"] = {k: v for k, v in out["data"].items() if k not in _FINETUNE_DATA_DROPS or f"data.{k}" in given}
    return out


# TRL's scripts' first words (`ModelConfig.model_name_or_path`, `ScriptArguments.dataset_name`): the same settings
# on jaxloom's command line. A Hub id is not downloaded (the error names the local path it expected).
COMMAND_LINE_ALIASES = {"model_name_or_path": "model.from_pretrained", "dataset_name": "data.train"}


def _positions(model_dir: Path) -> int:
    """The `max_position_embeddings` of an HF model directory or of a jaxloom run directory's model."""
    if (model_dir / RUN_CONFIG).is_file():
        model = json.loads((model_dir / RUN_CONFIG).read_text()).get("model") or {}
        if "max_position_embeddings" in model or "from_pretrained" not in model:
            return int(model.get("max_position_embeddings", FINETUNE_MAX_LENGTH))
        return _positions(Path(model["from_pretrained"]))
    return json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", FINETUNE_MAX_LENGTH)


def canonical_overrides(overrides: list[str]) -> list[str]:
    """`overrides` with other frameworks' names (`ALIASES`: `max_steps`, `output_dir`, ...; TRL's scripts'
    `model_name_or_path` and `dataset_name`) written as jaxloom's, so that a name the user gives replaces the default
    of the setting, whatever it is spelled; the same setting given twice on the command line under two names is an
    error."""
    keys = [o.split("=", 1)[0] for o in overrides]
    out = []
    for item, key in zip(overrides, keys, strict=True):
        name = ALIASES.get(key) or COMMAND_LINE_ALIASES.get(key)
        if name is not None:
            if name in keys:
                raise ValueError(f"{key} and {name} are one setting ({key} is another name of {name}); give one")
            twins = [k for k in keys if (ALIASES.get(k) or COMMAND_LINE_ALIASES.get(k)) == name and k != key]
            if twins:
                raise ValueError(f"{key} and {twins[0]} are one setting (both name {name}); give one")
            item = f"{name}={item.split('=', 1)[1]}"
        out.append(item)
    return out


def _canonical_file(data: dict, where: str | Path) -> dict:
    """A config file's settings with `ALIASES` written as jaxloom's names; both spellings in one file: an error."""
    out = dict(data)
    for alias, name in ALIASES.items():
        if alias in out:
            if name in out:
                raise ValueError(
                    f"{where}: {alias} and {name} are one setting ({alias} is another name of {name}); give one"
                )
            out[name] = out.pop(alias)
    return out


def _fine_tunes(config_path: str | None, overrides: list[str]) -> bool:
    """Whether a run fine-tunes with no config file: `model.from_pretrained` on the command line alone."""
    return config_path is None and any(
        o.split("=", 1)[0] in ("model.from_pretrained", "model_name_or_path") for o in overrides
    )


def kind_settings(data: dict, config_path: str | None, overrides: list[str]) -> dict:
    """`data` without the demo's settings that a trainer kind defines otherwise (`_KIND_DROPS`): GRPO's and a
    reward model's row length, a reward model's previews. One given on the command line or in the user's own file
    stays (and must agree)."""
    if config_path is not None:
        return data
    given = {o.split("=", 1)[0] for o in overrides}
    if "max_length" in given:
        given.add("max_sequence_length")
    drops = set(_KIND_DROPS.get(str(data.get("trainer")), ())) - given
    return {k: v for k, v in data.items() if k not in drops}


def resolve_settings(config_path: str | None, overrides: list[str]) -> tuple[dict, dict[str, str]]:
    """The one resolution of a run's settings, used by `train`, `plan`, `eval` and `config show`, and written to
    `run_config.json`: the config file (the demo's without one), then the trainer kind's and a fine-tune's
    defaults (`FINETUNE_DEFAULTS`), then the model's own facts (its tokenizer, its positions), then the command
    line. Returns `(resolved, sources)`: the settings as recorded, and where each one the user did not give came
    from (`{key: source}`; nested keys as `model.x`, `data.x`)."""
    base = _canonical_file(load_config_file(config_path or DEMO_CONFIG), config_path or DEMO_CONFIG)
    overrides = canonical_overrides(overrides)
    data = apply_overrides(base, overrides)
    data = _finetune_defaults(data, config_path, overrides)
    data = kind_settings(data, config_path, overrides)
    for section in ("model", "data"):
        if not isinstance(data.get(section) or {}, dict):
            raise ValueError(
                f"{section}: {data[section]!r} ({type(data[section]).__name__}); expected a section of key: value "
                f"settings (e.g. {section}.train: ... / {section}.hidden_size: ...)"
            )
    resolved = json.loads(json.dumps(data))
    given = {o.split("=", 1)[0] for o in overrides}
    fine_tune = _fine_tunes(config_path, overrides)
    kind = str(resolved.get("trainer", "sft"))
    rollouts = kind in ("grpo", "distillation")  # rows of prompt + completion: their length is the caps'
    length_from_model = fine_tune and not rollouts and not given & {"max_sequence_length", "max_length"}
    unknown = sorted(set(resolved.get("data") or {}) - set(DATA_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) in section data: {unknown}; expected train, eval, eval_fraction, tokenizer")
    model_cfg = dict(resolved.get("model") or {})
    explicit = {o.split("=", 1)[0].removeprefix("model.") for o in overrides if o.startswith("model.")}
    if "from_pretrained" in model_cfg:
        model_cfg["from_pretrained"] = expand_path(model_cfg["from_pretrained"], "model.from_pretrained")
        where = Path(model_cfg["from_pretrained"])
        if not where.is_dir():
            raise FileNotFoundError(
                f"model.from_pretrained = {str(where)!r} does not exist; expected a local Hugging Face model "
                "directory (config.json + safetensors; a Hub id is not downloaded: fetch it first, e.g. "
                "`hf download ID --local-dir DIR`)"
            )
        if not (where / "config.json").is_file() and not (where / RUN_CONFIG).is_file():
            raise FileNotFoundError(
                f"model.from_pretrained = {str(where)!r} has no config.json; expected a Hugging Face model directory "
                f"(config.json + safetensors) or a jaxloom run directory ({RUN_CONFIG}: its newest checkpoint)"
            )
    if "from_pretrained" in explicit:  # the pretrained model brings its architecture: the file's is not applied
        model_cfg = {k: v for k, v in model_cfg.items() if k in explicit}
    if model_cfg or "model" in resolved:
        resolved["model"] = model_cfg
    data_cfg = {k: _expanded(v, f"data.{k}") for k, v in (resolved.get("data") or {}).items()}
    source = _model_tokenizer(model_cfg, data_cfg, overrides, config_path)
    if source is not None:  # the model directory is the source of truth for its tokenizer
        resolved.setdefault("data", {})["tokenizer"] = source
    if length_from_model:  # rows as long as TRL's max_length, within the model's positions
        positions = model_cfg.get("max_position_embeddings")
        if positions is None:
            positions = _positions(Path(model_cfg["from_pretrained"]))
        resolved["max_sequence_length"] = min(FINETUNE_MAX_LENGTH, int(positions))
    _recorded_paths(resolved)
    # where each setting the user did not give came from
    user_file = config_path is not None and Path(config_path).name != RUN_CONFIG
    if user_file:
        origin = "your config file"
    elif config_path is not None:
        origin = "the run directory's run_config.json"
    else:
        origin = "the demo's config (configs/demo.yaml)"
    sources: dict[str, str] = {}
    for key in _flat_settings(resolved):
        if key in given or (user_file and key in _flat_settings(base)):
            continue  # the user's own
        if key == "data.tokenizer" and source is not None:
            sources[key] = "the model directory's own tokenizer"
        elif key == "max_sequence_length" and length_from_model:
            sources[key] = f"TRL's max_length {FINETUNE_MAX_LENGTH}, within the model's max_position_embeddings"
        elif fine_tune and key in FINETUNE_DEFAULTS.get(kind, {}):
            sources[key] = _FINETUNE_SOURCE
        else:
            sources[key] = origin
    return resolved, sources


# Settings that name local files or directories, made absolute when a run's settings are resolved: run_config.json
# then rebuilds the run from any working directory (`jaxloom train|eval|convert|generate RUN_DIR` from elsewhere).
# The run's own save_directory is not among them: a run directory is found where it is (split_target pins it).
RECORDED_PATHS = (
    "checkpoint_directory",
    "compilation_cache_dir",
    "ref_model",
    "lora_from",
    "teacher_model_name_or_path",
    "eval_tasks_include_path",
)


def _recorded_paths(resolved: dict) -> None:
    """`resolved`'s local paths made absolute in place (URIs, Hub ids, `bundled` and globs' patterns kept as text:
    a relative glob becomes an absolute one)."""

    def absolute(value: Any, must_exist: bool = False) -> Any:
        if isinstance(value, list):
            return [absolute(v, must_exist) for v in value]
        if isinstance(value, dict) and "path" in value:
            return {**value, "path": absolute(value["path"], must_exist)}
        if not isinstance(value, str) or not value or value == "bundled" or paths.is_uri(value):
            return value
        glob = any(c in value for c in "*?[")
        if Path(value).is_absolute() or (must_exist and not glob and not Path(value).exists()):
            return value  # a Hub id (`org/name`) is not a path here
        return os.path.abspath(value)

    model, data = resolved.get("model") or {}, resolved.get("data") or {}
    if "from_pretrained" in model:
        model["from_pretrained"] = absolute(model["from_pretrained"])
    for key in ("train", "eval"):
        if key in data:
            data[key] = absolute(data[key], must_exist=True)
    if "tokenizer" in data:
        data["tokenizer"] = absolute(data["tokenizer"], must_exist=True)
    for key in RECORDED_PATHS:
        if resolved.get(key) is not None:
            resolved[key] = absolute(resolved[key], must_exist=key in ("ref_model", "teacher_model_name_or_path"))


def _flat_settings(data: dict) -> dict[str, Any]:
    """`data` with its `model` and `data` sections as `model.x` / `data.x` keys."""
    out = {k: v for k, v in data.items() if k not in ("model", "data")}
    for section in ("model", "data"):
        out.update({f"{section}.{k}": v for k, v in (data.get(section) or {}).items()})
    return out


def announce_settings(sources: dict[str, str], resolved: dict) -> None:
    """Say, at the start of a run, every setting the user did not give and where it came from."""
    if not sources:
        return
    flat = _flat_settings(resolved)
    width = max(len(k) for k in sources)
    lines = [f"{k:<{width}} = {flat[k]!r}  ({where})" for k, where in sources.items()]
    log.info("settings you did not give (key=value or your config file overrides any):\n  %s", "\n  ".join(lines))
    if any(where == _FINETUNE_SOURCE for where in sources.values()):
        differ = [f"{k}: {why}" for k, why in FINETUNE_DIFFERENCES.items() if k in sources or k not in flat]
        if differ:
            log.info("where this fine-tune differs from TRL's defaults (docs/migration.md):\n  %s", "\n  ".join(differ))


def build_run(config_path: str | None, overrides: list[str]) -> tuple[Any, dict]:
    """Config file + overrides → (trainer, resolved config) (`resolve_settings`). Sections `model` and `data`;
    `trainer` (`sft`, `dpo`, `grpo`, `reward` or `distillation`) picks the trainer; the rest are its arguments. A
    pretrained model without a config file gets `FINETUNE_DEFAULTS` instead of the demo's training settings."""
    import jaxloom.data as jd
    import jaxloom.models as jm

    resolved, sources = resolve_settings(config_path, overrides)
    data = json.loads(json.dumps(resolved))
    model_cfg, data_cfg = dict(data.pop("model", {}) or {}), dict(data.pop("data", {}) or {})
    kind, args = arguments_of(data)
    data_cfg = {k: _expanded(v, f"data.{k}") for k, v in data_cfg.items()}
    if sources.get("data.tokenizer") == "the model directory's own tokenizer":
        log.info("tokenizer: the model's own, from %s (data.tokenizer=... to use another)", data_cfg["tokenizer"])
    if config_path is None or Path(config_path).name != RUN_CONFIG:
        announce_settings(sources, resolved)
    tokenizer = tokenizer_of(data_cfg)
    train, evaluation = data_cfg.get("train", "bundled"), data_cfg.get("eval")
    if kind in ("grpo", "rloo") and train == "bundled":
        raise ValueError(
            f"trainer={kind} needs prompts: data.train=prompts.jsonl (records with a prompt, and any columns the "
            "reward functions read) and reward_funcs=my_rewards.fn; the bundled corpus is plain text"
        )
    if kind == "distillation" and train == "bundled":
        raise ValueError(
            "trainer=distillation needs prompts: data.train=prompts.jsonl (records with a prompt) and "
            "teacher_model_name_or_path=DIR; the bundled corpus is plain text"
        )
    if kind == "kto" and train == "bundled":
        raise ValueError(
            "trainer=kto needs unpaired preference data: data.train=feedback.jsonl (records with prompt, completion "
            "and a boolean label); the bundled corpus is plain text"
        )
    if kind in ("dpo", "reward") and train == "bundled":
        raise ValueError(
            f"trainer={kind} needs preference data: data.train=pairs.jsonl (records with prompt, chosen, rejected); "
            "the bundled corpus is plain text"
        )
    if train != "bundled" and "eval_fraction" in data_cfg:
        said = (
            f"data.eval_fraction = {data_cfg['eval_fraction']!r} holds out part of the bundled corpus only; with "
            f"data.train = {train!r} it is not applied"
        )
        if any(o.startswith("data.eval_fraction=") for o in overrides):  # asked for now: an error
            raise ValueError(f"{said}. Expected data.eval=FILE (held-out records of your own), or no eval_fraction")
        user_file = config_path is not None and Path(config_path).name != RUN_CONFIG
        if user_file:  # e.g. a copy of the demo's config with other data: said, not silent
            log.warning("%s (from %s): evaluation uses data.eval only", said, config_path)
    if train == "bundled":
        records = jd.JsonlSource(jd.bundled_corpus_path()).read_shard(str(jd.bundled_corpus_path()))
        held = max(1, int(len(records) * float(data_cfg.get("eval_fraction", 0.05))))
        train, evaluation = records[:-held], evaluation or records[-held:]
    elif isinstance(train, list) and train and all(isinstance(p, dict) for p in train):
        train = jd.Mixture(train)  # [{path, weight}, ...]
    # The arguments' runtime settings are applied by the trainer too; given here as well so that weights
    # loaded from Hugging Face are laid out (stacked for scan_layers) and cast as the run needs them.
    runtime = args.runtime.apply(jm.RuntimeConfig())
    model = model_of(model_cfg, runtime, vocab_size=len(tokenizer))
    trainer = KINDS[kind](args, model=model, dataset_train=train, dataset_eval=evaluation, processing_class=tokenizer)
    return trainer, resolved


def _model_tokenizer(model_cfg: dict, data_cfg: dict, overrides: list[str], config_path: str | None) -> str | None:
    """The tokenizer directory a run from `model.from_pretrained=DIR` uses when its tokenizer was not chosen:
    DIR itself, when it holds a tokenizer, unless `data.tokenizer` is given now, or by the user's own config
    file (the bundled demo's `tokenizer: bundled` is the demo's choice, not the user's)."""
    own = own_tokenizer(model_cfg.get("from_pretrained"))
    if own is None:
        return None
    if any(o.startswith("data.tokenizer=") for o in overrides):
        return None
    if config_path is not None and Path(config_path).name != "run_config.json" and "tokenizer" in data_cfg:
        return None  # the user's config file chose it
    if config_path is not None and Path(config_path).name == "run_config.json":
        return None  # a run directory: its own copy of the tokenizer is pinned by split_target
    return own


def _expanded(value: Any, key: str) -> Any:
    """Paths of the data section (a path, a list of paths, or a mixture's `{path, weight}` entries) expanded."""
    if isinstance(value, list):
        return [_expanded(v, key) for v in value]
    if isinstance(value, dict) and "path" in value:
        return {**value, "path": expand_path(value["path"], key)}
    return expand_path(value, key)


def restored(run_dir: str | Path, config: str | None = None, *, params_only: bool, step: int | None = None):
    """The trainer of a finished or running run with its newest checkpoint (or checkpoint `step`) restored, and
    nothing else set up (no data loading, no compile); FileNotFoundError when the run has no checkpoint (or none
    of `step`, naming the steps it has)."""
    # max_training_steps: the run's length is not needed to read its weights, and counting an epoch-based
    # run's steps would read its training data, which may be long gone
    config_path, items = split_target([str(run_dir)]) if config is None else (config, [f"save_directory={run_dir}"])
    trainer, _ = build_run(config_path, [*items, *READ_ONLY, "max_training_steps=1"])
    trainer.restore_checkpoint(params_only=params_only, step=step)
    return trainer


def model_for_inference(path: str | Path, step: int | None = None) -> tuple[Any, Any, Any, Any, int | None]:
    """`(model, tokenizer, eos, mesh, step)` of `path`: an HF model directory (with its tokenizer if it has one,
    else the bundled one; `eos` where transformers' generate stops; mesh and step None) or a run directory (its
    checkpoint `step`, default the newest, on the run's mesh; eos None). What `jaxloom generate`, `serve` and an
    lm-eval run load."""
    import jaxloom.data as jd
    import jaxloom.models as jm
    import jaxloom.state as js

    path = Path(path)
    eos: Any = None
    if (path / RUN_CONFIG).is_file():
        trainer = restored(path, None, params_only=True, step=step)
        restored_step = js.parse_step_name(str(trainer.resumed_from).rsplit("/", 1)[-1])[0]  # the step folder read
        return trainer.state.model, trainer.tokenizer, None, trainer.mesh, restored_step
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is neither a Hugging Face model directory (config.json) nor a jaxloom run directory ({RUN_CONFIG})"
        )
    if step is not None:
        raise ValueError(f"--step {step}: {path} is a Hugging Face model directory, which has no steps")
    model = jm.from_pretrained(path)
    has_tok = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    tokenizer = jd.load_processor(path if has_tok else None)
    for name in ("generation_config.json", "config.json"):  # where transformers' generate() stops
        if eos is None and (path / name).is_file():
            eos = json.loads((path / name).read_text()).get("eos_token_id")
    return model, tokenizer, eos, None, None
