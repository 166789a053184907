"""Exact-grade integer products with quantized weights: y = x @ W.T from repacked GGUF blocks.

The arithmetic (docs/kernels.md has the whole design; `engine.kernels.int_reference` is the numpy
emulation the kernels are tested against, bit for bit):

    x row -> 16-bit codes q per 32-value block, scale s_b (`int_dot.quantize_activations`)
    per output row r and block b:  I = sum_k c[r,k] * q[k]          (exact, int32)
                                   blk = float32(I - off * Q_b) * (d[r,b] * s_b)   (+ m[r,b] * sQ_b)
    y[r] = (((0 + blk_0) + blk_1) + ...)                             (float32, blocks in order)

with c the type's integer weight codes (Q4_0: the nibbles 0..15 and off = 8; Q4_1: nibbles, plus
its block minimum m; Q8_0: the signed bytes). Every x row is computed alone, the same operations
whatever the batch: a row in a batch is bit-identical to the same row alone.

Layout: each group of 16 consecutive weight rows is repacked block by block, so that one 512-bit
vector holds the same 4 code bytes of 16 rows (lane r = row r): for group g and block b, GB =
16 * (bytes per block) bytes:
    16 float16 d (row order) | [16 float16 m] | code vectors P_j, 64 bytes each: byte 4r + i of
    P_j = byte 4j + i of row r's block codes (Q4_0/Q4_1: j = 0..3, 16 nibble bytes; Q8_0: j = 0..7)
The repacked matrix is viewed as (rows, bytes per row), the same shape as the file's, and replaces
the mapped view (`repack`); `unpack_rows` gives rows back in GGUF order (embedding lookups).

With VNNI the exact kernels read the codes q as hi and lo bytes (`int_dot.EXACT_FORM`, "split") and
take `make_group_dot_fast(split=True)`: I = 256 (c x hi) + (lo x c) by `vpdpbusd`, the same I. On
AVX2 they take the i16 pairs below.

Per P_j (i32 lanes) the i16 pairs each `vpdpwssd` multiplies, without leaving the row's lane:
    nibbles: P & 0x000F000F -> values (4j, 4j+2); P >> 8 & ... -> (4j+1, 4j+3);
             P >> 4 & ... -> (16+4j, 16+4j+2); P >> 12 & ... -> (16+4j+1, 16+4j+3)
    bytes:   (P16 << 8) >>a 8 -> (4j, 4j+2); P16 >>a 8 -> (4j+1, 4j+3)   (P16: P as i16 lanes)
each against the activation word holding the same two values (broadcast to every lane).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import background, int_dot
from .amx import AmxIR
from .int_dot import IntIR
from .pool import BUF_VALUES, CHUNK_BYTES, COMPUTE_SIG, MAX_CHUNKS, call_compute, readonly, run_rows
from .vector_ir import (F16, F32, I8, I32, I64, VectorIR, data_pointer, f32_pointer, i64_pointer, kernel_copy,
                        u8_pointer, vector_type)

log = logging.getLogger("omlx.kernels")

GROUP = 16  # weight rows per repacked group (lanes of a 512-bit vector)
# Software prefetch: every 64-byte line of the group block PREFETCH_BYTES ahead of the one being
# read. One prefetch per block (the float kernels' `prefetch_ahead`) covered one line in 4.5 of a
# Q4_0 group block (288 bytes) and one in 36 of a Q4_K one; measured on a 75 MB matrix, one row,
# 2 threads (min of 40 calls, 2 rounds): Q4_0 20-40 GB/s -> 46-55, Q4_K 11-27 -> 34-47 with every
# line 8 KiB ahead (4 KiB: 28-51 / 22-23; 16 KiB: 34-41 / 24). Into L2, not L1 (`prefetcht1`,
# locality 2): on a Xeon with AVX-512 VNNI, one row over 430-650 MB of matrices (past its L3),
# 2 threads, quiet: Q4_K 17.4 -> 18.5 GB/s, Q6_K 19.4 -> 20.2, Q4_0 19.1 -> 19.7 (`prefetchnta`:
# 10.8; 16 or 32 KiB ahead: no better). With the exact kernels' hi/lo form (faster per block), 3
# KiB ahead: Q4_K one row over 600 MB, 2 threads, helpers paused, alternating: exact 18.9 / 20.0
# GB/s at 8 KiB -> 21.6 / 21.0 at 3 KiB, fast 21.6 -> 22.6 / 23.7 (2 and 4 KiB: 21.4 / 20.9;
# none: 20.0); Q4_0 and Q6_K within 2%.
PREFETCH_BYTES = 3072
PREFETCH_LOCALITY = 2


def _prefetch(builder, gb, nbytes):
    """Prefetch (read, into L2 and the levels below it) each line of [gb, gb + nbytes)
    PREFETCH_BYTES ahead (never faults, past the end of the matrix included)."""
    ptr_t = I8.as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ptr_t, I32, I32, I32]),
                                        "llvm.prefetch.p0i8")
    for off in range(0, nbytes, 64):
        at = builder.gep(gb, [ir.Constant(I64, PREFETCH_BYTES + off)])
        builder.call(fn, [at, ir.Constant(I32, 0), ir.Constant(I32, PREFETCH_LOCALITY), ir.Constant(I32, 1)])


class IntType:
    """One weight type's integer form: its GGUF block (values, bytes, as gguf's GGML_QUANT_SIZES
    declares it); the header fields of a block, (offset, size) each, repacked as 16 rows' copies
    side by side (float16 scales, 6-bit scale bytes); where its code bytes start and how many
    4-byte code vectors a block has; the code kind ("nibbles" 0..15, "bytes" int8, or a k-quant
    "q3_k" / "q4_k" / "q5_k" / "q6_k") and the offset subtracted from each code."""

    def __init__(self, ggml_type, fields, codes_at, code_words, kind, offset=0, has_min=None):
        self.ggml_type = ggml_type
        self.values, self.nbytes = GGML_QUANT_SIZES[ggml_type]  # the GGUF block, as gguf declares it
        self.fields = fields
        self.codes_at, self.code_words, self.kind, self.offset = codes_at, code_words, kind, offset
        self.has_min = (kind == "nibbles" and len(fields) == 2) if has_min is None else has_min
        self.header = sum(GROUP * size for _, size in fields)
        self.group_block = GROUP * self.nbytes
        assert self.header + 64 * code_words == self.group_block
        # where field i starts in a repacked group block
        self.field_at = [sum(GROUP * size for _, size in fields[:i]) for i in range(len(fields))]


INT_TYPES = {
    QT.Q4_0: IntType(QT.Q4_0, ((0, 2),), 2, 4, "nibbles", 8),
    QT.Q4_1: IntType(QT.Q4_1, ((0, 2), (2, 2)), 4, 4, "nibbles"),
    QT.Q8_0: IntType(QT.Q8_0, ((0, 2),), 2, 8, "bytes"),
    # Q5_0 / Q5_1: d [, m] (float16), qh (the 32 fifth bits, repacked in QH5_ORDER), 16 nibble bytes
    QT.Q5_0: IntType(QT.Q5_0, ((0, 2), (2, 4)), 6, 4, "q5", 16, has_min=False),
    QT.Q5_1: IntType(QT.Q5_1, ((0, 2), (2, 2), (4, 4)), 8, 4, "q5", has_min=True),
    # Q4_K: d, dmin (float16), 12 bytes of 6-bit sub-block scales and minima, 128 nibble bytes
    # (byte 32c + l: low nibble value 64c + l, high nibble 64c + 32 + l)
    QT.Q4_K: IntType(QT.Q4_K, ((0, 2), (2, 2)) + tuple((4 + i, 1) for i in range(12)), 16, 32, "q4_k"),
    # Q5_K: Q4_K's header, then qh[32] (byte l: bit 2c + h is the fifth bit of value 64c + 32h + l)
    # and the 128 nibble bytes: the codes are 40 words, 8 of qh (word j: qh bytes 4j..4j + 3, the
    # fifth bits of nibble word 8c + j for every c) then Q4_K's 32 nibble words
    QT.Q5_K: IntType(QT.Q5_K, ((0, 2), (2, 2)) + tuple((4 + i, 1) for i in range(12)), 16, 40, "q5_k"),
    # Q6_K: ql[128] low nibbles, qh[64] high 2-bit pairs (the codes, 48 words), 16 int8 scales of
    # 16 values each, d (float16)
    QT.Q6_K: IntType(QT.Q6_K, ((208, 2),) + tuple((192 + i, 1) for i in range(16)), 0, 48, "q6_k"),
    # Q3_K: hmask[32] (byte l: bit 4n + j is the high bit of value 128n + 32j + l), qs[64] (byte
    # 32n + l: bits 2j, 2j + 1 the low bits of that value) -- the codes, 24 words: hmask's 8, then
    # qs' 16 --, 12 bytes of 6-bit scales of 16 values (ggml's packing, offset 32), d (float16)
    QT.Q3_K: IntType(QT.Q3_K, ((108, 2),) + tuple((96 + i, 1) for i in range(12)), 0, 24, "q3_k"),
}


def supports(ggml_type, n_rows: int, in_features: int) -> bool:
    t = INT_TYPES.get(ggml_type)
    return t is not None and n_rows % GROUP == 0 and in_features % t.values == 0 and n_rows > 0


# ---------------------------------------------------------------------------------------------
# Repacking (numpy)
# ---------------------------------------------------------------------------------------------


# Q5_0 / Q5_1: bit v of the GGUF qh (the fifth bit of value v) moves to bit QH5_ORDER[v] of the
# repacked one: value 16h + 4j + i to bit 8i + j + 4h. Then a code word j's four values (i = 0..3)
# of half h sit at bits 8i + g (g = j + 4h), one per byte: shifted by 4 - g they land on bit 4 of
# each byte (the fast kernels' u8 codes), and the pairs (i = 0, 2) and (i = 1, 3) on bits 4 and 20
# of the i16 lanes (the exact kernels'), two operations per vector.
QH5_ORDER = np.array([8 * (v % 4) + (v % 16) // 4 + 4 * (v // 16) for v in range(32)])


def _permute_bits(words: np.ndarray, order: np.ndarray) -> np.ndarray:
    """uint32 words -> the words with bit v moved to bit order[v]."""
    out = np.zeros_like(words)
    for v, to in enumerate(order):
        out |= ((words >> np.uint32(v)) & np.uint32(1)) << np.uint32(to)
    return out


def _qh_field(t: IntType) -> int:
    return t.fields[-1][0]


def repack(raw: np.ndarray, ggml_type) -> np.ndarray:
    """(rows, bytes) GGUF blocks -> the repacked layout, same shape (a new array)."""
    t = INT_TYPES[ggml_type]
    n_rows, row_bytes = raw.shape
    nb, G = row_bytes // t.nbytes, n_rows // GROUP
    if t.kind == "q5":
        raw = raw.reshape(n_rows, nb, t.nbytes).copy()
        at = _qh_field(t)
        qh = raw[:, :, at : at + 4].copy().view(np.uint32)
        raw[:, :, at : at + 4] = _permute_bits(qh, QH5_ORDER).view(np.uint8)
        raw = raw.reshape(n_rows, row_bytes)
    blocks = raw.reshape(G, GROUP, nb, t.nbytes).transpose(0, 2, 1, 3)  # (G, nb, 16, ts)
    out = np.empty((G, nb, t.group_block), dtype=np.uint8)
    for at, (off, size) in zip(t.field_at, t.fields):
        out[:, :, at : at + GROUP * size] = blocks[:, :, :, off : off + size].reshape(G, nb, GROUP * size)
    codes = blocks[:, :, :, t.codes_at : t.codes_at + 4 * t.code_words].reshape(G, nb, GROUP, t.code_words, 4)
    out[:, :, t.header :] = codes.transpose(0, 1, 3, 2, 4).reshape(G, nb, -1)
    return out.reshape(n_rows, row_bytes)


@njit(nogil=True, cache=True)
def _unpack_groups(packed, g0, n_groups, nbytes, field_at, field_off, field_size, header, codes_at, code_words,
                   out):
    """out (16 * n_groups, bytes) = groups g0.. of the repacked `packed` (rows, bytes) in GGUF
    order: field i of row r of block b at group byte field_at[i] + r * size; code word j of row r
    at header + (16 j + r) * 4 (the layout `repack` writes)."""
    row_bytes = packed.shape[1]
    nb = row_bytes // nbytes
    gb = 16 * nbytes
    src_all = packed.reshape(-1)
    dst_all = out.reshape(-1)
    n_fields = field_at.shape[0]
    for g in range(n_groups):
        src0 = (g0 + g) * 16 * row_bytes
        for r in range(16):
            dst_row = (16 * g + r) * row_bytes
            for b in range(nb):
                src = src0 + b * gb
                dst = dst_row + b * nbytes
                for i in range(n_fields):
                    size = field_size[i]
                    s_at = src + field_at[i] + r * size
                    d_at = dst + field_off[i]
                    for k in range(size):
                        dst_all[d_at + k] = src_all[s_at + k]
                s_at = src + header + 4 * r
                d_at = dst + codes_at
                for j in range(code_words):
                    for k in range(4):
                        dst_all[d_at + 4 * j + k] = src_all[s_at + 64 * j + k]


def unpack_range(packed: np.ndarray, ggml_type, start: int, stop: int) -> np.ndarray:
    """Rows start..stop (whole groups: multiples of GROUP) of a repacked matrix in GGUF block
    order, (stop - start, bytes) uint8: the inverse of `repack` over a contiguous range (what a
    dequantized tile needs), by a compiled copy rather than `unpack_rows`' gather."""
    t = INT_TYPES[ggml_type]
    if start % GROUP or stop % GROUP:
        return unpack_rows(packed, ggml_type, np.arange(start, stop))
    out = np.empty((stop - start, packed.shape[1]), dtype=np.uint8)
    _unpack_groups(packed, start // GROUP, (stop - start) // GROUP, t.nbytes,
                   np.array(t.field_at, np.int64), np.array([f[0] for f in t.fields], np.int64),
                   np.array([f[1] for f in t.fields], np.int64), t.header, t.codes_at, t.code_words, out)
    if t.kind == "q5":
        nb = packed.shape[1] // t.nbytes
        blocks = out.reshape(stop - start, nb, t.nbytes)
        at = _qh_field(t)
        qh = blocks[:, :, at : at + 4].copy().view(np.uint32)
        blocks[:, :, at : at + 4] = _permute_bits(qh, np.argsort(QH5_ORDER)).view(np.uint8)
    return out


