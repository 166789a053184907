"""Pieces every architecture shares: norms, RoPE, activations, and the forward-pass skeleton."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedModel
from ..gguf_file import GGUFError
from ..kernels import background
from ..kv.cache import FullPrecisionCache, KVCache

# the background group (`engine.kernels.background`) that compiles `_rms_rows` on a first start;
# until it is ready rms_norm takes the numpy expression (the same results)
NORM_KERNELS = "norms"


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (..., D) / sqrt(mean(x²) + eps) * weight (D,).

    The mean is np.mean's own arithmetic (pairwise sum, then one division by D). Float32 arrays go
    through one compiled call (`_rms_rows`, bit-identical): on a decode step's single row the five
    numpy operations' call overhead is several times their arithmetic, and a step has two norms
    per layer."""
    if (_rms_rows is not None and type(x) is np.ndarray and x.dtype == np.float32 and x.size
            and x.flags.c_contiguous and weight.dtype == np.float32 and weight.shape == x.shape[-1:]
            and not _norms_compiling()):
        rows = x.reshape(-1, x.shape[-1])
        out = np.empty_like(rows)
        _rms_rows(rows, np.ascontiguousarray(weight), np.float32(eps), out)
        return out.reshape(x.shape)
    ms = np.add.reduce(np.square(x), axis=-1, keepdims=True) / np.float32(x.shape[-1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps))) * weight


def _norms_compiling() -> bool:
    if background.pending(NORM_KERNELS):
        background.count_fallback(NORM_KERNELS)
        return True
    return False


def _compile_norms() -> None:
    """Compile, or load from numba's cache, `_rms_rows` (the NORM_KERNELS group's target)."""
    if _rms_rows is not None:
        _rms_rows(np.ones((2, 9), np.float32), np.ones(9, np.float32), np.float32(1e-6), np.empty((2, 9), np.float32))


