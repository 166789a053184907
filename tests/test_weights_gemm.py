"""The linear layers' many-row products (`weights.QuantLinear`'s tiles + BLAS, `DenseLinear`):
each row's values do not depend on which other rows share the product, the rule the serve
scheduler's batching relies on (`serve.scheduler.min_batched_chunk`, `kv.batch`)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import quantize

from engine import weights
from engine.engine import Engine
from engine.kv.batch import DecodeBatch
from engine.serve.scheduler import DECODE_GROUP
from engine.weights import DenseLinear, QuantLinear

from .tiny_gguf import write_tiny_model

# (out_features, in_features) of SmolLM2 135M (K/V, Q/O, up/gate, down) and Gemma3 270M (K/V)
SHAPES = [(192, 576), (576, 576), (1536, 576), (576, 1536), (256, 640)]
# the fewest rows SmolLM2's chunks batch with (min_batched_chunk: past the rows the fused kernels
# take, 16; OpenBLAS's small-product bound, 2048 outputs / 192 features = 11, lies below)
SMOLLM2_MIN_CHUNK = QuantLinear.MATVEC_MAX_ROWS + 1


def q8_linear(rows: int, cols: int, seed: int, arith: str = "float") -> QuantLinear:
    """Q8_0 on the float kernels and tiles (what this file is about), or on the integer ones."""
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(data, QT.Q8_0)).view(np.uint8).reshape(rows, -1)
    return QuantLinear(raw, QT.Q8_0, rows, cols, arith=arith)


# OpenBLAS's Haswell kernels (AVX2 CPUs, AMD's Zen 4, OPENBLAS_CORETYPE=Haswell) round a row of a
# product differently with the number of rows; the scheduler then batches no prefill through BLAS
# (`min_batched_chunk`, tests/test_serve_batch_prefill.py) and these properties do not apply
needs_row_independent_blas = pytest.mark.skipif(
    not weights.blas_rows_independent(), reason="this BLAS rounds a row differently with the number of rows")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@needs_row_independent_blas
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_both_product_layouts_give_the_same_bits(out_features, in_features):
    """Which layout a product takes (by its number of rows) does not change its values: a chunk
    of few rows (transposed product) equals its rows inside a batch of many (direct product)."""
    rng = np.random.default_rng(out_features + in_features)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    for T in (SMOLLM2_MIN_CHUNK, 46, weights.TRANSPOSED_PRODUCT_MAX_ROWS,
              weights.TRANSPOSED_PRODUCT_MAX_ROWS + 1, 200):
        x = rng.standard_normal((T, in_features)).astype(np.float32)
        transposed = np.ascontiguousarray((w @ x.T).T)
        direct = x @ w.T
        np.testing.assert_array_equal(bits(transposed), bits(direct))
        np.testing.assert_array_equal(bits(weights._product(x, w)), bits(direct))


CHUNKINGS = [
    (SMOLLM2_MIN_CHUNK, SMOLLM2_MIN_CHUNK, SMOLLM2_MIN_CHUNK),  # all transposed, the batch too
    (SMOLLM2_MIN_CHUNK, 46, weights.TRANSPOSED_PRODUCT_MAX_ROWS),  # alone transposed, batch direct
    (weights.TRANSPOSED_PRODUCT_MAX_ROWS + 1, 17, 160),  # both layouts among the chunks
    (128, 256, 300),  # all direct
]


@pytest.mark.parametrize("out_features,in_features", SHAPES[:4])
@pytest.mark.parametrize("tiled", [
    pytest.param(False, id="one-tile", marks=needs_row_independent_blas),
    pytest.param(True, id="tiles", marks=needs_row_independent_blas),
    pytest.param(None, id="integer-kernels")])
def test_quant_linear_rows_of_a_batch_equal_each_chunk_alone(out_features, in_features, tiled):
    if tiled is None and not weights.weight_arith(QT.Q8_0, out_features, in_features) == "int":
        pytest.skip("no integer kernels on this CPU")
    lin = q8_linear(out_features, in_features, seed=out_features, arith="int" if tiled is None else "float")
    if tiled is None and lin.int_max_rows < weights.EVERY_ROW_COUNT and not weights.blas_rows_independent():
        pytest.skip("long inputs take BLAS on this instruction set, and this BLAS rounds a row differently "
                    "with the number of rows")
    if tiled:  # several tiles per product, as a 1B model's matrices take; as real tiles are, none
        lin.tile_rows = max(192, out_features // 3)  # narrower than SmolLM2's narrowest layer
    rng = np.random.default_rng(in_features)
    for sizes in CHUNKINGS:
        chunks = [rng.standard_normal((n, in_features)).astype(np.float32) for n in sizes]
        together = lin(np.concatenate(chunks))
        alone = np.concatenate([lin(c) for c in chunks])
        np.testing.assert_array_equal(bits(together), bits(alone), err_msg=f"chunks {sizes}")


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_dense_linear_rows_up_to_max_rows_alone_are_each_computed_alone(out_features, in_features):
    rng = np.random.default_rng(7)
    lin = DenseLinear(rng.standard_normal((out_features, in_features)).astype(np.float32))
    x = rng.standard_normal((DenseLinear.MAX_ROWS_ALONE, in_features)).astype(np.float32)
    alone = np.concatenate([lin(x[i : i + 1]) for i in range(len(x))])
    for T in range(1, DenseLinear.MAX_ROWS_ALONE + 1):
        np.testing.assert_array_equal(bits(lin(x[:T])), bits(alone[:T]), err_msg=f"{T} rows")
    assert lin(x[0]).shape == (out_features,)  # one vector in, one out
    with pytest.raises(ValueError, match="features"):
        lin(x[:, :-1])


@pytest.mark.parametrize("out_features,in_features", SHAPES[:2])
def test_quant_linear_short_chunks_take_the_fused_kernels_row_by_row_exact(out_features, in_features):
    """Up to MATVEC_MAX_ROWS rows (a decode batch, a follow-up message's prefill) each row comes out
    exactly as alone; one more row goes to the tiles and BLAS, which round differently."""
    lin = q8_linear(out_features, in_features, seed=3)
    rng = np.random.default_rng(4)
    n = QuantLinear.MATVEC_MAX_ROWS
    x = rng.standard_normal((n + 1, in_features)).astype(np.float32)
    alone = np.concatenate([lin(x[i : i + 1]) for i in range(n + 1)])
    for T in (2, 9, n):
        np.testing.assert_array_equal(bits(lin(x[:T])), bits(alone[:T]), err_msg=f"{T} rows")
    assert not np.array_equal(bits(lin(x)), bits(alone))  # the tile path: a different summation


@needs_row_independent_blas
def test_dense_linear_many_rows_equal_each_chunk_alone():
    rng = np.random.default_rng(8)
    lin = DenseLinear(rng.standard_normal((192, 576)).astype(np.float32))
    for sizes in CHUNKINGS:
        chunks = [rng.standard_normal((n, 576)).astype(np.float32) for n in sizes]
        together = lin(np.concatenate(chunks))
        np.testing.assert_array_equal(bits(together), bits(np.concatenate([lin(c) for c in chunks])))
        np.testing.assert_allclose(together, np.concatenate(chunks) @ lin.weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_float32_model_decode_batch_logits_equal_each_sequence_alone(tmp_path, arch):
    """A model of float32 matrices (DenseLinear everywhere, the output layer too): a decode batch of
    up to DECODE_GROUP sequences (the serve scheduler's pass) gives each sequence the logits of its
    own decode step."""
    path = write_tiny_model(tmp_path / f"tiny-{arch}.gguf", arch, context_length=256, weight_type=QT.F32,
                            seed=5)
    engine = Engine.load(path, kv="full")
    engine.disk_cache = False
    assert isinstance(engine.model.lm_head, DenseLinear)
    prompts = [[5, 6, 7], list(range(40, 90)), [9] * 33, list(range(100, 117)), [4] * 12,
               list(range(60, 68)), [11, 12], list(range(20, 45))]
    assert len(prompts) == DECODE_GROUP
    pc = engine.prefix_cache()

    def prefilled():
        seqs = [pc.new_sequence(limit=256) for _ in prompts]
        for seq, ids in zip(seqs, prompts):
            engine.prefill(ids, seq)
        return seqs

    alone_seqs, batch_seqs = prefilled(), prefilled()
    rng = np.random.default_rng(0)
    for _ in range(6):
        tokens = rng.integers(3, 200, size=len(prompts))
        alone = [engine.model.forward(np.array([t]), seq, "last")[0] for seq, t in zip(alone_seqs, tokens)]
        together = engine.model.forward(tokens, DecodeBatch(batch_seqs), "all")
        np.testing.assert_array_equal(bits(together), bits(np.stack(alone)))
    for seq in alone_seqs + batch_seqs:
        seq.release()
