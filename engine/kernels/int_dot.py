"""Integer dot-product instructions (VNNI, AVX2) for the exact-grade integer weight kernels.

`engine.kernels.int_matvec` multiplies quantized weights with activations quantized to 16 bits
per 32-value block (see docs/kernels.md); this module holds what those kernels share:

* the instruction set they compile for, chosen once per process (`kernel_isa`): "avx512amx"
  (the AVX-512 VNNI kernels, and AMX-INT8 tiles for 16 rows of x at a time: prefill, large
  batches; `engine.kernels.amx`), "avx512vnni"
  (512-bit `vpdpbusd` over the codes' hi/lo bytes, `EXACT_FORM`), "avxvnni" (256-bit, VEX-encoded
  on CPUs without AVX-512),
  "avx2" (`vpmaddwd` + `vpaddd`, the same products without VNNI), or "float" (no integer kernels:
  today's float kernels, the reference and the fallback). OMLX_KERNELS forces one;
* `IntIR`, the LLVM IR of a lane-wise 2-way i16 dot product accumulated into i32 lanes, and the
  8-bit `vpdpbusd` form (u8 x s8, 4-way), declared for the LLVM that llvmlite ships: LLVM 22 types
  the operands as <32 x i16> / <64 x i8>, older LLVM as <16 x i32> (same bits);
* the activation quantizer (`quantize_activations`) and the layout of its output.

Activation layout (one row of x, K values, nb = K / 32 blocks), as float32 words so that the
work-sharing pool copies it like any x (bit patterns, no arithmetic):
    words [0, K/2)            int16 codes q, two per word: block b's 32 codes at words 16b..16b+15,
                              in the order the kernels pair them with weights: word 2j + e holds
                              the codes of values 4j + e and 4j + e + 2 (j = 0..7, e = 0, 1)
    words [K/2, K/2 + nb)     float32 s_b = max|x_b| / 32767 (0 for an all-zero block)
    words [+nb, +2nb)         int32 Q_b = sum of block b's codes
    words [+2nb, +3nb)        float32 sQ_b = s_b * float32(Q_b)
q = rint(x / s_b) in float32, |q| <= 32767: x = s_b * q up to s_b / 2, a relative precision of
2**-16 of the block's largest value (the float path's activations are float32).
"""

from __future__ import annotations

import logging
import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..errors import SettingsError
from .vector_ir import F32, I8, I16, I32, VectorIR, data_pointer, vector_type

log = logging.getLogger("omlx.kernels")

ISA_ENV = "OMLX_KERNELS"
# In order of preference; "float" runs on every CPU.
ISAS = ("avx512amx", "avx512vnni", "avxvnni", "avx2", "float")
# i32 lanes of the vectors each instruction set's kernels work in
ISA_LANES = {"avx512amx": 16, "avx512vnni": 16, "avxvnni": 8, "avx2": 8}
# Rows of x above which a product is faster as dequantized float32 tiles and BLAS sgemm than by
# the integer kernels (None: never). Without VNNI the 16-bit product is two instructions
# (vpmaddwd, vpaddd) for 16 multiply-adds per 256 bits, no more than two FMAs, and sgemm reuses
# each tile over the rows far better: on a Zen 3 EPYC (AVX2 only), a 2048 x 2048 matrix at 256
# rows takes 29 ms (Q4_1) / 61 ms (Q4_K) by the integer kernels against 20 / 20 ms by the tiles,
# while at 1-16 rows the integer kernels are 1.1-3x faster (docs/performance.md, 2026-12-03).
INT_MAX_ROWS = {"avx512amx": None, "avx512vnni": None, "avxvnni": None, "avx2": 32}
# Whether the fast mode's int8 product is faster than the exact 16-bit one: with VNNI `vpdpbusd`
# does twice `vpdpwssd`'s multiply-adds; on AVX2 both take two multiply instructions per 32
# (vpmaddubsw + vpmaddwd against two vpmaddwd), and the fast mode measured no faster
# (docs/performance.md, 2026-12-03)
FAST_GAINS = {"avx512amx": True, "avx512vnni": True, "avxvnni": True, "avx2": False}

