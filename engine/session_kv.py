"""SessionKV: what one conversation holds of the engine's KV cache.

    live        the sequence the conversation's last turn ran on (None until a turn, or after
                a change that makes it useless): made with this context limit and overflow policy
    pins        the chain keys of the pinned prefix's full blocks, pinned in `cache` (the
                prefix cache they were made under; a KV config change makes a new one and the
                pins go with the old)

A turn asks `sequence_for(ids, n_prefix)`: the live sequence when it still holds a prefix of the
prompt (trimmed back after an edit), else a new one that attaches the longest cached prefix
(memory, disk, or derived from the master copy). After the turn `pin` pins and saves the prefix.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

from .errors import EngineError
from .kv.paged import OVERFLOW_POLICIES, PagedKVCache
from .kv.prefix import PrefixCache, common_prefix


def check_overflow(policy: str) -> str:
    if policy not in OVERFLOW_POLICIES:
        raise EngineError(f"overflow policy must be one of {', '.join(OVERFLOW_POLICIES)}, not {policy!r}")
    return policy


class SessionKV:
    """Args:
        engine: the engine whose prefix cache the sequences come from.
        limit: the context limit of the sequences made (tokens).
        overflow: their overflow policy (kv.overflow: "stop", "rolling" or "attention").
        on_new_cache: called after a KV config change dropped the live sequence and the pins
            (the session's documents are no longer cached then).
    """

    def __init__(self, engine, limit: int, overflow: str, on_new_cache: Callable[[], None] = lambda: None):
        self.engine = engine
        self.limit = limit
        self.overflow = check_overflow(overflow)
        self.on_new_cache = on_new_cache
        self.cache: PrefixCache | None = None
        self.live: PagedKVCache | None = None
        self.pinned_keys: list[bytes] = []
        self._saved_key: bytes | None = None  # the last key saved to disk (a prefix saved once)
        self.master_prefilled = 0  # tokens the last sequence_for prefilled into the master copy

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self.release_live()  # its limit was fixed when it was made

    def set_overflow(self, policy: str) -> None:
        self.overflow = check_overflow(policy)
        self.release_live()

    def prefix_cache(self) -> PrefixCache:
        """The engine's prefix cache for its current KV config; a config change drops the live
        sequence and the pins made under the old one (their blocks go with the old cache)."""
        cache = self.engine.prefix_cache()
        if cache is not self.cache:
            self.release_live()
            if self.cache is not None:
                self.cache.unpin(self.pinned_keys)
            self.pinned_keys = []
            self._saved_key = None
            self.cache = cache
            self.on_new_cache()
        return cache

    def release_live(self) -> None:
        if self.live is not None:
            self.live.release()
            self.live = None

    def close(self) -> None:
        """Release the live sequence and the pins."""
        self.release_live()
        if self.cache is not None:
            self.cache.unpin(self.pinned_keys)
        self.pinned_keys = []

    def pin(self, ids: Sequence[int], n_prefix: int) -> bool:
        """Pin the full blocks of the prefix `ids[:n_prefix]` (those really cached) and save them
        to disk, unpinning the previous prefix; returns whether any block is pinned."""
        cache = self.prefix_cache()
        keys = cache.cached_keys(ids[:n_prefix])
        cache.pin(keys)
        cache.unpin(self.pinned_keys)
        self.pinned_keys = keys
        if keys and self._saved_key != keys[-1]:
            cache.save(keys)
            self._saved_key = keys[-1]
        return bool(keys)

    def repin(self, prefix_ids: Sequence[int]) -> None:
        """After the document set changed: unpin what is no longer a block of `prefix_ids`, the
        pinned prefix now."""
        if self.cache is None:
            return
        n = len(prefix_ids) - len(prefix_ids) % self.cache.B
        keep = set(self.cache.chain_keys(prefix_ids[:n])) if n else set()
        self.cache.unpin([k for k in self.pinned_keys if k not in keep])
        self.pinned_keys = [k for k in self.pinned_keys if k in keep]

    def sequence_for(self, ids: Sequence[int], n_prefix: int,
                     progress: Callable[[int, int], None] | None = None,
                     cancel: threading.Event | None = None) -> tuple[PagedKVCache, int, str]:
        """A sequence holding the longest reusable prefix of `ids` (leaving at least one token
        to prefill), its first `n_prefix` tokens protected from the overflow policy: the live
        one, trimmed or extended, or a new one from the prefix cache. Returns (sequence, tokens
        it holds of `ids`, "memory" / "disk" / "none").

        A pinned prefix the cache cannot supply is computed in the master layout first (when
        the current layout derives from it: kv.requantize) and derived, so a later switch to
        another derivable layout does not prefill it again; `master_prefilled` says how many
        tokens that took (progress and cancel apply to it)."""
        self.master_prefilled = 0
        cache = self.prefix_cache()
        live = self.live
        if live is not None:
            history = live.history
            common = common_prefix(history, ids)
            if live.dropped_tokens:
                # after a drop (the history counts the dropped tokens too) it is never trimmed
                # back: reused only when the prompt goes on from all of its history
                if common == len(history) and len(ids) > common:
                    live.protected_tokens = n_prefix
                    return live, common, "memory"
            else:
                # back to a block start, the rest prefilled again, where the trim would reopen a
                # quantized block whose rows are gone (the prompt then reads what a new sequence
                # would, not what an answer left in that block)
                common = live.exact_trim_point(min(common, len(ids) - 1))
                in_memory = cache.usable_blocks(cache.chain_keys(ids, (len(ids) - 1) // cache.B)) * cache.B
                if common > 0 and common >= in_memory:
                    try:
                        live.trim(len(history) - common)
                        live.protected_tokens = n_prefix
                        return self._kept(live, ids), common, "memory"
                    except ValueError:
                        pass  # a sliding window already released what the trim needs
            self.release_live()
        seq = cache.new_sequence(limit=self.limit, overflow=self.overflow, protected_tokens=n_prefix)
        reuse = cache.attach(seq, ids)
        prefix_blocks = min(n_prefix, len(ids) - 1) // cache.B
        if reuse.tokens < prefix_blocks * cache.B and cache.derives_from_master:
            before = reuse.tokens
            if self.engine.prefill_master(ids[:n_prefix], progress, cancel):
                seq.release()
                seq = cache.new_sequence(limit=self.limit, overflow=self.overflow, protected_tokens=n_prefix)
                reuse = cache.attach(seq, ids)
                self.master_prefilled = max(0, reuse.tokens - before)
        self.live = seq
        return self._kept(seq, ids), reuse.tokens, reuse.source

    @staticmethod
    def _kept(seq: PagedKVCache, ids: Sequence[int]) -> PagedKVCache:
        """`seq`, its rows at the prompt's last token kept exact: a regenerated answer (or the
        same question asked again) trims back to there, len(ids) - 1 (`sequence_for` leaves
        that token to prefill), and must read the prompt as this answer did."""
        seq.keep_exact(len(ids) - 1)
        return seq
