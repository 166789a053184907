"""One sequence's paged, quantized KV cache (`PagedKVCache`) over per-layer block pools.

The layout of a layer's tokens (sinks, quantized blocks, float16 tail) and what a query sees of
them is described in `storage`; this module keeps the layers of one sequence in step: room for
the next tokens (pool reservation, the overflow policy of `overflow`), the token ids and the
prefix-cache chain of its full blocks.

    storage.py          PagedLayerCache: one layer's blocks, tail and sinks (no arithmetic)
    paged_attention.py  the attention paths, chosen once per layer cache
    overflow.py         stop / rolling / attention: which blocks to drop at the context limit
    pool.py             LayerBlockPool, build_pools
"""

from __future__ import annotations

import numpy as np

from ..errors import ContextFull, KVPoolFull  # noqa: F401  (ContextFull re-exported)
from .cache import KVCache, LayerKVCache
from .config import KVConfig
from .overflow import OVERFLOW_POLICIES, overflow_policy
from .pool import LayerBlockPool, build_pools
from .storage import PagedLayerCache

__all__ = ["OVERFLOW_POLICIES", "PagedKVCache", "PagedLayerCache"]


class PagedKVCache(KVCache):
    """One sequence's paged cache over per-layer pools, built from a KVConfig.

    The pools are the sequence's own, or shared with other sequences through a PrefixCache
    (which then also publishes the blocks that fill up, and evicts cached blocks for room, and
    passes `attentions`, one attention backend per pool shared by its sequences).

    Context limit: with `limit` set, appending past it applies the `overflow` policy (see
    `overflow`: stop, rolling, attention). Later tokens move down (keys re-rotated) so positions
    never pass `limit`; `dropped_tokens` counts what was dropped.

    Attributes (read them; the prefix cache changes them through `adopt_prefix` and
    `mark_published`):
        token_ids: the tokens the cache holds, in position order.
        history: every token appended, dropped ones included.
        chain_keys: prefix-cache keys of the leading full blocks.
        n_published: leading full blocks already handed to the prefix cache.
    """

    def __init__(self, config: KVConfig, *, n_layers: int, n_kv_heads: int, head_dim: int,
                 value_dim: int | None = None, windows: list[int | None] | None = None,
                 max_tokens: int | None = None, use_kernels: bool | None = None,
                 pools: list[LayerBlockPool] | None = None, prefix_cache=None,
                 limit: int | None = None, overflow: str = "stop", protected_tokens: int = 0,
                 rerotate=None, attentions: list | None = None):
        value_dim = head_dim if value_dim is None else value_dim
        windows = windows or [None] * n_layers
        self.policy = overflow_policy(overflow)
        self.config = config
        self.precisions = config.per_layer(n_layers)
        self.prefix_cache = prefix_cache
        if pools is None:
            pools = build_pools(config, n_layers, n_kv_heads, head_dim, value_dim, max_tokens=max_tokens)
        self.pools = pools
        layers: list[LayerKVCache] = [
            PagedLayerCache(pool, sinks=config.sinks, window=windows[i], rotation=config.rotation,
                            use_kernels=use_kernels, attention=attentions[i] if attentions else None,
                            track_attention=self.policy.tracks_attention,
                            defer_release=prefix_cache is not None)
            for i, pool in enumerate(pools)
        ]
        super().__init__(layers)
        self.limit = limit
        self.overflow = overflow
        self.protected_tokens = protected_tokens
        self.rerotate = rerotate  # (layer, keys (T, Hkv, D), by (T,)) → keys; the model's
        self.dropped_tokens = 0
        self.keep_sink_blocks = max(1, -(-config.sinks // config.block_size))
        self.token_ids: list[int] = []
        self.history: list[int] = []
        self.chain_keys: list[bytes] = []
        self.n_published = 0
        self.chain_end: int | None = None  # blocks from here on no longer extend a token prefix

    # -- forward hooks -------------------------------------------------------------------------
    def begin_forward(self, tokens: np.ndarray) -> None:
        T = len(tokens)
        if self.limit is not None and self.offset + T > self.limit:
            self.make_room(T)
        self.reserve(T)
        new = [int(t) for t in tokens]
        self.token_ids.extend(new)
        self.history.extend(new)

    def end_forward(self) -> None:
        if self.prefix_cache is None:
            return
        n_full = self.offset // self.config.block_size
        if self.chain_end is not None:
            n_full = min(n_full, self.chain_end)
        if n_full > self.n_published:
            self.prefix_cache.publish(self, self.n_published, n_full)
        for layer in self.layers:
            layer.release_out_of_window()

    # -- room ----------------------------------------------------------------------------------
    def _allocate(self, layer: int) -> int | None:
        pool = self.pools[layer]
        if pool.n_free == 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(layer_needs={layer: 1})
        return pool.allocate()

    def reserve(self, n_tokens: int) -> None:
        """Fail before any layer changes if some layer's pool cannot take n_tokens more (after
        evicting unused cached blocks, when the pools are shared).

        Raises:
            KVPoolFull: naming the layer whose pool is full.
        """
        needs = {}  # free blocks each short layer must reach
        for i, (pool, layer) in enumerate(zip(self.pools, self.layers)):
            n = layer.blocks_needed(n_tokens)
            if n and n > pool.n_free:
                needs[i] = n
        if not needs:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.evict(layer_needs=needs)
        for i, n in needs.items():  # (evicting only frees blocks: the other layers still fit)
            if n > self.pools[i].n_free:
                raise KVPoolFull(f"the KV cache of layer {i} is full ({self.pools[i].max_blocks} blocks)")

    def protected_blocks(self) -> int:
        """Leading full blocks no policy drops: the pinned prefix, and the sink block(s) unless
        `keep_sink_blocks` was set to 0 (window-only dropping, for comparison in benchmarks)."""
        B = self.config.block_size
        return max(self.keep_sink_blocks, -(-self.protected_tokens // B))

    def protected_tokens_floor(self) -> int:
        return self.protected_blocks() * self.config.block_size

    def make_room(self, n_tokens: int) -> int:
        """Apply the overflow policy so n_tokens more fit under `limit`; returns tokens dropped.

        Raises:
            ContextFull: under `stop`, or when the protected prefix leaves too little room.
        """
        if self.offset + n_tokens - self.limit <= 0:
            return 0
        dropped = self.policy.blocks_to_drop(self, n_tokens)
        self.drop_blocks(dropped)
        return len(dropped) * self.config.block_size

    def drop_blocks(self, dropped: np.ndarray) -> None:
        """Drop full blocks by index in every layer and keep positions contiguous."""
        if self.rerotate is None:
            raise ContextFull("this cache cannot move keys, so it cannot drop old tokens")
        B = self.config.block_size
        dropped = np.asarray(dropped, dtype=np.int64)
        for i, layer in enumerate(self.layers):
            layer.drop_blocks(dropped, lambda k, by, i=i: self.rerotate(i, k, by),
                              lambda i=i: self._allocate(i))
        keep = np.ones(len(self.token_ids), bool)
        for d in dropped:
            keep[d * B : (d + 1) * B] = False
        self.token_ids = [t for t, k in zip(self.token_ids, keep) if k]
        first = int(dropped[0])
        self.chain_end = first if self.chain_end is None else min(self.chain_end, first)
        del self.chain_keys[first:]
        self.n_published = min(self.n_published, first)
        self.dropped_tokens += B * len(dropped)

    # -- the prefix cache's side --------------------------------------------------------------
    def adopt_prefix(self, token_ids, keys: list[bytes], layer_blocks: list[list[int | None]],
                     sinks: list[tuple[np.ndarray, np.ndarray]] | None) -> None:
        """Start this empty sequence on cached full blocks.

        Args:
            token_ids: the len(keys) * B tokens the blocks hold.
            keys: their prefix-cache keys, already published.
            layer_blocks: per layer, the pool ids of the blocks (None where a sliding-window layer
                released one; see PagedLayerCache.attach).
            sinks: per layer the sink (K, V) saved with block 0, or None.
        """
        if self.offset:
            raise ValueError("adopt_prefix needs an empty sequence")
        for i, layer in enumerate(self.layers):
            sk, sv = sinks[i] if sinks is not None else (None, None)
            layer.attach(layer_blocks[i], sk, sv)
        self.token_ids = [int(t) for t in token_ids]
        self.history = list(self.token_ids)
        self.chain_keys = list(keys)
        self.n_published = len(keys)

    def mark_published(self, start: int, keys: list[bytes]) -> None:
        """Full blocks start .. start+len(keys)-1 are in the prefix cache under `keys`."""
        self.chain_keys[start:] = keys
        self.n_published = start + len(keys)

    # -- trimming back -------------------------------------------------------------------------
    def keep_exact(self, position: int | None) -> None:
        """A later trim back to `position` tokens should leave the cache as one that never held
        the later tokens (a regenerated answer trims back to its prompt): each layer keeps the
        rows of the block holding `position` as they were before it was quantized, once it
        fills (`PagedLayerCache.keep_exact`: one block's rows per layer). None: no block."""
        for layer in self.layers:
            layer.keep_exact(position)

    def exact_trim_point(self, target: int) -> int:
        """The most tokens, at most `target`, that `trim` can keep leaving the cache as one that
        never held the later tokens: `target` when no layer reopens a quantized block whose
        rows it did not keep (`PagedLayerCache.trims_exactly`), else the start of target's
        block (the blocks before it are as they were when they filled; the tokens after are
        computed again)."""
        if all(layer.trims_exactly(target) for layer in self.layers):
            return target
        return target - target % self.config.block_size

    # -- bookkeeping ---------------------------------------------------------------------------
    def trim(self, n: int) -> None:
        before = self.offset
        super().trim(n)
        del self.token_ids[self.offset :]
        del self.history[len(self.history) - (before - self.offset) :]
        n_full = self.offset // self.config.block_size
        del self.chain_keys[n_full:]
        self.n_published = min(self.n_published, n_full)

    @property
    def nbytes(self) -> int:
        """Bytes this sequence holds: the rows of its blocks plus each layer's tail and sink
        buffers (sizes of the allocated arrays, not the formula). Shared blocks count fully."""
        total = 0
        for pool, layer in zip(self.pools, self.layers):
            total += len(layer.block_table) * (pool.k_row_bytes + pool.v_row_bytes) + layer.nbytes
        return total

    @property
    def capacity_bytes(self) -> int:
        """Bytes allocated: whole pool slabs (in use, cached or free) plus tail/sink buffers."""
        return sum(p.nbytes for p in self.pools) + sum(layer.nbytes for layer in self.layers)

    def release(self) -> None:
        """Return every block (the prefix cache keeps the ones it holds, tails evicted first)."""
        if self.prefix_cache is not None:
            self.prefix_cache.touch(reversed(self.chain_keys))
        for layer in self.layers:
            layer.release()
        self.token_ids.clear()
        self.history.clear()
        self.chain_keys.clear()
        self.n_published = 0
        self.chain_end = None
