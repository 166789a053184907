"""Several sequences in one forward pass (continuous batching, `engine.serve`).

A `SequenceBatch` is a KVCache over n sequences that each append their own number of new tokens:
the model runs its usual `hidden` over the concatenated (sum of n_i,) tokens, so every linear
layer gets all their rows at once, one pass over the weights for the whole batch. The rows of
sequence i get sequence i's own positions (`positions`), and each layer's attention is done per
sequence, sequence i's rows against sequence i's layer cache, through that cache's own `attend`
(a decode step's single tokens over one pool in one compiled call instead, shared between
threads: `PagedLayerCache.attend_tokens`): the attention arithmetic each sequence sees is the
arithmetic of the same call made alone.

    DecodeBatch    one new token per sequence (a decode step)
    PrefillBatch   a chunk of each sequence's prompt (several prompts prefilled together)

Whether the whole pass equals each sequence's own pass depends on the linear layers computing
each row of x independently of the others: `weights.QuantLinear`'s fused kernels do so for up to
MATVEC_MAX_ROWS rows, and `weights.DenseLinear` (one product per row up to its
MAX_ROWS_ALONE); BLAS (the path for more rows) sums each row of a large enough product in
an order that does not depend on how many rows there are, but differently from the fused
kernels and from its own small-product paths. So a decode batch is exact up to the smaller of
the two (the scheduler's DECODE_GROUP sequences per pass), and a prefill batch when every
sequence's chunk alone would also have taken BLAS's large-product path (the scheduler's rule,
`serve.scheduler.min_batched_chunk`).
"""

from __future__ import annotations

import numpy as np

from ..errors import ContextFull, KVPoolFull
from .cache import KVCache, LayerKVCache


class BatchLayer(LayerKVCache):
    """One layer of a SequenceBatch: rows bounds[i]:bounds[i+1] of q, k, v go to sequence i's
    layer cache."""

    def __init__(self, layers: list[LayerKVCache], bounds: np.ndarray):
        self.layers = layers
        self.bounds = bounds  # (n+1,) row offsets of each sequence's rows

    @property
    def offset(self) -> int:  # pragma: no cover - positions come from SequenceBatch.positions
        raise TypeError("a batch has one offset per sequence (use its positions)")

    def attend(self, q, k, v, *, scale, window):
        T, H, _ = q.shape
        if T != self.bounds[-1]:
            raise ValueError(f"{T} query rows for a batch of {self.bounds[-1]} new tokens")
        together = getattr(self.layers[0], "attend_tokens", None)
        if together is not None and T == len(self.layers) > 1:  # one token each: a decode step
            out = together(self.layers, q, k, v, scale=scale, window=window)
            if out is not None:
                return out
        out = None
        for i, layer in enumerate(self.layers):
            a, b = self.bounds[i], self.bounds[i + 1]
            o = layer.attend(q[a:b], k[a:b], v[a:b], scale=scale, window=window)  # (b - a, H, Dv)
            if out is None:
                out = np.empty((T, H, o.shape[-1]), np.float32)
            out[a:b] = o
        return out

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def trim(self, n: int) -> None:
        raise TypeError("trim the sequences of a batch one by one")


