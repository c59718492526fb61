"""The `jaxloom` command: `train`, `eval`, `plan`, `convert`.

jaxloom train [CONFIG.yaml] [key=value ...]     # no CONFIG: the bundled demo config
jaxloom train [CONFIG.yaml] [key=value ...] --ray num_workers=2 [max_failures=1 ...]
                                                 # a supervised gang of Ray workers (needs jaxloom-ray)
jaxloom eval CONFIG.yaml [key=value ...]         # evaluate the newest checkpoint of the run
jaxloom plan CONFIG.yaml [key=value ...]         # params, FLOPs/token, memory per device, from an AOT compile
jaxloom generate PATH --prompt TEXT [--max-new-tokens N] [--temperature T --top-k K --top-p P] [--chat]
                                                 # PATH: an HF model directory or a run's save_directory
jaxloom convert --to-hf SAVE_DIRECTORY OUT       # newest checkpoint → Hugging Face directory
                                                 # (model from SAVE_DIRECTORY/run_config.json)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

DEMO_CONFIG = Path(__file__).with_name("configs") / "demo.yaml"
RUN_CONFIG = "run_config.json"


def build_run(config_path: str | None, overrides: list[str]) -> tuple[Any, dict]:
    """Config file + overrides → (Trainer, info). Sections `model` and `data`; the rest are arguments."""
    from .arguments import TrainingArguments, apply_overrides, load_config_file

    data = apply_overrides(load_config_file(config_path or DEMO_CONFIG), overrides)
    resolved = json.loads(json.dumps(data))
    model_cfg, data_cfg = dict(data.pop("model", {}) or {}), dict(data.pop("data", {}) or {})
    unknown = sorted(set(data_cfg) - {"train", "eval", "eval_fraction", "tokenizer"})
    if unknown:
        raise ValueError(f"unknown key(s) in section data: {unknown}; expected train, eval, eval_fraction, tokenizer")
    args = TrainingArguments(**data)

    import jaxloom.data as jd
    import jaxloom.models as jm
    from .trainer import Trainer

    tokenizer = jd.load_processor(None if data_cfg.get("tokenizer", "bundled") == "bundled" else data_cfg["tokenizer"])
    train, evaluation = data_cfg.get("train", "bundled"), data_cfg.get("eval")
    if train == "bundled":
        records = jd.JsonlSource(jd.bundled_corpus_path()).read_shard(str(jd.bundled_corpus_path()))
        held = max(1, int(len(records) * float(data_cfg.get("eval_fraction", 0.05))))
        train, evaluation = records[:-held], evaluation or records[-held:]
    # The arguments' runtime settings are applied by the trainer too; given here as well so that weights
    # loaded from Hugging Face are laid out (stacked for scan_layers) and cast as the run needs them.
    runtime = jm.RuntimeConfig(**args.runtime.runtime_overrides())
    pretrained = model_cfg.pop("from_pretrained", None)
    if pretrained:
        model = jm.from_pretrained(pretrained, runtime, config_overrides=model_cfg or None)
    else:
        kind = model_cfg.pop("model_type", "llama")
        if kind not in jm.CONFIG_CLASSES:
            raise ValueError(f"model_type {kind!r} is not supported; known: {sorted(jm.CONFIG_CLASSES)}")
        model_cfg.setdefault("vocab_size", len(tokenizer))
        model = jm.create_model(jm.CONFIG_CLASSES[kind].from_hf_dict(model_cfg), runtime, lazy=True)
    trainer = Trainer(args, model, dataset_train=train, dataset_eval=evaluation, processing_class=tokenizer)
    return trainer, resolved


def write_run_config(trainer, resolved: dict) -> Path:
    """The resolved config beside the run, so `eval` and `convert` rebuild the same model."""
    path = Path(trainer.arguments.save_directory) / RUN_CONFIG
    if trainer.is_process_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(resolved, indent=2))
    return path


def _plan(trainer) -> dict[str, Any]:
    import jax

    import jaxloom.models as jm

    a = trainer.arguments
    compiled = trainer.compiled_train_step()  # for the exact shapes; also what train() runs
    mem = compiled.memory_analysis()
    per_device = {}
    if mem is not None:
        per_device = {
            "arguments_gb": mem.argument_size_in_bytes / 2**30,
            "outputs_gb": mem.output_size_in_bytes / 2**30,
            "temporaries_gb": mem.temp_size_in_bytes / 2**30,
            "generated_code_gb": mem.generated_code_size_in_bytes / 2**30,
        }
        aliased = getattr(mem, "alias_size_in_bytes", 0) / 2**30  # outputs written over donated arguments
        per_device["total_gb"] = sum(per_device.values()) - aliased
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    capacity = stats.get("bytes_limit")
    out = {
        "parameters": trainer.n_params,
        "flops_per_token": jm.flops_per_token(trainer.config, a.max_sequence_length),
        "mesh": dict(trainer.mesh.shape),
        "devices": f"{trainer.mesh.devices.size} × {device.device_kind}",
        "memory_per_device": per_device,
    }
    if capacity and per_device:
        out["fits"] = per_device["total_gb"] * 2**30 <= capacity
        out["device_capacity_gb"] = capacity / 2**30
    return out


def _generate(ns) -> int:
    """`jaxloom generate`: from an HF directory (with its tokenizer if it has one) or a run directory."""
    import jaxloom.data as jd
    import jaxloom.generation as jg
    import jaxloom.models as jm

    path = Path(ns.path)
    if (path / RUN_CONFIG).is_file():
        trainer = _restored(path, str(path / RUN_CONFIG), params_only=True)
        model, tokenizer = trainer.state.model, trainer.tokenizer
    elif (path / "config.json").is_file():
        model = jm.from_pretrained(path)
        has_tok = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
        tokenizer = jd.load_processor(path if has_tok else None)
    else:
        raise FileNotFoundError(
            f"{path} is neither a Hugging Face model directory (config.json) nor a jaxloom run directory ({RUN_CONFIG})"
        )
    sample = not ns.greedy and ns.temperature > 0
    config = jg.GenerationConfig(
        max_new_tokens=ns.max_new_tokens,
        do_sample=sample,
        temperature=ns.temperature or 1.0,
        top_k=ns.top_k,
        top_p=ns.top_p,
        seed=ns.seed,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    for prompt in ns.prompt:  # streamed: each token is printed as soon as it is decoded
        message = [{"role": "user", "content": prompt}] if ns.chat else prompt
        ids = jg.encode_prompts(tokenizer, message, apply_chat_template=ns.chat)[0]
        print(prompt, end="", flush=True)
        shown, new = "", []
        for token in jg.stream(model, ids, config):
            new.append(token)
            text = tokenizer.decode(new, skip_special_tokens=True)
            print(text[len(shown) :], end="", flush=True)
            shown = text
        print(flush=True)
    return 0


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


def _restored(run_dir: str | Path, config: str, *, params_only: bool):
    """The trainer of a finished or running run with its newest checkpoint restored, and nothing else
    set up (no data loading, no compile); FileNotFoundError when the run has no checkpoint."""
    # max_training_steps: the run's length is not needed to read its weights, and counting an epoch-based
    # run's steps would read its training data, which may be long gone
    trainer, _ = build_run(config, [f"save_directory={run_dir}", *READ_ONLY, "max_training_steps=1"])
    trainer.restore_checkpoint(params_only=params_only)
    return trainer


def exit_after_training_error(error: BaseException) -> None:
    """Training began and stopped on `error` (the trainer has already waited for the checkpoint in
    flight): print it with its notes (the step, what is safe on disk) and exit at once, so that orbax's
    writer threads cannot hold the interpreter open. Exit codes: 2 bad input, 3 failed save, 130 Ctrl-C,
    1 anything else."""
    import traceback

    from jaxloom.state import CheckpointSaveError, DirectoryLockedError

    if isinstance(error, CheckpointSaveError):
        code = 3
    elif isinstance(error, KeyboardInterrupt):
        code = 130
    elif isinstance(error, ValueError | TypeError | OSError | DirectoryLockedError):
        code = 2
    else:
        code = 1
    if code == 1:
        traceback.print_exception(error, file=sys.stderr)
    else:
        notes = "".join(f"\n{n}" for n in getattr(error, "__notes__", ()))
        print(f"jaxloom: error: {type(error).__name__}: {error}{notes}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _launcher(name: str):
    """The `--NAME` launcher registered by an installed part under the entry-point group
    `jaxloom.launchers` (jaxloom-ray registers `ray`): `fn(config, items, launcher_items) -> exit code`.
    Looked up, never imported by name, so this part depends on no later one."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="jaxloom.launchers") if ep.name == name]
    if not found:
        raise ValueError(f"--{name} needs the jaxloom-{name} package, which registers it; pip install jaxloom-{name}")
    return found[0].load()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxloom", description="Train, evaluate, plan and convert jaxloom runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("train", "eval", "plan"):
        p = sub.add_parser(name)
        p.add_argument("items", nargs="*", help="[CONFIG.yaml] then key=value overrides")
        if name == "train":
            p.add_argument(
                "--ray",
                nargs="*",
                metavar="KEY=VALUE",
                default=None,
                help="run on Ray: ScalingConfig settings (num_workers, max_failures, ...)",
            )
    gen = sub.add_parser("generate")
    gen.add_argument("path")
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--greedy", action="store_true")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to each prompt")
    conv = sub.add_parser("convert")
    conv.add_argument("--to-hf", nargs=2, metavar=("SAVE_DIRECTORY", "OUT"), required=True)
    conv.add_argument("--config", default=None)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    from jaxloom.state import DirectoryLockedError

    try:
        if ns.command == "generate":
            return _generate(ns)
        if ns.command == "convert":
            config = ns.config or Path(ns.to_hf[0]) / RUN_CONFIG
            trainer = _restored(ns.to_hf[0], str(config), params_only=True)
            print(trainer.save_pretrained(ns.to_hf[1], to_torch=True))
            return 0
        items = list(ns.items)
        config = items.pop(0) if items and "=" not in items[0] else None
        if getattr(ns, "ray", None) is not None:
            from .arguments import TrainingArguments, apply_overrides, load_config_file

            data = apply_overrides(load_config_file(config or DEMO_CONFIG), items)  # fail fast, before Ray starts
            TrainingArguments(**{k: v for k, v in data.items() if k not in ("model", "data")})
            return _launcher("ray")(config, items, ns.ray)
        if ns.command == "eval":
            trainer, _ = build_run(config, items + ["resume_if_possible=true"])
            trainer.restore_checkpoint()  # a run without a checkpoint is an error, never a random model's score
            print(json.dumps(trainer.evaluate(), indent=2))
            return 0
        trainer, resolved = build_run(config, items)
        if ns.command == "plan":
            print(json.dumps(_plan(trainer), indent=2))
        else:
            write_run_config(trainer, resolved)
            try:
                out = trainer.train()
            except BaseException as e:  # noqa: BLE001 - reported, then the process exits
                if not trainer._initialized:
                    raise  # nothing started: the usual error handling below
                exit_after_training_error(e)
            print(
                json.dumps(
                    {
                        "stop_reason": out.stop_reason,
                        "resumed_from": out.resumed_from,
                        "final": out.metrics,
                        "report": out.report_path,
                        "plot": out.plot_path,
                        "checkpoints": out.checkpoint_dir,
                    },
                    indent=2,
                    default=str,
                )
            )
            trainer.finish()
    except OSError as e:
        from jaxloom.state import CheckpointSaveError

        if not isinstance(e, CheckpointSaveError):
            if isinstance(e, FileNotFoundError):
                print(f"jaxloom: error: {e}", file=sys.stderr)
                return 2
            raise
        print(f"jaxloom: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)  # orbax's writer threads may hang after an I/O error: do not wait for them
    except (ValueError, TypeError, DirectoryLockedError) as e:
        print(f"jaxloom: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
