"""Quantized-weight kernels (engine.kernels.quant_matvec) and the quantized WeightStore backend.

Reference: gguf-py's numpy dequantizer. Dequantization must match it bit for bit; products must
equal x @ W.T (computed in float64 here) up to float32 rounding of the sums, bounded relative to
Σ|x|·|w| (the scale of a dot product's rounding error).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import quantize

from engine import weights
from engine.gguf_file import GGUFFile
from engine.kernels import pool as kpool
from engine.kernels import quant_matvec as qm

from .weight_blocks import GGUF_QUANTIZES, random_blocks

ALL_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.F16, QT.BF16,
             QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.IQ4_XS]
RTOL = 1e-5


def quantized_from_floats(qtype: QT, rows: int, cols: int, rng) -> np.ndarray:
    data = rng.standard_normal((rows, cols)).astype(np.float32)
    q = quantize(data, qtype)
    return np.ascontiguousarray(q).view(np.uint8).reshape(rows, -1)


def reference(raw: np.ndarray, qtype: QT) -> np.ndarray:
    return weights.dequantize_rows(raw, qtype).reshape(raw.shape[0], -1)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_product_close(y: np.ndarray, x: np.ndarray, w: np.ndarray, rtol: float = RTOL) -> None:
    """y ≈ x @ w.T: |error| ≤ rtol · (|x| @ |w|.T), elementwise (plus a subnormal-sized floor)."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T
    bound = rtol * (np.abs(x64) @ np.abs(w64).T) + 1e-30
    err = np.abs(y.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert y.dtype == np.float32 and y.shape == ref.shape
    assert (err <= bound).all(), f"error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


def cases():
    for t in ALL_TYPES:
        yield pytest.param(t, "random", id=f"{t.name}-random")
        yield pytest.param(t, "any-scale", id=f"{t.name}-any-scale")
        if t in GGUF_QUANTIZES:
            yield pytest.param(t, "quantized", id=f"{t.name}-quantized")


def make(qtype: QT, kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "quantized":
        return quantized_from_floats(qtype, rows, cols, rng)
    return random_blocks(qtype, rows, cols, rng, "any" if kind == "any-scale" else "small")


# -- the kernels against gguf's dequantizer -------------------------------------------------


@pytest.mark.parametrize("qtype,kind", list(cases()))
def test_dequantize_is_bit_exact(qtype, kind):
    raw = make(qtype, kind, 41, 512)
    ref = reference(raw, qtype)
    rows = np.array([3, 0, 40, 3, 17], dtype=np.int64)
    out = np.full((len(rows), 512), np.nan, dtype=np.float32)
    qm.dequantize_rows(qtype, raw, rows, out)
    np.testing.assert_array_equal(bits(out), bits(ref[rows]))
    # and every row, through the QuantLinear that the WeightStore hands out
    lin = weights.QuantLinear(raw, qtype, 41, 512)
    np.testing.assert_array_equal(bits(lin.weight), bits(ref))


@pytest.mark.parametrize("qtype,kind", list(cases()))
@pytest.mark.parametrize("T", [1, 3])
def test_matvec_equals_dense_product(qtype, kind, T):
    raw = make(qtype, kind, 45, 768, seed=T)
    w = reference(raw, qtype)
    x = np.random.default_rng(10 + T).standard_normal((T, 768)).astype(np.float32)
    lin = weights.QuantLinear(raw, qtype, 45, 768)
    assert T <= lin.MATVEC_MAX_ROWS  # the fused kernel path
    if kind == "any-scale":  # huge and tiny scales: only finite products make a sensible check
        assert np.isfinite(w).all()
    assert_product_close(lin(x), x, w)
    assert_product_close(qm.matvec(qtype, raw, x), x, w)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_batched_rows_equal_single_rows_bit_for_bit(qtype):
    """A batch's rows go through the multi-row kernels (4 and 2 rows per decode of a block, then
    one): each result is the same float32 as that row's own matvec, so a sequence's logits do not
    depend on the batch it is decoded in."""
    raw = make(qtype, "random", 45, 768, seed=21)
    rows = weights.QuantLinear.MATVEC_MAX_ROWS  # a decode batch or a short prompt chunk
    x = np.random.default_rng(22).standard_normal((rows, 768)).astype(np.float32)
    alone = np.concatenate([qm.matvec(qtype, raw, x[t:t + 1]) for t in range(rows)])
    assert_product_close(alone, x, reference(raw, qtype))
    for T in range(2, rows + 1):
        np.testing.assert_array_equal(qm.matvec(qtype, raw, x[:T]).view(np.uint32), alone[:T].view(np.uint32),
                                      err_msg=f"{T} rows")


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_prefill_tiles_equal_dense_product(qtype):
    rows, cols, T = 40, 512, 37
    raw = make(qtype, "random", rows, cols, seed=5)
    w = reference(raw, qtype)
    x = np.random.default_rng(6).standard_normal((T, cols)).astype(np.float32)
    lin = weights.QuantLinear(raw, qtype, rows, cols)
    lin.tile_rows = 7  # 40 rows: five full tiles and a tile of 5
    assert T > lin.MATVEC_MAX_ROWS
    y = lin(x)
    assert_product_close(y, x, w)
    # the tile path multiplies the same float32 values as the dense layer does
    np.testing.assert_allclose(y, weights.DenseLinear(w)(x), rtol=1e-5, atol=1e-5 * np.abs(y).max())


def test_matvec_handles_rows_and_threads_edges():
    """One output row, and more rows than a thread's share split evenly (odd count)."""
    rng = np.random.default_rng(7)
    for rows in (1, 2, 3, 127):
        raw = quantized_from_floats(QT.Q4_1, rows, 64, rng)
        x = rng.standard_normal((2, 64)).astype(np.float32)
        assert_product_close(qm.matvec(QT.Q4_1, raw, x), x, reference(raw, QT.Q4_1))


def test_kernels_reject_inconsistent_shapes():
    raw = quantized_from_floats(QT.Q8_0, 4, 64, np.random.default_rng(0))
    with pytest.raises(ValueError):
        qm.matvec(QT.Q8_0, raw, np.zeros((1, 96), np.float32))  # rows hold 64 values
    with pytest.raises(IndexError):
        qm.dequantize_rows(QT.Q8_0, raw, np.array([4]), np.empty((1, 64), np.float32))
    with pytest.raises(IndexError):
        qm.dequantize_rows(QT.Q8_0, raw, np.array([-1]), np.empty((1, 64), np.float32))
    lin = weights.QuantLinear(raw, QT.Q8_0, 4, 64)
    with pytest.raises(ValueError):
        lin(np.zeros((2, 32), np.float32))


def test_quant_linear_shapes_and_dtypes():
    raw = quantized_from_floats(QT.Q4_0, 24, 96, np.random.default_rng(1))
    lin = weights.QuantLinear(raw, QT.Q4_0, 24, 96)
    assert (lin.out_features, lin.in_features, lin.nbytes) == (24, 96, raw.nbytes)
    assert lin(np.zeros((0, 96), np.float32)).shape == (0, 24)
    x = np.random.default_rng(2).standard_normal((2, 5, 96))  # float64, 3-D
    y = lin(x)
    assert y.shape == (2, 5, 24) and y.dtype == np.float32
    assert_product_close(y.reshape(10, 24), x.reshape(10, 96).astype(np.float32), reference(raw, QT.Q4_0))


# -- real model tensors -------------------------------------------------------------------


def _model_tensors(path):
    """One 2-D tensor of each type of a model file: name -> (info, raw view)."""
    g = GGUFFile(path)
    picked = {}
    for name, info in g.tensors.items():
        if len(info.shape) == 2 and info.ggml_type not in picked and info.ggml_type in qm.TYPES:
            picked[info.ggml_type] = (name, info, g.raw(name))
    return picked


@pytest.mark.parametrize("which", ["smollm2_path", "gemma3_path"])
def test_real_model_tensors(which, request):
    picked = _model_tensors(request.getfixturevalue(which))
    expected = {"smollm2_path": {QT.Q8_0, QT.Q4_1}, "gemma3_path": {QT.Q8_0, QT.Q5_0, QT.Q4_K, QT.Q6_K}}[which]
    assert set(picked) == expected
    rng = np.random.default_rng(3)
    for qtype, (name, info, raw) in picked.items():
        raw = raw[:300]  # the embedding tables have up to 262,144 rows
        w = reference(raw, qtype)
        rows = np.arange(raw.shape[0])
        out = np.empty_like(w)
        qm.dequantize_rows(qtype, raw, rows, out)
        np.testing.assert_array_equal(bits(out), bits(w), err_msg=name)
        lin = weights.QuantLinear(raw, qtype, raw.shape[0], info.shape[1])
        for T in (1, 3, 37):
            x = rng.standard_normal((T, info.shape[1])).astype(np.float32)
            assert_product_close(lin(x), x, w)


def test_weight_store_backends(smollm2_path, monkeypatch):
    g = GGUFFile(smollm2_path)
    info = g.tensor_info("blk.0.ffn_up.weight")
    quant = weights.WeightStore(g, backend="quant")
    dense = weights.WeightStore(g, backend="dense")
    lq = quant.linear("blk.0.ffn_up.weight", *info.shape)
    ld = dense.linear("blk.0.ffn_up.weight", *info.shape)
    assert isinstance(lq, weights.QuantLinear) and isinstance(ld, weights.DenseLinear)
    assert lq.nbytes == g.raw("blk.0.ffn_up.weight").nbytes and ld.nbytes == info.shape[0] * info.shape[1] * 4
    assert quant.loaded_bytes == lq.nbytes and dense.loaded_bytes == ld.nbytes
    np.testing.assert_array_equal(lq.weight, ld.weight)
    x = np.random.default_rng(4).standard_normal((1, info.shape[1])).astype(np.float32)
    assert_product_close(lq(x), x, ld.weight)

    # tied embedding: lookups dequantize rows, the output projection is the quantized table
    vocab, dim = g.tensor_info("token_embd.weight").shape
    eq = quant.embedding("token_embd.weight", vocab, dim)
    ed = dense.embedding("token_embd.weight", vocab, dim)
    ids = np.array([0, 5, vocab - 1, 5])
    np.testing.assert_array_equal(eq.lookup(ids), ed.lookup(ids))
    assert eq.lookup(ids).shape == (4, dim) and eq.vocab_size == vocab and eq.dim == dim
    head = eq.as_linear()
    assert isinstance(head, weights.QuantLinear) and head.raw is eq.as_linear().raw
    h = np.random.default_rng(5).standard_normal((1, dim)).astype(np.float32)
    assert_product_close(head(h), h, ed.table)
    with pytest.raises(IndexError):
        eq.lookup(np.array([vocab]))

    # the environment variable picks the default; without numba the store is dense
    monkeypatch.setenv(weights.BACKEND_ENV, "dense")
    assert weights.WeightStore(g).backend == "dense"
    monkeypatch.setenv(weights.BACKEND_ENV, "quant")
    assert weights.WeightStore(g).backend == "quant"
    monkeypatch.setenv(weights.BACKEND_ENV, "bogus")
    with pytest.raises(ValueError):
        weights.WeightStore(g)
    monkeypatch.delenv(weights.BACKEND_ENV)
    monkeypatch.setattr(weights, "HAVE_NUMBA", False)
    store = weights.WeightStore(g)
    assert store.backend == "dense"
    assert isinstance(store.linear("blk.0.ffn_up.weight", *info.shape), weights.DenseLinear)


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.IQ4_XS], ids=lambda t: t.name)
def test_tiny_model_of_a_fused_type_runs_from_its_blocks(qtype, tmp_path, monkeypatch):
    """A model whose matrices are all of a type with fused float kernels keeps every matrix as the
    file's blocks (no float32 copy), and its logits, decode (matvec) and prefill (dequantized
    tiles), equal those of the dense path (gguf's dequantized values, BLAS). On the float
    arithmetic: Q3_K takes the integer kernels by default (tests/test_int_kernels.py)."""
    from engine.models import load_model

    monkeypatch.setenv(weights.ARITH_ENV, "float")

    from .tiny_gguf import write_tiny_model
    from .tiny_variants import BLOCK_FRIENDLY, rewrite

    src = write_tiny_model(tmp_path / "f32.gguf", **BLOCK_FRIENDLY)
    path = rewrite(src, tmp_path / f"{qtype.name}.gguf", matrix_type=qtype, seed=qtype.value)
    ids = np.arange(3, 23)
    logits = {}
    for backend in ("quant", "dense"):
        monkeypatch.setenv(weights.BACKEND_ENV, backend)
        g = GGUFFile(path)
        model = load_model(g)
        linears = {"token_embd.weight": model.token_embd.as_linear()}
        if "output.weight" in g.tensors:
            linears["output.weight"] = model.lm_head
        for i, block in enumerate(model.layers):
            for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
                linears[f"blk.{i}.{name}.weight"] = getattr(block.attention, name)
            for name in ("ffn_gate", "ffn_up", "ffn_down"):
                linears[f"blk.{i}.{name}.weight"] = getattr(block.mlp, name)
        assert set(linears) == {i.name for i in g.tensors.values() if len(i.shape) == 2}
        for name, lin in linears.items():
            if backend == "quant":  # the file's own blocks: a view of the memory map, no copy
                raw = g.raw(name)
                assert isinstance(lin, weights.QuantLinear) and lin.ggml_type == qtype, name
                assert lin.raw.shape == raw.shape and np.shares_memory(lin.raw, raw), name
            else:
                assert isinstance(lin, weights.DenseLinear), name
        if backend == "quant":
            assert model.token_embd.table is None  # lookups dequantize rows of the blocks
        cache = model.new_cache()
        prefill = model.forward(ids, cache, "all")
        cache = model.new_cache()
        decode = np.concatenate([model.forward(ids[i : i + 1], cache, "last") for i in range(len(ids))])
        logits[backend] = prefill, decode
    scale = np.abs(logits["dense"][0]).max()
    assert scale > 1e-3
    (prefill_q, decode_q), (prefill_d, decode_d) = logits["quant"], logits["dense"]
    # prefill: the tiles are the dense weights bit for bit, multiplied by the same BLAS call
    assert np.abs(prefill_q - prefill_d).max() <= 1e-6 * scale
    # decode: the fused dot products sum in another order; the cache rounds K and V to float16,
    # where a last-bit difference can become one float16 ulp (2**-11 relative) of a stored value
    assert np.abs(decode_q - decode_d).max() <= 1e-3 * scale


