"""lm-evaluation-harness on a loaded jaxloom model: `LoadedLM` (lm-eval's `TemplateLM`: loglikelihood and rolling
perplexity through the forward, generate_until on the paged engine, lm-eval's `hf` rules exactly), lm-eval's tasks
run with it (`evaluate_tasks`), its results written atomically and its scores named as jaxloom logs them. The public
face, with lm-eval's registered model `jaxloom` that also loads run and HF directories, is `jaxloom.trainer.harness`;
a run's `eval_tasks` (`jaxloom.trainer.benchmarks`) use this module directly.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

try:
    # lm-eval's own models first: its registry fills itself from `lm_eval.models` only while it is empty, so a
    # registry holding `jaxloom` alone would no longer find `hf`, `vllm`, ... (placeholders: nothing heavy loads)
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
except ImportError as e:  # the optional extra
    raise ImportError(
        "lm-evaluation-harness is not installed: pip install 'jaxloom-trainer[lm-eval]' (or lm-eval) to evaluate on "
        "its tasks"
    ) from e

log = logging.getLogger("jaxloom.trainer")

PREFIX = "lm_eval/"
"""Where lm-eval's scores are logged: `lm_eval/<task>/<metric>` (lm-eval's names; `<metric>/<filter>` when the filter
is not `none`), in metrics.jsonl, TensorBoard and report.md."""


def _bucket(n: int, cap: int) -> int:
    """The padded width of a batch whose longest row is `n` tokens: the next power of two (at least 16, at most
    `cap`), so a task's rows compile a handful of programs, not one per length."""
    return min(cap, max(16, 1 << (n - 1).bit_length()))


