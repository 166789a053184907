"""The OpenAI request bodies the server accepts, checked field by field, and the error shape it
answers with: ``{"error": {"message", "type", "param", "code"}}`` and a 4xx status.

Accepted (anything else a client commonly sends, e.g. `user`, is ignored; fields this engine
cannot honour are refused rather than silently dropped):
    chat:        model, messages, max_tokens | max_completion_tokens, temperature, top_p, stop,
                 seed, n (1), stream, stream_options.include_usage, presence_penalty and
                 frequency_penalty (-2..2), repetition_penalty (> 0, an extension), logprobs and
                 top_logprobs (0..20), tools and tool_choice (tools.py), assistant tool_calls and
                 tool messages, response_format (text, json_object, json_schema: constrained decoding)
    completions: model, prompt (a string, a one-string list, or a list of token ids), and the
                 same sampling fields; logprobs an integer (0..20)
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field

from ..constrain import ANY_OBJECT, json_grammar
from ..errors import OmlxError
from ..sampling import SamplingParams
from .tools import ToolChoice, ToolParser, split_events

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_CHOICES = 8  # `n`: choices per request (each is a sequence of its own in the batch)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs (we allow it for completions' logprobs too)
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of probability 0 (JSON has no -inf)
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class ApiError(Exception):
    """An error answered as OpenAI does: HTTP `status` and the error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class GenerationRequest:
    """What both endpoints ask the scheduler for."""

    model: str
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # the top log-probabilities per token (0: the token's alone); None: off
    tools: list | None = None  # OpenAI's shape: [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    tool_prefill: str = ""  # the start of a call the answer is pre-filled with (tools.prepare)
    tool_grammar: str | None = None  # required / named tool_choice: the call's grammar (tools.prepare)
    grammar: str | None = None  # response_format's JSON grammar (constrain.json_grammar); None: free text
    n: int = 1  # choices: n sequences from the one prompt (its KV blocks shared through the prefix cache)


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict] = None


@dataclass
class CompletionRequest(GenerationRequest):
    prompt: str | list[int] = ""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise bad(f"'{name}' must be a number, not {type(v).__name__}", name, "invalid_type")
    if not math.isfinite(v):
        raise bad(f"'{name}' must be a finite number, not {v}", name)
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be between {lo:g} and {hi:g}, not {v}", name)
    return float(v)


def served_model(body: dict, served_ids: tuple[str, ...]) -> str:
    """The request's `model`, one of the names this server answers to (404 otherwise)."""
    model = body.get("model")
    if model is None:
        raise bad("'model' is required", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise bad(f"'model' must be a string, not {type(model).__name__}", "model", "invalid_type")
    if model not in served_ids:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served_ids[0]}'",
                       param="model", code="model_not_found")
    return model


def stream_flag(body: dict) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise bad(f"'stream' must be a boolean, not {type(stream).__name__}", "stream", "invalid_type")
    return stream


def _common(body: dict, served_ids: tuple[str, ...]) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    model = served_model(body, served_ids)
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v):
            raise bad(f"'{name}' must be an integer, not {type(v).__name__}", name, "invalid_type")
        if v < 1:
            raise bad(f"'{name}' must be at least 1, not {v}", name)
        max_tokens = v if max_tokens is None else min(max_tokens, v)
    n = body.get("n")
    if n is not None:
        if not _is_int(n):
            raise bad(f"'n' must be an integer, not {type(n).__name__}", "n", "invalid_type")
        if not 1 <= n <= MAX_CHOICES:
            raise bad(f"'n' must be between 1 and {MAX_CHOICES}, not {n}", "n")
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise bad("'top_p' must be greater than 0", "top_p")
    presence = _number(body, "presence_penalty", -2.0, 2.0, 0.0)
    frequency = _number(body, "frequency_penalty", -2.0, 2.0, 0.0)
    repetition = _number(body, "repetition_penalty", -math.inf, math.inf, 1.0)  # an extension (vLLM's)
    if repetition <= 0.0:
        raise bad(f"'repetition_penalty' must be greater than 0 (1 = off), not {repetition:g}", "repetition_penalty")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad(f"'seed' must be an integer, not {type(seed).__name__}", "seed", "invalid_type")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise bad(f"at most {MAX_STOP_STRINGS} stop strings, not {len(stop)}", "stop")
        stops = tuple(stop)
    else:
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if any(s == "" for s in stops):
        raise bad("stop strings must not be empty", "stop")
    stream = stream_flag(body)
    if stream and (n or 1) > 1:
        raise bad("n > 1 is answered whole, not streamed: send stream=false, or one request per choice",
                  "n", "unsupported_value")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise bad("'stream_options' is only allowed with stream=true", "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad("'stream_options.include_usage' must be a boolean", "stream_options", "invalid_type")
    # the repetition penalty looks at the whole history, prompt included, as vLLM's and
    # transformers' do; presence and frequency count the completion's tokens only (OpenAI's)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, repetition_penalty=repetition,
                              repetition_last_n=-1, presence_penalty=presence, frequency_penalty=frequency)
    try:
        sampling.validate()
    except ValueError as exc:
        raise bad(str(exc), str(exc).split()[0]) from None
    return GenerationRequest(model, max_tokens, sampling, stops, stream, include_usage,
                             grammar=response_grammar(body.get("response_format")), n=n or 1)


