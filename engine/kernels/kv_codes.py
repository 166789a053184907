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

import threading

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .vector_ir import (
    CONTRACT,
    F32,
    I8,
    I16,
    I32,
    I64,
    VectorIR,
    _pointer_from_address,
    address_of,
    data_pointer,
    dequantize_f16_row,
    f32_pointer,
    u8_pointer,
    vector_type,
)

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


@njit(cache=True, inline="always")
def _f16_tile(src, out):
    """`_halves`, 16 values at a time with the weight kernels' vector conversion when it can."""
    if out.shape[0] % 16 == 0:
        dequantize_f16_row(src, out)
    else:
        _halves(src, out)


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
    _f16_tile(row[code_bytes + 2 * h * n_sc : code_bytes + 2 * (h + 1) * n_sc], sd[:n_sc])
    if symmetric:
        half = np.float32(1 << (bits - 1))
        for i in range(n_sc):
            zd[i] = -half * sd[i]
    else:
        min0 = code_bytes + 2 * n_groups  # byte offset of the mins
        _f16_tile(row[min0 + 2 * h * n_sc : min0 + 2 * (h + 1) * n_sc], zd[:n_sc])


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
                _f16_tile(row[2 * h * T * D : 2 * (h + 1) * T * D], x)
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
# default. Decode calls these kernels once per 16-block pool slab (tens of microseconds of work
# each, hundreds of calls per token) between numpy/OpenBLAS matmuls; every parallel region then
# waits for a second thread that numba's OpenMP layer leaves spinning for milliseconds after each
# region, or that another process holds, so splitting slabs made decode several times slower
# (no faster with OMP_WAIT_POLICY=PASSIVE). 32768 splits every slab.
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


# ---- one decode step -------------------------------------------------------------------------
# A token being decoded (one query per head) attends to its layer's whole cache in one call:
# scores over the quantized blocks (read from their packed codes), the full-precision sinks and
# the recent tokens, the masked softmax, and the weighted values. The numpy path needs a few
# dozen array operations per layer for the same step, each with its own overhead; on small models
# that overhead, not the arithmetic, is most of a decode step.


@njit(cache=True, nogil=True)
def _row_at(addr, n):
    """The pool row of n bytes at address `addr` (a row of a live slab; see
    `LayerBlockPool.row_addresses`)."""
    return carray(u8_pointer(addr), (n,))


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split so that k*_LN2_HI is exact for |k| < 2**8
_LN2_LO = np.float32(-2.12194440e-4)


@njit(cache=True, inline="always", fastmath=_FAST)
def _exp_le0(x):
    """exp(x) for x <= 0 (softmax after subtracting the maximum), branch-free so that loops over
    it vectorize: x = k*ln2 + r, |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial
    (relative error < 2e-7), times 2**k built in the exponent bits. Inputs at or below -64 give 0:
    the softmax divides each exponential by a sum of up to a context's length of them, and
    exp(-87) / 2 is already subnormal. Subnormal probabilities cost ~10x in the BLAS product with
    the values that follows (a 1B model whose attention held 1.3% of them: 2.5 s of a 7.9 s
    prefill in attention against 0.3 s), while exp(-64) ~ 1.6e-28 is below any float32 sum's
    rounding: dropping it changes no result."""
    keep = x > np.float32(-64.0)
    x = max(x, np.float32(-64.0))
    k = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - k * _LN2_HI - k * _LN2_LO
    p = np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    e = p * np.int32((np.int32(k) + np.int32(127)) << np.int32(23)).view(np.float32)
    return e if keep else np.float32(0.0)


@njit(cache=True, inline="always", fastmath=_FAST)
def _max_f32(x, lanes):
    """max of x (n >= 1,) float32, in 16 independent lanes: a running max is a chain of dependent
    compares that does not vectorize (fastmath here does not assume "no NaN", which LLVM needs to
    reorder a max reduction), four times the cost of the exponentials after it. lanes: (16,)
    float32 scratch, the caller's (allocated per row it cost ~40% of a prefill's softmax)."""
    n = x.shape[0]
    lanes[:] = -np.inf
    n16 = n - n % 16
    for c in range(0, n16, 16):
        for i in range(16):
            v = x[c + i]
            lanes[i] = v if v > lanes[i] else lanes[i]
    top = np.float32(-np.inf)
    for i in range(16):
        top = max(top, lanes[i])
    for c in range(n16, n):
        top = max(top, x[c])
    return top


@njit(cache=True, inline="always", fastmath=_FAST)
def _softmax_in_place(x, scale, lanes):
    """x (n >= 1,) float32 scores -> softmax(scale * x), in place, in float32 throughout (a
    float64 maximum would turn the exponentials' loop into float64 arithmetic, twice as slow).
    lanes: `_max_f32`'s scratch."""
    top = _max_f32(x, lanes) * scale
    total = np.float32(0.0)
    for c in range(x.shape[0]):
        e = _exp_le0(x[c] * scale - top)
        x[c] = e
        total += e
    # total >= 1 for real scores (the maximum's own term is exp(0)). A pool worker that runs a
    # decode-batch chunk after the caller has stolen it and moved on reads the pool's reused x
    # buffer (its result is dropped): NaN scores there made this a ZeroDivisionError, printed as
    # "Exception ignored" from the worker thread
    inv = np.float32(1.0) / total if total > 0 else np.float32(0.0)
    for c in range(x.shape[0]):
        x[c] *= inv


# ---- packed tiles in explicit vector IR -------------------------------------------------------
# numba compiles per-token loops over packed codes to code that spends most of its time on scalar
# byte loads, accumulator loads/stores and per-token shuffles, several times the arithmetic's
# share. The intrinsics below
# write the same sums as LLVM vector IR (the weight kernels' vocabulary, `vector_ir.VectorIR`),
# reading codes of any width 2..8 straight from the bit stream:
#
#   16 codes of `bits` bits (2*bits bytes; code j is bits [j*bits, (j+1)*bits) of the
#   little-endian chunk): lane j takes byte (j*bits)//8 and the next one (byte shuffles; one
#   when no code straddles a byte), shifts right by (j*bits) % 8 and masks -> int-to-float.
#   4-bit codes take a cheaper route: the bytes zero-extended to i32 lanes, low nibbles (even
#   channels) and high nibbles (odd channels) as two vectors, so a chunk comes out in the order
#   [even channels | odd channels]; callers permute the query (scores) or the sums (values) to
#   match (`_chunk_order`).
#
#   scores: per token, 32 channels at a time, one <16 x float> accumulator per query (FMAs with
#           the query's channels), one horizontal sum per token and query; token-axis groups are
#           summed apart and scaled by the token's group scale.
#   values: per 16 channels, the queries' accumulators stay in registers across all tokens of
#           the tile, one broadcast weight per (query, token).
#
# The number of queries (1..4, a GQA group or a part of one) is a compile-time constant of each
# intrinsic, so that groups of 3 (SmolLM2) do not pay for a fourth; the width is a branch taken
# once per call. Offsets (group minimums, symmetric zero points) are added by the callers: for
# channel-axis keys q·z is one number per query, elsewhere Σ p·z is one per (query, group).

