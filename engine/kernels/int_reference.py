"""numpy emulation of the integer kernels' arithmetic, operation for operation (the tests compare
every kernel with it bit for bit; docs/kernels.md states the arithmetic).

Works on the GGUF blocks directly (not the repacked layout): the repacking is a permutation the
kernels undo, so equal results also check it.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType as QT

from .int_dot import ACT_BLOCK, ACT_MAX, FAST_ACT_MAX


def quantize_activations(x: np.ndarray, fast: bool = False):
    """x (T, K) float32 -> (codes (T, K) int64 in value order, s (T, nb) float32, Q (T, nb) int64,
    sQ (T, nb) float32), as `int_dot.quantize_activations` (fast: `quantize_activations_fast`,
    int8 codes) computes them."""
    T, K = x.shape
    xb = x.reshape(T, K // ACT_BLOCK, ACT_BLOCK).astype(np.float32)
    amax = np.abs(xb).max(axis=-1)
    s = (amax / np.float32(FAST_ACT_MAX if fast else ACT_MAX)).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
    q = np.rint((xb / safe[..., None]).astype(np.float32)).astype(np.int64)
    q[s == 0] = 0
    Q = q.sum(axis=-1)
    sQ = (s * Q.astype(np.float32)).astype(np.float32)
    return q.reshape(T, K), s, Q, sQ


def _q4_k_scale_min(q: np.ndarray):
    """(rows, nb, 12) packed bytes -> (scales, minima) (rows, nb, 8) int64 (ggml's get_scale_min_k4)."""
    q = q.astype(np.int64)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def weight_codes(raw: np.ndarray, ggml_type):
    """GGUF rows (rows, bytes) -> (integer codes (rows, K) int64, d (rows, K / sub) float32,
    m (rows, K / sub) float32 or None, offset): codes times d (minus offset) plus m per
    sub-block of `sub` = K / d.shape[1] values (32; Q6_K 16), as the integer kernels read them."""
    rows = raw.shape[0]
    f16 = lambda a: a.copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    if ggml_type == QT.Q8_0:
        b = raw.reshape(rows, -1, 34)
        return b[:, :, 2:].view(np.int8).astype(np.int64).reshape(rows, -1), f16(b[:, :, 0:2]), None, 0
    if ggml_type == QT.Q4_K:
        b = raw.reshape(rows, -1, 144)
        sc, mn = _q4_k_scale_min(b[:, :, 4:16])
        d = (f16(b[:, :, 0:2])[..., None] * sc.astype(np.float32)).astype(np.float32)  # exact
        m = -(f16(b[:, :, 2:4])[..., None] * mn.astype(np.float32)).astype(np.float32)
        qs = b[:, :, 16:].astype(np.int64).reshape(rows, -1, 4, 32)  # (rows, nb, chunk c, byte l)
        codes = np.stack([qs & 15, qs >> 4], axis=3)  # value 64c + 32h + l
        return codes.reshape(rows, -1), d.reshape(rows, -1), m.reshape(rows, -1), 0
    if ggml_type == QT.Q5_K:
        b = raw.reshape(rows, -1, 176)
        sc, mn = _q4_k_scale_min(b[:, :, 4:16])
        d = (f16(b[:, :, 0:2])[..., None] * sc.astype(np.float32)).astype(np.float32)
        m = -(f16(b[:, :, 2:4])[..., None] * mn.astype(np.float32)).astype(np.float32)
        qh = b[:, :, 16:48].astype(np.int64)[:, :, None, None, :]  # (rows, nb, 1, 1, byte l)
        qs = b[:, :, 48:].astype(np.int64).reshape(rows, -1, 4, 1, 32)  # (rows, nb, chunk c, 1, l)
        nib = np.concatenate([qs & 15, qs >> 4], axis=3)  # (rows, nb, c, h, l): value 64c + 32h + l
        bit = 2 * np.arange(4)[:, None, None] + np.arange(2)[None, :, None]  # 2c + h
        codes = nib | (((qh >> bit) & 1) << 4)
        return codes.reshape(rows, -1), d.reshape(rows, -1), m.reshape(rows, -1), 0
    if ggml_type == QT.Q3_K:
        b = raw.reshape(rows, -1, 110)
        hm = b[:, :, 0:32].astype(np.int64)[:, :, None, None, :]  # (rows, nb, 1, 1, byte l)
        qs = b[:, :, 32:96].astype(np.int64).reshape(rows, -1, 2, 1, 32)  # (rows, nb, n, 1, l)
        j = np.arange(4)[:, None]
        n = np.arange(2)[:, None, None]
        codes = ((qs >> (2 * j)) & 3) | (((hm >> (4 * n + j)) & 1) << 2)  # value 128n + 32j + l
        sc = b[:, :, 96:108].astype(np.int64)
        low = np.concatenate([sc[..., 0:8] & 15, sc[..., 0:8] >> 4], axis=-1)  # scale i's low 4 bits
        top = sc[..., 8:12]
        high = np.concatenate([(top >> (2 * q)) & 3 for q in range(4)], axis=-1)  # scale 4q + i: bits 2q of byte 8 + i
        scales = (low | (high << 4)) - 32
        d = (f16(b[:, :, 108:110])[..., None] * scales.astype(np.float32)).astype(np.float32)
        return codes.reshape(rows, -1) - 4, d.reshape(rows, -1), None, 0
    if ggml_type == QT.Q6_K:
        b = raw.reshape(rows, -1, 210)
        ql = b[:, :, 0:128].astype(np.int64).reshape(rows, -1, 2, 2, 32)  # (.., half n, ql part, l)
        qh = b[:, :, 128:192].astype(np.int64).reshape(rows, -1, 2, 1, 32)
        low = np.concatenate([ql & 15, ql >> 4], axis=3)  # (.., n, k = 0..3, l): ql[l + 32 (k & 1)] nibble k >> 1
        codes = low | (((qh >> (2 * np.arange(4)[:, None])) & 3) << 4)
        d = (f16(b[:, :, 208:210])[..., None] * b[:, :, 192:208].view(np.int8).astype(np.float32)).astype(np.float32)
        return codes.reshape(rows, -1) - 32, d.reshape(rows, -1), None, 0
    if ggml_type in (QT.Q5_0, QT.Q5_1):
        size, qh_at = {QT.Q5_0: (22, 2), QT.Q5_1: (24, 4)}[ggml_type]
        b = raw.reshape(rows, -1, size)
        qh = b[:, :, qh_at : qh_at + 4].copy().view(np.uint32)[..., 0].astype(np.int64)
        nib = b[:, :, qh_at + 4 :].astype(np.int64)
        fifth = (qh[..., None] >> np.arange(32)) & 1
        codes = np.concatenate([nib & 15, nib >> 4], axis=-1) | (fifth << 4)
        m = f16(b[:, :, 2:4]) if ggml_type == QT.Q5_1 else None
        return codes.reshape(rows, -1), f16(b[:, :, 0:2]), m, (16 if ggml_type == QT.Q5_0 else 0)
    size, codes_at = {QT.Q4_0: (18, 2), QT.Q4_1: (20, 4)}[ggml_type]
    b = raw.reshape(rows, -1, size)
    d = f16(b[:, :, 0:2])
    m = f16(b[:, :, 2:4]) if ggml_type == QT.Q4_1 else None
    nib = b[:, :, codes_at:].astype(np.int64)
    codes = np.concatenate([nib & 15, nib >> 4], axis=-1).reshape(rows, -1)
    return codes, d, m, (8 if ggml_type == QT.Q4_0 else 0)


def matvec(raw: np.ndarray, ggml_type, x: np.ndarray, fast: bool = False) -> np.ndarray:
    """x (T, K) float32 -> y (T, rows) float32, exactly as the integer kernels compute it (fast:
    the fast mode's, int8 activations; the integer sums are the same whichever way a kernel
    offsets its codes, so the float operations that follow are too)."""
    q, s, Q, sQ = quantize_activations(np.ascontiguousarray(x, dtype=np.float32), fast)
    c, d, m, off = weight_codes(raw, ggml_type)
    T, K = q.shape
    nsub = d.shape[1]
    sub = K // nsub  # values per weight scale: 32, or 16 (Q6_K: two per activation block)
    per = ACT_BLOCK // sub
    I = np.einsum("tbk,rbk->trb", q.reshape(T, nsub, sub), c.reshape(c.shape[0], nsub, sub))  # exact (int64)
    if off:  # (the offset types have sub = 32)
        I = I - off * Q[:, None, :]
    assert np.abs(I).max(initial=0) < 2**31  # the kernels' i32 lanes
    y = np.zeros((T, c.shape[0]), dtype=np.float32)
    for b in range(nsub):
        f = (d[None, :, b] * s[:, None, b // per]).astype(np.float32)
        blk = (I[:, :, b].astype(np.float32) * f).astype(np.float32)
        if m is not None:
            blk = (blk + (m[None, :, b] * sQ[:, None, b]).astype(np.float32)).astype(np.float32)
        y = (y + blk).astype(np.float32)
    return y