class SequenceBatch(KVCache):
    """n sequences' caches appending counts[i] new tokens each, for one
    `model.forward(tokens (sum(counts),), batch, ...)` whose tokens are sequence 0's, then
    sequence 1's, and so on.

    `begin_forward` first checks that every sequence has room for its tokens (its context limit
    and its layers' pools, evicting unused cached blocks when the pools are shared), so that a
    failure (ContextFull, KVPoolFull) leaves every sequence unchanged; then each sequence's own
    `begin_forward` records its tokens. `end_forward` runs each sequence's (publishing the blocks
    that filled up to the prefix cache)."""

    def __init__(self, caches: list[KVCache], counts):
        if not caches:
            raise ValueError("a batch needs at least one sequence")
        counts = [int(n) for n in counts]
        if len(counts) != len(caches):
            raise ValueError(f"{len(counts)} token counts for {len(caches)} sequences")
        if any(n < 1 for n in counts):
            raise ValueError(f"every sequence of a batch appends at least one token, not {counts}")
        n_layers = len(caches[0])
        if any(len(c) != n_layers for c in caches):
            raise ValueError("the sequences of a batch must have the same layers")
        self.bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        super().__init__([BatchLayer(list(layers), self.bounds) for layers in zip(*(c.layers for c in caches))])
        self.caches = caches
        self.counts = counts

    @property
    def n_tokens(self) -> int:
        return int(self.bounds[-1])

    def _check_tokens(self, n_tokens: int) -> None:
        if n_tokens != self.n_tokens:
            raise ValueError(f"{n_tokens} tokens for a batch of {self.n_tokens} new tokens "
                             f"({', '.join(map(str, self.counts))} per sequence)")

    def positions(self, n_tokens: int) -> np.ndarray:
        self._check_tokens(n_tokens)
        return np.concatenate([c.offset + np.arange(n) for c, n in zip(self.caches, self.counts)])

    @property
    def offset(self) -> int:
        raise TypeError("a batch has one offset per sequence (use positions)")

    def begin_forward(self, tokens: np.ndarray) -> None:
        self._check_tokens(len(tokens))
        for cache, n in zip(self.caches, self.counts):
            if cache.limit is not None and not cache.can_drop and cache.offset + n > cache.limit:
                raise ContextFull(f"a sequence of the batch cannot take {n} more tokens: "
                                  f"{cache.offset:,} of its context limit of {cache.limit:,} are used")
        self._reserve()  # nothing changes until every sequence has room
        for i, cache in enumerate(self.caches):
            cache.begin_forward(np.asarray(tokens[self.bounds[i] : self.bounds[i + 1]]))

    def _reserve(self) -> None:
        """Room for every sequence's tokens at once: the blocks the sequences over one pool need
        together (a shared pool must have all of them free, not each one's alone).

        Raises:
            KVPoolFull: naming the layer whose pool is short.
        """
        needs: dict[int, list] = {}  # id(pool) -> [pool, blocks needed, layer index, prefix cache]
        for cache, n_new in zip(self.caches, self.counts):
            pools = getattr(cache, "pools", None)
            if pools is None:
                continue  # a plain cache grows without a pool
            for i, (pool, layer) in enumerate(zip(pools, cache.layers)):
                n = layer.blocks_needed(n_new)
                if n:
                    entry = needs.get(id(pool))
                    if entry is None:
                        needs[id(pool)] = [pool, n, i, getattr(cache, "prefix_cache", None)]
                    else:
                        entry[1] += n
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


class DecodeBatch(SequenceBatch):
    """n sequences' caches, one new token each, for one `model.forward(tokens (n,), batch, "all")`."""

    def __init__(self, caches: list[KVCache]):
        if not caches:
            raise ValueError("a decode batch needs at least one sequence")
        super().__init__(caches, [1] * len(caches))

    def _check_tokens(self, n_tokens: int) -> None:
        if n_tokens != len(self.caches):
            raise ValueError(f"{n_tokens} tokens for a batch of {len(self.caches)} sequences (one each)")

    def positions(self, n_tokens: int) -> np.ndarray:
        self._check_tokens(n_tokens)
        return np.array([c.offset for c in self.caches], dtype=np.int64)


class PrefillBatch(SequenceBatch):
    """n sequences' caches, a chunk of counts[i] prompt tokens each, for one pass over the
    concatenated chunks; `last_rows` are the rows of each sequence's last token (where its
    next-token logits come from)."""

    def last_rows(self) -> np.ndarray:
        """(n,) index of each sequence's last row in the batch's tokens."""
        return self.bounds[1:] - 1


