"""TokenStream: the per-sequence stream Engine.stream and the serve scheduler both drive."""

from __future__ import annotations

import numpy as np
import pytest

from engine.decoding import LENGTH, STOP, STOP_STRING, TokenStream
from engine.engine import Engine
from engine.sampling import SamplingParams, log_softmax
from engine.serve.scheduler import Finished, Job, Scheduler, ServeLimits, Token


@pytest.fixture(scope="module")
def engine(smollm2_path):
    e = Engine.load(smollm2_path, kv="full")
    e.disk_cache = False
    return e


def one_hot(vocab: int, token: int) -> np.ndarray:
    logits = np.full(vocab, -10.0, np.float32)
    logits[token] = 10.0
    return logits


def ids_of(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_bos=False, parse_special=False)


def test_a_stream_streams_text_and_ends_at_max_tokens(engine):
    vocab = engine.model.vocab_size
    words = ids_of(engine, " one two three")
    stream = TokenStream(engine.tokenizer, [1, 2], max_tokens=len(words))
    texts = []
    for i, token in enumerate(words):
        step = stream.push(one_hot(vocab, token))
        assert step.token == token
        texts.append(step.text)
        assert step.finish_reason == (LENGTH if i == len(words) - 1 else None)
    assert stream.done and stream.generated == words and stream.history == [1, 2] + words
    assert stream.finish() == "" and "".join(texts) == stream.text == " one two three"
    with pytest.raises(RuntimeError):
        stream.push(one_hot(vocab, words[0]))


def test_the_end_of_turn_token_ends_the_stream_without_text(engine):
    vocab = engine.model.vocab_size
    eot = next(iter(engine.tokenizer.stop_ids))
    stream = TokenStream(engine.tokenizer, [1], max_tokens=8)
    stream.push(one_hot(vocab, ids_of(engine, " hi")[0]))
    step = stream.push(one_hot(vocab, eot))
    assert (step.text, step.finish_reason) == ("", STOP)
    assert stream.n_generated == 1 and stream.first_token_at is not None


def test_a_stop_string_across_tokens_cuts_the_text_before_it(engine):
    vocab = engine.model.vocab_size
    words = ids_of(engine, " alpha beta END gamma")
    stream = TokenStream(engine.tokenizer, [1], stop=["END"], max_tokens=32)
    for token in words:
        step = stream.push(one_hot(vocab, token))
        if step.finish_reason:
            break
    assert step.finish_reason == STOP_STRING
    assert stream.finish() == "" and stream.text.rstrip() == " alpha beta"


def test_finish_releases_the_held_back_text_with_the_callers_reason(engine):
    vocab = engine.model.vocab_size
    stream = TokenStream(engine.tokenizer, [1], stop=["the end"], max_tokens=32)
    for token in ids_of(engine, " so the"):
        assert stream.push(one_hot(vocab, token)).finish_reason is None
    assert not stream.text.endswith("the")  # " the" may start the stop string: held back
    tail = stream.finish("cancelled")
    assert stream.finish_reason == "cancelled" and stream.text == " so the" and tail
    with pytest.raises(ValueError):
        TokenStream(engine.tokenizer, [1]).finish()


def test_zero_max_tokens_is_done_before_any_push(engine):
    assert TokenStream(engine.tokenizer, [1], max_tokens=0).finish_reason == LENGTH


def test_processors_see_the_history_and_change_what_is_sampled(engine):
    vocab = engine.model.vocab_size
    banned = ids_of(engine, " no")[0]
    seen = []

    def ban(history, logits):
        seen.append(list(history))
        logits = logits.copy()
        logits[banned] = -np.inf
        return logits

    stream = TokenStream(engine.tokenizer, [5, 6], processors=[ban], max_tokens=4)
    logits = one_hot(vocab, banned)
    logits[7] = 9.0
    assert stream.push(logits).token == 7
    assert stream.push(logits).token == 7
    assert seen == [[5, 6], [5, 6, 7]]


def test_logprobs_are_those_of_the_logits_the_sampler_saw(engine):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(engine.model.vocab_size) * 3).astype(np.float32)
    stream = TokenStream(engine.tokenizer, [1], logprobs=5, max_tokens=4)
    step = stream.push(logits)
    lp = log_softmax(logits[None, :])[0]
    assert step.token == int(np.argmax(logits))
    assert step.logprob.logprob == pytest.approx(lp.max())
    assert [t for t, _ in step.logprob.top] == list(np.argsort(-lp, kind="stable")[:5])
    assert TokenStream(engine.tokenizer, [1]).push(logits).logprob is None


def test_engine_and_scheduler_stream_the_same_tokens_and_text(engine):
    """One stream, two drivers: a window turn and a served request give the same greedy output,
    the same pieces of text and the same finish, with a stop string and with max_tokens."""
    prompt = engine.encode_chat([{"role": "user", "content": "Name three colours."}])
    for stop, max_tokens in (((), 12), ((" and",), 40)):
        gen = engine.stream(prompt, max_tokens=max_tokens, stop=stop)
        chunks = [(c.token_id, c.text) for c in gen]
        result = gen.result
        events = []
        scheduler = Scheduler(engine, ServeLimits(ctx=512, max_batch=2))
        scheduler.start()
        try:
            job = Job(list(prompt), max_tokens, SamplingParams(), events.append, stop=stop, logprobs=2)
            scheduler.submit(job)
            for _ in range(600):
                if events and isinstance(events[-1], Finished):
                    break
                job.cancelled.wait(0.05)
        finally:
            scheduler.stop()
        tokens = [e for e in events if isinstance(e, Token)]
        finished = events[-1]
        assert [t.token_id for t in tokens] == result.ids
        assert "".join(t.text for t in tokens) + finished.text == result.text
        assert [t for _, t in chunks if _ != -1] == [t.text for t in tokens]
        assert all(t.logprob is not None and len(t.logprob.top) == 2 for t in tokens)
        expected = "stop" if result.finish_reason == "stop_string" else result.finish_reason
        assert finished.finish_reason == expected and finished.completion_tokens == len(result.ids)
