"""PrefixStore: an engine's prefix caches, one for the KV layout it runs now and one for that
layout's 8-bit master copy (kv.requantize), with the questions asked about them: which cache a
new sequence comes from, computing a pinned prefix in the master layout, what a layout switch
would cost, the bytes they hold.

The store reads its engine's settings at every call (``kv_config``, ``compute_id``,
``disk_cache``, ``master_copies``: callers set them on the engine), so a change of any of them
takes effect at the next question; it prefills through ``engine.prefill``. The pools' size is the
store's own setting (``set_capacity_tokens``), for the caches it makes from then on.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Sequence

from .kv.config import KVConfig, parse_kv

log = logging.getLogger("omlx.engine")


class PrefixStore:
    def __init__(self, engine):
        self.engine = engine
        self.current = None  # the current layout's PrefixCache, made on first use
        self.master = None  # the master layout's PrefixCache, when the current one derives from it
        self.capacity_tokens = 2 * engine.model.context_length  # pool size per layer of the caches made
        self._lock = threading.Lock()

    def set_capacity_tokens(self, tokens: int) -> None:
        """Pool size per layer, in tokens, of the caches made from now on (sequences and cached
        blocks share it): `omlx serve` sizes them to its KV budget before its first cache."""
        if tokens < 1:
            raise ValueError(f"a prefix cache needs room for at least one token, not {tokens}")
        self.capacity_tokens = tokens

    def cache(self):
        """The shared block pools and prefix cache for the engine's current KV config. A new
        config gets a new cache (so does turning ``disk_cache`` on or off or another arithmetic);
        the old one's blocks are released when the sessions holding it move on."""
        from .kv.prefix import PrefixCache, PrefixDiskStore

        e = self.engine
        with self._lock:  # two threads must never each make their own
            cur = self.current
            if cur is None or cur.config != e.kv_config or cur.model_id != e.compute_id \
                    or (cur.disk is not None) != e.disk_cache:
                if cur is not None:
                    cur.clear()
                disk = PrefixDiskStore() if e.disk_cache else None
                self.current = PrefixCache(e.model, e.kv_config, model_id=e.compute_id,
                                           capacity_tokens=self.capacity_tokens, disk=disk)
                self.current.master = self._master_for(self.current)
            return self.current

    def _master_for(self, cache):
        """The master layout's PrefixCache for `cache` (kept while the master layout stays the
        same, so its memory survives a switch between derived presets); None when `cache` is
        the master layout itself or cannot be derived from it."""
        from .kv.prefix import PrefixCache

        e = self.engine
        if not e.master_copies or cache.is_master or not cache.can_derive():
            if cache.is_master:
                self.master = None
            return None
        if self.master is None or self.master.config != cache.master_config \
                or (self.master.disk is None) != (cache.disk is None) or self.master.model_id != cache.model_id:
            self.master = PrefixCache(e.model, cache.master_config, model_id=cache.model_id,
                                      capacity_tokens=self.capacity_tokens, disk=cache.disk)
        return self.master

    def prefill_master(self, ids: Sequence[int], progress: Callable[[int, int], None] | None = None,
                       cancel: threading.Event | None = None) -> int:
        """Engine.prefill_master: the full blocks of the pinned prefix `ids` computed in the
        master layout and saved; returns the prefix tokens the master holds in memory (0 when
        the current layout has no master to derive from, or on cancel)."""
        cache = self.cache()
        master = cache.master
        if master is None or not cache.derives_from_master:
            return 0
        n_blocks = len(ids) // master.B
        if n_blocks == 0:
            return 0
        seq = master.new_sequence()
        try:
            reuse = master.attach(seq, ids[: n_blocks * master.B])
            todo = ids[reuse.tokens : n_blocks * master.B]
            if todo:
                log.info("prefilling %d prefix tokens into the 8-bit master copy", len(todo))
                if self.engine.prefill(todo, seq, progress, cancel) is None:
                    return 0
            keys = master.cached_keys(ids[: n_blocks * master.B])
            master.save(keys)
            return len(keys) * master.B
        finally:
            seq.release()

    def switch_cost(self, kv: str | KVConfig, prefix_ids: Sequence[int]) -> dict:
        """Engine.switch_cost: {"reread", "source"} for switching to `kv`. Reads no block and
        makes no cache."""
        from .kv.prefix import PrefixDiskStore, chain_keys_from, chain_root, layout_signature
        from .kv.requantize import derivable, master_config

        e = self.engine
        n_layers = e.model.n_layers
        config = parse_kv(kv)
        config.per_layer(n_layers)
        B = config.block_size
        n_blocks = len(prefix_ids) // B
        if n_blocks == 0:
            return {"reread": 0, "source": "none"}
        if config == e.kv_config:
            return {"reread": 0, "source": "current"}

        def found(cfg) -> tuple[int, str]:
            """Leading blocks of the prefix held under layout `cfg` in memory or on disk."""
            sig = layout_signature(cfg, n_layers)
            keys = chain_keys_from(chain_root(e.model_id, sig), B, prefix_ids, n_blocks)
            best, where = 0, "none"
            for cache in (self.current, self.master):
                if cache is not None and cache.signature == sig:
                    n = cache.usable_blocks(keys)
                    if n > best:
                        best, where = n, "memory"
            if e.disk_cache:
                n = PrefixDiskStore().saved_blocks(keys)
                if n > best:
                    best, where = n, "disk"
            return best, where

        own, where = found(config)
        if own == n_blocks:
            return {"reread": 0, "source": where}
        if derivable(config, n_layers):
            master, _ = found(master_config(config))
            if master == n_blocks:
                return {"reread": 0, "source": "master"}
            own = max(own, master)
        return {"reread": (n_blocks - own) * B, "source": "prefill"}

    def usage(self) -> tuple[int, int]:
        """(bytes in use, bytes allocated) of both caches' pools, (0, 0) before there is one.
        Never creates one: safe to poll from a monitoring thread."""
        caches = [c for c in (self.current, self.master) if c is not None]
        return sum(c.nbytes for c in caches), sum(c.capacity_bytes for c in caches)


