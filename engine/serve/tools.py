"""Tool calls for both APIs: the request's tools rendered into the prompt, and the model's answer
parsed back into calls.

Rendering. A chat template that takes `tools` (Qwen2.5 / Qwen3, Llama 3.1 / 3.2 and others in GGUF
files) gets them as the OpenAI-shaped list (`{"type": "function", "function": {name, description,
parameters}}`), and renders the history's assistant `tool_calls` and `tool` messages itself. A
template without tool support (SmolLM2's) gets the generic format, as llama.cpp's generic handler
does: the tools described in a system message, the model asked to answer with one JSON object
`{"name": ..., "arguments": {...}}` to call one; history calls become that JSON as the assistant's
text and tool results user messages.

tool_choice: "auto" (the model decides), "none" (no tools rendered, nothing parsed), "required"
and a named tool: the answer is constrained (engine/constrain.py) to one JSON call object of an
offered tool (the named one) whose arguments match the tool's parameters schema, after `<tool_call>\\n`
pre-filled in Qwen's syntax; the answer ends where the object does. In "auto" the model's calls
are parsed as written (nothing constrains them).

Parsing, per family (`template_family`):
    qwen     `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around
    llama3   the whole answer one JSON object `{"name": ..., "parameters": {...}}` (or "arguments"),
             several separated by ';', optionally after `<|python_tag|>`
    generic  the whole answer one JSON object {"name": ..., "arguments": {...}} (or a list of them)
A call naming a tool the request did not offer, or whose JSON does not parse, stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
FAMILIES = ("qwen", "llama3", "generic")

GENERIC_SYSTEM = (
    "You can call these tools (JSON schemas of their arguments):\n{tools}\n\n"
    "To call a tool, answer with only a JSON object, nothing before or after it: "
    '{{"name": <the tool\'s name>, "arguments": <an object of its arguments>}}, for example\n{example}\n{when}'
)
GENERIC_WHEN = {"auto": "Otherwise answer in plain text.", "required": "You must call one of the tools."}


def template_family(template: str | None) -> str:
    """Which tool syntax a chat template's model speaks: "qwen", "llama3" or "generic" (the
    template does not take tools)."""
    if not template or not re.search(r"\btools\b", template):
        return "generic"
    if QWEN_OPEN in template:
        return "qwen"
    if PYTHON_TAG in template or '"parameters"' in template or "ipython" in template:
        return "llama3"
    return "generic"  # takes tools in an unknown syntax: the generic JSON answer is parsed


@dataclass
class ToolChoice:
    mode: str = "auto"  # "auto" | "none" | "required" | "named"
    name: str | None = None  # the named tool


@dataclass
class Prepared:
    """What the prompt is rendered from: messages, the template's `tools` (None: not passed) and
    the text the answer starts with."""

    messages: list[dict]
    tools: list[dict] | None
    prefill: str = ""
    call_schema: dict | None = None  # required / named: the JSON schema the call is constrained to


def _arguments_text(args) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _as_object(args):
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _generic_history(messages: list[dict]) -> list[dict]:
    """The history for a template without tool support: calls as the generic JSON text, tool
    results as user messages."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"Tool result ({m.get('tool_call_id') or 'call'}): {m['content']}"})
        elif m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _as_object(c["function"]["arguments"])}
                     for c in m["tool_calls"]]
            text = "\n".join(json.dumps(c, ensure_ascii=False) for c in calls)
            out.append({"role": "assistant", "content": (m.get("content") or "") + ("\n" if m.get("content") else "")
                        + text})
        else:
            out.append(m)
    return out


