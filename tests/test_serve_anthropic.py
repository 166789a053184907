"""`omlx serve`'s Anthropic Messages API (/v1/messages, /v1/messages/count_tokens), driven by the
official `anthropic` client at a real server on 127.0.0.1, and by raw HTTP for the event sequence
and malformed requests."""

from __future__ import annotations

import json

import anthropic
import httpx2 as httpx
import pytest

from engine.serve.anthropic import convert_messages
from .test_serve import _DROP, TINY_CTX, body_with, client, start, tiny, tiny_path, wait_idle  # noqa: F401 (fixtures)


def claude(thread, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=thread.url, api_key=key, max_retries=0, timeout=120)


def ask(c, content, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("extra_body", {"temperature": 0})  # the current SDK has no sampling arguments
    return c.messages.create(model="m", messages=[{"role": "user", "content": content}], **kw)


def sse_events(response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
    return events


def test_a_message_streamed_and_whole_gives_the_same_text_and_usage(tiny):
    c = claude(tiny)
    whole = ask(c, "the streaming check", max_tokens=20)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 20
    assert [b.type for b in whole.content] == ["text"]
    with c.messages.stream(model="m", max_tokens=20, messages=[{"role": "user", "content": "the streaming check"}],
                           extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 20
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_the_stream_is_anthropics_event_sequence(tiny):
    body = {"model": "m", "max_tokens": 6, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "events"}]}
    with httpx.stream("POST", tiny.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    names = [n for n, _ in events]
    assert all(n == data["type"] for n, data in events)
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) <= {"ping", "content_block_delta"}
    start_msg = events[0][1]["message"]
    assert start_msg["content"] == [] and start_msg["stop_reason"] is None
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert deltas and all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    message_delta = events[-2][1]
    assert message_delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert message_delta["usage"]["output_tokens"] == 6


def test_count_tokens_is_our_tokenizers_count_and_a_resent_conversation_reads_the_cache(tiny):
    c = claude(tiny)
    engine = tiny.server.engine
    system = "You are a careful assistant. " * 12  # several 32-token blocks
    messages = [{"role": "user", "content": "first question"}]
    counted = c.messages.count_tokens(model="m", system=system, messages=messages).input_tokens
    assert counted == len(engine.encode_chat(convert_messages(messages, system)))
    first = c.messages.create(model="m", system=system, messages=messages, max_tokens=8,
                              extra_body={"temperature": 0})
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == counted
    resent = messages + [{"role": "assistant", "content": first.content[0].text},
                         {"role": "user", "content": "and then?"}]
    again = c.messages.create(model="m", system=[{"type": "text", "text": system}], messages=resent,
                              max_tokens=8, extra_body={"temperature": 0})
    assert again.usage.cache_read_input_tokens > 0 and again.usage.cache_read_input_tokens % 32 == 0
    assert (again.usage.input_tokens + again.usage.cache_read_input_tokens
            == c.messages.count_tokens(model="m", system=system, messages=resent).input_tokens)


def test_a_prefilled_assistant_turn_is_continued(tiny):
    c = claude(tiny)
    prefill = [{"role": "user", "content": "stop here"}, {"role": "assistant", "content": "Sure:"}]
    counted = c.messages.count_tokens(model="m", messages=prefill).input_tokens
    without = c.messages.count_tokens(model="m", messages=prefill[:1]).input_tokens
    assert counted > without
    r = c.messages.create(model="m", messages=prefill, max_tokens=4, extra_body={"temperature": 0})
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == counted


def test_tool_use_and_tool_result_blocks_are_rendered_into_the_prompt(tiny):
    c = claude(tiny)
    turns = [{"role": "user", "content": "weather in Paris?"},
             {"role": "assistant", "content": [
                 {"type": "text", "text": "Let me look."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C, sunny"}]},
                 {"type": "text", "text": "thanks"}]}]
    converted = convert_messages(turns, None)
    assert converted[1]["tool_calls"] == [{"id": "toolu_1", "type": "function",
                                           "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert converted[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"}
    assert converted[3] == {"role": "user", "content": "thanks"}
    longer = [*turns[:2], {**turns[2], "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                    "content": "18 C, sunny, light wind from the west"}]}]
    assert (c.messages.count_tokens(model="m", messages=longer).input_tokens
            > c.messages.count_tokens(model="m", messages=turns[:2] + [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}]).input_tokens)
    r = c.messages.create(model="m", messages=turns, max_tokens=4, extra_body={"temperature": 0})
    assert r.usage.output_tokens == 4


def _bad_messages():
    ok = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}

    def with_(**fields):
        return "/v1/messages", body_with(ok, **fields)

    def turn(content, role="user"):
        return with_(messages=[{"role": role, "content": content}])

    return {
        "not JSON": ("/v1/messages", b"{nope"),
        "empty body": ("/v1/messages", b""),
        "no model": with_(model=_DROP),
        "unknown model": with_(model="claude-9"),
        "no max_tokens": with_(max_tokens=_DROP),
        "max_tokens a string": with_(max_tokens="8"),
        "max_tokens zero": with_(max_tokens=0),
        "max_tokens past the context": with_(max_tokens=10 * TINY_CTX),
        "no messages": with_(messages=_DROP),
        "empty messages": with_(messages=[]),
        "system role in messages": with_(messages=[{"role": "system", "content": "x"}]),
        "content a number": turn(5),
        "image block": turn([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]),
        "text block without text": turn([{"type": "text"}]),
        "tool_result without tool_use_id": turn([{"type": "tool_result", "content": "x"}]),
        "tool_use in a user turn": turn([{"type": "tool_use", "id": "t", "name": "f", "input": {}}]),
        "tool_use input a list": turn([{"type": "tool_use", "id": "t", "name": "f", "input": [1]}], "assistant"),
        "temperature above 1": with_(temperature=1.5),
        "top_k negative": with_(top_k=-1),
        "stop_sequences a string": with_(stop_sequences="END"),
        "system a number": with_(system=3),
        "stream a string": with_(stream="yes"),
        "prompt longer than the context": turn("word " * 2000),
        "body too large": ("/v1/messages", b'{"model": "m", "pad": "' + b"x" * (5 << 20) + b'"}'),
        "count_tokens without messages": ("/v1/messages/count_tokens", json.dumps({"model": "m"}).encode()),
    }


def test_bad_requests_get_anthropic_errors_and_the_server_keeps_serving(tiny):
    cases = _bad_messages()
    assert len(cases) >= 15
    with httpx.Client(base_url=tiny.url, timeout=60) as http:
        for name, (path, body) in cases.items():
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
            answer = r.json()
            assert answer["type"] == "error", name
            assert set(answer["error"]) == {"type", "message"} and answer["error"]["message"], name
            expected = {404: "not_found_error", 413: "request_too_large"}.get(r.status_code, "invalid_request_error")
            assert answer["error"]["type"] == expected, (name, answer)
        r = http.get("/v1/messages")
        assert r.status_code == 405 and r.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError) as info:
        ask(claude(tiny), "hi", max_tokens=10 * TINY_CTX)
    assert "max_tokens" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude(tiny).messages.create(model="claude-9", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert ask(claude(tiny), "still serving").usage.output_tokens == 16


def test_a_body_over_the_cap_gets_a_413_that_names_the_limit_on_both_apis(tiny):
    limit = tiny.server.config.max_body_bytes
    with pytest.raises(anthropic.APIStatusError) as info:
        ask(claude(tiny), "x" * (2 * limit))
    assert info.value.status_code == 413
    assert info.value.body["error"]["type"] == "request_too_large"
    assert f"{limit:,}" in info.value.body["error"]["message"]
    import openai

    with pytest.raises(openai.APIStatusError) as oinfo:
        client(tiny).chat.completions.create(model="m", max_tokens=4,
                                             messages=[{"role": "user", "content": "y" * (3 * limit)}])
    assert oinfo.value.status_code == 413 and f"{limit:,}" in oinfo.value.body["message"]
    wait_idle(tiny)
    assert ask(claude(tiny), "after the big one").usage.output_tokens == 16


def test_x_api_key_is_accepted_beside_bearer(tiny_path):
    thread = start(tiny_path, max_batch=2, api_key="s3cret")
    try:
        with pytest.raises(anthropic.AuthenticationError) as info:
            ask(claude(thread, "wrong"), "hi")
        assert info.value.body["error"]["type"] == "authentication_error"
        assert ask(claude(thread, "s3cret"), "hi", max_tokens=3).usage.output_tokens == 3
        # either header on either API
        r = httpx.post(thread.url + "/v1/chat/completions", headers={"x-api-key": "s3cret"}, timeout=60,
                       json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
        r = httpx.post(thread.url + "/v1/messages/count_tokens", headers={"authorization": "Bearer s3cret"},
                       json={"model": "m", "messages": [{"role": "user", "content": "x"}]}, timeout=60)
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
    finally:
        thread.stop()


@pytest.mark.slow
def test_smollm2_message_streamed_equals_whole_and_equals_the_openai_answer(smollm2_path):
    thread = start(smollm2_path, max_batch=2, ctx=2048)
    try:
        c = claude(thread)
        whole = ask(c, "What is the capital of France?", max_tokens=24)
        assert "Paris" in whole.content[0].text
        with c.messages.stream(model="m", max_tokens=24, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": "What is the capital of France?"}]) as s:
            assert s.get_final_text() == whole.content[0].text
        openai_answer = client(thread).chat.completions.create(
            model="m", max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert openai_answer.choices[0].message.content == whole.content[0].text
        words = whole.content[0].text.split()
        stop = words[2]
        cut = ask(c, "What is the capital of France?", max_tokens=24, stop_sequences=[stop, "never appears"])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert cut.content[0].text == whole.content[0].text[: whole.content[0].text.index(stop)]
        with c.messages.stream(model="m", max_tokens=24, extra_body={"temperature": 0}, stop_sequences=[stop],
                               messages=[{"role": "user", "content": "What is the capital of France?"}]) as s:
            assert s.get_final_text() == cut.content[0].text
            assert s.get_final_message().stop_sequence == stop
    finally:
        thread.stop()