# The layout of the exact (16-bit) activations each instruction set's kernels read: with VNNI
# the codes as hi and lo bytes for two `vpdpbusd` ("split", `quantize_activations_split`), whose
# weight codes decode as bytes, half the shifts and masks of the i16 pairs; measured one thread,
# cache-hot 2048 x 2048, Xeon with AVX-512 VNNI: Q4_K 1 / 4 / 16 rows 102 / 246 / 917 us as
# pairs -> 80 / 186 / 688 split, Q4_0 77 / 222 / 887 -> 63 / 146 / 562, Q6_K 163 / 317 / 1095 ->
# 141 / 272 / 914 (docs/kernels.md). AVX2 has no u8 x s8 product that keeps the sums exact, so
# its kernels take the i16 pairs ("pairs", `quantize_activations`) to `vpmaddwd`.
EXACT_FORM = {"avx512amx": "split", "avx512vnni": "split", "avxvnni": "split", "avx2": "pairs"}
ACTIVATION_FORMS = ("pairs", "split", "fast")


def activation_form(isa: str, fast: bool) -> str:
    """The activations the (instruction set, exact or fast) kernels read: "pairs", "split" or "fast"."""
    return "fast" if fast else EXACT_FORM[isa]


def quantize_form(x: np.ndarray, form: str, out: np.ndarray | None = None) -> np.ndarray:
    """x (T, K) float32 C-contiguous -> its activations in `form` (ACTIVATION_FORMS)."""
    return _QUANTIZERS[form](x, out)


def form_words(form: str, k: int) -> int:
    """float32 words of one row of k values in `form`."""
    return {"pairs": activation_words, "split": split_activation_words, "fast": fast_activation_words}[form](k)


ACT_BLOCK = 32  # activation values per scale
ACT_MAX = 32767  # largest |code|


def _llvm_major() -> int:
    from llvmlite import binding

    return binding.llvm_version_info[0]


# LLVM 22 declares vpdpwssd / vpdpbusd with i16 / i8 vector operands; LLVM up to 21 with i32 lanes.
TYPED_VNNI_OPERANDS = _llvm_major() >= 22


def isa_available(isa: str) -> bool:
    """Whether this process can run kernels for `isa` (the host CPU, or the CPU numba targets)."""
    from .vector_ir import _target_has

    import platform

    if isa == "float":
        return True
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if isa == "avx512vnni":
        return _target_has("avx512vnni") and _target_has("avx512bw") and _target_has("avx512f")
    if isa == "avx512amx":  # the VNNI kernels, and tiles the OS grants this process
        from . import amx

        return isa_available("avx512vnni") and amx.available()
    if isa == "avxvnni":  # the 256-bit form: AVX-VNNI, or AVX-512 VNNI with 256-bit vectors
        return _target_has("avxvnni") or (_target_has("avx512vnni") and _target_has("avx512vl"))
    if isa == "avx2":
        return _target_has("avx2")
    return False


class KernelSelectionError(SettingsError):
    """OMLX_KERNELS names an instruction set that does not exist or that this CPU lacks."""


def select_isa(wanted: str | None = None) -> str:
    """The instruction set of the integer kernels: `wanted` (or OMLX_KERNELS) when set, else the
    best this CPU has. A forced set this CPU cannot run is an error, not a silent fallback."""
    wanted = (os.environ.get(ISA_ENV, "") if wanted is None else wanted).strip().lower()
    if wanted:
        if wanted not in ISAS:
            raise KernelSelectionError(f"{ISA_ENV}={wanted!r}: expected one of {', '.join(ISAS)}")
        if not isa_available(wanted):
            raise KernelSelectionError(f"{ISA_ENV}={wanted}: this CPU cannot run {wanted} kernels "
                                       f"(it can run: {', '.join(i for i in ISAS if isa_available(i))})")
        return wanted
    return next(i for i in ISAS if isa_available(i))


_isa: str | None = None


def kernel_isa() -> str:
    """The process's choice (made on first call, logged once)."""
    global _isa
    if _isa is None:
        _isa = select_isa()
        log.info("weight kernels: %s", describe(_isa))
    return _isa


