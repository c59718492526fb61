"""Tools in GRPO's rollouts (TRL 1.16's `tools=`): Python callables the model may call while it completes a prompt.

    tools = ToolSet([get_weather], tokenizer, timeout=10.0)
    prompt_ids = tools.encode(messages)                 # the chat template renders the tools' schemas
    calls = tools.parse(text)                           # the family's tool-call format, [] when none
    results = tools.run(calls)                          # one tool message per call: its result, or its error
    suffix = tools.suffix_ids(results)                  # the tool turn and the next assistant header, as TRL builds it

A tool is a function with type hints and a Google-style docstring (TRL's rule: `transformers.utils.get_json_schema`
makes its schema). A call runs with a time limit; a tool that raises, passes the limit or returns something that is
not a string is reported to the model as an error in its tool message, and counted — never a crash. The formats
parsed are those of the families that define one: Qwen2.5/Qwen3 (`<tool_call>{"name", "arguments"}</tool_call>`,
several a turn) and Llama 3.1/3.2 (one bare `{"name", "parameters"}` object a turn), read as TRL's response schemas
read them; a chat template that renders neither is refused by name.
"""

from __future__ import annotations

import concurrent.futures
import json
import queue
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ..usercode import UserCodeError, awaited, describe

QWEN_CALL = re.compile(r"<tool_call>\s*(.+?)\s*</tool_call>", re.S)
LLAMA_CALL = re.compile(r'^\s*(\{"name":\s*".+?",\s*"parameters":\s*.+\})\s*$', re.S)


class ToolError(UserCodeError):
    """A tool stopped the run: it raised what is not an `Exception` (`SystemExit`, `KeyboardInterrupt` from its own
    code); an `Exception` is the model's to read, never the run's end."""


