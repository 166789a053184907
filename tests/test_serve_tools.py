"""Tool calls on both APIs: tools rendered through templates with the constructs of the published
Qwen2.5 / Qwen3 and Llama 3.1 templates (a `tools` list, `tool_calls` on assistant messages, the
`tool` role) or in the generic system-prompt format (SmolLM2's template takes no tools), each
family's call syntax parsed from canned model outputs (whole and fed in pieces, through the real
answer views), and round trips through a real server with the official `openai` and `anthropic`
clients.

The tiny random models cannot be steered into writing a call, so the end-to-end calls are
SmolLM2's (slow), and, with tool_choice required / named (decoding constrained to a call of an
offered tool), the tiny model's. The tiny-model server tests also check what goes in (the
rendered prompt) and that an answer without a parsable call comes back as text."""

from __future__ import annotations

import json

import anthropic
import httpx2 as httpx
import pytest

from engine.engine import Engine
from engine.serve import tools as T
from engine.serve.anthropic import MessagesView
from engine.serve.protocol import OpenAIView
from engine.serve.scheduler import Finished, Token
from .test_serve import CHAT_TEMPLATE, client, start
from .tiny_gguf import write_tiny_model

from gguf.constants import GGMLQuantizationType as QT

# the constructs of Qwen2.5's template: tools in <tools></tools> in the system turn, calls as
# <tool_call> JSON with "arguments", results as <tool_response> in a user turn
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{% if message.content %}\n{{ message.content }}"
    "{% endif %}{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}\n<tool_call>\n"
    "{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{% endif %}\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# the constructs of Llama 3.1's template: "Environment: ipython", the tools as JSON in the first
# user turn, calls as {"name": ..., "parameters": ...}, results in the ipython role
LLAMA31_TEMPLATE = (
    "{{- bos_token }}<|start_header_id|>system<|end_header_id|>\n\n{% if tools %}Environment: ipython\n{% endif %}"
    "Cutting Knowledge Date: December 2023\n\n<|eot_id|>"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and loop.first and tools %}<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}.\n\n{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}"
    "{{ message.content }}<|eot_id|>"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message.content | tojson }}<|eot_id|>"
    "{%- elif message.tool_calls %}{% set tool_call = message.tool_calls[0].function %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"{{ tool_call.name }}\", \"parameters\": "
    "{{ tool_call.arguments | tojson }}}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

TOOLS_CTX = 2048  # the tiny tokenizer spends a token on about every character of the tool descriptions
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
NAMES = {"get_weather", "get_time"}
HISTORY = [{"role": "user", "content": "weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tools") / "tiny-qwen.gguf", context_length=TOOLS_CTX,
                            chat_template=QWEN_TEMPLATE, weight_type=QT.Q8_0, seed=3)
    thread = start(path, max_batch=2, ctx=TOOLS_CTX)
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def generic(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tools") / "tiny-chat.gguf", context_length=TOOLS_CTX,
                            chat_template=CHAT_TEMPLATE, weight_type=QT.Q8_0, seed=3)
    thread = start(path, max_batch=2, ctx=TOOLS_CTX)
    yield thread
    thread.stop()


def test_template_families():
    assert T.template_family(QWEN_TEMPLATE) == "qwen"
    assert T.template_family(LLAMA31_TEMPLATE) == "llama3"
    assert T.template_family(CHAT_TEMPLATE) == "generic" and T.template_family(None) == "generic"


