"""Every tensor type the `gguf` package can dequantize loads: matrices of types with a fused kernel
stay as blocks, the others are dequantized at load; either way the engine's weights are exactly
gguf's dequantized values and a model runs. A type the engine cannot read is a clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize

from engine import cli
from engine.errors import UnsupportedModel, describe
from engine.gguf_file import GGUFFile
from engine.models import load_model
from engine.weights import SUPPORTED_TYPES, DenseLinear, QuantLinear, WeightStore

from .tiny_gguf import write_tiny_model
from .tiny_variants import BLOCK_FRIENDLY, random_blocks, rewrite

# The types issue 13 names; SUPPORTED_TYPES may hold more (whatever gguf dequantizes).
REQUIRED_TYPES = [
    QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS,
]
ALL_TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.value)


def test_supported_types_are_what_gguf_dequantizes():
    assert set(REQUIRED_TYPES) <= SUPPORTED_TYPES
    for qtype in (QT.Q8_1, QT.Q8_K, QT.I32, QT.F64):  # gguf has no dequantizer for these
        assert qtype not in SUPPORTED_TYPES


@pytest.fixture(scope="module")
def f32_source(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("src") / "f32.gguf", **BLOCK_FRIENDLY)


@pytest.fixture(scope="module")
def typed_file(f32_source, tmp_path_factory):
    made = {}

    def make(qtype: QT):
        if qtype not in made:
            made[qtype] = rewrite(f32_source, tmp_path_factory.mktemp("typed") / f"{qtype.name}.gguf",
                                  matrix_type=qtype, seed=qtype.value)
        return made[qtype]

    return make


@pytest.mark.parametrize("backend", ["quant", "dense"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_loaded_weights_are_ggufs_dequantized_values(typed_file, qtype, backend):
    g = GGUFFile(typed_file(qtype))
    store = WeightStore(g, backend=backend)
    matrices = [info for info in g.tensors.values() if len(info.shape) == 2]
    assert matrices and all(info.ggml_type == qtype for info in matrices)
    for info in matrices:
        lin = store.linear(info.name, *info.shape)
        expected = dequantize(g.raw(info.name), qtype).reshape(info.shape)
        assert lin.weight.dtype == np.float32 and lin.weight.shape == info.shape
        np.testing.assert_array_equal(lin.weight, expected, err_msg=f"{qtype.name} {info.name}")
        if backend == "dense":
            assert isinstance(lin, DenseLinear)
        x = np.random.default_rng(0).standard_normal((3, info.shape[1])).astype(np.float32)
        np.testing.assert_allclose(lin(x), x @ expected.T, rtol=1e-4, atol=1e-4)
    assert isinstance(store.linear(matrices[0].name, *matrices[0].shape), (QuantLinear, DenseLinear))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_a_model_of_each_type_runs_and_decode_matches_prefill(typed_file, qtype):
    model = load_model(GGUFFile(typed_file(qtype)))
    ids = np.arange(3, 23)
    whole = model.forward(ids, model.new_cache(), "all")
    assert whole.shape == (20, model.vocab_size) and np.isfinite(whole).all()
    assert np.std(whole) > 1e-3  # the weights are not all zero
    cache = model.new_cache()
    steps = np.concatenate([model.forward(ids[i : i + 1], cache, "last") for i in range(20)])
    # decode (fused kernels where the type has them) and prefill (dequantized tiles, BLAS) sum
    # in different orders: equal up to float32 rounding relative to the logits' scale
    assert np.abs(steps - whole).max() <= 1e-3 * np.abs(whole).max()


@pytest.mark.parametrize("qtype", REQUIRED_TYPES, ids=lambda t: t.name)
def test_omlx_generate_runs_on_each_type(typed_file, qtype, capsys):
    rc = cli.main(["generate", str(typed_file(qtype)), "--prompt", "the the", "--max-tokens", "4", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    result = json.loads(out.out)
    assert 1 <= len(result["ids"]) <= 4
    assert result["stats"]["prompt_tokens"] > 0


def _write_with_matrix_type(src, dst, name: str, qtype: QT) -> None:
    """A copy of `src` whose tensor `name` is random bytes of type `qtype` (no dequantizer needed)."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if t.name == name:
            block, size = GGML_QUANT_SIZES[qtype]
            raw = np.zeros((shape[0], shape[1] // block * size), np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


@pytest.mark.parametrize("qtype", [QT.Q8_K, QT.Q8_1])
def test_a_type_gguf_cannot_dequantize_is_a_clear_error(f32_source, tmp_path, qtype, capsys):
    path = tmp_path / "bad.gguf"
    _write_with_matrix_type(f32_source, path, "blk.1.ffn_up.weight", qtype)
    with pytest.raises(UnsupportedModel) as err:
        load_model(GGUFFile(path))
    message = str(err.value)
    assert "blk.1.ffn_up.weight" in message and qtype.name in message
    assert describe(err.value)[0] == "unsupported_model"
    assert cli.main(["generate", str(path), "--prompt", "hi", "--max-tokens", "2"]) == 2
    assert "blk.1.ffn_up.weight" in capsys.readouterr().err


def test_an_unknown_type_id_is_a_clear_error(f32_source, tmp_path):
    """A type id no version of gguf here knows (a newer quantization): refused when the file is
    opened, naming the tensor and the id."""
    path = tmp_path / "unknown.gguf"
    _write_with_matrix_type(f32_source, path, "blk.0.attn_k.weight", QT.Q8_K)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_k.weight"
    # tensor info: name (u64 len + bytes), n_dims u32, dims u64 × n_dims, type u32, offset u64
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at : type_at + 4], "little") == QT.Q8_K.value
    data[type_at : type_at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(UnsupportedModel, match=r"blk\.0\.attn_k\.weight.*type id 250"):
        GGUFFile(path)


def test_random_blocks_have_sane_scales():
    """The test blocks themselves: finite values of a weight-like size for every type."""
    rng = np.random.default_rng(0)
    for qtype in ALL_TYPES:
        raw = random_blocks(rng.standard_normal((4, 256)).astype(np.float32) * 0.05, qtype, rng)
        values = dequantize(raw, qtype)
        assert np.isfinite(values).all()
        assert 0.005 < np.sqrt(np.mean(values**2)) < 0.5, qtype.name
