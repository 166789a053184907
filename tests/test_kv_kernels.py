"""Packed-code attention kernels (engine.kernels.kv_codes): float16 support, odd geometries, threads.

The numpy `fmt.dequantize` of the same blocks followed by matmuls is the reference; the basic
match over every integer format lives in test_kv_formats.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.kv.formats import FORMATS

F16 = FORMATS["f16"]


def _reference(fmt, pool, ids, q, p, t, d):
    """numpy scores (Hkv, M, nb*T) and weighted values (Hkv, M, D) over the blocks ids."""
    h = q.shape[0]
    ref = fmt.dequantize(pool[ids], h, t, d)  # (nb, Hkv, T, D)
    ref = ref.transpose(1, 0, 2, 3).reshape(h, len(ids) * t, d)  # (Hkv, nb*T, D)
    return q @ ref.transpose(0, 2, 1), p @ ref


# ---- float16 -> float32 ---------------------------------------------------------------------------


def _tail_rows_rounded(bits: np.ndarray) -> np.ndarray:
    """`kv_codes.store_tail_row` applied to float32 bit patterns (n a multiple of 128): as k and v
    rows of 64 values, read back from the tails (float32 bits)."""
    from engine.kernels.kv_codes import store_tail_row

    rows = bits.view(np.float32).reshape(2, -1, 64)  # (k | v, Hkv, D)
    tail_k, tail_v = (np.zeros((rows.shape[1], 3, 64), np.float32) for _ in range(2))
    store_tail_row(rows[0], rows[1], tail_k, tail_v, 1)
    assert not tail_k[:, ::2].any() and not tail_v[:, ::2].any()  # only column 1 written
    return np.concatenate([tail_k[:, 1], tail_v[:, 1]]).reshape(-1).view(np.uint32)


def _numpy_rounded(bits: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return bits.view(np.float32).astype(np.float16).astype(np.float32).view(np.uint32)


def test_tail_rows_round_to_float16_as_numpy_does():
    """The compiled copy of a decode token into the tail (`store_tail_row`) rounds to float16 as
    `astype(np.float16)` does, bit for bit (NaN payloads too): around every float16 boundary
    (ties to even, the subnormal halves, the largest half and overflow) and on random patterns."""
    rng = np.random.default_rng(0)
    edges = []
    for exp in range(0x60, 0x90):  # float32 exponents from far below float16's subnormals to past 65504
        for low in (0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FFFFF, 0x7FE000, 0x7FF000):
            for high in (0, 0x2000, 0x4000, 0x7FC000):
                edges.append((exp << 23) | high | (low & 0x7FFFFF))
    edges += [0, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000]
    bits = np.array(edges, np.uint32)
    bits = np.concatenate([bits, bits | np.uint32(0x80000000), rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])
    bits = np.concatenate([bits, np.zeros(-len(bits) % 128, np.uint32)])
    np.testing.assert_array_equal(_tail_rows_rounded(bits), _numpy_rounded(bits))


@pytest.mark.slow
def test_tail_rows_round_to_float16_as_numpy_does_on_every_bit_pattern():
    chunk = 1 << 24
    for start in range(0, 1 << 32, chunk):
        bits = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32)
        np.testing.assert_array_equal(_tail_rows_rounded(bits), _numpy_rounded(bits))


def test_f16_conversion_matches_numpy_on_every_bit_pattern():
    from engine.kernels.kv_codes import f16_bits_to_f32

    bits = np.arange(1 << 16, dtype=np.uint16)
    ref = bits.view(np.float16).astype(np.float32)
    got = f16_bits_to_f32(bits)
    assert got.dtype == np.float32 and got.shape == ref.shape
    nan = np.isnan(ref)
    assert nan.sum() == 2 * 1023  # both signs, exponent 31, mantissa != 0
    np.testing.assert_array_equal(np.isnan(got), nan)
    # everything else bit for bit: ±0, the 2*1023 subnormals, normals, ±inf
    np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.signbit(got[0x8000]) and got[0x8000] == 0
    assert got[0x0001] == np.float32(2.0**-24) and got[0x03FF] == np.float32(1023 * 2.0**-24)
    assert got[0x7C00] == np.inf and got[0xFC00] == -np.inf
    assert got[0x7BFF] == 65504.0


# ---- float16 pools --------------------------------------------------------------------------------


@pytest.mark.parametrize("geometry", [(3, 32, 64), (1, 32, 256), (2, 16, 16), (2, 6, 12), (1, 3, 4)])
@pytest.mark.parametrize("m", [1, 3, 4, 16])
def test_f16_kernels_match_dequantize(geometry, m):
    from engine.kernels.kv_codes import attention_scores, weighted_values

    h, t, d = geometry
    rng = np.random.default_rng(20)
    pool = F16.quantize(3.0 * rng.standard_normal((7, h, t, d)).astype(np.float32))
    ids = np.array([4, 0, 6, 2, -2])
    q = rng.standard_normal((h, m, d)).astype(np.float32)
    p = rng.random((h, m, len(ids) * t)).astype(np.float32)
    s_ref, o_ref = _reference(F16, pool, ids, q, p, t, d)
    np.testing.assert_allclose(attention_scores(F16, pool, ids, q, t), s_ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(weighted_values(F16, pool, ids, p, t, d), o_ref, rtol=1e-5, atol=1e-4)


def test_f16_kernels_exact_on_special_values():
    """One-hot weights pick single tokens out exactly: zeros, subnormals, extremes survive."""
    from engine.kernels.kv_codes import attention_scores, weighted_values

    h, t, d = 2, 8, 16
    finite = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = finite[np.isfinite(finite)]  # every finite float16, subnormals and -0.0 included
    rng = np.random.default_rng(21)
    n = 4
    values = rng.choice(finite, size=(n, h, t, d)).astype(np.float32)
    values[0, 0, 0, :6] = [0.0, -0.0, 2.0**-24, -(2.0**-24), 65504.0, 2.0**-14]
    pool = F16.quantize(values)
    np.testing.assert_array_equal(F16.dequantize(pool, h, t, d), values)
    ids = np.arange(n)
    for j, tok in [(0, 0), (1, 5), (3, 7)]:
        p = np.zeros((h, 1, n * t), np.float32)
        p[:, 0, j * t + tok] = 1.0
        got = weighted_values(F16, pool, ids, p, t, d)  # (Hkv, 1, D)
        np.testing.assert_array_equal(np.abs(got[:, 0]), np.abs(values[j, :, tok]))
    # a unit query picks out one channel of every key exactly
    q = np.zeros((h, 1, d), np.float32)
    q[:, 0, 3] = 1.0
    scores = attention_scores(F16, pool, ids, q, t)  # (Hkv, 1, n*T)
    want = values[:, :, :, 3].transpose(1, 0, 2).reshape(h, n * t)
    np.testing.assert_array_equal(np.abs(scores[:, 0]), np.abs(want))


def test_f16_infinities_propagate():
    from engine.kernels.kv_codes import attention_scores, weighted_values

    k = np.ones((1, 1, 8, 8), np.float32)
    k[0, 0, 2, 5] = np.inf
    k[0, 0, 6, 1] = -np.inf
    pool = F16.quantize(k)
    scores = attention_scores(F16, pool, np.array([0]), np.ones((1, 1, 8), np.float32), 8)[0, 0]
    assert scores[2] == np.inf and scores[6] == -np.inf
    assert np.all(scores[[0, 1, 3, 4, 5, 7]] == 8.0)
    p = np.zeros((1, 1, 8), np.float32)
    p[0, 0, 2] = 0.5
    out = weighted_values(F16, pool, np.array([0]), p, 8, 8)[0, 0]
    assert out[5] == np.inf and np.all(np.delete(out, 5) == 0.5)


# ---- integer formats: odd geometries, masks, threads ----------------------------------------------


@pytest.mark.parametrize("name", ["q4c", "q4t64", "q8t32s", "q6t64", "q5c", "q3t32s", "q2t64", "q2cs"])
@pytest.mark.parametrize("geometry", [(2, 6, 16), (3, 5, 8)])  # T not a multiple of 4, tiny D
def test_kernels_odd_token_counts(name, geometry):
    from engine.kernels.kv_codes import attention_scores, weighted_values

    fmt = FORMATS[name]
    h, t, d = geometry
    rng = np.random.default_rng(22)
    pool = fmt.quantize(rng.standard_normal((5, h, t, d)).astype(np.float32))
    ids = np.array([3, 1, 4, 0])
    q = rng.standard_normal((h, 3, d)).astype(np.float32)
    p = rng.random((h, 3, len(ids) * t)).astype(np.float32)
    s_ref, o_ref = _reference(fmt, pool, ids, q, p, t, d)
    np.testing.assert_allclose(attention_scores(fmt, pool, ids, q, t), s_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(weighted_values(fmt, pool, ids, p, t, d), o_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["q4t64", "f16"])
def test_values_skip_zero_weights(name):
    """Masked tokens (weight 0) contribute nothing, whole groups of four included."""
    from engine.kernels.kv_codes import weighted_values

    fmt = FORMATS[name]
    h, t, d = 3, 32, 64
    rng = np.random.default_rng(23)
    pool = fmt.quantize(rng.standard_normal((4, h, t, d)).astype(np.float32))
    ids = np.arange(4)
    p = rng.random((h, 3, 4 * t)).astype(np.float32)
    p[:, :, :9] = 0  # sinks handled elsewhere, as paged.py does
    p[:, 1, 40:48] = 0
    _, o_ref = _reference(fmt, pool, ids, np.zeros((h, 3, d), np.float32), p, t, d)
    np.testing.assert_allclose(weighted_values(fmt, pool, ids, p, t, d), o_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["q4c", "q8t32s", "f16"])
def test_parallel_runs_match_serial(name, monkeypatch):
    """Blocks split over threads (prange) give the serial results, for any split of the blocks."""
    import numba

    from engine.kernels import kv_codes
    from engine.kernels.kv_codes import attention_scores, weighted_values

    fmt = FORMATS[name]
    h, t, d = 3, 32, 64
    rng = np.random.default_rng(24)
    pool = fmt.quantize(rng.standard_normal((20, h, t, d)).astype(np.float32))
    q = rng.standard_normal((h, 3, d)).astype(np.float32)
    n_threads = numba.get_num_threads()
    for nb in (1, 2, 3, 16, 20):
        ids = rng.permutation(20)[:nb]
        p = rng.random((h, 3, nb * t)).astype(np.float32)
        monkeypatch.setattr(kv_codes, "PARALLEL_MIN_VALUES", None)
        serial = attention_scores(fmt, pool, ids, q, t), weighted_values(fmt, pool, ids, p, t, d)
        monkeypatch.setattr(kv_codes, "PARALLEL_MIN_VALUES", 1)
        for threads in sorted({2, n_threads}):
            if threads > numba.config.NUMBA_NUM_THREADS:
                continue
            numba.set_num_threads(threads)
            try:
                parallel = attention_scores(fmt, pool, ids, q, t), weighted_values(fmt, pool, ids, p, t, d)
            finally:
                numba.set_num_threads(n_threads)
            np.testing.assert_array_equal(parallel[0], serial[0])  # disjoint columns per thread
            np.testing.assert_allclose(parallel[1], serial[1], rtol=1e-4, atol=1e-4)  # partial sums
        s_ref, o_ref = _reference(fmt, pool, ids, q, p, t, d)
        np.testing.assert_allclose(serial[0], s_ref, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(serial[1], o_ref, rtol=1e-4, atol=1e-4)


def test_parallel_split_policy(monkeypatch):
    import numba

    from engine.kernels import kv_codes

    monkeypatch.setattr(kv_codes, "PARALLEL_MIN_VALUES", None)
    assert kv_codes._n_chunks(16, 6144) == 1 and kv_codes._n_chunks(0, 6144) == 0
    monkeypatch.setattr(kv_codes, "PARALLEL_MIN_VALUES", 32768)
    assert kv_codes._n_chunks(4, 6144) == 1  # too small to be worth a parallel region
    assert kv_codes._n_chunks(16, 6144) == min(16, numba.get_num_threads())
    assert kv_codes._n_chunks(1, 10**6) == 1


def test_kernels_empty_block_list_and_non_contiguous_pool():
    from engine.kernels.kv_codes import attention_scores, weighted_values

    fmt = FORMATS["q8t32s"]
    h, t, d = 2, 32, 64
    rng = np.random.default_rng(25)
    pool = fmt.quantize(rng.standard_normal((6, h, t, d)).astype(np.float32))
    q = rng.standard_normal((h, 4, d)).astype(np.float32)
    none = np.zeros(0, np.int64)
    assert attention_scores(fmt, pool, none, q, t).shape == (h, 4, 0)
    out = weighted_values(fmt, pool, none, np.zeros((h, 4, 0), np.float32), t, d)
    assert out.shape == (h, 4, d) and not out.any()
    every_other = pool[::2]  # (3, bytes) view, not C-contiguous
    ids = np.array([2, 0])
    p = rng.random((h, 4, 2 * t)).astype(np.float32)
    s_ref, o_ref = _reference(fmt, np.ascontiguousarray(every_other), ids, q, p, t, d)
    np.testing.assert_allclose(attention_scores(fmt, every_other, ids, q, t), s_ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(weighted_values(fmt, every_other, ids, p, t, d), o_ref, rtol=1e-5, atol=1e-4)


def test_f16_kernels_reject_bad_pools():
    from engine.kernels.kv_codes import attention_scores

    pool = F16.quantize(np.zeros((2, 1, 32, 64), np.float32))
    q = np.zeros((1, 1, 64), np.float32)
    with pytest.raises(IndexError):
        attention_scores(F16, pool, np.array([2]), q, 32)
    with pytest.raises(ValueError):
        attention_scores(F16, pool[:, :-2], np.array([0]), q, 32)
    with pytest.raises(ValueError):
        attention_scores(F16, pool.view(np.float16), np.array([0]), q, 32)


# ---- softmax of the attention paths ---------------------------------------------------------------


def test_masked_softmax_matches_numpy_within_float_rounding():
    """The compiled row softmax (its own exp) against numpy's exp, with masked ranges, sliding
    windows, scores far below the maximum (exp underflow) and one-column rows."""
    from engine.kernels.kv_codes import masked_softmax

    rng = np.random.default_rng(5)
    Hkv, G, T, L = 2, 3, 7, 40
    s = (rng.standard_normal((Hkv, G * T, L)) * 30).astype(np.float32)
    s[0, 0, 5] = -1e4  # ~exp(-1250): zero in numpy, the smallest normal float32 here
    lo = np.array([0, 0, 3, 10, 20, 38, 39])
    hi = np.array([1, 12, 20, 30, 39, 40, 40])
    got = s.copy()
    masked_softmax(got, lo, hi, np.float32(0.125))
    ref = np.zeros_like(s)
    for m in range(G * T):
        t = m % T
        x = s[:, m, lo[t] : hi[t]].astype(np.float64) * 0.125
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        ref[:, m, lo[t] : hi[t]] = e / e.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-30)
    assert (got[:, :, :][ref == 0] <= 2e-38).all()  # masked columns exactly 0, underflow ~0
    for m in range(G * T):
        t = m % T
        assert not got[:, m, : lo[t]].any() and not got[:, m, hi[t] :].any()
        np.testing.assert_allclose(got[:, m].sum(axis=-1), 1.0, rtol=1e-6)


# ---- the decode step's vector intrinsics ----------------------------------------------------------


@pytest.mark.parametrize("bits", [16, 8, 6, 5, 4, 3, 2])
@pytest.mark.parametrize("n_q", [1, 2, 3, 4, 5, 8])
def test_vector_intrinsics_read_every_width(bits, n_q):
    """`_vec_scores` / `_vec_values` against numpy on packed random codes (bits 16: float16
    values, specials excepted): one group per row (channel-axis keys, scales folded; float16) and
    token-axis groups with their scales, queries and sums in the intrinsics' channel order; an
    odd token count and rows padded past n_q. Each query's result is bit for bit the one it gets
    alone (n_q = 1): a verified draft's rows share the tile passes (`decode_rows_attention`)."""
    from engine.kernels.kv_codes import SCORE_CHUNK, VALUE_CHUNK, _chunk_order, _vec_scores, _vec_values
    from engine.kv.formats import pack_codes

    rng = np.random.default_rng(bits * 10 + n_q)
    T, D = 7, 96
    if bits == 16:
        halves = (3.0 * rng.standard_normal((T, D))).astype(np.float16)
        halves[0, :3] = [np.float16(6e-8), np.float16(-0.0), np.float16(65504)]  # subnormal, -0, max
        tile = halves.view(np.uint8).copy()
        x = halves.astype(np.float64)
    else:
        codes = rng.integers(0, 1 << bits, (T, D)).astype(np.uint8)
        tile = np.ascontiguousarray(pack_codes(codes, bits))  # (T, D*bits/8)
        x = codes.astype(np.float64)
    q = rng.standard_normal((8, D)).astype(np.float32)
    s_order = np.array([_chunk_order(bits, SCORE_CHUNK, d) for d in range(D)])
    v_order = np.array([_chunk_order(bits, VALUE_CHUNK, d) for d in range(D)])
    assert sorted(s_order) == list(range(D)) and sorted(v_order) == list(range(D))
    q_ordered = np.empty_like(q)
    q_ordered[:, s_order] = q
    for group in (D, 32):
        n_grp = D // group
        sc = np.ones((T, 1), np.float32) if group == D else rng.random((T, n_grp)).astype(np.float32)
        out = np.full((8, T + 2), np.nan, np.float32)
        _vec_scores(n_q, bits, tile.ctypes.data, T, q_ordered[:n_q], sc, group, out)
        for k in range(n_q):
            alone = np.full((1, T), np.nan, np.float32)
            _vec_scores(1, bits, tile.ctypes.data, T, q_ordered[k : k + 1], sc, group, alone)
            assert np.array_equal(alone[0], out[k, :T])
        scaled = x * np.repeat(sc, group, axis=1)  # code * its token's group scale
        np.testing.assert_allclose(out[:n_q, :T], q[:n_q] @ scaled.T, rtol=2e-5, atol=2e-3)
        assert np.isnan(out[n_q:]).all() and np.isnan(out[:, T:]).all()  # nothing else written
    for group in (D, 32, 16):
        n_grp = D // group
        w = rng.random((8, T, n_grp)).astype(np.float32)
        acc = rng.standard_normal((8, D)).astype(np.float32)
        start = acc.copy()
        _vec_values(n_q, bits, tile.ctypes.data, T, w, group, acc)
        for k in range(n_q):
            alone = start[k : k + 1].copy()
            _vec_values(1, bits, tile.ctypes.data, T, np.ascontiguousarray(w[k : k + 1]), group, alone)
            assert np.array_equal(alone[0], acc[k])
        weights = np.repeat(w, group, axis=2)  # (8, T, D): each channel's weight
        want = start[:, v_order] + np.einsum("ktd,td->kd", weights, x)[:, :]
        np.testing.assert_allclose(acc[:n_q][:, v_order], want[:n_q], rtol=2e-5, atol=2e-3)
        np.testing.assert_array_equal(acc[n_q:], start[n_q:])


