"""The per-token kernels every architecture's forward pass shares: RMS norm and the RoPE rotation;
and the sampler's running sum over the vocabulary.

Each has a numpy expression (the reference, and the path for other dtypes and layouts) and a
compiled form that reproduces that expression bit for bit (`_rms_rows` numpy's pairwise sum,
`_rope_rows` the rotation, `_running_sum` np.cumsum of float64), so that decode
never drifts from prefill and a seeded draw picks the same token either way.
"""

from __future__ import annotations

import numpy as np

from . import background, helper

# the background group (`engine.kernels.background`) that compiles `_rms_rows` and `_running_sum`
# on a first start; until it is ready rms_norm and running_sum take numpy (the same results)
NORM_KERNELS = "norms"


# rows from which rms_norm's compiled rows are shared with the helper thread, in two halves (a 1B
# prefill's 512 x 2048 norms: ~1.4 ms a call on one thread)
NORM_SHARED_ROWS = 64


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (..., D) / sqrt(mean(x²) + eps) * weight (D,).

    The mean is np.mean's own arithmetic (pairwise sum, then one division by D). Float32 arrays go
    through one compiled call (`_rms_rows`, bit-identical): on a decode step's single row the five
    numpy operations' call overhead is several times their arithmetic, and a step has two norms
    per layer."""
    if (_rms_rows is not None and type(x) is np.ndarray and x.dtype == np.float32 and x.size
            and x.flags.c_contiguous and weight.dtype == np.float32 and weight.shape == x.shape[-1:]
            and not _norms_compiling()):
        rows = x.reshape(-1, x.shape[-1])
        out = np.empty_like(rows)
        weight, eps = np.ascontiguousarray(weight), np.float32(eps)
        T = rows.shape[0]
        if T < NORM_SHARED_ROWS:
            _rms_rows(rows, weight, eps, out)
        else:  # each row on its own: the same bits in halves
            helper.share_rows(lambda r0, r1: _rms_rows(rows[r0:r1], weight, eps, out[r0:r1]), T, -(-T // 2))
        return out.reshape(x.shape)
    ms = np.add.reduce(np.square(x), axis=-1, keepdims=True) / np.float32(x.shape[-1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps))) * weight


def _norms_compiling() -> bool:
    if background.pending(NORM_KERNELS):
        background.count_fallback(NORM_KERNELS)
        return True
    return False


def _compile_norms() -> None:
    """Compile, or load from numba's cache, `_rms_rows` and `_running_sum` (the NORM_KERNELS
    group's target)."""
    if _rms_rows is not None:
        _rms_rows(np.ones((2, 9), np.float32), np.ones(9, np.float32), np.float32(1e-6), np.empty((2, 9), np.float32))
        _running_sum(np.ones(3), np.empty(3))


def running_sum(weights: np.ndarray, out: np.ndarray) -> np.ndarray:
    """np.cumsum(weights, out=out). A 1-D C-contiguous float64 array goes through one compiled loop
    (`_running_sum`): np.add.accumulate adds the values one after the other, and so does the loop,
    in the same order, so the sums are the same bits; numpy's accumulate takes ~3 ns a value here
    (a sampler's draw over SmolLM2's 49,152 tokens: 145 us), the loop ~0.5 (26 us)."""
    if (_running_sum is not None and weights.dtype == np.float64 and out.dtype == np.float64
            and weights.ndim == 1 and out.shape == weights.shape and weights.flags.c_contiguous
            and out.flags.c_contiguous and not _norms_compiling()):
        _running_sum(weights, out)
        return out
    return np.cumsum(weights, out=out)


