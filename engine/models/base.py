"""Pieces every architecture shares: norms, RoPE, activations, and the forward-pass skeleton."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from ..kv.cache import FullPrecisionCache, KVCache


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (..., D) / sqrt(mean(x²) + eps) * weight (D,).

    The mean is np.mean's own arithmetic (pairwise sum, then one division by D) without its
    Python-level wrapper, which cost more than the sum on decode's single rows."""
    ms = np.add.reduce(np.square(x), axis=-1, keepdims=True) / np.float32(x.shape[-1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(np.sqrt(2.0 / np.pi))
    return 0.5 * x * (1.0 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


def rope_tables(positions: np.ndarray, dim: int, base: float, freq_scale: float = 1.0):
    """cos, sin of shape (T, dim // 2) for rotating pairs i = 0 .. dim/2 - 1."""
    inv_freq = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # (dim/2,)
    angles = (positions.astype(np.float64) * freq_scale)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """Rotate x (T, heads, dim) by position.

    neox=False: pairs are adjacent (x[2i], x[2i+1]) — llama in GGUF (converter permuted Q/K rows).
    neox=True:  pairs are halves (x[i], x[i + dim/2]) — gemma3, qwen2, ...
    """
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, dim/2)
    if x.shape[0] == 1 and x.dtype == np.float32 and _rope_one is not None:  # decode: one call
        out = np.empty_like(x)
        _rope_one(np.ascontiguousarray(x[0]), cos[0], sin[0], neox, out[0])
        return out
    if neox:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


try:
    from numba import njit

    @njit(cache=True, nogil=True)
    def _rope_one(x, cos, sin, neox, out):
        """apply_rope of one token: x, out (heads, dim) float32; cos, sin (dim/2,). The same
        products and sums as the numpy path (no fused multiply-add), so the same results."""
        half = cos.shape[0]
        for h in range(x.shape[0]):
            for i in range(half):
                if neox:
                    a, b = x[h, i], x[h, i + half]
                else:
                    a, b = x[h, 2 * i], x[h, 2 * i + 1]
                ra = a * cos[i] - b * sin[i]
                rb = a * sin[i] + b * cos[i]
                if neox:
                    out[h, i], out[h, i + half] = ra, rb
                else:
                    out[h, 2 * i], out[h, 2 * i + 1] = ra, rb
except ImportError:  # pragma: no cover - numba is a dependency; the numpy path stays the reference
    _rope_one = None


@dataclass(frozen=True)
class KVGeometry:
    """What sizes a model's KV cache: read from metadata alone, without loading weights."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    value_dim: int
    windows: tuple[int | None, ...]  # per layer: sliding window, or None for full attention
    context_length: int

    def bytes_per_token(self, bytes_per_value: float = 2.0) -> float:
        return self.n_layers * self.n_kv_heads * (self.head_dim + self.value_dim) * bytes_per_value


class BaseModel(ABC):
    """A decoder-only transformer. Subclasses build layers from GGUF tensors and define `hidden`.

    Attributes every architecture sets: n_layers, n_heads, n_kv_heads, head_dim, value_dim,
    vocab_size, context_length, dim.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    value_dim: int
    vocab_size: int
    context_length: int
    dim: int
    architecture: str

    @classmethod
    @abstractmethod
    def from_gguf(cls, gguf) -> "BaseModel": ...

    @abstractmethod
    def hidden(self, tokens: np.ndarray, cache: KVCache) -> np.ndarray:
        """Run the layers over new tokens (T,) appended to `cache`; returns (T, dim) after the
        final norm."""

    @abstractmethod
    def output(self, h: np.ndarray) -> np.ndarray:
        """(n, dim) → (n, vocab) logits."""

    def forward(self, tokens, cache: KVCache, logits_for: str | np.ndarray = "last") -> np.ndarray:
        """Append `tokens` to `cache` and return logits.

        Args:
            tokens: (T,) token ids, positions cache.offset .. cache.offset + T - 1.
            logits_for: "last" → (1, vocab); "all" → (T, vocab); an index array → (n, vocab).
                Only those rows go through the (vocab × dim) output projection.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        cache.begin_forward(tokens)  # room for all layers or none: layers must not get out of step
        h = self.hidden(tokens, cache)
        cache.end_forward()
        if isinstance(logits_for, str):
            if logits_for == "last":
                h = h[-1:]
            elif logits_for != "all":
                raise ValueError(f"logits_for must be 'last', 'all' or indices, not {logits_for!r}")
        else:
            h = h[np.asarray(logits_for)]
        if h.shape[0] == 0:
            return np.empty((0, self.vocab_size), np.float32)
        return self.output(h)

    @property
    def kv_geometry(self) -> KVGeometry:
        return self.args.kv_geometry()

    def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> float:
        """K + V bytes per token over all layers at `bytes_per_value` (2 = float16)."""
        return self.kv_geometry.bytes_per_token(bytes_per_value)

    def new_cache(self, kv=None, *, max_tokens: int | None = None, use_kernels: bool | None = None,
                  **paged_options) -> KVCache:
        """A cache for one sequence: the paged cache for a KVConfig (or spec string), the plain
        float16 reference cache for None. `paged_options` go to PagedKVCache (limit, overflow,
        protected_tokens, pools, prefix_cache)."""
        if kv is None:
            return FullPrecisionCache(self.n_layers, self.n_kv_heads, self.head_dim, self.value_dim)
        from ..kv.config import parse_kv
        from ..kv.paged import PagedKVCache

        return PagedKVCache(
            parse_kv(kv) if not hasattr(kv, "per_layer") else kv,
            n_layers=self.n_layers, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            value_dim=self.value_dim, windows=[self.layer_window(i) for i in range(self.n_layers)],
            max_tokens=max_tokens, use_kernels=use_kernels, rerotate=self.rerotate_keys, **paged_options,
        )

    def rerotate_keys(self, layer: int, keys: np.ndarray, by: np.ndarray) -> np.ndarray:
        """Move stored (post-RoPE) keys (T, Hkv, D) of `layer` by `by` (T,) positions: RoPE
        rotations compose, so rotating by `by` equals having computed them `by` later. Used when
        the cache drops older tokens and the rest move down to stay inside the trained context."""
        raise NotImplementedError(f"{self.architecture} cannot re-position cached keys")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer, or None for full attention."""
        return None
