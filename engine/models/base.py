"""Pieces every architecture shares: RoPE tables and layout, activations, and the forward-pass
skeleton (the norm and rotation kernels themselves are `engine.kernels.norms`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedModel
from ..gguf_file import GGUFError
from ..kernels import helper
from ..kernels.norms import apply_rope
from ..kv.cache import FullPrecisionCache, KVCache
from ..weights import LinearGroup, WeightStore


def silu(x: np.ndarray) -> np.ndarray:
    """x / (1 + exp(-x)), the same ufuncs in the same order as the expression, in one buffer
    (a prefill chunk's (T, ffn) activations are tens of MiB: each temporary costs page faults)."""
    t = np.negative(x)
    np.exp(t, out=t)
    np.add(t, 1.0, out=t)
    return np.divide(x, t, out=t)


# Rows of a gated activation from which it is computed in pieces shared with the helper thread
# (numpy's ufuncs release the GIL).
SHARED_ACTIVATION_ROWS = 64
# Values per piece: the piece's gate, up, output and the activation's temporary (4 x 256 KiB) stay
# in the core's L2 through the activation's five passes. A 1B shape's 512 x 8192 activations, one
# thread, 256 rows: in four pieces 4.9 ms, in pieces of 8 rows 3.1-3.5 ms (2026-12-07, Xeon).
ACTIVATION_PIECE_VALUES = 65536


def gated(activation, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """activation(gate) * up for (T, ffn) float32 arrays, the same operations row by row; long
    inputs in pieces of rows taken by this thread and the helper (`kernels.helper.share`), each
    written over its rows of gate (gate is consumed): a 512-token prefill's gate, up and output
    of a 1B shape are 16 MiB each, and the third array set the process's peak memory."""
    T = gate.shape[0]
    if gate.ndim != 2 or T < SHARED_ACTIVATION_ROWS:
        h = activation(gate)
        h *= up
        return h

    def piece(r0: int, r1: int) -> None:  # (activation() reads its rows before they are written)
        np.multiply(activation(gate[r0:r1]), up[r0:r1], out=gate[r0:r1])

    helper.share_rows(piece, T, max(1, ACTIVATION_PIECE_VALUES // gate.shape[1]))
    return gate


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(np.sqrt(2.0 / np.pi))
    return 0.5 * x * (1.0 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


class GatedMLP:
    """The feed-forward block of every family here: ffn_down(activation(ffn_gate x) * ffn_up x),
    gate and up as one group of products (x quantized once). args: the model's, with dim and
    ffn_dim."""

    def __init__(self, args, w: WeightStore, prefix: str, activation):
        self.ffn_gate = w.linear(f"{prefix}.ffn_gate.weight", args.ffn_dim, args.dim)
        self.ffn_up = w.linear(f"{prefix}.ffn_up.weight", args.ffn_dim, args.dim)
        self.ffn_down = w.linear(f"{prefix}.ffn_down.weight", args.dim, args.ffn_dim)
        self.gate_up = LinearGroup((self.ffn_gate, self.ffn_up))
        self.activation = activation

    def __call__(self, x: np.ndarray) -> np.ndarray:
        gate, up = self.gate_up(x)
        h = gated(self.activation, gate, up)
        del gate, up  # (up is not needed by the down product; h may be gate's buffer)
        return self.ffn_down(h)


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
