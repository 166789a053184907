"""Attention straight from packed KV blocks (numba), without a dequantized copy of the blocks.

`attention_scores` computes q·k for every token of a list of blocks of a key pool and
`weighted_values` computes Σ_t p_t·v_t over a value pool. Pools and formats are those of
`engine.kv.formats` (the format object is duck-typed here so this module does not import the cache
package); the numpy `fmt.dequantize` is the reference these kernels are tested against.

Each call decodes one (block, head) tile of T×D values at a time into a float32 scratch — codes,
then scale and min applied once per value — and uses it for all M queries: M dot products per
token for the scores, M axpys per token into an (Hkv, M, Dv) sum for the values. Keys quantized
along the channel axis skip the scaling: q·(c*s + z) = (q*s)·c + q·z, with q*s and q·z computed
once per (block, head). Large calls split the blocks into contiguous runs, one per numba thread
(`prange`); each run writes its own columns of the scores, or its own partial sum of the values,
added up after the parallel loop (see PARALLEL_MIN_VALUES for when threads are used).

Row layout read here (see `engine.kv.formats`), `row = [codes | scales f16 | mins f16]`:

    codes   (Hkv, T, D) values, LSB-first bit stream, `bits` per value; head h's T×D codes start at
            stream bit h*T*D*bits, a byte boundary because D is a multiple of 8, and are T*D/8
            chunks of 8 codes in `bits` bytes each:
                chunk (bits bytes) -> little-endian integer w;  code i = (w >> (i*bits)) & (2**bits - 1)
    scales  float16 per group: token axis (Hkv, T, D/G), channel axis (Hkv, D)
    mins    same, asymmetric formats only

The float16 format ("f16", bits 16) is the (Hkv, T, D) values as little-endian float16; it is read
as uint16 bit patterns and converted with integer operations (`_f16_to_f32`, exact for every
pattern: zeros, subnormals, normals, infinities; NaNs stay NaN), so the result does not depend on
the CPU's denormal (FTZ/DAZ) mode.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

# fast-math flags that let LLVM vectorize the float reductions (reassociate) and fuse multiply-adds,
# without assuming the data is free of infinities / NaNs
_FAST = {"reassoc", "contract", "nsz", "arcp"}
_TWO_M24 = np.float32(2.0**-24)  # float16 subnormal step


@njit(cache=True, inline="always")
def _f16_to_f32(h):
    """float16 bit pattern (an integer 0..65535) -> float32, exactly, by integer operations.

    Every step is cast to uint32 so that LLVM vectorizes it with 32-bit lanes."""
    h = np.uint32(h)
    em = np.uint32(h & np.uint32(0x7FFF))  # exponent and mantissa
    r = np.uint32((em << np.uint32(13)) + np.uint32(112 << 23))  # rebias 15 -> 127: normal numbers
    if em >= np.uint32(0x7C00):  # inf / NaN: exponent all ones, mantissa (NaN payload) kept
        r = np.uint32(r + np.uint32(112 << 23))
    if em < np.uint32(0x0400):  # zero / subnormal: mantissa * 2**-24 is an exact (normal) float32
        r = np.float32(np.float32(np.int32(em)) * _TWO_M24).view(np.uint32)
    return np.uint32(r | np.uint32((h & np.uint32(0x8000)) << np.uint32(16))).view(np.float32)


@njit(cache=True)
def _halves(src, out):
    """Little-endian float16 values in the bytes src (2*n,) -> out (n,) float32."""
    for i in range(out.shape[0]):
        out[i] = _f16_to_f32(np.uint32(src[2 * i]) | (np.uint32(src[2 * i + 1]) << np.uint32(8)))


# The loops below index 1-D slices with plain range variables only: numba then needs no
# negative-index wraparound per access and LLVM vectorizes them.


@njit(cache=True, inline="always")
def _unpack_chunks(src, bits, x):
    """Codes of a `bits`-wide stream (8 codes per `bits` bytes of src) -> x (size a multiple of 8).

    Inlined into one function per width below, where `bits` is a constant LLVM unrolls on."""
    mask = (1 << bits) - 1
    for c in range(x.shape[0] // 8):
        w = np.int64(0)
        for i in range(bits):
            w |= np.int64(src[c * bits + i]) << (8 * i)
        for i in range(8):
            x[c * 8 + i] = np.float32((w >> (i * bits)) & mask)


@njit(cache=True)
def _unpack8(src, x):
    for i in range(x.shape[0]):
        x[i] = np.float32(src[i])


@njit(cache=True)
def _unpack4(src, x):
    for i in range(x.shape[0] // 2):
        b = src[i]
        x[2 * i] = np.float32(b & 15)
        x[2 * i + 1] = np.float32(b >> 4)


@njit(cache=True)
def _unpack2(src, x):
    for i in range(x.shape[0] // 4):
        b = src[i]
        x[4 * i] = np.float32(b & 3)
        x[4 * i + 1] = np.float32((b >> 2) & 3)
        x[4 * i + 2] = np.float32((b >> 4) & 3)
        x[4 * i + 3] = np.float32(b >> 6)


@njit(cache=True)
def _unpack7(src, x):
    _unpack_chunks(src, 7, x)


@njit(cache=True)
def _unpack6(src, x):
    _unpack_chunks(src, 6, x)


@njit(cache=True)
def _unpack5(src, x):
    _unpack_chunks(src, 5, x)


@njit(cache=True)
def _unpack3(src, x):
    _unpack_chunks(src, 3, x)


@njit(cache=True)
def _unpack_tile(row, h, n, bits, x):
    """The n = T*D codes of head h of a pool row (1-D uint8) -> x (n,) float32, unscaled."""
    nbytes = n * bits // 8
    src = row[h * nbytes : (h + 1) * nbytes]
    if bits == 8:  # one loop per width, each with its width a constant
        _unpack8(src, x)
    elif bits == 4:
        _unpack4(src, x)
    elif bits == 2:
        _unpack2(src, x)
    elif bits == 6:
        _unpack6(src, x)
    elif bits == 5:
        _unpack5(src, x)
    elif bits == 3:
        _unpack3(src, x)
    else:
        _unpack7(src, x)


@njit(cache=True, fastmath=_FAST)
def _tile_scales(row, h, n_sc, bits, symmetric, code_bytes, n_groups, sd, zd):
    """Head h's n_sc group scales -> sd[:n_sc] and offsets -> zd[:n_sc], so that value = code*s + z
    (z = min, or -2**(bits-1)*s for symmetric formats)."""
    _halves(row[code_bytes + 2 * h * n_sc : code_bytes + 2 * (h + 1) * n_sc], sd)
    if symmetric:
        half = np.float32(1 << (bits - 1))
        for i in range(n_sc):
            zd[i] = -half * sd[i]
    else:
        min0 = code_bytes + 2 * n_groups  # byte offset of the mins
        _halves(row[min0 + 2 * h * n_sc : min0 + 2 * (h + 1) * n_sc], zd)


@njit(cache=True, fastmath=_FAST)
def _dequantize_tile(x, T, D, group, channel, sd, zd):
    """x (T*D,) codes -> values in place, with the scales/offsets of `_tile_scales`."""
    if channel:  # groups (Hkv, D): one scale (and min) per channel over the T tokens
        for t in range(T):
            xt = x[t * D : (t + 1) * D]
            for d in range(D):
                xt[d] = xt[d] * sd[d] + zd[d]
    else:  # groups (Hkv, T, D/G) of `group` consecutive values
        for g in range(x.shape[0] // group):
            s = sd[g]
            z = zd[g]
            xg = x[g * group : (g + 1) * group]
            for i in range(group):
                xg[i] = xg[i] * s + z


@njit(cache=True, fastmath=_FAST)
def _fold_channel_scales(qh, sd, zd, qs, bias):
    """Channel-axis keys: q·(c*s + z) = (q*s)·c + q·z. qs[m] = qh[m]*sd, bias[m] = qh[m]·zd."""
    for m in range(qh.shape[0]):
        b = np.float32(0.0)
        for d in range(qh.shape[1]):
            qs[m, d] = qh[m, d] * sd[d]
            b += qh[m, d] * zd[d]
        bias[m] = b


@njit(cache=True, fastmath=_FAST)
def _tile_scores(qh, x, T, D, bias, out_h, col0):
    """out_h[m, col0 + t] = qh[m]·x[t] + bias[m] for the tile x (T, D); qh (M, D).

    Four tokens per pass over qh[m]: a quarter of the loop overhead and of the loads of q."""
    for m in range(qh.shape[0]):
        qm = qh[m]
        om = out_h[m, col0 : col0 + T]
        b = bias[m]
        t = 0
        while t + 4 <= T:
            x0 = x[t * D : (t + 1) * D]
            x1 = x[(t + 1) * D : (t + 2) * D]
            x2 = x[(t + 2) * D : (t + 3) * D]
            x3 = x[(t + 3) * D : (t + 4) * D]
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for d in range(D):
                qd = qm[d]
                s0 += qd * x0[d]
                s1 += qd * x1[d]
                s2 += qd * x2[d]
                s3 += qd * x3[d]
            om[t] = s0 + b
            om[t + 1] = s1 + b
            om[t + 2] = s2 + b
            om[t + 3] = s3 + b
            t += 4
        while t < T:
            x0 = x[t * D : (t + 1) * D]
            s0 = np.float32(0.0)
            for d in range(D):
                s0 += qm[d] * x0[d]
            om[t] = s0 + b
            t += 1


@njit(cache=True, fastmath=_FAST)
def _tile_values(ph, x, T, D, col0, acc_h):
    """acc_h[m] += Σ_t ph[m, col0 + t]·x[t] for the tile x (T, D); ph (M, L), acc_h (M, D).

    Four tokens per pass over acc_h[m]: a quarter of the loop overhead and of its loads/stores."""
    for m in range(ph.shape[0]):
        am = acc_h[m]
        pm = ph[m, col0 : col0 + T]
        t = 0
        while t + 4 <= T:
            w0 = pm[t]
            w1 = pm[t + 1]
            w2 = pm[t + 2]
            w3 = pm[t + 3]
            if w0 != 0.0 or w1 != 0.0 or w2 != 0.0 or w3 != 0.0:  # e.g. masked-out sink tokens
                x0 = x[t * D : (t + 1) * D]
                x1 = x[(t + 1) * D : (t + 2) * D]
                x2 = x[(t + 2) * D : (t + 3) * D]
                x3 = x[(t + 3) * D : (t + 4) * D]
                for d in range(D):
                    am[d] += w0 * x0[d] + w1 * x1[d] + w2 * x2[d] + w3 * x3[d]
            t += 4
        while t < T:
            w0 = pm[t]
            if w0 != 0.0:
                x0 = x[t * D : (t + 1) * D]
                for d in range(D):
                    am[d] += w0 * x0[d]
            t += 1


# ---- drivers ----------------------------------------------------------------------------------
# One serial function for every format and both products, and one parallel driver splitting the
# blocks into runs, one per thread: numba's parallel compilation (slow) then runs once, only when
# threads are first used, and other calls use `_run` directly, without a parallel region. Both
# release the GIL (a GUI thread keeps running during a call).


@njit(cache=True, nogil=True)
def _run(pool, ids, j0, j1, a, T, D, bits, group, channel, symmetric, code_bytes, n_groups, values, out):
    """Scores (values False) or weighted values (values True) over the blocks ids[j0:j1] of pool.

    pool (n_pool, row_bytes) u8; ids (nb,) i64 rows.
    scores: a = q (Hkv, M, D) f32; out (Hkv, M, nb*T) f32, columns j0*T .. j1*T-1 written.
    values: a = p (Hkv, M, nb*T) f32; out (Hkv, M, D) f32, added into.
    """
    n_sc = 1 if bits == 16 else (D if channel else T * D // group)  # scales per head
    fold = channel and not values  # keys on the channel axis: scale q instead of every key
    M = a.shape[1]
    x = np.empty(T * D, np.float32)
    sd = np.empty(n_sc, np.float32)
    zd = np.empty(n_sc, np.float32)
    qs = np.empty((M, D), np.float32)
    bias = np.zeros(M, np.float32)
    for j in range(j0, j1):
        row = pool[ids[j]]
        for h in range(a.shape[0]):
            qh = a[h]
            if bits == 16:  # float16 values: head h is bytes [2*h*T*D, 2*(h+1)*T*D)
                _halves(row[2 * h * T * D : 2 * (h + 1) * T * D], x)
            else:
                _unpack_tile(row, h, T * D, bits, x)
                _tile_scales(row, h, n_sc, bits, symmetric, code_bytes, n_groups, sd, zd)
                if fold:
                    _fold_channel_scales(a[h], sd, zd, qs, bias)
                    qh = qs
                else:
                    _dequantize_tile(x, T, D, group, channel, sd, zd)
            if values:
                _tile_values(qh, x, T, D, j * T, out[h])
            else:
                _tile_scores(qh, x, T, D, bias, out[h], j * T)


@njit(cache=True, nogil=True, parallel=True)
def _run_parallel(pool, ids, a, T, D, bits, group, channel, symmetric, code_bytes, n_groups, values, n_chunks,
                  out):
    """`_run` over n_chunks contiguous runs of blocks in parallel (2 <= n_chunks <= nb).

    scores: out (1, Hkv, M, nb*T): the runs write disjoint columns of out[0].
    values: out (n_chunks, Hkv, M, D) zeros: one partial sum per run, added up into out[0].
    """
    nb = ids.shape[0]
    for c in prange(n_chunks):
        _run(pool, ids, c * nb // n_chunks, (c + 1) * nb // n_chunks, a, T, D, bits, group, channel,
             symmetric, code_bytes, n_groups, values, out[c] if values else out[0])
    if values:
        total = out[0]
        for c in range(1, n_chunks):
            part = out[c]
            for h in range(part.shape[0]):
                for m in range(part.shape[1]):
                    for d in range(part.shape[2]):
                        total[h, m, d] += part[h, m, d]


@njit(cache=True)
def _f16_bits_to_f32(bits, out):
    """Elementwise `_f16_to_f32` (for tests): bits (n,) uint16 -> out (n,) float32."""
    for i in range(bits.shape[0]):
        out[i] = _f16_to_f32(bits[i])


def f16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """The kernels' float16 -> float32 conversion, applied to an array of uint16 bit patterns."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16).ravel()
    out = np.empty(bits.shape, np.float32)
    _f16_bits_to_f32(bits, out)
    return out


