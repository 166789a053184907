"""Continuous batching in one engine thread.

Request handlers (any thread, usually the asyncio loop) `submit` a `Job` and receive its events
through the job's `sink`, which the engine thread calls; `cancel` (or the job's own `cancelled`
event) stops it at the next token boundary and frees its blocks. Only the engine thread touches
the model, the caches and the prefix cache.

One turn of the loop:

    1. take new jobs; drop cancelled ones; answer jobs that waited past `queue_timeout` for room
       with QueueTimeout (the HTTP layer's 429)
    2. admit waiting jobs in arrival order while there is a free slot (`max_batch` sequences)
       and the KV budget holds their worst case (below); an admitted job starts on the longest
       cached prefix of its prompt (the prefix cache), the rest is left to prefill
    3. one prefill step: the next chunk of the oldest admitted job still prefilling, with the
       next chunks of the prefilling jobs admitted after it while they fit in `prefill_chunk`
       tokens in all (min_batched_chunk below), in one forward pass (`kv.batch.PrefillBatch`: the
       linear layers see every chunk's rows, one pass over the weights; attention per sequence),
       so that prompts arriving together stall the running streams once, not once each. Chunks
       between decode steps keep running streams flowing; a job's last chunk samples its first
       token
    4. one decode step for every sequence past prefill: their tokens go through the model
       together (`kv.batch.DecodeBatch`: the linear layers see one row per sequence, one pass over
       the weights for up to DECODE_GROUP sequences), each samples its next token; finished
       sequences release their blocks. With prompt lookup (`speculate="lookup"`) or a draft
       model (`engine.draft_engine`), the rows a pass has left over (DECODE_GROUP less one per
       sequence) go to the sequences' drafts (`drafts.Drafts`): sequence i appends its token and
       its draft (`kv.batch.VerifyBatch`, every row equal to a decode step alone) in the same
       pass (`kv.batch.SequenceBatch`), keeps the rows its stream accepts and rolls the rest back

KV budget (`budget.KVBudget`): every pool has `max_blocks`. An admitted sequence reserves the
blocks of its worst case, prompt + max_tokens tokens, and is admitted while the reservations fit
in `max_blocks` less the blocks pinned in the prefix cache; a running sequence never lacks KV
memory, a new one waits instead.

Saved prefixes: with the engine's `disk_cache` on, a job's `prefix_tokens` (the system turn) are
saved to the prefix cache's disk store once its prompt is prefilled, if they are not saved yet:
the engine thread copies the blocks out of the pools between steps and a `PrefixSaver` thread
writes the file, so a save (or a full disk) never holds up the streams. A new server on the same
cache folder loads them when a prompt starts with them (`PrefixCache.attach`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..engine import Engine
from ..errors import ContextFull, EngineError, KVPoolFull, OmlxError
from ..kv.batch import DecodeBatch, PrefillBatch, SequenceBatch, VerifyBatch
from ..memory import release_free_heap
from ..prefix_store import PrefixSaver
from ..decoding import STOP, STOP_STRING, LogitsProcessor, TokenLogprob, TokenStream
from ..sampling import SamplingParams
from ..speculate import SPECULATE_MODES, agreed_tokens
from ..weights import blas_rows_independent, products_use_blas
from .budget import KVBudget
from .drafts import Drafts
from .metrics import Metrics

log = logging.getLogger("omlx.serve")

IDLE_WAIT_S = 0.05  # how long an idle engine thread sleeps before looking at queue deadlines again
# Sequences per forward pass of a decode step: rows that both kinds of linear layer compute
# exactly as they compute each alone (quantized matrices: the fused kernels; float32 ones: one
# product per row), so greedy output is the same alone or in a batch. A larger batch is decoded in
# several passes of this many rows; BLAS (the path for more rows) would round differently.
DECODE_GROUP = Engine.exact_batch_rows()
# Prefill batches. A sequence's chunk joins another's forward pass only when the chunk alone
# would be multiplied by the same kernels as inside the batch, so that its rows come out
# bit-identical (greedy output the same as prefilled alone):
# - more than Engine.rows_computed_alone() rows (QuantLinear.MATVEC_MAX_ROWS and
#   DenseLinear.MAX_ROWS_ALONE): fewer go through the fused matvec kernels (or one product per row), which round differently from the dequantized tiles +
#   BLAS that the batch's many rows take (whichever layout the product takes,
#   `weights.TRANSPOSED_PRODUCT_MAX_ROWS`: both give the same bits);
# - and enough rows that no linear layer's product is "small" for OpenBLAS (numpy's BLAS), which
#   takes other code paths, summing in another order, for products of up to about a thousand
#   output values (rows x output features). Past that, a row's sums do not depend on how many
#   rows there are. The narrowest layers are the K and V projections (n_kv_heads x head_dim
#   features); SMALL_GEMM_OUTPUTS leaves a margin above that bound.
# A shorter chunk is prefilled by itself, as before batching.
SMALL_GEMM_OUTPUTS = 2048


def min_batched_chunk(model) -> int:
    """The fewest tokens a sequence's prefill chunk needs to join a batch (see above); more than
    any chunk has (no prefill batching) where this BLAS rounds a row differently with the number
    of rows (`weights.blas_rows_independent`) and some layer of the model multiplies through it."""
    if not blas_rows_independent() and products_use_blas(model):
        return 1 << 62
    narrowest = model.n_kv_heads * min(model.head_dim, model.value_dim)
    return max(Engine.rows_computed_alone() + 1, -(-SMALL_GEMM_OUTPUTS // narrowest))


def prefill_together(model, caches: list, chunks: list) -> tuple[np.ndarray, np.ndarray]:
    """One forward pass over the next chunk of every cache (`kv.batch.PrefillBatch`): the final
    hidden states of all the chunks' tokens, concatenated (n_tokens, dim), and the row of each
    chunk's last token. ContextFull / KVPoolFull leave every cache unchanged."""
    batch = PrefillBatch(caches, [len(c) for c in chunks])
    tokens = np.concatenate([np.asarray(c, np.int64) for c in chunks])
    batch.begin_forward(tokens)
    h = model.hidden(tokens, batch)
    batch.end_forward()
    return h, batch.last_rows()