VECTOR_BITS = (16, 8, 6, 5, 4, 3, 2)  # widths the intrinsics read (16: float16 values)
SCORE_CHUNK, VALUE_CHUNK = 32, 16  # channels per step of the scores / values loops


def _arr_dim(context, builder, aty, aval, axis):
    arr = context.make_array(aty)(context, builder, aval)
    return cgutils.unpack_tuple(builder, arr.shape, aty.ndim)[axis]


def _i64(x):
    return ir.Constant(I64, x)


def _codes16(v, chunk, bits):
    """<16 x float> of the 16 codes of `bits` bits at byte pointer `chunk` (2*bits bytes), in
    channel order, or for bits == 4 in the order [8 even channels | 8 odd channels]; bits == 16:
    16 float16 values (converted exactly, F16C when the CPU has it)."""
    b = v.b
    if bits == 16:
        return v.f16(b.zext(v.load(chunk, 0, vector_type(I16, 16)), vector_type(I32, 16)))
    n_bytes = 2 * bits
    raw = v.load(chunk, 0, vector_type(I8, n_bytes))
    if bits == 4:
        w = b.zext(raw, vector_type(I32, 8))
        return b.shuffle_vector(v.sf(v.and_(w, 15)), v.sf(v.shr(w, 4)), v.civ(range(16)))
    if bits == 8:
        return v.sf(b.zext(raw, vector_type(I32, 16)))
    # one byte shuffle builds each lane's little-endian i32 from the code's first byte and the
    # next (zeros above): a 32-bit window holds shift (<= 7) + bits (<= 8) bits
    zeros = ir.Constant(vector_type(I8, n_bytes), [0] * n_bytes)
    picks = []
    for j in range(16):
        first, shift = j * bits // 8, j * bits % 8
        second = first + 1 if shift + bits > 8 else n_bytes  # n_bytes: a zero byte
        picks += [first, second, n_bytes, n_bytes]
    w = b.bitcast(b.shuffle_vector(raw, zeros, v.civ(picks)), vector_type(I32, 16))
    shifts = [j * bits % 8 for j in range(16)]
    if any(shifts):
        w = b.lshr(w, v.civ(shifts))
    return v.sf(v.and_(w, (1 << bits) - 1))


def _codes32(v, chunk, bits):
    """Two <16 x float> of the 32 codes of `bits` bits at `chunk` (4*bits bytes), in channel
    order, or for bits == 4 [16 even channels], [16 odd channels]."""
    if bits == 4:
        w = v.u8(chunk, 0, 16)
        return [v.sf(v.and_(w, 15)), v.sf(v.shr(w, 4))]
    return [_codes16(v, chunk, bits), _codes16(v, v.gep(chunk, 2 * bits), bits)]


def _for_each_width(builder, bits, emit):
    """emit(b) under `if bits == b` for each width of VECTOR_BITS."""
    for b in VECTOR_BITS:
        with builder.if_then(builder.icmp_signed("==", bits, ir.Constant(bits.type, b))):
            emit(b)


def _fma_into(builder, acc_ptr, a, x):
    """*acc_ptr += a * x (fusable)."""
    prod = builder.fmul(a, x, flags=CONTRACT)
    builder.store(builder.fadd(builder.load(acc_ptr), prod, flags=CONTRACT), acc_ptr)


def _make_tile_scores(n_q):
    """Intrinsic scores(bits, tile_addr, n_tokens, qs, sc, group, out): for k < n_q, t < n_tokens,
    out[k, t] = Σ_g sc[t, g]*Σ_{d in group g} qs[k, d]*code[t, d], groups of `group` channels (a
    multiple of SCORE_CHUNK; channel-axis keys: one group of D channels, sc = 1 and the scales
    folded into qs). code: the tile's (n_tokens, D) codes of `bits` bits at tile_addr, rows of
    D*bits/8 bytes; qs in `_chunk_order`. qs (>= n_q, D), sc (n_tokens, D/group) and out
    (>= n_q, >= n_tokens) float32 C-contiguous; D a multiple of SCORE_CHUNK."""

    @intrinsic
    def scores(typingctx, bits, tile_addr, n_tokens, qs, sc, group, out):
        sig = types.void(bits, tile_addr, n_tokens, qs, sc, group, out)

        def codegen(context, builder, signature, args):
            v = VectorIR(builder)
            vf = vector_type(F32, 16)
            zero = ir.Constant(vf, [0.0] * 16)
            bits_v, tile, n_tok, group = args[0], builder.inttoptr(args[1], I8.as_pointer()), args[2], args[5]
            qs_p = data_pointer(context, builder, signature.args[3], args[3])
            sc_p = data_pointer(context, builder, signature.args[4], args[4])
            out_p = data_pointer(context, builder, signature.args[6], args[6])
            D = _arr_dim(context, builder, signature.args[3], args[3], 1)
            n_grp = _arr_dim(context, builder, signature.args[4], args[4], 1)
            out_cols = _arr_dim(context, builder, signature.args[6], args[6], 1)
            accs = [cgutils.alloca_once(builder, vf) for _ in range(n_q)]
            q_rows = [builder.mul(D, _i64(4 * k)) for k in range(n_q)]  # byte offset of query k

            def chunk_into(row, c, b, targets):
                """targets[k] += qs[k, chunk c] * codes of chunk c (two <16 x float> each)."""
                xs = _codes32(v, v.gep(row, builder.mul(c, _i64(4 * b))), b)
                c_off = builder.mul(c, _i64(4 * SCORE_CHUNK))
                for k, acc in enumerate(targets):
                    off = builder.add(q_rows[k], c_off)
                    for half, x in enumerate(xs):
                        _fma_into(builder, acc, v.load(qs_p, builder.add(off, _i64(64 * half)), vf), x)

            parts = [cgutils.alloca_once(builder, vf) for _ in range(n_q)]
            pending = [cgutils.alloca_once(builder, vf, size=16) for _ in range(n_q)]  # 16 tokens' lanes per query
            per_group = builder.sdiv(group, _i64(SCORE_CHUNK))

            def emit(b):
                row_bytes = builder.sdiv(builder.mul(D, _i64(b)), _i64(8))
                with cgutils.for_range(builder, n_tok) as tok:
                    row = v.gep(tile, builder.mul(tok.index, row_bytes))
                    for acc in accs:
                        builder.store(zero, acc)
                    with cgutils.for_range(builder, n_grp) as grp:
                        for part in parts:
                            builder.store(zero, part)
                        with cgutils.for_range(builder, per_group) as ch:
                            chunk_into(row, builder.add(builder.mul(grp.index, per_group), ch.index), b, parts)
                        sc_off = builder.mul(builder.add(builder.mul(tok.index, n_grp), grp.index), _i64(4))
                        s = v.splat(v.load(sc_p, sc_off, F32, align=4), 16)
                        for acc, part in zip(accs, parts):
                            _fma_into(builder, acc, s, builder.load(part))
                    # each token's 16 lanes wait in `pending` until 16 tokens are there, then
                    # one transposing sum gives the 16 scores in one vector
                    slot = builder.and_(tok.index, _i64(15))
                    for k, acc in enumerate(accs):
                        builder.store(builder.load(acc), builder.gep(pending[k], [slot]))
                    with builder.if_then(builder.icmp_signed("==", slot, _i64(15))):
                        t0 = builder.sub(tok.index, _i64(15))
                        for k in range(n_q):
                            sums = v.transpose_sum([builder.load(builder.gep(pending[k], [_i64(i)])) for i in range(16)])
                            v.store(sums, out_p, builder.mul(builder.add(builder.mul(out_cols, _i64(k)), t0), _i64(4)))
                rest = builder.and_(n_tok, _i64(15))  # the last tokens when n_tokens % 16 != 0
                first = builder.sub(n_tok, rest)
                with cgutils.for_range(builder, rest) as i:
                    for k in range(n_q):
                        lanes = builder.load(builder.gep(pending[k], [i.index]))
                        off = builder.mul(builder.add(builder.mul(out_cols, _i64(k)), builder.add(first, i.index)), _i64(4))
                        v.store(v.hsum(lanes), out_p, off)

            _for_each_width(builder, bits_v, emit)
            return context.get_dummy_value()

        return sig, codegen

    return scores