class PrefixSaver:
    """Saves prefixes to disk off the caller's thread (`omlx serve`'s engine thread): `offer`
    copies the chain's blocks out of the pools (the caller owns them) and queues the copy; a
    thread of its own checksums and writes it (PrefixDiskStore.write: a temporary file renamed
    into place). At most `max_pending` copies wait; more offers are dropped until there is room
    (a client changing its system prompt every request must not pile up copies). A chain whose
    save failed (a full disk) is not offered again for `retry_s` seconds. `stop` lets the queued
    writes finish (up to a timeout). The thread also sweeps the temporary files of processes
    that are gone when it starts."""

    def __init__(self, disk, *, max_pending: int = 2, retry_s: float = 60.0):
        self.disk = disk
        self.max_pending = max_pending
        self.retry_s = retry_s
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._busy: set = set()  # paths queued or being written
        self._failed: dict = {}  # path → monotonic time of the failed write
        self._stopping = False
        self.saved = 0  # files written
        self.failed = 0  # writes that failed (logged by the store)
        self.dropped = 0  # offers dropped with max_pending copies waiting
        self._sweep = disk.take_sweep()  # the thread sweeps (not the first snapshot, on the caller's thread)
        self._thread = threading.Thread(target=self._run, name="omlx-prefix-saver", daemon=True)
        self._thread.start()

    def offer(self, cache, keys) -> str:
        """Save the chain `keys` of `cache` unless it is saved (its file is touched then), being
        saved, failed lately or the queue is full. Returns what happened: "saved", "queued",
        "busy", "failed lately", "dropped"."""
        path = self.disk.path_for(keys[-1])
        with self._cond:
            if path in self._busy:
                return "busy"
            failed_at = self._failed.get(path)
            if failed_at is not None and time.monotonic() - failed_at < self.retry_s:
                return "failed lately"
            if len(self._busy) >= self.max_pending:
                self.dropped += 1
                return "dropped"
        from .kv.prefix import PendingSave

        pending = self.disk.snapshot(cache, keys)  # the copy: on the caller's thread, outside the lock
        if not isinstance(pending, PendingSave):
            return "saved"  # on disk already
        with self._cond:
            self._busy.add(path)
            self._queue.append(pending)
            self._cond.notify()
        return "queued"

    def _run(self) -> None:
        if self._sweep:
            try:
                self.disk.sweep_stale()
            except Exception:
                log.exception("sweeping stale prefix files failed")
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                pending = self._queue[0]
            try:
                path = self.disk.write(pending)
            except Exception:  # a bug must not end the thread: the prefix stays in memory
                log.exception("saving the cached prefix %s failed", pending.path)
                path = None
            with self._cond:
                self._queue.popleft()
                self._busy.discard(pending.path)
                if path is None:
                    self.failed += 1
                    self._failed[pending.path] = time.monotonic()
                else:
                    self.saved += 1
                    self._failed.pop(pending.path, None)
                self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue, timeout)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Finish the queued writes (up to `timeout` seconds) and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