def silu(x: np.ndarray) -> np.ndarray:
    """x / (1 + exp(-x)), the same ufuncs in the same order as the expression, in one buffer
    (a prefill chunk's (T, ffn) activations are tens of MiB: each temporary costs page faults)."""
    t = np.negative(x)
    np.exp(t, out=t)
    np.add(t, 1.0, out=t)
    return np.divide(x, t, out=t)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(np.sqrt(2.0 / np.pi))
    return 0.5 * x * (1.0 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


def rope_tables(positions: np.ndarray, dim: int, base: float, freq_scale: float = 1.0,
                freq_factors: np.ndarray | None = None):
    """cos, sin of shape (T, dim // 2) for rotating pairs i = 0 .. dim/2 - 1.

    Pair i turns by position * freq_scale * base^(-2i/dim) / freq_factors[i] (llama.cpp's
    ggml_rope_ext without YaRN: `freq_scale` is linear scaling, `freq_factors` the per-pair
    divisors of a `rope_freqs` tensor, Llama 3.1/3.2's frequency scaling)."""
    inv_freq = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # (dim/2,)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    angles = (np.asarray(positions).astype(np.float64) * freq_scale)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# rope.scaling.type values the rotation implements. llama.cpp reads a missing type as "linear"
# (a `rope.scaling.factor` alone scales linearly) and never scales under "none".
ROPE_SCALING_TYPES = ("none", "linear")


class UnsupportedRopeScaling(UnsupportedModel, GGUFError):
    """A file whose RoPE scaling type (or factor) the rotation does not implement."""


def rope_freq_scale(g, arch: str) -> float:
    """The linear RoPE frequency scale (1 / `rope.scaling.factor`) a file asks for, read as
    llama.cpp reads it. Scaling types the rotation does not implement (yarn, longrope, anything
    unknown) are refused: rotating as if unscaled would compute a different model silently."""
    kind = g.get(f"{arch}.rope.scaling.type")
    kind = "linear" if kind is None else str(kind).strip().lower()
    if kind not in ROPE_SCALING_TYPES:
        raise UnsupportedRopeScaling(
            f"{g.path.name}: RoPE scaling type {kind!r} ({arch}.rope.scaling.type) is not supported; "
            f"supported: {', '.join(ROPE_SCALING_TYPES)}"
        )
    factor = g.get(f"{arch}.rope.scaling.factor")
    if factor is None:
        factor = g.get(f"{arch}.rope.scale_linear")  # the older key for the same factor
    factor = float(factor or 0.0)
    if kind == "none" or factor == 0.0:
        return 1.0
    if not np.isfinite(factor) or factor < 0:
        raise UnsupportedRopeScaling(f"{g.path.name}: {arch}.rope.scaling.factor is {factor}, not a positive number")
    return 1.0 / factor


@dataclass(frozen=True, eq=False)
class Rope:
    """One layer's rotary position embedding: which channels turn, how fast, in which layout.

    dim: channels rotated (the first `dim` of each head; the rest pass through).
    neox: pairs are halves (x[i], x[i + dim/2]) instead of adjacent (x[2i], x[2i+1]).
    freq_factors: (dim/2,) divisors of the pair frequencies (a `rope_freqs` tensor) or None.
    """

    dim: int
    base: float
    freq_scale: float = 1.0
    freq_factors: np.ndarray | None = None
    neox: bool = False

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return rope_tables(positions, self.dim, self.base, self.freq_scale, self.freq_factors)

    def rotate(self, x: np.ndarray, tables: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """x (T, heads, head_dim) rotated by the positions `tables` were made for."""
        cos, sin = tables
        r = self.dim
        if r == x.shape[-1]:
            return apply_rope(x, cos, sin, self.neox)
        return np.concatenate([apply_rope(x[..., :r], cos, sin, self.neox), x[..., r:]], axis=-1)

    def rerotate(self, keys: np.ndarray, by: np.ndarray) -> np.ndarray:
        """Keys (T, heads, head_dim) already rotated, moved by `by` (T,) more positions: the
        angles are linear in position, so this equals rotating them at position + by."""
        return self.rotate(keys, self.tables(np.asarray(by)))


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
    # numpy's pairwise summation of float32 (loops_utils.h: blocks of at most 128 values, each
    # summed with 8 accumulators; longer runs split in two halves, the split a multiple of 8),
    # reproduced exactly so that `_rms_rows` equals the numpy expression bit for bit
    @njit(cache=True, nogil=True, inline="always")
    def _block_sum(a, lo, n):
        if n < 8:
            res = np.float32(0.0)
            for i in range(lo, lo + n):
                res += a[i]
            return res
        r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
        r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
        i = 8
        whole = n - n % 8
        while i < whole:
            r0 += a[lo + i]
            r1 += a[lo + i + 1]
            r2 += a[lo + i + 2]
            r3 += a[lo + i + 3]
            r4 += a[lo + i + 4]
            r5 += a[lo + i + 5]
            r6 += a[lo + i + 6]
            r7 += a[lo + i + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += a[lo + i]
            i += 1
        return res

    @njit(cache=True, nogil=True)
    def _pairwise_sum(a, work):
        """numpy's pairwise sum of a (float32), its recursion unrolled on an explicit stack (numba
        does not cache recursive functions reliably). work: (64, 3) int64 scratch."""
        values = np.empty(64, np.float32)
        work[0, 0], work[0, 1], work[0, 2] = 0, a.shape[0], 0  # (first, count, halves done)
        depth, n_values = 1, 0
        while depth:
            lo, n, done = work[depth - 1, 0], work[depth - 1, 1], work[depth - 1, 2]
            if n <= 128:
                values[n_values] = _block_sum(a, lo, n)
                n_values += 1
                depth -= 1
                continue
            half = n // 2
            half -= half % 8
            if done < 2:  # push the first, then the second half
                work[depth - 1, 2] = done + 1
                work[depth, 0] = lo if done == 0 else lo + half
                work[depth, 1] = half if done == 0 else n - half
                work[depth, 2] = 0
                depth += 1
            else:  # both halves summed: left + right
                values[n_values - 2] = values[n_values - 2] + values[n_values - 1]
                n_values -= 1
                depth -= 1
        return values[0]

    @njit(cache=True, nogil=True)
    def _rms_rows(x, weight, eps, out):
        """out[t] = x[t] * (1 / sqrt(sum(x[t]²) / D + eps)) * weight, row by row: x, out (T, D)
        float32 C-contiguous, weight (D,) float32; the same operations in the same order as the
        numpy expression in `rms_norm` (no fused multiply-add), so the same results."""
        D = x.shape[1]
        squares = np.empty(D, np.float32)
        work = np.empty((64, 3), np.int64)
        for t in range(x.shape[0]):
            for d in range(D):
                squares[d] = x[t, d] * x[t, d]
            ms = (np.float32(0.0) + _pairwise_sum(squares, work)) / np.float32(D)
            inv = np.float32(1.0) / np.sqrt(ms + eps)
            for d in range(D):
                out[t, d] = x[t, d] * inv * weight[d]
except ImportError:  # pragma: no cover - numba is a dependency; the numpy path stays the reference
    _rope_one = None
    _rms_rows = None


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
    def args_from_gguf(cls, gguf):
        """The architecture's arguments from metadata alone (no weights are read): what the fit
        check and `omlx info` need before a load. Every architecture answers through its `Model`
        class, so a subclass that shares its parent's arguments inherits this too."""

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