def prepare(messages: list[dict], tools: list[dict] | None, choice: ToolChoice, family: str) -> Prepared:
    """The messages, template tools and prefill for a request (see the module docstring)."""
    use = bool(tools) and choice.mode != "none"
    if use and choice.mode == "required" and len(tools) == 1:  # one tool to call: that one
        choice = ToolChoice("named", tools[0]["function"]["name"])
    if family == "generic":
        messages = _generic_history(messages)
        if not use:
            return Prepared(messages, None)
        offered = [t for t in tools if choice.mode != "named" or t["function"]["name"] == choice.name]
        described = "\n".join(json.dumps({"name": t["function"]["name"],
                                          "description": t["function"].get("description", ""),
                                          "parameters": t["function"].get("parameters", {})}, ensure_ascii=False)
                              for t in offered)
        system = GENERIC_SYSTEM.format(tools=described, example=_example(offered[0]["function"]),
                                       when=GENERIC_WHEN.get(choice.mode, GENERIC_WHEN["required"]))
        if messages and messages[0]["role"] == "system":
            messages = [{"role": "system", "content": messages[0]["content"] + "\n\n" + system}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": system}, *messages]
        return Prepared(messages, None, _prefill(choice, "generic"), _call_schema(tools, choice, "generic"))
    if not use:
        return Prepared(messages, None)
    return Prepared(messages, tools, _prefill(choice, family), _call_schema(tools, choice, family))


def _call_schema(tools: list[dict], choice: ToolChoice, family: str) -> dict | None:
    """The JSON schema of a call of one of the offered tools (the named one alone), in the family's
    keys: {"name": <const>, "arguments" (Llama 3: "parameters"): <the tool's parameters>}."""
    if choice.mode not in ("required", "named"):
        return None
    key = "parameters" if family == "llama3" else "arguments"
    variants = []
    for t in tools:
        f = t["function"]
        if choice.mode == "named" and f["name"] != choice.name:
            continue
        params = f.get("parameters") or {"type": "object"}
        variants.append({"type": "object", "properties": {"name": {"const": f["name"]}, key: params},
                         "required": ["name", key], "additionalProperties": False})
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def _example(function: dict) -> str:
    """A call of `function` with placeholder values of its schema's properties' types."""
    placeholder = {"string": "...", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    props = (function.get("parameters") or {}).get("properties") or {}
    args = {k: placeholder.get(v.get("type") if isinstance(v, dict) else None, "...") for k, v in props.items()}
    return json.dumps({"name": function["name"], "arguments": args}, ensure_ascii=False)


def _prefill(choice: ToolChoice, family: str) -> str:
    """The answer's pre-filled start for a required / named call: Qwen's opening tag (the JSON
    after it is constrained to `_call_schema`)."""
    if choice.mode not in ("required", "named"):
        return ""
    return QWEN_OPEN + "\n" if family == "qwen" else ""


# -- parsing ---------------------------------------------------------------------------------
@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text (OpenAI's `arguments`)

    @property
    def input(self) -> dict:
        return json.loads(self.arguments)


def _call_of(obj, names: set[str], prefix: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(prefix + uuid.uuid4().hex[:24], obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list | None:
    """The JSON values `text` holds one after another (separated by whitespace, ';' or ','), or
    None if anything else is in it."""
    decoder, values, at = json.JSONDecoder(), [], 0
    text = text.strip()
    if text.startswith("```"):
        text = re.sub(r"^```(?:json)?\s*|\s*```$", "", text)
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
    return values or None


def _calls_in_json(text: str, names: set[str], prefix: str) -> list[ToolCall] | None:
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):]
    values = _json_values(text)
    if values is None:
        return None
    objs = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_call_of(o, names, prefix) for o in objs]
    return calls if calls and all(calls) else None


_CALL_HEAD = re.compile(r'\s*(?:<tool_call>\s*|<\|python_tag\|>\s*)?\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*'
                        r'"(?:arguments|parameters)"\s*:\s*')


def first_call(text: str, names: set[str], prefix: str = "call_") -> ToolCall | None:
    """The call `text` starts with, read leniently: `{"name": "X", "arguments": {...}` up to the
    end of the arguments object, whatever follows (a small model goes on writing after it)."""
    m = _CALL_HEAD.match(text)
    if not m or m.group(1) not in names:
        return None
    try:
        args, _ = json.JSONDecoder().raw_decode(text, m.end())
    except ValueError:
        return None
    return _call_of({"name": m.group(1), "arguments": args}, names, prefix)


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@dataclass
class ToolParser:
    """The model's answer, fed as it streams, split into text and tool calls.

    push(text) and finish() return events: ("text", str) for text to show, ("call", ToolCall).
    Text that may still turn into a call is held back (in Qwen's syntax from a possible
    `<tool_call>` on; in the JSON syntaxes the whole answer once it starts with `{`, `[`,
    `<|python_tag|>` or a code fence)."""

    family: str
    names: set[str]
    prefill: str = ""
    id_prefix: str = "call_"
    calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self):
        self._held = ""
        self._state = "start" if self.family != "qwen" else "text"
        self._pending = self.prefill  # the prefill is the answer's start: parsed, never shown alone
        self._after_call = False

    def push(self, text: str) -> list[tuple]:
        text, self._pending = self._pending + text, ""
        if self.family == "qwen":
            return self._push_tagged(text)
        return self._push_json(text)

    def finish(self) -> list[tuple]:
        events = self.push("")
        held, self._held = self._held, ""
        if not held:
            return events
        if self.family == "qwen":
            if self._state == "call":  # an unclosed call at the end of the answer
                calls = _calls_in_json(held[len(QWEN_OPEN):], self.names, self.id_prefix)
                if not calls:
                    call = first_call(held, self.names, self.id_prefix)
                    calls = [call] if call else None
                return events + (self._took(calls) if calls else [("text", held)])
            return events + self._text(held)
        if self._state == "hold":
            calls = _calls_in_json(held, self.names, self.id_prefix)
            if not calls:  # a call followed by more text (a small model goes on), or cut short
                call = first_call(held, self.names, self.id_prefix)
                calls = [call] if call else None
            if calls:
                return events + self._took(calls)
        return events + [("text", held)]

    def _took(self, calls: list[ToolCall]) -> list[tuple]:
        self.calls.extend(calls)
        self._after_call = True
        return [("call", c) for c in calls]

    def _text(self, text: str) -> list[tuple]:
        """A text event; the whitespace between and after calls is dropped."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        return [("text", text)]

    def _push_tagged(self, text: str) -> list[tuple]:
        buffer, self._held = self._held + text, ""
        events = []
        while buffer:
            if self._state == "text":
                at = buffer.find(QWEN_OPEN)
                if at < 0:
                    keep = _partial_suffix(buffer, QWEN_OPEN)
                    if len(buffer) > keep:
                        events.extend(self._text(buffer[: len(buffer) - keep]))
                    self._held = buffer[len(buffer) - keep:]
                    return events
                if at:
                    events.extend(self._text(buffer[:at]))
                buffer, self._state = buffer[at:], "call"
            else:
                end = buffer.find(QWEN_CLOSE)
                if end < 0:
                    self._held = buffer
                    return events
                body = buffer[len(QWEN_OPEN): end]
                calls = _calls_in_json(body, self.names, self.id_prefix)
                events.extend(self._took(calls) if calls else [("text", buffer[: end + len(QWEN_CLOSE)])])
                buffer, self._state = buffer[end + len(QWEN_CLOSE):], "text"
        return events

    def _push_json(self, text: str) -> list[tuple]:
        if self._state == "text":
            return [("text", text)] if text else []
        buffer, self._held = self._held + text, ""
        if self._state == "start":
            stripped = buffer.lstrip()
            if not stripped:
                self._held = buffer
                return []
            if stripped[0] in "{[" or stripped.startswith("```") or stripped.startswith(PYTHON_TAG) \
                    or PYTHON_TAG.startswith(stripped) or "```".startswith(stripped):
                self._state = "hold"
            else:
                self._state = "text"
                return [("text", buffer)]
        self._held = buffer
        return []


def split_events(events) -> tuple[str, list[ToolCall]]:
    """(the text, the calls) of a whole answer's events."""
    return "".join(e[1] for e in events if e[0] == "text"), [e[1] for e in events if e[0] == "call"]
