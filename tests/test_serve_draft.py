"""`omlx serve --draft MODEL`: a draft model's drafts inside the scheduler's decode batches.

The real server in-process (uvicorn on a free port) driven by the `openai` client, and `omlx
serve` as a process for the command line. A model drafting for itself drafts the greedy tokens,
so every drafted token is accepted; another model of the same vocabulary (tiny, random weights)
is mostly rejected, which exercises the rollbacks. Either way greedy answers equal a server's
that does not draft, alone and several at once.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.engine import Engine
from engine.errors import SettingsError
from engine.serve import OpenAIServer, ServeConfig, ServeLimits, ServerThread
from engine.speculate import load_draft
from .serve_process import ROOT, ServeProcess
from .test_serve import CHAT_TEMPLATE, TINY_CTX, client, metric, tiny_path  # noqa: F401 (fixture)
from .test_serve_speculate import PROMPTS, answer, answers_together
from .tiny_gguf import write_tiny_model

from gguf.constants import GGMLQuantizationType as QT

LONG = " ".join(f"item {i} blue," for i in range(20)) + " item 0"  # ~280 tokens: read in chunks


@pytest.fixture(scope="module")
def other_path(tmp_path_factory):
    """A smaller model of tiny_path's vocabulary (other weights): its drafts are mostly rejected."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "tiny-draft.gguf", context_length=TINY_CTX,
                            chat_template=CHAT_TEMPLATE, weight_type=QT.Q8_0, seed=11, n_layers=1,
                            ffn_dim=64, embedding_scale=0.05)


@pytest.fixture(scope="module")
def foreign_path(tmp_path_factory):
    """tiny_path's shape with one more token: another vocabulary."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "tiny-foreign.gguf", context_length=TINY_CTX,
                            chat_template=CHAT_TEMPLATE, weight_type=QT.Q8_0, seed=3, extra_tokens=("Ġcat",))


def start(path, draft=None, *, kv="full", speculate="off", **limits) -> ServerThread:
    engine = Engine.load(path, kv=kv)
    engine.disk_cache = False
    engine.speculate = speculate
    if draft is not None:
        engine.set_draft(load_draft(engine, draft))
    limits.setdefault("ctx", min(TINY_CTX, engine.model.context_length))
    server = OpenAIServer(engine, ServeLimits(**limits), ServeConfig(port=0, model_id="m"))
    return ServerThread(server).start()


def ask(thread: ServerThread, content: str, max_tokens: int, model: str = "m"):
    return client(thread).chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=max_tokens)


def draft_blocks_held(thread: ServerThread) -> int:
    """Pool blocks the draft model's sequences hold (0 once every answer has ended)."""
    scheduler = thread.server.scheduler
    return scheduler.call(lambda: scheduler.drafting.model.prefix.sequence_blocks())


@pytest.mark.parametrize("kv", ["full", "k4v4"])
def test_tiny_drafting_for_itself_accepts_every_token_alone_and_batched(tiny_path, kv):
    off = start(tiny_path, kv=kv, max_batch=4, prefill_chunk=64)
    on = start(tiny_path, tiny_path, kv=kv, max_batch=4, prefill_chunk=64)
    try:
        prompts = PROMPTS + [LONG]
        expected = [answer(off, p, 40) for p in prompts]
        assert [answer(on, p, 40) for p in prompts] == expected
        drafted = metric(on, "omlx_drafted_tokens_total")
        assert drafted > 0 and metric(on, "omlx_accepted_tokens_total") == drafted
        assert metric(off, "omlx_drafted_tokens_total") == 0
        # four at once: the drafts share the rows a pass has beyond one per sequence
        assert answers_together(on, PROMPTS, 40) == expected[: len(PROMPTS)]
        assert metric(on, "omlx_drafted_tokens_total") > drafted
        assert metric(on, "omlx_accepted_tokens_total") == metric(on, "omlx_drafted_tokens_total")
        # the usage of an answer: its drafted tokens, all kept
        usage = ask(on, PROMPTS[0], 40).usage
        details = usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
        assert ask(off, PROMPTS[0], 40).usage.completion_tokens_details is None
        assert metric(on, "omlx_running_sequences") == 0 and draft_blocks_held(on) == 0
        # the draft's pools: the budget's blocks per layer (the same model: the same bytes)
        assert metric(on, "omlx_draft_kv_bytes_capacity") == metric(on, "omlx_kv_bytes_capacity") > 0
        assert metric(off, "omlx_draft_kv_bytes_capacity") == 0
    finally:
        off.stop()
        on.stop()