def _make_tile_values(n_q):
    """Intrinsic values(bits, tile_addr, n_tokens, w, group, acc): for k < n_q and d < Dv,
    acc[k, d] += Σ_t w[k, t, d // group]*code[t, d]; code: the tile's (n_tokens, Dv) codes of
    `bits` bits at tile_addr (token-axis groups of `group` channels, a multiple of VALUE_CHUNK),
    rows of Dv*bits/8 bytes; acc in `_chunk_order`. w (>= n_q, n_tokens, Dv/group) and acc
    (>= n_q, Dv) float32 C-contiguous, Dv a multiple of VALUE_CHUNK."""

    @intrinsic
    def values(typingctx, bits, tile_addr, n_tokens, w, group, acc):
        sig = types.void(bits, tile_addr, n_tokens, w, group, acc)

        def codegen(context, builder, signature, args):
            v = VectorIR(builder)
            vf = vector_type(F32, VALUE_CHUNK)
            bits_v, tile, n_tok, group = args[0], builder.inttoptr(args[1], I8.as_pointer()), args[2], args[4]
            w_p = data_pointer(context, builder, signature.args[3], args[3])
            a_p = data_pointer(context, builder, signature.args[5], args[5])
            n_grp = _arr_dim(context, builder, signature.args[3], args[3], 2)
            w_q = builder.mul(builder.mul(n_tok, n_grp), _i64(4))  # bytes per query of w
            Dv = _arr_dim(context, builder, signature.args[5], args[5], 1)
            accs = [cgutils.alloca_once(builder, vf) for _ in range(n_q)]

            def emit(b):
                row_bytes = builder.sdiv(builder.mul(Dv, _i64(b)), _i64(8))
                with cgutils.for_range(builder, builder.sdiv(Dv, _i64(VALUE_CHUNK))) as chunk:
                    c0 = builder.mul(chunk.index, _i64(VALUE_CHUNK))  # first channel
                    a_offs = [builder.mul(builder.add(builder.mul(Dv, _i64(k)), c0), _i64(4)) for k in range(n_q)]
                    for k, acc in enumerate(accs):
                        builder.store(v.load(a_p, a_offs[k], vf, align=4), acc)
                    grp = builder.sdiv(c0, group)
                    codes0 = v.gep(tile, builder.mul(chunk.index, _i64(VALUE_CHUNK * b // 8)))
                    with cgutils.for_range(builder, n_tok) as tok:
                        x = _codes16(v, v.gep(codes0, builder.mul(tok.index, row_bytes)), b)
                        w_off = builder.mul(builder.add(builder.mul(tok.index, n_grp), grp), _i64(4))
                        for k, acc in enumerate(accs):
                            wk = v.load(w_p, builder.add(w_off, builder.mul(w_q, _i64(k))), F32, align=4)
                            _fma_into(builder, acc, v.splat(wk, VALUE_CHUNK), x)
                    for k, acc in enumerate(accs):
                        v.store(builder.load(acc), a_p, a_offs[k])

            _for_each_width(builder, bits_v, emit)
            return context.get_dummy_value()

        return sig, codegen

    return values


@intrinsic
def _prefetch(typingctx, addr, n_bytes):
    """Ask the CPU to bring the n_bytes at address `addr` into cache (one prefetch per 64-byte
    line, for reading). The decode step reads the next block's tiles this way while it computes
    on the current one: blocks sit anywhere in their slabs, a few KiB each, too short a stream
    for the hardware prefetcher to ramp up on (without the hint, a long layer's attention from
    memory took several times its cache-hot time)."""
    sig = types.void(addr, n_bytes)

    def codegen(context, builder, signature, args):
        ptr_t = I8.as_pointer()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ptr_t, I32, I32, I32]), "llvm.prefetch.p0i8"
        )
        base = builder.inttoptr(args[0], ptr_t)
        n_lines = builder.sdiv(builder.add(args[1], _i64(63)), _i64(64))
        with cgutils.for_range(builder, n_lines) as line:
            at = builder.gep(base, [builder.mul(line.index, _i64(64))])
            builder.call(fn, [at, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])  # read, keep, data
        return context.get_dummy_value()

    return sig, codegen


_tile_scores_1, _tile_scores_2, _tile_scores_3, _tile_scores_4 = (_make_tile_scores(n) for n in range(1, 5))
_tile_values_1, _tile_values_2, _tile_values_3, _tile_values_4 = (_make_tile_values(n) for n in range(1, 5))
_tile_scores_5, _tile_scores_6, _tile_scores_7, _tile_scores_8 = (_make_tile_scores(n) for n in range(5, 9))
_tile_values_5, _tile_values_6, _tile_values_7, _tile_values_8 = (_make_tile_values(n) for n in range(5, 9))


@njit(cache=True, nogil=True, inline="always")
def _vec_scores(n_q, bits, tile_addr, n_tokens, qs, sc, group, out):
    if n_q == 8:
        _tile_scores_8(bits, tile_addr, n_tokens, qs, sc, group, out)
    elif n_q == 7:
        _tile_scores_7(bits, tile_addr, n_tokens, qs, sc, group, out)
    elif n_q == 6:
        _tile_scores_6(bits, tile_addr, n_tokens, qs, sc, group, out)
    elif n_q == 5:
        _tile_scores_5(bits, tile_addr, n_tokens, qs, sc, group, out)
    elif n_q == 4:
        _tile_scores_4(bits, tile_addr, n_tokens, qs, sc, group, out)
    elif n_q == 3:
        _tile_scores_3(bits, tile_addr, n_tokens, qs, sc, group, out)
    elif n_q == 2:
        _tile_scores_2(bits, tile_addr, n_tokens, qs, sc, group, out)
    else:
        _tile_scores_1(bits, tile_addr, n_tokens, qs, sc, group, out)


