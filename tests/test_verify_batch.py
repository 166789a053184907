"""A draft verified in one pass (`kv.batch.VerifyBatch`): every row's logits bit-equal to decoding
that token alone, and a rollback that leaves the cache equal to one that never held the rejected
tokens, across a block boundary, under each overflow policy and with sliding-window layers.
What speculative decoding's identical greedy output rests on."""

from __future__ import annotations

import numpy as np
import pytest

from engine.engine import Engine
from engine.kv.batch import VerifyBatch
from engine.kv.config import parse_kv

PROMPT = ("The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun all day, "
          "and the quick brown fox")
DRAFT_TEXT = " jumps over the lazy dog. The lazy dog sleeps"


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def engine(request, smollm2_path, gemma3_path):
    return Engine.load(smollm2_path if request.param == "smollm2" else gemma3_path, kv="k6v4")


def _cache(engine: Engine, kv: str, overflow: str | None):
    if overflow is None:
        return engine.new_cache(kv)
    # a context limit far away: the policy's bookkeeping (attention mass) runs, nothing drops
    return engine.model.new_cache(parse_kv(kv), max_tokens=4096, limit=4096, overflow=overflow)


def _layer_state(layer) -> dict:
    """What later queries of a layer read: positions, the float tail, the blocks' stored values,
    the sinks and the attention mass."""
    k, v = layer.pool.dequantize(layer.block_table) if layer.block_table else (np.zeros(0), np.zeros(0))
    return {
        "offset": layer.offset, "n_tail": layer.n_tail, "first": layer.first_position,
        "tail_k": layer.tail_k[:, : layer.n_tail].copy(), "tail_v": layer.tail_v[:, : layer.n_tail].copy(),
        "blocks_k": np.asarray(k), "blocks_v": np.asarray(v),
        "sink_k": layer.sink_k.copy(), "sink_v": layer.sink_v.copy(),
        "mass": layer.attn_mass[: layer.offset].copy(),
    }


def _assert_same_cache(a, b) -> None:
    assert a.token_ids == b.token_ids and a.history == b.history
    assert a.chain_keys == b.chain_keys
    for i, (la, lb) in enumerate(zip(a.layers, b.layers)):
        sa, sb = _layer_state(la), _layer_state(lb)
        for key in sa:
            assert np.array_equal(sa[key], sb[key]), (i, key)


def _prefilled(engine: Engine, ids, kv: str, overflow: str | None):
    cache = _cache(engine, kv, overflow)
    logits = engine.prefill(ids, cache)
    return cache, logits


def test_every_verified_row_equals_the_token_decoded_alone(engine):
    ids = engine.encode_prompt(PROMPT)
    draft = engine.encode_prompt(DRAFT_TEXT)[:8]
    alone, _ = _prefilled(engine, ids, "k6v4", None)
    rows = [engine.model.forward([t], alone, "last")[0] for t in draft]
    together, _ = _prefilled(engine, ids, "k6v4", None)
    batch = VerifyBatch(together)
    out = engine.model.forward(draft, batch, "all")
    batch.finish(0)
    for i, row in enumerate(rows):
        assert np.array_equal(out[i], row), i
    _assert_same_cache(together, alone)


@pytest.mark.parametrize("n_draft", [2, 4, 7])
def test_rows_inside_one_block_attend_in_one_call_and_equal_decoding_alone(engine, n_draft):
    """A draft that fills no block attends all its rows in one compiled call
    (`PagedAttention.attend_rows`); each row still equals its decode step alone, bit for bit."""
    from engine.kernels import background
    from engine.kv.paged_attention import PagedAttention

    background.wait(timeout=600)  # the compiled paths, not the numpy reference
    ids = engine.encode_prompt(PROMPT + " " + PROMPT)
    B = parse_kv("k6v4").block_size
    ids = ids[: len(ids) - (len(ids) % B) + 1]  # one token into a block: the rows fit in it
    draft = engine.encode_prompt(DRAFT_TEXT)[:n_draft]
    alone, _ = _prefilled(engine, ids, "k6v4", None)
    rows = [engine.model.forward([t], alone, "last")[0] for t in draft]
    together, _ = _prefilled(engine, ids, "k6v4", None)
    calls = []
    original = PagedAttention.attend_rows

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(out is not None)
        return out

    PagedAttention.attend_rows = counted
    try:
        batch = VerifyBatch(together)
        out = engine.model.forward(draft, batch, "all")
    finally:
        PagedAttention.attend_rows = original
    batch.finish(0)
    assert calls and all(calls)  # every layer took the one-call path
    for i, row in enumerate(rows):
        assert np.array_equal(out[i], row), i
    _assert_same_cache(together, alone)
    # and rolled back after it, as if never held
    batch = VerifyBatch(together)
    engine.model.forward(draft, batch, "all")
    batch.finish(len(draft))
    _assert_same_cache(together, alone)


@pytest.mark.parametrize("kv, overflow", [("k6v4", None), ("full", None), ("k4v4", "rolling"),
                                          ("k4v4", "attention")])
def test_a_rolled_back_draft_leaves_the_cache_as_if_never_held(engine, kv, overflow):
    ids = engine.encode_prompt(PROMPT)
    block = engine.kv_config.block_size
    # the prompt ends 3 tokens before a block boundary: an 8-token draft fills that block and
    # starts the next one; keeping 2 of its rows trims back into the block it filled
    pad = (block - 3 - len(ids)) % block
    ids = ids + engine.encode_prompt(" and" * 4 * block)[:pad]
    assert (len(ids) + 3) % block == 0
    draft = engine.encode_prompt(DRAFT_TEXT)[:8]
    assert len(draft) == 8
    for keep in (2, 5, 8):
        reference, _ = _prefilled(engine, ids, kv, overflow)
        for t in draft[:keep]:
            engine.model.forward([t], reference, "last")
        verified, _ = _prefilled(engine, ids, kv, overflow)
        batch = VerifyBatch(verified)
        engine.model.forward(draft, batch, "all")
        batch.finish(len(draft) - keep)
        _assert_same_cache(verified, reference)
        # and the next step reads the same cache: the same logits, bit for bit
        nxt = draft[0]
        assert np.array_equal(engine.model.forward([nxt], verified, "last"),
                              engine.model.forward([nxt], reference, "last"))
        verified.release()
        reference.release()


def test_a_draft_that_would_need_a_drop_is_refused_before_anything_changes(engine):
    from engine.errors import ContextFull

    ids = engine.encode_prompt(PROMPT)
    cache, _ = _prefilled(engine, ids, "k6v4", None)
    cache.limit, cache.overflow = len(ids) + 2, "rolling"
    assert VerifyBatch.room(cache) == 2
    with pytest.raises(ContextFull):
        engine.model.forward(engine.encode_prompt(DRAFT_TEXT)[:4], VerifyBatch(cache), "all")
    assert cache.offset == len(ids) and cache.token_ids == list(ids)