def response_grammar(fmt) -> str | None:
    """`response_format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}} as the grammar decoding is constrained to."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                  "response_format", "invalid_value")
    if fmt["type"] == "text":
        return None
    schema = ANY_OBJECT
    if fmt["type"] == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad("'response_format.json_schema' must be an object with a 'schema' object",
                      "response_format.json_schema", "invalid_type")
        schema = spec.get("schema") or ANY_OBJECT
    try:
        return json_grammar(schema)
    except OmlxError as exc:
        raise bad(exc.user_message, "response_format.json_schema") from None


def chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs` (a boolean) and `top_logprobs` (0..MAX_TOP_LOGPROBS, which needs
    logprobs=true) as the top count (None: off)."""
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad(f"'logprobs' must be a boolean, not {type(on).__name__}", "logprobs", "invalid_type")
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top):
            raise bad(f"'top_logprobs' must be an integer, not {type(top).__name__}", "top_logprobs", "invalid_type")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, not {top}", "top_logprobs")
        if not on:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def completion_logprobs(body: dict) -> int | None:
    """Completions' `logprobs`: how many of the most likely tokens to list per position
    (0..MAX_TOP_LOGPROBS; OpenAI's own limit is 5), None: off."""
    n = body.get("logprobs")
    if n is None:
        return None
    if not _is_int(n):
        raise bad(f"'logprobs' must be an integer (the top tokens listed per position, 0 to {MAX_TOP_LOGPROBS}) "
                  f"on /v1/completions, not {type(n).__name__}", "logprobs", "invalid_type")
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise bad(f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, not {n}", "logprobs")
    return n


def _message_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content",
                          "unsupported_value")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content",
              "invalid_type")