@njit(cache=True, nogil=True, inline="always")
def _vec_values(n_q, bits, tile_addr, n_tokens, w, group, acc):
    if n_q == 8:
        _tile_values_8(bits, tile_addr, n_tokens, w, group, acc)
    elif n_q == 7:
        _tile_values_7(bits, tile_addr, n_tokens, w, group, acc)
    elif n_q == 6:
        _tile_values_6(bits, tile_addr, n_tokens, w, group, acc)
    elif n_q == 5:
        _tile_values_5(bits, tile_addr, n_tokens, w, group, acc)
    elif n_q == 4:
        _tile_values_4(bits, tile_addr, n_tokens, w, group, acc)
    elif n_q == 3:
        _tile_values_3(bits, tile_addr, n_tokens, w, group, acc)
    elif n_q == 2:
        _tile_values_2(bits, tile_addr, n_tokens, w, group, acc)
    else:
        _tile_values_1(bits, tile_addr, n_tokens, w, group, acc)


@njit(cache=True, inline="always")
def _chunk_order(bits, chunk, d):
    """Position of channel d in the intrinsics' order: channel order, except that 4-bit codes
    come out of each chunk of `chunk` channels as [even channels | odd channels]."""
    if bits != 4:
        return d
    i = d % chunk
    return d - i + (i // 2 if i % 2 == 0 else chunk // 2 + i // 2)


# Queries per pass over a tile (the intrinsics take 1..8): a decode step's GQA group in fours, a
# verified draft's rows' queries in eights (`decode_rows_attention`). SmolLM2's layer at 680
# tokens, K6V4, 3 KV heads, cache-hot, scores and values, minimums of 300 (Zen 5): 2 rows' 6
# queries per head 56 us in passes of 3 (each row alone), 46 in one pass; 8 rows' 24 queries
# 182 / 139.
DECODE_GROUP_Q, ROWS_GROUP_Q = 4, 8


@njit(cache=True, nogil=True, fastmath=_FAST)
def _block_scores(k_rows, j0, j1, k_layout, B, q, s, h0, h1, group_q):
    """s[h, g, j*B + t] = q[h, g]·k (unscaled) for the tokens of blocks j0..j1-1 and KV heads
    h0..h1-1 (see `decode_attention` for the arguments); the vector path reads each tile once per
    `group_q` (1..8) queries, each query's sums the same whatever the group (one compiled
    function for every caller: group_q is an argument, not a constant the compiler could fold)."""
    Hkv, G, D = q.shape
    kb, kg, kc, ks, kcb, kng, krb = k_layout
    n_sc = 1 if kb == 16 else (D if kc else B * D // kg)
    fold = kc and kb != 16
    whole_rows = kc or kb == 16  # one group per row for the intrinsic (no scales, or folded ones)
    vector = D % SCORE_CHUNK == 0 and (whole_rows or kg % SCORE_CHUNK == 0)  # `_vec_scores` reads the codes
    n_grp = 1 if whole_rows else D // kg
    tile_bytes = B * D * kb // 8  # one head's codes in a block row
    x = np.empty(B * D, np.float32)
    sd = np.empty(n_sc, np.float32)
    zd = np.empty(n_sc, np.float32)
    qs = np.empty((G, D), np.float32)
    bias = np.zeros(G, np.float32)
    out4 = np.empty((group_q, B), np.float32)
    no_scales = np.ones((B, 1), np.float32)
    q_sums = np.zeros((Hkv, G, n_grp), np.float32)  # token-axis groups: Σ of the query's channels
    q_ordered = np.empty((Hkv, G, D), np.float32)  # q in `_chunk_order`
    order = np.empty(D, np.int64)  # order[i]: the channel at position i
    sd_o = np.empty(D, np.float32)  # channel-axis scales / offsets in that order
    zd_o = np.empty(D, np.float32)
    if vector:
        for d in range(D):
            order[_chunk_order(kb, SCORE_CHUNK, d)] = d
        for h in range(h0, h1):
            for g in range(G):
                for i in range(D):
                    q_ordered[h, g, i] = q[h, g, order[i]]
                if not whole_rows:
                    for d in range(D):
                        q_sums[h, g, d // kg] += q[h, g, d]
    for j in range(j0, j1):
        row = _row_at(k_rows[j], krb)
        if j + 1 < j1 and kb != 16:  # the next block's scales (and mins)
            _prefetch(k_rows[j + 1] + kcb, krb - kcb)
        for h in range(h0, h1):
            if j + 1 < j1:  # the next block's tile of this head
                _prefetch(k_rows[j + 1] + h * tile_bytes, tile_bytes)
            if vector:
                if kb == 16:  # float16 values: no scales, bias 0
                    src = q_ordered[h]
                    sc = no_scales
                elif kc:  # q·(c*s + z) = (q*s)·c + q·z
                    _tile_scales(row, h, n_sc, kb, ks, kcb, kng, sd, zd)
                    if kb == 4:  # even / odd channels of each chunk, as the intrinsic reads them
                        for c0 in range(0, D, SCORE_CHUNK):
                            for i in range(SCORE_CHUNK // 2):
                                sd_o[c0 + i] = sd[c0 + 2 * i]
                                sd_o[c0 + SCORE_CHUNK // 2 + i] = sd[c0 + 2 * i + 1]
                                zd_o[c0 + i] = zd[c0 + 2 * i]
                                zd_o[c0 + SCORE_CHUNK // 2 + i] = zd[c0 + 2 * i + 1]
                    else:
                        sd_o[:] = sd[:D]
                        zd_o[:] = zd[:D]
                    _fold_channel_scales(q_ordered[h], sd_o, zd_o, qs, bias)
                    src = qs
                    sc = no_scales
                else:
                    _tile_scales(row, h, n_sc, kb, ks, kcb, kng, sd, zd)
                    src = q_ordered[h]
                    sc = sd.reshape((B, n_grp))
                for g0 in range(0, G, group_q):
                    n_q = min(group_q, G - g0)
                    _vec_scores(n_q, kb, k_rows[j] + h * tile_bytes, B, src[g0 : g0 + n_q], sc,
                                D if whole_rows else kg, out4)
                    for k in range(n_q):
                        m = g0 + k
                        sk = s[h, m, j * B : (j + 1) * B]
                        if whole_rows:
                            for t in range(B):
                                sk[t] = out4[k, t] + bias[m]
                        else:  # + Σ_groups z[t, g]·(Σ of the group's query channels)
                            for t in range(B):
                                sk[t] = out4[k, t]
                            for g in range(n_grp):
                                qg = q_sums[h, m, g]
                                for t in range(B):
                                    sk[t] += zd[t * n_grp + g] * qg
                continue
            if kb == 16:
                _f16_tile(row[2 * h * B * D : 2 * (h + 1) * B * D], x)
                _tile_scores(q[h], x, B, D, bias, s[h], j * B)
                continue
            _tile_scales(row, h, n_sc, kb, ks, kcb, kng, sd, zd)
            _unpack_tile(row, h, B * D, kb, x)
            if fold:
                _fold_channel_scales(q[h], sd, zd, qs, bias)
                _tile_scores(qs, x, B, D, bias, s[h], j * B)
                bias[:] = 0.0
            else:
                _dequantize_tile(x, B, D, kg, kc, sd, zd)
                _tile_scores(q[h], x, B, D, bias, s[h], j * B)


@njit(cache=True, nogil=True, fastmath=_FAST)
def _block_values(v_rows, j0, j1, v_layout, B, p, out, h0, h1, group_q):
    """out[h, g] += Σ p[h, g, j*B + t]·v over the tokens of blocks j0..j1-1, KV heads h0..h1-1;
    the vector path reads each tile once per `group_q` (1..8) queries (see `_block_scores`)."""
    Hkv, G, Dv = out.shape
    vb, vg, vc, vs, vcb, vng, vrb = v_layout
    n_sc = 1 if vb == 16 else (Dv if vc else B * Dv // vg)
    group = Dv if vb == 16 else vg  # float16: one "group" per row, weight p, no offsets
    vector = Dv % VALUE_CHUNK == 0 and (vb == 16 or (not vc and vg % VALUE_CHUNK == 0))  # `_vec_values`
    n_grp = Dv // group if vector else 1
    x = np.empty(B * Dv, np.float32)
    sd = np.empty(n_sc, np.float32)
    zd = np.empty(n_sc, np.float32)
    n_g4 = (G + group_q - 1) // group_q  # queries in groups of group_q (the last one shorter)
    acc = np.zeros((n_g4, group_q, Dv), np.float32)
    w = np.zeros((group_q, B, n_grp), np.float32)  # p * scale per (query, token, group)
    z_sum = np.zeros((G, n_grp), np.float32)  # Σ_t p * offset: the same for a group's channels
    tile_bytes = B * Dv * vb // 8  # one head's codes in a block row
    for h in range(h0, h1):
        if vector:
            acc[:] = 0.0
            z_sum[:] = 0.0
        for j in range(j0, j1):
            row = _row_at(v_rows[j], vrb)
            if j + 1 < j1:  # the next block's tile of this head, and its scales / mins
                _prefetch(v_rows[j + 1] + h * tile_bytes, tile_bytes)
                if vb != 16:
                    _prefetch(v_rows[j + 1] + vcb + 2 * h * n_sc, 2 * n_sc)
                    if not vs:
                        _prefetch(v_rows[j + 1] + vcb + 2 * vng + 2 * h * n_sc, 2 * n_sc)
            if vector:
                if vb != 16:
                    _tile_scales(row, h, n_sc, vb, vs, vcb, vng, sd, zd)
                for c in range(n_g4):
                    n_q = min(group_q, G - group_q * c)
                    for k in range(n_q):
                        m = group_q * c + k
                        pm = p[h, m, j * B : (j + 1) * B]
                        wk = w[k]
                        if vb == 16:
                            for t in range(B):
                                wk[t, 0] = pm[t]
                            continue
                        for g in range(n_grp):
                            zs = np.float32(0.0)
                            for t in range(B):
                                wk[t, g] = pm[t] * sd[t * n_grp + g]
                                zs += pm[t] * zd[t * n_grp + g]
                            z_sum[m, g] += zs
                    _vec_values(n_q, vb, v_rows[j] + h * tile_bytes, B, w, group, acc[c])
                continue
            if vb == 16:
                _f16_tile(row[2 * h * B * Dv : 2 * (h + 1) * B * Dv], x)
                _tile_values(p[h], x, B, Dv, j * B, out[h])
                continue
            _tile_scales(row, h, n_sc, vb, vs, vcb, vng, sd, zd)
            _unpack_tile(row, h, B * Dv, vb, x)
            _dequantize_tile(x, B, Dv, vg, vc, sd, zd)
            _tile_values(p[h], x, B, Dv, j * B, out[h])
        if vector:
            for m in range(G):
                for d in range(Dv):
                    out[h, m, d] += (acc[m // group_q, m % group_q, _chunk_order(vb, VALUE_CHUNK, d)]
                                     + z_sum[m, d // group])


@njit(cache=True, nogil=True, fastmath=_FAST)
def _softmax_and_full_precision(q, scale, sink_k, sink_v, sink0, n_sink_old, recent_k, recent_v, n_recent,
                                first_visible, L_old, s, mass, out, h0, h1):
    """The part of `decode_attention` between the block passes: scores of the sinks and recent
    tokens, the masked softmax of s in place, the mass, and out = the sinks' and recent tokens'
    weighted values (the sink columns of s then zeroed so the block pass skips them), for KV heads
    h0..h1-1 (the mass sums every head: h0..h1 must then be all of them)."""
    G, D = q.shape[1], q.shape[2]
    Dv = out.shape[2]
    L = L_old + n_recent
    for h in range(h0, h1):
        for g in range(G):
            qg = q[h, g]
            for c in range(n_sink_old):
                acc = np.float32(0.0)
                for d in range(D):
                    acc += qg[d] * sink_k[h, sink0 + c, d]
                s[h, g, c] = acc
            for t in range(n_recent):
                acc = np.float32(0.0)
                rk = recent_k[h, t]
                for d in range(D):
                    acc += qg[d] * rk[d]
                s[h, g, L_old + t] = acc
    lanes = np.empty(16, np.float32)
    for h in range(h0, h1):  # masked softmax over the visible columns first_visible .. L-1
        for g in range(G):
            _softmax_in_place(s[h, g, first_visible:L], scale, lanes)
            for c in range(first_visible):
                s[h, g, c] = 0.0
    if mass.shape[0]:
        for h in range(h0, h1):
            for g in range(G):
                for c in range(L):
                    mass[c] += s[h, g, c]
    for h in range(h0, h1):
        for g in range(G):
            og = out[h, g]
            for d in range(Dv):
                og[d] = 0.0
            for c in range(n_sink_old):
                w = s[h, g, c]
                s[h, g, c] = 0.0  # the block pass must not add the quantized copy
                for d in range(Dv):
                    og[d] += w * sink_v[h, sink0 + c, d]
            for t in range(n_recent):
                w = s[h, g, L_old + t]
                rv = recent_v[h, t]
                for d in range(Dv):
                    og[d] += w * rv[d]


@njit(cache=True, nogil=True)
def decode_attention(k_rows, v_rows, k_layout, v_layout, B, q, scale, sink_k, sink_v, sink0, n_sink_old,
                     recent_k, recent_v, n_recent, first_visible, mass, out):
    """Attention of one new token (its keys/values already in `recent_*`) over a layer's cache.

    Columns (key positions, oldest first): nb*B block tokens, then n_recent recent tokens.

    k_rows, v_rows: (nb,) int64 addresses of the blocks' K and V pool rows, in sequence order.
    k_layout, v_layout: (bits, group, channel, symmetric, code_bytes, n_groups, row_bytes) of the
        formats, as `_layout` gives them (row_bytes appended).
    q: (Hkv, G, D) float32 queries (G query heads per KV head), rotated like the stored keys.
    sink_k, sink_v: (Hkv, S, D|Dv) float16-rounded sinks; block columns 0..n_sink_old-1 are sink
        positions sink0.. (the position of the first block) and use these instead of their
        quantized copies.
    recent_k, recent_v: (Hkv, >= n_recent, D|Dv) the unfinished block including the new token:
        the query's own block, seen at full precision.
    first_visible: columns before it are outside a sliding window (0 = all visible).
    mass: (nb*B + n_recent,) float32, += the probabilities summed over heads and queries (H2O);
        size 0 to skip.
    out: (Hkv, G, Dv) float32, written.

    Blocks (float16 or quantized) are read by the vector intrinsics (`_vec_scores`, `_vec_values`)
    when the shapes allow: for the scores a head dim and token-axis groups that are multiples of
    SCORE_CHUNK, for the values multiples of VALUE_CHUNK and not channel-axis values. Other shapes
    are decoded a (block, head) tile at a time into a float32 scratch first. The next block's
    tiles are prefetched while the current one is computed on.
    """
    decode_attention_heads(k_rows, v_rows, k_layout, v_layout, B, q, scale, sink_k, sink_v, sink0, n_sink_old,
                           recent_k, recent_v, n_recent, first_visible, mass, out, 0, q.shape[0])


@njit(cache=True, nogil=True)
def decode_attention_heads(k_rows, v_rows, k_layout, v_layout, B, q, scale, sink_k, sink_v, sink0, n_sink_old,
                           recent_k, recent_v, n_recent, first_visible, mass, out, h0, h1):
    """`decode_attention` for KV heads h0..h1-1 only: out[h0:h1] written, the other heads' rows
    of out left as they were. A head's arithmetic is the same whichever range it is computed in
    (every loop runs within one head), so two threads that take half the heads each give the
    whole call's result bit for bit. The mass sums over all heads: with a mass, h0..h1 must be
    0..Hkv."""
    Hkv, G, D = q.shape
    nb = k_rows.shape[0]
    s = np.empty((Hkv, G, nb * B + n_recent), np.float32)
    j0 = first_visible // B  # blocks wholly before the window are skipped
    _block_scores(k_rows, j0, nb, k_layout, B, q, s, h0, h1, DECODE_GROUP_Q)
    _softmax_and_full_precision(q, scale, sink_k, sink_v, sink0, n_sink_old, recent_k, recent_v, n_recent,
                                first_visible, nb * B, s, mass, out, h0, h1)
    _block_values(v_rows, j0, nb, v_layout, B, s, out, h0, h1, DECODE_GROUP_Q)


@njit(cache=True, nogil=True)
def decode_rows_attention(k_rows, v_rows, k_layout, v_layout, B, q, scale, sink_k, sink_v, sink0, n_sink_old,
                          recent_k, recent_v, n_recent, first_visible, out, h0, h1):
    """`decode_attention_heads` of T consecutive new tokens of one sequence (a verified draft) at
    once, each row bit for bit its own decode step's: the block passes read each tile once for
    up to ROWS_GROUP_Q of the rows' queries (a query's sums do not depend on its companions);
    the sinks, the recent tokens and the softmax per row, as its step computes them.

    q: (T, Hkv, G, D) float32, row i's query; rows 0..T-1 are positions p..p+T-1 and row i's own
    block holds the recent tokens 0..n_recent+i-1 (n_recent: row 0's). first_visible: (T,) int64,
    each row's (`decode_attention`), all in one block (j0 the same). out: (T, Hkv, G, Dv)."""
    T, Hkv, G, D = q.shape
    Dv = out.shape[3]
    nb = k_rows.shape[0]
    L_old = nb * B
    j0 = first_visible[0] // B
    qa = np.empty((Hkv, T * G, D), np.float32)  # every row's queries of a KV head together
    for i in range(T):
        for h in range(h0, h1):
            for g in range(G):
                qa[h, i * G + g] = q[i, h, g]
    sa = np.empty((Hkv, T * G, L_old), np.float32)
    _block_scores(k_rows, j0, nb, k_layout, B, qa, sa, h0, h1, ROWS_GROUP_Q)
    oa = np.empty((Hkv, T * G, Dv), np.float32)
    for i in range(T):
        s = np.empty((Hkv, G, L_old + n_recent + i), np.float32)  # row i's step's scores
        for h in range(h0, h1):
            for g in range(G):
                s[h, g, :L_old] = sa[h, i * G + g]
        o = np.empty((Hkv, G, Dv), np.float32)
        _softmax_and_full_precision(q[i], scale, sink_k, sink_v, sink0, n_sink_old, recent_k, recent_v,
                                    n_recent + i, first_visible[i], L_old, s, np.zeros(0, np.float32), o, h0, h1)
        for h in range(h0, h1):
            for g in range(G):
                sa[h, i * G + g] = s[h, g, :L_old]
                oa[h, i * G + g] = o[h, g]
    _block_values(v_rows, j0, nb, v_layout, B, sa, oa, h0, h1, ROWS_GROUP_Q)
    for i in range(T):
        for h in range(h0, h1):
            for g in range(G):
                out[i, h, g] = oa[h, i * G + g]


# -- several sequences' decode steps in one call -------------------------------------------
# A decode batch (several sequences, one new token each, over one pool) runs `decode_attention`
# for every sequence from one compiled call, split between threads by the weight kernels' pool
# (`pool.run_rows`: "rows" are the sequences, or a range of one sequence's KV heads each, which
# is how one long sequence's step is shared). Each sequence's arithmetic is exactly its own
# call's, so its output does not depend on the batch. The pool passes arrays by address:
#   table  (n_rows, DECODE_FIELDS) int64, one row per sequence or head range (the DF_* fields
#          below; addresses of arrays the caller keeps alive for the call)
#   x      n_seqs rows of T float32: row r starts with sequence r's query (Hkv, G, D), T >= H*D
#          (the pool takes it as its (T, n_seqs) x: only the memory matters, copied whole)
#   out    (T, n_seqs) float32: column r gets its output (Hkv, G, Dv) flattened, T >= H*Dv (the
#          pool's layout: each worker commits a chunk of columns); a row of heads h0..h1-1 writes
#          only their part of its column
(DF_K_ROWS, DF_V_ROWS, DF_N_BLOCKS, DF_SINK_K, DF_SINK_V, DF_SINK0, DF_N_SINK_OLD, DF_TAIL_K, DF_TAIL_V,
 DF_N_RECENT, DF_FIRST_VISIBLE, DF_H0, DF_H1, DF_HKV, DF_G, DF_D, DF_DV, DF_SINKS, DF_TAIL_ROWS, DF_B, DF_SCALE,
 DF_K_LAYOUT) = range(22)  # DF_SCALE: address of a float32 scale; the layouts: 7 fields each
DF_V_LAYOUT = DF_K_LAYOUT + 7
DECODE_FIELDS = DF_V_LAYOUT + 7
_i64_pointer = _pointer_from_address(types.int64, I64)


@njit(nogil=True, cache=True)
def fill_decode_row(table, i, k_rows, v_rows, sink_k, sink_v, sink0, n_sink_old, tail_k, tail_v, n_recent,
                    first_visible, h0, h1):
    """Row i of a decode batch's table: a sequence's KV heads h0..h1-1 (the shared fields, DF_HKV
    on, are the caller's); the arrays as `decode_attention` takes them."""
    row = table[i]
    row[DF_K_ROWS] = address_of(k_rows)
    row[DF_V_ROWS] = address_of(v_rows)
    row[DF_N_BLOCKS] = k_rows.shape[0]
    row[DF_SINK_K] = address_of(sink_k)
    row[DF_SINK_V] = address_of(sink_v)
    row[DF_SINK0] = sink0
    row[DF_N_SINK_OLD] = n_sink_old
    row[DF_TAIL_K] = address_of(tail_k)
    row[DF_TAIL_V] = address_of(tail_v)
    row[DF_N_RECENT] = n_recent
    row[DF_FIRST_VISIBLE] = first_visible
    row[DF_H0] = h0
    row[DF_H1] = h1


@njit(nogil=True, cache=True)
def _f32_at(addr, shape):
    return carray(f32_pointer(addr), shape)


@njit(nogil=True, cache=True)
def _decode_row(row, x, col, out, out_col):
    """`decode_attention` of the sequence described by table row `row`: its query from x[col]
    (x: n_seqs rows), its output into out[:, out_col]."""
    Hkv, G, D, Dv = row[DF_HKV], row[DF_G], row[DF_D], row[DF_DV]
    S, R, B = row[DF_SINKS], row[DF_TAIL_ROWS], row[DF_B]
    nb = row[DF_N_BLOCKS]
    k_rows = carray(_i64_pointer(row[DF_K_ROWS]), (nb,))
    v_rows = carray(_i64_pointer(row[DF_V_ROWS]), (nb,))
    kl, vl = DF_K_LAYOUT, DF_V_LAYOUT
    k_layout = (row[kl], row[kl + 1], row[kl + 2], row[kl + 3], row[kl + 4], row[kl + 5], row[kl + 6])
    v_layout = (row[vl], row[vl + 1], row[vl + 2], row[vl + 3], row[vl + 4], row[vl + 5], row[vl + 6])
    q = x[col][: Hkv * G * D].reshape((Hkv, G, D))
    h0, h1 = row[DF_H0], row[DF_H1]
    o = np.empty((Hkv, G, Dv), np.float32)
    decode_attention_heads(k_rows, v_rows, k_layout, v_layout, B, q, _f32_at(row[DF_SCALE], (1,))[0],
                           _f32_at(row[DF_SINK_K], (Hkv, S, D)), _f32_at(row[DF_SINK_V], (Hkv, S, Dv)),
                           row[DF_SINK0], row[DF_N_SINK_OLD], _f32_at(row[DF_TAIL_K], (Hkv, R, D)),
                           _f32_at(row[DF_TAIL_V], (Hkv, R, Dv)), row[DF_N_RECENT], row[DF_FIRST_VISIBLE],
                           np.zeros(0, np.float32), o, h0, h1)
    i = h0 * G * Dv
    for h in range(h0, h1):
        for g in range(G):
            for d in range(Dv):
                out[i, out_col] = o[h, g, d]
                i += 1


def _compute_decode_rows(table_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols, out_off, r0, r1):
    """The pool's compute function for decode batches (`pool.COMPUTE_SIG`): sequences
    r0..r1-1 of the table into out's columns r - out_off."""
    table = carray(_i64_pointer(table_addr), (n_rows, row_bytes // 8))
    x = carray(f32_pointer(x_addr), (K, T))  # K = n_seqs rows of T (see above)
    out = carray(f32_pointer(out_addr), (T, out_cols))
    for r in range(r0, r1):
        _decode_row(table[r], x, r, out, r - out_off)


_decode_rows_cfunc = None
_decode_rows_lock = threading.Lock()


def decode_rows_address() -> int:
    """The address of the compiled `_compute_decode_rows` (compiled, or loaded from numba's disk
    cache, on the first call)."""
    global _decode_rows_cfunc
    if _decode_rows_cfunc is None:
        with _decode_rows_lock:
            if _decode_rows_cfunc is None:
                from .pool import COMPUTE_SIG

                _decode_rows_cfunc = cfunc(COMPUTE_SIG, nogil=True, cache=True)(_compute_decode_rows)
    return _decode_rows_cfunc.address


# -- a verified draft's rows in one call, KV heads shared between threads ------------------
# `decode_rows_attention` of one sequence's T rows as a pool job whose "rows" are its KV heads
# (every row's queries of a head together, for the tile passes). The table: one row per KV head,
# a decode batch's DF_* fields (DF_H0, DF_H1 the head) and DF_N_ROWS (T); DF_N_RECENT is row
# 0's, DF_FIRST_VISIBLE row 0's first visible column before clipping at 0 (row i's is
# max(0, that + i); NO_WINDOW without a window). x: rows of T*G*Dv floats holding the queries
# (T, Hkv, G, D) from its start; out (T*G*Dv, Hkv): column h the outputs (T, G, Dv) of head h.
DF_N_ROWS = DECODE_FIELDS
ROWS_FIELDS = DECODE_FIELDS + 1
NO_WINDOW = -(1 << 40)


@njit(nogil=True, cache=True)
def fill_rows_table(table, k_rows, v_rows, sink_k, sink_v, sink0, n_sink_old, tail_k, tail_v, n_recent,
                    visible0, n_rows):
    """The per-head fields of a rows job's table (row h: KV head h; the shared fields, DF_HKV on,
    are the caller's)."""
    for h in range(table.shape[0]):
        fill_decode_row(table, h, k_rows, v_rows, sink_k, sink_v, sink0, n_sink_old, tail_k, tail_v, n_recent,
                        visible0, h, h + 1)
        table[h, DF_N_ROWS] = n_rows


def _compute_rows_heads(table_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols, out_off, r0, r1):
    """The pool's compute function for a rows job (see above): KV heads r0..r1-1 into out's
    columns r - out_off."""
    table = carray(_i64_pointer(table_addr), (n_rows, row_bytes // 8))
    x = carray(f32_pointer(x_addr), (T * K,))
    out = carray(f32_pointer(out_addr), (T, out_cols))
    for r in range(r0, r1):
        row = table[r]
        Hkv, G, D, Dv = row[DF_HKV], row[DF_G], row[DF_D], row[DF_DV]
        S, R, B, n = row[DF_SINKS], row[DF_TAIL_ROWS], row[DF_B], row[DF_N_ROWS]
        nb = row[DF_N_BLOCKS]
        kl, vl = DF_K_LAYOUT, DF_V_LAYOUT
        k_layout = (row[kl], row[kl + 1], row[kl + 2], row[kl + 3], row[kl + 4], row[kl + 5], row[kl + 6])
        v_layout = (row[vl], row[vl + 1], row[vl + 2], row[vl + 3], row[vl + 4], row[vl + 5], row[vl + 6])
        visible = np.empty(n, np.int64)
        for i in range(n):
            visible[i] = max(0, row[DF_FIRST_VISIBLE] + i)
        h0, h1 = row[DF_H0], row[DF_H1]
        o = np.empty((n, Hkv, G, Dv), np.float32)
        decode_rows_attention(carray(_i64_pointer(row[DF_K_ROWS]), (nb,)), carray(_i64_pointer(row[DF_V_ROWS]), (nb,)),
                              k_layout, v_layout, B, x[: n * Hkv * G * D].reshape((n, Hkv, G, D)),
                              _f32_at(row[DF_SCALE], (1,))[0], _f32_at(row[DF_SINK_K], (Hkv, S, D)),
                              _f32_at(row[DF_SINK_V], (Hkv, S, Dv)), row[DF_SINK0], row[DF_N_SINK_OLD],
                              _f32_at(row[DF_TAIL_K], (Hkv, R, D)), _f32_at(row[DF_TAIL_V], (Hkv, R, Dv)),
                              row[DF_N_RECENT], visible, o, h0, h1)
        c = r - out_off
        j = 0
        for i in range(n):
            for h in range(h0, h1):
                for g in range(G):
                    for d in range(Dv):
                        out[j, c] = o[i, h, g, d]
                        j += 1


_rows_heads_cfunc = None


def rows_heads_address() -> int:
    """The address of the compiled `_compute_rows_heads` (compiled, or loaded from numba's disk
    cache, on the first call)."""
    global _rows_heads_cfunc
    if _rows_heads_cfunc is None:
        with _decode_rows_lock:
            if _rows_heads_cfunc is None:
                from .pool import COMPUTE_SIG

                _rows_heads_cfunc = cfunc(COMPUTE_SIG, nogil=True, cache=True)(_compute_rows_heads)
    return _rows_heads_cfunc.address


@njit(cache=True, nogil=True, fastmath=_FAST)
def masked_softmax(s, lo, hi, scale):
    """In place, row by row: s[h, m, lo[t]:hi[t]] = softmax(scale * s[h, m, lo[t]:hi[t]]) and the
    rest of the row 0, where t = m % len(lo) (rows are (query head in the group, token) pairs,
    token fastest). s (Hkv, M, L) float32; lo, hi (T,) int64 with lo < hi <= L."""
    T = lo.shape[0]
    lanes = np.empty(16, np.float32)
    for h in range(s.shape[0]):
        for m in range(s.shape[1]):
            t = m % T
            row = s[h, m]
            a, b = lo[t], hi[t]
            _softmax_in_place(row[a:b], scale, lanes)
            row[:a] = 0.0
            row[b:] = 0.0


def decode_layout(fmt, n_kv_heads: int, block_tokens: int, head_dim: int) -> tuple:
    """`_layout` of a format as the tuple `decode_attention` takes (row bytes appended)."""
    layout, row_bytes = _layout(fmt, n_kv_heads, block_tokens, head_dim)
    return tuple(int(v) for v in layout) + (int(row_bytes),)


@njit(cache=True, inline="always")
def _f16_rounded_bits(f):
    """The float32 bits of the float32 with bits f (an int64) rounded to float16 and back, as
    x.astype(np.float16).astype(np.float32) gives them: numpy's npy_floatbits_to_halfbits (round
    half to even, subnormal halves, overflow to infinity, a NaN stays a NaN), then
    npy_halfbits_to_floatbits, step for step."""
    sign = f & 0x80000000
    f_exp = f & 0x7F800000
    f_sig = f & 0x007FFFFF
    if f_exp >= 0x47800000:  # infinity, NaN, or too large for a half: infinity
        if f_exp == 0x7F800000 and f_sig != 0:
            h = f_sig >> 13
            return sign | 0x7F800000 | ((h if h else 1) << 13)
        return sign | 0x7F800000
    if f_exp <= 0x38000000:  # a subnormal half, or zero
        if f_exp < 0x33000000:
            return sign
        e = f_exp >> 23
        s = (0x00800000 + f_sig) >> (113 - e)
        if (s & 0x3FFF) != 0x1000 or (f & 0x7FF) != 0:
            s += 0x1000
        h = s >> 13  # 0x400 when the rounding spills into the smallest normal
    else:
        s = f_sig
        if (s & 0x3FFF) != 0x1000:
            s += 0x1000
        h = (s >> 13) + ((f_exp - 0x38000000) >> 13)  # 0x7c00: rounded up to infinity
    if h >= 0x7C00:
        return sign | 0x7F800000
    if h >= 0x400:
        return sign | ((h + 0x1C000) << 13)
    if h == 0:
        return sign
    h_exp = 0  # a subnormal half: normalized into a float32
    h <<= 1
    while (h & 0x400) == 0:
        h <<= 1
        h_exp += 1
    return sign | ((127 - 15 - h_exp) << 23) | ((h & 0x3FF) << 13)


@njit(cache=True, nogil=True)
def store_tail_row(k, v, tail_k, tail_v, n):
    """tail_k[:, n] = k and tail_v[:, n] = v rounded to float16 (the values k.astype(np.float16)
    gives, stored as float32): k (Hkv, D), v (Hkv, Dv) float32 C-contiguous, the tails (Hkv, B, D)
    and (Hkv, B, Dv) float32 C-contiguous. numpy's float16 casts take ~1.5 ns a value each way
    here (scalar), and two assignments per row."""
    kb, vb = k.view(np.uint32), v.view(np.uint32)
    tkb, tvb = tail_k.view(np.uint32), tail_v.view(np.uint32)
    for h in range(kb.shape[0]):
        for d in range(kb.shape[1]):
            tkb[h, n, d] = _f16_rounded_bits(np.int64(kb[h, d]))
        for d in range(vb.shape[1]):
            tvb[h, n, d] = _f16_rounded_bits(np.int64(vb[h, d]))
