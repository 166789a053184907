"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the request
body checked field by field and turned into the chat request the scheduler serves, and the
answer in Anthropic's shapes (the message object, the streamed events, the error object).

Accepted: model, messages (user / assistant turns; content a string or a list of `text`,
`tool_use` and `tool_result` blocks), system (a string or text blocks), max_tokens (required),
stop_sequences, temperature (0-1), top_p, top_k, stream, tools, tool_choice (auto / any / tool /
none; calls parsed as in tools.py and answered as tool_use blocks); metadata,
service_tier and other fields clients send are ignored. A last assistant turn is a prefill: the
answer continues it.

Usage follows Anthropic's split of the prompt: `input_tokens` are the prompt tokens computed for
this request, `cache_read_input_tokens` the ones that came from the prefix cache (their sum is
the prompt's length, which count_tokens returns), `cache_creation_input_tokens` is 0.

Streaming sends, as Anthropic does: message_start, content_block_start, content_block_delta
(text_delta, input_json_delta), content_block_stop for each block, message_delta (stop_reason,
usage), message_stop; a failure after the start is an `error` event.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..sampling import SamplingParams
from .protocol import (ApiError, ChatRequest, _is_int, _number, bad, check_tool_choice, check_tools, message_list,
                       served_model, stream_flag)
from .tools import ToolChoice, ToolParser, split_events
from .scheduler import Finished

MAX_STOP_SEQUENCES = 16  # well above what clients send; each is matched on every token

# Anthropic's error types by HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(err: ApiError) -> dict:
    """Anthropic's error object for `err` (the OpenAI-side `param` is named in the message)."""
    kind = ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


@dataclass
class MessagesRequest(ChatRequest):
    prefill: str = ""  # a last assistant turn's text: the answer continues it


def _blocks(content, where: str) -> list[dict]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of content blocks", f"{where}.content",
                  "invalid_type")
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise bad(f"{where}.content[{j}] must be an object", f"{where}.content", "invalid_type")
    return content


def _text_of(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}: a text block needs a string 'text'", where, "invalid_type")
    return text


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{where}: tool_result content may hold only text blocks", where, "unsupported_value")
            parts.append(_text_of(part, where))
        return "".join(parts)
    raise bad(f"{where}: tool_result content must be a string or a list of text blocks", where, "invalid_type")