def test_warm_up_logs(caplog):
    import logging

    qm._warm.discard(QT.Q5_1)
    with caplog.at_level(logging.INFO, logger="omlx.kernels"):
        seconds = qm.warm_up([QT.Q5_1, QT.F32])
    assert seconds >= 0 and QT.Q5_1 in qm._warm
    assert any("Q5_1" in r.getMessage() for r in caplog.records)
    assert qm.warm_up([QT.Q5_1]) == 0.0  # once per process


# -- the work-sharing pool -----------------------------------------------------------------


def _pool_or_skip():
    pool = kpool._get_pool()
    if pool is None:
        pytest.skip("one kernel thread: no pool")
    return pool


def test_pool_jobs_are_exact_and_write_nothing_late():
    """Jobs shared with the worker give exact products, also with grace 0 (the caller steals
    every chunk the worker has not finished), and no worker writes into y after the call returned
    (y is refilled with NaN and must stay NaN)."""
    import time

    pool = _pool_or_skip()
    rng = np.random.default_rng(11)
    rows, cols = 2048, 1024  # ~1.3 MB of blocks, 128 chunks: long enough for a parked worker to join
    raw = quantized_from_floats(QT.Q4_1, rows, cols, rng)
    w = reference(raw, QT.Q4_1)
    mv = qm.Matvec(QT.Q4_1, raw, cols)
    by_workers = 0
    deadline = time.monotonic() + 30
    for i in range(400):  # until the worker took part (timing-dependent)
        x = rng.standard_normal((1 + i % 3, cols)).astype(np.float32)
        y = np.full((x.shape[0], rows), np.nan, np.float32)
        with pool.lock:
            pool.kick()
            done, _ = kpool._pool_matvec(pool.ctl, pool.states, mv.compute, mv.raw, x, pool.x_buffer(x.size), y,
                                      16, 0 if i % 2 else 10**7, pool.n_workers + 1)
        by_workers += done
        assert_product_close(y, x, w)
        y[:] = np.nan
        if i % 10 == 0:
            time.sleep(0.002)
            assert np.isnan(y).all()
        if i >= 20 and by_workers or time.monotonic() > deadline:
            break
    assert by_workers > 0


