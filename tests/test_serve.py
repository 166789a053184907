"""`omlx serve`: the OpenAI-compatible server, driven in-process (uvicorn in a thread on a free
port of 127.0.0.1) by the official `openai` client and by raw HTTP for malformed requests.

Fast tests use tiny random models (tests/tiny_gguf.py); the ones on SmolLM2 are marked slow.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time

import httpx2 as httpx  # the HTTP client the openai package is built on
import numpy as np
import openai
import pytest

from engine.engine import Engine
from engine.serve import OpenAIServer, ServeConfig, ServeLimits, ServerThread
from .tiny_gguf import write_tiny_model

from gguf.constants import GGMLQuantizationType as QT

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY_CTX = 512


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    # Q8_0 matrices: the fused kernels compute each row of a batch as they compute it alone
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "tiny-chat.gguf", context_length=TINY_CTX,
                            chat_template=CHAT_TEMPLATE, weight_type=QT.Q8_0, seed=3)


def start(path, *, kv="full", api_key=None, **limits) -> ServerThread:
    engine = Engine.load(path, kv=kv)
    engine.disk_cache = False
    limits.setdefault("ctx", min(TINY_CTX, engine.model.context_length))
    server = OpenAIServer(engine, ServeLimits(**limits), ServeConfig(port=0, api_key=api_key, model_id="m"))
    return ServerThread(server).start()


@pytest.fixture(scope="module")
def tiny(tiny_path):
    thread = start(tiny_path, max_batch=4)
    yield thread
    thread.stop()


def client(thread: ServerThread, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=thread.url + "/v1", api_key=key, max_retries=0, timeout=120)


def metric(thread: ServerThread, name: str, labels: str = "") -> float:
    text = httpx.get(thread.url + "/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_idle(thread: ServerThread, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(thread, "omlx_running_sequences") or metric(thread, "omlx_queue_length"):
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)


def chat(c, content, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 16)
    return c.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], **kw)


# -- the API ---------------------------------------------------------------------------------
def test_models_health_and_metrics(tiny):
    c = client(tiny)
    assert [m.id for m in c.models.list().data] == ["m"]
    assert httpx.get(tiny.url + "/health").json()["status"] == "ok"
    chat(c, "hello")
    text = httpx.get(tiny.url + "/metrics").text
    for name in ("omlx_requests_total", "omlx_generated_tokens_total", "omlx_ttft_seconds_bucket",
                 "omlx_kv_bytes_in_use", "omlx_kv_bytes_capacity", "omlx_prefix_cache_hit_ratio",
                 "omlx_queue_length", "omlx_prefill_batch_size_bucket", "omlx_prefilled_tokens_total",
                 "omlx_prefill_seconds_total"):
        assert name in text
    assert metric(tiny, "omlx_ttft_seconds_count") >= 1
    assert metric(tiny, "omlx_kv_bytes_capacity") > 0
    assert metric(tiny, "omlx_prefill_batch_size_count") >= 1 and metric(tiny, "omlx_prefilled_tokens_total") > 0


def test_chat_streams_a_role_chunk_deltas_a_finish_reason_and_usage(tiny):
    # (a random tiny model repeats one token: the streamed text itself is checked on SmolLM2)
    c = client(tiny)
    whole = chat(c, "the streaming check", max_tokens=24)
    stream = chat(c, "the streaming check", max_tokens=24, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    pieces = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert not chunks[-1].choices
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens == 24
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    # max_completion_tokens is max_tokens' newer name; with both, the smaller holds
    assert chat(c, "x", max_tokens=None, max_completion_tokens=5).usage.completion_tokens == 5
    assert chat(c, "x", max_tokens=9, max_completion_tokens=3).usage.completion_tokens == 3


@pytest.mark.parametrize("arch,kv", [("llama", "full"), ("llama", "k4v4"), ("llama", "k6v4"), ("gemma3", "full")])
def test_decode_batch_rows_equal_each_sequence_decoded_alone(tmp_path, monkeypatch, arch, kv):
    """The batched step's hidden states (before the output layer) are bit-identical to each
    sequence's own decode step, at different positions and over shared pools (quantized KV and
    gemma3's sliding-window layers included); the batch's attention is one call per layer for
    all the sequences (`DecodeKernel.attend_many`)."""
    from engine.kv.batch import DecodeBatch
    from engine.kv import paged_attention
    from engine.kv.paged_attention import DecodeKernel

    many_calls = []
    attend_many = DecodeKernel.attend_many

    def counted(self, views, **kw):
        many_calls.append(len(views))
        return attend_many(self, views, **kw)

    monkeypatch.setattr(DecodeKernel, "attend_many", counted)
    monkeypatch.setattr(paged_attention, "TOGETHER_MIN_TOKENS", 0)  # these short sequences too

    path = write_tiny_model(tmp_path / f"tiny-{arch}.gguf", arch, context_length=TINY_CTX,
                            chat_template=CHAT_TEMPLATE, weight_type=QT.Q8_0, seed=3)
    engine = Engine.load(path, kv=kv)
    engine.disk_cache = False
    prompts = [[5, 6, 7], list(range(40, 90)), [9] * 33, list(range(100, 117))]
    pc = engine.prefix_cache()

    def prefilled():
        seqs = [pc.new_sequence(limit=TINY_CTX) for _ in prompts]
        for seq, ids in zip(seqs, prompts):
            engine.prefill(ids, seq)
        return seqs

    alone_seqs, batch_seqs = prefilled(), prefilled()
    rng = np.random.default_rng(0)
    for _ in range(40):  # crosses block boundaries (32 tokens) in every sequence
        tokens = rng.integers(3, 200, size=len(prompts))
        alone = []
        for seq, t in zip(alone_seqs, tokens):
            seq.begin_forward(np.array([t]))
            alone.append(engine.model.hidden(np.array([t]), seq)[0])
            seq.end_forward()
        batch = DecodeBatch(batch_seqs)
        batch.begin_forward(tokens)
        together = engine.model.hidden(tokens, batch)
        batch.end_forward()
        assert np.array_equal(together, np.stack(alone))
    assert [s.offset for s in batch_seqs] == [s.offset for s in alone_seqs]
    assert many_calls.count(len(prompts)) >= 40 * engine.model.n_layers  # every layer of every step
    for seq in alone_seqs + batch_seqs:
        seq.release()


def test_completions_from_text_and_from_token_ids(tiny):
    c = client(tiny)
    engine = tiny.server.engine
    r = c.completions.create(model="m", prompt="the cat sat", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 12
    ids = engine.encode_prompt("the cat sat")
    r2 = c.completions.create(model="m", prompt=ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == r.choices[0].text
    assert r2.usage.prompt_tokens == r.usage.prompt_tokens == len(ids)


def test_a_resent_conversation_and_a_shared_system_prompt_come_from_the_prefix_cache(tiny):
    c = client(tiny)
    system = "You are a careful assistant. " * 12  # several 32-token blocks
    first = c.chat.completions.create(model="m", temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "first question"}])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # another client, the same system prompt: its blocks are shared
    other = c.chat.completions.create(model="m", temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "a different question"}])
    assert other.usage.prompt_tokens_details.cached_tokens >= 64
    # the first client resends its conversation with the answer and a new question
    again = c.chat.completions.create(model="m", temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "first question"},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and then?"}])
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 32 and cached % 32 == 0
    assert metric(tiny, "omlx_prefix_cache_hit_ratio") > 0


def batched_steps(thread: ServerThread) -> float:
    """Decode steps with more than one sequence so far."""
    return metric(thread, "omlx_decode_batch_size_count") - metric(thread, "omlx_decode_batch_size_bucket",
                                                                   '{le="1"}')


# -- bad requests ----------------------------------------------------------------------------
_DROP = object()  # body_with(field=_DROP) leaves the field out


def body_with(ok: dict, **fields) -> bytes:
    """`ok` with some fields replaced or (given _DROP) removed, as JSON."""
    body = dict(ok)
    for k, v in fields.items():
        if v is _DROP:
            body.pop(k)
        else:
            body[k] = v
    return json.dumps(body).encode()


def _bad_requests():
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    long_text = "word " * 2000

    def chat_with(**fields):
        return ("POST", "/v1/chat/completions", body_with(ok, **fields))

    return {
        "not JSON": ("POST", "/v1/chat/completions", b"{not json"),
        "JSON array": ("POST", "/v1/chat/completions", b"[1, 2]"),
        "empty body": ("POST", "/v1/chat/completions", b""),
        "not UTF-8": ("POST", "/v1/chat/completions", b'{"model": "\xff"}'),
        "no model": chat_with(model=_DROP),
        "unknown model": chat_with(model="gpt-9"),
        "model not a string": chat_with(model=5),
        "no messages": chat_with(messages=_DROP),
        "messages not a list": chat_with(messages="hi"),
        "empty messages": chat_with(messages=[]),
        "bad role": chat_with(messages=[{"role": "wizard", "content": "hi"}]),
        "content a number": chat_with(messages=[{"role": "user", "content": 3}]),
        "image content": chat_with(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "max_tokens a string": chat_with(max_tokens="10"),
        "max_tokens zero": chat_with(max_tokens=0),
        "max_tokens past the context": chat_with(max_tokens=10 * TINY_CTX),
        "temperature too high": chat_with(temperature=5),
        "temperature a string": chat_with(temperature="hot"),
        "top_p zero": chat_with(top_p=0),
        "n=9": chat_with(n=9),
        "n=0": chat_with(n=0),
        "n=2 streamed": chat_with(n=2, stream=True),
        "five stop strings": chat_with(stop=["a", "b", "c", "d", "e"]),
        "stop a number": chat_with(stop=7),
        "stream a string": chat_with(stream="yes"),
        "seed a float": chat_with(seed=1.5),
        "negative seed": chat_with(seed=-1),
        "temperature NaN": ("POST", "/v1/chat/completions",
                            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
        "stream_options without stream": chat_with(stream_options={"include_usage": True}),
        "prompt longer than the context": chat_with(messages=[{"role": "user", "content": long_text}]),
        "body too large": ("POST", "/v1/chat/completions", b'{"model": "m", "pad": "' + b"x" * (5 << 20) + b'"}'),
        "completion without prompt": ("POST", "/v1/completions", json.dumps({"model": "m"}).encode()),
        "token id outside the vocabulary": ("POST", "/v1/completions",
                                            json.dumps({"model": "m", "prompt": [1, 10 ** 9]}).encode()),
        "two prompts": ("POST", "/v1/completions", json.dumps({"model": "m", "prompt": ["a", "b"]}).encode()),
        "unknown route": ("GET", "/v1/nothing", None),
        "wrong method": ("GET", "/v1/chat/completions", None),
    }


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(tiny):
    cases = _bad_requests()
    assert len(cases) >= 20
    with httpx.Client(base_url=tiny.url, timeout=60) as http:
        for name, (method, path, body) in cases.items():
            r = http.request(method, path, content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert error["message"], name
        assert http.get("/health").status_code == 200
    assert chat(client(tiny), "still serving").usage.completion_tokens == 16


def test_errors_name_the_field(tiny):
    with httpx.Client(base_url=tiny.url) as http:
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                     "temperature": "hot"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": "word " * 2000}]})
        assert r.json()["error"]["code"] == "context_length_exceeded"


# -- KV budget, disconnects, security --------------------------------------------------------
def test_disconnecting_clients_leave_kv_in_use_at_its_baseline(tiny):
    scheduler = tiny.server.scheduler
    wait_idle(tiny)
    baseline = scheduler.call(lambda: (scheduler.prefix.clear(), scheduler.prefix.nbytes)[1])
    assert scheduler.call(scheduler.prefix.sequence_blocks) == 0
    cancelled_before = metric(tiny, "omlx_finished_sequences_total", '{reason="cancelled"}')
    rng = random.Random(5)
    plan = [(i, rng.choice(["complete", "stream_then_leave", "leave_early"]), rng.randint(1, 60))
            for i in range(200)]
    failures = []

    def worker(items):
        with httpx.Client(base_url=tiny.url) as http:
            for i, how, max_tokens in items:
                body = {"model": "m", "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
                        "messages": [{"role": "user", "content": f"request {i} " + "x" * (i % 50)}]}
                try:
                    if how == "complete":
                        r = http.post("/v1/chat/completions", json=body, timeout=120)
                        if r.status_code != 200:
                            failures.append((i, r.status_code, r.text))
                    elif how == "stream_then_leave":
                        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                                         timeout=120) as r:
                            for n, _ in enumerate(r.iter_lines()):
                                if n >= 2:
                                    break
                    else:
                        http.post("/v1/chat/completions", json={**body, "max_tokens": 400}, timeout=0.05)
                except httpx.TimeoutException:
                    pass

    threads = [threading.Thread(target=worker, args=(plan[k::8],)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    wait_idle(tiny)
    assert metric(tiny, "omlx_finished_sequences_total", '{reason="cancelled"}') > cancelled_before
    assert scheduler.call(scheduler.prefix.sequence_blocks) == 0
    after = scheduler.call(lambda: (scheduler.prefix.clear(), scheduler.prefix.nbytes)[1])
    assert after == baseline
    assert chat(client(tiny), "after the storm").usage.completion_tokens == 16


def test_a_request_waits_for_kv_budget_then_gets_429_and_the_running_one_finishes(tiny_path):
    # one sequence's worth of KV: while the first request holds it, the second cannot start. The
    # tiny model finishes the first request's 472 tokens in well under a tenth of a second, which
    # would free the budget before the second's wait ends: the engine thread is held between two
    # steps (`Scheduler.call`) from the first request's start until the second has waited past
    # its timeout, whatever the speed of the machine.
    thread = start(tiny_path, max_batch=4, kv_tokens=TINY_CTX, queue_timeout=0.05)
    scheduler = thread.server.scheduler
    try:
        c = client(thread)

        def hold():  # on the engine thread, the first request running
            deadline = time.monotonic() + 60
            while not scheduler._inbox and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.2)

        long_stream = chat(c, "go on", max_tokens=TINY_CTX - 40, stream=True)  # admitted
        held = threading.Thread(target=scheduler.call, args=(hold,), kwargs={"timeout": 120})
        held.start()
        first = next(iter(long_stream))
        assert first.choices[0].delta.role == "assistant"
        with pytest.raises(openai.RateLimitError) as info:
            chat(c, "me too", max_tokens=TINY_CTX - 40)
        held.join()
        assert info.value.response.headers["retry-after"]
        assert info.value.response.json()["error"]["code"] == "kv_budget_exhausted"
        reasons = [ch.choices[0].finish_reason for ch in long_stream if ch.choices]
        assert reasons[-1] == "length"  # the running request was never failed for KV
        assert chat(c, "my turn", max_tokens=8).usage.completion_tokens == 8
    finally:
        thread.stop()


def test_api_key_is_required_when_set(tiny_path):
    thread = start(tiny_path, max_batch=2, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            client(thread, "wrong").models.list()
        assert httpx.get(thread.url + "/v1/models").status_code == 401
        assert httpx.get(thread.url + "/health").status_code == 200
        assert chat(client(thread, "s3cret"), "hi", max_tokens=4).usage.completion_tokens == 4
    finally:
        thread.stop()


def test_serving_beyond_localhost_without_a_key_is_refused_before_loading(capsys, tmp_path):
    from engine import cli

    missing = tmp_path / "never-read.gguf"
    assert cli.main(["serve", str(missing), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "0.0.0.0" in err
    with pytest.raises(Exception):
        ServeConfig(host="192.168.1.5").validate()
    ServeConfig(host="::1").validate()
    ServeConfig(host="0.0.0.0", api_key="k").validate()


# -- SmolLM2 -----------------------------------------------------------------------------------
PROMPTS = ["Tell me about cats.", "What is the capital of France?", "Write a haiku about the sea.",
           "Name three colors."]


@pytest.fixture(scope="module")
def smol(smollm2_path):
    thread = start(smollm2_path, max_batch=4, ctx=2048)
    yield thread
    thread.stop()


@pytest.mark.slow
def test_smollm2_greedy_text_equals_omlx_generate_alone_and_in_a_batch_of_four(smol, smollm2_path, capsys):
    from engine import cli

    expected = []
    for p in PROMPTS:
        assert cli.main(["generate", str(smollm2_path), "--prompt", p, "--chat", "--json", "--max-tokens", "32",
                         "--kv", "full"]) == 0
        expected.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert len({e["text"] for e in expected}) == 4
    c = client(smol)
    alone = chat(c, PROMPTS[0], max_tokens=32)
    assert alone.choices[0].message.content == expected[0]["text"]
    assert alone.usage.completion_tokens == len(expected[0]["ids"])
    before = batched_steps(smol)
    results = [None] * 4
    barrier = threading.Barrier(4)

    def ask(i):
        barrier.wait()
        results[i] = chat(c, PROMPTS[i], max_tokens=32)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.choices[0].message.content for r in results] == [e["text"] for e in expected]
    assert [r.usage.completion_tokens for r in results] == [len(e["ids"]) for e in expected]
    assert batched_steps(smol) > before  # some steps decoded several sequences together


@pytest.mark.slow
def test_smollm2_streamed_text_equals_the_whole_answer(smol):
    c = client(smol)
    whole = chat(c, PROMPTS[2], max_tokens=24)
    stream = chat(c, PROMPTS[2], max_tokens=24, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == \
        whole.choices[0].message.content
    completion = client(smol).completions.create(model="m", prompt="The capital of France is", max_tokens=8,
                                                 temperature=0)
    streamed = client(smol).completions.create(model="m", prompt="The capital of France is", max_tokens=8,
                                               temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == completion.choices[0].text
    assert "Paris" in completion.choices[0].text


@pytest.mark.slow
def test_smollm2_stop_strings_and_seeded_sampling(smol):
    c = client(smol)
    base = chat(c, PROMPTS[3], max_tokens=24).choices[0].message.content
    words = base.split()
    assert len(words) >= 4
    cut = words[2]
    stopped = chat(c, PROMPTS[3], max_tokens=24, stop=[cut, "zzzz"])
    assert stopped.choices[0].message.content == base[: base.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"
    a = chat(c, PROMPTS[0], temperature=1.0, top_p=0.95, seed=7, max_tokens=16).choices[0].message.content
    b = chat(c, PROMPTS[0], temperature=1.0, top_p=0.95, seed=7, max_tokens=16).choices[0].message.content
    others = {chat(c, PROMPTS[0], temperature=1.0, seed=s, max_tokens=16).choices[0].message.content
              for s in (1, 2, 3)}
    assert a == b and len(others | {a}) > 1


@pytest.mark.slow
def test_smollm2_resent_conversation_reuses_the_cached_prefix(smol):
    c = client(smol)
    first = chat(c, PROMPTS[1], max_tokens=24)
    messages = [{"role": "user", "content": PROMPTS[1]},
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And of Italy?"}]
    again = c.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


@pytest.mark.slow  # starts a process
def test_omlx_serve_runs_from_the_command_line_and_stops_on_ctrl_c(tiny_path):
    from .serve_process import ServeProcess

    with ServeProcess(tiny_path, "--kv", "full", "--ctx", "256", "--max-batch", "2") as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny-chat"]  # the file's stem
        r = c.completions.create(model="tiny-chat", prompt="the cat", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    assert server.returncode == 0, server.stderr


def test_an_engine_failure_fails_the_running_request_and_the_engine_thread_goes_on(tiny_path):
    thread = start(tiny_path, max_batch=2)
    try:
        model = thread.server.engine.model
        real_forward = model.forward
        calls = {"n": 0}

        def failing_once(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected failure")
            return real_forward(*args, **kwargs)

        model.forward = failing_once
        r = httpx.post(thread.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "internal" and "injected failure" in r.json()["error"]["message"]
        assert chat(client(thread), "again", max_tokens=4).usage.completion_tokens == 4
        scheduler = thread.server.scheduler
        wait_idle(thread)
        assert scheduler.call(scheduler.prefix.sequence_blocks) == 0
    finally:
        thread.stop()
