"""The `jaxloom` command: train, evaluate, plan, generate, convert, and show the settings.

jaxloom train [CONFIG.yaml | RUN_DIR] [key=value ...]   # no CONFIG: the bundled demo config
jaxloom train [CONFIG.yaml] [key=value ...] --ray num_workers=2 [max_failures=1 ...]
                                                 # a supervised gang of Ray workers (needs jaxloom-ray)
jaxloom eval RUN_DIR | CONFIG.yaml [key=value ...]  # evaluate the newest checkpoint of the run
jaxloom plan [CONFIG.yaml | RUN_DIR] [key=value ...]  # params, FLOPs/token, memory per device (AOT compile)
jaxloom generate PATH --prompt TEXT [--max-new-tokens N] [--temperature T --top-k K --top-p P] [--chat]
                                                 # PATH: an HF model directory or a run directory
jaxloom serve PATH [--host 127.0.0.1] [--port 8000]  # OpenAI's API on the paged engine, until Ctrl-C
jaxloom convert --to-hf RUN_DIR OUT [--merge]    # newest checkpoint → Hugging Face (LoRA: PEFT) directory
jaxloom data prepare SOURCE OUT [--tokenizer DIR] [--num-proc N] [--max-sequence-length L]
                                                 # tokenize once into a store; then data.train=OUT
jaxloom config keys                              # every setting: type, default, what it does
jaxloom config show [CONFIG.yaml | RUN_DIR] [key=value ...]  # the resolved config, as YAML

A RUN_DIR is a run's save_directory: it holds the resolved config (run_config.json) and a copy of the
tokenizer, so these commands work on it from any working directory, also after it is copied elsewhere.

Before train, eval, plan, generate and convert the program re-runs itself once with `GLIBC_TUNABLES` asking glibc for
transparent huge pages, where the kernel gives them only when asked (jaxloom.core.host: XLA's CPU runtime maps a
step's temporaries afresh every step); `JAXLOOM_HUGEPAGES=0` turns that off.

Exit status: 0 done; 2 bad input (a setting, a file, a run directory); 3 a checkpoint could not be
saved; 4 nothing to train (the run in save_directory already reached max_training_steps); 128+N
stopped by signal N after saving (130: Ctrl-C, 143: SIGTERM, 129: SIGHUP); 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxloom.core import host, paths

from .image_prompts import PROMPT_MARK
from .report import versions
from .compose import DATA_KEYS, DEMO_CONFIG, READ_ONLY, build_run, kind_settings, restored, split_target  # noqa: F401


def _model_to_generate(ns) -> tuple[Any, Any, Any]:
    """`(model, tokenizer, eos)` of `ns.path` (`compose.model_for_inference`), checkpoint `ns.step` of a run."""
    from .compose import model_for_inference

    model, tokenizer, eos, _, _ = model_for_inference(ns.path, ns.step)
    return model, tokenizer, eos


def _serve(ns) -> int:
    """`jaxloom serve`: OpenAI's API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`) on the paged
    engine, for an HF directory or a run directory; until Ctrl-C."""
    import jaxloom.generation as jg

    model, tokenizer, eos = _model_to_generate(ns)
    eos = tuple(eos) if isinstance(eos, list) else eos if eos is not None else tokenizer.eos_token_id
    config = jg.GenerationConfig(do_sample=True, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id or 0)
    engine = jg.LLMEngine(model, config, max_num_seqs=ns.max_num_seqs, tokenizer=tokenizer)
    name = ns.model_name or Path(ns.path).resolve().name
    server = jg.OpenAIServer(engine, tokenizer, model_name=name, host=ns.host, port=ns.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # set here: a parent that ignores them must not make it unstoppable
        signal.signal(sig, lambda *_: stop.set())
    host_, port = server.start()
    print(f"serving {name} at http://{host_}:{port}/v1 (Ctrl-C stops)", flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    return 0


def _generate(ns) -> int:
    """`jaxloom generate`: from an HF directory (with its tokenizer if it has one) or a run directory."""
    import numpy as np

    import jaxloom.generation as jg

    model, tokenizer, eos = _model_to_generate(ns)
    sample = not ns.greedy and ns.temperature > 0
    config = jg.GenerationConfig(
        max_new_tokens=ns.max_new_tokens,
        do_sample=sample,
        temperature=ns.temperature or 1.0,
        top_k=ns.top_k,
        top_p=ns.top_p,
        seed=ns.seed,
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos if eos is not None else tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    if ns.chat:  # a reply ends at the template's end-of-turn token
        config = jg.with_stop_ids(config, jg.end_of_turn_ids(tokenizer))
    n = ns.num_return_sequences
    if n < 1:
        raise ValueError(f"--num-return-sequences {n}; expected a positive integer")
    if n > 1 and not sample:
        raise ValueError(f"--num-return-sequences {n} with greedy decoding gives {n} equal texts; expected sampling "
                         "(--temperature > 0) or 1")  # fmt: skip
    if ns.image:
        from .image_prompts import generate_with_images

        return generate_with_images(ns, model, tokenizer, config)
    for i, prompt in enumerate(ns.prompt):  # streamed: each token is printed as soon as it is decoded
        message = [{"role": "user", "content": prompt}] if ns.chat else prompt
        ids = jg.encode_prompts(tokenizer, message, apply_chat_template=ns.chat)[0]
        print(f"{PROMPT_MARK}{prompt}", flush=True)  # the prompt on its own line; the completion(s) below it
        for j in range(n):
            if n > 1:
                print(f"[{j + 1}] ", end="", flush=True)
            # each prompt and each sample its own key; `--seed` still reproduces the whole output
            seed = int(np.random.SeedSequence([ns.seed, i, j]).generate_state(1)[0] >> 1)
            shown, new = "", []
            for token in jg.stream(model, ids, config.replace(seed=seed)):
                new.append(token)
                text = tokenizer.decode(new, skip_special_tokens=True)
                print(text[len(shown) :], end="", flush=True)
                shown = text
            print(flush=True)
    return 0


def _lm_eval(ns) -> int:
    """`jaxloom eval RUN_DIR|HF_DIR --tasks ...`: lm-eval's tasks on jaxloom's model and engine; lm-eval's table
    and the scores (`lm_eval/<task>/<metric>`) printed, its results JSON written (`harness.results_folder`)."""
    if len(ns.items) != 1 or "=" in ns.items[0]:
        raise ValueError(
            f"eval --tasks takes one run directory or HF model directory, got {ns.items}; settings do not apply"
        )
    from . import harness
    from .compose import model_for_inference

    path = ns.items[0]
    folder = harness.results_folder(path, ns.output_path)  # refused before anything is loaded
    tasks = [t.strip() for t in ns.tasks.split(",") if t.strip()]
    harness.check_task_data(tasks, ns.include_path)  # names and documents checked before the model is read
    model, tokenizer, eos, mesh, step = model_for_inference(path, ns.step)
    lm = harness.JaxloomLM(model=model, tokenizer=tokenizer, mesh=mesh, eos_token_id=eos, batch_size=ns.batch_size)
    results = harness.evaluate_tasks(
        lm,
        tasks,
        num_fewshot=ns.num_fewshot,
        limit=ns.limit,
        include_path=ns.include_path,
        apply_chat_template=ns.apply_chat_template,
        output_folder=folder,
        step=step,
    )
    print(harness.table(results))
    said = {f"{harness.PREFIX}{k}": v for k, v in harness.scores(results).items()}
    print(json.dumps({"step": step, "results_file": results["jaxloom"].get("results_file"), **said}, indent=2))
    return 0


def exit_after_training_error(error: BaseException) -> None:
    """Training began and stopped on `error` (the trainer has already waited for the checkpoint in
    flight): print it with its notes (the step, what is safe on disk) and exit at once, so that orbax's
    writer threads cannot hold the interpreter open. Exit codes: 2 bad input, 3 failed save, 130 Ctrl-C,
    5 the run directory's store lease taken by another run, 1 anything else (4: a run already complete)."""
    import traceback

    from jaxloom.state import CheckpointSaveError, DirectoryLockedError, LeaseLostError

    from .usercode import for_terminal, user_error

    if isinstance(error, LeaseLostError):
        code = 5
    elif isinstance(error, CheckpointSaveError):
        code = 3
    elif isinstance(error, KeyboardInterrupt):
        code = 130
    elif isinstance(error, ValueError | TypeError | OSError | DirectoryLockedError):
        code = 2
    else:
        code = 1
    if code == 1 and user_error(error) is not None:  # the user's frames and one line, none of jaxloom's
        print(for_terminal(error), file=sys.stderr)
    elif code == 1:
        traceback.print_exception(error, file=sys.stderr)
    else:
        notes = "".join(f"\n{n}" for n in getattr(error, "__notes__", ()))
        print(f"jaxloom: error: {type(error).__name__}: {error}{notes}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


class _StartupNoise(logging.Filter):
    """Drops the start-up notices that never apply to a jaxloom run."""

    NOISE = (
        "Unable to initialize backend",
        "libtpu",
        "An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not installed",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.NOISE)


def setup_console() -> None:
    """The command's console: jaxloom's own INFO lines, other libraries' warnings and errors only, and
    the start-up notices that never apply to a jaxloom run (transformers' note that no PyTorch is
    installed, JAX's search for TPU and CUDA backends that are not there) left out."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # read when transformers is imported
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's C++ INFO lines, read when jaxlib loads
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxloom").setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's INFO lines
    for handler in logging.getLogger().handlers:
        handler.addFilter(_StartupNoise())


def _launcher(name: str):
    """The `--NAME` launcher registered by an installed part under the entry-point group
    `jaxloom.launchers` (jaxloom-ray registers `ray`): `fn(config, items, launcher_items) -> exit code`.
    Looked up, never imported by name, so this part depends on no later one."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="jaxloom.launchers") if ep.name == name]
    if not found:
        raise ValueError(f"--{name} needs the jaxloom-{name} package, which registers it; pip install jaxloom-{name}")
    return found[0].load()


def _config_keys(model_type: str) -> str:
    """Every key a config takes: the data section, the model section (the config class of
    `model_type`), then every training argument, each with its type, default and what it does."""
    import dataclasses

    import jaxloom.models as jm

    from .arguments import ALIASES, RENAMED
    from .distillation_config import DistillationConfig
    from .dpo_config import DPOConfig
    from .grpo.config import GRPOConfig
    from .grpo.rloo import RLOOConfig
    from .kto_config import KTOConfig
    from .kinds import TRAINERS
    from .reward_config import RewardConfig

    if model_type not in jm.CONFIG_CLASSES:
        raise ValueError(f"model_type {model_type!r} is not supported; known: {sorted(jm.CONFIG_CLASSES)}")
    from .compose import DATA_TYPES

    lines = ["# data: what to train on"]
    lines += [f"data.{k}: {DATA_TYPES[k][0]} = {DATA_TYPES[k][1]!r}  {v}" for k, v in DATA_KEYS.items()]
    lines.append("")
    lines.append(f"# model: Hugging Face config names ({jm.CONFIG_CLASSES[model_type].__name__}), or from_pretrained")
    lines.append(
        "model.from_pretrained: str = None  a local Hugging Face model directory (config.json + safetensors): its "
        "architecture, weights, tokenizer, chat template and generation config (nothing is downloaded: a Hub id "
        "is not a directory); model.KEY=VALUE given with it overrides its config.json"
    )
    lines.append("model.model_type: str = 'llama'  " + ", ".join(sorted(jm.CONFIG_CLASSES)))
    for f in dataclasses.fields(jm.CONFIG_CLASSES[model_type]):
        if f.name.startswith("_"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        lines.append(f"model.{f.name}: {f.type} = {default!r}")
    group = None
    lines += [
        "",
        "# trainer",
        f"trainer: str = 'sft'  which trainer: {', '.join(TRAINERS)} "
        "(dpo adds # preference, kto # kto, grpo and rloo # rl, reward # reward, distillation # distillation)",
    ]
    kinds = {
        "preference": "trainer=dpo only",
        "kto": "trainer=kto only",
        "rl": "trainer=grpo and rloo; the keys marked [rloo] rloo only",
        "reward": "trainer=reward only",
        "distillation": "trainer=distillation only",
    }
    own = [f for f in GRPOConfig.fields() if f["group"] == "rl"]
    grpo_keys = {f["name"] for f in own}
    rloo_only = [f for f in RLOOConfig.fields() if f["group"] == "rl" and f["name"] not in grpo_keys]
    own += rloo_only
    own += [f for f in KTOConfig.fields() if f["group"] == "kto"]
    own += [f for f in RewardConfig.fields() if f["group"] == "reward"]
    own += [f for f in DistillationConfig.fields() if f["group"] == "distillation"]
    names = [f["name"] for f in [*DPOConfig.fields(), *own]]
    shared = {n for n in names if names.count(n) > 1}  # a key of several kinds: each kind's own default
    for f in [*DPOConfig.fields(), *own]:
        if f["group"] != group:
            group = f["group"]
            lines += ["", f"# {group}" + (f" ({kinds[group]}; a key both kinds have keeps each kind's default)"
                                          if group in kinds else "")]  # fmt: skip
        both = f["name"] in shared
        kind = {"preference": " [dpo]", "kto": " [kto]", "rl": " [grpo]", "distillation": " [distillation]"}.get(
            str(group), ""
        )
        kind = kind if both else " [rloo]" if f in rloo_only else ""
        if f["name"] == "beta" and group == "rl":
            kind += " (rloo's default: 0.05)"
        lines.append(f"{f['name']}: {f['type']} = {f['default']!r}  {f['doc']}{kind}")
    lines += ["", "# other names (HF Trainer, TRL, EasyDeL): read as the jaxloom key, or refused naming it"]
    lines += [f"{alias}: the same as {name}" for alias, name in ALIASES.items()]
    lines.append(
        "max_length: the same as max_sequence_length (TRL's SFTConfig, DPOConfig, KTOConfig and RewardConfig name; "
        "trainer=sft, dpo, kto or reward)"
    )
    lines += [f"{name}: refused; use {instead}" for name, instead in RENAMED.items()]
    lines += ["", *_launcher_keys()]
    return "\n".join(lines)


def _launcher_keys() -> list[str]:
    """`--ray KEY=VALUE` settings, read from the installed jaxloom-ray (its `ScalingConfig`), or how to get them."""
    import dataclasses
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="jaxloom.launchers") if ep.name == "ray"]
    head = "# --ray KEY=VALUE: how `jaxloom train ... --ray` runs the gang (jaxloom-ray's ScalingConfig)"
    if not found:
        return [head, "(jaxloom-ray is not installed: pip install jaxloom-ray)"]
    launcher = found[0].load()  # the registered function; its package (jaxloom.ray) is imported with it
    package = sys.modules.get(launcher.__module__.rsplit(".", 1)[0])
    scaling = getattr(package, "ScalingConfig", None)
    if scaling is None:
        return [head, "(the installed jaxloom-ray does not list its keys)"]
    return [head, *(f"--ray {f.name}: {f.type} = {f.default!r}" for f in dataclasses.fields(scaling))]