# (format, Hkv, T, D) -> ((bits, group, channel, symmetric, code_bytes, n_groups), row_bytes)
_LAYOUTS: dict = {}


def _layout(fmt, n_kv_heads: int, block_tokens: int, head_dim: int) -> tuple:
    key = (fmt.name, fmt.bits, fmt.axis, fmt.group, fmt.symmetric, n_kv_heads, block_tokens, head_dim)
    layout = _LAYOUTS.get(key)
    if layout is None:
        is_f16 = fmt.bits == 16
        if not (is_f16 or (2 <= fmt.bits <= 8 and head_dim % 8 == 0)):
            raise ValueError(
                f"{fmt.name}: the packed-code kernels need float16, or 2..8 bits and head_dim % 8 == 0"
            )
        channel = fmt.axis == "channel"
        group = 1 if channel or is_f16 else fmt.group_size(block_tokens, head_dim)
        layout = (
            (
                fmt.bits,
                group,
                channel,
                bool(fmt.symmetric),
                fmt.code_bytes(n_kv_heads, block_tokens, head_dim),
                fmt.n_groups(n_kv_heads, block_tokens, head_dim),
            ),
            fmt.bytes_per_block(n_kv_heads, block_tokens, head_dim),
        )
        _LAYOUTS[key] = layout
    return layout