# -- rendering ---------------------------------------------------------------------------------
def test_tools_and_a_tool_history_are_rendered_through_a_qwen_template(qwen):
    c, engine = client(qwen), qwen.server.engine
    r = c.chat.completions.create(model="m", messages=HISTORY, tools=[WEATHER, TIME], max_tokens=4, temperature=0)
    converted = [HISTORY[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, HISTORY[2]]
    text = engine.tokenizer.apply_chat_template(converted, tools=[WEATHER, TIME])
    assert json.dumps(WEATHER) in text and json.dumps(TIME) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert r.usage.prompt_tokens == len(engine.encode_chat(converted, tools=[WEATHER, TIME]))
    # the random model writes no call: its answer is text, finish_reason as without tools
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    # tool_choice "none": the tools are not rendered
    none = c.chat.completions.create(model="m", messages=HISTORY, tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert none.usage.prompt_tokens == len(engine.encode_chat(converted))
    # Anthropic's tools and tool_use / tool_result blocks render the same prompt
    claude = anthropic.Anthropic(base_url=qwen.url, api_key="x", max_retries=0)
    counted = claude.messages.count_tokens(model="m", tools=[
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)], messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "18 C, sunny"}]}])
    assert counted.input_tokens == r.usage.prompt_tokens