class LoadedLM(TemplateLM):
    """lm-eval's model over a loaded jaxloom `model` with its `tokenizer` (on `mesh`, the mesh its parameters are
    on; `eos_token_id`: where generation stops, default the tokenizer's). `batch_size`: rows per forward (lm-eval's
    `auto` takes 16); `max_length` (default: the model's positions): the longest row, longer ones lose their start
    as lm-eval's `hf` model does; `max_gen_toks`: `generate_until`'s default; `add_bos_token` and `prefix_token_id`
    as lm-eval's `hf` model; `max_num_seqs`: the engine's decode slots; `block_size`: positions of one block of the
    output layer. Rows and tokens are the `hf` model's exactly (same encoding, truncation and stop handling), so
    scores match it. `max_batch_size` and `device` (lm-eval passes them) are not used: the mesh places the rows."""

    def __init__(
        self,
        *,
        model: Any = None,
        tokenizer: Any = None,
        mesh: Any = None,
        eos_token_id: Any = None,
        batch_size: int | str = 16,
        max_batch_size: int | None = None,
        device: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        max_num_seqs: int = 64,
        block_size: int = 1024,
        **unknown: Any,
    ):
        super().__init__()
        if unknown:
            raise ValueError(
                f"model_args {sorted(unknown)} are not settings of lm-eval's jaxloom model; expected some of "
                "pretrained, step, batch_size, max_length, max_gen_toks, add_bos_token, prefix_token_id, "
                "max_num_seqs, block_size"
            )
        if model is not None and tokenizer is None:
            raise ValueError("a jaxloom model for lm-eval needs its tokenizer (tokenizer=)")
        if isinstance(batch_size, str):
            batch_size = 16 if batch_size.startswith("auto") else int(batch_size)
        for name, value in (("batch_size", batch_size), ("max_gen_toks", max_gen_toks), ("block_size", block_size)):
            if int(value) < 1:
                raise ValueError(f"{name} = {value}; expected a positive integer")
        self._given = (model, tokenizer, eos_token_id, mesh)
        self._batch_size, self._max_length = int(batch_size), None if max_length is None else int(max_length)
        self._max_gen_toks, self.max_num_seqs, self.block_size = int(max_gen_toks), int(max_num_seqs), int(block_size)
        self.add_bos_token = None if add_bos_token is None else _flag(add_bos_token)
        self.custom_prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)
        self.timings = {"loglikelihood_s": 0.0, "generate_s": 0.0}

    # -- what lm-eval reads --------------------------------------------------------------------------------
    @functools.cached_property
    def _loaded(self) -> tuple[Any, Any, Any, Any]:
        """`(model, tokenizer, eos, mesh)` (a subclass may load them on first use)."""
        if self._given[0] is None:
            raise ValueError("a jaxloom model for lm-eval needs model= and tokenizer=")
        return self._given

    def set_model(self, model: Any) -> None:
        """Score and generate with `model` from now on — the same architecture with other weights (a run's state at
        its next evaluation): the compiled scoring programs are kept (they take the weights as an argument); the
        engine, which holds its model, is made again at the next generation."""
        self._loaded = (model, *self._loaded[1:])
        self.__dict__.pop("engine", None)
        self.timings = dict.fromkeys(self.timings, 0.0)

    @property
    def model(self) -> Any:
        return self._loaded[0]

    @property
    def tokenizer(self) -> Any:  # type: ignore[override]
        return self._loaded[1]

    @property
    def mesh(self) -> Any:
        return self._loaded[3]

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length or int(self.model.config.max_position_embeddings)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or "jaxloom").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kwargs):
        """As lm-eval's `hf` model: the tokenizer's own special tokens unless `add_special_tokens` (or
        `add_bos_token`) says otherwise, and none when the text already starts with the prefix token."""
        special = (
            {"add_special_tokens": add_special_tokens}
            if add_special_tokens is not None
            else {"add_special_tokens": self.add_bos_token}
            if self.add_bos_token is not None
            else {}
        )
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template, as lm-eval's `hf` model applies it (without the system turn when the
        template refuses one)."""
        import jinja2

        kw = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
        kw["continue_final_message"] = not add_generation_prompt
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kw)
        except jinja2.exceptions.TemplateError:
            log.warning("the chat template refused the history: applying it without the system turn (lm-eval's)")
            return self.tokenizer.apply_chat_template([m for m in chat_history if m["role"] != "system"], **kw)

    # -- scoring -------------------------------------------------------------------------------------------
    @functools.cached_property
    def _score_fn(self) -> Callable:
        """`(state, ids, segments, targets) -> (logp, greedy)` jitted: each target's log-probability and whether
        it is the argmax, position by position, through the model's forward without the `[B, T, V]` logits."""
        import inspect

        import jax
        import jax.numpy as jnp
        from flax import nnx

        import jaxloom.models as jm
        from jaxloom.models.losses import block_count

        graph, _ = nnx.split(self.model)
        fusable = (
            hasattr(self.model, "output_projection")
            and "return_hidden" in inspect.signature(type(self.model).__call__).parameters
        )
        block = self.block_size

        def fn(state, ids, segments, targets):
            model = nnx.merge(graph, state)
            if fusable:
                hidden = model(ids, segment_ids=segments, return_hidden=True).hidden
                kernel, dtype, precision = model.output_projection()
                blocks = block_count(ids.shape[0], ids.shape[1], block)
                softcap = getattr(model, "logit_softcap", None)
                return jm.linear_token_scores(
                    hidden, kernel, targets, blocks=blocks, dtype=dtype, precision=precision, softcap=softcap
                )
            logits = model(ids, segment_ids=segments).logits.astype(jnp.float32)
            picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
            return picked - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == targets

        if self.mesh is None:
            return jax.jit(fn)
        # replicated answers: every process reads them whole (the rows themselves are split over the mesh)
        return jax.jit(fn, out_shardings=jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    def _rows_per_batch(self) -> int:
        shards = 1 if self.mesh is None else int(self.mesh.devices.size)
        return -(-self._batch_size // shards) * shards  # a multiple of the devices: the rows split evenly

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """`(sum of the continuation's log-probabilities, whether greedy decoding gives it)` per request: each row
        `(context + continuation)[-(max_length + 1):]` as lm-eval's `hf` model cuts it, the longest first."""
        import jax
        from flax import nnx
        from tqdm import tqdm

        started = time.monotonic()
        rows = []
        for key, context, continuation in requests:
            if not context or not continuation or len(continuation) > self.max_length:
                raise ValueError(
                    f"an lm-eval request of {len(context)} context and {len(continuation)} continuation tokens; "
                    f"expected both non-empty and the continuation at most max_length ({self.max_length})"
                )
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            rows.append((key, whole, len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: (-len(rows[i][1]), tuple(rows[i][1])))
        per = self._rows_per_batch()
        state = nnx.state(self.model)
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        bar = tqdm(total=len(rows), disable=disable_tqdm, desc="jaxloom: loglikelihood requests")
        chunks = [order[start : start + per] for start in range(0, len(order), per)]
        inflight: list[tuple[list[int], Any]] = []  # a few batches dispatched ahead: the host builds the next rows
        for n, chunk in enumerate(chunks):  # while the device runs the previous ones
            width = _bucket(max(len(rows[i][1]) - 1 for i in chunk), self.max_length)
            ids, segments, targets = (np.zeros((per, width), np.int32) for _ in range(3))
            for r, i in enumerate(chunk):
                whole = rows[i][1]
                ids[r, : len(whole) - 1], targets[r, : len(whole) - 1] = whole[:-1], whole[1:]
                segments[r, : len(whole) - 1] = 1
            with _on(self.mesh):
                inflight.append((chunk, self._score_fn(state, ids, segments, targets)))
            if len(inflight) < 4 and n + 1 < len(chunks):
                continue
            for chunk, scored in inflight:
                self._answer(rows, chunk, jax.device_get(scored), out)
                bar.update(len(chunk))
            inflight = []
        bar.close()
        self.timings["loglikelihood_s"] += time.monotonic() - started
        return out  # type: ignore[return-value]

    def _answer(self, rows: list, chunk: list[int], scored: tuple[np.ndarray, np.ndarray], out: list) -> None:
        """The answers of one scored batch: each row's continuation span summed, and whether it was all greedy."""
        logp, greedy = scored
        for r, i in enumerate(chunk):
            key, whole, n = rows[i]
            span = slice(len(whole) - 1 - n, len(whole) - 1)
            answer = (float(logp[r, span].astype(np.float64).sum()), bool(greedy[r, span].all()))
            out[i] = answer
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood (perplexity tasks) in lm-eval's rolling windows of `max_length`."""
        from lm_eval import utils

        windows, counts = [], []
        for (string,) in [r.args for r in requests]:
            tokens = self.tok_encode(string)
            got = [
                utils.make_disjoint_window(w)
                for w in utils.get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1)
            ]
            windows += [(None, *w) for w in got]
            counts.append(len(got))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals, at = [], 0
        for request, n in zip(requests, counts, strict=True):
            total = sum(s for s, _ in scores[at : at + n])
            at += n
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", tuple(request.args), total)
        return totals

    # -- generation ----------------------------------------------------------------------------------------
    @functools.cached_property
    def engine(self) -> Any:
        """The paged engine `generate_until` runs (made at its first request)."""
        import jaxloom.generation as jg

        eos = self._loaded[2]
        eos = tuple(eos) if isinstance(eos, list) else eos if eos is not None else self.tokenizer.eos_token_id
        config = jg.GenerationConfig(eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id or 0)
        slots = self.max_num_seqs
        return jg.LLMEngine(self.model, config, max_num_seqs=slots, tokenizer=self.tokenizer, mesh=self.mesh)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's completion up to its first stop sequence (lm-eval's `until`, the end-of-text added), at
        most `max_gen_toks` tokens, the context cut from the left to fit: lm-eval's `hf` rules, on the engine."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
        from tqdm import tqdm

        started = time.monotonic()
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        pending: dict[int, tuple[int, list[str]]] = {}
        for i, (context, gen_kwargs) in enumerate([r.args for r in requests]):
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            unsupported = sorted(set(kw) - {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"})
            if unsupported:
                raise ValueError(
                    f"generation_kwargs {unsupported} of an lm-eval task are not settings of jaxloom's engine; "
                    "expected until, max_gen_toks, do_sample, temperature, top_k, top_p (drop them from the task)"
                )
            until = handle_stop_sequences(kw.pop("until", None), eos=eos_text)
            max_new = int(kw.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise ValueError(
                    f"max_gen_toks = {max_new}; expected fewer than the model's max_length ({self.max_length})"
                )
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_new)
            sample = bool(kw.get("do_sample")) and float(kw.get("temperature", 0.0)) > 0
            rid = self.engine.add_request(
                ids,
                max_new_tokens=max_new,
                stop=until,
                temperature=float(kw.get("temperature", 1.0)) if sample else 0.0,
                top_k=kw.get("top_k"),
                top_p=kw.get("top_p"),
                seed=i,
            )
            pending[rid] = (i, until)
        texts: list[str | None] = [None] * len(pending)
        bar = tqdm(total=len(pending), disable=disable_tqdm, desc="jaxloom: generate_until requests")
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                i, until = pending[output.request_id]
                text = self.tok_decode(output.outputs[0].token_ids)
                texts[i] = postprocess_generated_text(text, until, None)
                self.cache_hook.add_partial("generate_until", tuple(requests[i].args), texts[i])
                bar.update(1)
        bar.close()
        self.timings["generate_s"] += time.monotonic() - started
        return texts  # type: ignore[return-value]


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"add_bos_token = {value!r}; expected true or false")
        return value.lower() in ("true", "1")
    return bool(value)


def _on(mesh: Any):
    import contextlib

    import jax

    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


# -- running tasks -------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _manager(include_path: str | None, defaults: bool) -> Any:
    """lm-eval's `TaskManager`, made once per process for each folder (an evaluation during training reuses it)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def task_manager(tasks: list[str], include_path: str | None = None) -> Any:
    """lm-eval's `TaskManager` with `include_path` (only its tasks when they are all `tasks` asks for), every name
    of `tasks` checked to be a task or group it knows (else one error naming the unknown ones)."""
    if not tasks:
        raise ValueError("eval tasks: none given; expected lm-eval task names (--tasks arc_easy,hellaswag)")
    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"include_path {include_path}: not a directory of lm-eval task YAMLs")
    if include_path is not None:  # one's own tasks alone: lm-eval's ~15,000 need not be indexed (~9 s)
        local = _manager(str(include_path), False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = _manager(None if include_path is None else str(include_path), True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"tasks {unknown} are not lm-eval tasks{' nor in ' + str(include_path) if include_path else ''}; "
            "expected names lm-eval lists (lm-eval ls tasks), or include_path to a folder of task YAMLs"
        )
    return manager


def check_task_data(tasks: list[str], include_path: str | None = None) -> None:
    """Every task's documents loaded once (lm-eval's datasets, cached by `datasets`): before a model is read or a
    run trains, a task whose data cannot be had fails in one line (`_reachable`)."""
    from lm_eval.tasks import get_task_dict

    with _reachable(tasks):
        get_task_dict(list(tasks), task_manager(tasks, include_path))


@contextlib.contextmanager
def _reachable(tasks: list[str]):
    """A task's data that lm-eval cannot fetch (a Hub dataset without the network) as one line naming the tasks."""
    try:
        yield
    except ConnectionError as e:
        raise ConnectionError(
            f"tasks {list(tasks)}: {e}; a task whose dataset_path is on the Hugging Face Hub needs the network (or "
            "the dataset in the local cache): use local tasks (dataset_path: json with data_files) through "
            "include_path"
        ) from None


def evaluate_tasks(
    lm: LoadedLM,
    tasks: list[str],
    *,
    num_fewshot: int | None = None,
    limit: float | None = None,
    include_path: str | None = None,
    apply_chat_template: bool = False,
    output_folder: str | Path | None = None,
    log_samples: bool = False,
    seed: int = 0,
    step: int | None = None,
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `tasks` on `lm` (lm-eval's task names; `include_path`: a folder of one's own
    task YAMLs), its results JSON written in `output_folder` (`write_results`: whole or not at all; process 0), with
    `jaxloom`'s own entry (`step`: the checkpoint's, the time spent scoring and generating). A task whose data lm-eval
    cannot fetch (the Hub, offline) fails in one line naming the tasks. Returns lm-eval's results."""
    import lm_eval

    manager = task_manager(tasks, include_path)
    with _reachable(tasks):
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            apply_chat_template=apply_chat_template,
            log_samples=log_samples,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=None,
            fewshot_random_seed=seed,
        )
    if results is None:  # a non-zero rank of a torch launcher; jaxloom's processes all compute, one writes
        return {}
    results["jaxloom"] = {"step": step, "timings_s": {k: round(v, 3) for k, v in lm.timings.items()}}
    if output_folder is not None and _process_zero():
        results["jaxloom"]["results_file"] = str(write_results(results, output_folder))
    return results


def _process_zero() -> bool:
    import jax

    return jax.process_index() == 0


def write_results(results: dict[str, Any], folder: str | Path) -> Path:
    """lm-eval's results JSON (its `EvaluationTracker`'s file name, `results_<time>.json`, and content, samples
    left out) in `folder`, written to a temporary file there and renamed into place: an evaluation killed midway
    leaves no partial file."""
    from lm_eval.utils import handle_non_serializable

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H-%M-%S", time.gmtime()) + f".{int(time.time() * 1e6) % 1_000_000:06d}"
    target = folder / f"results_{stamp}.json"
    kept = {k: v for k, v in results.items() if k != "samples"}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".results-", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(kept, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return target


def scores(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's numeric scores as jaxloom logs them under `lm_eval/`: `<task>/<metric>` (`<metric>/<filter>` when
    the filter is not `none`), standard errors left out."""
    out: dict[str, float] = {}
    for task, row in (results.get("results") or {}).items():
        for key, value in row.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            out[f"{task}/{metric}" + ("" if filt == "none" else f"/{filt}")] = float(value)
    return out


def table(results: dict[str, Any]) -> str:
    """lm-eval's own results table (what its command prints)."""
    from lm_eval.utils import make_table

    return make_table(results)
