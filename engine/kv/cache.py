"""KV cache objects. The model never looks inside: each attention layer calls `attend` on its
layer cache with the new tokens' q, k, v and gets the attention output back."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .attention import grouped_attention


class LayerKVCache(ABC):
    """One layer's keys and values for one sequence."""

    offset: int  # tokens stored so far (= the next token's position)

    @abstractmethod
    def attend(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float, window: int | None
    ) -> np.ndarray:
        """Store k, v for the T new tokens (positions offset .. offset+T-1), then attend.

        Args:
            q: (T, H, D) float32; k: (T, Hkv, D); v: (T, Hkv, Dv).
        Returns:
            (T, H, Dv) float32: each new token attends causally to every stored token it sees.
        """

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of the buffers actually allocated."""

    @abstractmethod
    def trim(self, n: int) -> None:
        """Forget the last n tokens."""


class FullPrecisionLayerCache(LayerKVCache):
    """K and V rounded to float16 values (as llama.cpp's default cache) in a growing buffer.

    The rounded values are kept as float32: a float16 buffer would be converted whole to float32
    on every decode step, work of the order of the attention itself.
    """

    def __init__(self, n_kv_heads: int, head_dim: int, value_dim: int, capacity: int = 256):
        self.n_kv_heads, self.head_dim, self.value_dim = n_kv_heads, head_dim, value_dim
        self.offset = 0
        self._keys = np.empty((n_kv_heads, capacity, head_dim), np.float32)  # (Hkv, cap, D)
        self._values = np.empty((n_kv_heads, capacity, value_dim), np.float32)  # (Hkv, cap, Dv)

    def _reserve(self, n_tokens: int) -> None:
        capacity = self._keys.shape[1]
        if n_tokens <= capacity:
            return
        new_capacity = max(n_tokens, capacity * 2)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = np.empty((old.shape[0], new_capacity, old.shape[2]), old.dtype)
            new[:, : self.offset] = old[:, : self.offset]
            setattr(self, name, new)

    def attend(self, q, k, v, *, scale, window):
        T = q.shape[0]
        start = self.offset
        self._reserve(start + T)
        self._keys[:, start : start + T] = k.transpose(1, 0, 2).astype(np.float16)
        self._values[:, start : start + T] = v.transpose(1, 0, 2).astype(np.float16)
        self.offset = start + T
        # A sliding-window layer's first query never sees further back than window - 1 tokens.
        first = 0 if window is None else max(0, start - window + 1)
        q_positions = np.arange(start, start + T)
        k_positions = np.arange(first, self.offset)
        return grouped_attention(
            q,
            self._keys[:, first : self.offset],
            self._values[:, first : self.offset],
            q_positions,
            k_positions,
            scale=scale,
            window=window,
        )

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._values.nbytes

    def trim(self, n: int) -> None:
        self.offset = max(0, self.offset - n)


class KVCache:
    """All layers' caches for one sequence.

    Context limit: a plain cache has none (`limit` None: the model's context is the bound) and
    never drops tokens; the paged cache sets `limit`, `overflow` and counts `dropped_tokens`.
    """

    limit: int | None = None
    overflow: str = "stop"
    dropped_tokens: int = 0

    def __init__(self, layers: list[LayerKVCache]):
        self.layers = layers

    @property
    def can_drop(self) -> bool:
        """Whether appending past `limit` drops older tokens instead of failing."""
        return self.limit is not None and self.overflow != "stop"

    def protected_tokens_floor(self) -> int:
        """Leading tokens no overflow policy may drop (0 for a cache that never drops)."""
        return 0

    @property
    def capacity_bytes(self) -> int:
        """Bytes allocated (a plain cache holds exactly what it allocated)."""
        return self.nbytes

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def offset(self) -> int:
        return self.layers[0].offset if self.layers else 0

    def positions(self, n_tokens: int) -> np.ndarray:
        """(n_tokens,) positions of the tokens a forward pass appends next: offset, offset+1, ...
        (a batch of sequences, `kv.batch.DecodeBatch`, gives each row its own sequence's offset)."""
        return self.offset + np.arange(n_tokens)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def trim(self, n: int) -> None:
        for layer in self.layers:
            layer.trim(n)

    # Hooks around one model forward pass over new tokens. The paged cache uses them to make
    # room (overflow policy, pool eviction) before any layer changes and to publish the blocks
    # that filled up to the prefix cache afterwards; a plain cache has nothing to do.
    def begin_forward(self, tokens: np.ndarray) -> None:
        """Called with the (T,) token ids about to be appended, before the first layer runs."""

    def end_forward(self) -> None:
        """Called after the last layer stored the new tokens."""


def FullPrecisionCache(n_layers: int, n_kv_heads: int, head_dim: int, value_dim: int | None = None) -> KVCache:
    """A plain float16 cache for every layer."""
    value_dim = head_dim if value_dim is None else value_dim
    return KVCache([FullPrecisionLayerCache(n_kv_heads, head_dim, value_dim) for _ in range(n_layers)])