def _config_show(config: str | None, items: list[str]) -> str:
    """The config the run would use, as YAML: exactly what `train` with the same arguments runs and records in
    `run_config.json` (`resolve_settings`), then, as comments, where each setting you did not give comes from
    and every other setting at its default."""
    import yaml

    from .compose import resolve_settings
    from .kinds import arguments_of

    resolved, sources = resolve_settings(config, items)
    top = {k: v for k, v in resolved.items() if k not in ("model", "data")}
    _, args = arguments_of(top)  # checked as a run would check them
    text = yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True)
    if sources:
        text += "# where the settings you did not give come from:\n"
        text += "".join(f"#   {k}: {where}\n" for k, where in sources.items())
    defaults = {k: v for k, v in json.loads(json.dumps(args.to_dict(), default=str)).items() if k not in top}
    text += "# every other setting, at its default (not recorded; `jaxloom config keys` says what each does):\n"
    return text + "".join(f"# {line}\n" for line in yaml.safe_dump(defaults, sort_keys=False).splitlines())


class _Versions(argparse.Action):
    """`--version`: the installed parts' versions, one a line (looked up only when asked)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(f"{k} {v}" for k, v in versions().items()))
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxloom",
        description="Train, evaluate, plan, generate from and convert jaxloom runs.",
        epilog="Settings: `jaxloom config keys` lists every key; `jaxloom config show` prints a resolved config.",
    )
    parser.add_argument("--version", action=_Versions, help="print the installed parts' versions, one a line, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    target = "[CONFIG.yaml | RUN_DIR] then key=value overrides (see `jaxloom config keys`)"
    helps = {
        "train": "train a model (no CONFIG: the bundled demo); a RUN_DIR or a save_directory with checkpoints resumes",
        "eval": "evaluate the newest checkpoint of a run",
        "plan": "parameters, FLOPs per token and memory per device, from an ahead-of-time compile",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text + ". " + _KEYS_HINT)
        p.add_argument("items", nargs="*", metavar="ITEM", help=target)
        if name == "eval":
            p.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
            lm = p.add_argument_group(
                "lm-evaluation-harness (the lm-eval extra)",
                "with --tasks, ITEM is a run directory or an HF model directory",
            )
            lm.add_argument("--tasks", default=None, help="lm-eval task names, comma-separated (arc_easy,hellaswag)")
            lm.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
            lm.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if below 1)")
            lm.add_argument("--include-path", default=None, help="a folder of one's own lm-eval task YAMLs")
            lm.add_argument(
                "--output-path",
                default=None,
                help="where lm-eval's results JSON goes (default: RUN_DIR/lm_eval; for an HF directory ./<name>/)",
            )
            lm.add_argument("--batch-size", type=int, default=16, help="rows per forward")
            lm.add_argument("--apply-chat-template", action="store_true", help="lm-eval's chat formatting of prompts")
        if name == "train":
            p.add_argument(
                "--ray",
                nargs="*",
                metavar="KEY=VALUE",
                default=None,
                help="run on Ray: ScalingConfig settings (num_workers, max_failures, ...)",
            )
    text = "generate text from an HF model directory or a run directory (streamed)"
    gen = sub.add_parser("generate", help=text, description=text)
    gen.add_argument("path", help="an HF model directory (config.json) or a run directory (run_config.json)")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--greedy", action="store_true", help="greedy decoding (also when --temperature is 0)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0, help="the whole output's seed (each prompt and sample its own key)")
    gen.add_argument("--num-return-sequences", type=int, default=1, help="samples per prompt (TRL/HF's name)")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to each prompt")
    gen.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image every prompt shows (repeat for several; a vision-language model: Qwen2.5-VL)",
    )
    gen.add_argument(
        "--step", type=int, default=None, help="a run directory's checkpoint of this step (default: newest)"
    )
    text = "serve an HF model directory or a run directory with OpenAI's API (the paged engine)"
    srv = sub.add_parser("serve", help=text, description=text)
    srv.add_argument("path", help="an HF model directory (config.json) or a run directory (run_config.json)")
    srv.add_argument("--host", default="127.0.0.1", help="the address to bind (default: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded at once (the engine's slots)")
    srv.add_argument("--model-name", default=None, help="the name /v1/models lists (default: the directory's)")
    srv.add_argument("--step", type=int, default=None, help="a run directory's checkpoint (default: newest)")
    text = (
        "export the newest checkpoint of a run as a Hugging Face model directory (with its tokenizer), or rewrite "
        "a run's checkpoints with arrays in another format"
    )
    conv = sub.add_parser("convert", help=text, description=text)
    what = conv.add_mutually_exclusive_group(required=True)
    what.add_argument("--to-hf", nargs=2, metavar=("RUN_DIR", "OUT"))
    what.add_argument(
        "--checkpoint",
        nargs=2,
        metavar=("RUN_DIR", "OUT"),
        help="write RUN_DIR's checkpoints into the checkpoint directory OUT with arrays in --format",
    )
    conv.add_argument(
        "--format", choices=("orbax", "raw"), default="orbax", help="with --checkpoint: orbax's standard or raw"
    )
    conv.add_argument(
        "--step",
        type=int,
        default=None,
        help="this checkpoint (default: --to-hf the newest; --checkpoint every one); a step not there is an error",
    )
    conv.add_argument("--config", default=None, help="the run's config (default: RUN_DIR/run_config.json)")
    conv.add_argument(
        "--merge", action="store_true", help="a LoRA run: the merged full model (default: a PEFT adapter directory)"
    )
    text = "tokenize a corpus once into a token store that training reads by memory map (data.train=OUT)"
    data = sub.add_parser("data", help=text, description=text)
    dsub = data.add_subparsers(dest="action", required=True, metavar="ACTION")
    prep = dsub.add_parser("prepare", help=text, description=text)
    prep.add_argument("source", help="a .jsonl/.parquet/.txt file or glob (quoted), or a saved HF dataset directory")
    prep.add_argument("out", help="the store directory to make (continues an unfinished one)")
    prep.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the bundled one)")
    prep.add_argument("--num-proc", type=int, default=1, help="processes tokenizing in parallel")
    prep.add_argument("--max-sequence-length", type=int, default=None, help="split longer documents into rows")
    prep.add_argument("--no-bos", action="store_true", help="do not put BOS before each document")
    prep.add_argument("--no-eos", action="store_true", help="do not put EOS after each document")
    text = "list every setting (keys) or print a resolved config (show)"
    cfg = sub.add_parser("config", help=text, description=text)
    csub = cfg.add_subparsers(dest="action", required=True, metavar="ACTION")
    keys = csub.add_parser("keys", help="every key: type, default, what it does")
    keys.add_argument("--model-type", default="llama", help="whose model keys to list (default: llama)")
    show = csub.add_parser("show", help="the resolved config as YAML (defaults included)")
    show.add_argument("items", nargs="*", metavar="ITEM", help=target)
    return parser


_KEYS_HINT = "`jaxloom config keys` lists every setting"


def _convert_checkpoints(ns) -> int:
    """`jaxloom convert --checkpoint RUN_DIR OUT`: the run's checkpoints, read onto its own state's structure,
    written into OUT in `--format`."""
    from jaxloom.state import convert_checkpoint

    run_dir, out = ns.checkpoint
    config_path, items = split_target([run_dir]) if ns.config is None else (ns.config, [f"save_directory={run_dir}"])
    trainer, _ = build_run(config_path, [*items, *READ_ONLY, "max_training_steps=1"])
    source = str(trainer.run_directory.checkpoints)
    steps = convert_checkpoint(source, out, array_format=ns.format, step=ns.step, target=trainer.plan.target())
    print(json.dumps({"converted": steps, "from": source, "to": out, "format": ns.format}))
    return 0


def _prepare(ns) -> int:
    import jaxloom.data as jd

    for flag in ("num_proc", "max_sequence_length"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value}; expected a positive integer")
    config = jd.DataConfig(add_bos=not ns.no_bos, add_eos=not ns.no_eos)
    paths.check_writable_target(ns.out, "the token store")
    restore = _stop_prepare_at_once(ns.out)
    try:
        manifest = jd.prepare(
            ns.source,  # a glob is expanded by the source
            ns.out,
            ns.tokenizer,
            config=config,
            num_proc=ns.num_proc,
            max_sequence_length=ns.max_sequence_length,
            progress=sys.stderr.isatty(),
        )
    finally:
        restore()
    keys = ("documents", "tokens", "dtype", "tokenizer")
    print(json.dumps({"store": str(ns.out), **{k: manifest[k] for k in keys}, "shards": len(manifest["shards"])}))
    return 0


def _stop_prepare_at_once(out: str):
    """Ctrl-C or SIGTERM during `jaxloom data prepare` exits at once, saying what is kept: its finished units are
    on disk and the same command continues from them (a KeyboardInterrupt could be swallowed by a library
    callback, and the prepare ran on to exit 0). Returns the function that puts the previous handlers back."""
    import signal

    def stop(signum, _frame):
        print(
            f"jaxloom: prepare interrupted (signal {signum}): its finished units are kept in {out}.partial; run the "
            "same command to continue",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(sig, handler) for sig, handler in old.items()]


def _train(train: Callable[[], Any], finish: Callable[[], None], started: Callable[[], bool]) -> int:
    """`jaxloom train`: `train()`, its summary printed, `finish()`; the exit code. An error once the run started
    (`started()`) is reported as the run's (what is safe on disk), not as a traceback."""
    from .outputs import ALREADY_COMPLETE

    try:
        out = train()
    except BaseException as e:  # noqa: BLE001 - reported, then the process exits
        if not started():
            raise  # nothing started: the usual error handling
        exit_after_training_error(e)
    from .metrics import console

    console(json.dumps(run_summary(out), indent=2, default=str))  # a closed stdout loses the summary, not the run
    finish()
    if out.stop_reason.startswith(ALREADY_COMPLETE):
        return 4
    return 128 + out.signal if out.signal else 0


