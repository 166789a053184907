"""GenerationStats, a turn's figures, and where they are written: `TurnMeter` measures what
`Engine.stream` runs (prefill, first token, decode, memory, drops, drafts), and
`GenerationStats.count_reuse` adds what a `Session` knows beyond it (the whole prompt, the tokens
its KV cache supplied, the time it took to find them)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from .memory import PeakRSS

log = logging.getLogger("omlx.engine")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0  # request start → first generated token sampled
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0  # tokens after the first / time after the first
    total_s: float = 0.0
    peak_rss_bytes: int = 0
    kv_bytes: int = 0  # KV bytes this sequence holds (block rows in use + tail/sink buffers)
    kv_capacity_bytes: int = 0  # KV bytes allocated (whole pool slabs)
    cached_tokens: int = 0  # prompt tokens reused from the KV cache instead of prefilled
    cache_source: str = "none"  # where they came from: "memory", "disk" or "none"
    dropped_tokens: int = 0  # tokens the overflow policy dropped during this turn
    drafted_tokens: int = 0  # speculative decoding: tokens drafted by prompt lookup
    accepted_tokens: int = 0  # of those, the ones the model agreed with (kept without a step of their own)
    pinned_tokens: int = 0  # prompt tokens of pinned documents (and system prompt) held pinned
    arith: str = "exact"  # the weight arithmetic the turn ran in (weights.ARITH_MODES)

    def as_dict(self) -> dict:
        return asdict(self)

    def count_reuse(self, prompt_tokens: int, cached_tokens: int, source: str, setup_s: float) -> None:
        """A session's turn: the engine was given only the `prompt_tokens` its cache did not
        supply; `cached_tokens` came from `source`; finding them took `setup_s`, before the
        engine's clock started, so it counts in the time to the first token."""
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.cache_source = source if cached_tokens else "none"
        if self.ttft_s:
            self.ttft_s += setup_s  # from the question, not from the start of the prefill


class TurnMeter:
    """The figures of one `Engine.stream` run over `cache`, its clock started at construction
    (the run's first step, before the prefill)."""

    def __init__(self, prompt_tokens: int, arith: str, cache):
        self.stats = GenerationStats(prompt_tokens=prompt_tokens, arith=arith)
        self.peak = PeakRSS()
        self.cache = cache
        self.t_start = time.perf_counter()
        self._dropped_before = cache.dropped_tokens  # the cache may come with drops of earlier turns

    def sample_memory(self) -> None:
        self.peak.sample()

    def prefilled(self) -> None:
        self.stats.prefill_tok_s = self.stats.prompt_tokens / max(time.perf_counter() - self.t_start, 1e-9)

    def first_token(self, at: float) -> float:
        """The first token was sampled at `at` (perf_counter); returns the time to it."""
        self.stats.ttft_s = at - self.t_start
        return self.stats.ttft_s

    def finish(self, reason: str, n_generated: int, t_first: float | None, drafter=None) -> GenerationStats:
        """The stats at the end (`reason`: the finish reason, for the log); `t_first`: when the
        first token was sampled (None: none was); `drafter`: the run's drafter, if any."""
        st, cache = self.stats, self.cache
        now = time.perf_counter()
        st.generated_tokens = n_generated
        st.total_s = now - self.t_start
        if t_first is not None and n_generated > 1:
            st.decode_tok_s = (n_generated - 1) / max(now - t_first, 1e-9)
        st.peak_rss_bytes = max(self.peak.peak, self.peak.sample())
        st.kv_bytes = cache.nbytes
        st.kv_capacity_bytes = cache.capacity_bytes
        st.dropped_tokens = cache.dropped_tokens - self._dropped_before
        if drafter is not None:
            st.drafted_tokens, st.accepted_tokens = drafter.drafted, drafter.accepted
        log.info("generation: peak RSS %.1f MiB, KV %.2f MiB in use, %.2f MiB allocated (%s)",
                 st.peak_rss_bytes / 2**20, st.kv_bytes / 2**20, st.kv_capacity_bytes / 2**20, reason)
        return st
