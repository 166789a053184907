"""Weight blocks for kernel tests: real quantizations where gguf-py can make them, random blocks
with sane float16 scales where it cannot (the k-quants)."""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import quantize

GGUF_QUANTIZES = {QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.F16, QT.BF16}

# Offsets of the float16 scale fields in a block of each type (the rest are codes / 6-bit scales).
F16_FIELDS = {
    QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.IQ4_NL: (0,), QT.IQ4_XS: (0,),
}


def random_f16(rng, shape) -> np.ndarray:
    """Finite float16 values over the whole range, subnormals and signed zeros included."""
    bits = rng.integers(0, 0x10000, size=shape, dtype=np.uint32).astype(np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # inf/NaN exponent -> subnormal
    return bits.astype(np.uint16).view(np.float16)


def random_blocks(qtype: QT, rows: int, cols: int, rng, scale_range: str = "small") -> np.ndarray:
    """(rows, bytes) random blocks with finite float16 scale fields.

    scale_range "small": scales ~0.01 (like real weights); "any": any finite float16, including
    subnormals, zeros and large values, to exercise the float16 conversion."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint16).astype(np.uint8)
    if qtype == QT.F16:
        return random_f16(rng, (rows, cols)).view(np.uint8).reshape(rows, -1)
    if qtype == QT.BF16:
        if scale_range == "small":  # normal values, truncated to bfloat16
            vals = rng.standard_normal((rows, cols)).astype(np.float32)
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        # any sign/mantissa, exponents 2**-60 .. 2**60 plus subnormals and zeros: products stay finite
        b = raw.view(np.uint16)
        exp = rng.integers(127 - 60, 127 + 60, size=b.shape).astype(np.uint16)
        exp[rng.random(b.shape) < 0.05] = 0
        raw.view(np.uint16)[:] = (b & 0x807F) | (exp << 7)
        return raw
    blocks = raw.reshape(rows, -1, size)
    for off in F16_FIELDS[qtype]:
        if scale_range == "small":
            vals = (rng.uniform(0.001, 0.02, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2]))
            vals = vals.astype(np.float16)
        else:
            vals = random_f16(rng, blocks.shape[:2])
        blocks[..., off : off + 2] = vals[..., None].view(np.uint8)
    return raw


def blocks(qtype: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes) blocks of weights ~N(0, 1) times a per-row scale in 0.005 .. 0.05: quantized
    by gguf-py, or random k-quant blocks (codes and 6-bit scales uniform, float16 fields ~0.01)."""
    rng = np.random.default_rng(seed)
    if qtype not in GGUF_QUANTIZES:
        return random_blocks(qtype, rows, cols, rng)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.005, 0.05, (rows, 1))).astype(np.float32)
    return np.ascontiguousarray(quantize(w, qtype)).view(np.uint8).reshape(rows, -1)