SUMMARY_KEYS = ("stop_reason", "step", "resumed_from", "final", "report", "plot", "checkpoints")


def run_summary(out) -> dict[str, Any]:
    """What `jaxloom train` prints at the end: `SUMMARY_KEYS` (the same first keys with --ray)."""
    return {
        "stop_reason": out.stop_reason,
        "step": int(out.state.step) if out.state is not None else None,
        "resumed_from": out.resumed_from,
        "final": out.metrics,
        "report": out.report_path,
        "plot": out.plot_path,
        "checkpoints": out.checkpoint_dir,
    }


def _disk_error(error: OSError) -> str | None:
    """One line for a write the disk refused (full, over quota, file too large, read-only, no permission): what
    could not be written and what to do; None for other errors (raised as they are)."""
    import errno

    where = error.filename or "a file"
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return (
            f"the disk is full writing {where} ({error.strerror}); free space there or write elsewhere — an export "
            "or checkpoint in progress is not complete, and the previous one is left as it was"
        )
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"cannot write {where} ({error.strerror}); expected a writable directory (choose another, or fix it)"
    return None


_OWN_OPTIONS = {  # options of a command itself, not settings
    "eval": (
        "--step",
        "--tasks",
        "--num-fewshot",
        "--limit",
        "--include-path",
        "--output-path",
        "--batch-size",
        "--apply-chat-template",
    )
}
_FLAGS = {"--apply-chat-template"}  # own options without a value


