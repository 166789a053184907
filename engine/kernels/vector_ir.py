"""The LLVM vector IR both kernel modules write their inner loops in (numba `@intrinsic`s).

`engine.kernels.quant_matvec` (GGUF weight blocks) and `engine.kernels.kv_codes` (packed KV codes)
share this vocabulary: the IR types, `VectorIR` (lane-wise integer and float operations, loads and
stores through i8* pointers, exact float16 -> float32), array and address pointers, and the row
intrinsics built from a block decoder (`make_row_dot`, `make_row_dequantize`; `decode_f16` and
`dequantize_f16_row` for little-endian float16 rows).

numba's disk cache (`cache=True`) keys a compiled function by its own source file only, while the
kernels inline the IR written here. So that an edit to this file recompiles them instead of
loading stale machine code, the cache locators registered at the end of this module serve every
function defined in engine/kernels/ and add this file's content hash (`SHARED_IR_HASH`) to the
source stamp numba compares when it loads a cached kernel.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import FunctionType

from llvmlite import ir
from numba import types
from numba.core import caching, cgutils
from numba.extending import intrinsic

def _target_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with `feature` (numba targets the host CPU unless
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES say otherwise)."""
    from llvmlite import binding
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return f"+{feature}" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME not in (None, "host"):
        return False
    return bool(binding.get_host_cpu_features().get(feature, False))


# float16 -> float32 with the F16C instruction (vcvtph2ps, exact for every bit pattern) when the
# target has it, else by integer operations (`VectorIR.f16`).
_F16C = _target_has("f16c")


def _byte_table_lookup() -> str:
    """How `VectorIR.lookup16` indexes a 16-entry byte table: x86 `pshufb` (SSSE3), arm `tbl`
    (NEON), else "select" (a tree of lane selects, any target)."""
    import platform

    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64") and _target_has("ssse3"):
        return "pshufb"
    if machine in ("arm64", "aarch64") and _target_has("neon"):
        return "tbl"
    return "select"


_BYTE_TABLE_LOOKUP = _byte_table_lookup()

# How `VectorIR.permute16` looks lanes up in a 16-entry float table: "vpermps" (AVX-512F: one
# instruction for 16 lanes, only the low 4 bits of each index used), else None, and the decoders
# convert codes to floats arithmetically instead (`VectorIR.float_tables` says which).
_FLOAT_TABLE_LOOKUP = "vpermps" if _target_has("avx512f") else None

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32 = ir.HalfType(), ir.FloatType()
CONTRACT = ("contract",)
LANES = 16  # lanes of the vectors the decoders produce


# ---------------------------------------------------------------------------------------------
# LLVM IR helpers
# ---------------------------------------------------------------------------------------------


def vector_type(elt, n):
    return ir.VectorType(elt, n)