# rows of x from which apply_rope's compiled rotation is shared with the helper thread, in two
# halves of rows: a prefill's 512 x 32 heads x 64 took ~3.3 ms in numpy's ten array operations,
# 1.0 ms compiled on one thread (2026-12-07, Xeon)
ROPE_SHARED_ROWS = 64


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """Rotate x (T, heads, dim) by position.

    neox=False: pairs are adjacent (x[2i], x[2i+1]) — llama in GGUF (converter permuted Q/K rows).
    neox=True:  pairs are halves (x[i], x[i + dim/2]) — gemma3, qwen2, ...

    float32 x (any layout: a partial rotation passes the rotated channels as a strided view) takes
    one compiled call (`_rope_rows`; long inputs in two halves on two threads), which computes
    `rope_numpy` bit for bit; other dtypes take `rope_numpy`."""
    if (_rope_rows is not None and type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 3
            and cos.dtype == np.float32 and sin.dtype == np.float32
            and cos.shape == sin.shape == (x.shape[0], x.shape[2] // 2)):
        x, cos, sin = np.ascontiguousarray(x), np.ascontiguousarray(cos), np.ascontiguousarray(sin)
        out = np.empty_like(x)
        T = x.shape[0]
        if T < ROPE_SHARED_ROWS:
            _rope_rows(x, cos, sin, neox, out)
        else:
            helper.share_rows(lambda r0, r1: _rope_rows(x[r0:r1], cos[r0:r1], sin[r0:r1], neox, out[r0:r1]), T,
                              -(-T // 2))
        return out
    return rope_numpy(x, cos, sin, neox)


def rope_numpy(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """apply_rope as numpy array expressions: the reference the compiled rotation reproduces."""
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, dim/2)
    if neox:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


try:
    from numba import njit

    @njit(cache=True, nogil=True)
    def _rope_rows(x, cos, sin, neox, out):
        """apply_rope: x, out (T, heads, dim) float32; cos, sin (T, dim/2). The same products and
        sums as the numpy path (no fused multiply-add), so the same results."""
        half = cos.shape[1]
        for t in range(x.shape[0]):
            for h in range(x.shape[1]):
                for i in range(half):
                    if neox:
                        a, b = x[t, h, i], x[t, h, i + half]
                    else:
                        a, b = x[t, h, 2 * i], x[t, h, 2 * i + 1]
                    ra = a * cos[t, i] - b * sin[t, i]
                    rb = a * sin[t, i] + b * cos[t, i]
                    if neox:
                        out[t, h, i], out[t, h, i + half] = ra, rb
                    else:
                        out[t, h, 2 * i], out[t, h, 2 * i + 1] = ra, rb
    # numpy's pairwise summation of float32 (loops_utils.h: blocks of at most 128 values, each
    # summed with 8 accumulators; longer runs split in two halves, the split a multiple of 8),
    # reproduced exactly so that `_rms_rows` equals the numpy expression bit for bit
    @njit(cache=True, nogil=True, inline="always")
    def _block_sum(a, lo, n):
        if n < 8:
            res = np.float32(0.0)
            for i in range(lo, lo + n):
                res += a[i]
            return res
        r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
        r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
        i = 8
        whole = n - n % 8
        while i < whole:
            r0 += a[lo + i]
            r1 += a[lo + i + 1]
            r2 += a[lo + i + 2]
            r3 += a[lo + i + 3]
            r4 += a[lo + i + 4]
            r5 += a[lo + i + 5]
            r6 += a[lo + i + 6]
            r7 += a[lo + i + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += a[lo + i]
            i += 1
        return res

    @njit(cache=True, nogil=True)
    def _pairwise_sum(a, work):
        """numpy's pairwise sum of a (float32), its recursion unrolled on an explicit stack (numba
        does not cache recursive functions reliably). work: (64, 3) int64 scratch."""
        values = np.empty(64, np.float32)
        work[0, 0], work[0, 1], work[0, 2] = 0, a.shape[0], 0  # (first, count, halves done)
        depth, n_values = 1, 0
        while depth:
            lo, n, done = work[depth - 1, 0], work[depth - 1, 1], work[depth - 1, 2]
            if n <= 128:
                values[n_values] = _block_sum(a, lo, n)
                n_values += 1
                depth -= 1
                continue
            half = n // 2
            half -= half % 8
            if done < 2:  # push the first, then the second half
                work[depth - 1, 2] = done + 1
                work[depth, 0] = lo if done == 0 else lo + half
                work[depth, 1] = half if done == 0 else n - half
                work[depth, 2] = 0
                depth += 1
            else:  # both halves summed: left + right
                values[n_values - 2] = values[n_values - 2] + values[n_values - 1]
                n_values -= 1
                depth -= 1
        return values[0]

    @njit(cache=True, nogil=True)
    def _rms_rows(x, weight, eps, out):
        """out[t] = x[t] * (1 / sqrt(sum(x[t]²) / D + eps)) * weight, row by row: x, out (T, D)
        float32 C-contiguous, weight (D,) float32; the same operations in the same order as the
        numpy expression in `rms_norm` (no fused multiply-add), so the same results."""
        D = x.shape[1]
        squares = np.empty(D, np.float32)
        work = np.empty((64, 3), np.int64)
        for t in range(x.shape[0]):
            for d in range(D):
                squares[d] = x[t, d] * x[t, d]
            ms = (np.float32(0.0) + _pairwise_sum(squares, work)) / np.float32(D)
            inv = np.float32(1.0) / np.sqrt(ms + eps)
            for d in range(D):
                out[t, d] = x[t, d] * inv * weight[d]

    @njit(cache=True, nogil=True)
    def _running_sum(weights, out):
        """out[i] = weights[0] + ... + weights[i], added left to right as np.add.accumulate does
        (float64, no reassociation: numba keeps IEEE order without fastmath)."""
        total = 0.0
        for i in range(weights.shape[0]):
            total += weights[i]
            out[i] = total
except ImportError:  # pragma: no cover - numba is a dependency; the numpy path stays the reference
    _rope_rows = None
    _rms_rows = None
    _running_sum = None