def key_value_forms(argv: list[str]) -> list[str]:
    """`train`/`eval`/`plan` arguments with HF's and argparse's forms of a setting, `--key=value` and `--key value`
    (dashes in the key read as underscores), turned into jaxloom's `key=value`, placed after the config or run
    directory and before `--ray`. A `--key` without a value is an error naming the three forms."""
    if not argv or argv[0] not in ("train", "eval", "plan"):
        return argv
    rest, kept, moved, options, i = argv[1:], [], [], [], 0
    own = _OWN_OPTIONS.get(argv[0], ())
    while i < len(rest):
        item = rest[i]
        if item.split("=", 1)[0] in own:  # the command's own option, and its value: kept as they are, at the end
            options.append(item)
            if "=" not in item and item not in _FLAGS and i + 1 < len(rest):
                options.append(rest[i + 1])
                i += 1
        elif item.startswith("--") and item not in ("--ray", "--help", "--"):
            key, eq, value = item[2:].partition("=")
            key = key.replace("-", "_")
            if not eq:
                if i + 1 == len(rest) or rest[i + 1].startswith("--"):
                    raise ValueError(f"{item} needs a value: --{key}=VALUE, --{key} VALUE or {key}=VALUE")
                value, i = rest[i + 1], i + 1
            moved.append(f"{key}={value}")
        else:
            kept.append(item)
        i += 1
    first = 1 if kept and not kept[0].startswith("-") and "=" not in kept[0] else 0
    return [argv[0], *kept[:first], *moved, *kept[first:], *options]