def tool_format(tokenizer: Any) -> str:
    """`"qwen"` or `"llama3"`: the tool-call format `tokenizer`'s chat template renders (read from the template
    itself); an error naming the tokenizer when it renders no format jaxloom parses."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<tool_call>" in template:
        return "qwen"
    if '"parameters"' in template and "<|eot_id|>" in template:
        return "llama3"
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    raise ValueError(
        f"tools: the chat template of {name!r} renders no tool-call format jaxloom reads (Qwen2.5/Qwen3's "
        "<tool_call> JSON, Llama 3.1's JSON calls); expected a model whose chat template supports tools"
    )


def tool_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


class ToolSet:
    """The tools of a run (`tools`: callables, `async def` ones awaited), for `tokenizer`'s chat format; `timeout`:
    seconds a tool turn's calls may take (None: no limit); `workers`: the threads that run them (`ToolWorkers`,
    shared by the sets of one run). See the module docstring."""

    def __init__(
        self,
        tools: Sequence[Callable],
        tokenizer: Any,
        *,
        timeout: float | None = 60.0,
        workers: ToolWorkers | None = None,
    ):
        from transformers.utils import get_json_schema

        self.tools = {tool_name(f): f for f in tools}
        self.schemas = []
        for f in tools:
            try:
                self.schemas.append(get_json_schema(f))
            except Exception as e:  # noqa: BLE001 - transformers' own message names what the docstring lacks
                raise ValueError(f"tools: {tool_name(f)} has no schema TRL's rule can make ({e})") from None
        self.tokenizer, self.timeout = tokenizer, timeout
        self.workers = workers if workers is not None else ToolWorkers()
        self.format = tool_format(tokenizer)
        from jaxloom.generation import end_of_turn_ids

        ends = [*end_of_turn_ids(tokenizer), *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])]
        self.ends = [tokenizer.convert_ids_to_tokens(i) for i in ends]  # where a turn's text stops, read once

    # ---- rendering ------------------------------------------------------------------------------------------
    def encode(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat prompt with the tools' schemas, the generation prompt added (TRL's prompt)."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.schemas, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens after an assistant turn's end that carry `tool_messages` and open the next assistant turn,
        as TRL's `GRPOTrainer` makes them: the template's rendering of a minimal conversation with and without the
        tool messages (and the generation prompt), the shorter cut after its last EOS, the difference taken."""
        tok = self.tokenizer
        calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        prefix = tok.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False)
        full = tok.apply_chat_template(
            dummy + tool_messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        eos = [i for i, t in enumerate(prefix) if t == tok.eos_token_id]
        if eos:
            prefix = prefix[: eos[-1] + 1]
        if list(full[: len(prefix)]) != list(prefix):
            raise ValueError("tools: the chat template renders a tool turn that does not extend the conversation")
        return list(full[len(prefix) :])

    # ---- parsing and calling --------------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, list[dict]]:
        """`(content, calls)` of an assistant turn's text (its end-of-turn token removed): the calls in TRL's form
        (`{"type": "function", "function": {"name", "arguments"}}`) and the text around them. A call that is not
        valid JSON is a call of no tool (its error goes back to the model)."""
        for end in self.ends:
            text = text.split(end)[0]
        if self.format == "qwen":
            found = QWEN_CALL.findall(text)
            content = QWEN_CALL.sub("", text).strip()
            return content, [self._call(raw, "arguments") for raw in found]
        match = LLAMA_CALL.match(text)
        if not match:
            return text, []
        return "", [self._call(match.group(1), "parameters")]

    @staticmethod
    def _call(raw: str, key: str) -> dict:
        try:
            obj = json.loads(raw)
            name, arguments = obj["name"], obj.get(key, {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("name must be a string and the arguments an object")
        except (ValueError, KeyError, TypeError) as e:
            return {"type": "function", "function": {"name": "unknown", "arguments": {}}, "error": f"{e}"}
        return {"type": "function", "function": {"name": name, "arguments": arguments}}

    def run(self, calls: list[dict], tools: dict[str, Callable] | None = None) -> tuple[list[dict], int]:
        """One tool message per call (`{"role": "tool", "name", "content"}`: the result, or `{"error": ...}` as
        text) and how many calls failed (raised, passed the time limit, returned a non-string, named no tool).
        `tools` (by name) replaces the set's own for this call: an environment row's bound methods."""
        return self.run_turn([(calls, tools)])[0]

    def run_turn(self, rows: Sequence[tuple[list[dict], dict[str, Callable] | None]]) -> list[tuple[list[dict], int]]:
        """`run` for every row of a tool turn at once: each row's calls run in order (an environment's instance sees
        them as the model wrote them), the rows concurrently on the set's `workers`, all under one time limit from
        the turn's start (`timeout`): a call still running then is cut, and the row's later calls are not run —
        both reported to the model as errors. A step waits the limit at most once a turn, however many calls hang."""
        import time

        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        jobs = []
        for calls, tools in rows:
            done: list[tuple[Any, str | None]] = []
            jobs.append((calls, done, self.workers.submit(self._row_job(calls, tools, done))))
        out = []
        for calls, done, future in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.result(left)
            except concurrent.futures.TimeoutError:
                future.cancel()  # not started yet: it never will be
            except BaseException as e:  # noqa: BLE001 - not an Exception (SystemExit, ...): a tool that stops the run
                name = calls[len(done)]["function"]["name"] if len(done) < len(calls) else "a tool"
                raise ToolError(f"tool {name} raised {describe(e)}, which stops the run (a tool's Exception is "
                                "reported to the model; this is not an Exception)") from e  # fmt: skip
            out.append(self._messages(calls, list(done)))
        return out

    def _row_job(self, calls: list[dict], tools: dict[str, Callable] | None, done: list) -> Callable[[], None]:
        """The calls of one row, made in order, each `(result, error)` appended to `done` as it ends."""
        tools = self.tools if tools is None else tools

        def job() -> None:
            for call in calls:
                name, arguments = call["function"]["name"], call["function"]["arguments"]
                if call.get("error") is not None:
                    done.append((None, call["error"]))
                elif name not in tools:
                    done.append((None, f"Tool {name} not found."))
                else:
                    try:
                        done.append((awaited(tools[name](**arguments)), None))
                    except Exception as e:  # noqa: BLE001 - a tool's fault goes back to the model (TRL: str(e))
                        done.append((None, str(e) or type(e).__name__))

        return job

    def _messages(self, calls: list[dict], done: list[tuple[Any, str | None]]) -> tuple[list[dict], int]:
        """The tool messages of one row's calls (`done`: the results of those that ended, in order) and its failed
        calls: a call past the turn's limit is cut, the ones after it not run."""
        messages, failed = [], 0
        for i, call in enumerate(calls):
            name = call["function"]["name"]
            if i < len(done):
                result, error = done[i]
            elif i == len(done):
                result, error = None, f"{name} took longer than {self.timeout} s and was cut"
            else:
                result, error = None, f"not run: an earlier tool call of this turn passed the {self.timeout} s limit"
            if error is None and not isinstance(result, str):
                error = f"{name} returned {type(result).__name__}; expected a string"
            failed += error is not None
            content = str({"error": error}) if error is not None else result
            messages.append({"role": "tool", "name": name, "content": content})
        return messages, failed


class ToolWorkers:
    """At most `size` daemon threads that run tool calls, made as calls wait for one. A call that never returns
    holds its thread for good (Python cannot stop a thread): the threads stay bounded — later calls wait for a free
    one, and are cut at their turn's limit if none frees — and never hold the process open at exit."""

    def __init__(self, size: int = 16):
        if size < 1:
            raise ValueError(f"tool_workers = {size}; expected a positive integer")
        self.size = size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._idle = self._waiting = 0

    def submit(self, fn: Callable[[], Any]) -> Future:
        """`fn()` run on a worker; its future."""
        future: Future = Future()
        self._jobs.put((future, fn))
        with self._lock:
            self._waiting += 1
            if self._waiting > self._idle and self._threads < self.size:
                self._threads += 1
                threading.Thread(target=self._work, name="jaxloom-tool", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            future, fn = self._jobs.get()
            with self._lock:
                self._idle -= 1
                self._waiting -= 1
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller reads it
                future.set_exception(e)

    @property
    def threads(self) -> int:
        """How many worker threads exist (at most `size`)."""
        return self._threads


class Exchange:
    """The tool turns of a rollout's rows (`exchange`): per row its completion tokens (model turns and tool turns),
    which of them the model wrote (`keep`: 1; the tool turns' tokens 0), their sampled log-probs (0 on tool
    tokens), the turns as messages (what reward functions receive), the calls each turn ran with the text each
    returned (`made`: what rebuilds an environment's state after a resume, `environments.replay_calls`) and the counts
    of calls and failed calls."""

    def __init__(self, rows: int):
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.keep: list[list[int]] = [[] for _ in range(rows)]
        self.logps: list[list[float]] = [[] for _ in range(rows)]
        self.messages: list[list[dict]] = [[] for _ in range(rows)]
        self.made: list[list[list[dict]]] = [[] for _ in range(rows)]  # per row, per turn: its calls and results
        self.calls = self.failures = self.turns = 0
        self.tool_seconds = self.generate_seconds = 0.0  # time in the tools' calls, and in the later generations

    def metrics(self) -> dict[str, float]:
        """TRL's tool metrics (`tools/call_frequency`: calls per completion, `tools/failure_frequency`: failed calls
        per call), and jaxloom's `tools/turns` (tool turns per completion) and `time/tools_s` (time in the calls)."""
        rows = len(self.ids)
        return {
            "tools/call_frequency": self.calls / rows,
            "tools/failure_frequency": self.failures / self.calls if self.calls else 0.0,
            "tools/turns": sum(sum(m["role"] == "tool" for m in row) for row in self.messages) / rows,
            "time/tools_s": self.tool_seconds,
        }

    def saved(self) -> dict[str, Any]:
        """What a checkpoint keeps of a drawn rollout's exchange (JSON-safe): the turns as messages and the counts;
        the tokens are kept as arrays beside it (`pipeline.Pipeline.state`)."""
        return {
            "rows": len(self.ids),
            "messages": self.messages,
            "made": self.made,
            "counts": [self.calls, self.failures, self.turns],
            "seconds": [self.tool_seconds, self.generate_seconds],
        }

    @classmethod
    def restored(cls, saved: dict[str, Any]) -> Exchange:
        """The exchange `saved` wrote (its messages and counts: what scoring reads)."""
        out = cls(int(saved["rows"]))
        out.messages = saved["messages"]
        out.made = saved.get("made", out.made)
        out.calls, out.failures, out.turns = saved["counts"]
        out.tool_seconds, out.generate_seconds = saved["seconds"]
        return out

    def add(self, row: int, ids: Sequence[int], logps: Sequence[float] | None, model: bool) -> None:
        self.ids[row] += list(ids)
        self.keep[row] += [int(model)] * len(ids)
        self.logps[row] += list(logps) if logps is not None else [0.0] * len(ids)


def exchange(
    tools: ToolSet,
    prompts: Sequence[Sequence[int]],
    first: Sequence[tuple[Sequence[int], Sequence[float]]],
    generate: Callable[[list[list[int]], int, int, list[int]], list[tuple[list[int], list[float]]]],
    *,
    max_completion_length: int,
    positions: int,
    max_iterations: int | None,
    row_tools: Sequence[dict[str, Callable]] | None = None,
) -> Exchange:
    """TRL 1.16's tool loop over a rollout's rows: each row's first completion (`first`: its tokens and sampled
    log-probs) is parsed for tool calls; the calls run (`tools.run`), their messages are appended as a tool turn
    (`tools.suffix_ids`), and the model continues from its whole history (`generate(histories, budget, iteration,
    rows)` gives each history's new tokens and log-probs, at most `budget` of them; `rows`: whose histories) —
    up to `max_iterations` times (None: while the model calls tools). A tool turn that would take a row past
    `max_completion_length` tokens of completion, or its history to the model's `positions`, is not added: the
    row ends as it is (TRL's rule). `row_tools` (per row, by name) replaces the set's tools for that row: an
    environment instance's methods."""
    import time

    out = Exchange(len(prompts))
    for row, (ids, logps) in enumerate(first):
        out.add(row, ids, logps, model=True)
    segments = {row: list(ids) for row, (ids, _) in enumerate(first)}
    iteration = 0
    while segments:
        calls_of = {}
        for row, ids in segments.items():
            content, calls = tools.parse(tools.tokenizer.decode(ids, skip_special_tokens=False))
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "error"} for c in calls]
                calls_of[row] = calls
            out.messages[row].append(message)
        if not calls_of or (max_iterations is not None and iteration >= max_iterations):
            break
        histories = {}
        started = time.perf_counter()
        turn = [(calls, None if row_tools is None else row_tools[row]) for row, calls in calls_of.items()]
        for (row, calls), (results, failed) in zip(calls_of.items(), tools.run_turn(turn), strict=True):
            out.calls, out.failures = out.calls + len(calls), out.failures + failed
            out.made[row].append([{**c, "content": m["content"]} for c, m in zip(calls, results, strict=True)])
            suffix = tools.suffix_ids(results)
            completion = len(out.ids[row]) + len(suffix)
            if completion >= max_completion_length or len(prompts[row]) + completion >= positions:
                continue  # no room for the tool turn and a reply: the row ends here
            out.messages[row].extend(results)
            out.add(row, suffix, None, model=False)
            histories[row] = [*prompts[row], *out.ids[row]]
        out.tool_seconds += time.perf_counter() - started
        if not histories:
            break
        rows = sorted(histories)
        budget = max(max_completion_length - len(out.ids[r]) for r in rows)
        started = time.perf_counter()
        new = generate([histories[r] for r in rows], budget, iteration, rows)
        out.generate_seconds += time.perf_counter() - started
        segments = {}
        for row, (ids, logps) in zip(rows, new, strict=True):
            room = max_completion_length - len(out.ids[row])
            out.add(row, ids[:room], logps[:room], model=True)
            segments[row] = list(ids[:room])
        out.turns += 1
        iteration += 1
    return out


def tool_turns(
    sampler: Any,
    prompts: list,
    completion: Any,
    mask: Any,
    sampled: Any,
    key: Any,
    buckets: tuple[int, int],
    tools: ToolSet,
    row_tools: Sequence[dict[str, Callable]] | None = None,
    model: Any = None,
) -> Exchange:
    """The tool loop of one rollout (`exchange`, TRL's) through GRPO's `sampler`: each row's first completion
    (`completion`, `mask`, `sampled` log-probs, after `prompts`) parsed for calls, the tools run, their turn appended
    and `model` (default the sampler's: the policy's current weights) continuing from its whole history (histories
    left-padded to a power of two of
    at least `buckets[0]` tokens, the budget to one of at least `buckets[1]`: one generation program per width and
    budget met), each iteration seeded by the rollout's `key` and its index; `tools` parses and runs the calls
    (`row_tools`: per row, an environment instance's own tools)."""
    import jax
    import numpy as np

    rl, tok = sampler.rl, sampler.tokenizer()
    first = [(list(c[m > 0]), list(lp[m > 0])) for c, m, lp in zip(completion, mask, sampled, strict=True)]
    pad, rows = tok.pad_token_id or 0, len(prompts)

    def generate(histories: list[list[int]], budget: int, iteration: int, rows_: list[int]):
        from jaxloom.generation.decode import bucket

        if sampler.paged is not None:  # the engine kept each row's pages: only the tool turns run
            return sampler.paged.continue_rows(rows_, histories, rl.max_completion_length)

        width = bucket(max(map(len, histories)), buckets[0])
        ids = np.full((rows, width), pad, np.int32)  # every row, so the program's shape holds: extra rows idle
        mask_ = np.zeros((rows, width), np.int32)
        for i in range(rows):
            h = histories[i] if i < len(histories) else histories[0]
            ids[i, width - len(h) :], mask_[i, width - len(h) :] = h, 1
        steps = min(rl.max_completion_length, bucket(budget, buckets[1]))
        out_ids, out_mask, out_logps = sampler.generate(
            ids, mask_, jax.random.fold_in(key, 1 + iteration), group=1, max_new_tokens=steps, model=model
        )
        return [(list(c[m > 0]), list(lp[m > 0])) for c, m, lp in zip(out_ids, out_mask, out_logps, strict=True)][
            : len(histories)
        ]

    return exchange(
        tools,
        prompts,
        first,
        generate,
        max_completion_length=rl.max_completion_length,
        positions=(model or sampler.model()).config.max_position_embeddings,
        max_iterations=getattr(rl, "max_tool_calling_iterations", None),
        row_tools=row_tools,
    )