def unpack_rows(packed: np.ndarray, ggml_type, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` of a repacked matrix in GGUF block order ((len(rows), bytes) uint8)."""
    t = INT_TYPES[ggml_type]
    n_rows, row_bytes = packed.shape
    nb = row_bytes // t.nbytes
    g, r = np.divmod(np.asarray(rows, dtype=np.int64), GROUP)
    grp = packed.reshape(n_rows // GROUP, nb, t.group_block)[g]  # (n, nb, GB)
    out = np.empty((len(g), nb, t.nbytes), dtype=np.uint8)
    idx = np.arange(len(g))
    for at, (off, size) in zip(t.field_at, t.fields):
        f = grp[:, :, at : at + GROUP * size].reshape(len(g), nb, GROUP, size)
        out[:, :, off : off + size] = f[idx, :, r]
    codes = grp[:, :, t.header :].reshape(len(g), nb, t.code_words, GROUP, 4)
    out[:, :, t.codes_at : t.codes_at + 4 * t.code_words] = codes[idx, :, :, r].reshape(len(g), nb, -1)
    if t.kind == "q5":
        at = _qh_field(t)
        qh = out[:, :, at : at + 4].copy().view(np.uint32)
        out[:, :, at : at + 4] = _permute_bits(qh, np.argsort(QH5_ORDER)).view(np.uint8)
    return out.reshape(len(g), row_bytes)


# ---------------------------------------------------------------------------------------------
# The group kernel: 16 weight rows x n rows of x, every block, in LLVM IR
# ---------------------------------------------------------------------------------------------


def _code_vectors(v, t: IntType, gb, lanes, half):
    """The block's i16-pair weight vectors for `lanes` rows (rows lanes*half ..) of the group at
    gb, each with the activation word it pairs with: [(<lanes x i32>, word), ...]."""
    b = v.b
    vi = vector_type(I32, lanes)
    out = []
    if t.kind == "q5":  # the fifth bits, QH5_ORDER (see there): to bits 4 and 20 of the lane
        qh = v.load(gb, t.field_at[-1] + 4 * lanes * half, vi, align=1)
    for j in range(t.code_words):
        p = v.load(gb, t.header + 64 * j + 4 * lanes * half, vi, align=1)
        if t.kind == "q5":
            for shift, word, g, odd in ((0, 2 * j, j, 0), (8, 2 * j + 1, j, 1), (4, 2 * (j + 4), j + 4, 0),
                                        (12, 2 * (j + 4) + 1, j + 4, 1)):
                move = 4 - g - 8 * odd  # bit g (+8 for the odd values) -> bit 4
                fifth = v.shl(qh, move) if move > 0 else (v.shr(qh, -move) if move < 0 else qh)
                nib = v.and_(v.shr(p, shift) if shift else p, 0x000F000F)
                out.append((v.or_(nib, v.and_(fifth, 0x00100010)), word))
        elif t.kind == "nibbles":
            for shift, word in ((0, 2 * j), (8, 2 * j + 1), (4, 2 * (j + 4)), (12, 2 * (j + 4) + 1)):
                out.append((v.and_(v.shr(p, shift) if shift else p, 0x000F000F), word))
        else:
            vh = vector_type(ir.IntType(16), 2 * lanes)
            p16 = b.bitcast(p, vh)
            eight = ir.Constant(vh, [8] * (2 * lanes))
            even = b.ashr(b.shl(p16, eight), eight)
            odd = b.ashr(p16, eight)
            out.append((b.bitcast(even, vi), 2 * j))
            out.append((b.bitcast(odd, vi), 2 * j + 1))
    return out


def c64(k: int):
    """An i64 constant of the IR."""
    return ir.Constant(I64, k)


class _GroupDotFrame:
    """What every group-dot intrinsic's codegen starts and ends with, for its arguments (raw, xw,
    y, g, t0, yoff) as `make_group_dot` describes them: row_bytes, words (activation words per x
    row), nb (weight blocks per row), group_base (the first byte of weight group g), x_rows (the
    first byte of x rows t0 .. t0 + n - 1) and faccs[h][i] (the float32 sums of x row t0 + i for
    weight rows 16g + lanes h .., lanes wide, zero), which `store_sums` writes to y."""

    def __init__(self, context, builder, signature, args, t: IntType, lanes: int, n: int):
        self.builder, self.v, self.lanes, self.n = builder, VectorIR(builder), lanes, n
        arg_types = signature.args
        rarr = context.make_array(arg_types[0])(context, builder, args[0])
        self.row_bytes = cgutils.unpack_tuple(builder, rarr.shape, 2)[1]
        rp = data_pointer(context, builder, arg_types[0], args[0])
        xarr = context.make_array(arg_types[1])(context, builder, args[1])
        self.words = cgutils.unpack_tuple(builder, xarr.shape, 2)[1]
        xp = data_pointer(context, builder, arg_types[1], args[1])
        yarr = context.make_array(arg_types[2])(context, builder, args[2])
        self.ycols = cgutils.unpack_tuple(builder, yarr.shape, 2)[1]
        self.yp = data_pointer(context, builder, arg_types[2], args[2])
        self.gi, self.t0i, self.yoffi = (context.cast(builder, args[i], arg_types[i], types.int64) for i in (3, 4, 5))
        self.nb = builder.sdiv(self.row_bytes, c64(t.nbytes))
        self.group_base = self.v.gep(rp, builder.mul(builder.mul(self.gi, c64(GROUP)), self.row_bytes))
        x_row_bytes = builder.mul(self.words, c64(4))
        self.x_rows = [self.v.gep(xp, builder.mul(builder.add(self.t0i, c64(i)), x_row_bytes)) for i in range(n)]
        zero_f = ir.Constant(vector_type(F32, lanes), [0.0] * lanes)
        self.faccs = [[cgutils.alloca_once_value(builder, zero_f) for _ in range(n)] for _ in range(GROUP // lanes)]

    def store_sums(self) -> None:
        """y[t0 + i, 16g - yoff + r] = the sums, r < 16, i < n."""
        b, v = self.builder, self.v
        col0 = b.sub(b.mul(self.gi, c64(GROUP)), self.yoffi)
        for i in range(self.n):
            yrow = v.gep(self.yp, b.mul(b.add(self.t0i, c64(i)), b.mul(self.ycols, c64(4))))
            for h, accs in enumerate(self.faccs):
                v.store(b.load(accs[i]), yrow, b.mul(b.add(col0, c64(self.lanes * h)), c64(4)))


def make_group_dot(t: IntType, isa: str, n: int):
    """Intrinsic gdot(raw, xw, y, g, t0, yoff): y[t0 + i, 16g - yoff + r] = row 16g + r of W
    times row t0 + i of x, for r < 16 and i < n; raw the repacked matrix (rows, bytes) uint8, xw
    quantized activations (T, words) float32 (`int_dot` layout), y (T, cols) float32."""

    lanes = int_dot.ISA_LANES[isa]
    halves = GROUP // lanes
    n_int_accs = max(1, 4 // n)  # independent i32 chains per x row (latency of vpdpwssd)

    @intrinsic
    def gdot(typingctx, raw, xw, y, g, t0, yoff):
        sig = types.void(raw, xw, y, g, t0, yoff)

        def codegen(context, builder, signature, args):
            v = VectorIR(builder)
            ii = IntIR(builder, isa)
            vf, vi = vector_type(F32, lanes), vector_type(I32, lanes)
            frame = _GroupDotFrame(context, builder, signature, args, t, lanes, n)
            nb, group_base, x_rows, faccs = frame.nb, frame.group_base, frame.x_rows, frame.faccs
            h_words = builder.mul(nb, c64(16))  # activation code words per x row
            zero_i = ir.Constant(vi, [0] * lanes)
            with cgutils.for_range(builder, nb) as loop:
                bi = loop.index
                gb = v.gep(group_base, builder.mul(bi, c64(t.group_block)))
                _prefetch(builder, gb, t.group_block)
                code_off = builder.mul(bi, c64(64))  # block b's code words start at byte 64b
                s_off = builder.mul(builder.add(h_words, bi), c64(4))
                q_off = builder.mul(builder.add(builder.add(h_words, nb), bi), c64(4))
                sq_off = builder.mul(builder.add(builder.add(h_words, builder.mul(nb, c64(2))), bi), c64(4))
                x_scale = [v.load(v.gep(xr, s_off), 0, F32, align=4) for xr in x_rows]
                x_sum = [v.load(v.gep(xr, q_off), 0, I32, align=4) for xr in x_rows]
                x_ssum = [v.load(v.gep(xr, sq_off), 0, F32, align=4) for xr in x_rows] if t.has_min else None
                for h in range(halves):
                    d = builder.fpext(v.load(gb, 2 * lanes * h, vector_type(F16, lanes), align=1), vf)
                    m = (builder.fpext(v.load(gb, 32 + 2 * lanes * h, vector_type(F16, lanes), align=1), vf)
                         if t.has_min else None)
                    codes = _code_vectors(v, t, gb, lanes, h)
                    for i in range(n):
                        xc = v.gep(x_rows[i], code_off)
                        accs = [zero_i] * n_int_accs
                        for k, (w, word) in enumerate(codes):
                            a = v.splat(v.load(xc, 4 * word, I32, align=4), lanes)
                            accs[k % n_int_accs] = ii.dot2(accs[k % n_int_accs], w, a)
                        total = accs[0]
                        for extra in accs[1:]:
                            total = builder.add(total, extra)
                        if t.offset:
                            total = builder.sub(total, v.splat(builder.mul(x_sum[i], ir.Constant(I32, t.offset)), lanes))
                        blk = builder.fmul(builder.sitofp(total, vf), builder.fmul(d, v.splat(x_scale[i], lanes)))
                        if t.has_min:
                            blk = builder.fadd(blk, builder.fmul(m, v.splat(x_ssum[i], lanes)))
                        builder.store(builder.fadd(builder.load(faccs[h][i]), blk), faccs[h][i])
            frame.store_sums()
            return context.get_dummy_value()

        return sig, codegen

    return gdot


def _k_code_vectors(v, t: IntType, gb, lanes, half, sub):
    """The i16-pair weight vectors of 32-value sub-block `sub` (0..7) of a k-quant super-block,
    for rows lanes*half .. of the group at gb: [(<lanes x i32>, activation word 0..15), ...],
    in word order (words 0..7 hold values 0..15, words 8..15 values 16..31).

    Q4_K: code vector 8c + j holds nibble bytes 32c + 4j .. of 16 rows; sub-block 2c is their
    low nibbles, 2c + 1 their high nibbles (the Q4_0 pairing, 32 values per 8 vectors).
    Q6_K: half n = sub // 4 of the super-block has ql words 16n .. 16n + 15 and qh words
    32 + 8n .. 32 + 8n + 7; its sub-block k = sub % 4 takes, per byte l of 32, ql[l + 32(k & 1)]'s
    low (k < 2) or high nibble and qh[l]'s bits 2k, 2k + 1 as bits 4, 5: codes 0..63, minus 32."""
    b = v.b
    vi = vector_type(I32, lanes)
    out = []
    if t.kind == "q4_k":
        c, hi = divmod(sub, 2)
        shifts = (4, 12) if hi else (0, 8)
        for j in range(8):
            p = v.load(gb, t.header + 64 * (8 * c + j) + 4 * lanes * half, vi, align=1)
            out.append((v.and_(v.shr(p, shifts[0]) if shifts[0] else p, 0x000F000F), 2 * j))
            out.append((v.and_(v.shr(p, shifts[1]), 0x000F000F), 2 * j + 1))
        return out
    if t.kind == "q5_k":  # Q4_K's pairs | the fifth bit: bit 2c + hi of the same byte of qh word j
        c, hi = divmod(sub, 2)
        for j in range(8):
            p = v.load(gb, t.header + 64 * (8 + 8 * c + j) + 4 * lanes * half, vi, align=1)
            qh = v.load(gb, t.header + 64 * j + 4 * lanes * half, vi, align=1)
            for odd in (0, 1):  # bytes 0, 2 (values 4j, 4j + 2) or 1, 3 of each lane
                shift = 8 * odd + 4 * hi
                nib = v.and_(v.shr(p, shift) if shift else p, 0x000F000F)
                move = 8 * odd + 2 * c + hi - 4  # the fifth bit -> bit 4 (and 20) of the lane
                fifth = v.shr(qh, move) if move > 0 else (v.shl(qh, -move) if move < 0 else qh)
                out.append((v.or_(nib, v.and_(fifth, 0x00100010)), 2 * j + odd))
        return out
    n, k = divmod(sub, 4)
    vh = vector_type(ir.IntType(16), 2 * lanes)
    if t.kind == "q3_k":  # value 128n + 32k + l: qs[32n + l] bits 2k, 2k+1 | hmask[l] bit 4n + k << 2, minus 4
        four = ir.Constant(vh, [4] * (2 * lanes))
        for j in range(8):
            pl = v.load(gb, t.header + 64 * (8 + 8 * n + j) + 4 * lanes * half, vi, align=1)
            ph = v.load(gb, t.header + 64 * j + 4 * lanes * half, vi, align=1)
            low = v.and_(v.shr(pl, 2 * k) if k else pl, 0x03030303)
            move = 4 * n + k - 2  # the high bit -> bit 2 of each byte
            high = v.shr(ph, move) if move > 0 else (v.shl(ph, -move) if move < 0 else ph)
            code = v.or_(low, v.and_(high, 0x04040404))  # byte i: the code of value 4j + i, 0..7
            for e, word in ((0, 2 * j), (8, 2 * j + 1)):
                pair = v.and_(v.shr(code, e) if e else code, 0x00FF00FF)
                out.append((b.bitcast(b.sub(b.bitcast(pair, vh), four), vi), word))
        return out
    thirty_two = ir.Constant(vh, [32] * (2 * lanes))
    for j in range(8):
        pl = v.load(gb, t.header + 64 * (16 * n + 8 * (k & 1) + j) + 4 * lanes * half, vi, align=1)
        ph = v.load(gb, t.header + 64 * (32 + 8 * n + j) + 4 * lanes * half, vi, align=1)
        low = v.and_(v.shr(pl, 4) if k >= 2 else pl, 0x0F0F0F0F)
        shift = 4 - 2 * k  # qh bits 2k, 2k+1 of each byte -> bits 4, 5
        high = v.shl(ph, shift) if shift > 0 else (v.shr(ph, -shift) if shift < 0 else ph)
        code = v.or_(low, v.and_(high, 0x30303030))  # byte i: the code of value 4j + i
        for e, word in ((0, 2 * j), (8, 2 * j + 1)):
            pair = v.and_(v.shr(code, e) if e else code, 0x00FF00FF)
            out.append((b.bitcast(b.sub(b.bitcast(pair, vh), thirty_two), vi), word))
    return out


def _q3_k_scale(v, col, is_):
    """ggml's Q3_K scale unpacking (the kmask1/kmask2 dance) for scale `is_` (0..15) of a
    super-block, lane-wise over the zero-extended scale bytes `col` (12 <lanes x i32>): 0..63, the
    caller subtracts 32."""
    quarter, i = divmod(is_, 4)
    low = v.and_(col[is_], 15) if quarter < 2 else v.shr(col[is_ - 8], 4)
    top = col[8 + i]
    shift = 2 * quarter
    return v.or_(low, v.shl(v.and_(v.shr(top, shift) if shift else top, 3), 4))


def make_group_dot_k(t: IntType, isa: str, n: int):
    """The k-quant form of `make_group_dot` (same intrinsic signature): a weight block is a
    256-value super-block, 8 activation blocks of 32. Per activation block a and weight row:
        Q4_K  blk = float32(I) * ((d * sc_a) * s_a) + (-(dmin * m_a)) * sQ_a
        Q6_K  blk = float32(I_lo) * ((d * sc_2a) * s_a), then the same for I_hi, sc_2a+1
    (I_lo, I_hi: the dot products of values 0..15 and 16..31; d * sc and dmin * m are exact in
    float32), each added to the row's float32 sum in value order."""

    lanes = int_dot.ISA_LANES[isa]
    halves = GROUP // lanes
    n_int_accs = max(1, 4 // n) if t.kind in ("q4_k", "q5_k") else max(1, 2 // n)
    subs = 8  # activation blocks per super-block

    @intrinsic
    def gdot(typingctx, raw, xw, y, g, t0, yoff):
        sig = types.void(raw, xw, y, g, t0, yoff)

        def codegen(context, builder, signature, args):
            v = VectorIR(builder)
            ii = IntIR(builder, isa)
            vf, vi = vector_type(F32, lanes), vector_type(I32, lanes)
            vb = vector_type(I8, lanes)
            frame = _GroupDotFrame(context, builder, signature, args, t, lanes, n)
            nb, group_base, x_rows, faccs = frame.nb, frame.group_base, frame.x_rows, frame.faccs
            na = builder.mul(nb, c64(subs))  # activation blocks per x row
            h_words = builder.mul(na, c64(16))
            zero_i = ir.Constant(vi, [0] * lanes)

            def int_dot_sum(xc, codes):
                accs = [zero_i] * n_int_accs
                for k, (w, word) in enumerate(codes):
                    a = v.splat(v.load(xc, 4 * word, I32, align=4), lanes)
                    accs[k % n_int_accs] = ii.dot2(accs[k % n_int_accs], w, a)
                total = accs[0]
                for extra in accs[1:]:
                    total = builder.add(total, extra)
                return total

            def scale_byte(gb, i, h, signed):
                raw8 = v.load(gb, t.field_at[len(t.fields) - (16 if t.kind == "q6_k" else 12) + i] + lanes * h, vb, align=1)
                return builder.sext(raw8, vi) if signed else builder.zext(raw8, vi)

            with cgutils.for_range(builder, nb) as loop:
                bi = loop.index
                gb = v.gep(group_base, builder.mul(bi, c64(t.group_block)))
                _prefetch(builder, gb, t.group_block)
                for h in range(halves):
                    d = builder.fpext(v.load(gb, 2 * lanes * h, vector_type(F16, lanes), align=1), vf)
                    if t.kind in ("q4_k", "q5_k"):
                        dmin = builder.fpext(v.load(gb, 32 + 2 * lanes * h, vector_type(F16, lanes), align=1), vf)
                    if t.kind in ("q3_k", "q4_k", "q5_k"):
                        col = [scale_byte(gb, i, h, False) for i in range(12)]
                    for sub in range(subs):
                        a = builder.add(builder.mul(bi, c64(subs)), c64(sub))
                        code_off = builder.mul(a, c64(64))
                        s_off = builder.mul(builder.add(h_words, a), c64(4))
                        x_scale = [v.splat(v.load(v.gep(xr, s_off), 0, F32, align=4), lanes) for xr in x_rows]
                        codes = _k_code_vectors(v, t, gb, lanes, h, sub)
                        if t.kind in ("q4_k", "q5_k"):
                            # get_scale_min_k4: 6-bit scale and minimum of sub-block `sub`
                            if sub < 4:
                                sc, mn = v.and_(col[sub], 63), v.and_(col[sub + 4], 63)
                            else:
                                sc = v.or_(v.and_(col[sub + 4], 15), v.shl(v.shr(col[sub - 4], 6), 4))
                                mn = v.or_(v.shr(col[sub + 4], 4), v.shl(v.shr(col[sub], 6), 4))
                            dsc = builder.fmul(d, builder.sitofp(sc, vf))
                            dmn = builder.fmul(dmin, builder.sitofp(mn, vf))
                            sq_off = builder.mul(builder.add(builder.add(h_words, builder.mul(na, c64(2))), a), c64(4))
                            x_ssum = [v.splat(v.load(v.gep(xr, sq_off), 0, F32, align=4), lanes) for xr in x_rows]
                            for i in range(n):
                                total = int_dot_sum(v.gep(x_rows[i], code_off), codes)
                                blk = builder.fmul(builder.sitofp(total, vf), builder.fmul(dsc, x_scale[i]))
                                blk = builder.fsub(blk, builder.fmul(dmn, x_ssum[i]))
                                builder.store(builder.fadd(builder.load(faccs[h][i]), blk), faccs[h][i])
                        else:
                            if t.kind == "q3_k":
                                half_scales = [builder.fmul(d, builder.sitofp(
                                    builder.sub(_q3_k_scale(v, col, 2 * sub + e), ir.Constant(vi, [32] * lanes)), vf))
                                    for e in (0, 1)]
                            else:
                                half_scales = [builder.fmul(d, builder.sitofp(scale_byte(gb, 2 * sub + e, h, True), vf))
                                               for e in (0, 1)]
                            for i in range(n):
                                xc = v.gep(x_rows[i], code_off)
                                for e in (0, 1):
                                    total = int_dot_sum(xc, codes[8 * e : 8 * e + 8])
                                    blk = builder.fmul(builder.sitofp(total, vf), builder.fmul(half_scales[e], x_scale[i]))
                                    builder.store(builder.fadd(builder.load(faccs[h][i]), blk), faccs[h][i])
            frame.store_sums()
            return context.get_dummy_value()

        return sig, codegen

    return gdot


def _fast_code_vectors(v, t: IntType, gb, lanes, half, sub):
    """Fast mode: the unsigned byte code vectors of activation block `sub` of a weight block (0
    for the 32-value types), rows lanes*half .. of the group at gb: [(<lanes x i32> of 4 u8 codes,
    activation word 0..7 of the block), ...], words 0..3 (values 0..15) first.
    Q8_0's signed bytes come back as they are (the caller offsets them); Q6_K's 6-bit codes are
    unsigned 0..63 (offset 32, per 16 values)."""
    vi = vector_type(I32, lanes)
    out = []

    def word(j):
        return v.load(gb, t.header + 64 * j + 4 * lanes * half, vi, align=1)

    if t.kind == "q5":  # nibbles | fifth bit (QH5_ORDER: group g's bits at 8i + g -> bit 4 of byte i)
        qh = v.load(gb, t.field_at[-1] + 4 * lanes * half, vi, align=1)
        for j in range(4):
            p = word(j)
            for hh, nib in ((0, v.and_(p, 0x0F0F0F0F)), (1, v.and_(v.shr(p, 4), 0x0F0F0F0F))):
                move = 4 - (j + 4 * hh)
                fifth = v.shl(qh, move) if move > 0 else (v.shr(qh, -move) if move < 0 else qh)
                out.append((v.or_(nib, v.and_(fifth, 0x10101010)), j + 4 * hh))
        out.sort(key=lambda item: item[1])
    elif t.kind == "nibbles":  # code word j: values 4j.. (low nibbles), 16 + 4j.. (high)
        ps = [word(j) for j in range(4)]
        out = [(v.and_(p, 0x0F0F0F0F), j) for j, p in enumerate(ps)]
        out += [(v.and_(v.shr(p, 4), 0x0F0F0F0F), 4 + j) for j, p in enumerate(ps)]
    elif t.kind == "bytes":
        out = [(word(j), j) for j in range(8)]
    elif t.kind == "q4_k":
        c, hi = divmod(sub, 2)
        for j in range(8):
            p = word(8 * c + j)
            out.append((v.and_(v.shr(p, 4) if hi else p, 0x0F0F0F0F), j))
    elif t.kind == "q5_k":
        c, hi = divmod(sub, 2)
        for j in range(8):
            p, qh = word(8 + 8 * c + j), word(j)
            move = 2 * c + hi - 4  # bit 2c + hi of each qh byte -> bit 4
            fifth = v.shr(qh, move) if move > 0 else (v.shl(qh, -move) if move < 0 else qh)
            out.append((v.or_(v.and_(v.shr(p, 4) if hi else p, 0x0F0F0F0F), v.and_(fifth, 0x10101010)), j))
    elif t.kind == "q3_k":  # unsigned 0..7 (offset 4, per 16 values)
        n, k = divmod(sub, 4)
        for j in range(8):
            pl, ph = word(8 + 8 * n + j), word(j)
            low = v.and_(v.shr(pl, 2 * k) if k else pl, 0x03030303)
            move = 4 * n + k - 2
            high = v.shr(ph, move) if move > 0 else (v.shl(ph, -move) if move < 0 else ph)
            out.append((v.or_(low, v.and_(high, 0x04040404)), j))
    else:  # q6_k
        n, k = divmod(sub, 4)
        for j in range(8):
            pl, ph = word(16 * n + 8 * (k & 1) + j), word(32 + 8 * n + j)
            low = v.and_(v.shr(pl, 4) if k >= 2 else pl, 0x0F0F0F0F)
            shift = 4 - 2 * k
            high = v.shl(ph, shift) if shift > 0 else (v.shr(ph, -shift) if shift < 0 else ph)
            out.append((v.or_(low, v.and_(high, 0x30303030)), j))
    return out


def _fast_k_code_vectors(v, t: IntType, gb, lanes, half, sub):
    """`_fast_code_vectors` of a k-quant for a run-time sub-block `sub` (i64, 0..7): the loop over
    a super-block's 8 activation blocks stays a loop in the IR (8 copies of a body of 8 rows made
    the kernels' compile time double); the same bytes. A bit moving to bit 4 (or 2) of each byte is
    shifted right by its run-time position, masked to bit 0 and shifted back up."""
    b = v.b
    vi = vector_type(I32, lanes)
    i32 = b.trunc(sub, I32)

    def shift_by(x):  # a run-time i32 shift count, splat
        return v.splat(x, lanes)

    def word_at(base_words, j):  # code word base_words + j, base_words an i64 IR value
        at = b.add(b.mul(base_words, ir.Constant(I64, 64)), ir.Constant(I64, t.header + 64 * j + 4 * lanes * half))
        return v.load(gb, at, vi, align=1)

    out = []
    if t.kind in ("q4_k", "q5_k"):
        c = b.lshr(sub, c64(1))
        hi4 = shift_by(b.shl(b.and_(i32, ir.Constant(I32, 1)), ir.Constant(I32, 2)))  # 4 for the high nibbles
        bit = shift_by(i32)  # 2c + hi: the fifth bit's place in each qh byte
        for j in range(8):
            if t.kind == "q4_k":
                p = word_at(b.mul(c, c64(8)), j)
                out.append((v.and_(v.shr(p, hi4), 0x0F0F0F0F), j))
            else:
                p = word_at(b.add(b.mul(c, c64(8)), c64(8)), j)
                qh = v.load(gb, t.header + 64 * j + 4 * lanes * half, vi, align=1)
                fifth = v.shl(v.and_(v.shr(qh, bit), 0x01010101), 4)
                out.append((v.or_(v.and_(v.shr(p, hi4), 0x0F0F0F0F), fifth), j))
        return out
    n = b.lshr(sub, c64(2))
    k = b.and_(i32, ir.Constant(I32, 3))
    if t.kind == "q3_k":  # unsigned 0..7 (offset 4, per 16 values)
        low_shift = shift_by(b.shl(k, ir.Constant(I32, 1)))  # 2k
        high_bit = shift_by(b.add(b.shl(b.trunc(n, I32), ir.Constant(I32, 2)), k))  # 4n + k
        for j in range(8):
            pl = word_at(b.add(b.mul(n, c64(8)), c64(8)), j)
            ph = v.load(gb, t.header + 64 * j + 4 * lanes * half, vi, align=1)
            low = v.and_(v.shr(pl, low_shift), 0x03030303)
            high = v.shl(v.and_(v.shr(ph, high_bit), 0x01010101), 2)
            out.append((v.or_(low, high), j))
        return out
    # q6_k: ql word 16n + 8 (k & 1) + j (high nibbles for k >= 2), qh word 32 + 8n + j bits 2k, 2k + 1
    ql_base = b.add(b.mul(n, c64(16)), b.mul(b.zext(b.and_(k, ir.Constant(I32, 1)), I64), c64(8)))
    nib_shift = shift_by(b.shl(b.lshr(k, ir.Constant(I32, 1)), ir.Constant(I32, 2)))  # 4 for k >= 2
    pair_shift = shift_by(b.shl(k, ir.Constant(I32, 1)))  # 2k
    for j in range(8):
        pl = word_at(ql_base, j)
        ph = word_at(b.add(b.mul(n, c64(8)), c64(32)), j)
        low = v.and_(v.shr(pl, nib_shift), 0x0F0F0F0F)
        high = v.shl(v.and_(v.shr(ph, pair_shift), 0x03030303), 4)
        out.append((v.or_(low, high), j))
    return out


def make_group_dot_fast(t: IntType, isa: str, n: int, split: bool = False, amx: bool = False):
    """Fast mode (`int_dot.quantize_activations_fast`: int8 activations per 32 values), the
    intrinsic signature of `make_group_dot`. Per activation block a and weight row, I the exact
    int32 sum of unsigned codes times int8 codes (`vpdpbusd`; AVX2 `vpmaddubsw` + `vpmaddwd`):
        Q4_0  float32(I - 8 Q_a) * (d * s_a)            Q4_1  float32(I) * (d * s_a) + m * sQ_a
        Q8_0  float32(I - 128 Q_a) * (d * s_a), I of the codes + 128 (AVX2: as two nibbles, I =
              I_lo + 16 I_hi, so that no i16 pair sum saturates)
        Q4_K  float32(I) * ((d * sc_a) * s_a) - (dmin * m_a) * sQ_a
        Q6_K  float32(I_lo - 32 Q16_lo) * ((d * sc_lo) * s_a), then the same for the high half
    the same float operations as the exact kernels', each added to the row's sum in order.

    split: the exact kernels' form with VNNI (`int_dot.quantize_activations_split`: the 16-bit
    codes as hi and lo bytes): I = 256 (codes x hi) + (lo x codes), two `vpdpbusd` per code vector
    (Q8_0: its codes + 128 against hi, minus 128 sum(hi), and its signed bytes against lo), the
    16-bit codes' exact sum and so the exact kernels' bits, with the fast mode's byte decoding
    (half the shifts and masks of the i16 pairs)."""

    assert not split or isa != "avx2"
    lanes = int_dot.ISA_LANES[isa]
    halves = GROUP // lanes
    subs = t.values // 32
    n_int_accs = max(1, 2 // n) if not split else 1  # split: hi and lo are two chains already
    block_words = 16 if split else 8  # activation code words per 32 values
    # A k-quant's 8 activation blocks as a loop in the IR from 4 rows of x: unrolled, the bodies of
    # 8 rows made compiling a type's kernels take twice as long (Q4_K 1.2 -> 2.7 s of CPU time;
    # looped 0.7). Below 4 rows the unrolled blocks stay: one row's integer chains are short, and
    # a loop left them waiting on the dot products' latency (one row of Q4_K 80 -> 95 us).
    loop_subs = n >= 4

    def gdot(typingctx, raw, xw, y, g, t0, yoff, code_tiles=None, decode=None):
        sig = (types.void(raw, xw, y, g, t0, yoff) if code_tiles is None
               else types.void(raw, xw, y, g, t0, yoff, code_tiles, decode))

        def codegen(context, builder, signature, args):
            v = VectorIR(builder)
            ii = IntIR(builder, isa)
            vf, vi = vector_type(F32, lanes), vector_type(I32, lanes)
            vb = vector_type(I8, lanes)
            frame = _GroupDotFrame(context, builder, signature, args, t, lanes, n)
            words, nb, group_base, x_rows, faccs = frame.words, frame.nb, frame.group_base, frame.x_rows, frame.faccs
            na = builder.mul(nb, c64(subs))  # activation blocks per x row
            c_words = builder.mul(na, c64(block_words))  # code words per x row
            zero_i = ir.Constant(vi, [0] * lanes)

            sub_scales = cgutils.alloca_once(builder, vf, size=16)  # per-sub-block scales (k-quants)
            sub_minima = cgutils.alloca_once(builder, vf, size=8)
            per16 = _per16(t)  # sums per 16 values (two scales per block)
            # AMX takes codes with an offset as c - offset and Q8_0's as they are, signed bytes
            # (`_store_amx_codes`): the sums come out with the offset term taken off (the same
            # integers), and the float work after them loses its correction
            signed_codes = amx and (_amx_code_offset(t) > 0 or t.kind == "bytes")
            if amx:
                ax = AmxIR(builder)
                ax.configure({0: (GROUP, 64), 1: (GROUP, 64), 2: (GROUP, 64), 3: (GROUP, 64),
                              4: (GROUP, 16 if per16 else 32), 5: (GROUP, 16 if per16 else 32),
                              6: (4 if per16 else 8, 64), 7: (4 if per16 else 8, 64)})
                # B: the group's code tiles (`AMX_CODE_BLOCK` bytes per activation block), decoded
                # once for every tile of x rows by `make_amx_code_tiles`, or (decode != 0: a few
                # tiles of x rows) block by block here, between the float work of the blocks, into
                # one slot at code_tiles
                b_ptr = data_pointer(context, builder, signature.args[6], args[6])
                decode_here = builder.icmp_signed("!=", context.cast(builder, args[7], signature.args[7], types.int64),
                                                  c64(0))
                c_buf = cgutils.alloca_once(builder, ir.ArrayType(I8, 4096))  # sum tiles 0..3, 1024 bytes each
                c_buf.align = 64
                c_ptr = builder.bitcast(c_buf, I8.as_pointer())
                x_stride = builder.mul(words, c64(4))  # bytes from one row of x to the next

            def part(index):  # byte offset of word `index` (i64) of an x row
                return builder.mul(index, c64(4))

            def x_word(xr, index, ty):
                return v.splat(v.load(v.gep(xr, part(index)), 0, ty, align=4), lanes)

            def dot_sum(xc, codes):
                if split:  # codes: [(u8 codes, s8 codes, word)]; hi bytes at xc, lo bytes 32 on
                    hi = lo = zero_i
                    for w_u8, w_s8, word in codes:
                        hi = ii.dot4u8s8(hi, w_u8, v.splat(v.load(xc, 4 * word, I32, align=4), lanes))
                        lo = ii.dot4u8s8(lo, v.splat(v.load(xc, 32 + 4 * word, I32, align=4), lanes), w_s8)
                    return hi, lo
                accs = [zero_i] * n_int_accs
                for k, (w, word) in enumerate(codes):
                    a = v.splat(v.load(xc, 4 * word, I32, align=4), lanes)
                    accs[k % n_int_accs] = ii.dot4u8s8(accs[k % n_int_accs], w, a)
                total = accs[0]
                for extra in accs[1:]:
                    total = builder.add(total, extra)
                return total

            def join(sums):  # split: I = 256 hi + lo
                return builder.add(v.shl(sums[0], 8), sums[1]) if split else sums

            def scale_byte(gb, i, h, signed):
                raw8 = v.load(gb, t.field_at[len(t.fields) - (16 if t.kind == "q6_k" else 12) + i] + lanes * h, vb,
                              align=1)
                return builder.sext(raw8, vi) if signed else builder.zext(raw8, vi)

            def add_block(h, i, blk):
                builder.store(builder.fadd(builder.load(faccs[h][i]), blk), faccs[h][i])

            def sum_tile(e, lo):  # the tile of part e (parity or 16-value half) and hi / lo (or fast)
                return 2 * e + lo if split else e

            def tile_sums(a, xc0, parity):
                """AMX: activation block a's sums for the 16 rows of x into c_buf (tile c at byte
                1024 c, row i at 64 i), `sum_tile(e, lo)`, e the 16-value half (per16) or the block's
                parity (consecutive blocks alternate tiles, so that one block's dot products need not
                wait for the previous block's sums to be stored). xc0: row 0's activation bytes of
                the block (split: 32 hi then 32 lo bytes; fast: 32 codes). Per 16 values (Q6_K,
                Q3_K) each half is its own product of K = 16 (A: 16 bytes a row, B: 4 rows): against
                one A tile of the block and two B tiles of 8 rows each with the other half's rows
                zero, the same sums took ~10% longer (2048 x 8192, 512 rows, docs/performance.md)."""
                b_block = v.gep(b_ptr, builder.mul(a, c64(AMX_CODE_BLOCK)))
                halves_parts = ((0, 0, 0), (1, 16, 256)) if per16 else ((parity, 0, 0),)
                for e, x_at, b_at in halves_parts:  # (sum tile part, A and B byte offsets)
                    codes_tile = 6 + e if per16 else 6
                    ax.load(4, v.gep(xc0, x_at), x_stride)
                    ax.load(codes_tile, v.gep(b_block, b_at), 64)
                    if split:
                        ax.load(5, v.gep(xc0, 32 + x_at), x_stride)
                    ax.zero(sum_tile(e, 0))
                    ax.dot(sum_tile(e, 0), 4, codes_tile, a_signed=True, b_signed=signed_codes)  # hi or fast
                    if split:
                        ax.zero(sum_tile(e, 1))
                        ax.dot(sum_tile(e, 1), 5, codes_tile, a_signed=False, b_signed=signed_codes)  # lo
                for e, _, _ in halves_parts:
                    for lo in ((0, 1) if split else (0,)):
                        ax.store(sum_tile(e, lo), v.gep(c_ptr, 1024 * sum_tile(e, lo)), 64)

            def amx_sums(i, e):
                if not split:
                    return v.load(c_ptr, 1024 * sum_tile(e, 0) + 64 * i, vi, align=64)
                return (v.load(c_ptr, 1024 * sum_tile(e, 0) + 64 * i, vi, align=64),
                        v.load(c_ptr, 1024 * sum_tile(e, 1) + 64 * i, vi, align=64))

            def block(bi, parity, later=None):  # weight block bi (parity: AMX's alternate sum tiles; later:
                # where its 32-value types' float operations go to be done after the next block's tiles)
                gb = v.gep(group_base, builder.mul(bi, c64(t.group_block)))
                _prefetch(builder, gb, t.group_block)
                for h in range(halves):
                    d = builder.fpext(v.load(gb, 2 * lanes * h, vector_type(F16, lanes), align=1), vf)
                    if t.kind in ("q4_k", "q5_k"):
                        dmin = builder.fpext(v.load(gb, 32 + 2 * lanes * h, vector_type(F16, lanes), align=1), vf)
                    if t.kind in ("q3_k", "q4_k", "q5_k"):
                        col = [scale_byte(gb, i, h, False) for i in range(12)]
                    m = None
                    if t.has_min:
                        m = builder.fpext(v.load(gb, 32 + 2 * lanes * h, vector_type(F16, lanes), align=1), vf)
                    # the per-sub-block scales of a k-quant, for the run-time loop over its 8
                    # activation blocks (d * sc and dmin * m, as the exact kernels compute them)
                    if t.kind in ("q4_k", "q5_k"):
                        for sub in range(subs):  # get_scale_min_k4
                            if sub < 4:
                                sc, mn = v.and_(col[sub], 63), v.and_(col[sub + 4], 63)
                            else:
                                sc = v.or_(v.and_(col[sub + 4], 15), v.shl(v.shr(col[sub - 4], 6), 4))
                                mn = v.or_(v.shr(col[sub + 4], 4), v.shl(v.shr(col[sub], 6), 4))
                            builder.store(builder.fmul(d, builder.sitofp(sc, vf)), builder.gep(sub_scales, [c64(sub)]))
                            builder.store(builder.fmul(dmin, builder.sitofp(mn, vf)), builder.gep(sub_minima, [c64(sub)]))
                    if t.kind == "q3_k":
                        for is_ in range(16):
                            scale = builder.sub(_q3_k_scale(v, col, is_), ir.Constant(vi, [32] * lanes))
                            builder.store(builder.fmul(d, builder.sitofp(scale, vf)), builder.gep(sub_scales, [c64(is_)]))

                    def sub_block(sub, fixed, parity=0, later=None, h=h, d=d, m=m):  # activation block `sub` (i64; `fixed` its
                        # value when known at compile time) of the weight block
                        a = builder.add(builder.mul(bi, c64(subs)), sub)
                        code_off = builder.mul(a, c64(4 * block_words))
                        s_at = builder.add(c_words, a)
                        x_scale = [x_word(xr, s_at, F32) for xr in x_rows]
                        if amx:
                            with builder.if_then(decode_here):
                                _store_amx_codes(v, t, b_ptr, (_fast_code_vectors(v, t, gb, lanes, h, fixed)
                                                               if fixed is not None
                                                               else _fast_k_code_vectors(v, t, gb, lanes, h, sub)))
                            tile_sums(builder.select(decode_here, c64(0), a), v.gep(x_rows[0], code_off), parity)
                        codes = [] if amx else (_fast_code_vectors(v, t, gb, lanes, h, fixed) if fixed is not None
                                                else _fast_k_code_vectors(v, t, gb, lanes, h, sub))
                        if split:  # (u8, s8, word): the unsigned codes are s8 too, Q8_0's are s8
                            codes = [(v.b.xor(w, ir.Constant(vi, [0x80808080 - 2**32] * lanes)) if t.kind == "bytes"
                                      else w, w, word) for w, word in codes]
                        elif t.kind == "bytes":
                            codes = [(v.b.xor(w, ir.Constant(vi, [0x80808080 - 2**32] * lanes)), word)
                                     for w, word in codes]  # codes + 128, unsigned

                        def finish():  # the block's float operations, x row by x row
                            def sums(i, part=None):  # x row i's dot_sum over the block (part: its 16-value half)
                                if amx:
                                    return amx_sums(i, parity if part is None else part)
                                xc = v.gep(x_rows[i], code_off)
                                return dot_sum(xc, codes if part is None else codes[4 * part : 4 * part + 4])
                            if t.kind in ("q4_k", "q5_k"):
                                dsc = builder.load(builder.gep(sub_scales, [sub]))
                                dmn = builder.load(builder.gep(sub_minima, [sub]))
                            if t.kind == "q6_k":  # its 16 scale bytes are fields 1..16, 16 rows' each
                                half_scales = []
                                for e in (0, 1):
                                    at = builder.add(builder.mul(builder.add(builder.mul(sub, c64(2)), c64(e)), c64(GROUP)),
                                                     c64(t.field_at[1] + lanes * h))
                                    byte = builder.sext(v.load(gb, at, vb, align=1), vi)
                                    half_scales.append(builder.fmul(d, builder.sitofp(byte, vf)))
                            if t.kind == "q3_k":
                                half_scales = [builder.load(builder.gep(sub_scales, [builder.add(builder.mul(sub, c64(2)),
                                                                                                  c64(e))]))
                                               for e in (0, 1)]
                            for i in range(n):
                                xc = v.gep(x_rows[i], code_off)
                                if per16:
                                    code_offset = 32 if t.kind == "q6_k" else 4
                                    for e in (0, 1):
                                        total = join(sums(i, e))
                                        q16 = x_word(x_rows[i], builder.add(builder.add(c_words, builder.mul(na, c64(3))),
                                                                            builder.add(builder.mul(a, c64(2)), c64(e))), I32)
                                        if not signed_codes:
                                            total = builder.sub(total, builder.mul(q16, ir.Constant(vi, [code_offset] * lanes)))
                                        f = builder.fmul(half_scales[e], x_scale[i])
                                        add_block(h, i, builder.fmul(builder.sitofp(total, vf), f))
                                    continue
                                if t.kind == "bytes" and isa == "avx2":
                                    # I = I_lo + 16 I_hi over the two nibbles of each code + 128
                                    lo = dot_sum(xc, [(v.and_(w, 0x0F0F0F0F), word) for w, word in codes])
                                    hi = dot_sum(xc, [(v.and_(v.shr(w, 4), 0x0F0F0F0F), word) for w, word in codes])
                                    total = builder.add(lo, v.shl(hi, 4))
                                elif split and t.kind == "bytes":
                                    hi, lo = sums(i)
                                    hi_sum = x_word(x_rows[i], builder.add(builder.add(c_words, builder.mul(na, c64(5))), a),
                                                    I32)
                                    if not signed_codes:
                                        hi = builder.sub(hi, builder.mul(hi_sum, ir.Constant(vi, [128] * lanes)))
                                    total = builder.add(v.shl(hi, 8), lo)
                                else:
                                    total = join(sums(i))
                                off = t.offset + (128 if t.kind == "bytes" and not split else 0)
                                if t.kind in ("nibbles", "bytes", "q5") and off and not signed_codes:
                                    q_sum = x_word(x_rows[i], builder.add(builder.add(c_words, na), a), I32)
                                    total = builder.sub(total, builder.mul(q_sum, ir.Constant(vi, [off] * lanes)))
                                if t.kind in ("q4_k", "q5_k"):
                                    blk = builder.fmul(builder.sitofp(total, vf), builder.fmul(dsc, x_scale[i]))
                                    sq = x_word(x_rows[i], builder.add(builder.add(c_words, builder.mul(na, c64(2))), a), F32)
                                    blk = builder.fsub(blk, builder.fmul(dmn, sq))
                                else:
                                    blk = builder.fmul(builder.sitofp(total, vf), builder.fmul(d, x_scale[i]))
                                    if t.has_min:
                                        sq = x_word(x_rows[i], builder.add(builder.add(c_words, builder.mul(na, c64(2))), a),
                                                    F32)
                                        blk = builder.fadd(blk, builder.fmul(m, sq))
                                add_block(h, i, blk)

                        if later is None:
                            finish()
                        else:  # (AMX: after the next block's tile operations are issued)
                            later.append(finish)


                    if subs == 1 or not loop_subs:
                        for sub in range(subs):
                            sub_block(c64(sub), sub, parity, later)
                    elif amx:  # sub-blocks in pairs, alternating sum tiles
                        with cgutils.for_range(builder, c64(subs // 2)) as sub_loop:
                            later = None if per16 else []  # per16 takes all four sum tiles per block
                            for odd in (0, 1):
                                sub_block(builder.add(builder.mul(sub_loop.index, c64(2)), c64(odd)), None, odd, later)
                            for finish in later or ():
                                finish()
                    else:
                        with cgutils.for_range(builder, c64(subs)) as sub_loop:
                            sub_block(sub_loop.index, None)

            if amx and subs == 1:  # blocks in pairs, alternating sum tiles (and an odd one last)
                with cgutils.for_range(builder, builder.sdiv(nb, c64(2))) as loop:
                    later = []
                    for odd in (0, 1):
                        block(builder.add(builder.mul(loop.index, c64(2)), c64(odd)), odd, later)
                    for finish in later:
                        finish()
                with builder.if_then(builder.icmp_signed("!=", builder.srem(nb, c64(2)), c64(0))):
                    block(builder.sub(nb, c64(1)), 0)
            else:
                with cgutils.for_range(builder, nb) as loop:
                    block(loop.index, 0)
            if amx:
                ax.release()
            frame.store_sums()
            return context.get_dummy_value()

        return sig, codegen

    if amx:  # the AMX intrinsics also take the group's code tiles
        def gdot_amx(typingctx, raw, xw, y, g, t0, yoff, code_tiles, decode):
            return gdot(typingctx, raw, xw, y, g, t0, yoff, code_tiles, decode)

        return intrinsic(gdot_amx)

    def gdot_vector(typingctx, raw, xw, y, g, t0, yoff):
        return gdot(typingctx, raw, xw, y, g, t0, yoff)

    return intrinsic(gdot_vector)


# Bytes of B tiles per activation block (`make_amx_code_tiles`), every type: 8 rows of 64 bytes,
# row j 16 weight rows' 4 codes of activation word j (per 16 values, Q6_K and Q3_K, rows 0..3 and
# 4..7 are each half's tile of 4 rows)
AMX_CODE_BLOCK = 512


def _per16(t: IntType) -> bool:
    """Whether the type's scales are per 16 values (two per 32-value activation block)."""
    return t.kind in ("q6_k", "q3_k")


def _amx_code_offset(t: IntType) -> int:
    """What the AMX kernels take off each code to make it a signed byte (Q4_0 8, Q5_0 16, Q6_K 32,
    Q3_K 4; 0: the codes go in as they are)."""
    return {"q6_k": 32, "q3_k": 4}.get(t.kind, t.offset if t.kind in ("nibbles", "q5") else 0)


def _store_amx_codes(v, t: IntType, at, codes):
    """An activation block's B tile rows at `at` from its code vectors (`_fast_code_vectors`, 16
    rows; word j at 64 j): signed c - offset where the type has an offset (Q4_0 8, Q5_0 16, Q6_K
    32, Q3_K 4), Q8_0's signed bytes as they are, else unsigned (the AMX kernels' sums then need
    no offset term)."""
    offset = _amx_code_offset(t)
    vi = vector_type(I32, GROUP)
    vb64 = vector_type(I8, 4 * GROUP)
    for w, word in codes:
        if offset:  # byte by byte
            w = v.b.bitcast(v.b.sub(v.b.bitcast(w, vb64), ir.Constant(vb64, [offset] * 4 * GROUP)), vi)
        v.store(w, at, 64 * word, align=1)


def make_amx_code_tiles(t: IntType):
    """An intrinsic (raw, g, out): weight group g's codes as AMX B tiles (`_store_amx_codes`) for
    every activation block of its rows, block a at out[a * AMX_CODE_BLOCK:] (uint8,
    C-contiguous, at least blocks per row x that). The AMX kernels multiply one group's tiles with
    every 16 rows of x: decoding them once per group, not once per 16 rows, and reading them from
    memory written long before, not from stores just issued (a tile load cannot take data from the
    store buffer: it waits for the stores to reach the cache), took a 512-row Q4_0 product from 32
    to ~26 ms in the fast mode (docs/performance.md)."""
    subs = t.values // 32

    @intrinsic
    def code_tiles(typingctx, raw, g, out):
        sig = types.void(raw, g, out)

        def codegen(context, builder, signature, args):
            v = VectorIR(builder)
            rarr = context.make_array(signature.args[0])(context, builder, args[0])
            row_bytes = cgutils.unpack_tuple(builder, rarr.shape, 2)[1]
            rp = data_pointer(context, builder, signature.args[0], args[0])
            op = data_pointer(context, builder, signature.args[2], args[2])
            gi = context.cast(builder, args[1], signature.args[1], types.int64)
            nb = builder.sdiv(row_bytes, c64(t.nbytes))
            group_base = v.gep(rp, builder.mul(builder.mul(gi, c64(GROUP)), row_bytes))
            with cgutils.for_range(builder, nb) as loop:
                gb = v.gep(group_base, builder.mul(loop.index, c64(t.group_block)))
                for sub in range(subs):
                    at = v.gep(op, builder.mul(builder.add(builder.mul(loop.index, c64(subs)), c64(sub)),
                                               c64(AMX_CODE_BLOCK)))
                    _store_amx_codes(v, t, at, _fast_code_vectors(v, t, gb, GROUP, 0, sub))
            return context.get_dummy_value()

        return sig, codegen

    return code_tiles


def make_group_dot_exact(t: IntType, isa: str, n: int, amx: bool = False):
    """The exact intrinsic for the activations `int_dot.EXACT_FORM` gives `isa`: hi/lo bytes
    (`make_group_dot_fast(split=True)`, by AMX tiles for AMX_ROWS rows) or i16 pairs
    (`make_group_dot`, `make_group_dot_k`)."""
    if int_dot.EXACT_FORM[isa] == "split":
        return make_group_dot_fast(t, isa, n, split=True, amx=amx)
    return (make_group_dot_k if t.values == 256 else make_group_dot)(t, isa, n)


# Rows of x per pass over a group's blocks (each block's codes decoded once for them), largest
# first: 8 with AVX-512's 32 registers (one 16-row half, 8 rows' accumulators and the code vectors
# fit); measured one thread, 64 rows of a 2048 x 2048 matrix against tiles of 4, a test run beside
# it: fast mode Q4_0 1.23x, Q4_K 1.05x, Q6_K 1.21x; exact 1.03x / 1.08x / 1.16x. The 256-bit
# sets (16 registers on CPUs without AVX-512, and two halves per group) stay at 4.
# avx512amx: these are the VNNI kernels; its AMX kernels (below) are apart.
X_TILES = {"avx512amx": (8, 4, 2, 1), "avx512vnni": (8, 4, 2, 1), "avxvnni": (4, 2, 1), "avx2": (4, 2, 1)}
# AMX: 16 rows of x at a time by tiles (`make_group_dot_fast(amx=True)`). Fewer rows stay on the
# VNNI kernels: tiles of 8 and 4 rows measured slower than them (docs/performance.md, 2026-12-07).
AMX_ROWS = 16
# A last AMX_PAD_FROM or more rows of x that do not fill a tile go to AMX as a whole tile, zero
# rows below them, not to the VNNI kernels (fewer stay on VNNI): one 16-row tile of a 1B-shaped
# matrix costs about what 12-14 rows of the VNNI kernels do (Q8_0 and Q4_0 12, Q6_K 13, Q4_K 14
# alone; after whole tiles 10-12; docs/performance.md, 2026-12-07, fifth session). A chat prompt
# of 46 tokens is 3 tiles, not 2 and 14 rows.
AMX_PAD_FROM = 13
# ... when the input is one slice (below AMX_SLICE_ROWS rows: a prompt, a prompt's last chunk) and
# the padded output, a copy, is at most this big (not a long prompt's logits over a vocabulary)
AMX_PAD_MAX_BYTES = 1 << 23
# Long inputs go to the AMX kernels in slices of this many rows of x (each slice a pool job that
# decodes every weight group's codes once for its tiles): each weight group reads all of a slice's
# activations, and a 512-row slice of a 2,048-wide input (2.9 MB as hi and lo bytes) no longer
# stays in L2 from one group to the next. Whole prefills of 512 tokens, alternating in one
# process: 1B Q4_K_M 1.5-3.9% faster, 1B Q4_0 4.4%, 3B Q4_K_M 4.1% (128 rows: no better).
AMX_SLICE_ROWS = 256


def amx_decode_once_rows(t: IntType) -> int:
    """From this many rows of x the AMX kernels decode a weight group's codes once for all its
    tiles of x rows (`make_amx_code_tiles`); below, block by block beside the float work, as each
    block's code vectors serve fewer tiles than a separate pass costs. Measured per type (one
    1B-shaped matrix, 16 and 32 rows, exact and fast, docs/performance.md): the 32-value types
    from 48 rows (decoding once made 16 rows 20-40% slower), the k-quants from 32 (8-15% faster
    at 32 rows), the types with scales per 16 values (Q6_K, Q3_K) from 16."""
    if _per16(t):
        return 16
    return 32 if t.values == 256 else 48


# One intrinsic per (type, instruction set, rows of x at once)
_GDOT = {(tt, isa, n): make_group_dot_exact(INT_TYPES[tt], isa, n)
         for tt in INT_TYPES for isa in int_dot.ISA_LANES for n in X_TILES[isa]}


# ---------------------------------------------------------------------------------------------
# Kernels (numba), one set per (type in INT_TYPES, instruction set in int_dot.ISA_LANES, exact or
# fast), made here at import from the templates below: groups r0/16 .. r1/16 of the matrix, every
# row of x. numba's disk cache (cache=True) files a function under its source file and qualified
# name and trusts it while that file's stamp holds (plus vector_ir's hash), so each kernel is a
# template's own code object under its own name (`_kernel_copy`): its file is this one, an edit
# here (a template, the IR builders above) recompiles it, and it compiles or loads from the cache
# only when its type is used.
# ---------------------------------------------------------------------------------------------

# Fast mode (int8 activations)
_GDOT_FAST = {(tt, isa, n): make_group_dot_fast(INT_TYPES[tt], isa, n)
              for tt in INT_TYPES for isa in int_dot.ISA_LANES for n in X_TILES[isa]}


# _irows_<type>_<isa> (exact) / _frows_<type>_<isa> (fast): GDOT8, GDOT4, GDOT2 and GDOT1 stand
# for the module-level names of that kernel's intrinsics (_g_<type>_<isa>_<n> / _f_<type>_<isa>_<n>);
# _rows_template8 for the instruction sets with tiles of 8 (X_TILES)
def _rows_template8(raw, xw, y, r0, r1, yoff):
    T = xw.shape[0]
    for g in range(r0 // 16, r1 // 16):
        t = 0
        while t < T:
            if T - t >= 8:
                GDOT8(raw, xw, y, g, t, yoff)  # noqa: F821
                t += 8
            elif T - t >= 4:
                GDOT4(raw, xw, y, g, t, yoff)  # noqa: F821
                t += 4
            elif T - t >= 2:
                GDOT2(raw, xw, y, g, t, yoff)  # noqa: F821
                t += 2
            else:
                GDOT1(raw, xw, y, g, t, yoff)  # noqa: F821
                t += 1


def _rows_template(raw, xw, y, r0, r1, yoff):
    T = xw.shape[0]
    for g in range(r0 // 16, r1 // 16):
        t = 0
        while t < T:
            if T - t >= 4:
                GDOT4(raw, xw, y, g, t, yoff)  # noqa: F821
                t += 4
            elif T - t >= 2:
                GDOT2(raw, xw, y, g, t, yoff)  # noqa: F821
                t += 2
            else:
                GDOT1(raw, xw, y, g, t, yoff)  # noqa: F821
                t += 1


# The pool's compute functions (`pool.COMPUTE_SIG`, see `pool.run_rows`), _c_<type>_<isa> (exact) /
# _cf_<type>_<isa> (fast), ROWS their row loop: x is the quantized activations (T, words), rows are
# weight rows (multiples of 16 per chunk).
def _compute_template(raw_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols, out_off, r0, r1):
    ROWS(carray(u8_pointer(raw_addr), (n_rows, row_bytes)), carray(f32_pointer(x_addr), (T, K)),  # noqa: F821
         carray(f32_pointer(out_addr), (T, out_cols)), r0, r1, out_off)


def _kernel_copy(template, name: str, renames: dict):
    """`template` as the function `name` of this module (`vector_ir.kernel_copy`)."""
    return kernel_copy(template, globals(), name, renames)


def _make_kernels(gdots: dict, g_prefix: str, rows_prefix: str, c_prefix: str):
    """The row loops and compute functions of one mode for every (type, instruction set), with
    the module-level names of their intrinsics: ({(type, isa): compute}, {(type, isa): rows})."""
    computes, rows = {}, {}
    for tt in INT_TYPES:
        for isa in int_dot.ISA_LANES:
            stem = f"{tt.name.lower()}_{isa}"
            tiles = X_TILES[isa]
            for n in tiles:
                globals()[f"_{g_prefix}_{stem}_{n}"] = gdots[tt, isa, n]
            loop = _kernel_copy(_rows_template8 if 8 in tiles else _rows_template, f"_{rows_prefix}_{stem}",
                                {f"GDOT{n}": f"_{g_prefix}_{stem}_{n}" for n in tiles})
            rows[tt, isa] = globals()[loop.__name__] = njit(nogil=True, cache=True)(loop)
            computes[tt, isa] = _kernel_copy(_compute_template, f"_{c_prefix}_{stem}", {"ROWS": loop.__name__})
    return computes, rows


_COMPUTE_PY, _ROWS = _make_kernels(_GDOT, "g", "irows", "c")
_COMPUTE_FAST_PY, _ROWS_FAST = _make_kernels(_GDOT_FAST, "f", "frows", "cf")
_cfuncs: dict = {}
_cfunc_lock = threading.Lock()


# AMX (instruction set avx512amx): per (type, exact or fast) a row loop over whole tiles of
# AMX_ROWS rows of x only (`IntMatvec` sends the rest of the rows to the VNNI kernels) and its
# compute function, compiled apart from the VNNI kernels, off the path to the first token: a first
# start compiles them in the background (`background`, one group per type, started by `warm_up`),
# and until a type's group is ready its products take the VNNI kernels, which give the same bits.
# _arows_<type> / _afrows_<type> (exact / fast), GDOT16 their intrinsic (_a_<type> / _af_<type>).
def _rows_template_amx(raw, xw, y, r0, r1, yoff):
    T = xw.shape[0] // 16 * 16
    if T < DECODE_ONCE_ROWS:  # noqa: F821 (`amx_decode_once_rows`)
        # each block's codes decoded beside the float work of the last, into one slot
        slot = np.zeros(AMX_CODE_BLOCK, np.uint8)
        for g in range(r0 // 16, r1 // 16):
            for t in range(0, T, 16):
                GDOT16(raw, xw, y, g, t, yoff, slot, 1)  # noqa: F821
        return
    # B tiles of one weight group (CODE_BYTES per byte of a row's blocks), decoded once for all
    # the tiles of 16 x rows
    code_tiles = np.empty(raw.shape[1] * CODE_BYTES, np.uint8)  # noqa: F821
    for g in range(r0 // 16, r1 // 16):
        CODE_TILES(raw, g, code_tiles)  # noqa: F821
        for t in range(0, T, 16):
            GDOT16(raw, xw, y, g, t, yoff, code_tiles, 0)  # noqa: F821


def _make_amx_kernels():
    computes, rows = {}, {}
    for tt in INT_TYPES:
        t = INT_TYPES[tt]
        globals()[f"_amx_codes_{tt.name.lower()}"] = make_amx_code_tiles(t)
        # B tile bytes per byte of a row's GGUF blocks, rounded up (what `_rows_template_amx`
        # allocates: AMX_CODE_BLOCK bytes per activation block)
        globals()[f"_amx_code_bytes_{tt.name.lower()}"] = -(-AMX_CODE_BLOCK * (t.values // 32) // t.nbytes)
        globals()[f"_amx_once_rows_{tt.name.lower()}"] = amx_decode_once_rows(t)
        for fast in (False, True):
            stem = f"{'af' if fast else 'a'}_{tt.name.lower()}"
            gdot = (make_group_dot_fast(t, "avx512amx", AMX_ROWS, amx=True) if fast
                    else make_group_dot_exact(t, "avx512amx", AMX_ROWS, amx=True))
            globals()[f"_{stem}"] = gdot
            loop = _kernel_copy(_rows_template_amx, f"_{stem}rows",
                                {"GDOT16": f"_{stem}", "CODE_TILES": f"_amx_codes_{tt.name.lower()}",
                                 "CODE_BYTES": f"_amx_code_bytes_{tt.name.lower()}",
                                 "DECODE_ONCE_ROWS": f"_amx_once_rows_{tt.name.lower()}"})
            rows[tt, fast] = globals()[loop.__name__] = njit(nogil=True, cache=True)(loop)
            computes[tt, fast] = _kernel_copy(_compute_template, f"_c{stem}", {"ROWS": loop.__name__})
    return computes, rows


_COMPUTE_AMX_PY, _ROWS_AMX = _make_amx_kernels()


def amx_group(ggml_type) -> str:
    """The background group (`engine.kernels.background`) of a type's exact AMX kernels."""
    return f"AMX tiles ({ggml_type.name})"


def amx_compute_address(ggml_type, fast: bool = False) -> int:
    """The address of a type's AMX compute function (whole tiles of AMX_ROWS rows of x), compiled
    or loaded from numba's disk cache on first use."""
    key = (ggml_type, "amx", fast)
    fn = _cfuncs.get(key)
    if fn is None:
        with _cfunc_lock:
            fn = _cfuncs.get(key)
            if fn is None:
                fn = _cfuncs[key] = cfunc(COMPUTE_SIG, nogil=True, cache=True)(_COMPUTE_AMX_PY[ggml_type, fast])
    return fn.address


def _amx_warm_target(ggml_type):
    def warm() -> None:  # (run by the background group: in its child process, then here)
        amx_compute_address(ggml_type)

    name = f"warm_amx_{ggml_type.name.lower()}"
    warm.__name__ = warm.__qualname__ = name
    globals()[name] = warm
    return f"{__name__}:{name}", [f"{__name__}:{_ROWS_AMX[ggml_type, False].py_func.__qualname__}"]


_AMX_WARM = {tt: _amx_warm_target(tt) for tt in INT_TYPES}


def compute_address(ggml_type, isa: str, fast: bool = False) -> int:
    """The address of the (type, instruction set, exact or fast) compute function, compiled or
    loaded from numba's disk cache on first use."""
    key = (ggml_type, isa, fast)
    fn = _cfuncs.get(key)
    if fn is None:
        with _cfunc_lock:
            fn = _cfuncs.get(key)
            if fn is None:
                py = (_COMPUTE_FAST_PY if fast else _COMPUTE_PY)[ggml_type, isa]
                fn = _cfuncs[key] = cfunc(COMPUTE_SIG, nogil=True, cache=True)(py)
    return fn.address


class IntMatvec:
    """y = x @ W.T by the integer kernels, for one matrix: W the GGUF blocks `raw` (rows, bytes),
    repacked here (the caller drops `raw` and keeps `packed`)."""

    __slots__ = ("ggml_type", "isa", "packed", "n_rows", "in_features", "compute", "compute_fast", "chunk", "form",
                 "amx")

    def __init__(self, ggml_type, raw: np.ndarray, in_features: int, isa: str, packed: np.ndarray | None = None):
        if not supports(ggml_type, raw.shape[0], in_features) or isa not in int_dot.ISA_LANES:
            raise ValueError(f"no integer kernel for {ggml_type.name} ({raw.shape[0]} x {in_features}) on {isa}")
        if isa == "avx512amx" and not int_dot.isa_available(isa):  # (a tile instruction without the grant: SIGILL)
            raise ValueError("AMX tiles are not available to this process")
        self.ggml_type, self.isa = ggml_type, isa
        self.packed = readonly(repack(raw, ggml_type) if packed is None else packed)
        self.n_rows, self.in_features = raw.shape[0], in_features
        self.compute = compute_address(ggml_type, isa)
        self.form = int_dot.activation_form(isa, False)  # the exact kernels' activations
        self.compute_fast = None  # compiled on the first fast-mode product
        # avx512amx: {fast: AMX compute address}, each made on its first product of AMX_ROWS rows or more
        self.amx = {} if isa == "avx512amx" else None
        # rows per chunk: ~CHUNK_BYTES, whole groups of GROUP rows, and at most MAX_CHUNKS chunks
        # (the pool's state array has that many slots: a vocabulary-sized matrix of 262,144 rows
        # needs chunks of 64 rows or more)
        fewest = -(-raw.shape[0] // MAX_CHUNKS)
        self.chunk = max(GROUP, (CHUNK_BYTES // raw.shape[1]) // GROUP * GROUP, -(-fewest // GROUP) * GROUP)

    def __call__(self, x: np.ndarray, out: np.ndarray, fast: bool = False, xw: np.ndarray | None = None) -> np.ndarray:
        """x C-contiguous float32 (T, in_features) -> out (T, rows), C-contiguous. fast: int8
        activations (`int_dot.quantize_activations_fast`), else 16-bit (in `self.form`). xw: x
        already quantized that way (several matrices reading one input quantize it once)."""
        if fast:
            if self.compute_fast is None:
                self.compute_fast = compute_address(self.ggml_type, self.isa, True)
            compute = self.compute_fast
        else:
            compute = self.compute
        T = x.shape[0]
        form = "fast" if fast else self.form
        amx = self._amx_for(T, fast)
        tail = T % AMX_ROWS
        # the last rows as a whole AMX tile, zero rows below them, in one call with the others (one
        # pass over the weights): for an input of one slice whose padded output, a copy, is small
        pad = (AMX_ROWS - tail if amx and tail >= AMX_PAD_FROM and T < AMX_SLICE_ROWS
               and (T + AMX_ROWS - tail) * out.shape[1] * 4 <= AMX_PAD_MAX_BYTES else 0)
        if xw is None or pad:
            quantized = np.empty((T + pad, int_dot.form_words(form, x.shape[1])), np.float32)
            if xw is None:
                int_dot.quantize_form(x, form, quantized[:T])
            else:
                quantized[:T] = xw
            quantized[T:] = 0.0  # codes, scales and sums 0: rows of zeros
            xw = quantized
        if pad:
            padded_out = np.empty((T + pad, out.shape[1]), np.float32)
            self._rows(amx, xw, padded_out, amx=True)
            out[:] = padded_out[:T]
            return out
        # whole tiles of rows by AMX, the rest by VNNI (a row's bits are the same either way)
        whole = T - tail if amx else 0
        if whole:
            self._rows(amx, xw[:whole], out[:whole], amx=True)
            if whole == T:
                return out
            xw, out_rest = xw[whole:], out[whole:]
        else:
            out_rest = out
        if T - whole <= BUF_VALUES // self.chunk:  # (a decode step, a batch: one job, no method call more)
            run_rows(compute, self.packed, xw, out_rest, self.chunk, self.chunk * self.packed.shape[1] * (T - whole))
        else:
            self._rows(compute, xw, out_rest)
        return out

    def _amx_for(self, T: int, fast: bool) -> int:
        """The AMX compute function's address for T rows of x, or 0: VNNI for all of them (no
        AMX, too few rows, chunks holding under AMX_ROWS rows of x in the pool's buffer, or the
        type's AMX kernels still compiling)."""
        if (self.amx is None or (T < AMX_ROWS and T % AMX_ROWS < AMX_PAD_FROM)
                or BUF_VALUES // self.chunk < AMX_ROWS):
            return 0
        return self._amx_compute(fast)

    def _amx_compute(self, fast: bool) -> int:
        """The AMX compute function's address, or 0 while the type's exact kernels are still being
        compiled in the background (the VNNI kernels answer meanwhile). The fast mode's are made by
        `warm_up(fast=True)` (`Engine.set_arith`), else here on first use."""
        address = self.amx.get(fast)
        if address is None:
            group = amx_group(self.ggml_type)
            if background.pending(group):
                background.count_fallback(group)
                return 0
            address = self.amx[fast] = amx_compute_address(self.ggml_type, fast)
        return address

    def _rows(self, compute: int, xw: np.ndarray, out: np.ndarray, amx: bool = False) -> None:
        # the pool shares a job of at most BUF_VALUES outputs per chunk: a long prompt goes in
        # slices of rows of x (the kernels compute a row the same in any batch, so slicing changes
        # no bit); for AMX (`compute` an AMX kernel) whole tiles of rows, at most AMX_SLICE_ROWS
        # (a decode step or a batch, one job, goes to run_rows straight from __call__)
        T = xw.shape[0]
        multiple = AMX_ROWS if amx else 1
        step = max(multiple, BUF_VALUES // self.chunk // multiple * multiple)
        if amx:
            step = min(step, AMX_SLICE_ROWS)
        for t0 in range(0, T, step):
            t1 = min(t0 + step, T)
            run_rows(compute, self.packed, xw[t0:t1], out[t0:t1], self.chunk,
                     self.chunk * self.packed.shape[1] * (t1 - t0))

    def rows_gguf(self, rows: np.ndarray) -> np.ndarray:
        return unpack_rows(self.packed, self.ggml_type, rows)

    def range_gguf(self, start: int, stop: int) -> np.ndarray:
        return unpack_range(self.packed, self.ggml_type, start, stop)


# ---------------------------------------------------------------------------------------------
# Several matrices reading one x in one pool job
# ---------------------------------------------------------------------------------------------
# q, k and v (gate and up) of a layer read the same activations. As separate pool jobs each pays
# the hand-off between threads and the Python around it, ~3 us, about what a decode step's k or v
# product of a small model computes (SmolLM2's 192 x 576 Q4_1: ~1.5 us of blocks). One job over
# their rows stacked (matrix i's rows at [start_i, stop_i) of a virtual matrix) runs each matrix's
# own compute function on the part of a chunk that falls in it: every output is computed by the
# same kernel from the same activations, so the bits are those of the separate products.
# The job's "raw" is a segment table, passed by address as `kv_codes` passes its table of
# sequences: (rows of the virtual matrix, 8) uint8, whose first int64 words are
#     n, then per matrix: start, stop, compute function address, packed blocks' address, row bytes
# (n <= rows / 16 matrices of 16 rows or more: the table fits).
SEGMENT_FIELDS = 5


def _compute_segments(table_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols, out_off, r0, r1):
    """The pool's compute function (`pool.COMPUTE_SIG`) of a segment table: rows r0..r1-1 of the
    virtual matrix into out's columns r - out_off, by the compute function of each matrix they
    fall in."""
    table = carray(i64_pointer(table_addr), (n_rows * row_bytes // 8,))
    for i in range(table[0]):
        f = 1 + SEGMENT_FIELDS * i
        start, stop = table[f], table[f + 1]
        a, b = max(r0, start), min(r1, stop)
        if a < b:
            call_compute(table[f + 2], table[f + 3], stop - start, table[f + 4], x_addr, T, K, out_addr, out_cols,
                         out_off - start, a - start, b - start)


_segments_cfunc = None


def segments_address() -> int:
    """The address of the compiled `_compute_segments` (compiled, or loaded from numba's disk cache,
    on the first call)."""
    global _segments_cfunc
    if _segments_cfunc is None:
        with _cfunc_lock:
            if _segments_cfunc is None:
                _segments_cfunc = cfunc(COMPUTE_SIG, nogil=True, cache=True)(_compute_segments)
    return _segments_cfunc.address


class IntMatvecGroup:
    """IntMatvecs of one input width on one instruction set, as one product: out (T, their rows
    summed), matrix i's outputs in columns bounds[i]..bounds[i + 1], each bit-identical to its
    own product's."""

    def __init__(self, matvecs):
        matvecs = tuple(matvecs)
        if len({(m.in_features, m.isa) for m in matvecs}) != 1:
            raise ValueError("the matrices of a group read one input on one instruction set")
        self.matvecs = matvecs
        self.form = matvecs[0].form
        self.bounds = [0]
        for m in matvecs:
            self.bounds.append(self.bounds[-1] + m.n_rows)
        self.n_rows = self.bounds[-1]
        self.chunk = min(m.chunk for m in matvecs)  # whole groups of GROUP rows, as each matrix's
        self.chunk_bytes = self.chunk * max(m.packed.shape[1] for m in matvecs)
        # rows of x a joint job takes: what the pool's buffer holds, and with AMX fewer than
        # AMX_PAD_FROM (from there each matrix's own product takes AMX tiles, faster than VNNI)
        self.max_rows = BUF_VALUES // self.chunk
        if matvecs[0].amx is not None:
            self.max_rows = min(self.max_rows, AMX_PAD_FROM - 1)
        self._tables: dict[bool, np.ndarray] = {}  # fast -> segment table

    def table(self, fast: bool) -> np.ndarray:
        """The segment table of the exact or fast compute functions (the fast ones compiled on
        their first use, as IntMatvec's)."""
        table = self._tables.get(fast)
        if table is None:
            table = np.zeros((self.n_rows, 8), np.uint8)
            words = table.reshape(-1).view(np.int64)
            words[0] = len(self.matvecs)
            for i, m in enumerate(self.matvecs):
                if fast and m.compute_fast is None:
                    m.compute_fast = compute_address(m.ggml_type, m.isa, True)
                f = 1 + SEGMENT_FIELDS * i
                words[f : f + SEGMENT_FIELDS] = (self.bounds[i], self.bounds[i + 1],
                                                 m.compute_fast if fast else m.compute, m.packed.ctypes.data,
                                                 m.packed.shape[1])
            table = self._tables[fast] = readonly(table)
        return table

    def __call__(self, xw: np.ndarray, out: np.ndarray, fast: bool = False) -> np.ndarray:
        """xw: the activations (T, words) of x quantized for these kernels (int8 when fast, else in
        `self.form`), T * self.chunk <= BUF_VALUES to be shared -> out (T, n_rows) C-contiguous."""
        # keep: what the table points at, held by the pool if a worker's chunk was stolen
        run_rows(segments_address(), self.table(fast), xw, out, self.chunk, self.chunk_bytes * xw.shape[0],
                 self.matvecs)
        return out


_warm: set = set()


def warm_up(ggml_types, isa: str, fast: bool = False) -> float:
    """Compile or load the integer kernels of these types for `isa` (fast: the fast mode's, which
    otherwise compile on their first use); logs the time."""
    if fast:
        todo = sorted({t for t in ggml_types if t in INT_TYPES and (t, isa, True) not in _cfuncs},
                      key=lambda t: t.name)
        if not todo or isa not in int_dot.ISA_LANES:
            return 0.0
        t0 = time.perf_counter()
        for t in todo:
            compute_address(t, isa, True)
            if isa == "avx512amx":  # (its AMX kernels too: a first fast-mode prefill would wait for them)
                amx_compute_address(t, True)
        seconds = time.perf_counter() - t0
        log.info("fast-mode integer kernels (%s) for %s ready in %.2f s", isa, ", ".join(t.name for t in todo),
                 seconds)
        return seconds
    todo = sorted({t for t in ggml_types if t in INT_TYPES and (t, isa) not in _warm}, key=lambda t: t.name)
    if not todo or isa not in int_dot.ISA_LANES:
        return 0.0
    t0 = time.perf_counter()
    x = np.zeros((1, 64), np.float32)
    int_dot.quantize_form(x, int_dot.activation_form(isa, False))
    for t in todo:
        it = INT_TYPES[t]
        k = max(64, it.values)
        raw = np.zeros((GROUP, k // it.values * it.nbytes), np.uint8)
        IntMatvec(t, raw, k, isa)(x if k == 64 else np.zeros((1, k), np.float32), np.empty((1, GROUP), np.float32))
        _warm.add((t, isa))
    segments_address()  # (IntMatvecGroup's; its calls take the types' own compute functions)
    seconds = time.perf_counter() - t0
    log.info("integer kernels (%s) for %s ready in %.2f s", isa, ", ".join(t.name for t in todo), seconds)
    if isa == "avx512amx":  # the AMX kernels off the path to the first token
        background.start([(amx_group(t), *_AMX_WARM[t]) for t in todo])
    return seconds
