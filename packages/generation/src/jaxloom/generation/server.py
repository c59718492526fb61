"""An OpenAI-compatible HTTP server on `LLMEngine`: `/v1/completions`, `/v1/chat/completions` (streamed or
not) and `/v1/models`, so evaluation harnesses and agent frameworks can call a checkpoint.

```python
server = jg.OpenAIServer(jg.LLMEngine(model, tokenizer=tok), tok, model_name="my-run")
host, port = server.start()                  # 127.0.0.1 and a free port unless told otherwise
openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="-").completions.create(model="my-run", prompt="Hi")
server.shutdown()
```

One thread owns the engine: requests from the HTTP threads queue for it, it adds them between steps and sends
each request's tokens back as they are decoded. A bad request gets an HTTP 400 (404 for an unknown path) with an
OpenAI-style error body naming the field and what was expected; it never stops the server.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .engine import LLMEngine, RequestOutput
from .unified import end_of_turn_ids


class RequestError(ValueError):
    """A request the server refuses: `param` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def _number(body: dict, name: str, default: Any, kind: type, low: float | None = None, high: float | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not float(value).is_integer()):
        raise RequestError(f"{name} = {value!r}; expected {'an integer' if kind is int else 'a number'}", name)
    value = kind(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(f"{name} = {value}; expected a value in [{low}, {high}]", name)
    return value


class OpenAIServer:
    """Serve `engine` over HTTP with OpenAI's API (see the module docstring). `tokenizer` encodes prompts,
    renders chat messages with its template (a reply also ends at the template's end-of-turn token) and decodes
    completions; `model_name` is what `/v1/models` lists; `host` 127.0.0.1 unless told otherwise, `port` 0 for a
    free one (`start` returns the one bound)."""

    def __init__(
        self, engine: LLMEngine, tokenizer: Any, *, model_name: str = "jaxloom", host: str = "127.0.0.1", port: int = 0
    ):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        if engine.tokenizer is None:  # stop strings are found in decoded text
            engine.tokenizer = tokenizer
        self._failure: str | None = None
        self.host, self.port = host, port
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._http: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        eos = tokenizer.eos_token_id
        self._chat_stops = tuple({*(() if eos is None else (eos,)), *end_of_turn_ids(tokenizer)})

    def start(self) -> tuple[str, int]:
        """Bind, start the engine's thread and the HTTP threads; returns `(host, port)`."""
        server = self

        class Handler(_Handler):
            owner = server

        self._http = ThreadingHTTPServer((self.host, self.port), Handler)
        self._http.daemon_threads = True
        self.host, self.port = self._http.server_address[:2]
        self._threads = [
            threading.Thread(target=self._run_engine, name="jaxloom-engine", daemon=True),
            threading.Thread(target=self._http.serve_forever, name="jaxloom-http", daemon=True),
        ]
        for t in self._threads:
            t.start()
        return self.host, self.port

    def serve_forever(self) -> None:
        """`start`, then block until interrupted."""
        self.start()
        try:
            while not self._stop.is_set():
                time.sleep(0.5)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop answering and stop the engine's thread."""
        self._stop.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        for t in self._threads:
            t.join(timeout=30)

    # -- the engine's thread --------------------------------------------------------------------------------
    def submit(self, request: dict) -> queue.Queue:
        """Queue `request` (`add_request`'s keywords) for the engine; events arrive on the returned queue:
        `("tokens", [ids per completion])` as they decode, then `("done", RequestOutput)` or `("error", text)`."""
        replies: queue.Queue = queue.Queue()
        self._inbox.put((request, replies))
        return replies

    def _run_engine(self) -> None:
        waiting: dict[int, queue.Queue] = {}
        while not self._stop.is_set():
            try:
                block = self._failure is not None or not self.engine.has_unfinished_requests()
                while True:
                    request, replies = self._inbox.get(block=block, timeout=0.1 if block else None)
                    block = False
                    if self._failure is not None:
                        replies.put(("error", self._failure))
                        continue
                    try:
                        rid = self.engine.add_request(**request, request_id=next(self._ids))
                        waiting[rid] = replies
                    except ValueError as e:
                        replies.put(("error", str(e)))
            except queue.Empty:
                pass
            if self._failure is not None or not self.engine.has_unfinished_requests():
                continue
            try:
                finished = {o.request_id: o for o in self.engine.step()}
            except Exception as e:  # noqa: BLE001 - the engine failed: every caller, now and later, hears why
                self._failure = f"the engine failed: {type(e).__name__}: {e}"
                for replies in waiting.values():
                    replies.put(("error", self._failure))
                waiting.clear()
                continue
            for rid, replies in list(waiting.items()):
                if rid in finished:
                    replies.put(("done", finished[rid]))
                    del waiting[rid]
                else:
                    replies.put(("tokens", self.engine.progress(rid)))

    # -- requests -------------------------------------------------------------------------------------------
    def parse(self, path: str, body: dict) -> tuple[dict, bool, list[int]]:
        """`(add_request keywords, stream, prompt ids)` of the JSON `body` of a completions or chat request (by its
        `path`); RequestError naming the field if it is bad."""
        if body.get("model") not in (None, self.model_name):
            raise RequestError(f"model {body['model']!r} is not served here; this server serves {self.model_name!r}",
                               "model", 404)  # fmt: skip
        chat = path.endswith("/chat/completions")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - the template's own complaint, as the reason
                raise RequestError(f"the chat template refused these messages: {e}", "messages") from None
            prompt = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            given = body.get("prompt")
            if isinstance(given, list) and len(given) == 1 and isinstance(given[0], str | list):
                given = given[0]  # one prompt in a list
            if isinstance(given, str) and given:
                prompt = list(self.tokenizer(given)["input_ids"])
            elif isinstance(given, list) and given and all(isinstance(t, int) for t in given):
                prompt = list(given)
            else:
                raise RequestError("prompt must be a non-empty string or list of token ids (one prompt)", "prompt")
        limit = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        stop = body.get("stop")
        if stop is not None and not (
            isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
        ):
            raise RequestError("stop must be a string or a list of strings", "stop")  # fmt: skip
        request = dict(
            prompt_token_ids=prompt,
            max_new_tokens=_number(body, limit, None if chat else 16, int, 1),
            temperature=_number(body, "temperature", 1.0, float, 0, 2),
            top_p=_number(body, "top_p", 1.0, float, 0, 1),
            n=_number(body, "n", 1, int, 1, self.engine.max_num_seqs),
            stop=stop or None,
            seed=_number(body, "seed", None, int, 0),
        )
        if request["top_p"] == 0:
            raise RequestError("top_p = 0; expected a value in (0, 1]", "top_p")
        if request["max_new_tokens"] is None:  # chat without a limit: the rest of the context
            request["max_new_tokens"] = max(1, self.engine.max_model_len - len(prompt))
        if chat and self._chat_stops:
            request["eos_token_id"] = list(self._chat_stops)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(f"stream = {stream!r}; expected true or false", "stream")
        return request, stream, prompt

    def text(self, ids: list[int]) -> str:
        """The text of token `ids`, special tokens left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def response(self, path: str, out: RequestOutput, created: int, rid: str) -> dict:
        """The OpenAI response body (`id` `rid`, `created`) of `out`, a finished request to `path`."""
        chat = path.endswith("/chat/completions")
        choices = []
        for c in out.outputs:
            text = c.text if c.text is not None else self.text(c.token_ids)
            choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            choices.append(choice)
        generated = sum(len(c.token_ids) for c in out.outputs)
        usage = {
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": generated,
            "total_tokens": len(out.prompt_token_ids) + generated,
        }
        kind = "chat.completion" if chat else "text_completion"
        return {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": choices,
                "usage": usage}  # fmt: skip


class _Handler(BaseHTTPRequestHandler):
    owner: OpenAIServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # quiet: a server under an evaluation harness answers thousands of requests

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send(status, {"error": {"message": message, "type": kind, "param": param, "code": None}})

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") == "/v1/models":
            model = {"id": self.owner.model_name, "object": "model", "created": 0, "owned_by": "jaxloom"}
            return self._send(200, {"object": "list", "data": [model]})
        return self._error(404, f"no such path: GET {self.path}")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.rstrip("/")
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return self._error(404, f"no such path: POST {self.path}")
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"null")
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            request, stream, _ = self.owner.parse(path, body)
        except json.JSONDecodeError as e:
            return self._error(400, f"the request body is not JSON: {e}")
        except RequestError as e:
            return self._error(e.status, str(e), e.param)
        replies = self.owner.submit(request)
        created, rid = int(time.time()), f"{'chatcmpl' if 'chat' in path else 'cmpl'}-{id(replies):x}"
        if stream:
            return self._stream(path, replies, created, rid, request["n"], request["stop"])
        while True:
            kind, value = replies.get()
            if kind == "error":
                return self._error(400, value)
            if kind == "done":
                return self._send(200, self.owner.response(path, value, created, rid))

    def _stream(self, path: str, replies: queue.Queue, created: int, rid: str, n: int, stop: Any) -> None:
        """Server-sent events: a chunk per new piece of text of each completion, then `[DONE]`. Text that could
        be the start of a stop string is held back until it is known not to be."""
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        hold = max((len(s) for s in stops), default=1) - 1
        chat = path.endswith("/chat/completions")
        kind = "chat.completion.chunk" if chat else "text_completion"
        first = replies.get()
        if first[0] == "error":
            return self._error(400, first[1])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        shown = [""] * n

        def event(index: int, piece: str | None, finish: str | None, role: bool = False) -> None:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if piece:
                    delta["content"] = piece
                choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": index, "text": piece or "", "finish_reason": finish, "logprobs": None}
            body = {"id": rid, "object": kind, "created": created, "model": self.owner.model_name, "choices": [choice]}
            self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
            self.wfile.flush()

        def advance(index: int, text: str, finish: str | None) -> None:
            if finish is None:
                text = text.rstrip("\ufffd")  # half a character: wait for the rest of its bytes
                text = text[: len(text) - hold] if hold else text
            if text.startswith(shown[index]) and (len(text) > len(shown[index]) or finish):
                event(index, text[len(shown[index]) :], finish)
                shown[index] = text
            elif finish:
                event(index, None, finish)

        if chat:
            for i in range(n):
                event(i, None, None, role=True)
        message = first
        while True:
            kind_, value = message
            if kind_ == "error":  # after the headers: the stream ends with the reason
                self.wfile.write(f"data: {json.dumps({'error': {'message': value}})}\n\n".encode())
                break
            if kind_ == "tokens":
                for i, ids in enumerate(value):
                    advance(i, self.owner.text(ids), None)
            else:
                for c in value.outputs:
                    advance(c.index, c.text if c.text is not None else self.owner.text(c.token_ids), c.finish_reason)
                break
            message = replies.get()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True
