"""The HTTP side of `omlx serve`: a Starlette app whose handlers validate a request, tokenize it
(`prompts.PromptBuilder`) and hand it to the `Scheduler`'s engine thread, then answer with the result or stream it as
server-sent events. Served by uvicorn (`run`, or `ServerThread` for tests and the desktop app).

Routes: GET /health, GET /metrics, GET /v1/models, POST /v1/chat/completions,
POST /v1/completions (OpenAI's API), POST /v1/messages, POST /v1/messages/count_tokens
(Anthropic's, see anthropic.py). Every failure is the API's error object with a 4xx status (a 5xx
only for an engine failure that is not the request's fault).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..constrain import JsonConstraint
from ..engine import Engine
from ..errors import ContextFull, KVPoolFull, OmlxError, SettingsError, describe
from .metrics import Metrics
from .anthropic import MessagesView, new_message_id, parse_messages
from .anthropic import error_body as anthropic_error_body
from . import tools
from .prompts import PromptBuilder
from .protocol import ApiError, OpenAIView, bad
from .scheduler import Failed, Finished, Job, QueueTimeout, Scheduler, ServeLimits, Started, Token

log = logging.getLogger("omlx.serve")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
MAX_BODY_BYTES = 4 << 20  # request bodies above this are refused (413) before they are parsed
DRAIN_MAX_BYTES = 256 << 20  # an oversized body is read (and dropped) this far before the 413 goes out
ANTHROPIC_ENDPOINTS = ("messages", "count_tokens")  # answered with Anthropic's error object
RETRY_AFTER_S = 5  # the Retry-After of a 429: a guess at when a slot or KV budget frees up
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks whether its client left


@dataclass
class ServeConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    model_id: str | None = None  # the id /v1/models lists (default: the engine's name)

    def validate(self) -> None:
        """Refuse to listen beyond this machine without a key (SettingsError)."""
        if not is_loopback(self.host) and not self.api_key:
            raise SettingsError(
                f"refusing to serve on {self.host} without an API key: any host other than 127.0.0.1 "
                "(or ::1 / localhost) is reachable from other machines; give --api-key KEY "
                "(clients then send 'Authorization: Bearer KEY')")
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"--port must be between 0 and 65535, not {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise SettingsError("--api-key must not be empty")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class OpenAIServer:
    """The app and the scheduler behind it. `app` is the ASGI application; the scheduler is
    started with the app (lifespan) and stopped with it."""

    def __init__(self, engine: Engine, limits: ServeLimits, config: ServeConfig | None = None):
        self.config = config or ServeConfig()
        self.config.validate()
        self.engine = engine
        self.limits = limits
        self.metrics = Metrics()
        self.scheduler = Scheduler(engine, limits, self.metrics)
        self.model_id = self.config.model_id or engine.name
        # the names a request may use for the model: the listed id, the file's name and stem
        self.served_ids = tuple(dict.fromkeys([self.model_id, engine.name, engine.path.name, engine.path.stem]))
        self.created = int(time.time())
        self.prompts = PromptBuilder(engine, self.model_id, self.served_ids,
                                     min(limits.ctx, engine.model.context_length), self.scheduler.budget)
        guarded = self._guarded
        routes = [
            Route("/health", guarded("health", self.health), methods=["GET"]),
            Route("/metrics", guarded("metrics", self.metrics_text), methods=["GET"]),
            Route("/v1/models", guarded("models", self.models), methods=["GET"]),
            Route("/v1/models/{model_id:path}", guarded("models", self.model), methods=["GET"]),
            Route("/v1/chat/completions", guarded("chat", self.chat), methods=["POST"]),
            Route("/v1/completions", guarded("completions", self.completions), methods=["POST"]),
            Route("/v1/messages", guarded("messages", self.messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", guarded("count_tokens", self.count_tokens), methods=["POST"]),
        ]
        self.app = Starlette(routes=routes, lifespan=self._lifespan,
                             exception_handlers={404: self._not_found, 405: self._not_allowed})

    # -- lifecycle ---------------------------------------------------------------------------
    def _lifespan(self, app):
        server = self

        class _Lifespan:
            async def __aenter__(self):
                if not server.scheduler.running:
                    server.scheduler.start()

            async def __aexit__(self, *exc):
                await run_in_threadpool(server.scheduler.stop)

        return _Lifespan()

    # -- plumbing ------------------------------------------------------------------------------
    def _error(self, endpoint: str, err: ApiError) -> JSONResponse:
        """`err` answered in the shape of the endpoint's API (Anthropic's for /v1/messages)."""
        self.metrics.request(endpoint, err.status)
        body = anthropic_error_body(err) if endpoint in ANTHROPIC_ENDPOINTS else err.body()
        return JSONResponse(body, status_code=err.status, headers=err.headers)

    @staticmethod
    def _endpoint_of(request: Request) -> str:
        return "messages" if request.url.path.startswith("/v1/messages") else "other"

    def _guarded(self, endpoint: str, handler):
        """`handler` with whatever escapes it answered as an error object, never a bare 500 page or
        a dropped connection: the family's errors as 4xx (their kind as the code), anything else
        (a bug) as a 500 with its traceback in the log. The server goes on serving either way."""

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as err:
                return self._error(endpoint, err)
            except ClientDisconnect:
                self.metrics.request(endpoint, 499)
                return Response(status_code=499)
            except (ContextFull, KVPoolFull, QueueTimeout) as exc:
                return self._error(endpoint, self._failure(exc))
            except OmlxError as exc:
                return self._error(endpoint, ApiError(400, exc.user_message, code=exc.kind))
            except Exception as exc:
                log.exception("internal error answering %s %s", request.method, request.url.path)
                return self._error(endpoint, self._failure(exc))

        return run

    async def _not_found(self, request: Request, exc) -> JSONResponse:
        return self._error(self._endpoint_of(request),
                           ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def _not_allowed(self, request: Request, exc) -> JSONResponse:
        return self._error(self._endpoint_of(request),
                           ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                    code="method_not_allowed"))

    def _authorize(self, request: Request) -> None:
        """With --api-key, the key as 'Authorization: Bearer KEY' (OpenAI's clients) or as
        'x-api-key: KEY' (Anthropic's)."""
        key = self.config.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        sent = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
        if not hmac.compare_digest(sent.encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                           type="authentication_error", code="invalid_api_key")

    async def _json_body(self, request: Request):
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and not length.isdigit():
            raise bad("bad Content-Length header", None, "invalid_request")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                await self._drain(request, size)
                told = f"{int(length):,} bytes" if length is not None else f"over {limit:,} bytes"
                raise ApiError(413, f"the request body is {told}; this server accepts at most {limit:,} bytes "
                               f"({limit / (1 << 20):g} MiB)", code="request_too_large",
                               headers={"Connection": "close"})
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            raise bad("the request body is empty; send a JSON object", None, "invalid_json")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise bad(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise bad(f"the request body must be a JSON object, not {type(body).__name__}", None, "invalid_type")
        return body

    async def _drain(self, request: Request, size: int) -> None:
        """Read and drop the rest of an oversized body (up to DRAIN_MAX_BYTES), so that the 413
        reaches the client: closing the socket with its data unread resets the connection, and
        the client sees "connection reset by peer" instead of the error."""
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAIN_MAX_BYTES:
                return

    # -- simple routes -------------------------------------------------------------------------
    async def health(self, request: Request) -> JSONResponse:
        ok = self.scheduler.running
        self.metrics.request("health", 200 if ok else 503)
        return JSONResponse({"status": "ok" if ok else "stopped", "model": self.model_id},
                            status_code=200 if ok else 503)

    async def metrics_text(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as err:
            return self._error("metrics", err)
        self.metrics.request("metrics", 200)
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def _model_object(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "omlx",
                "context_length": self.limits.ctx}

    async def models(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
        except ApiError as err:
            return self._error("models", err)
        self.metrics.request("models", 200)
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
            if request.path_params["model_id"] not in self.served_ids:
                raise ApiError(404, f"the model '{request.path_params['model_id']}' does not exist",
                               param="model", code="model_not_found")
        except ApiError as err:
            return self._error("models", err)
        self.metrics.request("models", 200)
        return JSONResponse(self._model_object())

    # -- generation ----------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def messages(self, request: Request) -> Response:
        return await self._generate(request, "messages")

    async def count_tokens(self, request: Request) -> Response:
        self._authorize(request)  # errors: answered by _guarded
        req = parse_messages(await self._json_body(request), self.served_ids, counting=True)
        prompt_ids = await run_in_threadpool(self.prompts.encode, "messages", req)
        self.metrics.request("count_tokens", 200)
        return JSONResponse({"input_tokens": len(prompt_ids)})

    async def _generate(self, request: Request, kind: str) -> Response:
        try:
            self._authorize(request)
            body = await self._json_body(request)
            req = self.prompts.parse(kind, body)
            prompt_ids = await run_in_threadpool(self.prompts.encode, kind, req)
            max_tokens = self.prompts.room(kind, prompt_ids, req)
        except ClientDisconnect:
            self.metrics.request(kind, 499)
            return Response(status_code=499)
        except ApiError as err:
            return self._error(kind, err)

        loop = asyncio.get_running_loop()
        if kind == "messages":
            job_id = new_message_id()
        else:
            job_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]

        def choice(index: int):
            """Choice `index`'s job, its event queue and its view (each choice is a sequence of its
            own; with a seed, choice i samples with seed + i, so that they differ and repeat)."""
            events: asyncio.Queue = asyncio.Queue()

            def sink(event) -> None:  # the engine thread
                loop.call_soon_threadsafe(events.put_nowait, event)

            parser = None
            if kind != "completions" and req.tools and req.tool_choice.mode != "none":
                parser = tools.ToolParser(self.prompts.tool_family, {t["function"]["name"] for t in req.tools},
                                          prefill=req.tool_prefill, id_prefix="toolu_" if kind == "messages" else "call_")
            if kind == "messages":
                view = MessagesView(job_id, self.model_id, len(prompt_ids), parser)
            else:
                view = OpenAIView(kind, job_id, self.model_id, req.include_usage, self.engine.tokenizer, req.logprobs,
                                  parser)
            processors = ()
            grammar = getattr(req, "tool_grammar", None) or getattr(req, "grammar", None)
            if grammar:  # a required / named call, or response_format
                processors = (JsonConstraint(self.engine.tokenizer, None, len(prompt_ids), grammar=grammar),)
            sampling = req.sampling
            if index and sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + index)
            job = Job(prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling, sink=sink,
                      stop=req.stop, id=job_id if req.n == 1 else f"{job_id}-{index}", logprobs=req.logprobs,
                      processors=processors, prefix_tokens=getattr(req, "prefix_tokens", 0))
            return job, events, view

        choices = [choice(i) for i in range(req.n)]
        job, events, view = choices[0]
        try:  # n > 1: the other choices go in once the first has prefilled (_complete_choices)
            self.scheduler.submit(job)
        except OmlxError as exc:
            return self._error(kind, ApiError(503, exc.user_message, type="server_error", code="unavailable"))
        if len(choices) > 1:
            return await self._complete_choices(request, kind, choices)
        if req.stream:
            return await self._stream(request, kind, job, events, view)
        return await self._complete(request, kind, job, events, view)

    async def _complete_choices(self, request: Request, kind: str, choices) -> Response:
        """`n` > 1: every choice's whole answer in one response, choice i at index i; usage counts
        the prompt once and every choice's completion tokens (OpenAI's). The first choice is
        submitted alone; the others when its prefill is done (its first event), so that the
        prompt's full KV blocks are in the prefix cache and every other choice prefills only the
        last, partial block: the prompt is read once, not n times."""
        answers = []
        job0, events0, _ = choices[0]
        early: list = []  # the first choice's events up to its first token (Started comes at admission)
        while not early or isinstance(early[-1], Started):
            event = await self._next_event(request, job0, events0)
            if event is None:
                self.metrics.request(kind, 499)
                return Response(status_code=499)
            if isinstance(event, Failed):
                return self._error(kind, self._failure(event.error))
            early.append(event)
        submitted = 1
        try:
            for job, _, _ in choices[1:]:
                self.scheduler.submit(job)
                submitted += 1
        except OmlxError as exc:
            for job, _, _ in choices[:submitted]:
                self.scheduler.cancel(job)
            return self._error(kind, ApiError(503, exc.user_message, type="server_error", code="unavailable"))
        try:
            for n, (job, events, view) in enumerate(choices):
                text, tokens, last = await self._collect(request, job, events, early if n == 0 else None)
                if last is None or isinstance(last, Failed):  # the other choices go too
                    for other, _, _ in choices[n + 1 :]:
                        self.scheduler.cancel(other)
                    if last is None:
                        self.metrics.request(kind, 499)
                        return Response(status_code=499)
                    return self._error(kind, self._failure(last.error))
                answers.append(view.whole(text, last, tokens))
        except asyncio.CancelledError:
            for job, _, _ in choices:
                self.scheduler.cancel(job)
            raise
        body = answers[0]
        body["choices"] = [dict(a["choices"][0], index=i) for i, a in enumerate(answers)]
        completion = sum(a["usage"]["completion_tokens"] for a in answers)
        body["usage"] = dict(body["usage"], completion_tokens=completion,
                             total_tokens=body["usage"]["prompt_tokens"] + completion)
        details = [a["usage"].get("completion_tokens_details", {}) for a in answers]
        if any(details):  # every choice's drafts
            body["usage"]["completion_tokens_details"] = {
                key: sum(d.get(key, 0) for d in details)
                for key in ("accepted_prediction_tokens", "rejected_prediction_tokens")}
        self.metrics.request(kind, 200)
        return JSONResponse(body)

    def _failure(self, exc: BaseException) -> ApiError:
        if isinstance(exc, QueueTimeout):
            return ApiError(429, exc.user_message, type="rate_limit_error", code="kv_budget_exhausted",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
        if isinstance(exc, (ContextFull, KVPoolFull)):
            return ApiError(400, exc.user_message, code="context_length_exceeded")
        kind, message = describe(exc)
        return ApiError(503 if kind == "out_of_memory" else 500, message, type="server_error", code=kind)

    async def _next_event(self, request: Request, job: Job, events: asyncio.Queue):
        """The job's next event; None if the client went away (the job is then cancelled)."""
        if not events.empty():
            return events.get_nowait()
        while True:
            try:
                return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.scheduler.cancel(job)
                    return None

    async def _collect(self, request: Request, job: Job, events: asyncio.Queue, early: list | None = None):
        """A job's events to its end: (text, Token events, the last event), the last being
        Finished, Failed or None (the client went away; the job is then cancelled). `early`:
        events already taken from the queue, handled first."""
        pieces: list[str] = []
        tokens: list[Token] = []
        early = list(early or ())
        while True:
            event = early.pop(0) if early else await self._next_event(request, job, events)
            if event is None or isinstance(event, Failed):
                return "", tokens, event
            if isinstance(event, Token):
                pieces.append(event.text)
                tokens.append(event)
            elif isinstance(event, Finished):
                pieces.append(event.text)
                return "".join(pieces), tokens, event

    async def _complete(self, request: Request, kind: str, job: Job, events: asyncio.Queue, view) -> Response:
        try:
            text, tokens, last = await self._collect(request, job, events)
        except asyncio.CancelledError:
            self.scheduler.cancel(job)
            raise
        if last is None:
            self.metrics.request(kind, 499)
            return Response(status_code=499)
        if isinstance(last, Failed):
            return self._error(kind, self._failure(last.error))
        self.metrics.request(kind, 200)
        return JSONResponse(view.whole(text, last, tokens))

    async def _stream(self, request: Request, kind: str, job: Job, events: asyncio.Queue, view) -> Response:
        # The first event decides the status: a request that times out in the queue is a 429,
        # not a stream that starts and then fails.
        first = await self._next_event(request, job, events)
        if first is None:
            self.metrics.request(kind, 499)
            return Response(status_code=499)
        if isinstance(first, Failed):
            return self._error(kind, self._failure(first.error))

        def render(event) -> tuple[str, bool]:
            """SSE text for one event, and whether it ends the stream."""
            if isinstance(event, Token):
                return view.stream_token(event), False
            if isinstance(event, Finished):
                self.metrics.request(kind, 200)
                return view.stream_end(event), True
            if isinstance(event, Failed):
                err = self._failure(event.error)
                self.metrics.request(kind, err.status)
                return view.stream_error(err), True
            return "", False  # Started

        async def events_out():
            event = first
            finished = False
            try:
                yield view.stream_start(first.cached_tokens if isinstance(first, Started) else 0)
                while True:
                    # every event already queued goes out in one write: fewer wake-ups of the
                    # loop thread, which shares the interpreter with the engine thread
                    pieces = []
                    while event is not None and not finished:
                        text, finished = render(event)
                        pieces.append(text)
                        event = events.get_nowait() if not events.empty() else None
                    if pieces and any(pieces):
                        yield "".join(pieces)
                    if finished:
                        return
                    event = await self._next_event(request, job, events)
                    if event is None:
                        return
            finally:
                if not finished:  # the client went away mid-stream (the task was cancelled)
                    self.scheduler.cancel(job)
                    self.metrics.request(kind, 499)

        return StreamingResponse(events_out(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- running ------------------------------------------------------------------------------------
def _uvicorn_config(server: OpenAIServer, log_level: str):
    import uvicorn

    return uvicorn.Config(server.app, host=server.config.host, port=server.config.port, log_level=log_level,
                          access_log=False, lifespan="on", timeout_graceful_shutdown=5)


def run(server: OpenAIServer, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C), in this thread."""
    import uvicorn

    uvicorn.Server(_uvicorn_config(server, log_level)).run()


class ServerThread:
    """uvicorn in a background thread (tests, the desktop app's serve switch). `start()` returns
    once the socket listens; `url` is then the base URL (with the port the OS chose for port 0)."""

    def __init__(self, server: OpenAIServer, log_level: str = "warning"):
        import uvicorn

        self.server = server
        self._uvicorn = uvicorn.Server(_uvicorn_config(server, log_level))
        self._uvicorn.install_signal_handlers = lambda: None  # not the main thread
        self._thread = threading.Thread(target=self._uvicorn.run, name="omlx-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the server did not start on {self.server.config.host}:{self.server.config.port}")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        sockets = [s for srv in self._uvicorn.servers for s in srv.sockets]
        return sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = self.server.config.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 15.0) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout)
        self.server.scheduler.stop()