class VerifyLayer(LayerKVCache):
    """One layer of a VerifyBatch: row i of q, k, v is stored and attended exactly as the decode
    step of that token alone would be (all rows in one compiled call where the layer's attention
    can, `PagedAttention.attend_rows`; else the layer's own one-token `attend`, in order), with
    out-of-window releases held back until the batch is finished (a rejected row may be trimmed
    back over blocks a window layer would otherwise have let go)."""

    def __init__(self, layer: LayerKVCache):
        self.layer = layer
        # A layer keeping attention mass (the `attention` overflow policy): the mass after each
        # row, so that a rollback keeps exactly the kept rows' contributions, summed as the
        # decode steps would have.
        self.mass_after: list[np.ndarray] = []

    @property
    def offset(self) -> int:
        return self.layer.offset

    def attend(self, q, k, v, *, scale, window):
        T, H, _ = q.shape
        track = getattr(self.layer, "track_attention", False)
        attend_rows = getattr(getattr(self.layer, "attention", None), "attend_rows", None)
        if attend_rows is not None and not track:  # all rows in one compiled call, when it applies
            out = attend_rows(self.layer, q, k, v, scale=scale, window=window)
            if out is not None:
                return out
        out = None
        for i in range(T):
            o = self.layer.attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], scale=scale, window=window)
            if out is None:
                out = np.empty((T, H, o.shape[-1]), np.float32)
            out[i] = o[0]
            if track:
                self.mass_after.append(self.layer.attn_mass.copy())
        return out

    def blocks_needed(self, n_tokens: int) -> int:
        return self.layer.blocks_needed(n_tokens)

    def roll_back_mass(self, n_kept: int) -> None:
        if self.mass_after and 0 < n_kept <= len(self.mass_after):
            self.layer.attn_mass = self.mass_after[n_kept - 1]
        self.mass_after = []

    @property
    def nbytes(self) -> int:
        return self.layer.nbytes

    def trim(self, n: int) -> None:
        raise TypeError("a verify batch is rolled back with VerifyBatch.finish")


class VerifyBatch(KVCache):
    """T tokens of one sequence in one forward pass whose every row equals the decode step of
    that token alone: the linear layers take all T rows at once (one pass over the weights; exact
    per row up to the model's `exact_rows`), each layer's attention runs the rows one by one
    through the sequence's one-token path. Speculative decoding verifies a draft this way and
    keeps a prefix of it: `finish(n_rejected)` trims the rest so that the cache equals one that
    never held them (the last filled block's rows come back exactly, `PagedLayerCache.trim`),
    then publishes full blocks and releases out-of-window ones as a normal forward pass would
    have.

    The draft must fit without the overflow policy dropping anything (`room`): a drop could not
    be undone."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        super().__init__([VerifyLayer(layer) for layer in cache.layers])
        self.limit = cache.limit
        self._deferred: list = []
        self._n_tokens = 0

    @property
    def pools(self):
        """The sequence's pools, so that a SequenceBatch of verify batches reserves every
        sequence's blocks before any is stored (`SequenceBatch._reserve`)."""
        return getattr(self.cache, "pools", None)

    @property
    def prefix_cache(self):
        return getattr(self.cache, "prefix_cache", None)

    @staticmethod
    def room(cache: KVCache) -> int:
        """Tokens a verify batch on `cache` may append (no drop, no context end)."""
        limit = cache.limit
        return (1 << 30) if limit is None else max(0, limit - cache.offset)

    def positions(self, n_tokens: int) -> np.ndarray:
        return self.cache.positions(n_tokens)

    def begin_forward(self, tokens: np.ndarray) -> None:
        if len(tokens) > self.room(self.cache):
            raise ContextFull(f"a draft of {len(tokens)} tokens does not fit: {self.cache.offset:,} of "
                              f"the context limit of {self.cache.limit:,} are used")
        self.cache.begin_forward(tokens)  # room for every row first (raises before any change)
        for layer in self.cache.layers:  # no release until the rejected rows are trimmed
            if hasattr(layer, "defer_release"):
                self._deferred.append((layer, layer.defer_release))
                layer.defer_release = True
        self._n_tokens = len(tokens)

    def end_forward(self) -> None:
        """Nothing yet: what a forward pass ends with happens in `finish`, after the rollback."""

    def finish(self, n_rejected: int) -> None:
        """Forget the last `n_rejected` rows, then end the forward pass for what stays."""
        try:
            if n_rejected:
                for layer in self.layers:
                    layer.roll_back_mass(self._n_tokens - n_rejected)
                self.cache.trim(n_rejected)
        finally:
            for layer, deferred in self._deferred:
                layer.defer_release = deferred
            self._deferred.clear()
        self.cache.end_forward()
        for layer in self.cache.layers:
            if hasattr(layer, "release_out_of_window") and not getattr(layer, "defer_release", False):
                layer.release_out_of_window()
