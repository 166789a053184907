"""Several prompts prefilled in one forward pass (`kv.batch.PrefillBatch`, the serve scheduler's
prefill step): each sequence's results are bit-identical to prefilling it alone.

Fast tests use tiny random models (Q8_0 matrices); the ones on SmolLM2 and Gemma3 are slow.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from engine.engine import Engine
from engine.errors import ContextFull
from engine.kv.batch import PrefillBatch
from engine.sampling import SamplingParams
from engine.serve.scheduler import (Failed, Finished, Job, Scheduler, ServeLimits, Started, Token,
                                    min_batched_chunk)
from engine.weights import blas_rows_independent, products_use_blas

from .tiny_gguf import write_tiny_model


@pytest.fixture(autouse=True)
def integer_kernels_at_every_row_count(monkeypatch):
    """Models loaded here take the integer kernels at every row count, as with VNNI: on AVX2 long
    inputs go to float tiles and BLAS for speed (`int_dot.INT_MAX_ROWS`), and where this BLAS
    rounds a row differently with the row count the scheduler then batches no prefill
    (test_weight_arith checks that rule); the batching machinery is what this file tests."""
    from engine.kernels import int_dot

    for isa in int_dot.INT_MAX_ROWS:
        monkeypatch.setitem(int_dot.INT_MAX_ROWS, isa, None)

TINY_CTX = 512
PROMPTS = ["Tell me about cats.", "What is the capital of France?", "Write a haiku about the sea.",
           "Name three colors."]


def tiny_engine(tmp_path, arch="llama", kv="full") -> Engine:
    path = write_tiny_model(tmp_path / f"tiny-{arch}.gguf", arch, context_length=TINY_CTX, weight_type=QT.Q8_0,
                            seed=3)
    engine = Engine.load(path, kv=kv)
    engine.disk_cache = False
    return engine


def assert_batched_prefill_equals_alone(engine: Engine, prefixes, chunks, limit: int) -> None:
    """Sequences holding `prefixes` each append their chunk: alone, one after another, and
    together in a PrefillBatch. Every row's hidden state, each sequence's last-row logits and the next
    decode step after the chunk (so the caches hold the same values) are bit-identical."""
    assert all(len(c) >= min_batched_chunk(engine.model) for c in chunks)  # the scheduler's batching rule
    pc = engine.prefix_cache()
    model = engine.model

    def prefilled():
        seqs = [pc.new_sequence(limit=limit) for _ in prefixes]
        for seq, ids in zip(seqs, prefixes):
            if ids:
                engine.prefill(ids, seq)
        return seqs

    alone_seqs, batch_seqs = prefilled(), prefilled()
    alone = []
    for seq, chunk in zip(alone_seqs, chunks):
        seq.begin_forward(chunk)
        alone.append(model.hidden(chunk, seq))
        seq.end_forward()
    batch = PrefillBatch(batch_seqs, [len(c) for c in chunks])
    tokens = np.concatenate(chunks)
    batch.begin_forward(tokens)
    together = model.hidden(tokens, batch)
    batch.end_forward()
    assert np.array_equal(together, np.concatenate(alone))
    for row, h in zip(batch.last_rows(), alone):  # logits as the scheduler takes them
        assert np.array_equal(model.output(together[row : row + 1]), model.output(h[-1:]))
    assert [s.offset for s in batch_seqs] == [s.offset for s in alone_seqs]
    for a, b in zip(alone_seqs, batch_seqs):
        t = np.array([17])
        assert np.array_equal(model.forward(t, a, "last"), model.forward(t, b, "last"))
    for seq in alone_seqs + batch_seqs:
        seq.release()


@pytest.mark.parametrize("arch,kv", [("llama", "full"), ("llama", "k4v4"), ("gemma3", "full")])
def test_prefill_batch_rows_equal_each_sequence_prefilled_alone(tmp_path, arch, kv):
    # different offsets (empty, inside a 32-token block, on a boundary), chunks crossing blocks
    engine = tiny_engine(tmp_path, arch, kv)
    rng = np.random.default_rng(1)
    prefixes = [[], list(range(40, 75)), [9] * 64, list(range(100, 117))]
    chunks = [rng.integers(3, 200, size=n) for n in (40, 50, 33, 90)]
    assert_batched_prefill_equals_alone(engine, prefixes, chunks, TINY_CTX)


def test_a_prefill_batch_without_room_for_one_sequence_changes_none(tmp_path):
    engine = tiny_engine(tmp_path)
    pc = engine.prefix_cache()
    seqs = [pc.new_sequence(limit=64), pc.new_sequence(limit=TINY_CTX)]
    engine.prefill(list(range(3, 43)), seqs[0])
    before = [s.offset for s in seqs]
    batch = PrefillBatch(seqs, [30, 20])  # 40 + 30 > 64
    with pytest.raises(ContextFull):
        engine.model.forward(np.arange(3, 53), batch, batch.last_rows())
    assert [s.offset for s in seqs] == before
    assert [len(s.token_ids) for s in seqs] == before
    with pytest.raises(ValueError, match="50 new tokens"):
        batch.positions(49)
    with pytest.raises(ValueError, match="at least one token"):
        PrefillBatch(seqs, [3, 0])
    for s in seqs:
        s.release()


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["full", "k4v4"])
def test_smollm2_prefill_batch_equals_each_prompt_prefilled_alone(smollm2_path, kv):
    engine = Engine.load(smollm2_path, kv=kv)
    engine.disk_cache = False
    chats = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    # two sequences start from a conversation already in their cache (a later chunk of a prompt)
    prefixes = [[], chats[1], [], chats[3] + chats[0][1:]]
    chunks = [np.asarray(c) for c in chats[:1]] + [np.asarray(c[1:]) for c in chats[1:]]
    assert_batched_prefill_equals_alone(engine, prefixes, chunks, 2048)


@pytest.mark.slow
def test_gemma3_prefill_batch_equals_each_prompt_prefilled_alone(gemma3_path):
    engine = Engine.load(gemma3_path, kv="full")
    engine.disk_cache = False
    prompts = [engine.encode_prompt(p * 5) for p in PROMPTS]
    if products_use_blas(engine.model) and not blas_rows_independent():
        # Gemma3's layers on the float kernels (a CPU without integer kernels, or OMLX_ARITH=float)
        # multiply long prompts through a BLAS that rounds a row differently with the number of
        # rows (OpenBLAS's Haswell kernels): the scheduler prefills each alone
        assert min_batched_chunk(engine.model) > max(len(p) for p in prompts)
        return
    assert_batched_prefill_equals_alone(engine, [[], prompts[0], [], []], [np.asarray(p) for p in prompts],
                                        2048)


# -- the scheduler ---------------------------------------------------------------------------


class Collector:
    """A job's sink: its events, and an Event set at Finished or Failed."""

    def __init__(self):
        self.events = []
        self.done = threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, (Finished, Failed)):
            self.done.set()

    @property
    def token_ids(self):
        return [e.token_id for e in self.events if isinstance(e, Token)]


