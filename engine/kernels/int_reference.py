"""numpy emulation of the integer kernels' arithmetic, operation for operation (the tests compare
every kernel with it bit for bit; docs/kernels.md states the arithmetic).

Works on the GGUF blocks directly (not the repacked layout): the repacking is a permutation the
kernels undo, so equal results also check it.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType as QT

from .int_dot import ACT_BLOCK, ACT_MAX


def quantize_activations(x: np.ndarray):
    """x (T, K) float32 -> (codes (T, K) int64 in value order, s (T, nb) float32, Q (T, nb) int64,
    sQ (T, nb) float32), as `int_dot.quantize_activations` computes them."""
    T, K = x.shape
    xb = x.reshape(T, K // ACT_BLOCK, ACT_BLOCK).astype(np.float32)
    amax = np.abs(xb).max(axis=-1)
    s = (amax / np.float32(ACT_MAX)).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
    q = np.rint((xb / safe[..., None]).astype(np.float32)).astype(np.int64)
    q[s == 0] = 0
    Q = q.sum(axis=-1)
    sQ = (s * Q.astype(np.float32)).astype(np.float32)
    return q.reshape(T, K), s, Q, sQ


def weight_codes(raw: np.ndarray, ggml_type):
    """GGUF rows (rows, bytes) -> (integer codes (rows, K) int64, d (rows, nb) float32,
    m (rows, nb) float32 or None, offset) of the types the integer kernels read."""
    rows = raw.shape[0]
    if ggml_type == QT.Q8_0:
        b = raw.reshape(rows, -1, 34)
        d = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        return b[:, :, 2:].view(np.int8).astype(np.int64).reshape(rows, -1), d, None, 0
    size, codes_at = {QT.Q4_0: (18, 2), QT.Q4_1: (20, 4)}[ggml_type]
    b = raw.reshape(rows, -1, size)
    d = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if ggml_type == QT.Q4_1 else None
    nib = b[:, :, codes_at:].astype(np.int64)
    codes = np.concatenate([nib & 15, nib >> 4], axis=-1).reshape(rows, -1)
    return codes, d, m, (8 if ggml_type == QT.Q4_0 else 0)


def matvec(raw: np.ndarray, ggml_type, x: np.ndarray) -> np.ndarray:
    """x (T, K) float32 -> y (T, rows) float32, exactly as the integer kernels compute it."""
    q, s, Q, sQ = quantize_activations(np.ascontiguousarray(x, dtype=np.float32))
    c, d, m, off = weight_codes(raw, ggml_type)
    T, K = q.shape
    nb = K // ACT_BLOCK
    qb = q.reshape(T, nb, ACT_BLOCK)
    cb = c.reshape(c.shape[0], nb, ACT_BLOCK)
    I = np.einsum("tbk,rbk->trb", qb, cb)  # exact (int64)
    I = I - off * Q[:, None, :]
    assert np.abs(I).max(initial=0) < 2**31  # the kernels' i32 lanes
    y = np.zeros((T, c.shape[0]), dtype=np.float32)
    for b in range(nb):
        f = (d[None, :, b] * s[:, None, b]).astype(np.float32)
        blk = (I[:, :, b].astype(np.float32) * f).astype(np.float32)
        if m is not None:
            blk = (blk + (m[None, :, b] * sQ[:, None, b]).astype(np.float32)).astype(np.float32)
        y = (y + blk).astype(np.float32)
    return y