def test_pool_steals_chunks_of_a_stalled_worker():
    """Chunks a worker claimed and never finished (as when it loses its core) are computed by the
    caller after the grace period: the job neither hangs nor misses rows."""
    pool = _pool_or_skip()
    rng = np.random.default_rng(13)
    raw = quantized_from_floats(QT.Q8_0, 640, 256, rng)
    w = reference(raw, QT.Q8_0)
    mv = qm.Matvec(QT.Q8_0, raw, 256)
    stalled = [1, 7, 20, 39]  # of 40 chunks of 16 rows
    for T in (1, 3):
        x = rng.standard_normal((T, 256)).astype(np.float32)
        y = np.full((T, 640), np.nan, np.float32)
        with pool.lock:
            seq = ((int(pool.ctl[kpool._WORD]) >> 32) + 1) & 0x7FFFFFFF  # the job about to be published
            for c in stalled:
                pool.states[c] = (seq << 2) | kpool._ST_COMPUTING
            _, stolen = kpool._pool_matvec(pool.ctl, pool.states, mv.compute, mv.raw, x, pool.x_buffer(x.size), y,
                                        16, 1000, pool.n_workers + 1)
        assert stolen == len(stalled)
        assert_product_close(y, x, w)


def test_pool_keeps_what_a_job_with_stolen_chunks_reads():
    """A job run through `run_job` whose chunks were stolen from a stalled worker holds `keep`
    (memory the job reads by address: that worker may still read it after the call returned);
    a job without steals does not."""
    pool = _pool_or_skip()
    rng = np.random.default_rng(17)
    raw = quantized_from_floats(QT.Q8_0, 640, 256, rng)
    w = reference(raw, QT.Q8_0)
    mv = qm.Matvec(QT.Q8_0, raw, 256)
    x = rng.standard_normal((2, 256)).astype(np.float32)

    class Owner:  # stands for the arrays a job reads by address
        pass

    stolen_owner, clean_owner = Owner(), Owner()
    pool.serial_until = 0.0
    seq = ((int(pool.ctl[kpool._WORD]) >> 32) + 1) & 0x7FFFFFFF  # the job about to be published
    for c in (3, 30):  # of 40 chunks of 16 rows: claimed by a worker that never finishes
        pool.states[c] = (seq << 2) | kpool._ST_COMPUTING
    y = np.full((2, 640), np.nan, np.float32)
    assert pool.run_job(mv.compute, mv.raw, x, y, 16, 16, keep=stolen_owner)
    assert_product_close(y, x, w)
    assert any(held is stolen_owner for held, _ in pool._raws.values())
    assert any(held is mv.raw for held, _ in pool._raws.values())  # the stalled worker reads it
    pool.serial_until = 0.0
    y2 = np.full((2, 640), np.nan, np.float32)
    assert pool.run_job(mv.compute, mv.raw, x, y2, 16, 10**9, keep=clean_owner)
    assert_product_close(y2, x, w)
    assert not any(held is clean_owner for held, _ in pool._raws.values())