# Calls of at least this many values (Hkv*T*D per block × blocks) split their blocks over the numba
# threads (numba.get_num_threads(): NUMBA_NUM_THREADS, numba.set_num_threads()); None = never, the
# default. Decode calls these kernels once per 16-block pool slab (~50 µs of work each, ~500 calls
# per token) between numpy/OpenBLAS matmuls; every parallel region then waits for a second thread
# that numba's OpenMP layer leaves spinning for milliseconds after each region, or that another
# process holds. Measured end to end on 2 cores (SmolLM2, K4V4, 4,096 tokens, a machine shared
# with other jobs): ~160 ms/token single-threaded, ~520 ms/token with every slab split over 2
# threads, about even with OMP_WAIT_POLICY=PASSIVE. 32768 splits every slab.
PARALLEL_MIN_VALUES: int | None = None


def _n_chunks(n_blocks: int, values_per_block: int) -> int:
    """Runs of blocks to split a call into: 1 (0 for no blocks), or one per numba thread for calls
    of at least PARALLEL_MIN_VALUES values."""
    if PARALLEL_MIN_VALUES is None or n_blocks * values_per_block < PARALLEL_MIN_VALUES:
        return min(n_blocks, 1)
    return min(n_blocks, get_num_threads())


def _prepare(fmt, pool, block_ids, n_kv_heads, block_tokens, head_dim):
    """(kernel layout arguments, C-contiguous pool, block rows (nb,) int64)."""
    layout, row_bytes = _layout(fmt, n_kv_heads, block_tokens, head_dim)
    if pool.ndim != 2 or pool.shape[1] != row_bytes or pool.dtype != np.uint8:
        raise ValueError(f"{fmt.name}: expected (n, {row_bytes}) uint8 rows, got {pool.dtype} {pool.shape}")
    pool = np.ascontiguousarray(pool)
    ids = np.arange(pool.shape[0], dtype=np.int64)[block_ids]  # bounds-checked, negatives resolved
    return layout, pool, ids