def run_together(engine: Engine, prompts, max_tokens: int, on_batch=None, **limits):
    """Submit one greedy job per prompt in one engine-thread turn (so they are admitted and
    prefilled together); returns their collectors, the (cache, tokens) of every prefill pass
    (every `model.hidden` call but those of decode steps, which ask forward for "all" logits)
    and the scheduler's metrics. on_batch(batch) is called before a PrefillBatch's pass."""
    passes = []
    model = engine.model
    real_forward, real_hidden, real_begin = model.forward, model.hidden, PrefillBatch.begin_forward
    decoding = threading.local()

    def forward(tokens, cache, logits_for="last"):
        decoding.on = isinstance(logits_for, str) and logits_for == "all"
        try:
            return real_forward(tokens, cache, logits_for)
        finally:
            decoding.on = False

    def hidden(tokens, cache):
        if not getattr(decoding, "on", False):
            passes.append((cache, len(tokens)))
        return real_hidden(tokens, cache)

    def begin_forward(batch, tokens):
        if on_batch is not None:
            on_batch(batch)
        return real_begin(batch, tokens)

    scheduler = Scheduler(engine, ServeLimits(**limits))
    sinks = [Collector() for _ in prompts]
    jobs = [Job(list(p), max_tokens, SamplingParams(), sink, id=str(i)) for i, (p, sink) in
            enumerate(zip(prompts, sinks))]
    model.forward, model.hidden = forward, hidden
    PrefillBatch.begin_forward = begin_forward
    scheduler.start()
    try:
        scheduler.call(lambda: [scheduler.submit(job) for job in jobs])
        for sink in sinks:
            assert sink.done.wait(300), "a job did not finish"
        assert scheduler.call(scheduler.prefix.sequence_blocks) == 0
    finally:
        scheduler.stop()
        del model.forward, model.hidden
        PrefillBatch.begin_forward = real_begin
    return sinks, passes, scheduler.metrics