class VectorIR:
    """Small vector-IR vocabulary over an llvmlite builder. `blk` pointers are i8*."""

    def __init__(self, builder):
        self.b = builder

    # constants / broadcasts
    def ci(self, v, n=None, t=I32):
        return ir.Constant(t if n is None else vector_type(t, n), v if n is None else [v] * n)

    def civ(self, values, t=I32):
        return ir.Constant(vector_type(t, len(values)), list(values))

    def splat(self, s, n=LANES):
        v = ir.Constant(vector_type(s.type, n), ir.Undefined)
        v = self.b.insert_element(v, s, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, v, ir.Constant(vector_type(I32, n), [0] * n))

    # memory
    def gep(self, ptr, off):
        if isinstance(off, int):
            off = ir.Constant(I64, off)
        return self.b.gep(ptr, [off])

    def load(self, ptr, off, ty, align=1):
        p = self.b.bitcast(self.gep(ptr, off), ty.as_pointer())
        return self.b.load(p, align=align)

    def store(self, val, ptr, off, align=4):
        p = self.b.bitcast(self.gep(ptr, off), val.type.as_pointer())
        self.b.store(val, p, align=align)

    def u8(self, blk, off, n=LANES):
        """n bytes as zero-extended i32 lanes."""
        return self.b.zext(self.load(blk, off, vector_type(I8, n)), vector_type(I32, n))

    def s8(self, blk, off, n=LANES):
        return self.b.sext(self.load(blk, off, vector_type(I8, n)), vector_type(I32, n))

    def u8s(self, blk, off):
        """One byte as a zero-extended i32 scalar."""
        return self.b.zext(self.load(blk, off, I8), I32)

    def s8s(self, blk, off):
        return self.b.sext(self.load(blk, off, I8), I32)

    def u16s(self, blk, off):
        return self.b.zext(self.load(blk, off, I16), I32)

    def u32s(self, blk, off):
        return self.load(blk, off, I32)

    # integer lane ops (scalar or vector; int right operands are splatted)
    def _c(self, a, c):
        if isinstance(c, int):
            if isinstance(a.type, ir.VectorType):
                return self.ci(c, a.type.count, a.type.element)
            return self.ci(c, None, a.type)
        return c

    def and_(self, a, c):
        return self.b.and_(a, self._c(a, c))

    def or_(self, a, c):
        return self.b.or_(a, self._c(a, c))

    def shr(self, a, c):
        return self.b.lshr(a, self._c(a, c))

    def shl(self, a, c):
        return self.b.shl(a, self._c(a, c))

    def sub(self, a, c):
        return self.b.sub(a, self._c(a, c))

    def add(self, a, c):
        return self.b.add(a, self._c(a, c))

    def lookup16(self, table, idx):
        """table[idx] lane by lane: `table` 16 constant int8 values, idx <16 x i8> with every lane
        in 0..15 -> <16 x i8> (a nonlinear 4-bit code book, as IQ4_NL's)."""
        b = self.b
        vt = vector_type(I8, 16)
        assert idx.type == vt and len(table) == 16
        consts = [ir.Constant(I8, t & 0xFF) for t in table]
        if _BYTE_TABLE_LOOKUP in ("pshufb", "tbl"):
            name = "llvm.x86.ssse3.pshuf.b.128" if _BYTE_TABLE_LOOKUP == "pshufb" else "llvm.aarch64.neon.tbl1.v16i8"
            fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(vt, [vt, vt]), name)
            return b.call(fn, [ir.Constant(vt, consts), idx])
        # select tree: level k keeps, per lane, the half of the candidates its index bit k picks
        cands = [ir.Constant(vt, [c] * 16) for c in consts]
        for bit in range(4):
            on = b.icmp_unsigned("!=", self.and_(idx, 1 << bit), self.ci(0, 16, I8))
            cands = [b.select(on, cands[2 * i + 1], cands[2 * i]) for i in range(len(cands) // 2)]
        return cands[0]

    @property
    def float_tables(self) -> bool:
        """Whether `permute16` is one instruction here (decoders then build a block's 16 possible
        values once and look codes up in them, instead of converting and scaling every code)."""
        return _FLOAT_TABLE_LOOKUP == "vpermps"

    def permute16(self, table, idx):
        """table[idx & 15] lane by lane: table <16 x float>, idx <16 x i32> (only the low 4 bits
        are read: a byte of two nibbles indexes by its low nibble without a mask). AVX-512F only
        (`float_tables`)."""
        assert _FLOAT_TABLE_LOOKUP == "vpermps"
        ft, it = vector_type(F32, 16), vector_type(I32, 16)
        assert table.type == ft and idx.type == it
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ft, [ft, it]),
                                            "llvm.x86.avx512.permvar.sf.512")
        return self.b.call(fn, [table, idx])

    def cfv(self, values):
        """A constant float32 vector."""
        return ir.Constant(vector_type(F32, len(values)), [float(x) for x in values])

    # conversions
    def sf(self, a):
        """Signed integer lanes -> float32 (exact: |a| < 2**24)."""
        t = vector_type(F32, a.type.count) if isinstance(a.type, ir.VectorType) else F32
        return self.b.sitofp(a, t)

    def f16(self, h):
        """float16 bit patterns (i32 lanes, 0..65535) -> float32, exactly, by integer operations:
        normal numbers rebias the exponent, subnormals are mantissa * 2**-24 (exact in float32),
        infinities / NaNs keep an all-ones exponent and their payload."""
        b = self.b
        vec = isinstance(h.type, ir.VectorType)
        n = h.type.count if vec else None
        if _F16C:
            h16 = b.trunc(h, vector_type(I16, n) if vec else I16)
            return b.fpext(b.bitcast(h16, vector_type(F16, n) if vec else F16), vector_type(F32, n) if vec else F32)
        em = self.and_(h, 0x7FFF)
        r = self.add(self.shl(em, 13), 112 << 23)
        r_inf = self.add(r, 112 << 23)
        ft = vector_type(F32, n) if vec else F32
        two_m24 = ir.Constant(ft, [2.0**-24] * n) if vec else ir.Constant(F32, 2.0**-24)
        r_sub = b.bitcast(b.fmul(b.sitofp(em, ft), two_m24), h.type)
        r = b.select(b.icmp_unsigned(">=", em, self._c(em, 0x7C00)), r_inf, r)
        r = b.select(b.icmp_unsigned("<", em, self._c(em, 0x0400)), r_sub, r)
        r = b.or_(r, self.shl(self.and_(h, 0x8000), 16))
        return b.bitcast(r, ft)

    # float lane ops. The products the decoders form (float16 scale x small integer, at most 24
    # significant bits) are exact in float32, so letting LLVM fuse `d*q + m` into an FMA
    # (`contract`) gives the same single rounding as gguf's separate multiply and add.
    def fmul(self, a, s):
        if not isinstance(s.type, ir.VectorType) and isinstance(a.type, ir.VectorType):
            s = self.splat(s, a.type.count)
        return self.b.fmul(s, a, flags=CONTRACT)

    def fadd(self, a, s):
        if not isinstance(s.type, ir.VectorType) and isinstance(a.type, ir.VectorType):
            s = self.splat(s, a.type.count)
        return self.b.fadd(a, s, flags=CONTRACT)

    def fsub(self, a, s):
        if not isinstance(s.type, ir.VectorType) and isinstance(a.type, ir.VectorType):
            s = self.splat(s, a.type.count)
        return self.b.fsub(a, s, flags=CONTRACT)

    def lo16(self, v):
        return self.b.shuffle_vector(v, v, self.civ(range(16)))

    def hi16(self, v):
        return self.b.shuffle_vector(v, v, self.civ(range(16, 32)))

    def _lanes_tree(self, v, combine):
        """combine(low half, high half) down to one lane (a pairwise tree over the lanes)."""
        n = v.type.count
        while n > 1:
            h = n // 2
            a = self.b.shuffle_vector(v, v, self.civ(range(h)))
            c = self.b.shuffle_vector(v, v, self.civ(range(h, n)))
            v = combine(a, c)
            n = h
        return self.b.extract_element(v, ir.Constant(I32, 0))

    def hsum(self, v):
        """Sum of the lanes of a float vector (pairwise tree)."""
        return self._lanes_tree(v, self.b.fadd)

    def isum(self, v):
        """Sum of the lanes of an integer vector."""
        return self._lanes_tree(v, self.b.add)

    def hmax(self, v):
        """The largest lane of a float vector (exact in any order; NaN lanes are passed over)."""
        return self._lanes_tree(v, lambda a, c: self.b.select(self.b.fcmp_ordered(">", c, a), c, a))

    def transpose_sum(self, vecs):
        """16 <16 x float> -> one <16 x float> whose lane t is the sum of vecs[t]'s lanes: four
        levels of pairing, each adding the low and high halves of every vector's partial sums (45
        shuffles and adds for 16 sums, where one `hsum` each takes 13)."""
        b = self.b
        width = 16  # partial sums per input vector at this level
        while len(vecs) > 1:
            per_vec = 16 // width  # inputs summarized in each vector
            lo, hi = [], []
            for src in (0, 16):  # lanes of the first, then the second vector of the pair
                for j in range(per_vec):
                    lo += [src + j * width + i for i in range(width // 2)]
                    hi += [src + j * width + width // 2 + i for i in range(width // 2)]
            vecs = [b.fadd(b.shuffle_vector(x, y, self.civ(lo)), b.shuffle_vector(x, y, self.civ(hi)))
                    for x, y in zip(vecs[0::2], vecs[1::2])]
            width //= 2
        return vecs[0]


# ---------------------------------------------------------------------------------------------
# Pointers: array data as i8*, addresses (int64) and back to typed pointers
# ---------------------------------------------------------------------------------------------


def data_pointer(context, builder, aty, aval):
    """The data of the array argument `aval` (numba type `aty`) as an i8* (inside a codegen)."""
    return builder.bitcast(context.make_array(aty)(context, builder, aval).data, I8.as_pointer())


@intrinsic
def address_of(typingctx, arr):
    """The address of an array's data as an int64 (to pass arrays by address)."""
    sig = types.int64(arr)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, I64)

    return sig, codegen


def _pointer_from_address(numba_type, ir_type):
    """Intrinsic: an int64 address as a pointer to `numba_type` values (for numba.carray)."""

    @intrinsic
    def pointer(typingctx, addr):
        sig = types.CPointer(numba_type)(addr)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], ir_type.as_pointer())

        return sig, codegen

    return pointer


