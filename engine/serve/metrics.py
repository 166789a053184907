"""The server's counters, gauges and the TTFT histogram, rendered in the Prometheus text
exposition format (version 0.0.4) for GET /metrics. Updated from the engine thread and the
request handlers; every value sits behind one lock."""

from __future__ import annotations

import bisect
import threading
from collections import Counter as _Tally

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # sequences per decode (or prefill) step

_lock = threading.Lock()


class _Value:
    def __init__(self):
        self.value = 0.0

    def inc(self, n: float = 1.0) -> None:
        with _lock:
            self.value += n

    def dec(self, n: float = 1.0) -> None:
        with _lock:
            self.value -= n

    def set(self, v: float) -> None:
        with _lock:
            self.value = float(v)


class _Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        with _lock:
            self.counts[bisect.bisect_left(self.buckets, v)] += 1
            self.sum += v
            self.count += 1


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Metrics:
    def __init__(self):
        self.requests = _Tally()  # (endpoint, HTTP status) → count
        self.finish_reasons = _Tally()
        self.prompt_tokens = _Value()
        self.cached_tokens = _Value()
        self.disk_cached_tokens = _Value()  # of those, read from saved prefixes on disk
        self.prefix_saves = {"written": _Value(), "failed": _Value(), "dropped": _Value()}  # PrefixSaver's
        self.generated_tokens = _Value()
        self.drafted_tokens = _Value()  # speculative decoding: tokens drafted (prompt lookup or --draft)
        self.accepted_tokens = _Value()  # of those, the ones the model agreed with (kept)
        self.queue_length = _Value()
        self.queue_timeouts = _Value()
        self.running = _Value()
        self.kv_bytes_in_use = _Value()
        self.kv_bytes_allocated = _Value()
        self.kv_bytes_capacity = _Value()
        self.draft_kv_bytes_in_use = _Value()  # the draft model's pools (--draft), beside the budget's
        self.draft_kv_bytes_capacity = _Value()
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.batch_size = _Histogram(BATCH_BUCKETS)
        self.decode_seconds = _Value()
        self.prefill_batch_size = _Histogram(BATCH_BUCKETS)
        self.prefill_seconds = _Value()
        self.prefilled_tokens = _Value()

    def request(self, endpoint: str, status: int) -> None:
        with _lock:
            self.requests[(endpoint, int(status))] += 1

    def finished(self, reason: str) -> None:
        with _lock:
            self.finish_reasons[reason] += 1

    def observe_step(self, n_sequences: int, seconds: float) -> None:
        self.batch_size.observe(n_sequences)
        self.decode_seconds.inc(seconds)

    def observe_prefill(self, n_sequences: int, n_tokens: int, seconds: float) -> None:
        """One prefill step: chunks of n_sequences prompts, n_tokens in all, in one forward pass."""
        self.prefill_batch_size.observe(n_sequences)
        self.prefilled_tokens.inc(n_tokens)
        self.prefill_seconds.inc(seconds)

    def render(self) -> str:
        lines: list[str] = []

        def metric(name, kind, help_text, samples):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                label = "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""
                lines.append(f"{name}{label} {_num(value)}")

        def histogram(name, help_text, h: _Histogram):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} histogram")
            running = 0
            for bound, count in zip(h.buckets, h.counts):
                running += count
                lines.append(f'{name}_bucket{{le="{_num(bound)}"}} {running}')
            lines.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
            lines.append(f"{name}_sum {_num(h.sum)}")
            lines.append(f"{name}_count {h.count}")

        with _lock:
            prompt, cached = self.prompt_tokens.value, self.cached_tokens.value
            metric("omlx_requests_total", "counter", "HTTP requests answered, by endpoint and status",
                   [((("endpoint", e), ("status", s)), n) for (e, s), n in sorted(self.requests.items())])
            metric("omlx_finished_sequences_total", "counter", "sequences ended, by reason",
                   [((("reason", r),), n) for r, n in sorted(self.finish_reasons.items())])
            metric("omlx_prompt_tokens_total", "counter", "prompt tokens of admitted requests", [((), prompt)])
            metric("omlx_cached_prompt_tokens_total", "counter",
                   "prompt tokens taken from the prefix cache instead of prefilled", [((), cached)])
            metric("omlx_disk_cached_prompt_tokens_total", "counter",
                   "of the cached prompt tokens, those read from prefixes saved on disk",
                   [((), self.disk_cached_tokens.value)])
            metric("omlx_prefix_saves_total", "counter",
                   "system-prompt prefixes saved to disk, by result (written; failed, e.g. a full disk; "
                   "dropped with saves already waiting)",
                   [((("result", r),), v.value) for r, v in self.prefix_saves.items()])
            metric("omlx_generated_tokens_total", "counter", "tokens generated", [((), self.generated_tokens.value)])
            metric("omlx_drafted_tokens_total", "counter",
                   "tokens drafted by prompt lookup (--speculate lookup) or the draft model (--draft)",
                   [((), self.drafted_tokens.value)])
            metric("omlx_accepted_tokens_total", "counter", "drafted tokens the model agreed with (kept)",
                   [((), self.accepted_tokens.value)])
            metric("omlx_prefix_cache_hit_ratio", "gauge", "cached prompt tokens / prompt tokens",
                   [((), cached / prompt if prompt else 0.0)])
            metric("omlx_queue_length", "gauge", "requests waiting for a slot or KV budget",
                   [((), self.queue_length.value)])
            metric("omlx_queue_timeouts_total", "counter", "requests answered 429 after waiting",
                   [((), self.queue_timeouts.value)])
            metric("omlx_running_sequences", "gauge", "sequences prefilling or decoding", [((), self.running.value)])
            metric("omlx_kv_bytes_in_use", "gauge", "KV pool rows in use (sequences and prefix cache)",
                   [((), self.kv_bytes_in_use.value)])
            metric("omlx_kv_bytes_allocated", "gauge", "KV pool slabs allocated", [((), self.kv_bytes_allocated.value)])
            metric("omlx_kv_bytes_capacity", "gauge", "KV budget: every pool's max blocks",
                   [((), self.kv_bytes_capacity.value)])
            metric("omlx_draft_kv_bytes_in_use", "gauge", "the draft model's KV pool rows in use (--draft)",
                   [((), self.draft_kv_bytes_in_use.value)])
            metric("omlx_draft_kv_bytes_capacity", "gauge",
                   "the draft model's KV pools: the budget's blocks per layer at its geometry (--draft)",
                   [((), self.draft_kv_bytes_capacity.value)])
            metric("omlx_decode_seconds_total", "counter", "time in decode steps", [((), self.decode_seconds.value)])
            histogram("omlx_ttft_seconds", "request arrival to first token", self.ttft)
            metric("omlx_prefill_seconds_total", "counter", "time in prefill steps", [((), self.prefill_seconds.value)])
            metric("omlx_prefilled_tokens_total", "counter", "prompt tokens prefilled (not from the prefix cache)",
                   [((), self.prefilled_tokens.value)])
            histogram("omlx_decode_batch_size", "sequences per decode step", self.batch_size)
            histogram("omlx_prefill_batch_size", "sequences whose prompt chunks one prefill step runs together",
                      self.prefill_batch_size)
        return "\n".join(lines) + "\n"