def test_pool_from_several_threads():
    """Concurrent callers: one runs a job, the others fall back to their own thread."""
    import threading

    _pool_or_skip()
    rng = np.random.default_rng(12)
    layers = []
    for qtype in (QT.Q8_0, QT.Q4_1, QT.Q5_0):
        raw = quantized_from_floats(qtype, 300, 512, rng)
        layers.append((weights.QuantLinear(raw, qtype, 300, 512), reference(raw, qtype)))
    errors = []

    def run(seed):
        r = np.random.default_rng(seed)
        try:
            for i in range(60):
                lin, w = layers[i % len(layers)]
                x = r.standard_normal((1 + i % 2, 512)).astype(np.float32)
                assert_product_close(lin(x), x, w)
        except AssertionError as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_float16_conversion_without_f16c(monkeypatch):
    """The integer float16 -> float32 conversion (CPUs without F16C) is exact for every bit
    pattern: compiled here, uncached, with the F16C path switched off."""
    from numba import njit

    from engine.kernels import vector_ir

    monkeypatch.setattr(vector_ir, "_F16C", False)
    # vector conversion (F16 weights), scalar conversion (block scales)
    deq_f16 = vector_ir.make_row_dequantize(qm._DECODERS[QT.F16], *qm.block_shape(QT.F16))
    deq_q4_1 = vector_ir.make_row_dequantize(qm._DECODERS[QT.Q4_1], *qm.block_shape(QT.Q4_1))

    @njit
    def run_f16(raw, out):
        for i in range(out.shape[0]):
            deq_f16(raw[i], out[i])

    @njit
    def run_q4_1(raw, out):
        for i in range(out.shape[0]):
            deq_q4_1(raw[i], out[i])

    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty((1, 1 << 16), np.float32)
    run_f16(patterns.view(np.uint8).reshape(1, -1), out)
    ref = patterns.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(out[0]), nan)
    np.testing.assert_array_equal(bits(out[0][~nan]), bits(ref[~nan]))  # incl. ±0, subnormals, ±inf

    raw = make(QT.Q4_1, "any-scale", 16, 256, seed=9)
    out = np.empty((16, 256), np.float32)
    run_q4_1(raw, out)
    np.testing.assert_array_equal(bits(out), bits(reference(raw, QT.Q4_1)))