def _usable(name: str, geometry: tuple[int, int, int, int]) -> bool:
    """Whether the format can lay out blocks of this geometry (groups of 32 channels cannot
    split a head dim of 48, say)."""
    _, _, t, d = geometry
    try:
        FORMATS[name].group_size(t, d)
    except ValueError:
        return False
    return True


DECODE_CASES = [
    (name, geometry)
    for geometry in [(3, 3, 32, 64), (1, 4, 16, 256), (2, 5, 8, 32), (2, 1, 16, 64), (1, 2, 16, 48)]
    for name in ["f16", "q8t32s", "q6cs", "q5c", "q4c", "q3c", "q2cs", "q4t32", "q6t64", "q4t64s", "q2t32"]
    if _usable(name, geometry)
]


@pytest.mark.parametrize("name,geometry", DECODE_CASES)
def test_decode_block_passes_match_dequantize(name, geometry):
    """The decode step's block passes (`_block_scores`, `_block_values`) on pool rows read by
    address, every quantized format the spec can select and some it cannot, GQA groups of 1..5
    queries (5: a group of 4 and one more), head dims that take the vector intrinsics (64, 256,
    32) and one that does not (48); the queries in passes of 4 (a decode step) and of 8 or 2 (a
    draft's rows, `decode_rows_attention`) give the same bits."""
    from engine.kernels.kv_codes import _block_scores, _block_values, decode_layout

    fmt = FORMATS[name]
    h, g, t, d = geometry
    rng = np.random.default_rng(d + g)
    pool = fmt.quantize(rng.standard_normal((6, h, t, d)).astype(np.float32))
    ids = np.array([4, 0, 5, 2])
    q = rng.standard_normal((h, g, d)).astype(np.float32)
    p = rng.random((h, g, len(ids) * t)).astype(np.float32)
    s_ref, o_ref = _reference(fmt, pool, ids, q, p, t, d)
    rows = pool.ctypes.data + ids.astype(np.int64) * pool.shape[1]
    layout = decode_layout(fmt, h, t, d)
    s = np.full((h, g, len(ids) * t + 3), np.nan, np.float32)
    _block_scores(rows, 1, len(ids), layout, t, q, s, 0, h, 4)  # blocks 1.. only, like a sliding window
    np.testing.assert_allclose(s[:, :, t : len(ids) * t], s_ref[:, :, t:], rtol=1e-4, atol=2e-4)
    assert np.isnan(s[:, :, :t]).all() and np.isnan(s[:, :, len(ids) * t :]).all()
    out = np.zeros((h, g, d), np.float32)
    _block_values(rows, 0, len(ids), layout, t, p, out, 0, h, 4)
    np.testing.assert_allclose(out, o_ref, rtol=1e-4, atol=2e-4)
    if h > 1:  # heads 1.. alone: the same values, head 0 untouched
        s_part = np.full_like(s, np.nan)
        _block_scores(rows, 1, len(ids), layout, t, q, s_part, 1, h, 4)
        assert np.array_equal(s_part[1:], s[1:], equal_nan=True) and np.isnan(s_part[0]).all()
        out_part = np.zeros_like(out)
        _block_values(rows, 0, len(ids), layout, t, p, out_part, 1, h, 4)
        assert np.array_equal(out_part[1:], out[1:]) and not out_part[0].any()
    for group_q in (8, 2):
        s_group = np.full_like(s, np.nan)
        _block_scores(rows, 1, len(ids), layout, t, q, s_group, 0, h, group_q)
        assert np.array_equal(s_group, s, equal_nan=True)
        out_group = np.zeros_like(out)
        _block_values(rows, 0, len(ids), layout, t, p, out_group, 0, h, group_q)
        assert np.array_equal(out_group, out)