def attention_scores(
    fmt, pool: np.ndarray, block_ids: np.ndarray, q: np.ndarray, block_tokens: int
) -> np.ndarray:
    """Scores q·k over the keys of the listed blocks (no softmax scale, no mask).

    Args:
        fmt: the key pool's `KVFormat` (2..8 bits, or float16).
        pool: (n_pool, fmt.bytes_per_block(Hkv, T, D)) uint8 key pool.
        block_ids: (nb,) rows of `pool`, in sequence order.
        q: (Hkv, M, D) float32; M = query heads per KV head × query tokens.
        block_tokens: T.
    Returns:
        (Hkv, M, nb*T) float32; column j*T + t is token t of block_ids[j].
    """
    q = np.ascontiguousarray(q, dtype=np.float32)
    n_kv, M, D = q.shape
    layout, pool, ids = _prepare(fmt, pool, block_ids, n_kv, block_tokens, D)
    n_chunks = _n_chunks(len(ids), n_kv * block_tokens * D)
    if n_chunks > 1:
        out = np.empty((1, n_kv, M, len(ids) * block_tokens), np.float32)
        _run_parallel(pool, ids, q, block_tokens, D, *layout, False, n_chunks, out)
        return out[0]
    out = np.empty((n_kv, M, len(ids) * block_tokens), np.float32)
    if n_chunks:
        _run(pool, ids, 0, len(ids), q, block_tokens, D, *layout, False, out)
    return out