def test_tiny_another_draft_model_is_mostly_rejected_and_answers_the_same(tiny_path, other_path):
    off = start(tiny_path, max_batch=4)
    on = start(tiny_path, other_path, max_batch=4, speculate="lookup")  # the draft model wins
    try:
        expected = [answer(off, p, 40) for p in PROMPTS]
        assert [answer(on, p, 40) for p in PROMPTS] == expected
        assert answers_together(on, PROMPTS, 40) == expected
        drafted, accepted = metric(on, "omlx_drafted_tokens_total"), metric(on, "omlx_accepted_tokens_total")
        assert drafted > 0 and accepted < drafted  # rejections rolled back, not lookup's drafts
        assert on.server.scheduler.drafting.model is not None and not on.server.scheduler.drafting.lookup
        r = client(on).chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPTS[1]}],
                                               temperature=0, max_tokens=40, n=3)
        assert [c.message.content for c in r.choices] == [expected[1][0]] * 3
        details = r.usage.completion_tokens_details  # every choice's drafts
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
        assert metric(on, "omlx_running_sequences") == 0 and draft_blocks_held(on) == 0
    finally:
        off.stop()
        on.stop()


def test_tiny_a_draft_never_runs_past_max_tokens_the_context_or_the_budget(tiny_path):
    # a budget of one context for two sequences: the second waits, the draft's pools never run short
    on = start(tiny_path, tiny_path, max_batch=2, ctx=64, kv_tokens=64)
    off = start(tiny_path, max_batch=2, ctx=64, kv_tokens=64)
    try:
        for n in (1, 2, 5):
            assert answer(on, PROMPTS[2], n) == answer(off, PROMPTS[2], n)
            assert answer(on, PROMPTS[2], n)[1] == n
        long = " ".join(["abc"] * 9)  # 54 tokens of the 64-token context: it ends where it ends without
        got = answer(on, long, 10)
        assert got == answer(off, long, 10) and got[2] == "length"
        assert answers_together(on, [PROMPTS[0], PROMPTS[3]], 12) == [answer(off, PROMPTS[0], 12),
                                                                      answer(off, PROMPTS[3], 12)]
        assert metric(on, "omlx_accepted_tokens_total") == metric(on, "omlx_drafted_tokens_total") > 0
        assert draft_blocks_held(on) == 0
    finally:
        on.stop()
        off.stop()


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_path, foreign_path):
    engine = Engine.load(tiny_path)
    with pytest.raises(SettingsError, match="vocabulary"):
        load_draft(engine, foreign_path)
    assert engine.draft_engine is None
    # the command line: an error before serving (exit 2), no traceback
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", str(tiny_path), "--port", "0",
                        "--draft", str(foreign_path)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and "vocabulary" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_smollm2_serve_draft_on_the_command_line(smollm2_path, gemma3_path):
    """`omlx serve SmolLM2 --draft SmolLM2`: every greedy token drafted is accepted, the answers
    are those of a server without drafts; Gemma3's vocabulary is refused before serving."""
    prompts = ["Repeat exactly: apple, banana, cherry, date, apple, banana, cherry, date.",
               "Name three colours."]
    off = start(smollm2_path, max_batch=2, ctx=1024)
    try:
        expected = [answer(off, p, 40) for p in prompts]
    finally:
        off.stop()
    with ServeProcess(smollm2_path, "--draft", str(smollm2_path), "--speculate", "lookup", "--ctx", "1024", "--kv", "full",
                      "--max-batch", "2", "--no-disk-cache") as server:
        model = smollm2_path.stem
        assert answers_together(server, prompts, 40, model) == expected
        assert [answer(server, p, 40, model) for p in prompts] == expected
        drafted = metric(server, "omlx_drafted_tokens_total")
        assert drafted > 0 and metric(server, "omlx_accepted_tokens_total") == drafted
    assert server.returncode == 0 and "--speculate lookup is not used" in server.stderr
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", str(smollm2_path), "--port", "0",
                        "--draft", str(gemma3_path)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and "does not have" in r.stderr and "vocabulary" in r.stderr
