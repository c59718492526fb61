"""EleutherAI's lm-evaluation-harness driven by jaxloom's own model and engine.

`JaxloomLM` is lm-eval's model `jaxloom` (registered when this module is imported): a run directory (its newest
checkpoint, or `step`) or an HF model directory, or an already loaded model; `loglikelihood` and
`loglikelihood_rolling` run the training forward (rows sorted by length and batched, the output layer in blocks of
positions, on the model's mesh), `generate_until` runs the paged engine (`jaxloom.generation.LLMEngine`) with
lm-eval's stop sequences. Tasks, prompts, few-shot sampling and metrics are lm-eval's own; nothing here formats a
prompt. `evaluate_tasks` runs lm-eval's `simple_evaluate` with it and writes lm-eval's results JSON atomically.

    jaxloom eval RUN_DIR --tasks arc_easy --limit 100            # or an HF model directory
    lm_eval.simple_evaluate(model="jaxloom", model_args="pretrained=RUN_DIR", tasks=[...])  # after importing this

Needs the `lm-eval` extra: `pip install "jaxloom-trainer[lm-eval]"`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from lm_eval.api.registry import register_model

from .harness_core import (
    PREFIX,
    LoadedLM,
    check_task_data,
    evaluate_tasks,
    scores,
    table,
    task_manager,
    write_results,
)

__all__ = [
    "PREFIX",
    "JaxloomLM",
    "LoadedLM",
    "check_task_data",
    "evaluate_tasks",
    "results_folder",
    "scores",
    "table",
    "task_manager",
    "write_results",
]


@register_model("jaxloom")
class JaxloomLM(LoadedLM):
    """lm-eval's model `jaxloom`: `pretrained` (a run directory, checkpoint `step` by default the newest, or an HF
    model directory), or an already loaded `model` with its `tokenizer` (and `mesh`, `eos_token_id`); `settings`
    as `LoadedLM`'s (`batch_size`, `max_length`, `max_gen_toks`, `add_bos_token`, `prefix_token_id`,
    `max_num_seqs`, `block_size`). Nothing is read until the first request."""

    def __init__(self, pretrained: str | None = None, *, model: Any = None, step: int | None = None, **settings: Any):
        if (pretrained is None) == (model is None):
            raise ValueError("JaxloomLM: give pretrained (a run or HF model directory) or model with its tokenizer")
        super().__init__(model=model, **settings)
        self.pretrained, self.step = pretrained, None if step is None else int(step)

    @functools.cached_property
    def _loaded(self) -> tuple[Any, Any, Any, Any]:
        if self.pretrained is None:
            return super()._loaded
        from .compose import model_for_inference

        model, tokenizer, eos, mesh, _ = model_for_inference(self.pretrained, self.step)
        return model, tokenizer, eos, mesh


def results_folder(model_path: str | Path, output_path: str | Path | None) -> Path:
    """Where `jaxloom eval --tasks` writes lm-eval's results for `model_path`: a run directory's `lm_eval/`
    (unless `output_path`); for an HF model directory lm-eval's `<output_path>/<model name>/` (default output
    path: the current directory), refused inside the model's directory (a model directory stays as exported)."""
    from lm_eval.utils import sanitize_model_name

    from .run_directory import RUN_CONFIG

    model_path = Path(model_path).resolve()
    if output_path is None and (model_path / RUN_CONFIG).is_file():
        return model_path / "lm_eval"
    base = Path(output_path if output_path is not None else ".").resolve()
    folder = base / sanitize_model_name(str(model_path))
    if not (model_path / RUN_CONFIG).is_file() and folder.is_relative_to(model_path):
        raise ValueError(
            f"--output-path {base} puts lm-eval's results inside the model directory {model_path}; expected a "
            "folder outside it (a model directory holds the model only)"
        )
    return folder