def weighted_values(
    fmt, pool: np.ndarray, block_ids: np.ndarray, p: np.ndarray, block_tokens: int, value_dim: int
) -> np.ndarray:
    """Σ_t p[..., t]·v_t over the values of the listed blocks.

    Args:
        fmt: the value pool's `KVFormat` (2..8 bits, or float16).
        pool: (n_pool, fmt.bytes_per_block(Hkv, T, Dv)) uint8 value pool.
        block_ids: (nb,) rows of `pool`, in sequence order.
        p: (Hkv, M, nb*T) float32 weights (e.g. softmax probabilities).
        block_tokens: T.
        value_dim: Dv.
    Returns:
        (Hkv, M, Dv) float32.
    """
    p = np.ascontiguousarray(p, dtype=np.float32)
    n_kv, M, L = p.shape
    layout, pool, ids = _prepare(fmt, pool, block_ids, n_kv, block_tokens, value_dim)
    if L != len(ids) * block_tokens:
        raise ValueError(f"p covers {L} tokens, the blocks {len(ids) * block_tokens}")
    n_chunks = _n_chunks(len(ids), n_kv * block_tokens * value_dim)
    if n_chunks > 1:
        out = np.zeros((n_chunks, n_kv, M, value_dim), np.float32)
        _run_parallel(pool, ids, p, block_tokens, value_dim, *layout, True, n_chunks, out)
        return out[0]
    out = np.zeros((n_kv, M, value_dim), np.float32)
    if n_chunks:
        _run(pool, ids, 0, len(ids), p, block_tokens, value_dim, *layout, True, out)
    return out