def convert_messages(messages, system) -> list[dict]:
    """Anthropic's turns as chat-template messages (OpenAI's shape, which the templates in GGUF
    files take): tool_use blocks become the assistant's `tool_calls` (arguments as objects, as
    the templates expect), each tool_result a `tool` message."""
    out: list[dict] = []
    if system is not None:
        if isinstance(system, str):
            text = system
        elif isinstance(system, list):
            if not all(isinstance(b, dict) and b.get("type") == "text" for b in system):
                raise bad("system: only text blocks are supported", "system", "invalid_type")
            text = "".join(_text_of(b, "system") for b in system)
        else:
            raise bad("'system' must be a string or a list of text blocks", "system", "invalid_type")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(message_list(messages)):
        where = f"messages[{i}]"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role must be 'user' or 'assistant', not {role!r} (the system prompt goes in "
                      "'system')", f"{where}.role")
        if "content" not in m:
            raise bad(f"{where}.content is required", f"{where}.content", "missing_required_parameter")
        text, calls, results = [], [], []
        for j, block in enumerate(_blocks(m["content"], where)):
            kind, at = block.get("type"), f"{where}.content[{j}]"
            if kind == "text":
                text.append(_text_of(block, at))
            elif kind == "tool_use" and role == "assistant":
                name, args = block.get("name"), block.get("input", {})
                if not isinstance(name, str) or not name:
                    raise bad(f"{at}: a tool_use block needs a 'name'", at, "missing_required_parameter")
                if not isinstance(args, dict):
                    raise bad(f"{at}: a tool_use block's 'input' must be an object", at, "invalid_type")
                calls.append({"id": str(block.get("id") or ""), "type": "function",
                              "function": {"name": name, "arguments": args}})
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str) or not call_id:
                    raise bad(f"{at}: a tool_result block needs a 'tool_use_id'", at, "missing_required_parameter")
                results.append({"role": "tool", "tool_call_id": call_id,
                                "content": _tool_result_text(block, at)})
            elif kind in ("tool_use", "tool_result"):
                raise bad(f"{at}: a {kind} block belongs in a{'n assistant' if kind == 'tool_use' else ' user'} "
                          "turn", at)
            else:
                raise bad(f"{at}: content blocks of type {kind!r} are not supported (text, tool_use, "
                          "tool_result)", at, "unsupported_value")
        out.extend(results)  # tool results answer the previous assistant turn: they come first
        if text or calls or not results:
            msg = {"role": role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def parse_messages(body: dict, served_ids: tuple[str, ...], *, counting: bool = False) -> MessagesRequest:
    """The request of `/v1/messages` (or of count_tokens when `counting`: no max_tokens)."""
    model = served_model(body, served_ids)
    max_tokens = body.get("max_tokens")
    if not counting:
        if max_tokens is None:
            raise bad("'max_tokens' is required", "max_tokens", "missing_required_parameter")
        if not _is_int(max_tokens):
            raise bad(f"'max_tokens' must be an integer, not {type(max_tokens).__name__}", "max_tokens",
                      "invalid_type")
        if max_tokens < 1:
            raise bad(f"'max_tokens' must be at least 1, not {max_tokens}", "max_tokens")
    messages = convert_messages(body.get("messages"), body.get("system"))
    prefill = ""
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        prefill = messages.pop()["content"]
        if not any(m["role"] != "system" for m in messages):
            raise bad("the conversation needs a user turn before the assistant's", "messages")
    temperature = _number(body, "temperature", 0.0, 1.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise bad("'top_p' must be greater than 0", "top_p")
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < 0:
        raise bad(f"'top_k' must be an integer >= 0, not {top_k!r}", "top_k", "invalid_type")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop_sequences' must be a list of strings", "stop_sequences", "invalid_type")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad(f"at most {MAX_STOP_SEQUENCES} stop sequences, not {len(stops)}", "stop_sequences")
    if any(not s.strip() for s in stops):
        raise bad("stop sequences must contain non-whitespace", "stop_sequences")
    stream = stream_flag(body)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    tools = anthropic_tools(body.get("tools"))
    choice = anthropic_tool_choice(body.get("tool_choice"), tools)
    return MessagesRequest(model=model, max_tokens=max_tokens, sampling=sampling, stop=tuple(stops),
                           stream=stream, include_usage=True, messages=messages, prefill=prefill,
                           tools=tools, tool_choice=choice)


def anthropic_tools(tools) -> list[dict] | None:
    """Anthropic's tools ({name, description, input_schema}) in OpenAI's shape, checked."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools", "invalid_type")
    converted = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad(f"tools[{j}] must be an object", f"tools[{j}]", "invalid_type")
        if t.get("type") not in (None, "custom"):
            raise bad(f"tools[{j}]: server tools of type {t.get('type')!r} are not supported (custom tools only)",
                      f"tools[{j}]", "unsupported_value")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad(f"tools[{j}].input_schema is required (a JSON schema object)", f"tools[{j}].input_schema",
                      "missing_required_parameter")
        converted.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                           "parameters": schema}})
    return check_tools(converted)


def anthropic_tool_choice(choice, tools) -> ToolChoice:
    """{"type": "auto" | "any" | "tool" (with "name") | "none"}."""
    if choice is None:
        return ToolChoice()
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice",
                  "invalid_value")
    kind = choice["type"]
    if kind == "tool":
        return check_tool_choice({"type": "function", "function": {"name": choice.get("name")}}, tools)
    if kind == "any" and not tools:
        raise bad("'tool_choice' is 'any' but the request has no 'tools'", "tool_choice")
    return ToolChoice({"any": "required"}.get(kind, kind))


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def usage(fin: Finished) -> dict:
    return {"input_tokens": fin.prompt_tokens - fin.cached_tokens, "output_tokens": fin.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": fin.cached_tokens}


def stop_reason(fin: Finished) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if fin.stop_string is not None:
        return "stop_sequence", fin.stop_string
    if fin.finish_reason == "length":
        return "max_tokens", None
    return "end_turn", None


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class MessagesView:
    """One request's answer in Anthropic's shapes (see the module docstring). With tools, the
    answer's calls are `tool_use` blocks after its text (streamed: the text block is closed, each
    call is a block of its own with its input as one input_json_delta, text after a call opens a
    new text block)."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int, tools: ToolParser | None = None):
        self.id, self.model, self.prompt_tokens = message_id, model, prompt_tokens
        self.tools = tools
        self._open: int | None = None  # the index of the open text block
        self._blocks = 0  # blocks started so far

    error_body = staticmethod(error_body)

    def _stop(self, fin: Finished) -> tuple[str, str | None]:
        if self.tools is not None and self.tools.calls:
            return "tool_use", None
        return stop_reason(fin)

    def whole(self, text: str, fin: Finished, tokens=()) -> dict:
        reason, sequence = self._stop_whole(text, fin)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self._content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(fin)}

    def _stop_whole(self, text: str, fin: Finished):
        content = [{"type": "text", "text": text}]
        if self.tools is not None:
            text, calls = split_events(self.tools.push(text) + self.tools.finish())
            content = [{"type": "text", "text": text}] if text.strip() or not calls else []
            content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.input} for c in calls]
        self._content = content
        return self._stop(fin)

    def stream_start(self, cached_tokens: int) -> str:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens - cached_tokens, "output_tokens": 0,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}}
        return (sse("message_start", {"type": "message_start", "message": message})
                + self._open_text() + sse("ping", {"type": "ping"}))

    def _open_text(self) -> str:
        self._open, self._blocks = self._blocks, self._blocks + 1
        return sse("content_block_start", {"type": "content_block_start", "index": self._open,
                                           "content_block": {"type": "text", "text": ""}})

    def _close_text(self) -> str:
        if self._open is None:
            return ""
        index, self._open = self._open, None
        return sse("content_block_stop", {"type": "content_block_stop", "index": index})

    def stream_text(self, text: str) -> str:
        if not text:
            return ""
        head = self._open_text() if self._open is None else ""
        return head + sse("content_block_delta", {"type": "content_block_delta", "index": self._open,
                                                  "delta": {"type": "text_delta", "text": text}})

    def _tool_events(self, events) -> str:
        out = []
        for kind, value in events:
            if kind == "text":
                out.append(self.stream_text(value))
                continue
            out.append(self._close_text())
            index, self._blocks = self._blocks, self._blocks + 1
            out.append(sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
                "type": "tool_use", "id": value.id, "name": value.name, "input": {}}}))
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "input_json_delta", "partial_json": value.arguments}}))
            out.append(sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        return "".join(out)

    def stream_token(self, event) -> str:
        if self.tools is None:
            return self.stream_text(event.text)
        return self._tool_events(self.tools.push(event.text))

    def stream_end(self, fin: Finished) -> str:
        tail = (self.stream_text(fin.text) if self.tools is None
                else self._tool_events(self.tools.push(fin.text) + self.tools.finish()))
        reason, sequence = self._stop(fin)
        return (tail + self._close_text()
                + sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                        "usage": usage(fin)})
                + sse("message_stop", {"type": "message_stop"}))

    def stream_error(self, err: ApiError) -> str:
        return sse("error", error_body(err))