def test_a_named_tool_choice_is_constrained_to_that_tools_call(qwen):
    """Even the tiny random model answers a named (or required) tool_choice with a call whose
    arguments match the tool's schema: the answer is constrained to the call object."""
    prepared = T.prepare(HISTORY[:1], [WEATHER, TIME], T.ToolChoice("named", "get_time"), "qwen")
    assert prepared.prefill == "<tool_call>\n" and prepared.tools == [WEATHER, TIME]
    assert prepared.call_schema["properties"] == {"name": {"const": "get_time"},
                                                  "arguments": TIME["function"]["parameters"]}
    c = client(qwen)
    for choice, names in [({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
                          ("required", NAMES)]:
        for stream in (False, True):
            r = c.chat.completions.create(model="m", messages=HISTORY[:1], tools=[WEATHER, TIME], max_tokens=200,
                                          tool_choice=choice, stream=stream, temperature=0)
            if stream:
                chunks = [ch.choices[0] for ch in r if ch.choices]
                calls = [d for ch in chunks for d in ch.delta.tool_calls or ()]
                reason = chunks[-1].finish_reason
            else:
                calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
            assert reason == "tool_calls" and len(calls) == 1, (choice, stream)
            args = json.loads(calls[0].function.arguments)
            assert calls[0].function.name in names and set(args) == {"zone" if calls[0].function.name == "get_time"
                                                                    else "city"}
            assert all(isinstance(v, str) for v in args.values())
    llama = T.prepare(HISTORY[:1], [WEATHER], T.ToolChoice("required"), "llama3")
    assert llama.prefill == "" and set(llama.call_schema["properties"]) == {"name", "parameters"}
    assert set(T.prepare(HISTORY[:1], [WEATHER, TIME], T.ToolChoice("required"), "generic").call_schema) == {"anyOf"}


def test_a_template_without_tools_gets_the_generic_system_prompt_and_history(generic):
    engine = generic.server.engine
    prepared = T.prepare(HISTORY, [WEATHER], T.ToolChoice(), "generic")
    system = prepared.messages[0]
    assert system["role"] == "system" and '"name": "get_weather"' in system["content"]
    assert '{"name": "get_weather", "arguments": {"city": "..."}}' in system["content"]  # the example call
    assert prepared.messages[2] == {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}'}
    assert prepared.messages[3]["role"] == "user" and "18 C, sunny" in prepared.messages[3]["content"]
    assert prepared.tools is None and prepared.prefill == ""
    r = client(generic).chat.completions.create(model="m", messages=HISTORY, tools=[WEATHER], max_tokens=4)
    assert r.usage.prompt_tokens == len(engine.encode_chat(prepared.messages))


def test_bad_tool_requests_get_400s_naming_the_field(generic):
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [({"tools": "get_weather"}, "tools"),
             ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
             ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
             ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
             ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
              "messages[0].tool_calls[0].function.arguments")]
    with httpx.Client(base_url=generic.url, timeout=60) as http:
        for fields, param in cases:
            r = http.post("/v1/chat/completions", json={**ok, **fields})
            assert r.status_code == 400, (fields, r.text)
            assert r.json()["error"]["param"] == param, fields
        for fields in ({"tools": [{"name": "f"}]}, {"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "x"}},
                       {"tool_choice": {"type": "any"}}, {"tools": [{"type": "web_search_20250305", "name": "w"}]}):
            r = http.post("/v1/messages", json={**ok, **fields})
            assert r.status_code == 400 and r.json()["type"] == "error", (fields, r.text)
        assert http.get("/health").status_code == 200


# -- parsing canned outputs --------------------------------------------------------------------
CANNED = {
    "qwen": [("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
              "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}\n</tool_call>",
              "Let me check.\n", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
             ("No tools needed: 2 < 3 and <tool is a word.", "No tools needed: 2 < 3 and <tool is a word.", []),
             ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}",  # unclosed at the end
              "", [("get_weather", {"city": "Rome"})]),
             ("<tool_call>{broken json}</tool_call>", "<tool_call>{broken json}</tool_call>", []),
             ("<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",  # not an offered tool
              "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>", [])],
    "llama3": [("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", "", [("get_weather", {"city": "Oslo"})]),
               ("<|python_tag|>{\"name\": \"get_time\", \"parameters\": {\"zone\": \"UTC\"}}", "",
                [("get_time", {"zone": "UTC"})]),
               ("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"A\"}}; "
                "{\"name\": \"get_time\", \"parameters\": {\"zone\": \"B\"}}", "",
                [("get_weather", {"city": "A"}), ("get_time", {"zone": "B"})]),
               ("The weather is fine.", "The weather is fine.", [])],
    "generic": [("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}", "", [("get_weather", {"city": "Lima"})]),
                ("```json\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"PST\"}}\n```", "",
                 [("get_time", {"zone": "PST"})]),
                ("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}, \"note\": \"a small model goes on",
                 "", [("get_weather", {"city": "Lima"})]),
                ("{\"not\": \"a call\"}", "{\"not\": \"a call\"}", []),
                ("Sure, here you go.", "Sure, here you go.", [])],
}


def _cases():
    return [(family, i) for family, cases in CANNED.items() for i in range(len(cases))]


def _tokens(text: str, size: int) -> list[Token]:
    return [Token(0, text[i:i + size]) for i in range(0, len(text), size)]


def _sse(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("family,i", _cases())
def test_each_familys_syntax_is_parsed_whole_and_streamed_into_openai_tool_calls(family, i):
    text, content, calls = CANNED[family][i]
    fin = Finished("stop", 10, 20, 0, "", None)
    whole = OpenAIView("chat", "id", "m", False, tools=T.ToolParser(family, NAMES)).whole(text, fin)
    message = whole["choices"][0]["message"]
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    assert got == calls
    assert (message["content"] or "") == content or (calls and not content.strip() and message["content"] is None)
    assert whole["choices"][0]["finish_reason"] == ("tool_calls" if calls else "stop")
    for size in (1, 3, 7):  # the answer streamed in pieces of `size` characters
        view = OpenAIView("chat", "id", "m", False, tools=T.ToolParser(family, NAMES))
        out = view.stream_start(0) + "".join(view.stream_token(t) for t in _tokens(text, size)) + view.stream_end(fin)
        chunks = [ch["choices"][0] for ch in _sse(out)]
        deltas = [d for ch in chunks for d in ch["delta"].get("tool_calls", [])]
        assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == calls
        assert [d["index"] for d in deltas] == list(range(len(calls)))
        assert "".join(ch["delta"].get("content") or "" for ch in chunks) == content
        assert chunks[-1]["finish_reason"] == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("family,i", [("qwen", 0), ("llama3", 2), ("generic", 0), ("generic", 4)])
def test_calls_are_anthropic_tool_use_blocks_whole_and_streamed(family, i):
    text, content, calls = CANNED[family][i]
    fin = Finished("stop", 10, 20, 0, "", None)
    whole = MessagesView("msg", "m", 10, T.ToolParser(family, NAMES, id_prefix="toolu_")).whole(text, fin)
    assert [(b["name"], b["input"]) for b in whole["content"] if b["type"] == "tool_use"] == calls
    assert all(b["id"].startswith("toolu_") for b in whole["content"] if b["type"] == "tool_use")
    assert "".join(b["text"] for b in whole["content"] if b["type"] == "text") == content
    assert whole["stop_reason"] == ("tool_use" if calls else "end_turn")
    view = MessagesView("msg", "m", 10, T.ToolParser(family, NAMES, id_prefix="toolu_"))
    out = view.stream_start(0) + "".join(view.stream_token(t) for t in _tokens(text, 2)) + view.stream_end(fin)
    events = _sse(out)
    starts = [e for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert [e["index"] for e in starts] == stops == list(range(len(starts)))  # blocks open and close in turn
    inputs = {e["index"]: json.loads(e["delta"]["partial_json"]) for e in events
              if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"}
    assert [(e["content_block"]["name"], inputs[e["index"]]) for e in starts
            if e["content_block"]["type"] == "tool_use"] == calls
    assert [e for e in events if e["type"] == "message_delta"][0]["delta"]["stop_reason"] == whole["stop_reason"]


# -- SmolLM2 end to end --------------------------------------------------------------------------
def _valid(args: dict, schema: dict) -> bool:
    """The few JSON-schema rules the test tools use: an object, required keys, string values."""
    props = schema["properties"]
    return (isinstance(args, dict) and all(k in args for k in schema.get("required", ()))
            and all(k in props and isinstance(v, str) for k, v in args.items()))


@pytest.mark.slow
def test_smollm2_required_tool_call_round_trip_with_the_openai_and_anthropic_clients(smollm2_path):
    """SmolLM2's template takes no tools: the generic format. With tool_choice "required" the
    answer is constrained to a call of the tool and ends with it; the call's arguments validate
    against the tool's schema, streamed and not; the call and its result sent back get a text
    answer."""
    thread = start(smollm2_path, max_batch=2, ctx=2048)
    try:
        c = client(thread)
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = c.chat.completions.create(model="m", messages=ask, tools=[WEATHER], tool_choice="required",
                                      max_tokens=48, temperature=0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and _valid(args, WEATHER["function"]["parameters"])
        assert r.usage.completion_tokens < 48  # ended once the arguments closed
        streamed = list(c.chat.completions.create(model="m", messages=ask, tools=[WEATHER], tool_choice="required",
                                                  max_tokens=48, temperature=0, stream=True))
        deltas = [d for ch in streamed if ch.choices for d in ch.choices[0].delta.tool_calls or ()]
        assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_weather", args)]
        assert [ch.choices[0].finish_reason for ch in streamed if ch.choices][-1] == "tool_calls"
        back = c.chat.completions.create(model="m", max_tokens=24, temperature=0, tools=[WEATHER], tool_choice="none",
                                         messages=[
            *ask, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}])
        assert back.choices[0].message.content and back.choices[0].finish_reason in ("stop", "length")
        # Anthropic: tool_choice any -> a tool_use block, then tool_result -> text
        claude = anthropic.Anthropic(base_url=thread.url, api_key="x", max_retries=0, timeout=120)
        tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
                "input_schema": WEATHER["function"]["parameters"]}
        m = claude.messages.create(model="m", max_tokens=48, tools=[tool], tool_choice={"type": "any"},
                                   messages=ask, extra_body={"temperature": 0})
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and use.name == "get_weather" and use.input == args
        with claude.messages.stream(model="m", max_tokens=48, tools=[tool], tool_choice={"type": "any"},
                                    messages=ask, extra_body={"temperature": 0}) as s:
            final = s.get_final_message()
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("get_weather", args)]
        answer = claude.messages.create(model="m", max_tokens=24, tools=[tool], tool_choice={"type": "none"},
                                        extra_body={"temperature": 0}, messages=[
            *ask, {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}]}])
        assert answer.content[0].type == "text" and answer.content[0].text
    finally:
        thread.stop()
