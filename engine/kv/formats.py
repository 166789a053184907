"""Storage formats for full KV-cache blocks: float16 passthrough and grouped 2..8-bit integers.

A block of one layer's keys (or values) is a float32 array (Hkv, T, D); a batch of blocks is
(n, Hkv, T, D). A format turns each block into ONE flat uint8 row, so a pool of blocks is a
single (n_blocks, bytes_per_block) uint8 array:

    row = [ packed codes | scales (float16) | mins (float16, asymmetric only) ]

    codes:  Hkv*T*D values in (Hkv, T, D) order, `bits` bits each, packed LSB-first
            (see `pack_codes`), padded with zero codes to a multiple of 8 values.
    scales: one per group, in group order (see below).
    mins:   one per group, same order.

Groups ("axis"):
    token    groups of G consecutive values along D, per token: (Hkv, T, D/G) groups of G.
             G is min(group, D) and must divide D.
    channel  one group per (head, channel) over the block's T tokens (KIVI-style keys):
             (Hkv, D) groups of T.

Code <-> value (q is the unsigned b-bit code, levels = 2**b):
    asymmetric  x ~ min + scale*q,                q in [0, levels-1]
                min is rounded DOWN and scale UP to float16, so every x of the group lies in
                [min, min + scale*(levels-1)] and |x - x~| <= scale/2 (+ float32 rounding).
    symmetric   x ~ scale*(q - levels/2),         q in [1, levels-1] (0 unused, as q8_0)
                scale = max|x| / (levels/2 - 1), rounded UP to float16: |x - x~| <= scale/2.
A constant group stores scale 0 and decodes to its float16-rounded value; zeros decode to zeros.
Inputs are expected finite; magnitudes beyond float16 range (65504) saturate.

Rotation: `hadamard(D)` is an orthonormal (D, D) matrix; the caller may store k @ H and use
q @ H for the scores (q·k is unchanged) to spread outlier channels before quantizing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "FORMATS",
    "Float16Format",
    "KVFormat",
    "get_format",
    "hadamard",
    "pack_codes",
    "unpack_codes",
]

_F16_MAX = np.float32(65504.0)

# Codes are packed as one LSB-first bit stream: value i occupies stream bits [i*b, (i+1)*b), and
# stream bit j is bit (j % 8) of byte j // 8. A chunk of k values (k*b a multiple of 8) is one
# little-endian word. Per chunk (vN[hi:lo] = bits hi..lo of value N, lowest bit first):
#
#   8-bit, 1 value  -> 1 byte:   b0 = v0
#   6-bit, 4 values -> 3 bytes:  b0 = v0[5:0] | v1[1:0]<<6
#                                b1 = v1[5:2] | v2[3:0]<<4
#                                b2 = v2[5:4] | v3[5:0]<<2
#   5-bit, 8 values -> 5 bytes:  b0 = v0[4:0] | v1[2:0]<<5
#                                b1 = v1[4:3] | v2[4:0]<<2 | v3[0]<<7
#                                b2 = v3[4:1] | v4[3:0]<<4
#                                b3 = v4[4]   | v5[4:0]<<1 | v6[1:0]<<6
#                                b4 = v6[4:2] | v7[4:0]<<3
#   4-bit, 2 values -> 1 byte:   b0 = v0 | v1<<4
#   3-bit, 8 values -> 3 bytes:  b0 = v0 | v1<<3 | v2[1:0]<<6
#                                b1 = v2[2] | v3<<1 | v4<<4 | v5[0]<<7
#                                b2 = v5[2:1] | v6<<2 | v7<<5
#   2-bit, 4 values -> 1 byte:   b0 = v0 | v1<<2 | v2<<4 | v3<<6
#
# bits -> (values per chunk, little-endian word type holding one chunk)
_CHUNKS: dict[int, tuple[int, np.dtype]] = {
    8: (1, np.dtype("u1")),
    7: (8, np.dtype("<u8")),
    6: (4, np.dtype("<u4")),
    5: (8, np.dtype("<u8")),
    4: (2, np.dtype("u1")),
    3: (8, np.dtype("<u4")),
    2: (4, np.dtype("u1")),
    1: (8, np.dtype("u1")),
}


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes into a little-endian bit stream, `bits` bits per code.

    Args:
        codes: (..., N) uint8, every code < 2**bits; N a multiple of 8.
        bits: 1..8.
    Returns:
        (..., N*bits//8) uint8.
    """
    if bits not in _CHUNKS:
        raise ValueError(f"cannot pack {bits}-bit codes (supported: 1..8)")
    codes = np.asarray(codes, dtype=np.uint8)
    *lead, n = codes.shape
    if n % 8:
        raise ValueError(f"the last axis ({n}) must be a multiple of 8 codes")
    if bits == 8:
        return codes.copy()
    k, word = _CHUNKS[bits]
    chunks = codes.reshape(*lead, n // k, k)  # (..., n/k, k)
    acc = chunks[..., 0].astype(word)  # (..., n/k)
    for i in range(1, k):
        acc |= chunks[..., i].astype(word) << word.type(i * bits)
    nbytes = k * bits // 8
    out = acc.view(np.uint8).reshape(*lead, n // k, word.itemsize)[..., :nbytes]
    return out.reshape(*lead, n * bits // 8)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `pack_codes`: (..., N*bits//8) uint8 -> (..., N) uint8."""
    if bits not in _CHUNKS:
        raise ValueError(f"cannot unpack {bits}-bit codes (supported: 1..8)")
    packed = np.asarray(packed, dtype=np.uint8)
    *lead, m = packed.shape
    if m % bits:
        raise ValueError(f"{m} bytes is not a whole number of {bits}-bit chunks")
    if bits == 8:
        return packed.copy()
    k, word = _CHUNKS[bits]
    nbytes = k * bits // 8
    n_chunks = m // nbytes
    chunks = packed.reshape(*lead, n_chunks, nbytes)  # (..., n/k, nbytes)
    if word.itemsize != nbytes:
        wide = np.zeros((*lead, n_chunks, word.itemsize), np.uint8)
        wide[..., :nbytes] = chunks
        chunks = wide
    words = np.ascontiguousarray(chunks).view(word)[..., 0]  # (..., n/k)
    mask = word.type((1 << bits) - 1)
    out = np.empty((*lead, n_chunks, k), np.uint8)
    for i in range(k):
        out[..., i] = (words >> word.type(i * bits)) & mask
    return out.reshape(*lead, n_chunks * k)


def _f16_up(a: np.ndarray) -> np.ndarray:
    """Smallest float16 >= a (a finite float32, clipped to the float16 range)."""
    a = np.clip(a, -_F16_MAX, _F16_MAX)
    h = a.astype(np.float16)
    return np.where(h.astype(np.float32) < a, np.nextafter(h, np.float16(np.inf)), h)


def _f16_down(a: np.ndarray) -> np.ndarray:
    """Largest float16 <= a (a finite float32, clipped to the float16 range)."""
    a = np.clip(a, -_F16_MAX, _F16_MAX)
    h = a.astype(np.float16)
    return np.where(h.astype(np.float32) > a, np.nextafter(h, np.float16(-np.inf)), h)


@dataclass(frozen=True)
class KVFormat:
    """A grouped integer format for KV blocks (see the module docstring for the row layout).

    Attributes:
        name: registry key, e.g. "q4c", "q6t64", "q8t32s".
        bits: code width, 2..8.
        axis: "token" (groups along head_dim) or "channel" (groups over the block's tokens).
        group: G for the token axis (min(G, head_dim) is used); None for the channel axis.
        symmetric: one scale per group (True) or scale and min per group (False).
    """

    name: str
    bits: int
    axis: str
    group: int | None
    symmetric: bool

    def __post_init__(self):
        if not 2 <= self.bits <= 8:
            raise ValueError(f"{self.name}: unsupported bit width {self.bits} (supported: 2..8, 16)")
        if self.axis not in ("token", "channel"):
            raise ValueError(f"{self.name}: axis must be 'token' or 'channel', not {self.axis!r}")
        if (self.axis == "token") != (self.group is not None):
            raise ValueError(f"{self.name}: the token axis needs a group size, the channel axis none")

    # ---- geometry -------------------------------------------------------------------------------

    def group_size(self, block_tokens: int, head_dim: int) -> int:
        """Values per group for this block geometry."""
        if self.axis == "channel":
            return block_tokens
        g = min(self.group, head_dim)
        if head_dim % g:
            raise ValueError(f"{self.name}: group {g} does not divide head_dim {head_dim}")
        return g

    def n_groups(self, n_kv_heads: int, block_tokens: int, head_dim: int) -> int:
        """Groups (= scales) per block."""
        return n_kv_heads * block_tokens * head_dim // self.group_size(block_tokens, head_dim)

    def code_bytes(self, n_kv_heads: int, block_tokens: int, head_dim: int) -> int:
        """Bytes of packed codes at the start of each row."""
        n = n_kv_heads * block_tokens * head_dim
        return -(-n // 8) * self.bits

    def bytes_per_block(self, n_kv_heads: int, block_tokens: int, head_dim: int) -> int:
        """Exact row length: codes + float16 scales (+ float16 mins)."""
        per_group = 2 if self.symmetric else 4
        return self.code_bytes(n_kv_heads, block_tokens, head_dim) + per_group * self.n_groups(
            n_kv_heads, block_tokens, head_dim
        )

    def bits_per_value(self, block_tokens: int, head_dim: int) -> float:
        """Storage bits per cached value, scale (and min) overhead included."""
        return 8 * self.bytes_per_block(1, block_tokens, head_dim) / (block_tokens * head_dim)

    def fields(
        self, buf: np.ndarray, n_kv_heads: int, block_tokens: int, head_dim: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Views of a pool's rows: (packed codes (n, code_bytes) uint8, scales (n, n_groups) f16,
        mins (n, n_groups) f16 or None). Scales/mins are in group order: token axis (Hkv, T, D/G),
        channel axis (Hkv, D)."""
        n_bytes = self.bytes_per_block(n_kv_heads, block_tokens, head_dim)
        if buf.ndim != 2 or buf.shape[1] != n_bytes or buf.dtype != np.uint8:
            raise ValueError(f"{self.name}: expected (n, {n_bytes}) uint8 rows, got {buf.dtype} {buf.shape}")
        nc = self.code_bytes(n_kv_heads, block_tokens, head_dim)
        ng = self.n_groups(n_kv_heads, block_tokens, head_dim)
        codes = buf[:, :nc]
        scales = buf[:, nc : nc + 2 * ng].view(np.float16)
        mins = None if self.symmetric else buf[:, nc + 2 * ng :].view(np.float16)
        return codes, scales, mins

    def _grouped(self, x: np.ndarray) -> tuple[np.ndarray, int]:
        """(n, Hkv, T, D) -> a view whose reduction axis holds one group, and that axis."""
        n, h, t, d = x.shape
        if self.axis == "channel":
            return x, 2  # reduce over T: stats (n, Hkv, 1, D)
        g = self.group_size(t, d)
        return x.reshape(n, h, t, d // g, g), 4  # stats (n, Hkv, T, D/G, 1)

    # ---- conversion -----------------------------------------------------------------------------

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """(n, Hkv, T, D) float32 -> (n, bytes_per_block) uint8."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 4:
            raise ValueError(f"{self.name}: expected (n, Hkv, T, D) blocks, got shape {x.shape}")
        n, h, t, d = x.shape
        xg, ax = self._grouped(x)
        levels = 1 << self.bits
        if self.symmetric:
            half = levels // 2
            amax = np.abs(xg).max(axis=ax, keepdims=True)
            scale = _f16_up(amax / np.float32(half - 1))
            s32 = scale.astype(np.float32)
            inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 > 0)
            q = np.rint(xg * inv)
            np.clip(q, -(half - 1), half - 1, out=q)
            q += half
            mins = None
        else:
            lo = _f16_down(xg.min(axis=ax, keepdims=True))
            lo32 = lo.astype(np.float32)
            hi = xg.max(axis=ax, keepdims=True)
            scale = _f16_up((hi - lo32) / np.float32(levels - 1))
            s32 = scale.astype(np.float32)
            inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 > 0)
            q = np.rint((xg - lo32) * inv)
            np.clip(q, 0, levels - 1, out=q)
            mins = lo.reshape(n, -1)
        codes = q.astype(np.uint8).reshape(n, h * t * d)  # (n, Hkv*T*D), (Hkv, T, D) order
        pad = -(h * t * d) % 8
        if pad:
            codes = np.concatenate([codes, np.zeros((n, pad), np.uint8)], axis=1)
        out = np.empty((n, self.bytes_per_block(h, t, d)), np.uint8)
        c, sc, mn = self.fields(out, h, t, d)
        c[:] = pack_codes(codes, self.bits)
        sc[:] = scale.reshape(n, -1)
        if mn is not None:
            mn[:] = mins
        return out

    def dequantize(self, buf: np.ndarray, n_kv_heads: int, block_tokens: int, head_dim: int) -> np.ndarray:
        """(n, bytes_per_block) uint8 -> (n, Hkv, T, D) float32."""
        n = buf.shape[0]
        h, t, d = n_kv_heads, block_tokens, head_dim
        c, sc, mn = self.fields(buf, h, t, d)
        q = unpack_codes(c, self.bits)[:, : h * t * d].reshape(n, h, t, d).astype(np.float32)
        qg, _ = self._grouped(q)
        if self.axis == "channel":
            shape = (n, h, 1, d)
        else:
            shape = (n, h, t, d // self.group_size(t, d), 1)
        scale = sc.reshape(shape).astype(np.float32)
        if self.symmetric:
            qg -= np.float32(1 << (self.bits - 1))
            qg *= scale
        else:
            qg *= scale
            qg += mn.reshape(shape).astype(np.float32)
        return q


@dataclass(frozen=True)
class Float16Format(KVFormat):
    """float16 passthrough: the row is the block's (Hkv, T, D) values as little-endian float16."""

    def __post_init__(self):
        pass

    def group_size(self, block_tokens: int, head_dim: int) -> int:
        return 1

    def n_groups(self, n_kv_heads: int, block_tokens: int, head_dim: int) -> int:
        return 0

    def code_bytes(self, n_kv_heads: int, block_tokens: int, head_dim: int) -> int:
        return 2 * n_kv_heads * block_tokens * head_dim

    def bytes_per_block(self, n_kv_heads: int, block_tokens: int, head_dim: int) -> int:
        return self.code_bytes(n_kv_heads, block_tokens, head_dim)

    def fields(self, buf, n_kv_heads, block_tokens, head_dim):
        """(values (n, Hkv*T*D) float16 view, None, None)."""
        n_bytes = self.bytes_per_block(n_kv_heads, block_tokens, head_dim)
        if buf.ndim != 2 or buf.shape[1] != n_bytes or buf.dtype != np.uint8:
            raise ValueError(f"{self.name}: expected (n, {n_bytes}) uint8 rows, got {buf.dtype} {buf.shape}")
        return buf.view("<f2"), None, None

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """(n, Hkv, T, D) float32 -> (n, 2*Hkv*T*D) uint8."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 4:
            raise ValueError(f"{self.name}: expected (n, Hkv, T, D) blocks, got shape {x.shape}")
        return x.astype("<f2").reshape(x.shape[0], -1).view(np.uint8)

    def dequantize(self, buf, n_kv_heads, block_tokens, head_dim):
        """(n, 2*Hkv*T*D) uint8 -> (n, Hkv, T, D) float32."""
        values, _, _ = self.fields(buf, n_kv_heads, block_tokens, head_dim)
        return values.astype(np.float32).reshape(buf.shape[0], n_kv_heads, block_tokens, head_dim)


def _format_name(bits: int, axis: str, group: int | None, symmetric: bool) -> str:
    """q{bits}c / q{bits}t{G}, suffix "s" when symmetric: q4c, q6t64, q8t32s."""
    base = f"q{bits}c" if axis == "channel" else f"q{bits}t{group}"
    return base + ("s" if symmetric else "")


def _register() -> dict[str, KVFormat]:
    formats: dict[str, KVFormat] = {"f16": Float16Format("f16", 16, "token", None, False)}
    for bits in (8, 6, 5, 4, 3, 2):
        for axis, group in (("token", 32), ("token", 64), ("channel", None)):
            for symmetric in (False, True):
                name = _format_name(bits, axis, group, symmetric)
                formats[name] = KVFormat(name, bits, axis, group, symmetric)
    return formats


FORMATS: dict[str, KVFormat] = _register()

# (bits, role) -> default format name.
# Keys at 6 bits and below are grouped per channel over the block's tokens (outlier channels get
# their own scale). Measured on the first 512 tokens of gpl-3, k6v4 mean KL vs 16-bit KV
# (SmolLM2 / Gemma3): q6t64 0.0046 / 0.0083, q6cs 0.0028 / 0.0030, q6c 0.0019 / 0.0022; q6c costs
# 7 bits per value and would put K6V4 over 5.6 GiB at 32K tokens of 7B geometry, q6cs costs 6.5.
# Values stay per token (groups of 64 along the head dimension).
_DEFAULTS: dict[tuple[int, str], str] = {
    (16, "k"): "f16",
    (16, "v"): "f16",
    (8, "k"): "q8t32s",
    (8, "v"): "q8t32s",
    (6, "k"): "q6cs",
    (5, "k"): "q5c",
    (4, "k"): "q4c",
    (3, "k"): "q3c",
    (2, "k"): "q2c",
    (6, "v"): "q6t64",
    (5, "v"): "q5t64",
    (4, "v"): "q4t64",
    (3, "v"): "q3t64",
    (2, "v"): "q2t64",
}


def get_format(bits: int, role: str) -> KVFormat:
    """The default format for keys (role "k") or values (role "v") at a bit width."""
    if role not in ("k", "v"):
        raise ValueError(f"role must be 'k' or 'v', not {role!r}")
    try:
        return FORMATS[_DEFAULTS[(bits, role)]]
    except KeyError:
        supported = sorted({b for b, _ in _DEFAULTS}, reverse=True)
        msg = f"no KV cache format for {bits}-bit {role.upper()} (supported: {supported})"
        raise ValueError(msg) from None


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Walsh-Hadamard matrix (Sylvester order), (n, n) float32, n a power of two.

    H = H_n / sqrt(n) with H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]; H is symmetric and
    H @ H.T = I, so (q @ H)·(k @ H) = q·k. Storing k @ H spreads an outlier channel's energy
    evenly over all n channels before quantizing.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(np.float32(n))).astype(np.float32)