def message_list(messages) -> list[dict]:
    """The request's `messages`: a non-empty list of objects."""
    if messages is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise bad("'messages' must be a list", "messages", "invalid_type")
    if not messages:
        raise bad("'messages' must not be empty", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
    return messages


def check_tools(tools, param: str = "tools") -> list[dict] | None:
    """OpenAI's `tools`: a list of {"type": "function", "function": {"name", "description",
    "parameters"}} (None: no tools)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad(f"'{param}' must be a list", param, "invalid_type")
    names = set()
    for j, t in enumerate(tools):
        where = f"{param}[{j}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad(f"{where} must be an object with \"type\": \"function\" and a \"function\" object", where,
                      "invalid_type")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', not {name!r}",
                      f"{where}.function.name")
        if name in names:
            raise bad(f"{where}: two tools are named {name!r}", f"{where}.function.name")
        names.add(name)
        if not isinstance(f.get("description", ""), str):
            raise bad(f"{where}.function.description must be a string", f"{where}.function.description", "invalid_type")
        if not isinstance(f.get("parameters", {}), dict):
            raise bad(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters",
                      "invalid_type")
    return [{"type": "function", "function": t["function"]} for t in tools] or None


def check_tool_choice(choice, tools: list | None) -> ToolChoice:
    """OpenAI's `tool_choice`: "auto", "none", "required" or {"type": "function", "function":
    {"name": ...}} naming one of `tools`."""
    if choice is None:
        return ToolChoice()
    names = [t["function"]["name"] for t in tools or ()]
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad(f"'tool_choice' must be 'auto', 'none', 'required' or a named function, not {choice!r}",
                      "tool_choice")
        if choice == "required" and not names:
            raise bad("'tool_choice' is 'required' but the request has no 'tools'", "tool_choice")
        return ToolChoice(choice)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad(f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice")
        return ToolChoice("named", name)
    raise bad("'tool_choice' must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
              "tool_choice", "invalid_type")


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's tool_calls with each call's arguments as an object (the templates
    render them with tojson)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise bad(f"{where} must be a non-empty list", where, "invalid_type")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise bad(f"{where}[{j}] needs a function with a name", f"{where}[{j}]", "invalid_type")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad(f"{where}[{j}].function.arguments is not valid JSON", f"{where}[{j}].function.arguments",
                          "invalid_value") from None
        if not isinstance(args, dict):
            raise bad(f"{where}[{j}].function.arguments must be a JSON object", f"{where}[{j}].function.arguments",
                      "invalid_type")
        out.append({"id": str(c.get("id") or ""), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def parse_chat(body, served_ids: tuple[str, ...]) -> ChatRequest:
    common = _common(body, served_ids)
    messages = message_list(body.get("messages"))
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, not {role!r}",
                      f"messages[{i}].role")
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None:
            msg = {"role": role, "content": "" if m.get("content") is None else _message_text(m["content"], i),
                   "tool_calls": _tool_calls(calls, i)}
            out.append(msg)
            continue
        if "content" not in m or m["content"] is None:
            raise bad(f"messages[{i}].content is required", f"messages[{i}].content", "missing_required_parameter")
        msg = {"role": "system" if role == "developer" else role, "content": _message_text(m["content"], i)}
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"messages[{i}].tool_call_id is required in a tool message", f"messages[{i}].tool_call_id",
                          "missing_required_parameter")
            msg["tool_call_id"] = call_id
        out.append(msg)
    common.tools = check_tools(body.get("tools"))
    common.tool_choice = check_tool_choice(body.get("tool_choice"), common.tools)
    common.logprobs = chat_logprobs(body)
    return ChatRequest(**common.__dict__, messages=out)


def parse_completion(body, served_ids: tuple[str, ...], vocab_size: int) -> CompletionRequest:
    common = _common(body, served_ids)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' must not be empty", "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad_ids = [t for t in prompt if not 0 <= t < vocab_size]
        if bad_ids:
            raise bad(f"token id {bad_ids[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise bad("only one prompt per request is supported (n=1)", "prompt", "unsupported_value")
    else:
        raise bad("'prompt' must be a string, a list with one string, or a list of token ids", "prompt",
                  "invalid_type")
    if body.get("echo") not in (None, False):
        raise bad("'echo' is not supported", "echo", "unsupported_value")
    if body.get("suffix") not in (None, ""):
        raise bad("'suffix' is not supported", "suffix", "unsupported_value")
    common.logprobs = completion_logprobs(body)
    return CompletionRequest(**common.__dict__, prompt=prompt)


# -- answers -----------------------------------------------------------------------------------
def openai_usage(fin) -> dict:
    """OpenAI's usage object; with drafts (--speculate lookup, --draft), the drafted tokens kept
    and rejected as its prediction counts (`completion_tokens_details`)."""
    usage = {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
             "total_tokens": fin.prompt_tokens + fin.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}
    if fin.drafted_tokens:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": fin.accepted_tokens,
                                              "rejected_prediction_tokens": fin.drafted_tokens - fin.accepted_tokens}
    return usage


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class OpenAIView:
    """One request's answer in OpenAI's shapes: `chat` (chat.completion and its chunks) or
    `completions` (text_completion). The app calls whole() for a complete answer, or
    stream_start(), stream_token() per Token event, then stream_end() or stream_error().

    With logprobs, every generated token's entry (its log-probability and the top ones, from the
    scheduler's Token events) goes with the text: a streamed chunk carries the entries of the
    tokens whose text it brings (a token whose text is held back, an unfinished UTF-8 character
    or a possible stop string, goes with the next chunk that has text, or with the last one)."""

    def __init__(self, kind: str, job_id: str, model: str, include_usage: bool, tokenizer=None,
                 logprobs: int | None = None, tools: ToolParser | None = None):
        self.kind, self.id, self.model, self.include_usage = kind, job_id, model, include_usage
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self._pending: list = []  # Token events whose logprobs have not gone out yet
        self._offset = 0  # completions' text_offset of the next token
        self.tools = tools  # splits a chat answer into text and tool calls (a request with tools)

    @staticmethod
    def error_body(err: ApiError) -> dict:
        return err.body()

    def _reason(self, fin) -> str:
        if self.tools is not None and self.tools.calls:
            return "tool_calls"
        return "length" if fin.finish_reason == "length" else "stop"

    @staticmethod
    def _call_object(call, index: int | None = None) -> dict:
        out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        return out if index is None else {"index": index, **out}

    # -- logprobs ---------------------------------------------------------------------------
    def _token_text(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _logprobs(self, events) -> dict | None:
        """The `logprobs` object of a choice (or a chunk's) for these Token events."""
        if self.logprobs is None:
            return None
        events = [e for e in events if e.logprob is not None]
        if self.kind == "chat":
            content = []
            for e in events:
                text, raw = self._token_text(e.token_id)
                top = []
                for tid, lp in e.logprob.top:
                    t, b = self._token_text(tid)
                    top.append({"token": t, "logprob": max(lp, LOGPROB_FLOOR), "bytes": b})
                content.append({"token": text, "logprob": max(e.logprob.logprob, LOGPROB_FLOOR), "bytes": raw,
                                "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens, values, tops, offsets = [], [], [], []
        for e in events:
            text = self._token_text(e.token_id)[0]
            tokens.append(text)
            values.append(max(e.logprob.logprob, LOGPROB_FLOOR))
            top: dict[str, float] = {}
            for tid, lp in e.logprob.top:
                top.setdefault(self._token_text(tid)[0], max(lp, LOGPROB_FLOOR))
            tops.append(top)
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if self.logprobs else None,
                "text_offset": offsets}

    # -- whole --------------------------------------------------------------------------------
    def whole(self, text: str, fin, tokens=()) -> dict:
        logprobs = self._logprobs(tokens)
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            if self.tools is not None:
                text, calls = split_events(self.tools.push(text) + self.tools.finish())
                message["content"] = text if text.strip() or not calls else None
                if calls:
                    message["tool_calls"] = [self._call_object(c) for c in calls]
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": self._reason(fin)}
            return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "choices": [choice], "usage": openai_usage(fin), "system_fingerprint": None}
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": self._reason(fin)}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": openai_usage(fin)}

    # -- streamed -----------------------------------------------------------------------------
    def _chunk(self, delta: str | None, reason: str | None, role: bool = False, logprobs: dict | None = None,
               calls: list | None = None) -> str:
        if self.kind == "chat":
            d = {"role": "assistant"} if role else {}
            if delta is not None:
                d["content"] = delta
            if calls:
                d["tool_calls"] = calls
            choice = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return _sse(body)

    def stream_start(self, cached_tokens: int) -> str:
        return self._chunk("", None, role=True) if self.kind == "chat" else ""

    def stream_text(self, text: str, final: bool = False) -> str:
        """A chunk with `text` and the logprobs of the tokens it completes (at the end, the
        held-back tokens' even without text)."""
        if not text and not (final and self._pending):
            return ""
        logprobs = self._logprobs(self._pending) if self._pending else None
        self._pending = []
        return self._chunk(text, None, logprobs=logprobs)

    def stream_token(self, event) -> str:
        if self.logprobs is not None:
            self._pending.append(event)
        if self.tools is None:
            return self.stream_text(event.text)
        return self._tool_events(self.tools.push(event.text))

    def _tool_events(self, events, final: bool = False) -> str:
        """Chunks for the tool parser's events: text as content, each call as a tool_calls delta
        (OpenAI's: the call's index, id, type and name with its whole arguments in one delta)."""
        out = []
        for kind, value in events:
            if kind == "text":
                out.append(self.stream_text(value))
            else:
                index = self.tools.calls.index(value)
                out.append(self._chunk(None, None, calls=[self._call_object(value, index)]))
        if final:
            out.append(self.stream_text("", final=True))
        return "".join(out)

    def stream_end(self, fin) -> str:
        tail = (self.stream_text(fin.text, final=True) if self.tools is None
                else self._tool_events(self.tools.push(fin.text) + self.tools.finish(), final=True))
        out = [tail,
               self._chunk(None if self.kind == "chat" else "", self._reason(fin))]
        if self.include_usage:
            out.append(_sse({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                             "choices": [], "usage": openai_usage(fin)}))
        out.append("data: [DONE]\n\n")
        return "".join(out)

    def stream_error(self, err: ApiError) -> str:
        return _sse(err.body())