u8_pointer = _pointer_from_address(types.uint8, I8)
f32_pointer = _pointer_from_address(types.float32, F32)
i64_pointer = _pointer_from_address(types.int64, I64)


# ---------------------------------------------------------------------------------------------
# Row intrinsics over a block decoder: (VectorIR, blk) -> list of <LANES x float>, in row order
# ---------------------------------------------------------------------------------------------


def for_each_block(context, builder, signature, args, decoder, bs, ts, each):
    """The loop both intrinsics share: over the blocks of a row (args[0], 1-D uint8), as many as
    the float32 array args[1] (1-D, C) holds values; calls each(v, i, w, fp) for the i-th decoded
    <16 x float> vector w of a block, fp pointing at that block's first float of args[1]."""
    v = VectorIR(builder)
    sp = data_pointer(context, builder, signature.args[0], args[0])
    fp0 = data_pointer(context, builder, signature.args[1], args[1])
    farr = context.make_array(signature.args[1])(context, builder, args[1])
    n_blocks = builder.sdiv(cgutils.unpack_tuple(builder, farr.shape, 1)[0], ir.Constant(I64, bs))
    with cgutils.for_range(builder, n_blocks) as loop:
        blk = v.gep(sp, builder.mul(loop.index, ir.Constant(I64, ts)))
        fp = v.gep(fp0, builder.mul(loop.index, ir.Constant(I64, 4 * bs)))
        prefetch_ahead(builder, blk)
        for i, w in enumerate(decoder(v, blk)):
            each(v, i, w, fp)
    return v