@pytest.mark.parametrize("spec,n_kv_heads,group", [("full", 8, 4), ("k4v4", 3, 2), ("k6v4", 2, 5),
                                                     ("k8v8,bs=32", 5, 1)])
def test_a_long_sequence_step_shared_by_kv_heads_equals_the_whole_call(monkeypatch, spec, n_kv_heads, group):
    """`DecodeKernel.attend` of a sequence past SPLIT_MIN_HEAD_TOKENS shares its KV heads between the
    weight kernels' threads (rows of consecutive heads in one pool job): bit-identical to the
    whole call on one thread, for odd head counts, GQA groups, quantized formats, a sliding
    window, and when the caller takes over the worker's part at once (grace 0)."""
    from engine.kernels import kv_codes
    from engine.kernels import pool as work_pool
    from engine.kv.config import KVConfig
    from engine.kv.paged import PagedKVCache
    from engine.kv import paged_attention
    from engine.kv.paged_attention import DecodeKernel, PagedAttention, ReferenceAttention

    config = KVConfig.parse(spec)
    layer = PagedKVCache(config, n_layers=1, n_kv_heads=n_kv_heads, head_dim=64)[0]
    decode = DecodeKernel(layer.pool)
    layer.attention = PagedAttention(ReferenceAttention(), None, decode, gated=False)
    rng = np.random.default_rng(n_kv_heads)
    n = 300
    q = rng.standard_normal((n + 3, n_kv_heads * group, 64)).astype(np.float32)
    k = rng.standard_normal((n + 3, n_kv_heads, 64)).astype(np.float32)
    for t0 in range(0, n, 100):  # stored through the reference, in three chunks
        layer.attend(q[t0 : t0 + 100], k[t0 : t0 + 100], k[t0 : t0 + 100], scale=0.125, window=None)
    pool = work_pool.get_pool()
    if pool is not None and spec == "k4v4":
        monkeypatch.setattr(pool, "grace_per_byte", 0.0)
    split_calls = []
    heads = kv_codes.decode_attention_heads
    monkeypatch.setattr(decode, "threads", 2)  # the split even on a one-CPU machine (then one thread runs both)
    monkeypatch.setattr(paged_attention, "SPLIT_MIN_HEAD_TOKENS", n // 2)  # these 300 tokens too
    attend_many = DecodeKernel.attend_many

    def recorded(self, views, **kw):
        split_calls.append(kw.get("head_parts", 1))
        return attend_many(self, views, **kw)

    monkeypatch.setattr(DecodeKernel, "attend_many", recorded)
    for step in range(n, n + 3):
        view = layer.stage_token(q[step : step + 1], k[step : step + 1], k[step : step + 1])
        for window in (None, 200):
            whole = np.empty((n_kv_heads, group, 64), np.float32)
            first_visible = 0 if window is None else max(0, view.position - window + 1 - view.first_position)
            heads(view.k_rows, view.v_rows, decode.k_layout, decode.v_layout, decode.block_size, view.query,
                  np.float32(0.125), view.sink_k, view.sink_v, view.first_position, view.n_sink_old, view.tail_k,
                  view.tail_v, view.n_recent, first_visible, view.mass, whole, 0, n_kv_heads)
            shared = decode.attend(view, scale=0.125, window=window)
            assert np.array_equal(shared, whole)
            parts = decode.attend_many([view, view], scale=0.125, window=window, head_parts=n_kv_heads)
            assert np.array_equal(parts[0], whole) and np.array_equal(parts[1], whole)
        layer.commit_token(view)
    # each step: attend's own call (split in 2 where there are 2 heads or more), then the explicit one
    assert split_calls == ([2, n_kv_heads] * 6 if n_kv_heads > 1 else [1] * 6)


def test_decode_batch_call_equals_each_sequence_alone_when_the_pool_steals(monkeypatch):
    """`DecodeKernel.attend_many` (a decode batch's sequences in one call shared with the weight
    kernels' pool) gives each sequence exactly its own `attend`, also when the caller takes over
    every chunk the worker has not finished at once (grace 0)."""
    from engine import warmup
    from engine.kernels import pool as work_pool

    layer, q, k = warmup._tiny_layer(True)
    pool = work_pool.get_pool()
    if pool is not None:
        monkeypatch.setattr(pool, "grace_per_byte", 0.0)
    for step in range(36, 40):
        view = layer.stage_token(q[step : step + 1], k[step : step + 1], k[step : step + 1])
        alone = layer.attention.decode.attend(view, scale=0.25, window=None)
        together = layer.attention.decode.attend_many([view] * 5, scale=0.25, window=None)
        windowed = layer.attention.decode.attend_many([view] * 3, scale=0.25, window=20)
        assert together.shape == (5,) + alone.shape
        for out in together:
            assert np.array_equal(out, alone)
        for out in windowed:
            assert np.array_equal(out, layer.attention.decode.attend(view, scale=0.25, window=20))
        layer.commit_token(view)


def test_decode_batch_calls_with_other_scales_each_use_their_own():
    """`DecodeKernel.attend_many` keeps the table fields its calls share (the scale's among them)
    from one call to the next: calls alternating between two scales each equal `attend`."""
    from engine import warmup

    layer, q, k = warmup._tiny_layer(True)
    view = layer.stage_token(q[36:37], k[36:37], k[36:37])
    decode = layer.attention.decode
    for scale in (0.25, 0.5, 0.25, 0.5):
        together = decode.attend_many([view, view], scale=scale, window=None)
        alone = decode.attend(view, scale=scale, window=None)
        assert np.array_equal(together[0], alone) and np.array_equal(together[1], alone)
    layer.commit_token(view)


@pytest.mark.parametrize("spec,n_kv_heads,group,head_dim", [
    ("full", 2, 4, 64), ("k6v4", 3, 3, 64), ("k4v4", 2, 5, 64), ("k8v8,bs=32", 1, 8, 64), ("k3v2", 2, 2, 32),
    ("k4v4", 2, 3, 48), ("k4v4,rot", 2, 3, 64)])
def test_a_drafts_rows_in_one_call_equal_each_decode_step(monkeypatch, spec, n_kv_heads, group, head_dim):
    """A verified draft's rows stored together (`PagedLayerCache.stage_rows`) and attended in one
    pool job over the KV heads, several rows' queries per tile pass (`DecodeKernel.attend_rows`,
    `kv_codes.decode_rows_attention`): each row bit for bit its decode step's `attend` after
    `stage_token` (a second layer decoding the same tokens one by one), and the layers equal
    after: 2, 3 and 7 rows (up to 56 queries per head: passes of ROWS_GROUP_Q that mix rows),
    formats on the vector intrinsics and one head dim that is not (48), rotated keys, windows;
    None when the rows' windows start in different blocks. With grace 0 (the caller takes over
    the worker's heads at once) for one spec."""
    from engine.kernels import pool as work_pool
    from engine.kv.config import KVConfig
    from engine.kv.paged import PagedKVCache
    from engine.kv.paged_attention import DecodeKernel, PagedAttention, ReferenceAttention

    config = KVConfig.parse(spec)
    B = config.block_size
    layer, alone = PagedKVCache(config, n_layers=2, n_kv_heads=n_kv_heads, head_dim=head_dim)
    decode = DecodeKernel(layer.pool)
    for each in (layer, alone):
        each.attention = PagedAttention(ReferenceAttention(), None, decode, gated=False)
    pool = work_pool.get_pool()
    if pool is not None and spec == "k4v4":
        monkeypatch.setattr(pool, "grace_per_byte", 0.0)
    rng = np.random.default_rng(n_kv_heads * group)
    n = 4 * B + 3  # four full blocks and a tail of 3: seven more rows fit in the tail's block
    q = rng.standard_normal((n + 7, n_kv_heads * group, head_dim)).astype(np.float32)
    k = rng.standard_normal((n + 7, n_kv_heads, head_dim)).astype(np.float32)
    for each in (layer, alone):
        each.attend(q[:n], k[:n], k[:n], scale=0.125, window=None)  # stored through the reference
    for T in (2, 3, 7):
        views = []
        for i in range(n, n + T):
            views.append(alone.stage_token(q[i : i + 1], k[i : i + 1], k[i : i + 1]))
            alone.commit_token(views[-1])
        view, queries = layer.stage_rows(q[n : n + T], k[n : n + T], k[n : n + T])
        for key in ("offset", "n_tail", "block_table"):
            assert getattr(layer, key) == getattr(alone, key)
        assert np.array_equal(layer.tail_k, alone.tail_k) and np.array_equal(layer.tail_v, alone.tail_v)
        for i, one in enumerate(views):
            assert np.array_equal(queries[i], one.query)
        for window in (None, 2 * B, n - B + 2):  # the last: row 0 sees from block 0's end, row 1 from block 1
            rows = decode.attend_rows(view, queries, scale=0.125, window=window)
            if window == n - B + 2:
                assert rows is None
                continue
            assert rows.shape == (T, n_kv_heads, group, head_dim)
            for i, one in enumerate(views):
                assert np.array_equal(rows[i], decode.attend(one, scale=0.125, window=window)), (T, window, i)
        layer.trim(T)
        alone.trim(T)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_softmax_of_scores_that_are_not_numbers_raises_nothing(value):
    """A pool worker may run a dropped (stolen) decode chunk over the pool's reused x buffer, whose
    bytes are anything: the softmax must not raise there (it printed ZeroDivisionError as
    "Exception ignored" from the worker thread); real scores keep their exact result."""
    from engine.kernels.kv_codes import _softmax_in_place

    lanes = np.empty(16, np.float32)  # (the maximum's scratch)
    x = np.full(4, value, np.float32)
    _softmax_in_place(x, np.float32(1.0), lanes)  # no exception; the values do not matter
    real = np.array([0.5, -1.0, 2.0], np.float32)
    _softmax_in_place(real, np.float32(1.0), lanes)
    want = np.exp(np.array([0.5, -1.0, 2.0]) - 2.0)
    np.testing.assert_allclose(real, want / want.sum(), rtol=1e-6)
