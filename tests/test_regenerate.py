"""A regenerated answer reads its prompt as the first answer did, on the real models at K4V4.

The prompt's last tokens share a block with the answer's first ones. The first answer's
prefill left them at float16 in the unfinished block; the answer then filled that block and
quantized it, scales spanning the answer's tokens. A Session that trims back to the prompt
(regenerate, the same question again) must get those rows back as the prompt left them
(`PagedKVCache.keep_exact`), and a trim into a block whose rows nobody kept goes back to the
block's start and computes the rest again (`PagedKVCache.exact_trim_point`)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.engine import Engine
from engine.session import Session

# per model, a question whose second greedy answer differed from the first (from a few tokens
# in) while the trim reopened the prompt's block dequantized
QUESTIONS = {"smollm2-135m-instruct": "How do I boil an egg?", "gemma3-270m": "Name three fruits."}
FILLER = " and then it went on and on"


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine.load(model_path, kv="k4v4")


def _prompt(session: Session, question: str) -> tuple[list[int], int]:
    return session.render([{"role": "user", "content": question}])


def _layer_rows(seq) -> list[tuple]:
    """What later queries read of each layer: the block table (pool ids), the float16 tail's
    rows and the sinks."""
    return [(list(layer.block_table), layer.n_tail, layer.tail_k[:, : layer.n_tail].copy(),
             layer.tail_v[:, : layer.n_tail].copy(), layer.sink_k.copy(), layer.sink_v.copy())
            for layer in seq.layers]


def _answer_tokens(engine: Engine, n: int) -> list[int]:
    ids = engine.tokenizer.encode(FILLER * n, add_bos=False, parse_special=False)[:n]
    assert len(ids) == n
    return ids


def _feed(engine: Engine, seq, tokens: list[int], one_by_one: bool) -> None:
    """An answer's tokens into the cache: decode steps (one token each), or one pass."""
    if one_by_one:
        for t in tokens:
            engine.model.forward([t], seq, "last")
    else:
        engine.model.forward(np.asarray(tokens), seq, "last")


def test_regenerating_a_greedy_answer_gives_the_same_tokens_each_time(engine, model_name):
    question = QUESTIONS[model_name]
    session = Session(engine, ctx=2048)
    ids, _ = _prompt(session, question)
    B = engine.kv_config.block_size
    assert (len(ids) - 1) % B, "the prompt's last tokens share a block with the answer"
    first = session.send(question, max_tokens=64).result
    # the answer filled the prompt's block and the next: the prompt's is not the block that
    # filled last (whose rows the cache keeps for a speculative draft's rollback anyway)
    assert (len(ids) + len(first.ids) - 1) // B >= (len(ids) - 1) // B + 2
    again = [session.regenerate(max_tokens=64).result for _ in range(2)]
    assert [r.stats.cached_tokens for r in again] == [len(ids) - 1] * 2  # trimmed, not a new sequence
    assert [r.ids for r in again] == [first.ids, first.ids]
    asked = session.ask(question, max_tokens=64).result  # the same question outside the conversation
    assert asked.ids == first.ids
    fresh = Session(engine, ctx=2048).send(question, max_tokens=64).result
    assert fresh.ids == first.ids


@pytest.mark.parametrize("one_by_one", [True, False], ids=["decoded", "one-pass"])
def test_a_trim_back_to_the_prompt_leaves_the_rows_the_prompt_left(engine, model_name, one_by_one):
    """After an answer that filled the prompt's block and two more, the trim of the next turn
    with the same prompt leaves every layer as it was when it held the prompt alone, but for its
    last token (prefilled again): the same blocks, tail rows bit for bit, sinks."""
    session = Session(engine, ctx=2048)
    ids, n_prefix = _prompt(session, QUESTIONS[model_name] + " (trim)")
    B = engine.kv_config.block_size
    seq, reused, _ = session.kv.sequence_for(ids, n_prefix)
    engine.prefill(ids[reused:], seq)
    held = _layer_rows(seq)
    _feed(engine, seq, _answer_tokens(engine, 3 * B), one_by_one)
    again, reused, source = session.kv.sequence_for(ids, n_prefix)
    assert (again, reused, source) == (seq, len(ids) - 1, "memory")
    for i, (now, before) in enumerate(zip(_layer_rows(again), held)):
        table, n_tail, tail_k, tail_v, sink_k, sink_v = before
        assert now[0] == table and now[1] == n_tail - 1, i
        for got, want in zip(now[2:], (tail_k[:, :-1], tail_v[:, :-1], sink_k, sink_v)):
            assert np.array_equal(got, want), i
    session.kv.close()


def test_a_trim_into_a_block_nobody_kept_goes_back_to_its_start(engine, model_name):
    """A later prompt that leaves the history inside an answer's block that is neither the
    prompt's (kept) nor the last filled one: that block's float16 rows are gone, so the
    sequence keeps the blocks before it and the rest is prefilled again, rather than reading
    the block's dequantized rows in the unfinished block."""
    session = Session(engine, ctx=2048)
    ids, n_prefix = _prompt(session, QUESTIONS[model_name] + " (edit)")
    B = engine.kv_config.block_size
    seq, reused, _ = session.kv.sequence_for(ids, n_prefix)
    engine.prefill(ids[reused:], seq)
    _feed(engine, seq, _answer_tokens(engine, 3 * B), one_by_one=True)
    middle = ((len(ids) - 1) // B + 1) * B  # the block after the prompt's, filled by the answer
    edited = seq.history[: middle + B // 2] + _answer_tokens(engine, 2)[::-1]
    tables = [list(layer.block_table) for layer in seq.layers]
    again, reused, source = session.kv.sequence_for(edited, n_prefix)
    assert (again, reused, source) == (seq, middle, "memory")
    for layer, table in zip(again.layers, tables):
        assert layer.n_tail == 0 and layer.block_table == table[: middle // B]
    session.kv.close()
