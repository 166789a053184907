"""PrefixStore: an engine's prefix caches, one for the KV layout it runs now and one for that
layout's 8-bit master copy (kv.requantize), with the questions asked about them: which cache a
new sequence comes from, computing a pinned prefix in the master layout, what a layout switch
would cost, the bytes they hold.

The store reads its engine's settings at every call (``kv_config``, ``compute_id``,
``disk_cache``, ``master_copies``, ``prefix_capacity_tokens``: callers set them on the engine), so
a change of any of them takes effect at the next question; it prefills through ``engine.prefill``.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

from .kv.config import KVConfig, parse_kv

log = logging.getLogger("omlx.engine")


class PrefixStore:
    def __init__(self, engine):
        self.engine = engine
        self.current = None  # the current layout's PrefixCache, made on first use
        self.master = None  # the master layout's PrefixCache, when the current one derives from it
        self._lock = threading.Lock()

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
                                           capacity_tokens=e.prefix_capacity_tokens, disk=disk)
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
                                      capacity_tokens=e.prefix_capacity_tokens, disk=cache.disk)
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
            keys = master.chain_keys(ids, n_blocks)
            n = master.usable_blocks(keys)
            master.save(keys[:n])
            return n * master.B
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