# Bytes past the block being decoded that the row kernels ask the CPU to fetch into cache. A
# matvec streams its matrix once, row after row; on this project's test machines (2-core VMs) the
# hardware prefetchers alone kept a 1B model's decode at ~60% of the memory bandwidth llama.cpp
# reaches. Measured on 1B-shaped Q4_0 / Q8_0 files and SmolLM2 (tok/s, decode): no hint 11.3 /
# 9.6 / ~50; 1 KiB ahead 16 / 11.9; 4 KiB 18-21 / 13-17 / 60-79; 8-16 KiB no better than 4 KiB.
# A constant (not a setting): numba's disk cache keys the kernels by this file's source only.
WEIGHT_PREFETCH_BYTES = 4096


def prefetch_ahead(builder, blk):
    """Prefetch (read, into every cache level) the line WEIGHT_PREFETCH_BYTES past blk. Issued once
    per block, so a line is asked for 1-8 times (prefetches of a line already on its way are
    cheap); a prefetch never faults, past the end of the matrix included."""
    ptr_t = I8.as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ptr_t, I32, I32, I32]),
                                        "llvm.prefetch.p0i8")
    at = builder.gep(blk, [ir.Constant(I64, WEIGHT_PREFETCH_BYTES)])
    builder.call(fn, [at, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def make_row_dot(decoder, bs, ts):
    """Intrinsic dot(src, x) -> float32: src a row's blocks (1-D uint8), x (1-D float32, C)."""

    @intrinsic
    def dot(typingctx, src, x):
        sig = types.float32(src, x)

        def codegen(context, builder, signature, args):
            vf = vector_type(F32, LANES)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * LANES)) for _ in range(2)]

            def accumulate(v, i, w, xb):
                xv = v.load(xb, 4 * LANES * i, vf, align=4)
                acc = accs[i % 2]
                prod = builder.fmul(xv, w, flags=CONTRACT)
                builder.store(builder.fadd(builder.load(acc), prod, flags=CONTRACT), acc)

            v = for_each_block(context, builder, signature, args, decoder, bs, ts, accumulate)
            return v.hsum(builder.fadd(builder.load(accs[0]), builder.load(accs[1])))

        return sig, codegen

    return dot


