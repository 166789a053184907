"""Matrix products straight from GGUF quantized blocks (numba + explicit SIMD IR).

Kernels per GGUF type, reading the (rows, bytes per row) uint8 view of the memory-mapped blocks
(`GGUFFile.raw`), so that weights stay quantized in memory:

    Matvec(type, raw, K)(x, y)          y[t, r] = Σ_k x[t, k] · W[r, k]   (decode: x has few rows)
    dequantize_rows(type, raw, rows, out)  out[i] = W[rows[i]]         (prefill tiles, embeddings)

where W = `gguf.quants.dequantize(raw, type)` (float32). `dequantize_rows` reproduces those values
bit for bit; the matvec multiplies exactly those values and differs from `x @ W.T` only by the
order (and fusing, FMA) of the float32 additions.

Design. numba leaves SLP vectorization off and fully unrolls the short per-block loops, so a plain
numba loop over 32-value blocks compiles to scalar code. The per-block work is therefore written
as LLVM vector IR (numba `@intrinsic`, in `engine.kernels.vector_ir`'s vocabulary), one decoder
per type that turns a block's bytes into <16 x float> vectors of dequantized values:

    load the block's code bytes as one vector (16 or 32 bytes) -> zero/sign-extend to i32 lanes ->
    shift / mask / or in high bits (or look 4-bit codes up in a code book) -> int-to-float ->
    d * q (+ m)

with the block's float16 scale fields converted exactly (F16C `vcvtph2ps` when the CPU has it,
else integer operations) and applied as in `gguf.quants`: same
operations in the same order. Every product there (float16 scale x small integer, at most 24
significant bits) is exact in float32, so fusing `d*q + m` into an FMA keeps gguf's single
rounding. The row-dot intrinsic loops over a row's blocks, multiplies the vectors with x and
accumulates into two <16 x float> accumulators (FMA), summed at the end of the row; the
dequantize intrinsic stores the vectors instead. Rows are split between the calling thread and a
small pool of worker threads without a barrier (`engine.kernels.pool`), CHUNK_BYTES of blocks
per chunk. A decode step's matvecs read every weight block from memory once, so their speed is
bounded by memory bandwidth; the vector decoders and a second thread bring it closer to that bound
(benchmarks/bench_weights.py measures it).

Row layouts (little-endian; d, m, dmin float16; see ggml-common.h / gguf.quants):
    Q8_0  34 B / 32: d | 32 x int8 q                               w = q*d
    Q4_0  18 B / 32: d | 16 B nibbles (lo -> 0..15, hi -> 16..31)  w = d*(q-8)
    Q4_1  20 B / 32: d | m | 16 B nibbles                          w = d*q + m
    Q5_0  22 B / 32: d | qh u32 (bit j = high bit of value j) | 16 B nibbles   w = d*(q-16)
    Q5_1  24 B / 32: d | m | qh u32 | 16 B nibbles                 w = d*q + m
    Q4_K 144 B / 256: d | dmin | 12 B 6-bit scales/mins | 128 B nibbles (32 B per pair of
                      32-value sub-blocks: lo nibbles -> sub-block 2i, hi -> 2i+1)
                      w = (d*sc)*q - dmin*mn
    Q5_K 176 B / 256: d | dmin | 12 B scales | 32 B qh (bit s of byte j: sub-block s, value j) |
                      128 B nibbles as Q4_K                       w = (d*sc)*q - dmin*mn
    Q6_K 210 B / 256: 128 B ql nibbles | 64 B qh 2-bit pairs | 16 x int8 scales | d
                      w = (d*sc)*(q-32)
    Q2_K  84 B / 256: 16 B scales (per 16-value sub-block: lo nibble sc, hi nibble mn) |
                      64 B 2-bit codes (32 B per 128 values: bits 2j..2j+1 of byte k -> value
                      32j + k) | d | dmin                          w = (d*sc)*q - dmin*mn
    Q3_K 110 B / 256: 32 B hmask (bit b of byte k: value 32b + k; clear means q - 4) | 64 B 2-bit
                      codes as Q2_K | 12 B 6-bit scales (minus 32) | d     w = (d*sc)*q
    IQ4_NL 18 B / 32: d | 16 B nibbles as Q4_0, indices into a 16-value int8 code book kv
                      w = d*kv[q]
    IQ4_XS 136 B / 256: d | u16 high 2 bits of 8 scales | 4 B low nibbles of the scales |
                      128 B nibbles (16 B per 32-value sub-block, as IQ4_NL)   w = (d*(sc-32))*kv[q]
    F16 / BF16: 16-value groups of 2-byte values (rows must be a multiple of 16 values).

Compiled code is cached on disk by numba (`cache=True`); `warm_up(types)` loads or compiles the
kernels a model needs and logs the time (the first start on a machine compiles them; later starts
load them). Only the types asked for are compiled: the work-sharing pool calls a type's kernel
through the address of its compute function (a numba `cfunc`), so the pool's code holds no type's
decoder and compiles once (`pool.warm_up_pool`, which `pool.defer_pool` lets a background thread do while
matvecs run on the calling thread). The IR the decoders are written in lives in
`engine.kernels.vector_ir`, whose cache locators make an edit there recompile these kernels too.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT
from numba import carray, cfunc, njit

from .pool import (
    _MAX_CHUNKS,
    CHUNK_BYTES,
    COMPUTE_SIG,
    _cache_misses,
    _matvec_here,
    readonly,
    run_rows,
    warm_up_pool,
)
from .vector_ir import (
    F32,
    I8,
    I16,
    I32,
    LANES,
    decode_f16,
    f32_pointer,
    make_row_dequantize,
    make_row_dot,
    ACC_VALUES,
    kernel_copy,
    make_rows_dot_part,
    u8_pointer,
    vector_type,
)

log = logging.getLogger("omlx.kernels")


# ---------------------------------------------------------------------------------------------
# Block decoders: (ir, blk) -> list of <16 x float> dequantized values, in row order
# ---------------------------------------------------------------------------------------------


def _dec_q8_0(v, blk):
    d = v.f16(v.u16s(blk, 0))
    return [v.fmul(v.sf(v.s8(blk, 2 + 16 * i)), d) for i in range(2)]


# Decoders of 4-bit codes, where `v.float_tables` (AVX-512: one vpermps per 16 lanes), first
# compute the block's (or sub-block's) 16 possible values with the same operations gguf applies to
# a code, then look each code up: the same float32 values as converting and scaling every code,
# in two instructions fewer per 16 values (a batch's decode step is bound by these operations).


def _dec_q4_0(v, blk):
    d = v.f16(v.u16s(blk, 0))
    q = v.u8(blk, 2)
    if v.float_tables:
        table = v.fmul(v.cfv(range(-8, 8)), d)  # d * (c - 8) for each code c
        return [v.permute16(table, q), v.permute16(table, v.shr(q, 4))]
    return [v.fmul(v.sf(v.sub(v.and_(q, 15), 8)), d), v.fmul(v.sf(v.sub(v.shr(q, 4), 8)), d)]


def _dec_q4_1(v, blk):
    d = v.f16(v.u16s(blk, 0))
    m = v.f16(v.u16s(blk, 2))
    q = v.u8(blk, 4)
    if v.float_tables:
        table = v.fadd(v.fmul(v.cfv(range(16)), d), m)  # d * c + m
        return [v.permute16(table, q), v.permute16(table, v.shr(q, 4))]
    return [v.fadd(v.fmul(v.sf(v.and_(q, 15)), d), m), v.fadd(v.fmul(v.sf(v.shr(q, 4)), d), m)]


def _q5_codes(v, qh, q):
    """Q5_0/Q5_1 5-bit codes: nibbles of q (16 bytes) plus bit j of qh for value j."""
    qhv = v.splat(qh)
    h0 = v.shl(v.and_(v.b.lshr(qhv, v.civ(range(16))), 1), 4)
    h1 = v.shl(v.and_(v.b.lshr(qhv, v.civ(range(16, 32))), 1), 4)
    return v.b.or_(v.and_(q, 15), h0), v.b.or_(v.shr(q, 4), h1)


def _dec_q5_0(v, blk):
    d = v.f16(v.u16s(blk, 0))
    c0, c1 = _q5_codes(v, v.u32s(blk, 2), v.u8(blk, 6))
    return [v.fmul(v.sf(v.sub(c, 16)), d) for c in (c0, c1)]


def _dec_q5_1(v, blk):
    d = v.f16(v.u16s(blk, 0))
    m = v.f16(v.u16s(blk, 2))
    c0, c1 = _q5_codes(v, v.u32s(blk, 4), v.u8(blk, 8))
    return [v.fadd(v.fmul(v.sf(c), d), m) for c in (c0, c1)]


def _k_scale_min(v, blk, s):
    """6-bit scale and min of sub-block s of a Q4_K/Q5_K block (12 bytes at offset 4)."""
    if s < 4:
        sc = v.and_(v.u8s(blk, 4 + s), 63)
        mn = v.and_(v.u8s(blk, 8 + s), 63)
    else:
        sc = v.or_(v.and_(v.u8s(blk, 8 + s), 15), v.shl(v.shr(v.u8s(blk, s), 6), 4))
        mn = v.or_(v.shr(v.u8s(blk, 8 + s), 4), v.shl(v.shr(v.u8s(blk, 4 + s), 6), 4))
    return sc, mn


def _dec_qk(v, blk, qs_off, qh_off):
    d = v.f16(v.u16s(blk, 0))
    dmin = v.f16(v.u16s(blk, 2))
    out = []
    for s in range(8):
        sc, mn = _k_scale_min(v, blk, s)
        dsc = v.b.fmul(d, v.sf(sc))
        dmn = v.b.fmul(dmin, v.sf(mn))
        if qh_off is None and v.float_tables:  # Q4_K
            table = v.fsub(v.fmul(v.cfv(range(16)), dsc), dmn)  # (d*sc) * c - dmin*mn
            for half in range(2):
                q = v.u8(blk, qs_off + 32 * (s // 2) + 16 * half)
                out.append(v.permute16(table, q if s % 2 == 0 else v.shr(q, 4)))
            continue
        for half in range(2):
            q = v.u8(blk, qs_off + 32 * (s // 2) + 16 * half)
            q = v.and_(q, 15) if s % 2 == 0 else v.shr(q, 4)
            if qh_off is not None:
                h = v.u8(blk, qh_off + 16 * half)
                q = v.b.or_(q, v.shl(v.and_(v.shr(h, s), 1), 4))
            out.append(v.fsub(v.fmul(v.sf(q), dsc), dmn))
    return out


def _dec_q4_k(v, blk):
    return _dec_qk(v, blk, 16, None)


def _dec_q5_k(v, blk):
    return _dec_qk(v, blk, 48, 16)


def _dec_q6_k(v, blk):
    d = v.f16(v.u16s(blk, 208))
    out = []
    for h in range(2):
        for c in range(4):
            for half in range(2):
                k = 16 * half
                ql = v.u8(blk, 64 * h + 32 * (c & 1) + k)
                ql = v.and_(ql, 15) if c < 2 else v.shr(ql, 4)
                qh = v.and_(v.shr(v.u8(blk, 128 + 32 * h + k), 2 * c), 3)
                q = v.sub(v.b.or_(ql, v.shl(qh, 4)), 32)
                dsc = v.b.fmul(d, v.sf(v.s8s(blk, 192 + 8 * h + 2 * c + half)))
                out.append(v.fmul(v.sf(q), dsc))
    return out


def _bytes(v, blk, off):
    """LANES bytes at off as an i8 vector (bit fields are cut out before widening to i32 lanes)."""
    return v.load(blk, off, vector_type(I8, LANES))


def _broadcast(v, vec, lane):
    """Lane `lane` of vec in every one of LANES lanes."""
    return v.b.shuffle_vector(vec, vec, v.civ([lane] * LANES))


def _dec_q2_k(v, blk):
    d = v.f16(v.u16s(blk, 80))
    dmin = v.f16(v.u16s(blk, 82))
    sc = v.u8(blk, 0)  # the 16 sub-blocks' scale bytes, converted as one vector
    dl = v.fmul(v.sf(v.and_(sc, 15)), d)
    ml = v.fmul(v.sf(v.shr(sc, 4)), dmin)
    out = []
    for h in range(2):
        for j in range(4):
            for half in range(2):
                s = 8 * h + 2 * j + half  # the 16-value sub-block of values 128h + 32j + 16half ..
                q = v.and_(v.shr(_bytes(v, blk, 16 + 32 * h + 16 * half), 2 * j), 3)
                q = v.b.zext(q, vector_type(I32, LANES))
                out.append(v.fsub(v.fmul(v.sf(q), _broadcast(v, dl, s)), _broadcast(v, ml, s)))
    return out


def _dec_q3_k(v, blk):
    d = v.f16(v.u16s(blk, 108))
    # sub-block s's 6-bit scale: low 4 bits from byte s % 8 (shifted 4 * (s // 8)), high 2 bits
    # from byte 8 + s % 4 (shifted 2 * (s // 4)) of the 12 scale bytes at 96
    lo = v.b.shuffle_vector(v.u8(blk, 96, 8), v.u8(blk, 96, 8), v.civ(list(range(8)) * 2))
    lo = v.and_(v.b.lshr(lo, v.civ([0] * 8 + [4] * 8)), 15)
    hi = v.b.shuffle_vector(v.u8(blk, 104, 4), v.u8(blk, 104, 4), v.civ(list(range(4)) * 4))
    hi = v.and_(v.b.lshr(hi, v.civ([0] * 4 + [2] * 4 + [4] * 4 + [6] * 4)), 3)
    dl = v.fmul(v.sf(v.sub(v.b.or_(lo, v.shl(hi, 4)), 32)), d)
    out = []
    for h in range(2):
        for j in range(4):
            for half in range(2):
                s = 8 * h + 2 * j + half  # as Q2_K
                ql = v.and_(v.shr(v.u8(blk, 32 + 32 * h + 16 * half), 2 * j), 3)
                b = 4 * h + j  # hmask bit b, moved to bit 2 (value 4)
                hm = v.u8(blk, 16 * half)
                h4 = v.and_(v.shr(hm, b - 2) if b >= 2 else v.shl(hm, 2 - b), 4)
                q = v.sub(v.b.or_(ql, h4), 4)  # ql - 4 where the hmask bit is clear
                out.append(v.fmul(v.sf(q), _broadcast(v, dl, s)))
    return out


# IQ4_NL's and IQ4_XS's 4-bit code book (gguf.quants.IQ4_NL.kvalues)
_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_codes(v, blk, off):
    """The code-book values of 16 bytes of nibbles at off: (low nibbles, high nibbles) as i32 lanes."""
    q = _bytes(v, blk, off)
    i32s = vector_type(I32, LANES)
    return (v.b.sext(v.lookup16(_IQ4_VALUES, v.and_(q, 15)), i32s),
            v.b.sext(v.lookup16(_IQ4_VALUES, v.shr(q, 4)), i32s))


def _dec_iq4_nl(v, blk):
    d = v.f16(v.u16s(blk, 0))
    if v.float_tables:
        table = v.fmul(v.cfv(_IQ4_VALUES), d)  # d * kv[c]
        q = v.u8(blk, 2)
        return [v.permute16(table, q), v.permute16(table, v.shr(q, 4))]
    return [v.fmul(v.sf(c), d) for c in _iq4_codes(v, blk, 2)]


def _dec_iq4_xs(v, blk):
    d = v.f16(v.u16s(blk, 0))
    # the 8 sub-blocks' 6-bit scales as one vector: low 4 bits the nibbles of the bytes at 4 (low
    # nibble first), high 2 bits bits 2s..2s+1 of the u16 at 2
    lo = v.b.shuffle_vector(v.u8(blk, 4, 4), v.u8(blk, 4, 4), v.civ([0, 0, 1, 1, 2, 2, 3, 3]))
    lo = v.and_(v.b.lshr(lo, v.civ([0, 4] * 4)), 15)
    hi = v.and_(v.b.lshr(v.splat(v.u16s(blk, 2), 8), v.civ(range(0, 16, 2))), 3)
    dl = v.fmul(v.sf(v.sub(v.b.or_(lo, v.shl(hi, 4)), 32)), d)
    out = []
    for s in range(8):
        if v.float_tables:
            table = v.fmul(v.cfv(_IQ4_VALUES), _broadcast(v, dl, s))  # (d*(sc-32)) * kv[c]
            q = v.u8(blk, 8 + 16 * s)
            out.extend((v.permute16(table, q), v.permute16(table, v.shr(q, 4))))
            continue
        out.extend(v.fmul(v.sf(c), _broadcast(v, dl, s)) for c in _iq4_codes(v, blk, 8 + 16 * s))
    return out


def _dec_bf16(v, blk):
    h = v.b.zext(v.load(blk, 0, vector_type(I16, LANES)), vector_type(I32, LANES))
    return [v.b.bitcast(v.shl(h, 16), vector_type(F32, LANES))]


# The one declaration of each type the float kernels read: its block decoder. Its kernels are made
# from it (`_make_kernels`) with the block's values and bytes as gguf declares them
# (GGML_QUANT_SIZES, `block_shape`); F16 and BF16 are decoded 16 values (32 bytes) at a time.
_DECODERS = {
    QT.Q8_0: _dec_q8_0,
    QT.Q4_0: _dec_q4_0,
    QT.Q4_1: _dec_q4_1,
    QT.Q5_0: _dec_q5_0,
    QT.Q5_1: _dec_q5_1,
    QT.Q4_K: _dec_q4_k,
    QT.Q5_K: _dec_q5_k,
    QT.Q6_K: _dec_q6_k,
    QT.F16: decode_f16,
    QT.BF16: _dec_bf16,
    QT.Q2_K: _dec_q2_k,
    QT.Q3_K: _dec_q3_k,
    QT.IQ4_NL: _dec_iq4_nl,
    QT.IQ4_XS: _dec_iq4_xs,
}


def block_shape(ggml_type: QT) -> tuple[int, int]:
    """(values, bytes) of the unit the kernels decode (a GGUF block; 16 values for F16/BF16)."""
    return (16, 32) if ggml_type in (QT.F16, QT.BF16) else GGML_QUANT_SIZES[ggml_type]


# ---------------------------------------------------------------------------------------------
# Kernels (numba), made for every declared type from templates: each type's row dot products (one
# and several rows of x), row dequantization and pool compute function
# ---------------------------------------------------------------------------------------------

# Several rows of x (a decode batch): weight rows go _ROW_GROUP at a time through K tiles of ~512
# values, each block decoded once for up to 4 rows of x, the partial sums kept per (weight row, x
# row) between tiles; the tile of x (4 x 512 floats, 8 KiB) stays in L1 while the group's blocks
# stream past it. Without the tiles a 1B model's 4 rows of x (32-128 KiB) came from L2 for every
# block, and a batch of 4 cost 3.3x one sequence's step instead of ~1.4x.
# Rows of x up to _UNTILED_K values (4 of them: 16 KiB) stay in L1 whole: one tile (SmolLM2's
# 576-value rows were slower in tiles).
_ROW_GROUP = 16
_UNTILED_K = 1024
_TILE_VALUES = 512


# The templates. Each type's copy (`kernel_copy`: the same bytecode under the type's own name, so
# that numba's disk cache files it apart) reads its own module-level names for the capitalised
# ones: _dot_<type>, _part{4,2,1}_<type> (`make_row_dot`, `make_rows_dot_part`), _deq_<type>
# (`make_row_dequantize`), _values_<type> (values per block) and _tile_<type> (blocks per K tile).
# All release the GIL.
def _row_loop_template(raw, x, y, r0, r1, yoff):
    """y[:, r - yoff] = x @ W[r] for the weight rows r0 .. r1-1 (raw: the rows' blocks)."""
    T = x.shape[0]
    if T == 1:
        x0 = x[0]
        for r in range(r0, r1):
            y[0, r - yoff] = DOT(raw[r], x0)  # noqa: F821
        return
    nb = x.shape[1] // VALUES  # noqa: F821
    kt = nb if x.shape[1] <= _UNTILED_K else TILE  # noqa: F821
    acc = np.empty((_ROW_GROUP, 4 * ACC_VALUES), np.float32)
    for g0 in range(r0, r1, _ROW_GROUP):
        g1 = min(r1, g0 + _ROW_GROUP)
        t = 0
        while t < T:
            n = 4 if T - t >= 4 else (2 if T - t >= 2 else 1)
            for b0 in range(0, nb, kt):
                b1 = min(nb, b0 + kt)
                for r in range(g0, g1):
                    c = r - yoff
                    if n == 4:
                        s0, s1, s2, s3 = PART4(raw[r], x, t, b0, b1, acc[r - g0])  # noqa: F821
                        if b1 == nb:
                            y[t, c], y[t + 1, c], y[t + 2, c], y[t + 3, c] = s0, s1, s2, s3
                    elif n == 2:
                        s0, s1 = PART2(raw[r], x, t, b0, b1, acc[r - g0])  # noqa: F821
                        if b1 == nb:
                            y[t, c], y[t + 1, c] = s0, s1
                    else:
                        s0 = PART1(raw[r], x, t, b0, b1, acc[r - g0])[0]  # noqa: F821
                        if b1 == nb:
                            y[t, c] = s0
            t += n


def _dequantize_template(raw, rows, out):
    """out[i] = W[rows[i]]."""
    for i in range(out.shape[0]):
        DEQ(raw[rows[i]], out[i])  # noqa: F821


# The pool runs a job's rows through a C function pointer: a job descriptor carries the address
# of its type's compute function, a numba `cfunc` made (compiled, or loaded from numba's cache) by
# `warm_up` for the types a model uses. The pool's own code is then the same for every type and
# compiles once, without any type's block decoder in it; dispatching on a type code instead would
# compile every type's kernels into it (and into each function that calls it), whichever types a
# model has. Each is `_rows_<type>` over arrays made from the job's addresses (the signature,
# `pool.COMPUTE_SIG`: 11 int64s, raw_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols,
# out_off, r0, r1).
def _compute_template(raw_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols, out_off, r0, r1):
    ROWS(carray(u8_pointer(raw_addr), (n_rows, row_bytes)), carray(f32_pointer(x_addr), (T, K)),  # noqa: F821
         carray(f32_pointer(out_addr), (T, out_cols)), r0, r1, out_off)


def _make_kernels():
    """Every declared type's kernels, as module-level functions of their own names:
    ({type: (rows, dequantize rows)}, {type: compute function (Python, made a cfunc on use)})."""
    kernels, computes = {}, {}
    namespace = globals()
    for ggml_type, decoder in _DECODERS.items():
        values, nbytes = block_shape(ggml_type)
        stem = ggml_type.name.lower()
        names = {"DOT": f"_dot_{stem}", "DEQ": f"_deq_{stem}", "VALUES": f"_values_{stem}", "TILE": f"_tile_{stem}"}
        namespace[names["DOT"]] = make_row_dot(decoder, values, nbytes)
        namespace[names["DEQ"]] = make_row_dequantize(decoder, values, nbytes)
        for n in (4, 2, 1):
            names[f"PART{n}"] = f"_part{n}_{stem}"
            namespace[names[f"PART{n}"]] = make_rows_dot_part(decoder, values, nbytes, n)
        namespace[names["VALUES"]], namespace[names["TILE"]] = values, max(1, _TILE_VALUES // values)
        rows = njit(nogil=True, cache=True)(kernel_copy(_row_loop_template, namespace, f"_rows_{stem}", names))
        dq = njit(nogil=True, cache=True)(kernel_copy(_dequantize_template, namespace, f"_dq_{stem}", names))
        namespace[rows.__name__], namespace[dq.__name__] = rows, dq
        kernels[ggml_type] = (rows, dq)
        computes[ggml_type] = kernel_copy(_compute_template, namespace, f"_compute_{stem}", {"ROWS": rows.__name__})
    return kernels, computes


_KERNELS, _COMPUTE_PY = _make_kernels()
TYPES = frozenset(_KERNELS)
_compute_cfuncs: dict = {}  # ggml type -> its compiled cfunc (made by `_compute_address`)
_compute_lock = threading.Lock()


def _compute_address(ggml_type: QT) -> int:
    """The address of the type's compiled compute function (compiled, or loaded from numba's
    disk cache, on the first call for the type)."""
    fn = _compute_cfuncs.get(ggml_type)
    if fn is None:
        with _compute_lock:
            fn = _compute_cfuncs.get(ggml_type)
            if fn is None:
                fn = _compute_cfuncs[ggml_type] = cfunc(COMPUTE_SIG, nogil=True, cache=True)(_COMPUTE_PY[ggml_type])
    return fn.address



# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------



def supports(ggml_type: QT, in_features: int) -> bool:
    """Whether the kernels read rows of `in_features` values of this type."""
    return ggml_type in _KERNELS and in_features % block_shape(ggml_type)[0] == 0


def _check(ggml_type: QT, raw: np.ndarray, n_values: int) -> None:
    # The kernels do not check bounds: the row length in bytes must match the values asked for.
    bs, ts = block_shape(ggml_type)
    if raw.dtype != np.uint8 or raw.ndim != 2 or not raw.flags.c_contiguous:
        raise ValueError("quantized rows must be a C-contiguous (rows, bytes) uint8 array")
    if n_values % bs or raw.shape[1] != n_values // bs * ts:
        raise ValueError(f"{ggml_type.name} rows of {raw.shape[1]} bytes do not hold {n_values} values")


class Matvec:
    """y = x @ W.T for one matrix of quantized rows, prepared once (checks, chunking) so that a
    call costs little more than the kernel: W = dequantize(raw), raw (rows, bytes) uint8."""

    __slots__ = ("ggml_type", "raw", "n_rows", "in_features", "compute", "chunk", "shared")

    def __init__(self, ggml_type: QT, raw: np.ndarray, in_features: int):
        _check(ggml_type, raw, in_features)
        self.ggml_type = ggml_type
        self.raw = readonly(raw)
        self.n_rows, self.in_features = raw.shape[0], in_features
        self.compute = _compute_address(ggml_type)  # the type's kernel, for this thread and the pool's
        # rows per chunk: ~CHUNK_BYTES, a multiple of 16 (a 64-byte line of y per thread), and at
        # most _MAX_CHUNKS chunks
        chunk = max(16, (CHUNK_BYTES // raw.shape[1]) // 16 * 16, -(-self.n_rows // _MAX_CHUNKS))
        self.chunk = chunk
        self.shared = self.n_rows > chunk  # more than one chunk: worth sharing with the pool

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """x: C-contiguous float32 (T, in_features); out: C-contiguous float32 (T, rows)."""
        return run_rows(self.compute, self.raw, x, out, self.chunk, self.chunk * self.raw.shape[1] * x.shape[0])


def matvec(ggml_type: QT, raw: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x (T, K) float32 -> x @ W.T (T, rows) float32, W the dequantized raw (rows, bytes).

    Output rows are split between the calling thread and the pool's workers (see `_Pool`); meant
    for small T (each row of x is a pass over the blocks, which stay in the core's caches)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    mv = Matvec(ggml_type, raw, x.shape[1])
    if out is None:
        out = np.empty((x.shape[0], raw.shape[0]), dtype=np.float32)
    elif out.shape != (x.shape[0], raw.shape[0]) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError("out must be a C-contiguous float32 (T, rows) array")
    return mv(x, out)


def dequantize_rows(ggml_type: QT, raw: np.ndarray, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = W[rows[i]] (float32, bit-identical to gguf.quants.dequantize); one thread."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    _check(ggml_type, raw, out.shape[1])
    if out.dtype != np.float32 or not out.flags.c_contiguous or out.shape[0] != rows.shape[0]:
        raise ValueError("out must be a C-contiguous float32 (len(rows), values) array")
    if rows.size and (rows.min() < 0 or rows.max() >= raw.shape[0]):
        raise IndexError(f"row index out of range for {raw.shape[0]} rows")
    _KERNELS[ggml_type][1](readonly(raw), rows, out)
    return out


_warm: set[QT] = set()
_warm_rows: set = set()  # types whose row dequantizer alone is ready (warm_up's rows_only)

def warm_up(ggml_types, pool: bool = True, rows_only=()) -> float:
    """Compile, or load from numba's on-disk cache, the kernels of these types (once per process)
    and run them on a tiny input; logs how long that took. Returns the seconds spent.

    A type costs its compute function (`_compute_address`) and its row dequantizer; a type in
    `rows_only` (a table whose products take the integer kernels, read by row for embedding
    lookups) only its row dequantizer. pool=True also makes the work-sharing pool's functions
    ready (`warm_up_pool`, once per process); pool=False leaves them to the caller (`defer_pool`
    + `warm_up_pool` in a background thread)."""
    for t in sorted({QT(t) for t in rows_only if QT(t) in _KERNELS} - _warm - _warm_rows, key=lambda t: t.name):
        bs, ts = block_shape(t)
        t0 = time.perf_counter()
        dequantize_rows(t, np.zeros((1, 256 // bs * ts), np.uint8), np.zeros(1, np.int64),
                        np.empty((1, 256), np.float32))
        _warm_rows.add(t)
        log.info("%s row dequantizer ready in %.2f s", t.name, time.perf_counter() - t0)
    todo = sorted({QT(t) for t in ggml_types if QT(t) in _KERNELS} - _warm, key=lambda t: t.name)
    seconds = 0.0
    if todo:
        t0 = time.perf_counter()
        compiled = []
        for t in todo:
            bs, ts = block_shape(t)
            n_values = 256
            raw = np.zeros((2, n_values // bs * ts), dtype=np.uint8)
            funcs = (_KERNELS[t][1], _matvec_here)
            misses = _cache_misses(funcs)
            new_cfunc = t not in _compute_cfuncs
            x = np.zeros((1, n_values), np.float32)
            matvec(t, raw, x)  # two rows: one chunk, on this thread
            dequantize_rows(t, raw, np.zeros(1, np.int64), np.empty((1, n_values), np.float32))
            if _cache_misses(funcs) > misses or (new_cfunc and _compute_cfuncs[t].cache_hits == 0):
                compiled.append(t.name)
            _warm.add(t)
        seconds = time.perf_counter() - t0
        log.info("quantized-weight kernels for %s ready in %.2f s (%s)", ", ".join(t.name for t in todo), seconds,
                 f"compiled {', '.join(compiled)}; cached on disk for the next start" if compiled
                 else "loaded from numba's cache")
    if pool:
        seconds += warm_up_pool()
    return seconds


