"""LayerBlockPool, pointer by pointer: block ids, reference counts, the FIFO free queue, slabs that
grow only when a fresh row is needed, and the bytes written into (and read back out of) the rows."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kv.formats import FORMATS, get_format
from engine.kv.pool import SLAB_BLOCKS, LayerBlockPool

HKV, BS, D, DV = 2, 8, 32, 16


def make_pool(k="q4c", v="q4t32", *, slab_blocks=4, max_blocks=None, head_dim=D, value_dim=DV, bs=BS):
    return LayerBlockPool(FORMATS[k], FORMATS[v], HKV, bs, head_dim, value_dim,
                          max_blocks=max_blocks, slab_blocks=slab_blocks)


def free_queue(pool: LayerBlockPool) -> list[int]:
    return list(pool._free)


def blocks_kv(rng, n, head_dim=D, value_dim=DV, bs=BS):
    k = rng.standard_normal((n, HKV, bs, head_dim)).astype(np.float32)
    v = rng.standard_normal((n, HKV, bs, value_dim)).astype(np.float32)
    return k, v


# ---- allocation and reference counts ----------------------------------------------------------------


def test_fresh_pool_is_empty():
    pool = make_pool()
    assert pool.n_blocks == pool.n_used == 0
    assert pool.k_slabs == [] and pool.v_slabs == [] and pool.ref_cnt == []
    assert pool.nbytes == pool.used_bytes == 0
    assert free_queue(pool) == []
    assert LayerBlockPool(FORMATS["q4c"], FORMATS["q4c"], 1, 8, 8, 8).slab_blocks == SLAB_BLOCKS


def test_allocate_hands_out_fresh_ids_in_order():
    pool = make_pool()
    assert [pool.allocate() for _ in range(6)] == [0, 1, 2, 3, 4, 5]
    assert pool.ref_cnt == [1] * 6
    assert pool.n_blocks == pool.n_used == 6
    assert free_queue(pool) == []


def test_free_queue_is_fifo():
    pool = make_pool()
    ids = [pool.allocate() for _ in range(5)]
    assert ids == [0, 1, 2, 3, 4]
    pool.decref(3)
    pool.decref(0)
    pool.decref(4)
    assert free_queue(pool) == [3, 0, 4]  # in the order they were freed
    assert pool.ref_cnt == [0, 1, 1, 0, 0]
    assert pool.n_blocks == 5 and pool.n_used == 2
    # reuse: oldest freed first, before any new row is created
    assert pool.allocate() == 3
    assert free_queue(pool) == [0, 4]
    assert pool.allocate() == 0
    pool.decref(1)
    assert free_queue(pool) == [4, 1]
    assert pool.allocate() == 4
    assert pool.allocate() == 1
    assert free_queue(pool) == []
    assert pool.allocate() == 5  # queue empty: a fresh row
    assert pool.n_blocks == 6 and pool.n_used == 6
    assert pool.ref_cnt == [1] * 6


def test_incref_keeps_a_block_until_the_last_reference():
    pool = make_pool()
    a, b = pool.allocate(), pool.allocate()
    pool.incref(a)
    pool.incref(a)
    assert pool.ref_cnt[a] == 3
    pool.decref(a)
    pool.decref(a)
    assert pool.ref_cnt[a] == 1 and free_queue(pool) == [] and pool.n_used == 2
    pool.decref(a)
    assert pool.ref_cnt[a] == 0 and free_queue(pool) == [a] and pool.n_used == 1
    # a reallocated block starts again at one reference
    assert pool.allocate() == a
    assert pool.ref_cnt[a] == 1 and pool.ref_cnt[b] == 1


def test_double_free_and_incref_of_a_free_block_raise():
    pool = make_pool()
    a = pool.allocate()
    pool.decref(a)
    with pytest.raises(ValueError, match="already free"):
        pool.decref(a)
    with pytest.raises(ValueError, match="free"):
        pool.incref(a)
    # the failed calls changed nothing: the block is in the queue exactly once
    assert free_queue(pool) == [a] and pool.ref_cnt == [0] and pool.n_used == 0
    assert pool.allocate() == a
    assert pool.allocate() == 1


def test_max_blocks_limits_blocks_in_use():
    pool = make_pool(max_blocks=3, slab_blocks=2)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.allocate() is None
    assert pool.allocate() is None  # still full, nothing created
    assert pool.n_blocks == 3 and pool.n_used == 3 and len(pool.k_slabs) == 2
    pool.decref(1)
    assert pool.allocate() == 1  # a freed block can be reused at the limit
    assert pool.allocate() is None
    pool.incref(2)
    pool.decref(2)  # still one reference: nothing freed
    assert pool.allocate() is None
    assert pool.ref_cnt == [1, 1, 1]


def test_max_blocks_zero():
    pool = make_pool(max_blocks=0)
    assert pool.allocate() is None
    assert pool.k_slabs == [] and pool.nbytes == 0


# ---- slabs and bytes --------------------------------------------------------------------------------


@pytest.mark.parametrize("k, v", [("q4c", "q4t32"), ("f16", "f16"), ("q8t32s", "q2t64"), ("q6t64", "q5c")])
def test_row_bytes_follow_the_formats(k, v):
    pool = make_pool(k, v)
    assert pool.k_row_bytes == FORMATS[k].bytes_per_block(HKV, BS, D)
    assert pool.v_row_bytes == FORMATS[v].bytes_per_block(HKV, BS, DV)
    if k == "f16":
        assert pool.k_row_bytes == 2 * HKV * BS * D


def test_slabs_grow_only_when_needed():
    pool = make_pool(slab_blocks=4)
    row = pool.k_row_bytes + pool.v_row_bytes

    def slabs():
        assert len(pool.k_slabs) == len(pool.v_slabs)
        return len(pool.k_slabs)

    pool.allocate()
    assert slabs() == 1 and pool.nbytes == 1 * 4 * row
    for _ in range(3):
        pool.allocate()
    assert pool.n_blocks == 4 and slabs() == 1  # the first slab is exactly full
    assert pool.allocate() == 4
    assert slabs() == 2 and pool.nbytes == 2 * 4 * row
    # freeing never shrinks, reusing never grows
    for b in (4, 0, 2):
        pool.decref(b)
    assert slabs() == 2 and pool.nbytes == 2 * 4 * row
    assert [pool.allocate() for _ in range(3)] == [4, 0, 2]
    assert slabs() == 2
    for _ in range(3):
        pool.allocate()  # 5, 6, 7: fill the second slab
    assert pool.n_blocks == 8 and slabs() == 2
    assert pool.allocate() == 8 and slabs() == 3
    assert pool.nbytes == 3 * 4 * row
    for s in pool.k_slabs:
        assert s.shape == (4, pool.k_row_bytes) and s.dtype == np.uint8
    for s in pool.v_slabs:
        assert s.shape == (4, pool.v_row_bytes) and s.dtype == np.uint8


def test_used_bytes_counts_rows_in_use():
    pool = make_pool(slab_blocks=4)
    row = pool.k_row_bytes + pool.v_row_bytes
    ids = [pool.allocate() for _ in range(6)]
    assert pool.used_bytes == 6 * row
    assert pool.nbytes == 2 * 4 * row  # two slabs
    pool.decref(ids[1])
    pool.decref(ids[5])
    assert pool.used_bytes == 4 * row and pool.nbytes == 2 * 4 * row
    for b in (0, 2, 3, 4):
        pool.decref(b)
    assert pool.n_used == 0 and pool.used_bytes == 0 and pool.nbytes == 2 * 4 * row
    pool.allocate()
    assert pool.used_bytes == row
    assert pool.used_bytes <= pool.nbytes


# ---- data ---------------------------------------------------------------------------------------------


def test_block_locations():
    pool = make_pool(slab_blocks=4)
    assert [pool._locate(b) for b in (0, 3, 4, 9)] == [(0, 0), (0, 3), (1, 0), (2, 1)]


def test_row_addresses_point_at_each_blocks_rows_across_slabs():
    pool = make_pool(slab_blocks=4)
    blocks = [pool.allocate() for _ in range(10)]  # three slabs
    order = [9, 0, 4, 3, 8, 5]
    k_rows, v_rows = pool.row_addresses(order)
    assert k_rows.dtype == v_rows.dtype == np.int64
    assert list(k_rows) == [pool.k_row(b).ctypes.data for b in order]
    assert list(v_rows) == [pool.v_row(b).ctypes.data for b in order]
    assert all(len(rows) == 0 for rows in pool.row_addresses([]))
    pool.decref(blocks[2])
    assert pool.allocate() == 2 and list(pool.row_addresses([2])[0]) == [pool.k_row(2).ctypes.data]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_write_dequantize_round_trip(name):
    """Every format, as K and as V: the rows hold exactly the format's bytes, and dequantize gives
    back the format's own reconstruction (float16 rounding for f16)."""
    rng = np.random.default_rng(sum(map(ord, name)))
    fmt = FORMATS[name]
    pool = LayerBlockPool(fmt, fmt, HKV, BS, 64, 32, slab_blocks=4)
    ids = [pool.allocate() for _ in range(6)]  # two slabs
    k, v = blocks_kv(rng, 6, 64, 32)
    k[:, :, :, 5] *= 10  # an outlier channel
    pool.write(ids, k, v)
    k_rows, v_rows = fmt.quantize(k), fmt.quantize(v)
    for i, b in enumerate(ids):
        slab, row = divmod(b, 4)
        np.testing.assert_array_equal(pool.k_slabs[slab][row], k_rows[i])
        np.testing.assert_array_equal(pool.v_slabs[slab][row], v_rows[i])
    kd, vd = pool.dequantize(ids)
    assert kd.shape == (6, HKV, BS, 64) and vd.shape == (6, HKV, BS, 32)
    assert kd.dtype == vd.dtype == np.float32
    np.testing.assert_array_equal(kd, fmt.dequantize(k_rows, HKV, BS, 64))
    np.testing.assert_array_equal(vd, fmt.dequantize(v_rows, HKV, BS, 32))
    if name == "f16":
        np.testing.assert_array_equal(kd, k.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(vd, v.astype(np.float16).astype(np.float32))
    else:
        # within the format's error bound: |x - x~| <= scale/2 <= range/(2*(levels-1)) (+ f16 slack)
        span = np.abs(k).max() * 2
        assert np.abs(kd - k).max() <= span / (2 * ((1 << fmt.bits) - 2)) * 1.01 + 1e-5
        assert np.abs(kd - k).max() > 0  # really quantized


@pytest.mark.parametrize("k_name, v_name", [("q8t32s", "q4t64"), ("q4c", "q2t32"), ("f16", "q6t64")])
def test_k_and_v_formats_are_independent(k_name, v_name):
    rng = np.random.default_rng(3)
    pool = make_pool(k_name, v_name, slab_blocks=2)
    ids = [pool.allocate() for _ in range(3)]
    k, v = blocks_kv(rng, 3)
    pool.write(ids, k, v)
    kd, vd = pool.dequantize(ids)
    kf, vf = FORMATS[k_name], FORMATS[v_name]
    np.testing.assert_array_equal(kd, kf.dequantize(kf.quantize(k), HKV, BS, D))
    np.testing.assert_array_equal(vd, vf.dequantize(vf.quantize(v), HKV, BS, DV))


def test_write_only_touches_its_rows_and_reuse_overwrites():
    rng = np.random.default_rng(4)
    pool = make_pool("q8t32s", "q8t32s", slab_blocks=4)
    ids = [pool.allocate() for _ in range(5)]
    k, v = blocks_kv(rng, 5)
    pool.write(ids, k, v)
    before_k = [s.copy() for s in pool.k_slabs]
    # rewrite block 2 only
    k2, v2 = blocks_kv(rng, 1)
    pool.write([2], k2, v2)
    for s, (old, new) in enumerate(zip(before_k, pool.k_slabs)):
        changed = np.nonzero((old != new).any(axis=1))[0]
        assert list(changed) == ([2] if s == 0 else [])
    kd, vd = pool.dequantize([2])
    fmt = pool.k_format
    np.testing.assert_array_equal(kd, fmt.dequantize(fmt.quantize(k2), HKV, BS, D))
    # free and reallocate: the reused row holds the new data, not the old
    pool.decref(4)
    assert pool.allocate() == 4
    k4, v4 = blocks_kv(rng, 1)
    pool.write([4], k4, v4)
    kd, vd = pool.dequantize([4])
    np.testing.assert_array_equal(vd, pool.v_format.dequantize(pool.v_format.quantize(v4), HKV, BS, DV))
    # untouched blocks still read back their original data
    kd, _ = pool.dequantize([0, 1, 3])
    np.testing.assert_array_equal(kd, fmt.dequantize(fmt.quantize(k[[0, 1, 3]]), HKV, BS, D))


def test_fresh_slabs_are_zero():
    pool = make_pool(slab_blocks=4)
    pool.allocate()
    assert not pool.k_slabs[0].any() and not pool.v_slabs[0].any()


def test_runs_group_blocks_by_slab_in_sequence_order():
    pool = make_pool(slab_blocks=4)
    for _ in range(12):
        pool.allocate()
    blocks = [5, 1, 6, 9, 2, 7]  # slabs 1, 0, 1, 2, 0, 1
    runs = pool.runs(blocks)
    assert [r[0] for r in runs] == [0, 1, 2]  # one run per slab, slabs ascending
    got = {slab: (list(rows), list(where)) for slab, rows, where in runs}
    assert got == {
        0: ([1, 2], [1, 4]),  # blocks 1, 2: rows 1, 2 of slab 0, at indices 1 and 4 of `blocks`
        1: ([1, 2, 3], [0, 2, 5]),  # blocks 5, 6, 7 in the order they appear
        2: ([1], [3]),
    }
    # every index of `blocks` appears exactly once, and rows point back to the same block ids
    where_all = np.concatenate([w for _, _, w in runs])
    assert sorted(where_all.tolist()) == list(range(len(blocks)))
    for slab, rows, where in runs:
        assert [slab * 4 + r for r in rows] == [blocks[i] for i in where]
    for slab, rows, where in runs:
        assert rows.dtype.kind == "i" and where.dtype.kind == "i"
    assert [(s, list(r), list(w)) for s, r, w in pool.runs([3])] == [(0, [3], [0])]


def test_runs_of_a_reversed_sequence_keep_sequence_order():
    pool = make_pool(slab_blocks=4)
    for _ in range(8):
        pool.allocate()
    blocks = [7, 6, 5, 4, 3, 2, 1, 0]
    got = [(s, list(r), list(w)) for s, r, w in pool.runs(blocks)]
    assert got == [(0, [3, 2, 1, 0], [4, 5, 6, 7]), (1, [3, 2, 1, 0], [0, 1, 2, 3])]


def test_dequantize_follows_block_order_across_slabs():
    rng = np.random.default_rng(5)
    pool = make_pool("q6t64", "q4t32", slab_blocks=2)
    ids = [pool.allocate() for _ in range(7)]  # four slabs
    k, v = blocks_kv(rng, 7)
    pool.write(ids, k, v)
    order = [6, 0, 3, 5, 1]
    kd, vd = pool.dequantize(order)
    singles = [pool.dequantize([b]) for b in order]
    np.testing.assert_array_equal(kd, np.concatenate([s[0] for s in singles]))
    np.testing.assert_array_equal(vd, np.concatenate([s[1] for s in singles]))
    fk, fv = pool.k_format, pool.v_format
    np.testing.assert_array_equal(kd, fk.dequantize(fk.quantize(k[order]), HKV, BS, D))
    np.testing.assert_array_equal(vd, fv.dequantize(fv.quantize(v[order]), HKV, BS, DV))
    # a write in a scrambled order lands each block in its own row
    k2, v2 = blocks_kv(rng, 3)
    pool.write([5, 0, 3], k2, v2)
    kd, _ = pool.dequantize([0, 3, 5])
    np.testing.assert_array_equal(kd, fk.dequantize(fk.quantize(k2[[1, 2, 0]]), HKV, BS, D))


def test_dequantize_of_no_blocks():
    pool = make_pool()
    kd, vd = pool.dequantize([])
    assert kd.shape == (0, HKV, BS, D) and vd.shape == (0, HKV, BS, DV)


def test_default_formats_pool():
    """The pools PagedKVCache builds: default formats per bit width."""
    for bits in (16, 8, 6, 5, 4, 3, 2):
        pool = LayerBlockPool(get_format(bits, "k"), get_format(bits, "v"), HKV, 32, 64, 64)
        ids = [pool.allocate() for _ in range(3)]
        rng = np.random.default_rng(bits)
        k, v = blocks_kv(rng, 3, 64, 64, 32)
        pool.write(ids, k, v)
        kd, vd = pool.dequantize(ids)
        err = max(np.abs(kd - k).max(), np.abs(vd - v).max())
        assert err < (4e-3 if bits == 16 else 4.0 / (1 << bits) * 3)
        assert pool.used_bytes == 3 * (pool.k_row_bytes + pool.v_row_bytes)