def make_rows_dot_part(decoder, bs, ts, n):
    """Intrinsic part(src, x, t0, b0, b1, acc) -> n float32s: blocks b0..b1-1 of one row src (1-D
    uint8) against rows t0..t0+n-1 of x (2-D float32, C; the caller keeps t0 + n <= rows of x and
    b1 <= the row's blocks), accumulated into acc (1-D float32, >= n*2*16: per x row the two
    <16 x float> accumulators of `make_row_dot`; zeros when b0 == 0, else loaded from acc; stored
    back at the end). Returns the n dot products so far: after a row's last tile, its results.

    Each block is decoded once for all n rows of x (a batch's decode step reads and decodes the
    weights once, not once per sequence). A caller runs a row's blocks in order over one or more
    calls (the K dimension in tiles, so that n rows' slice of x stays in the core's L1 cache while
    a group of weight rows streams past it); the accumulators see the same products in the same order as `make_row_dot`'s, so every result is bit-identical to
    `dot(src, x[t0 + j])` — a sequence's logits do not depend on the batch it runs in."""

    @intrinsic
    def part(typingctx, src, x, t0, b0, b1, acc):
        sig = types.UniTuple(types.float32, n)(src, x, t0, b0, b1, acc)

        def codegen(context, builder, signature, args):
            v = VectorIR(builder)
            vf = vector_type(F32, LANES)
            sp = data_pointer(context, builder, signature.args[0], args[0])
            xarr = context.make_array(signature.args[1])(context, builder, args[1])
            k_values = cgutils.unpack_tuple(builder, xarr.shape, 2)[1]
            xp = builder.bitcast(xarr.data, I8.as_pointer())
            row_bytes = builder.mul(k_values, ir.Constant(I64, 4))
            t0, b0, b1 = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (2, 3, 4))
            x_rows = [v.gep(xp, builder.mul(builder.add(t0, ir.Constant(I64, j)), row_bytes)) for j in range(n)]
            ap = data_pointer(context, builder, signature.args[5], args[5])
            # the accumulators live in registers (allocas LLVM promotes) for the whole call: zeros
            # for a row's first tile (b0 == 0), else the state acc holds
            first = builder.icmp_signed("==", b0, ir.Constant(I64, 0))
            zero = ir.Constant(vf, [0.0] * LANES)
            accs = [[cgutils.alloca_once_value(
                builder, builder.select(first, zero, v.load(ap, 4 * LANES * (2 * j + a), vf, align=4)))
                for a in range(2)] for j in range(n)]
            with cgutils.for_range_slice(builder, b0, b1, ir.Constant(I64, 1), inc=True) as (index, _):
                blk = v.gep(sp, builder.mul(index, ir.Constant(I64, ts)))
                x_off = builder.mul(index, ir.Constant(I64, 4 * bs))
                prefetch_ahead(builder, blk)
                for i, w in enumerate(decoder(v, blk)):
                    for j in range(n):
                        xv = v.load(v.gep(x_rows[j], x_off), 4 * LANES * i, vf, align=4)
                        acc = accs[j][i % 2]
                        prod = builder.fmul(xv, w, flags=CONTRACT)
                        builder.store(builder.fadd(builder.load(acc), prod, flags=CONTRACT), acc)
            for j in range(n):
                for a in range(2):
                    v.store(builder.load(accs[j][a]), ap, 4 * LANES * (2 * j + a))
            sums = [v.hsum(builder.fadd(builder.load(a0), builder.load(a1))) for a0, a1 in accs]
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    return part