@pytest.mark.parametrize("lookup", ["select", "pshufb", "tbl"])
def test_code_book_lookup_on_every_target(monkeypatch, lookup):
    """IQ4_NL / IQ4_XS decode their 4-bit codes through a 16-entry table (`VectorIR.lookup16`):
    pshufb on x86, tbl on arm, a tree of lane selects elsewhere. Each way this machine can run is
    compiled here, uncached, and must reproduce gguf's values bit for bit for every code."""
    import platform

    from numba import njit

    from engine.kernels import vector_ir

    machine = platform.machine().lower()
    runs_here = {"select": True, "pshufb": machine in ("x86_64", "amd64") and vector_ir._target_has("ssse3"),
                 "tbl": machine in ("arm64", "aarch64") and vector_ir._target_has("neon")}
    if not runs_here[lookup]:
        pytest.skip(f"{lookup} is not an instruction of this CPU")
    monkeypatch.setattr(vector_ir, "_BYTE_TABLE_LOOKUP", lookup)
    for qtype in (QT.IQ4_NL, QT.IQ4_XS):
        deq = vector_ir.make_row_dequantize(qm._DECODERS[qtype], *qm.block_shape(qtype))

        @njit
        def run(raw, out):
            for i in range(out.shape[0]):
                deq(raw[i], out[i])

        raw = make(qtype, "random", 8, 512, seed=21)
        block, size = GGML_QUANT_SIZES[qtype]
        codes = raw.reshape(-1, size)[:, size - block // 2:]  # the nibble bytes of every block
        codes[0, :16] = np.arange(16, dtype=np.uint8) * 17  # both nibbles of a byte: every code once
        out = np.empty((8, 512), np.float32)
        run(raw, out)
        np.testing.assert_array_equal(bits(out), bits(reference(raw, qtype)), err_msg=f"{lookup} {qtype.name}")


def test_kernel_caches_depend_on_the_shared_vector_ir(monkeypatch):
    """numba keys a cached kernel by its own source file; the kernels of both kernel modules inline
    the IR of engine/kernels/vector_ir.py, so their cache stamp carries that file's content hash
    too, and a different hash (an edit there) makes numba treat their cached code as stale."""
    from engine.kernels import kv_codes, vector_ir

    for kernel in (qm._rows_q4_1, kpool._pool_matvec, kv_codes._halves, kv_codes.decode_attention):
        locator = kernel._cache._impl.locator
        stamp = locator.get_source_stamp()
        assert isinstance(locator, tuple(vector_ir._LOCATORS)) and stamp[1] == vector_ir.SHARED_IR_HASH
        monkeypatch.setattr(vector_ir, "SHARED_IR_HASH", "edited")
        assert locator.get_source_stamp() != stamp
        monkeypatch.undo()
    from numba import njit

    @njit(cache=True)  # a function outside engine/kernels/ keeps numba's own locator (never compiled here)
    def elsewhere(x):
        return x

    assert not isinstance(elsewhere._cache._impl.locator, tuple(vector_ir._LOCATORS))
