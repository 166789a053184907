"""Tiny random-weight models: cache equivalence, sliding windows, weight types."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize

from engine.gguf_file import GGUFFile
from engine.models import load_model
from engine.weights import WeightStore

from .tiny_gguf import write_tiny_model


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf", request.param)
    return load_model(GGUFFile(path))


def test_prefill_in_chunks_and_decode_agree_with_one_pass(tiny):
    rng = np.random.default_rng(1)
    ids = rng.integers(3, tiny.vocab_size, size=40)
    whole = tiny.forward(ids, tiny.new_cache(), "all")
    assert whole.shape == (40, tiny.vocab_size)

    cache = tiny.new_cache()
    parts = [tiny.forward(ids[s : s + 7], cache, "all") for s in range(0, 40, 7)]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-3, atol=2e-3)
    assert cache.offset == 40

    cache = tiny.new_cache()
    steps = [tiny.forward(ids[i : i + 1], cache, "last") for i in range(40)]
    np.testing.assert_allclose(np.concatenate(steps), whole, rtol=1e-3, atol=2e-3)


def test_logits_only_where_asked(tiny):
    ids = np.arange(3, 23)
    whole = tiny.forward(ids, tiny.new_cache(), "all")
    last = tiny.forward(ids, tiny.new_cache(), "last")
    some = tiny.forward(ids, tiny.new_cache(), np.array([0, 5, 19]))
    none = tiny.forward(ids, tiny.new_cache(), np.empty(0, np.int64))
    np.testing.assert_allclose(last, whole[-1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(some, whole[[0, 5, 19]], rtol=1e-5, atol=1e-5)
    assert none.shape == (0, tiny.vocab_size)


def test_trim_then_refill_reproduces_logits(tiny):
    ids = np.arange(3, 33)
    cache = tiny.new_cache()
    first = tiny.forward(ids, cache, "all")
    cache.trim(10)
    assert cache.offset == 20
    again = tiny.forward(ids[20:], cache, "all")
    np.testing.assert_allclose(again, first[20:], rtol=1e-3, atol=2e-3)


def test_gemma3_sliding_window_bounds_what_a_position_sees(tmp_path):
    # Two layers, both local (window 8): position p depends on tokens p-14 .. p only.
    model = load_model(GGUFFile(write_tiny_model(tmp_path / "g.gguf", "gemma3", sliding_window=8)))
    assert model.layer_window(0) == 8 and model.layer_window(1) == 8
    rng = np.random.default_rng(2)
    ids = rng.integers(3, model.vocab_size, size=40)
    changed = ids.copy()
    changed[0] = (ids[0] + 1) % model.vocab_size
    a = model.forward(ids, model.new_cache(), "all")
    b = model.forward(changed, model.new_cache(), "all")
    np.testing.assert_allclose(a[15:], b[15:], rtol=1e-5, atol=1e-5)
    assert np.abs(a[1:8] - b[1:8]).max() > 1e-3


def test_gemma3_global_layers_every_sixth(tmp_path):
    model = load_model(GGUFFile(write_tiny_model(tmp_path / "g.gguf", "gemma3", n_layers=12)))
    assert [i for i in range(12) if model.layer_window(i) is None] == [5, 11]


@pytest.mark.parametrize("qtype,tol", [
    (QT.F16, 0.01), (QT.BF16, 0.05), (QT.Q8_0, 0.05), (QT.Q5_1, 0.25), (QT.Q5_0, 0.25),
    (QT.Q4_1, 0.5), (QT.Q4_0, 0.5),
])
def test_quantized_weights_give_nearly_the_f32_model(tmp_path, qtype, tol):
    ref = load_model(GGUFFile(write_tiny_model(tmp_path / "f32.gguf", weight_type=QT.F32)))
    quant = load_model(GGUFFile(write_tiny_model(tmp_path / "q.gguf", weight_type=qtype)))
    ids = np.arange(3, 20)
    a = ref.forward(ids, ref.new_cache(), "all")
    b = quant.forward(ids, quant.new_cache(), "all")
    rel = np.abs(a - b).mean() / np.abs(a).mean()
    assert rel < tol, f"{qtype.name}: relative error {rel:.4f}"


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_1])
def test_weight_store_reads_block_types_row_by_row(tmp_path, qtype):
    """Rows come back as gguf's dequantizer gives them, shaped (out, in), for every block type
    (K-quants written as random blocks with sane scales: gguf-py has no quantizer for them)."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = 24, 512
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    # Keep the f16 scale fields finite: put small f16 values in every 2-byte slot of the block's
    # header area for K-quants (d/dmin at the start for Q4_K/Q5_K, at the end for Q6_K).
    blocks = raw.reshape(rows, -1, size)
    small = np.array([0.01], np.float16).view(np.uint8)
    if qtype == QT.Q6_K:
        blocks[..., size - 2 : size] = small
    elif qtype in (QT.Q4_K, QT.Q5_K):
        blocks[..., 0:2] = small
        blocks[..., 2:4] = small
    else:  # Q8_0 / Q4_1: f16 d (and m) lead each block
        blocks[..., 0:2] = small
        if qtype == QT.Q4_1:
            blocks[..., 2:4] = small
    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("m.weight", raw, raw_dtype=qtype)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    lin = WeightStore(GGUFFile(path)).linear("m.weight", rows, cols)
    expected = dequantize(raw, qtype).reshape(rows, cols)
    assert lin.weight.shape == (rows, cols)
    np.testing.assert_array_equal(lin.weight, expected)
    assert np.isfinite(lin.weight).all()