ACC_VALUES = 2 * LANES  # floats of accumulator state per row of x (`make_rows_dot_part`)


def make_row_dequantize(decoder, bs, ts):
    """Intrinsic deq(src, out): out (1-D float32, C) = the dequantized row src."""

    @intrinsic
    def deq(typingctx, src, out):
        sig = types.void(src, out)

        def codegen(context, builder, signature, args):
            for_each_block(context, builder, signature, args, decoder, bs, ts,
                           lambda v, i, w, ob: v.store(w, ob, 4 * LANES * i))
            return context.get_dummy_value()

        return sig, codegen

    return deq


def decode_f16(v, blk):
    """16 little-endian float16 values at blk -> one <16 x float>, exactly."""
    h = v.b.zext(v.load(blk, 0, vector_type(I16, LANES)), vector_type(I32, LANES))
    return [v.f16(h)]


# little-endian float16 rows (1-D uint8, 2 bytes per value) -> float32, 16 values at a time
dequantize_f16_row = make_row_dequantize(decode_f16, 16, 32)


def kernel_copy(template, namespace: dict, name: str, renames: dict):
    """`template` as the function `name` of the module whose globals are `namespace` (and stored
    there), the global names its code reads renamed by `renames`: the same bytecode under its own
    qualified name, which numba's disk cache files each kernel by. How the kernel modules make one
    kernel per weight type (or type and instruction set) from one written function."""
    code = template.__code__
    code = code.replace(co_name=name, co_qualname=name, co_names=tuple(renames.get(n, n) for n in code.co_names))
    fn = FunctionType(code, namespace, name)
    namespace[name] = fn
    return fn


# ---------------------------------------------------------------------------------------------
# numba's disk cache: kernels in engine/kernels/ also depend on this file
# ---------------------------------------------------------------------------------------------



def _source_hash() -> str:
    """sha256 of this file's source; empty when it is not on disk (a frozen app, whose cache stamp
    numba takes from the executable instead, which changes with every build)."""
    try:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    except OSError:
        return ""


SHARED_IR_HASH = _source_hash()
_KERNELS_DIR = Path(__file__).resolve().parent


class _DependsOnSharedIR:
    """Cache-locator mixin: takes only functions defined in engine/kernels/ (numba's own locators
    serve everything else) and adds `SHARED_IR_HASH` to their source stamp."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if Path(py_file).resolve().parent != _KERNELS_DIR:
            return None
        return super().from_function(py_func, py_file)

    def get_source_stamp(self):
        return (super().get_source_stamp(), SHARED_IR_HASH)


def _numba_caching(name: str) -> type:
    """numba's caching class `name` (public in recent numba, with a leading underscore before)."""
    return getattr(caching, name, None) or getattr(caching, "_" + name)


# in the order of numba's own list: NUMBA_CACHE_DIR if set, else __pycache__ next to the source if
# writable, else the user-wide cache folder
_LOCATORS = [
    type(f"SharedIR{name}", (_DependsOnSharedIR, _numba_caching(name)), {"__module__": __name__})
    for name in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
]
_locator_classes = _numba_caching("CacheImpl")._locator_classes  # the list every cached function's locator comes from
_locator_classes[:] = _LOCATORS + [cls for cls in _locator_classes if not issubclass(cls, _DependsOnSharedIR)]