@pytest.mark.slow
def test_smollm2_prompts_arriving_together_are_prefilled_together_with_the_same_greedy_tokens(smollm2_path):
    engine = Engine.load(smollm2_path, kv="full")
    engine.disk_cache = False
    prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    assert all(len(p) >= min_batched_chunk(engine.model) for p in prompts)
    expected = [engine.generate(p, max_tokens=24, sampling=SamplingParams()).ids for p in prompts]
    assert len({tuple(e) for e in expected}) == 4
    sinks, passes, metrics = run_together(engine, prompts, 24, ctx=2048, max_batch=4)
    assert [s.token_ids for s in sinks] == expected
    assert all(isinstance(s.events[0], Started) and isinstance(s.events[-1], Finished) for s in sinks)
    assert len(passes) < len(prompts)
    assert sum(n for _, n in passes) == sum(len(p) for p in prompts)
    assert isinstance(passes[0][0], PrefillBatch) and len(passes[0][0].caches) == 4
    assert metrics.prefilled_tokens.value == sum(len(p) for p in prompts)
    assert metrics.prefill_batch_size.count == len(passes)
    assert "omlx_prefill_batch_size_bucket" in metrics.render()


def test_prompts_share_the_prefill_chunk_budget_oldest_first_and_short_chunks_go_alone(tmp_path):
    engine = tiny_engine(tmp_path)
    rng = np.random.default_rng(2)
    # chunks of 60, 5 (short: alone), 50, 40 under a budget of 128 (tiny model: 32 tokens to batch): 60 + 50 in the first pass,
    # then 40 (the 5-token prompt is not the oldest prefilling until the others finish or pass)
    prompts = [list(rng.integers(3, 200, size=n)) for n in (60, 5, 50, 40)]
    expected = [engine.generate(p, max_tokens=6, sampling=SamplingParams()).ids for p in prompts]
    sinks, passes, _ = run_together(engine, prompts, 6, ctx=TINY_CTX, max_batch=4, prefill_chunk=128)
    assert [s.token_ids for s in sinks] == expected
    sizes = [n for _, n in passes]
    assert sizes[0] == 110 and sorted(sizes[1:]) == [5, 40]


def test_a_sequence_without_room_fails_alone_and_the_batch_goes_on(tmp_path):
    engine = tiny_engine(tmp_path)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, 200, size=n)) for n in (40, 50, 35)]
    expected = [engine.generate(p, max_tokens=5, sampling=SamplingParams()).ids for p in prompts]

    def shrink_second(batch):  # as if sequence 1 had reached its context limit
        if len(batch.caches) == 3:
            second = batch.caches[1]
            second.limit = second.offset + 10

    sinks, passes, _ = run_together(engine, prompts, 5, on_batch=shrink_second, ctx=TINY_CTX, max_batch=4)
    assert isinstance(sinks[1].events[-1], Failed) and isinstance(sinks[1].events[-1].error, ContextFull)
    assert [sinks[0].token_ids, sinks[2].token_ids] == [expected[0], expected[2]]
    assert all(isinstance(s.events[-1], Finished) for s in (sinks[0], sinks[2]))