def describe(isa: str, fast: bool = False) -> str:
    acts = "int8 activations, fast mode" if fast else "16-bit activations"
    if fast and not FAST_GAINS.get(isa, True):
        acts += "; no faster than exact without VNNI"
    return {
        "avx512amx": f"integer (AMX-INT8 tiles for 16 rows at a time, else AVX-512 VNNI vpdpbusd, {acts}"
                     f"{'' if fast else ' as hi/lo bytes'})",
        "avx512vnni": f"integer (AVX-512 VNNI vpdpbusd, {acts}{'' if fast else ' as hi/lo bytes'})",
        "avxvnni": f"integer (AVX-VNNI 256-bit vpdpbusd, {acts}{'' if fast else ' as hi/lo bytes'})",
        "avx2": f"integer (AVX2 {'vpmaddubsw' if fast else 'vpmaddwd'}, {acts})",
        "float": "float32 (dequantize-and-FMA)",
    }[isa]


class IntIR:
    """Integer dot products over an llvmlite builder, for one instruction set. Vectors are
    <lanes x i32>; an i16 pair vector is the same bits as <2*lanes x i16>."""

    def __init__(self, builder, isa: str):
        self.b = builder
        self.isa = isa
        self.lanes = ISA_LANES[isa]

    def _fn(self, name, ret, args):
        return cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, args), name)

    def dot2(self, acc, w, a):
        """acc + (w.lo16 * a.lo16 + w.hi16 * a.hi16) lane by lane, exact in i32 (signed 16-bit
        halves; the caller keeps the sums in range)."""
        b, n = self.b, self.lanes
        vi = vector_type(I32, n)
        if self.isa == "avx2":
            vh = vector_type(I16, 2 * n)
            fn = self._fn("llvm.x86.avx2.pmadd.wd", vi, [vh, vh])
            return b.add(acc, b.call(fn, [b.bitcast(w, vh), b.bitcast(a, vh)]))
        name = "llvm.x86.avx512.vpdpwssd.512" if n == 16 else "llvm.x86.avx512.vpdpwssd.256"
        if TYPED_VNNI_OPERANDS:
            vh = vector_type(I16, 2 * n)
            return b.call(self._fn(name, vi, [vi, vh, vh]), [acc, b.bitcast(w, vh), b.bitcast(a, vh)])
        return b.call(self._fn(name, vi, [vi, vi, vi]), [acc, w, a])

    def dot4u8s8(self, acc, w_u8, a_s8):
        """acc + sum of the four u8 x s8 byte products of each lane (`vpdpbusd`; on AVX2
        `vpmaddubsw` + `vpmaddwd` by ones, whose i16 pair sums saturate: the caller keeps
        u8 * |s8| * 2 <= 32767, e.g. codes up to 63 against |a| <= 127)."""
        b, n = self.b, self.lanes
        vi = vector_type(I32, n)
        if self.isa == "avx2":
            vb, vh = vector_type(I8, 4 * n), vector_type(I16, 2 * n)
            pairs = b.call(self._fn("llvm.x86.avx2.pmadd.ub.sw", vh, [vb, vb]),
                           [b.bitcast(w_u8, vb), b.bitcast(a_s8, vb)])
            ones = ir.Constant(vh, [1] * (2 * n))
            return b.add(acc, b.call(self._fn("llvm.x86.avx2.pmadd.wd", vi, [vh, vh]), [pairs, ones]))
        name = "llvm.x86.avx512.vpdpbusd.512" if n == 16 else "llvm.x86.avx512.vpdpbusd.256"
        if TYPED_VNNI_OPERANDS:
            vb = vector_type(I8, 4 * n)
            return b.call(self._fn(name, vi, [vi, vb, vb]), [acc, b.bitcast(w_u8, vb), b.bitcast(a_s8, vb)])
        return b.call(self._fn(name, vi, [vi, vi, vi]), [acc, w_u8, a_s8])


# ---------------------------------------------------------------------------------------------
# Activations: float32 rows -> 16-bit codes per 32-value block (layout in the module docstring)
# ---------------------------------------------------------------------------------------------


def activation_words(k: int) -> int:
    """float32 words of one quantized row of k values."""
    return k // 2 + 3 * (k // ACT_BLOCK)


# Position, within a block's 32 int16 slots, of each of its 32 values (value 4j + r goes to slot
# 4j + PAIR_SLOT[r]: word 2j + e pairs values 4j + e and 4j + e + 2).
PAIR_SLOT = (0, 2, 1, 3)


