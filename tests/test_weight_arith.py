"""The integer weight kernels wired into QuantLinear (the default where this CPU has them): which
matrices take them, that a layer computes exactly what its kernel does at every row count, that
embedding lookups read the repacked copy right, and that a whole model's output distribution stays
within KL 1e-5 of the float kernels' on the reference texts (issue 26's exactness bar)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize

from engine import weights
from engine.engine import Engine
from engine.errors import SettingsError
from engine.kernels import int_dot, int_matvec
from engine.weights import QuantLinear, linear_layers

from .conftest import reference_npz_path
from .weight_blocks import blocks

INT_ISAS = [i for i in int_dot.ISA_LANES if int_dot.isa_available(i)]
INT_CAPS = dict(int_dot.INT_MAX_ROWS)  # as shipped, before any test patches it
pytestmark = pytest.mark.skipif(not INT_ISAS, reason="no x86 integer instruction set on this CPU")


@pytest.mark.parametrize("qtype", list(int_matvec.INT_TYPES), ids=lambda t: t.name)
def test_a_layer_takes_the_integer_kernels_at_every_row_count_its_isa_allows(qtype):
    raw = blocks(qtype, 64, 256)
    lin = QuantLinear(raw, qtype, 64, 256)
    assert lin.arith == "int" and lin.raw is None
    assert lin.int_max_rows == (int_dot.INT_MAX_ROWS[int_dot.kernel_isa()] or weights.EVERY_ROW_COUNT)
    kernel = int_matvec.IntMatvec(qtype, raw, 256, int_dot.kernel_isa())
    x = np.random.default_rng(1).standard_normal((300, 256)).astype(np.float32)
    alone = kernel(x, np.empty((300, 64), np.float32))
    w = dequantize(raw, qtype).reshape(64, 256).astype(np.float64)
    for T in (1, 4, 16, 17, 64, 300):  # the matvec sizes, a prompt chunk, past the pool's job size
        if T <= lin.int_max_rows:
            assert np.array_equal(lin(x[:T]).view(np.uint32), alone[:T].view(np.uint32)), T
        else:  # past the ISA's integer rows (AVX2): float tiles of the same matrix and BLAS
            scale = np.abs(x[:T]).astype(np.float64) @ np.abs(w).T
            assert np.max(np.abs(lin(x[:T]) - x[:T].astype(np.float64) @ w.T) / scale) < 1e-5, T
    assert lin(x[:3].reshape(3, 1, 256)).shape == (3, 1, 64)
    assert lin(x[:0]).shape == (0, 64)
    # the embedding side: rows dequantized from the repacked copy equal the file's blocks
    ids = np.array([0, 63, 5, 5, 31])
    want = dequantize(raw, qtype).reshape(64, 256)[ids]
    assert np.array_equal(lin.rows(ids), want)
    with pytest.raises(IndexError, match="out of range"):
        lin.rows(np.array([64]))


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_layers_sharing_an_input_quantize_it_once_and_compute_what_each_does_alone(fast, monkeypatch):
    # q, k and v (gate and up) read one x: `products` quantizes it once per kind of activations,
    # long inputs on two threads; every layer's output is bit-identical to calling it alone
    layers = [QuantLinear(blocks(qt, 32, 256, seed=i), qt, 32, 256) for i, qt in enumerate((QT.Q4_0, QT.Q6_K, QT.Q8_0))]
    layers.append(QuantLinear(blocks(QT.Q4_0, 32, 256), QT.Q4_0, 32, 256, arith="float"))
    for lin in layers:
        lin.fast = fast and lin.arith == "int"
    calls = []
    real = weights.quantize_input
    monkeypatch.setattr(weights, "quantize_input", lambda x, f: calls.append(f) or real(x, f))
    rng = np.random.default_rng(2)
    for T in (1, 16, weights.PARALLEL_QUANTIZE_ROWS, 300):
        x = rng.standard_normal((T, 256)).astype(np.float32)
        calls.clear()
        together = weights.products(layers, x)
        assert calls == [int_dot.activation_form(int_dot.kernel_isa(), fast)] or T > layers[0].int_max_rows, (T, calls)
        for lin, y in zip(layers, together):
            assert np.array_equal(y.view(np.uint32), lin(x).view(np.uint32)), (T, lin.ggml_type)
    form = int_dot.activation_form(int_dot.kernel_isa(), fast)
    x = rng.standard_normal((2 * weights.PARALLEL_QUANTIZE_ROWS + 1, 256)).astype(np.float32)
    assert np.array_equal(real(x, form).view(np.uint32), int_dot.quantize_form(x, form).view(np.uint32))


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_a_layer_group_is_one_pool_job_with_each_layers_bits(fast):
    # q, k and v of mixed types (Q4_K_M files give v Q6_K) and sizes that do not fill a pool chunk:
    # one job over their stacked rows (`IntMatvecGroup`) gives each layer's own product bit for bit
    # at every row count, views of one output for a single row
    shapes = ((QT.Q4_K, 96), (QT.Q4_K, 16), (QT.Q6_K, 48), (QT.Q8_0, 1024))
    layers = [QuantLinear(blocks(qt, n, 512, seed=i), qt, n, 512) for i, (qt, n) in enumerate(shapes)]
    for lin in layers:
        lin.fast = fast
    group = weights.LinearGroup(layers)
    assert group._joint is not None and group._joint.n_rows == sum(n for _, n in shapes)
    assert group._joint.chunk < group._joint.n_rows  # several chunks: the pool shares them
    rng = np.random.default_rng(5)
    for T in (1, 2, 5, 16, 17, 40):
        x = rng.standard_normal((T, 512)).astype(np.float32)
        together = group(x)
        for lin, y in zip(layers, together):
            assert y.shape == (T, lin.out_features) and y.flags.c_contiguous
            assert np.array_equal(y.view(np.uint32), lin(x).view(np.uint32)), (T, lin.ggml_type, lin.out_features)
    # layers on different paths (a float one among them) are no group: each computes alone
    mixed = weights.LinearGroup(layers[:2] + [QuantLinear(blocks(QT.Q4_0, 32, 512), QT.Q4_0, 32, 512, arith="float")])
    assert mixed._joint is None
    x = rng.standard_normal((1, 512)).astype(np.float32)
    assert all(np.array_equal(y, lin(x)) for lin, y in zip(mixed.layers, mixed(x)))


def test_float_arithmetic_on_request_and_for_types_without_integer_kernels(monkeypatch):
    raw = blocks(QT.Q4_0, 32, 256)
    assert QuantLinear(raw, QT.Q4_0, 32, 256, arith="float").raw is not None
    monkeypatch.setenv(weights.ARITH_ENV, "float")
    assert QuantLinear(raw, QT.Q4_0, 32, 256).arith == "float"
    monkeypatch.setenv(weights.ARITH_ENV, "fastt")
    with pytest.raises(ValueError, match="did you mean 'fast'"):
        weights.weight_arith(QT.Q4_0, 32, 256)
    monkeypatch.delenv(weights.ARITH_ENV)
    assert weights.weight_arith(QT.Q2_K, 32, 256) == "float"  # no integer kernel yet
    assert weights.weight_arith(QT.Q4_0, 40, 256) == "float"  # rows not whole 16-row groups


def _log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_model_output_within_kl_1e_5_of_the_float_kernels(name, smollm2_path, gemma3_path, monkeypatch):
    path = smollm2_path if name == "smollm2-135m-instruct" else gemma3_path
    tokens = np.load(reference_npz_path(name, "gpl-3"))["tokens"][:160]
    at = np.arange(len(tokens))
    logits = {}
    for arith in ("float", "exact"):
        monkeypatch.setenv(weights.ARITH_ENV, arith)
        engine = Engine.load(path, kv="full")
        ariths = {lin.arith for lin in linear_layers(engine.model) if isinstance(lin, QuantLinear)}
        assert ariths == ({"float"} if arith == "float" else {"int"})  # Gemma3: Q4_K, Q5_0, Q6_K, Q8_0
        logits[arith] = engine.model.forward(tokens, engine.new_cache(), at)
    p, q = _log_softmax(logits["float"]), _log_softmax(logits["exact"])
    kl = np.sum(np.exp(p) * (p - q), axis=-1)
    assert float(kl.mean()) <= 1e-5, f"{name}: mean KL {kl.mean():.2e} vs the float kernels"
    assert np.mean(np.argmax(p, -1) == np.argmax(q, -1)) >= 0.99


def test_prefill_batching_follows_the_blas_and_the_layers(tmp_path, monkeypatch):
    """The scheduler batches prefill chunks of several sequences only where a row comes out the
    same in any batch: always on the integer kernels; through BLAS only where this BLAS keeps a
    row's bits whatever the row count (measured once, `blas_rows_independent`)."""
    from engine.serve.scheduler import min_batched_chunk

    from .tiny_gguf import write_tiny_model

    def tiny(arith):
        monkeypatch.setenv(weights.ARITH_ENV, arith)
        return Engine.load(write_tiny_model(tmp_path / f"tiny-{arith}.gguf", "llama", context_length=256,
                                            weight_type=QT.Q8_0, seed=3), kv="full").model

    on_blas = tiny("float")
    capped = tiny("exact")  # as the instruction set has it: AVX2 sends long inputs to BLAS
    for isa in int_dot.INT_MAX_ROWS:  # the integer kernels at every row count, as with VNNI
        monkeypatch.setitem(int_dot.INT_MAX_ROWS, isa, None)
    on_int = tiny("exact")
    assert not weights.products_use_blas(on_int) and weights.products_use_blas(on_blas)
    assert weights.integer_rows(on_int) is None and weights.integer_rows(on_blas) is None
    cap = weights.integer_rows(capped)
    assert cap == INT_CAPS[int_dot.kernel_isa()]
    assert weights.products_use_blas(capped) == (cap is not None)
    for independent in (True, False):
        monkeypatch.setattr(weights, "_blas_rows_independent", independent)
        assert min_batched_chunk(on_int) <= 512
        assert (min_batched_chunk(on_blas) <= 512) == independent
        assert (min_batched_chunk(capped) <= 512) == (independent or cap is None)
    monkeypatch.setattr(weights, "_blas_rows_independent", None)  # measured again
    w = np.random.default_rng(2).standard_normal((576, 1536)).astype(np.float32)
    x = np.random.default_rng(3).standard_normal((300, 1536)).astype(np.float32)
    rows_same = np.array_equal(weights._product(x[:200], w), weights._product(x, w)[:200])
    if not rows_same:  # a row that changed with the row count: the probe must have seen it too
        assert not weights.blas_rows_independent()


