"""`omlx serve --speculate lookup`: prompt-lookup drafts inside the scheduler's decode batches.

The real server in-process (uvicorn on a free port) driven by the `openai` client; the answers of
a server drafting are compared with a server that does not, for requests running one at a time
and several at once (their drafts then share a pass's spare rows with the other sequences' plain
rows). A tiny random model repeats itself, so its drafts are long and mostly accepted; SmolLM2
quoting a document is the real case.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.serve import OpenAIServer, ServeConfig, ServeLimits, ServerThread
from .test_serve import TINY_CTX, client, metric, tiny_path  # noqa: F401 (fixture)

TEXTS = Path(__file__).parent / "data" / "texts"
PROMPTS = ["one two three one two three one two", "the cat sat on the mat, the cat sat", "abc abc abc abc",
           "red green blue red green blue red"]


def start(path, speculate: str, *, kv="full", **limits) -> ServerThread:
    engine = Engine.load(path, kv=kv)
    engine.disk_cache = False
    engine.speculate = speculate
    limits.setdefault("ctx", min(TINY_CTX, engine.model.context_length))
    server = OpenAIServer(engine, ServeLimits(**limits), ServeConfig(port=0, model_id="m"))
    return ServerThread(server).start()


def answer(thread: ServerThread, content: str, max_tokens: int, model: str = "m") -> tuple[str, int, str]:
    """A greedy chat answer: (text, completion tokens, finish reason)."""
    r = client(thread).chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason


def answers_together(thread: ServerThread, prompts: list[str], max_tokens: int,
                     model: str = "m") -> list[tuple[str, int, str]]:
    """`answer` of every prompt, all sent at once (one client thread each)."""
    out: list = [None] * len(prompts)

    def ask(i):
        out[i] = answer(thread, prompts[i], max_tokens, model)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


@pytest.mark.parametrize("kv", ["full", "k4v4"])
def test_tiny_greedy_answers_equal_without_speculation_alone_and_batched(tiny_path, kv):
    off, on = start(tiny_path, "off", kv=kv, max_batch=4), start(tiny_path, "lookup", kv=kv, max_batch=4)
    try:
        expected = [answer(off, p, 40) for p in PROMPTS]
        assert [answer(on, p, 40) for p in PROMPTS] == expected
        drafted_alone = metric(on, "omlx_drafted_tokens_total")
        assert drafted_alone > 0 and metric(on, "omlx_accepted_tokens_total") > 0
        assert metric(off, "omlx_drafted_tokens_total") == 0
        # four at once: the drafts share the rows a pass has beyond one per sequence
        assert answers_together(on, PROMPTS, 40) == expected
        assert metric(on, "omlx_drafted_tokens_total") > drafted_alone
        assert metric(on, "omlx_accepted_tokens_total") <= metric(on, "omlx_drafted_tokens_total")
        assert metric(on, "omlx_running_sequences") == 0
    finally:
        off.stop()
        on.stop()


def test_tiny_a_draft_never_runs_past_max_tokens_or_the_context(tiny_path):
    on = start(tiny_path, "lookup", max_batch=2, ctx=64)
    off = start(tiny_path, "off", max_batch=2, ctx=64)
    try:
        for n in (1, 2, 5):
            assert answer(on, PROMPTS[2], n) == answer(off, PROMPTS[2], n)
            assert answer(on, PROMPTS[2], n)[1] == n
        # a prompt near the 64-token context (54 tokens) asking for all the room left: the
        # answer ends where it ends without drafts
        long = " ".join(["abc"] * 9)
        got = answer(on, long, 10)
        assert got == answer(off, long, 10) and got[2] == "length"
    finally:
        on.stop()
        off.stop()


@pytest.mark.slow
def test_smollm2_quoting_a_document_answers_the_same_with_drafts_accepted(smollm2_path):
    text = (TEXTS / "apache-2.0.txt").read_text()[:3000]
    prompts = [text + "\n\nQuote the paragraph that defines Contribution word for word.",
               text + "\n\nQuote the first sentence of the license exactly."]
    off = start(smollm2_path, "off", max_batch=2, ctx=2048)
    on = start(smollm2_path, "lookup", max_batch=2, ctx=2048)
    try:
        expected = [answer(off, p, 64) for p in prompts]
        assert answers_together(on, prompts, 64) == expected
        assert metric(on, "omlx_accepted_tokens_total") > 10
    finally:
        off.stop()
        on.stop()
