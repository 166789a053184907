"""Integer weight kernels (engine.kernels.int_matvec): every instruction set this CPU can run,
forced in turn, bit-equal to the numpy emulation of their arithmetic (engine.kernels.int_reference)
and within 1e-4 of the float64 product (relative to sum |x| |w|, the scale of a dot product)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize

from engine.kernels import int_dot, int_matvec, int_reference

from .weight_blocks import blocks

INT_ISAS = [i for i in int_dot.ISA_LANES if int_dot.isa_available(i)]
TYPES = list(int_matvec.INT_TYPES)

pytestmark = pytest.mark.skipif(not INT_ISAS, reason="no x86 integer instruction set on this CPU")


def activations(T, K, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[:, 64:96] *= 1000.0  # a block of large values
    x[:, 96:128] = 0.0  # an all-zero block
    x[:, 128:160] *= 1e-6  # tiny values
    x[0, 5] = 40.0  # an outlier inside a block
    return x


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def run(qtype, raw, x, isa, fast=False):
    mv = int_matvec.IntMatvec(qtype, raw, x.shape[1], isa)
    return mv(np.ascontiguousarray(x), np.empty((x.shape[0], raw.shape[0]), np.float32), fast)


@pytest.mark.parametrize("isa", INT_ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernels_equal_the_integer_emulation_and_the_float64_product(qtype, isa):
    raw = blocks(qtype, 48, 512)
    x = activations(7, 512)
    y = run(qtype, raw, x, isa)
    assert np.array_equal(bits(y), bits(int_reference.matvec(raw, qtype, x)))
    w = dequantize(raw, qtype).astype(np.float64).reshape(48, 512)
    exact = x.astype(np.float64) @ w.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(w).T
    assert np.all(np.abs(y - exact) <= 1e-4 * scale + 1e-30)


@pytest.mark.parametrize("isa", INT_ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fast_kernels_equal_their_emulation_at_int8_accuracy(qtype, isa):
    """Fast mode (int8 activations): bit-equal to its emulation, within the 8-bit rounding of
    the activations (1/254 of a block's largest value) of the float64 product, and not the
    exact kernels' results (the mode really changes the arithmetic)."""
    raw = blocks(qtype, 48, 512)
    x = activations(7, 512)
    y = run(qtype, raw, x, isa, fast=True)
    assert np.array_equal(bits(y), bits(int_reference.matvec(raw, qtype, x, fast=True)))
    w = dequantize(raw, qtype).astype(np.float64).reshape(48, 512)
    exact = x.astype(np.float64) @ w.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(w).T
    assert np.all(np.abs(y - exact) <= 1e-2 * scale + 1e-30)
    assert not np.array_equal(bits(y), bits(run(qtype, raw, x, isa)))


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_amx_tiles_equal_the_integer_emulation(qtype, fast, monkeypatch):
    """16 rows of x at a time by AMX tiles (the rest by VNNI): 16, 17 and 33 rows (codes decoded
    block by block below the type's `amx_decode_once_rows`), 49 and 80 (decoded once per weight
    group), 12 and 46 (the last 12 and 14 rows as a tile with zero rows below them,
    AMX_PAD_FROM), 302 (slices of AMX_SLICE_ROWS; its last 14 rows on VNNI, as padding is for
    inputs of one slice), K with an odd number of 32-value blocks (the tiles take blocks in pairs),
    bit-equal to the emulation; and the AMX kernel really ran (its compute function was made for
    the type)."""
    if "avx512amx" not in INT_ISAS:
        pytest.skip("no AMX-INT8 tiles granted to this process")
    K = 256 * 3 if int_matvec.INT_TYPES[qtype].values == 256 else 32 * 25
    raw = blocks(qtype, 32, K, seed=5)
    mv = int_matvec.IntMatvec(qtype, raw, K, "avx512amx")
    assert 16 <= int_matvec.amx_decode_once_rows(int_matvec.INT_TYPES[qtype]) <= 48
    assert 0 < int_matvec.AMX_PAD_FROM < 16
    assert int_matvec.AMX_SLICE_ROWS % 16 == 0 and int_matvec.AMX_SLICE_ROWS < 302
    for T in (12, 16, 17, 33, 46, 49, 80, 302):
        x = activations(T, K, seed=T)
        y = mv(x, np.empty((T, 32), np.float32), fast)
        assert np.array_equal(bits(y), bits(int_reference.matvec(raw, qtype, x, fast=fast))), T
    # an output too big to copy padded (AMX_PAD_MAX_BYTES): the last 14 rows on VNNI instead
    monkeypatch.setattr(int_matvec, "AMX_PAD_MAX_BYTES", 0)
    x = activations(46, K, seed=46)
    y = mv(x, np.empty((46, 32), np.float32), fast)
    assert np.array_equal(bits(y), bits(int_reference.matvec(raw, qtype, x, fast=fast)))
    assert mv.amx == {fast: int_matvec.amx_compute_address(qtype, fast)}


def test_amx_waits_for_its_background_group_on_the_vnni_kernels(monkeypatch):
    """While a type's AMX kernels are compiling in the background its long products take the
    VNNI kernels (the same bits) and are counted as fallbacks; once ready, the tiles."""
    if "avx512amx" not in INT_ISAS:
        pytest.skip("no AMX-INT8 tiles granted to this process")
    from engine.kernels import background

    group = int_matvec.amx_group(QT.Q4_K)
    counted = []
    monkeypatch.setattr(background, "pending", lambda name: name == group)
    monkeypatch.setattr(background, "count_fallback", counted.append)
    raw = blocks(QT.Q4_K, 48, 512, seed=6)
    x = activations(20, 512, seed=7)
    mv = int_matvec.IntMatvec(QT.Q4_K, raw, 512, "avx512amx")
    y = mv(x, np.empty((20, 48), np.float32))
    assert mv.amx == {} and counted == [group]
    assert np.array_equal(bits(y), bits(run(QT.Q4_K, raw, x, "avx512vnni")))
    monkeypatch.setattr(background, "pending", lambda name: False)
    assert np.array_equal(bits(mv(x, np.empty((20, 48), np.float32))), bits(y)) and False in mv.amx


def test_amx_kernels_are_made_for_every_type_and_mode():
    """Each (type, exact or fast) has its own AMX row loop and compute function in int_matvec's
    file, and a background group whose probe is that row loop."""
    names = set()
    for tt in int_matvec.INT_TYPES:
        for fast in (False, True):
            loop, compute = int_matvec._ROWS_AMX[tt, fast].py_func, int_matvec._COMPUTE_AMX_PY[tt, fast]
            for fn in (loop, compute):
                assert fn.__code__.co_filename == int_matvec.__file__ and fn.__qualname__ not in names
                names.add(fn.__qualname__)
            assert getattr(int_matvec, compute.__code__.co_names[0]) is int_matvec._ROWS_AMX[tt, fast]
        target, probes = int_matvec._AMX_WARM[tt]
        module, _, function = target.partition(":")
        assert module == int_matvec.__name__ and callable(getattr(int_matvec, function))
        assert probes == [f"{int_matvec.__name__}:{int_matvec._ROWS_AMX[tt, False].py_func.__qualname__}"]


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("isa", INT_ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_in_a_batch_equals_the_row_alone(qtype, isa, fast):
    raw = blocks(qtype, 32, 256, seed=3)
    x = activations(64, 256, seed=4)
    alone = np.concatenate([run(qtype, raw, x[i : i + 1], isa, fast) for i in range(64)])
    for n in range(1, 65):
        assert np.array_equal(bits(run(qtype, raw, x[:n], isa, fast)), bits(alone[:n])), n


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_every_instruction_set_gives_the_same_bits(qtype, fast):
    raw = blocks(qtype, 64, 1024, seed=5)
    x = activations(5, 1024, seed=6)
    ys = [run(qtype, raw, x, isa, fast) for isa in INT_ISAS]
    for y in ys[1:]:
        assert np.array_equal(bits(y), bits(ys[0]))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_repacking_round_trips(qtype):
    raw = blocks(qtype, 48, 256, seed=7)
    packed = int_matvec.repack(raw, qtype)
    assert packed.shape == raw.shape
    assert np.array_equal(int_matvec.unpack_rows(packed, qtype, np.arange(48)), raw)
    ids = np.array([47, 0, 17, 17, 31])
    assert np.array_equal(int_matvec.unpack_rows(packed, qtype, ids), raw[ids])
    for start, stop in ((0, 48), (16, 48), (0, 16), (16, 32), (5, 40)):  # whole groups, and not
        assert np.array_equal(int_matvec.unpack_range(packed, qtype, start, stop), raw[start:stop])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_long_prompts_past_the_integer_rows_take_float_tiles_of_the_same_matrix(qtype, monkeypatch):
    """Where an instruction set caps the integer kernels' rows (INT_MAX_ROWS: AVX2, whose sgemm
    is faster at prompt lengths), longer inputs are dequantized tiles of the repacked copy (the
    file's blocks are gone) and BLAS: the float path's product, to float32 rounding."""
    from engine import weights

    monkeypatch.setitem(int_dot.INT_MAX_ROWS, int_dot.kernel_isa(), 8)
    raw = blocks(qtype, 48, 256, seed=9)
    lin = weights.QuantLinear(raw.copy(), qtype, 48, 256, arith="int")
    assert lin._int is not None and lin.int_max_rows == 8
    x = activations(40, 256, seed=10)
    w = dequantize(raw, qtype).reshape(48, 256).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T + 1e-30
    long = lin(x)  # 40 rows > 8: tiles and BLAS
    assert np.max(np.abs(long - want) / scale) < 1e-5
    assert lin.tile_rows % int_matvec.GROUP == 0  # tiles in whole groups (strided unpacking)
    tile = np.empty((48, 256), np.float32)
    lin._dequantize(0, 48, tile)
    assert np.array_equal(tile, dequantize(raw, qtype).reshape(48, 256).astype(np.float32))
    # a tile past PARALLEL_DEQUANTIZE_ROWS: its halves (whole groups) dequantized on two threads
    big_raw = blocks(qtype, 528, 256, seed=11)
    big = weights.QuantLinear(big_raw.copy(), qtype, 528, 256, arith="int")
    big_tile = np.empty((528, 256), np.float32)
    big._dequantize(0, 528, big_tile)
    assert np.array_equal(big_tile, dequantize(big_raw, qtype).reshape(528, 256).astype(np.float32))
    short = lin(x[:8])  # the integer kernels, as alone
    assert np.array_equal(bits(short), bits(run(qtype, raw, x[:8], int_dot.kernel_isa())))


def test_fast_activation_quantizer_matches_its_emulation():
    x = activations(3, 256, seed=8)
    words = int_dot.quantize_activations_fast(x)
    h, nb = 256 // 4, 256 // 32
    q_ref, s_ref, Q_ref, sQ_ref = int_reference.quantize_activations(x, fast=True)
    assert np.array_equal(words[:, :h].view(np.int8).astype(np.int64), q_ref)
    assert np.array_equal(bits(words[:, h : h + nb]), bits(s_ref))
    assert np.array_equal(words[:, h + nb : h + 2 * nb].view(np.int32), Q_ref)
    assert np.array_equal(bits(words[:, h + 2 * nb : h + 3 * nb]), bits(sQ_ref))
    halves = words[:, h + 3 * nb :].view(np.int32)
    assert np.array_equal(halves, q_ref.reshape(3, 16, 16).sum(-1))
    assert np.abs(q_ref).max() == int_dot.FAST_ACT_MAX and np.all(q_ref[:, 96:128] == 0)


def test_activation_quantizer_matches_its_emulation():
    x = activations(3, 256, seed=8)
    words = int_dot.quantize_activations(x)
    codes, s, Q, sQ = int_dot.split_activations(words, 256)
    q_ref, s_ref, Q_ref, sQ_ref = int_reference.quantize_activations(x)
    slots = np.array([4 * (v // 4) + int_dot.PAIR_SLOT[v % 4] for v in range(32)])
    order = (np.arange(8)[:, None] * 32 + slots[None, :]).reshape(-1)
    assert np.array_equal(codes[:, order].astype(np.int64), q_ref)
    assert np.array_equal(bits(s), bits(s_ref)) and np.array_equal(Q, Q_ref) and np.array_equal(bits(sQ), bits(sQ_ref))
    assert np.abs(q_ref).max() == int_dot.ACT_MAX
    assert np.all(q_ref[:, 96:128] == 0)


def test_vector_quantizers_match_the_emulation_on_long_rows_and_edge_values():
    """The split (16-bit) and fast (int8) quantizers read each 32-value block as vectors; their codes,
    scales and sums must be the emulation's for every block: rows of 4,096 values of mixed scale,
    a block of zeros, one of -0.0, a subnormal, an outlier, values tied for the maximum with
    opposite signs, and halves that round to even."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((40, 4096)) * rng.exponential(2.0, (40, 1))).astype(np.float32)
    x[2, 64:96] = 0.0
    x[9, 0:32] = -0.0
    x[11, 40] = 3e-39  # subnormal
    x[7, 5] = -1e4  # an outlier: the rest of its block rounds to few codes
    x[13, 32:64] = np.where(np.arange(32) % 2, 8.0, -8.0)  # the maximum, both signs
    x[15, 64:96] = np.arange(32) * np.float32(0.5) / 31  # many codes at .5 boundaries
    nb = 4096 // 32
    for fast in (False, True):
        q_ref, s_ref, Q_ref, sQ_ref = int_reference.quantize_activations(x, fast=fast)
        if fast:
            words, h = int_dot.quantize_activations_fast(x), 4096 // 4
            codes = words[:, :h].view(np.int8).astype(np.int64)
        else:
            words, h = int_dot.quantize_activations_split(x), 4096 // 2
            halves = words[:, :h].view(np.uint8).reshape(40, nb, 2, 32)
            codes = (256 * halves[:, :, 0].view(np.int8).astype(np.int64) + halves[:, :, 1]).reshape(40, 4096)
        assert np.array_equal(codes, q_ref), fast
        assert np.array_equal(bits(words[:, h : h + nb]), bits(s_ref)), fast
        assert np.array_equal(words[:, h + nb : h + 2 * nb].view(np.int32), Q_ref), fast
        assert np.array_equal(bits(words[:, h + 2 * nb : h + 3 * nb]), bits(sQ_ref)), fast
    assert np.all(q_ref[2, 64:96] == 0) and np.all(q_ref[9, :32] == 0) and np.abs(q_ref[13, 32:64]).min() == 127


def test_split_activations_are_the_16_bit_codes_as_hi_and_lo_bytes():
    """The VNNI kernels' exact activations (`EXACT_FORM` "split"): q = 256 hi + lo per value,
    hi signed and lo unsigned bytes, with the pairs' scales and sums, the half sums and sum(hi)."""
    x = activations(3, 256, seed=8)
    words = int_dot.quantize_activations_split(x)
    assert words.shape == (3, int_dot.split_activation_words(256)) == (3, int_dot.form_words("split", 256))
    h, nb = 256 // 2, 256 // 32
    q_ref, s_ref, Q_ref, sQ_ref = int_reference.quantize_activations(x)
    halves = words[:, :h].view(np.uint8).reshape(3, nb, 2, 32)
    hi, lo = halves[:, :, 0].view(np.int8).astype(np.int64), halves[:, :, 1].astype(np.int64)
    assert np.array_equal((256 * hi + lo).reshape(3, 256), q_ref)
    assert hi.min() >= -128 and hi.max() <= 127 and lo.min() >= 0 and lo.max() <= 255
    assert np.array_equal(bits(words[:, h : h + nb]), bits(s_ref))
    assert np.array_equal(words[:, h + nb : h + 2 * nb].view(np.int32), Q_ref)
    assert np.array_equal(bits(words[:, h + 2 * nb : h + 3 * nb]), bits(sQ_ref))
    assert np.array_equal(words[:, h + 3 * nb : h + 5 * nb].view(np.int32), q_ref.reshape(3, 16, 16).sum(-1))
    assert np.array_equal(words[:, h + 5 * nb :].view(np.int32), hi.sum(-1))
    assert np.abs(q_ref).max() == int_dot.ACT_MAX  # the extremes (hi = 127, -128) are in the test
    assert {int_dot.activation_form(isa, False) for isa in INT_ISAS} <= {"split", "pairs"}
    assert all(int_dot.activation_form(isa, True) == "fast" for isa in INT_ISAS)


def test_kernels_are_made_for_every_declared_type_and_instruction_set():
    """`INT_TYPES` and `int_dot.ISA_LANES` are the only lists: each (type, instruction set, mode)
    has a row loop calling its own intrinsics and a compute function calling that loop, functions
    of int_matvec's own file under their own names (numba's cache files them by file and name)."""
    want = {(t, isa) for t in int_matvec.INT_TYPES for isa in int_dot.ISA_LANES}
    names = set()
    for computes, rows, gdots in ((int_matvec._COMPUTE_PY, int_matvec._ROWS, int_matvec._GDOT),
                                  (int_matvec._COMPUTE_FAST_PY, int_matvec._ROWS_FAST, int_matvec._GDOT_FAST)):
        assert set(computes) == set(rows) == want
        for key in want:
            loop, compute = rows[key].py_func, computes[key]
            for fn in (loop, compute):
                assert fn.__code__.co_filename == int_matvec.__file__ and fn.__globals__ is vars(int_matvec)
                assert getattr(int_matvec, fn.__qualname__) in (fn, rows[key]) and fn.__qualname__ not in names
                names.add(fn.__qualname__)
            called = [getattr(int_matvec, n) for n in loop.__code__.co_names if n.startswith(("_g_", "_f_"))]
            assert called == [gdots[(*key, n)] for n in int_matvec.X_TILES[key[1]]]
            assert getattr(int_matvec, compute.__code__.co_names[0]) is rows[key]


@pytest.mark.parametrize("isa", INT_ISAS)
def test_assembly_uses_the_integer_instructions(isa):
    packed = int_matvec.repack(blocks(QT.Q4_0, 16, 64), QT.Q4_0)
    from numba import njit

    fn = njit(int_matvec._ROWS[QT.Q4_0, isa].py_func)  # a fresh compilation (cached code has no assembly)
    xw = int_dot.quantize_form(np.ones((1, 64), np.float32), int_dot.activation_form(isa, False))
    fn(packed, xw, np.empty((1, 16), np.float32), 0, 16, 0)
    asm = "\n".join(fn.inspect_asm(sig) for sig in fn.signatures)
    # (on a CPU with VNNI, LLVM fuses the AVX2 path's vpmaddwd + vpaddd into one vpdpwssd ymm)
    avx2 = r"vpmaddwd" if not int_dot.isa_available("avxvnni") else r"vpmaddwd|vpdpwssd\s+[^\n]*ymm"
    want = {"avx512vnni": r"vpdpbusd\s+[^\n]*zmm", "avxvnni": r"vpdpbusd\s+[^\n]*ymm", "avx2": avx2,
            "avx512amx": r"vpdpbusd\s+[^\n]*zmm"}[isa]  # (avx512amx: its VNNI kernels, AMX's apart)
    assert re.search(want, asm)
    if isa == "avx512amx":
        fn = njit(int_matvec._ROWS_AMX[QT.Q4_0, False].py_func)
        fn(packed, int_dot.quantize_form(np.ones((16, 64), np.float32), "split"), np.empty((16, 16), np.float32),
           0, 16, 0)
        asm = "\n".join(fn.inspect_asm(sig) for sig in fn.signatures)
        assert re.search(r"tdpb[su][su]d\s+[^\n]*tmm", asm) and re.search(r"ldtilecfg", asm)


def test_vpdpbusd_is_declared_for_this_llvm():
    """The 8-bit VNNI form (u8 x s8, four products per lane) compiles to vpdpbusd and sums right."""
    if "avx512vnni" not in INT_ISAS:
        pytest.skip("no AVX-512 VNNI")
    from numba import njit, types
    from numba.extending import intrinsic

    from engine.kernels.vector_ir import I32, data_pointer, vector_type

    @intrinsic
    def dot4(typingctx, acc, u, s):
        def codegen(context, builder, signature, args):
            p = [data_pointer(context, builder, t, a) for t, a in zip(signature.args, args)]
            vi = vector_type(I32, 16)
            ld = [builder.load(builder.bitcast(q, vi.as_pointer()), align=1) for q in p]
            r = int_dot.IntIR(builder, "avx512vnni").dot4u8s8(ld[0], ld[1], ld[2])
            builder.store(r, builder.bitcast(p[0], vi.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(acc, u, s), codegen

    @njit
    def f(acc, u, s):
        dot4(acc, u, s)

    rng = np.random.default_rng(9)
    u = rng.integers(0, 256, 64).astype(np.uint8)
    s = rng.integers(-128, 128, 64).astype(np.int8)
    acc = np.arange(16, dtype=np.int32)
    want = acc + (u.astype(np.int64) * s).reshape(16, 4).sum(1)
    f(acc, u, s)
    assert np.array_equal(acc, want)
    assert "vpdpbusd" in f.inspect_asm(f.signatures[0])


def test_kernel_selection(monkeypatch):
    monkeypatch.setenv(int_dot.ISA_ENV, "float")
    assert int_dot.select_isa() == "float"
    monkeypatch.setenv(int_dot.ISA_ENV, "sse9")
    with pytest.raises(int_dot.KernelSelectionError, match="expected one of"):
        int_dot.select_isa()
    monkeypatch.delenv(int_dot.ISA_ENV)
    assert int_dot.select_isa() == INT_ISAS[0]
    for isa in INT_ISAS:
        assert int_dot.select_isa(isa) == isa


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_matrix_of_more_chunks_than_the_pool_has_slots(qtype):
    """65,552 rows of >= 2 KiB (a vocabulary-sized output matrix): ~CHUNK_BYTES chunks would be
    16 rows, 4,097 of them, past the pool's 4,096 chunk slots (this once overwrote memory). The
    chunk grows instead, in whole 16-row groups. The rows are one 16-row group repeated, so every
    chunk must give that group's bits."""
    from engine.kernels.pool import CHUNK_BYTES, MAX_CHUNKS

    t = int_matvec.INT_TYPES[qtype]
    cols = -(-(CHUNK_BYTES // 16) // t.nbytes) * t.values
    group = blocks(qtype, int_matvec.GROUP, cols, seed=5)
    rows = (MAX_CHUNKS + 1) * int_matvec.GROUP
    raw = np.tile(group, (rows // int_matvec.GROUP, 1))
    mv = int_matvec.IntMatvec(qtype, raw, cols, INT_ISAS[0])
    assert mv.chunk % int_matvec.GROUP == 0 and -(-rows // mv.chunk) <= MAX_CHUNKS
    x = activations(2, cols, seed=6)
    y = mv(np.ascontiguousarray(x), np.empty((2, rows), np.float32))
    one = run(qtype, group, x, INT_ISAS[0])
    assert np.array_equal(bits(y), bits(np.tile(one, (1, rows // int_matvec.GROUP))))


def test_fast_mode_warm_up_makes_the_amx_kernels_too():
    """`warm_up(fast=True)` (what `Engine.set_arith("fast")` calls) compiles a type's fast AMX
    kernel with its fast VNNI ones, so the first fast-mode prefill does not wait for it."""
    if "avx512amx" not in INT_ISAS:
        pytest.skip("no AMX-INT8 tiles granted to this process")
    int_matvec.warm_up({QT.Q4_0}, "avx512amx", fast=True)
    assert (QT.Q4_0, "amx", True) in int_matvec._cfuncs and (QT.Q4_0, "avx512amx", True) in int_matvec._cfuncs