@njit(nogil=True, cache=True)
def _quantize(x, codes, scales, sums, scaled_sums):
    T, K = x.shape
    for t in range(T):
        for b in range(K // 32):
            k0 = 32 * b
            amax = np.float32(0.0)
            for i in range(32):
                a = abs(x[t, k0 + i])
                if a > amax:
                    amax = a
            s = amax / np.float32(32767.0)
            total = 0
            if s > 0:
                for i in range(32):
                    q = int(np.rint(x[t, k0 + i] / s))
                    codes[t, k0 + (i & ~3) + ((i & 1) << 1) + ((i >> 1) & 1)] = q
                    total += q
            else:
                for i in range(32):
                    codes[t, k0 + i] = 0
            scales[t, b] = s
            sums[t, b] = total
            scaled_sums[t, b] = s * np.float32(total)


def quantize_activations(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x (T, K) float32, C-contiguous, K a multiple of 32 -> (T, activation_words(K)) float32 words
    in the layout above. NaN or infinite inputs give undefined codes (as they give NaN in floats)."""
    T, K = x.shape
    if out is None:
        out = np.empty((T, activation_words(K)), dtype=np.float32)
    _quantize_into(x, out)
    return out


# The layouts' views are taken inside these (numba): from Python, each view and slice costs about
# a third of a microsecond, together more than quantizing a decode row (576 values: 0.9 us of 3).
@njit(nogil=True, cache=True)
def _quantize_into(x, out):
    K = x.shape[1]
    h, nb = K // 2, K // ACT_BLOCK
    _quantize(x, out[:, :h].view(np.int16), out[:, h : h + nb], out[:, h + nb : h + 2 * nb].view(np.int32),
              out[:, h + 2 * nb :])


# ---------------------------------------------------------------------------------------------
# Fast mode: int8 activations per 32 values (llama.cpp's Q8_0 activations), for `vpdpbusd`
# ---------------------------------------------------------------------------------------------
#
# Layout of one row of x (K values, nb = K / 32 blocks), float32 words:
#     words [0, K/4)            int8 codes q, four per word, block b's at words 8b..8b+7 in value
#                               order (word 8b + j: values 4j .. 4j+3)
#     words [K/4, K/4 + nb)     float32 s_b = max|x_b| / 127 (0 for an all-zero block)
#     words [+nb, +2nb)         int32 Q_b = sum of block b's codes
#     words [+2nb, +3nb)        float32 sQ_b = s_b * float32(Q_b)
#     words [+3nb, +5nb)        int32 sums of values 0..15 and 16..31 of block b (words 2b, 2b+1)
# q = rint(x / s_b) in float32, |q| <= 127.

FAST_ACT_MAX = 127


def fast_activation_words(k: int) -> int:
    """float32 words of one int8-quantized row of k values."""
    return k // 4 + 5 * (k // ACT_BLOCK)


# One 32-value block of a row as vectors (both quantizers of the prefill's long inputs): the scalar
# loops took ~2 ns a value (numba unrolls the 32-value loops and leaves them scalar), a third of a
# 1B prefill's non-product time. Same operations lane by lane, so the same codes: |x| and its
# maximum (exact), s = amax / qmax (one float32 division), q = rint(x / s) (IEEE division, round to
# nearest even) for each of the 32 values.


def _block_codes(v, x_ptr, qmax):
    """The block at x_ptr (32 float32) -> (s, q_lo, q_hi): s = max|x| / qmax (float32, 0 for a
    block of zeros), q_lo / q_hi the codes of values 0..15 / 16..31 as <16 x i32>."""
    b = v.b
    ft = vector_type(F32, 16)
    lo, hi = v.load(x_ptr, 0, ft), v.load(x_ptr, 64, ft)
    fabs = cgutils.get_or_insert_function(b.module, ir.FunctionType(ft, [ft]), "llvm.fabs.v16f32")
    m = b.call(fabs, [lo])
    m2 = b.call(fabs, [hi])
    amax = v.hmax(b.select(b.fcmp_ordered(">", m2, m), m2, m))
    s = b.fdiv(amax, ir.Constant(F32, float(qmax)))
    # a block of zeros divides by 1 instead of 0: its codes are 0 either way
    d = v.splat(b.select(b.fcmp_ordered(">", s, ir.Constant(F32, 0.0)), s, ir.Constant(F32, 1.0)))
    rint = cgutils.get_or_insert_function(b.module, ir.FunctionType(ft, [ft]), "llvm.rint.v16f32")
    it = vector_type(I32, 16)
    q_lo = b.fptosi(b.call(rint, [b.fdiv(lo, d)]), it)
    q_hi = b.fptosi(b.call(rint, [b.fdiv(hi, d)]), it)
    return s, q_lo, q_hi


def _block_pointers(context, builder, signature, args, out_bytes):
    """(x + k0 floats, out + out_bytes * k0 bytes) as i8* for an intrinsic (x, k0, out)."""
    v = VectorIR(builder)
    k0 = args[1]
    x_at = builder.mul(k0, v.ci(4, None, k0.type))
    out_at = builder.mul(k0, v.ci(out_bytes, None, k0.type))
    return (v.gep(data_pointer(context, builder, signature.args[0], args[0]), x_at),
            v.gep(data_pointer(context, builder, signature.args[2], args[2]), out_at))


def _block_result(context, builder, s, sums):
    return context.make_tuple(builder, types.Tuple((types.float32,) + (types.int32,) * len(sums)), [s] + list(sums))


@intrinsic
def _split_block(typingctx, x, k0, halves):
    """(s, Q_lo, Q_hi, H) of x[k0:k0+32] (1-D float32, C), its hi bytes stored at halves[2 k0 ..
    2 k0 + 31] and its lo bytes after them (1-D uint8, C): the split layout's block."""
    sig = types.Tuple((types.float32, types.int32, types.int32, types.int32))(x, k0, halves)

    def codegen(context, builder, signature, args):
        v = VectorIR(builder)
        xp, hp = _block_pointers(context, builder, signature, args, 2)
        s, q_lo, q_hi = _block_codes(v, xp, 32767)
        bt = vector_type(I8, 16)
        high = []
        for i, q in enumerate((q_lo, q_hi)):
            h = builder.ashr(q, v.ci(8, 16))
            high.append(h)
            v.store(builder.trunc(h, bt), hp, 16 * i, align=1)
            v.store(builder.trunc(q, bt), hp, 32 + 16 * i, align=1)  # q - 256 h: q's low byte
        return _block_result(context, builder, s, [v.isum(q_lo), v.isum(q_hi), v.isum(builder.add(*high))])

    return sig, codegen


@intrinsic
def _int8_block(typingctx, x, k0, codes):
    """(s, Q_lo, Q_hi) of x[k0:k0+32] (1-D float32, C) at 8 bits, its codes stored at
    codes[k0 .. k0+31] (1-D int8, C): the fast layout's block."""
    sig = types.Tuple((types.float32, types.int32, types.int32))(x, k0, codes)

    def codegen(context, builder, signature, args):
        v = VectorIR(builder)
        xp, cp = _block_pointers(context, builder, signature, args, 1)
        s, q_lo, q_hi = _block_codes(v, xp, 127)
        bt = vector_type(I8, 16)
        v.store(builder.trunc(q_lo, bt), cp, 0, align=1)
        v.store(builder.trunc(q_hi, bt), cp, 16, align=1)
        return _block_result(context, builder, s, [v.isum(q_lo), v.isum(q_hi)])

    return sig, codegen


@njit(nogil=True, cache=True)
def _quantize8(x, codes, scales, sums, scaled_sums, half_sums):
    T, K = x.shape
    for t in range(T):
        for b in range(K // 32):
            s, lo, hi = _int8_block(x[t], 32 * b, codes[t])
            scales[t, b] = s
            sums[t, b] = lo + hi
            scaled_sums[t, b] = s * np.float32(lo + hi)
            half_sums[t, 2 * b] = lo
            half_sums[t, 2 * b + 1] = hi


def quantize_activations_fast(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x (T, K) float32, C-contiguous, K a multiple of 32 -> (T, fast_activation_words(K)) float32
    words in the fast layout above."""
    T, K = x.shape
    if out is None:
        out = np.empty((T, fast_activation_words(K)), dtype=np.float32)
    _quantize8_into(x, out)
    return out


@njit(nogil=True, cache=True)
def _quantize8_into(x, out):
    K = x.shape[1]
    h, nb = K // 4, K // ACT_BLOCK
    _quantize8(x, out[:, :h].view(np.int8), out[:, h : h + nb], out[:, h + nb : h + 2 * nb].view(np.int32),
               out[:, h + 2 * nb : h + 3 * nb], out[:, h + 3 * nb :].view(np.int32))


# ---------------------------------------------------------------------------------------------
# The exact activations as two int8 halves, for `vpdpbusd` (VNNI): the same 16-bit codes q
# ---------------------------------------------------------------------------------------------
#
# q = 256 hi + lo, hi = q >> 8 (arithmetic: -128..127), lo = q & 255 (unsigned 0..255). A weight
# code c (unsigned, 0..255 or 0..63) times q is then two u8 x s8 products the instruction makes:
# 256 (c x hi) + (lo x c') with c' the code as a signed byte (every unsigned code the kernels use
# fits one, but Q8_0's signed bytes, which go as they are into the lo product and as c + 128 into
# the hi one, minus 128 sum(hi)). The integer sums are the 16-bit codes' exactly, so a kernel
# reading this layout gives the bits of one reading `quantize_activations`' pairs.
#
# Layout of one row of x (K values, nb = K / 32 blocks), float32 words:
#     words [0, K/2)            block b's 16 words at 16b..16b+15: words 16b..16b+7 the hi bytes
#                               of values 0..31 in value order (word 16b + j: values 4j..4j+3),
#                               words 16b+8..16b+15 the lo bytes the same way
#     words [K/2, K/2 + nb)     float32 s_b, as `quantize_activations`
#     words [+nb, +2nb)         int32 Q_b = sum of block b's codes q
#     words [+2nb, +3nb)        float32 sQ_b = s_b * float32(Q_b)
#     words [+3nb, +5nb)        int32 sums of q over values 0..15 and 16..31 of block b (words 2b, 2b+1)
#     words [+5nb, +6nb)        int32 sum of block b's hi bytes


def split_activation_words(k: int) -> int:
    """float32 words of one row of k values in the hi/lo layout."""
    return k // 2 + 6 * (k // ACT_BLOCK)


@njit(nogil=True, cache=True)
def _quantize_split(x, halves, scales, sums, scaled_sums, half_sums, hi_sums):
    T, K = x.shape
    for t in range(T):
        for b in range(K // 32):
            s, lo_sum, hi_sum, high = _split_block(x[t], 32 * b, halves[t])
            scales[t, b] = s
            sums[t, b] = lo_sum + hi_sum
            scaled_sums[t, b] = s * np.float32(lo_sum + hi_sum)
            half_sums[t, 2 * b] = lo_sum
            half_sums[t, 2 * b + 1] = hi_sum
            hi_sums[t, b] = high


def quantize_activations_split(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x (T, K) float32, C-contiguous, K a multiple of 32 -> (T, split_activation_words(K)) float32
    words in the hi/lo layout above (the codes of `quantize_activations`, split)."""
    T, K = x.shape
    if out is None:
        out = np.empty((T, split_activation_words(K)), dtype=np.float32)
    _quantize_split_into(x, out)
    return out


@njit(nogil=True, cache=True)
def _quantize_split_into(x, out):
    K = x.shape[1]
    h, nb = K // 2, K // ACT_BLOCK
    # the halves as uint8 (lo is unsigned; hi's bytes are its two's complement)
    _quantize_split(x, out[:, :h].view(np.uint8), out[:, h : h + nb], out[:, h + nb : h + 2 * nb].view(np.int32),
                    out[:, h + 2 * nb : h + 3 * nb], out[:, h + 3 * nb : h + 5 * nb].view(np.int32),
                    out[:, h + 5 * nb :].view(np.int32))


def split_activations(words: np.ndarray, k: int):
    """The parts of quantized rows: (codes (T, k) int16 in slot order, s (T, nb), Q (T, nb) int32,
    sQ (T, nb)) as views."""
    h, nb = k // 2, k // ACT_BLOCK
    return (words[:, :h].view(np.int16), words[:, h : h + nb], words[:, h + nb : h + 2 * nb].view(np.int32),
            words[:, h + 2 * nb :])


# `quantize_form`'s quantizer per form (ACTIVATION_FORMS)
_QUANTIZERS = {"pairs": quantize_activations, "split": quantize_activations_split, "fast": quantize_activations_fast}