def test_fast_mode_switches_at_run_time_at_llama_cpp_accuracy(smollm2_path, monkeypatch):
    """Engine.set_arith("fast"): every integer layer takes int8 activations (a mean KL vs exact of
    the order llama.cpp's int8 run has against its float32 one, 0.003-0.008 on these texts, and
    clearly not zero), back to the exact bits on "exact"; float needs a reload."""
    monkeypatch.delenv(weights.ARITH_ENV, raising=False)
    tokens = np.load(reference_npz_path("smollm2-135m-instruct", "gpl-3"))["tokens"][:160]
    engine = Engine.load(smollm2_path, kv="full")
    assert engine.arith == "exact"
    # chunks the integer kernels take whole (AVX2 sends longer ones to float tiles)
    chunk = weights.integer_rows(engine.model) or len(tokens)

    def forward():
        cache = engine.new_cache()
        return np.concatenate([engine.model.forward(tokens[s : s + chunk], cache, np.arange(len(tokens[s : s + chunk])))
                               for s in range(0, len(tokens), chunk)])

    exact = forward()
    engine.set_arith("fast")
    assert engine.arith == "fast" and all(lin.fast for lin in engine._int_layers())
    fast = forward()
    engine.set_arith("exact")
    assert np.array_equal(forward(), exact)
    p, q = _log_softmax(exact), _log_softmax(fast)
    kl = float(np.sum(np.exp(p) * (p - q), axis=-1).mean())
    assert 1e-4 < kl < 0.01, kl
    assert np.mean(np.argmax(p, -1) == np.argmax(q, -1)) >= 0.9
    with pytest.raises(SettingsError, match="chosen when a model loads"):
        engine.set_arith("float")
    with pytest.raises(SettingsError, match="did you mean 'exact'"):
        engine.set_arith("exakt")


def test_fast_and_exact_prefixes_never_mix(smollm2_path, monkeypatch, tmp_path):
    monkeypatch.delenv(weights.ARITH_ENV, raising=False)
    engine = Engine.load(smollm2_path, kv="full")
    engine.disk_cache = False
    exact_cache = engine.prefix_cache()
    engine.set_arith("fast")
    fast_cache = engine.prefix_cache()
    assert fast_cache is not exact_cache and fast_cache.root != exact_cache.root
    assert fast_cache.model_id == engine.model_id + "+fast"
    engine.set_arith("exact")
    assert engine.prefix_cache().model_id == engine.model_id


def test_omlx_arith_fast_loads_in_fast_mode_and_float_stays_float(smollm2_path, monkeypatch):
    monkeypatch.setenv(weights.ARITH_ENV, "fast")
    assert Engine.load(smollm2_path, kv="full").arith == "fast"
    monkeypatch.setenv(weights.ARITH_ENV, "float")
    engine = Engine.load(smollm2_path, kv="full")
    assert engine.arith == "float" and not engine._int_layers()
    with pytest.raises(SettingsError, match="loaded with OMLX_ARITH=float"):
        engine.set_arith("fast")