class QueueTimeout(OmlxError):
    """A request waited `queue_timeout` seconds without a free slot or KV budget."""

    kind = "queue_timeout"


# -- events the engine thread sends to a job's sink ---------------------------------------------
@dataclass
class Started:
    """Admitted: `cached_tokens` of the prompt come from the prefix cache."""

    cached_tokens: int


@dataclass
class Token:
    token_id: int
    text: str  # text this token completes (may be empty: an unfinished UTF-8 character, a held stop)
    logprob: TokenLogprob | None = None  # with Job.logprobs


@dataclass
class Finished:
    finish_reason: str  # "stop", "length" (max_tokens or the context), "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str  # any text held back until the end (the stream decoder's and stop matcher's rest)
    ttft_s: float | None
    stop_string: str | None = None  # the stop string that ended the answer
    drafted_tokens: int = 0  # speculative decoding: tokens drafted for this answer
    accepted_tokens: int = 0  # of those, the ones kept


@dataclass
class Failed:
    error: BaseException


@dataclass
class Job:
    """One request for the scheduler. `sink` is called on the engine thread with Started, Token...,
    then exactly one Finished or Failed; it must not block."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    sink: Callable[[object], None]
    stop: tuple[str, ...] = ()
    id: str = ""
    processors: tuple[LogitsProcessor, ...] = ()  # per-sequence logits processors (decoding.TokenStream)
    logprobs: int | None = None  # top log-probabilities each Token carries (None: none)
    prefix_tokens: int = 0  # leading prompt tokens worth saving to disk once prefilled (the system turn)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class ServeLimits:
    """Scheduler settings: `ctx` tokens per sequence (prompt + generated), at most `max_batch`
    sequences at once, `kv_tokens` tokens per layer pool (None: max_batch × ctx), waiting at most
    `queue_timeout` seconds for room, at most `prefill_chunk` prompt tokens per prefill step (one
    sequence's chunk, or the chunks of several sequences prefilled together)."""

    ctx: int
    max_batch: int = 8
    kv_tokens: int | None = None
    queue_timeout: float = 60.0
    prefill_chunk: int = 512

    def validate(self, model_context: int) -> None:
        if not 16 <= self.ctx <= model_context:
            raise EngineError(f"--ctx must be between 16 and the model's context of {model_context:,} tokens, "
                              f"not {self.ctx:,}")
        if not 1 <= self.max_batch <= 256:
            raise EngineError(f"--max-batch must be between 1 and 256, not {self.max_batch}")
        if self.kv_tokens is not None and self.kv_tokens < self.ctx:
            raise EngineError(f"the KV budget ({self.kv_tokens:,} tokens) must hold at least one "
                              f"sequence of --ctx {self.ctx:,} tokens")
        if self.queue_timeout <= 0:
            raise EngineError("the queue timeout must be positive")
        if self.prefill_chunk < 1:
            raise EngineError("the prefill chunk must be at least one token")


class _Sequence:
    """An admitted job's state on the engine thread."""

    def __init__(self, job: Job, cache, engine: Engine, reuse_tokens: int, reserved_blocks: int,
                 drafter=None):
        self.job = job
        self.drafter = drafter  # its drafts (serve.drafts: PromptLookup or DraftModel), None without
        self.cache = cache
        self.cached_tokens = reuse_tokens
        self.pending = list(job.prompt_ids[reuse_tokens:])  # prompt tokens still to prefill
        self.reserved_blocks = reserved_blocks
        self.stream = TokenStream(engine.tokenizer, job.prompt_ids, sampling=job.sampling, stop=job.stop,
                                  max_tokens=job.max_tokens, processors=job.processors,
                                  logprobs=job.logprobs, clock=time.monotonic)  # job.submitted's clock
        self.next_token: int | None = None  # the token the next decode step feeds

    @property
    def prefilling(self) -> bool:
        return bool(self.pending)


class Scheduler:
    """Owns the engine thread. `start()` it, `submit` jobs from any thread, `stop()` at the end.

    Args:
        engine: the loaded model; only this scheduler's thread uses it while running.
        limits: ServeLimits.
        metrics: counters and gauges the thread updates (a new Metrics if None).
    """

    def __init__(self, engine: Engine, limits: ServeLimits, metrics: Metrics | None = None):
        limits.validate(engine.model.context_length)
        if engine.speculate not in SPECULATE_MODES:
            raise EngineError(f"speculate must be one of {', '.join(SPECULATE_MODES)}, not {engine.speculate!r}")
        self.engine = engine
        self.drafting = Drafts(engine, DECODE_GROUP, limits.prefill_chunk)  # drafts in the passes' spare rows
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.budget = KVBudget(limits.kv_tokens or limits.max_batch * limits.ctx, engine.kv_config.block_size)
        engine.prefixes.set_capacity_tokens(self.budget.kv_tokens)  # the pools hold the budget
        self.min_batched_chunk = min_batched_chunk(engine.model)
        self._inbox: deque[Job] = deque()
        self._calls: deque[tuple[Callable, list, threading.Event]] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._waiting: deque[Job] = deque()
        self._running: list[_Sequence] = []
        self.prefix = None  # the engine's PrefixCache, made on the engine thread at start
        self.saver = None  # PrefixSaver: writes saved prefixes off the engine thread (disk_cache on)
        self._to_save: list[Job] = []  # jobs whose prompt was prefilled this turn, their prefix to save

    # -- any thread ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the scheduler is already running")
        self._thread = threading.Thread(target=self._loop, name="omlx-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Cancel every job and end the engine thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.saver is not None:
            self.saver.stop(timeout)  # the queued saves are written

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Job) -> None:
        if self._stopping or not self.running:
            raise EngineError("the server is shutting down")
        self._inbox.append(job)  # deque.append is atomic
        self.metrics.queue_length.inc()
        self._wake.set()

    def cancel(self, job: Job) -> None:
        job.cancelled.set()
        self._wake.set()

    def call(self, fn: Callable[[], object], timeout: float = 60.0):
        """Run fn() on the engine thread between steps and return its result (for tests and
        monitoring that must see the caches in a consistent state)."""
        box: list = []
        done = threading.Event()
        self._calls.append((fn, box, done))
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError("the engine thread did not answer")
        if box and isinstance(box[0], BaseException):
            raise box[0]
        return box[0] if box else None

    # -- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        self.prefix = self.engine.prefix_cache()
        if self.prefix.disk is not None and self.saver is None:
            self.saver = PrefixSaver(self.prefix.disk)
            log.info("system prompts' KV saved to and read from %s", self.prefix.disk.directory)
        self.drafting.start(self.budget.kv_tokens)
        b = self.budget
        log.info("engine thread: batches of up to %d sequences, KV budget %d tokens per layer (%d blocks of %d)",
                 self.limits.max_batch, b.kv_tokens, b.max_blocks, b.block_size)
        while not self._stopping:
            worked = False
            try:
                self._run_calls()
                self._take_new()
                self._admit()
                worked = self._prefill_step() or worked
                worked = self._decode_step() or worked
                self._save_prefixes()
                self._update_gauges()
            except Exception as exc:  # a bug or MemoryError must not end the engine thread
                log.exception("engine step failed")
                for seq in list(self._running):
                    try:
                        self._fail(seq, exc)
                    except Exception:
                        log.exception("releasing a failed sequence failed")
                        if seq in self._running:
                            self._running.remove(seq)
                worked = True
            if not worked:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
        for seq in list(self._running):
            self._finish(seq, "cancelled")
        while self._waiting:
            self._send(self._waiting.popleft(), Failed(EngineError("the server is shutting down")))
        while self._inbox:
            self._send(self._inbox.popleft(), Failed(EngineError("the server is shutting down")))
        self._run_calls()

    def _run_calls(self) -> None:
        while self._calls:
            fn, box, done = self._calls.popleft()
            try:
                box.append(fn())
            except BaseException as exc:  # handed back to the caller
                box.append(exc)
            done.set()

    def _send(self, job: Job, event) -> None:
        try:
            job.sink(event)
        except Exception:  # a sink whose loop is gone: nothing to tell
            log.debug("job %s: sink failed", job.id, exc_info=True)

    def _take_new(self) -> None:
        while self._inbox:
            self._waiting.append(self._inbox.popleft())
        now = time.monotonic()
        kept: deque[Job] = deque()
        for job in self._waiting:
            if job.cancelled.is_set():
                self.metrics.queue_length.dec()
                self._send(job, Finished("cancelled", len(job.prompt_ids), 0, 0, "", None))
            elif now - job.submitted > self.limits.queue_timeout:
                self.metrics.queue_length.dec()
                self.metrics.queue_timeouts.inc()
                self._send(job, Failed(QueueTimeout(
                    f"no room for this request within {self.limits.queue_timeout:g} s "
                    f"({len(self._running)} sequences running, KV budget {self.budget.kv_tokens:,} tokens)")))
            else:
                kept.append(job)
        self._waiting = kept

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.limits.max_batch:
            job = self._waiting[0]
            need = self.budget.blocks_for(len(job.prompt_ids) + job.max_tokens)
            if not self.budget.admits(need, sum(s.reserved_blocks for s in self._running), self.prefix):
                return  # in arrival order: a later small job does not overtake this one
            self._waiting.popleft()
            self.metrics.queue_length.dec()
            cache = self.prefix.new_sequence(limit=self.limits.ctx, overflow="stop")
            drafter = None
            try:
                reuse = self.prefix.attach(cache, job.prompt_ids)
                drafter = self.drafting.new(job.prompt_ids, self.limits.ctx)
                seq = _Sequence(job, cache, self.engine, reuse.tokens, need, drafter)
            except Exception as exc:  # e.g. a saved prefix that cannot be read: this job only
                cache.release()
                if drafter is not None:
                    drafter.close()
                self._send(job, Failed(exc))
                continue
            self._running.append(seq)
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
            self.metrics.cached_tokens.inc(reuse.tokens)
            self.metrics.disk_cached_tokens.inc(reuse.disk_tokens)
            if reuse.tokens:
                log.debug("job %s: %d of %d prompt tokens from the prefix cache", job.id, reuse.tokens,
                          len(job.prompt_ids))
            self._send(job, Started(reuse.tokens))

    def _drop_cancelled(self) -> None:
        for seq in list(self._running):
            if seq.job.cancelled.is_set():
                self._finish(seq, "cancelled")

    def _chunk_of(self, seq: _Sequence) -> int:
        """Tokens of `seq`'s next prefill chunk: the same however many sequences prefill, so that
        a prompt is cut at the same places (and computed the same way) alone or in a batch."""
        return min(self.limits.prefill_chunk, self.engine.chunk_size(seq.cache), len(seq.pending))

    def _prefill_group(self) -> list[tuple[_Sequence, int]]:
        """The sequences of the next prefill step with their chunk sizes: the oldest prefilling
        sequence, and when its chunk may be batched (`min_batched_chunk` tokens or more), the
        next ones in admission order whose chunks may be batched too, while the chunks fit in
        `prefill_chunk` tokens together (a sequence whose chunk does not fit ends the group: no
        later one overtakes it)."""
        prefilling = [s for s in self._running if s.prefilling]
        if not prefilling:
            return []
        first = prefilling[0]
        group = [(first, self._chunk_of(first))]
        if group[0][1] < self.min_batched_chunk:
            return group
        budget = self.limits.prefill_chunk - group[0][1]
        for seq in prefilling[1:]:
            n = self._chunk_of(seq)
            if n < self.min_batched_chunk:
                continue  # prefilled alone when it is the oldest
            if n > budget:
                break
            group.append((seq, n))
            budget -= n
        return group

    def _prefill_step(self) -> bool:
        self._drop_cancelled()
        group = self._prefill_group()
        if not group:
            return False
        t0 = time.perf_counter()
        if len(group) == 1:
            prefilled = self._prefill_alone(*group[0])
        else:
            try:
                prefilled = self._prefill_batch(group)
            except (ContextFull, KVPoolFull):  # nothing changed: each alone, so that only the one
                prefilled = sum(self._prefill_alone(seq, n) for seq, n in group)  # short of room fails
        release_free_heap()  # the chunks' temporaries: not resident while the next step runs
        self.metrics.observe_prefill(len(group), prefilled, time.perf_counter() - t0)
        if self.saver is not None:
            self._to_save.extend(seq.job for seq, _ in group if not seq.pending and seq.job.prefix_tokens)
        return True

    def _save_prefixes(self) -> None:
        """Offer the prefixes of the jobs prefilled this turn to the saver (after the decode
        step, so that the copy does not delay it): the leading full blocks of each job's
        `prefix_tokens` still in the prefix cache."""
        jobs, self._to_save = self._to_save, []
        for job in jobs:
            keys = self.prefix.cached_keys(job.prompt_ids[: job.prefix_tokens])
            if not keys:
                continue
            try:
                t0 = time.perf_counter()
                what = self.saver.offer(self.prefix, keys)
            except Exception:  # never the requests' problem
                log.exception("job %s: saving its prefix failed", job.id)
                continue
            if what == "queued":
                log.debug("job %s: %d prefix tokens copied for saving in %.1f ms", job.id,
                          len(keys) * self.prefix.B, (time.perf_counter() - t0) * 1e3)

    def _prefill_alone(self, seq: _Sequence, n: int) -> int:
        """Prefill the next n prompt tokens of `seq` by themselves; returns the tokens prefilled
        (0 when the sequence failed)."""
        chunk = seq.pending[:n]
        last = n == len(seq.pending)
        try:
            out = self.engine.model.forward(np.asarray(chunk, np.int64), seq.cache,
                                            "last" if last else np.empty(0, np.int64))
        except (ContextFull, KVPoolFull) as exc:  # admission makes these unreachable; kept exact
            self._fail(seq, exc)
            return 0
        del seq.pending[:n]
        if last:
            self._advance(seq, out[0])
        return n

    def _prefill_batch(self, group: list[tuple[_Sequence, int]]) -> int:
        """One forward pass over the next chunk of every sequence of `group`; the sequences whose
        prompt ends in it sample their first token. Returns the tokens prefilled. ContextFull and
        KVPoolFull leave every sequence unchanged (PrefillBatch.begin_forward checks them all
        before any changes).

        `model.forward`'s steps, with the output layer run on each finishing sequence's last row
        by itself, as `forward(..., "last")` runs it on a sequence prefilled alone: more than
        MATVEC_MAX_ROWS rows at once would go through BLAS, which sums differently from the
        one-row products."""
        model = self.engine.model
        h, last_rows = prefill_together(model, [seq.cache for seq, _ in group], [seq.pending[:n] for seq, n in group])
        finishing = [(seq, row) for (seq, n), row in zip(group, last_rows) if n == len(seq.pending)]
        for seq, n in group:
            del seq.pending[:n]
        for seq, row in finishing:
            self._advance(seq, model.output(h[row : row + 1])[0])
        return len(h)

    def _decode_step(self) -> bool:
        self._drop_cancelled()
        batch = [s for s in self._running if not s.prefilling and s.next_token is not None]
        if not batch:
            return False
        t0 = time.perf_counter()
        drafts = self._drafts(batch)
        if any(drafts):
            self._verify_pass(batch, drafts)  # len(batch) < DECODE_GROUP: one pass
        else:
            for start in range(0, len(batch), DECODE_GROUP):
                group = batch[start : start + DECODE_GROUP]
                tokens = np.array([s.next_token for s in group], np.int64)
                cache = group[0].cache if len(group) == 1 else DecodeBatch([s.cache for s in group])
                logits = self.engine.model.forward(tokens, cache, "all")  # (len(group), vocab)
                for seq, row in zip(group, logits):
                    self._advance(seq, row)
        self.metrics.observe_step(len(batch), time.perf_counter() - t0)
        return True

    def _drafts(self, batch: list[_Sequence]) -> list[list[int]]:
        """Each sequence's draft for this step ([] for none): serve.drafts hands out the rows a
        pass has beyond one per sequence (DECODE_GROUP in all), in the batch's order."""
        limit = min(self.limits.ctx, self.engine.model.context_length)
        rooms = [Engine.draft_room(s.cache, limit, s.stream.max_tokens - s.stream.n_generated - 1)
                 if s.drafter is not None else 0 for s in batch]
        return self.drafting.for_pass([s.drafter for s in batch], [s.stream.history for s in batch], rooms)

    def _verify_pass(self, batch: list[_Sequence], drafts: list[list[int]]) -> None:
        """One forward pass of every sequence's token and draft: (1 + len(draft_i)) rows each,
        sequence by sequence; a sequence without a draft is a plain decode row."""
        caches = [VerifyBatch(s.cache) if d else s.cache for s, d in zip(batch, drafts)]
        counts = [1 + len(d) for d in drafts]
        tokens = np.array([t for s, d in zip(batch, drafts) for t in (s.next_token, *d)], np.int64)
        cache = caches[0] if len(batch) == 1 else SequenceBatch(caches, counts)
        rows = self.engine.model.forward(tokens, cache, "all")  # (sum(counts), vocab)
        start = 0
        for seq, verify, draft, n in zip(batch, caches, drafts, counts):
            if draft:
                self._advance_draft(seq, verify, rows[start : start + n], draft)
            else:
                self._advance(seq, rows[start])
            start += n

    def _advance_draft(self, seq: _Sequence, verify: VerifyBatch, rows: np.ndarray, draft: list[int]) -> None:
        """`_advance` for a verified draft: rows (len(draft) + 1, vocab). The stream takes the
        tokens the acceptance rule keeps, the cache keeps the rows of the draft tokens the stream
        went on after (the rest rolled back), each token is sent."""
        seq.next_token = None
        if seq.job.cancelled.is_set():
            verify.finish(len(draft))
            self._finish(seq, "cancelled")
            return
        steps = seq.stream.verify(rows, draft)
        verify.finish(len(draft) - (len(steps) - 1))
        agreed = agreed_tokens(steps, draft)
        seq.drafter.update(len(draft), agreed)
        self.metrics.drafted_tokens.inc(len(draft))
        self.metrics.accepted_tokens.inc(agreed)
        for step in steps:
            if self._emit(seq, step):
                return
        self._go_on(seq, steps[-1].token)

    def _emit(self, seq: _Sequence, step) -> bool:
        """Send one step's token, or finish the sequence on a stop token / a limit the step hit;
        True when the sequence has ended."""
        if step.finish_reason == STOP:
            self._finish(seq, STOP)
            return True
        self.metrics.generated_tokens.inc()
        self._send(seq.job, Token(step.token, step.text, step.logprob))
        if step.finish_reason is not None:
            self._finish(seq, step.finish_reason)
            return True
        return False

    def _go_on(self, seq: _Sequence, token: int) -> None:
        """`token` is the next decode step's input, unless the context is full (finished: length)."""
        if seq.cache.offset + 1 >= min(self.limits.ctx, self.engine.model.context_length):
            self._finish(seq, "length")
        else:
            seq.next_token = token

    def _advance(self, seq: _Sequence, logits: np.ndarray) -> None:
        """Push `logits` through the sequence's token stream and send the token, or finish."""
        seq.next_token = None
        if seq.job.cancelled.is_set():
            self._finish(seq, "cancelled")
            return
        stream = seq.stream
        if stream.done:  # max_tokens 0: nothing to sample
            self._finish(seq, stream.finish_reason)
            return
        first = stream.first_token_at is None
        step = stream.push(logits)
        if first:
            self.metrics.ttft.observe(stream.first_token_at - seq.job.submitted)
        if not self._emit(seq, step):
            self._go_on(seq, step.token)

    def _release(self, seq: _Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        seq.cache.release()
        if seq.drafter is not None:
            seq.drafter.close()

    def _finish(self, seq: _Sequence, reason: str) -> None:
        tail = seq.stream.finish(reason)
        self._release(seq)
        stream = seq.stream
        ttft = None if stream.first_token_at is None else stream.first_token_at - seq.job.submitted
        self.metrics.finished(reason)
        drafter = seq.drafter
        self._send(seq.job, Finished("stop" if reason == STOP_STRING else reason, len(seq.job.prompt_ids),
                                     stream.n_generated, seq.cached_tokens, tail, ttft, stream.matcher.matched,
                                     drafter.drafted if drafter else 0, drafter.accepted if drafter else 0))

    def _fail(self, seq: _Sequence, exc: BaseException) -> None:
        self._release(seq)
        self.metrics.finished("error")
        self._send(seq.job, Failed(exc))

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self._running))
        m.kv_bytes_in_use.set(self.prefix.nbytes)
        m.kv_bytes_allocated.set(self.prefix.capacity_bytes)
        m.kv_bytes_capacity.set(self.budget.capacity_bytes(self.prefix))
        self.drafting.gauges(m, self.budget)
        if self.saver is not None:
            saves = m.prefix_saves
            saves["written"].set(self.saver.saved)
            saves["failed"].set(self.saver.failed)
            saves["dropped"].set(self.saver.dropped)