# The commands that run XLA programs: the `jaxloom` program re-runs itself for them with glibc asking for huge pages
# (jaxloom.core.host: on CPU a step's temporaries are mapped afresh every step; huge pages: ~14 % more tokens/s).
COMPUTING = frozenset({"train", "eval", "plan", "generate", "serve", "convert"})


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in COMPUTING and "--ray" not in sys.argv:
        try:  # the program itself, not a call from Python; a Ray driver computes nothing
            host.reexec_with_hugepages()
        except ValueError as e:  # JAXLOOM_HUGEPAGES neither on nor off
            print(f"jaxloom: error: {e}", file=sys.stderr)
            return 2
    try:
        argv = key_value_forms(list(sys.argv[1:] if argv is None else argv))
    except ValueError as e:
        print(f"jaxloom: error: {e}", file=sys.stderr)
        return 2
    ns = _parser().parse_args(argv)
    setup_console()
    from jaxloom.state import DirectoryLockedError

    from .usercode import UserCodeError, for_terminal

    try:
        if ns.command == "config":
            if ns.action == "keys":
                print(_config_keys(ns.model_type))
            else:
                print(_config_show(*split_target(ns.items)), end="")
            return 0
        if ns.command == "generate":
            return _generate(ns)
        if ns.command == "serve":
            return _serve(ns)
        if ns.command == "data":
            return _prepare(ns)
        if ns.command == "convert":  # the target named before any checkpoint is read
            paths.check_writable_target((ns.checkpoint or ns.to_hf)[1], "the convert target")
        if ns.command == "convert" and ns.checkpoint:
            return _convert_checkpoints(ns)
        if ns.command == "convert":
            trainer = restored(ns.to_hf[0], ns.config, params_only=True, step=ns.step)
            print(trainer.save_pretrained(ns.to_hf[1], to_torch=True, merge_adapters=ns.merge))
            return 0
        if ns.command == "eval" and ns.tasks is not None:
            return _lm_eval(ns)
        config, items = split_target(ns.items)
        if getattr(ns, "ray", None) is not None:
            from .compose import resolve_settings
            from .kinds import arguments_of

            resolved, _ = resolve_settings(config, items)  # the run's own resolution, checked before Ray starts
            _, args = arguments_of({k: v for k, v in resolved.items() if k not in ("model", "data")})
            if args.save_directory is None:  # chosen once by the driver: every restart of the gang resumes it
                from .resume import fresh_run_directory

                items = [*items, f"save_directory={fresh_run_directory()}"]
            return _launcher("ray")(config, items, ns.ray)
        if ns.command == "eval":
            trainer, _ = build_run(config, items + ["resume_if_possible=true"])
            trainer.restore_checkpoint(step=ns.step)  # no checkpoint is an error, never a random model's score
            scores = {f"eval/{k}": v for k, v in trainer.evaluate().items()}  # as metrics.jsonl names them
            print(json.dumps({"step": int(trainer.state.step), **scores}, indent=2))
            return 0
        trainer, resolved = build_run(config, items)
        if ns.command == "plan":
            from .setup import memory_plan

            print(json.dumps(trainer.parts.call(memory_plan, trainer), indent=2))
            return 0
        trainer.run_config = resolved  # written to save_directory/run_config.json once the run is set up
        started = lambda: trainer.parts.built("setup") and trainer.setup.done  # noqa: E731
        return _train(trainer.train, trainer.finish, started)
    except OSError as e:
        from jaxloom.state import CheckpointSaveError

        if not isinstance(e, CheckpointSaveError):
            # a missing input; a target another run holds; data out of reach (an lm-eval task's Hub dataset)
            if isinstance(e, FileNotFoundError | FileExistsError | ConnectionError):
                print(f"jaxloom: error: {e}", file=sys.stderr)
                return 2
            said = _disk_error(e)
            if said is None:
                raise
            print(f"jaxloom: error: {said}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(3)  # a writer thread may still hold the file: do not wait for it
        print(f"jaxloom: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)  # orbax's writer threads may hang after an I/O error: do not wait for them
    except (ValueError, TypeError, DirectoryLockedError) as e:
        print(f"jaxloom: error: {e}", file=sys.stderr)
        return 2
    except UserCodeError as e:  # a reward, environment or tool failed before training began: its frames, one line
        print(for_terminal(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before training began (setup, the first compile): nothing to save
        print(
            "jaxloom: interrupted before training began: nothing was trained and nothing needs saving; run the same "
            "command again to start",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(130)  # the train step may still be compiling in a background thread: do not wait for it


if __name__ == "__main__":
    sys.exit(main())
