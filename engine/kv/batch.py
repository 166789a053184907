"""Several sequences decoded in one forward pass (continuous batching, `engine.serve`).

`DecodeBatch` is a KVCache over n sequences that each append one token. The model runs its
usual `hidden` over the (n,) new tokens, so every linear layer gets (n, dim) rows: one pass over
the weights for the whole batch. Row i's position is sequence i's own offset (`positions`), and
each layer's attention is done per sequence, row i against sequence i's layer cache, through
that cache's own decode path: the arithmetic each row sees is the arithmetic of the sequence
decoded alone, as long as the linear layers compute each row of x independently of the others
(`weights.QuantLinear`'s fused kernels for up to MATVEC_MAX_ROWS rows; larger batches go through
BLAS, whose rounding may differ in the last bits).
"""

from __future__ import annotations

import numpy as np

from ..errors import ContextFull, KVPoolFull
from .cache import KVCache, LayerKVCache


class DecodeBatchLayer(LayerKVCache):
    """One layer of a DecodeBatch: row i of q, k, v goes to sequence i's layer cache."""

    def __init__(self, layers: list[LayerKVCache]):
        self.layers = layers

    @property
    def offset(self) -> int:  # pragma: no cover - positions come from DecodeBatch.positions
        raise TypeError("a decode batch has one offset per sequence (use DecodeBatch.positions)")

    def attend(self, q, k, v, *, scale, window):
        n, H, _ = q.shape
        if n != len(self.layers):
            raise ValueError(f"{n} query rows for a batch of {len(self.layers)} sequences")
        out = None
        for i, layer in enumerate(self.layers):
            o = layer.attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], scale=scale, window=window)  # (1, H, Dv)
            if out is None:
                out = np.empty((n, H, o.shape[-1]), np.float32)
            out[i] = o[0]
        return out

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def trim(self, n: int) -> None:
        raise TypeError("trim the sequences of a decode batch one by one")


class DecodeBatch(KVCache):
    """n sequences' caches, one new token each, for one `model.forward(tokens (n,), batch, "all")`.

    `begin_forward` first checks that every sequence has room for its token (its context limit
    and its layers' pools, evicting unused cached blocks when the pools are shared), so that a
    failure (ContextFull, KVPoolFull) leaves every sequence unchanged; then each sequence's own
    `begin_forward` records its token. `end_forward` runs each sequence's (publishing the blocks
    that filled up to the prefix cache)."""

    def __init__(self, caches: list[KVCache]):
        if not caches:
            raise ValueError("a decode batch needs at least one sequence")
        n_layers = len(caches[0])
        if any(len(c) != n_layers for c in caches):
            raise ValueError("the sequences of a decode batch must have the same layers")
        super().__init__([DecodeBatchLayer([c[i] for c in caches]) for i in range(n_layers)])
        self.caches = caches

    def positions(self, n_tokens: int) -> np.ndarray:
        if n_tokens != len(self.caches):
            raise ValueError(f"{n_tokens} tokens for a batch of {len(self.caches)} sequences (one each)")
        return np.array([c.offset for c in self.caches], dtype=np.int64)

    @property
    def offset(self) -> int:
        raise TypeError("a decode batch has one offset per sequence (use positions)")

    def begin_forward(self, tokens: np.ndarray) -> None:
        if len(tokens) != len(self.caches):
            raise ValueError(f"{len(tokens)} tokens for a batch of {len(self.caches)} sequences (one each)")
        for cache in self.caches:
            if cache.limit is not None and not cache.can_drop and cache.offset + 1 > cache.limit:
                raise ContextFull(f"a sequence of the batch is at its context limit of {cache.limit:,} tokens")
        self._reserve()  # nothing changes until every sequence has room
        for cache, token in zip(self.caches, tokens):
            cache.begin_forward(np.asarray([token]))

    def _reserve(self) -> None:
        """Room for one token in every sequence at once: the blocks the sequences over one pool
        need together (a shared pool must have all of them free, not each one's alone).

        Raises:
            KVPoolFull: naming the layer whose pool is short.
        """
        needs: dict[int, list] = {}  # id(pool) -> [pool, blocks needed, layer index, prefix cache]
        for cache in self.caches:
            pools = getattr(cache, "pools", None)
            if pools is None:
                continue  # a plain cache grows without a pool
            for i, (pool, layer) in enumerate(zip(pools, cache.layers)):
                entry = needs.setdefault(id(pool), [pool, 0, i, getattr(cache, "prefix_cache", None)])
                entry[1] += layer.blocks_needed(1)
        short = [e for e in needs.values() if e[1] > e[0].n_free]
        for pool, n, layer, prefix_cache in short:
            if prefix_cache is not None:
                prefix_cache.evict(layer_needs={layer: n})
        for pool, n, layer, _ in short:
            if n > pool.n_free:
                raise KVPoolFull(f"the KV cache of layer {layer} is full ({pool.max_blocks} blocks)")

    def end_forward(self) -> None:
        for cache in self.caches:
            cache.end_forward()
