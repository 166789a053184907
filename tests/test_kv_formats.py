"""KV block formats: sizes, packing, round-trip error bounds, defaults, rotation, packed-code kernels."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kv.formats import FORMATS, KVFormat, get_format, hadamard, pack_codes, unpack_codes

INT_FORMATS = [name for name, fmt in FORMATS.items() if fmt.bits <= 8]
GEOMETRIES = [(3, 32, 64), (1, 32, 256), (2, 16, 16)]  # (Hkv, T, D): SmolLM2, Gemma3, tiny
ROLES_BITS = [(role, bits) for role in "kv" for bits in (16, 8, 6, 5, 4, 3, 2)]


def _blocks(rng, n, geometry, scale=1.0):
    return (scale * rng.standard_normal((n, *geometry))).astype(np.float32)  # (n, Hkv, T, D)


def _expected_bytes(fmt: KVFormat, h: int, t: int, d: int) -> int:
    if fmt.bits == 16:
        return 2 * h * t * d
    n = h * t * d
    n_groups = h * d if fmt.axis == "channel" else n // min(fmt.group, d)
    return -(-n // 8) * fmt.bits + n_groups * (2 if fmt.symmetric else 4)


def _per_value_scale(fmt: KVFormat, buf: np.ndarray, h: int, t: int, d: int) -> np.ndarray:
    """The stored float16 scale of each value's group, broadcast to (n, Hkv, T, D)."""
    _, scales, _ = fmt.fields(buf, h, t, d)
    s = scales.astype(np.float32)
    n = buf.shape[0]
    if fmt.axis == "channel":
        return np.broadcast_to(s.reshape(n, h, 1, d), (n, h, t, d))
    g = fmt.group_size(t, d)
    return np.repeat(s.reshape(n, h, t, d // g), g, axis=3)


def _rel_rmse(fmt: KVFormat, x: np.ndarray) -> float:
    y = fmt.dequantize(fmt.quantize(x), *x.shape[1:])
    return float(np.sqrt(np.mean((x - y) ** 2) / np.mean(x**2)))


# ---- registry -------------------------------------------------------------------------------------


@pytest.mark.parametrize("role,bits", ROLES_BITS)
def test_default_format_per_bits_and_role(role, bits):
    fmt = get_format(bits, role)
    assert fmt is FORMATS[fmt.name]
    assert fmt.bits == bits
    if bits == 16:
        assert fmt.name == "f16"
    elif bits == 8:
        assert (fmt.axis, fmt.group, fmt.symmetric) == ("token", 32, True)
    elif role == "k" and bits == 6:
        assert (fmt.axis, fmt.symmetric) == ("channel", True)
    elif role == "k" and bits <= 5:
        assert (fmt.axis, fmt.symmetric) == ("channel", False)
    else:
        assert (fmt.axis, fmt.group, fmt.symmetric) == ("token", 64, False)


def test_bits_per_value_of_defaults():
    table = {
        "f16": 16.0,
        "q8t32s": 8.5,
        "q6t64": 6.5,
        "q5t64": 5.5,
        "q4t64": 4.5,
        "q3t64": 3.5,
        "q2t64": 2.5,
        "q4c": 5.0,
        "q3c": 4.0,
        "q2c": 3.0,
    }
    for name, bpv in table.items():
        for d in (64, 128, 256):
            assert FORMATS[name].bits_per_value(32, d) == bpv, (name, d)


@pytest.mark.parametrize("bits,role", [(7, "k"), (1, "v"), (32, "k"), (4, "q")])
def test_unsupported_requests_raise(bits, role):
    with pytest.raises(ValueError):
        get_format(bits, role)


def test_invalid_inputs_raise():
    fmt = FORMATS["q4t64"]
    with pytest.raises(ValueError, match="group"):
        fmt.quantize(np.zeros((1, 1, 32, 96), np.float32))  # 64 does not divide 96
    with pytest.raises(ValueError):
        fmt.quantize(np.zeros((32, 64), np.float32))
    with pytest.raises(ValueError):
        fmt.dequantize(np.zeros((1, 10), np.uint8), 1, 32, 64)
    with pytest.raises(ValueError):
        KVFormat("q9t32", 9, "token", 32, False)
    with pytest.raises(ValueError):
        KVFormat("q4x", 4, "head", None, False)


# ---- sizes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("geometry", GEOMETRIES + [(1, 3, 4)])
@pytest.mark.parametrize("name", list(FORMATS))
def test_buffer_size_matches_formula(name, geometry):
    fmt = FORMATS[name]
    x = _blocks(np.random.default_rng(0), 5, geometry)
    buf = fmt.quantize(x)
    n_bytes = _expected_bytes(fmt, *geometry)
    assert fmt.bytes_per_block(*geometry) == n_bytes
    assert buf.dtype == np.uint8 and buf.shape == (5, n_bytes) and buf.nbytes == 5 * n_bytes
    _, t, d = geometry
    assert fmt.bits_per_value(t, d) == pytest.approx(8 * _expected_bytes(fmt, 1, t, d) / (t * d))
    y = fmt.dequantize(buf, *geometry)
    assert y.dtype == np.float32 and y.shape == x.shape


def test_7b_k6v4_fits_in_5_6_gib():
    # 7B: 32 layers, 32 KV heads x 128, 32,768 tokens in 32-token blocks
    layers, h, d, tokens, t = 32, 32, 128, 32768, 32
    blocks = tokens // t

    def total(k_bits, v_bits):
        k_fmt, v_fmt = get_format(k_bits, "k"), get_format(v_bits, "v")
        per_block = k_fmt.bytes_per_block(h, t, d) + v_fmt.bytes_per_block(h, t, d)
        return layers * blocks * per_block / 2**30  # GiB

    assert total(16, 16) == 16.0
    k6v4 = total(6, 4)
    print(f"7B @ 32K tokens: K6V4 {k6v4:.3f} GiB, K4V4 {total(4, 4):.3f} GiB, K8V8 {total(8, 8):.3f} GiB")
    assert k6v4 <= 5.6


# ---- packing --------------------------------------------------------------------------------------


def _pack_reference(codes: np.ndarray, bits: int) -> np.ndarray:
    """Bit by bit: value i occupies stream bits [i*bits, (i+1)*bits), stream bit j = byte j//8 bit j%8."""
    out = np.zeros(len(codes) * bits // 8, np.uint8)
    for i, c in enumerate(codes.tolist()):
        for k in range(bits):
            j = i * bits + k
            out[j // 8] |= ((c >> k) & 1) << (j % 8)
    return out


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_exact_for_random_codes(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(3, 5, 64), dtype=np.uint8)  # (..., N)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_codes(packed, bits), codes)
    np.testing.assert_array_equal(packed[1, 2], _pack_reference(codes[1, 2], bits))
    codes[...] = (1 << bits) - 1
    assert (pack_codes(codes, bits) == 255).all()


def test_pack_layout_as_drawn():
    v = np.array([0b101010, 0b110011, 0b001111, 0b111000], np.uint8)  # four 6-bit values
    b = pack_codes(np.tile(v, 2), 6)[:3]
    assert b[0] == (v[0] | (v[1] & 3) << 6) & 0xFF
    assert b[1] == (v[1] >> 2 | (v[2] & 15) << 4) & 0xFF
    assert b[2] == (v[2] >> 4 | v[3] << 2) & 0xFF
    v = np.arange(8, dtype=np.uint8)  # eight 3-bit values
    b = pack_codes(v, 3)
    assert b[0] == (v[0] | v[1] << 3 | (v[2] & 3) << 6) & 0xFF
    assert b[1] == (v[2] >> 2 | v[3] << 1 | v[4] << 4 | (v[5] & 1) << 7) & 0xFF
    assert b[2] == (v[5] >> 1 | v[6] << 2 | v[7] << 5) & 0xFF
    assert pack_codes(np.array([1, 2] * 4, np.uint8), 4)[0] == 0x21
    assert pack_codes(np.array([1, 2, 3, 0] * 2, np.uint8), 2)[0] == 0b00111001


def test_pack_rejects_bad_lengths():
    with pytest.raises(ValueError):
        pack_codes(np.zeros(12, np.uint8), 4)
    with pytest.raises(ValueError):
        unpack_codes(np.zeros(7, np.uint8), 3)
    with pytest.raises(ValueError):
        pack_codes(np.zeros(8, np.uint8), 9)


# ---- round trip -----------------------------------------------------------------------------------


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("name", INT_FORMATS)
def test_round_trip_error_within_half_a_step(name, geometry):
    fmt = FORMATS[name]
    rng = np.random.default_rng(2)
    x = _blocks(rng, 6, geometry)
    x[1] *= 40.0  # a loud block
    x[2, :, :, 3] += 8.0  # an offset channel
    x[3] *= 1e-3  # a quiet block
    buf = fmt.quantize(x)
    y = fmt.dequantize(buf, *geometry)
    step = _per_value_scale(fmt, buf, *geometry)  # (n, Hkv, T, D)
    levels = 1 << fmt.bits
    tol = 1e-6 * (np.abs(x) + step * levels)  # float32 arithmetic
    err = np.abs(y - x)
    assert np.all(err <= step / 2 + tol), float(np.max(err - step / 2))
    assert np.isfinite(y).all()


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_f16_round_trip(geometry):
    fmt = FORMATS["f16"]
    x = _blocks(np.random.default_rng(3), 4, geometry, scale=10.0)
    buf = fmt.quantize(x)
    np.testing.assert_array_equal(fmt.dequantize(buf, *geometry), x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(buf[0].view(np.float16), x[0].astype(np.float16).ravel())


@pytest.mark.parametrize("axis,group", [("token", 32), ("token", 64), ("channel", None)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_relative_rmse_falls_with_bits(axis, group, symmetric):
    x = _blocks(np.random.default_rng(4), 64, (3, 32, 64))
    errors = []
    for bits in (2, 3, 4, 5, 6, 8):
        name = f"q{bits}" + ("c" if axis == "channel" else f"t{group}") + ("s" if symmetric else "")
        errors.append(_rel_rmse(FORMATS[name], x))
    assert all(a > 1.5 * b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.01


def test_rmse_table_of_defaults():
    x = _blocks(np.random.default_rng(5), 256, (3, 32, 64))
    rows = []
    for role in "kv":
        previous = np.inf
        for bits in (2, 3, 4, 5, 6, 8, 16):
            fmt = get_format(bits, role)
            err = _rel_rmse(fmt, x)
            bpv = fmt.bits_per_value(32, 64)
            rows.append(f"{role.upper()}{bits:<2} {fmt.name:7s} {bpv:5.2f} bits/value  rel RMSE {err:.5f}")
            assert err < previous
            previous = err
    print("\n" + "\n".join(rows))


@pytest.mark.parametrize("name", list(FORMATS))
def test_zero_and_constant_groups(name):
    fmt = FORMATS[name]
    geometry = (2, 32, 64)
    x = np.zeros((4, *geometry), np.float32)
    x[1] = 1.5  # float16-representable constant
    x[2] = -0.1  # not representable in float16
    x[3, 0] = 3e-9  # below the float16 subnormal range
    x[3, 1] = -1e4
    y = fmt.dequantize(fmt.quantize(x), *geometry)
    assert np.isfinite(y).all()
    assert (y[0] == 0).all()
    if fmt.bits == 16 or not fmt.symmetric:
        assert (y[1] == 1.5).all()
    np.testing.assert_allclose(y[1:], x[1:], rtol=2e-3, atol=1e-7)


def test_mixed_constant_and_varying_groups():
    fmt = FORMATS["q4t32"]
    x = _blocks(np.random.default_rng(6), 2, (1, 32, 64))
    x[:, :, 5, :32] = 0.25  # one constant group per block
    y = fmt.dequantize(fmt.quantize(x), 1, 32, 64)
    assert (y[:, :, 5, :32] == 0.25).all()
    assert np.isfinite(y).all()


def test_accepts_non_contiguous_and_float64_input():
    fmt = FORMATS["q5t64"]
    x = _blocks(np.random.default_rng(7), 3, (32, 2, 64)).transpose(0, 2, 1, 3)  # (3, 2, 32, 64) view
    a = fmt.quantize(x)
    np.testing.assert_array_equal(a, fmt.quantize(np.ascontiguousarray(x)))
    np.testing.assert_array_equal(a, fmt.quantize(x.astype(np.float64)))


# ---- keys with an outlier channel, rotation -------------------------------------------------------


def _score_error(fmt, k, q, rotation=None):
    """Relative RMS error of q·k over all stored tokens; k (n, Hkv, T, D), q (Hkv, M, D)."""
    n, h, t, d = k.shape
    kr, qr = (k, q) if rotation is None else (k @ rotation, q @ rotation)
    kq = fmt.dequantize(fmt.quantize(kr), h, t, d)
    ref = np.einsum("hmd,nhtd->hmnt", q, k)
    got = np.einsum("hmd,nhtd->hmnt", qr, kq)
    return float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)))


def test_channel_axis_beats_token_axis_on_outlier_keys():
    rng = np.random.default_rng(8)
    k = _blocks(rng, 32, (2, 32, 64))
    k[..., 7] = 30.0 + 4.0 * k[..., 7]  # a large fixed outlier channel, as in real keys
    k[..., 40] *= 15.0
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    channel = _score_error(FORMATS["q4c"], k, q)
    token32 = _score_error(FORMATS["q4t32"], k, q)
    token64 = _score_error(FORMATS["q4t64"], k, q)
    rotated = _score_error(FORMATS["q4t32"], k, q, hadamard(64))
    print(
        f"\n4-bit key score error: channel {channel:.4f} token/32 {token32:.4f} "
        f"token/64 {token64:.4f} token/32+Hadamard {rotated:.4f}"
    )
    assert channel < token32 / 2
    assert token32 < token64
    assert rotated < token32


@pytest.mark.parametrize("n", [1, 2, 8, 64, 256])
def test_hadamard_is_orthonormal_and_keeps_dot_products(n):
    h = hadamard(n)
    assert h.shape == (n, n) and h.dtype == np.float32
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_allclose(np.abs(h), 1 / np.sqrt(n), rtol=1e-6)
    rng = np.random.default_rng(n)
    q = rng.standard_normal((5, n)).astype(np.float32)
    k = rng.standard_normal((7, n)).astype(np.float32)
    np.testing.assert_allclose((q @ h) @ (k @ h).T, q @ k.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [0, 3, 96])
def test_hadamard_rejects_non_powers_of_two(n):
    with pytest.raises(ValueError):
        hadamard(n)


# ---- batches ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
def test_batch_quantizes_each_block_on_its_own(name):
    """The pool quantizes one block at a time and a prefill many at once: a batch must give every
    block the bytes it gets alone (no scale or group reaches across blocks), and dequantizing the
    batch must give every block its own values back."""
    fmt = FORMATS[name]
    h, t, d = 3, 32, 64
    rng = np.random.default_rng(9)
    scales = np.array([1e-3, 1.0, 40.0, 0.0, 5.0], np.float32).reshape(5, 1, 1, 1)
    x = _blocks(rng, 5, (h, t, d)) * scales  # (5, Hkv, T, D), very different ranges per block
    batch = fmt.quantize(x)
    assert batch.shape == (5, fmt.bytes_per_block(h, t, d))
    singles = np.concatenate([fmt.quantize(x[i : i + 1]) for i in range(5)])
    np.testing.assert_array_equal(batch, singles)
    back = fmt.dequantize(batch, h, t, d)
    for i in range(5):
        np.testing.assert_array_equal(back[i], fmt.dequantize(singles[i : i + 1], h, t, d)[0])
    assert not back[3].any()  # the all-zero block stays zero


# ---- packed-code attention kernels ----------------------------------------------------------------

@pytest.mark.parametrize("geometry", [(3, 32, 64), (1, 32, 256)])
@pytest.mark.parametrize("name", INT_FORMATS)
def test_kernels_match_numpy_dequantize(name, geometry):
    from engine.kernels.kv_codes import attention_scores, weighted_values

    fmt = FORMATS[name]
    h, t, d = geometry
    rng = np.random.default_rng(10)
    pool = fmt.quantize(_blocks(rng, 9, geometry))  # (9, bytes)
    ids = np.array([4, 0, 7, 2, -1])
    m = 5  # query heads per KV head x query tokens
    q = rng.standard_normal((h, m, d)).astype(np.float32)
    p = rng.random((h, m, len(ids) * t)).astype(np.float32)

    ref = fmt.dequantize(pool[ids], h, t, d)  # (nb, Hkv, T, D)
    ref = ref.transpose(1, 0, 2, 3).reshape(h, len(ids) * t, d)  # (Hkv, nb*T, D)
    scores = attention_scores(fmt, pool, ids, q, t)
    np.testing.assert_allclose(scores, q @ ref.transpose(0, 2, 1), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(weighted_values(fmt, pool, ids, p, t, d), p @ ref, rtol=1e-4, atol=1e-3)


def test_kernels_reject_unusable_inputs():
    from engine.kernels.kv_codes import attention_scores, weighted_values

    fmt = FORMATS["q4c"]
    pool = fmt.quantize(np.zeros((2, 1, 32, 64), np.float32))
    with pytest.raises(IndexError):
        attention_scores(fmt, pool, np.array([2]), np.zeros((1, 1, 64), np.float32), 32)
    with pytest.raises(ValueError):
        weighted_values(fmt, pool, np.array([0]), np.zeros((1, 1, 31), np.float32), 32, 64)
    with pytest.raises(ValueError):  # rows of another geometry (2 KV heads)
        attention_scores(fmt, pool, np.array([0]), np.zeros((2, 1, 64), np.float32), 32)
    with pytest.raises(ValueError):  # packed codes need head_dim % 8 == 0 (float16 does not)
        pool12 = fmt.quantize(np.zeros((1, 1, 32, 12), np.float32))
        attention_scores(fmt, pool12, np.array([0]), np.zeros((1, 1, 12), np.float32), 32)