@pytest.mark.parametrize("dim", [5, 8, 64, 129, 256, 576, 640, 960, 2048, 3072])
def test_compiled_rms_norm_is_the_numpy_expression_bit_for_bit(dim):
    """rms_norm runs float32 rows through one compiled call that reproduces numpy's pairwise sum;
    it must equal the numpy expression exactly (the numpy path serves other dtypes and layouts),
    for one row (decode), many rows (prefill, shared by two threads from NORM_SHARED_ROWS) and
    per-head norms (T, H, D)."""
    from engine.kernels import norms

    rng = np.random.default_rng(dim)
    weight = rng.standard_normal(dim).astype(np.float32)
    for shape in [(1, dim), (7, dim), (3, 4, dim), (norms.NORM_SHARED_ROWS + 3, dim), (20, 8, dim)]:
        x = (rng.standard_normal(shape) * rng.uniform(0.01, 300)).astype(np.float32)
        ms = np.add.reduce(np.square(x), axis=-1, keepdims=True) / np.float32(dim)
        expected = x * (1.0 / np.sqrt(ms + np.float32(1e-6))) * weight
        got = norms.rms_norm(x, weight, 1e-6)
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_array_equal(got, expected)
    strided = np.asfortranarray(rng.standard_normal((6, dim)).astype(np.float32))  # the numpy path
    ms = np.add.reduce(np.square(strided), axis=-1, keepdims=True) / np.float32(dim)
    np.testing.assert_array_equal(norms.rms_norm(strided, weight, 1e-6),
                                  strided * (1.0 / np.sqrt(ms + np.float32(1e-6))) * weight)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("head_dim", [64, 48, 256])
def test_rope_kernel_is_the_numpy_rotation_bit_for_bit(neox, head_dim):
    """Every rotation of float32 rows (a decode token, a verify pass, a prefill shared between
    two threads) is one compiled kernel; it must equal the numpy expressions exactly, or a
    token rotated alone would differ from the same token in a batch."""
    from engine.kernels.norms import ROPE_SHARED_ROWS, apply_rope, rope_numpy
    from engine.models.base import rope_tables

    rng = np.random.default_rng(2)
    n = ROPE_SHARED_ROWS + 37
    x = (rng.standard_normal((n, 9, head_dim)) * 4).astype(np.float32)
    cos, sin = rope_tables(np.arange(4321, 4321 + n), head_dim, 10000.0)
    by_numpy = rope_numpy(x, cos, sin, neox)
    for rows in (1, 3, ROPE_SHARED_ROWS - 1, ROPE_SHARED_ROWS, n):
        np.testing.assert_array_equal(apply_rope(x[:rows], cos[:rows], sin[:rows], neox), by_numpy[:rows])
    strided = x.transpose(1, 0, 2).copy().transpose(1, 0, 2)  # x's values, not C-contiguous
    np.testing.assert_array_equal(apply_rope(strided, cos, sin, neox), by_numpy)
    # a partial rotation's channels (a strided view), as `Rope.rotate` passes them
    np.testing.assert_array_equal(apply_rope(x[..., :32], *(t[:, :16] for t in (cos, sin)), neox),
                                  rope_numpy(x[..., :32], cos[:, :16], sin[:, :16], neox))
    half = x.shape[-1] // 2
    a, b = (x[..., :half], x[..., half:]) if neox else (x[..., 0::2], x[..., 1::2])
    c, s = cos[:, None, :], sin[:, None, :]
    ra, rb = (by_numpy[..., :half], by_numpy[..., half:]) if neox else (by_numpy[..., 0::2], by_numpy[..., 1::2])
    np.testing.assert_allclose(ra, a * c - b * s, rtol=1e-6, atol=1e-6)  # and it is the rotation
    np.testing.assert_allclose(rb, a * s + b * c, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(by_numpy, x)
