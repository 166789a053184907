"""Scaled dot-product attention over stored keys/values (numpy reference path)."""

from __future__ import annotations

import numpy as np


def grouped_attention(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    q_positions: np.ndarray,
    k_positions: np.ndarray,
    *,
    scale: float,
    window: int | None = None,
) -> np.ndarray:
    """Causal grouped-query attention.

    Args:
        q: (T, H, D) float32 queries; query head h reads KV head h // (H // Hkv).
        keys: (Hkv, L, D), values: (Hkv, L, Dv), any float dtype (upcast to float32).
        q_positions: (T,) absolute positions of the queries.
        k_positions: (L,) absolute positions of the stored keys.
        scale: multiplies q·k.
        window: sliding window; query at p sees key at j iff j <= p and p - j < window.

    Returns:
        (T, H, Dv) float32.
    """
    T, H, D = q.shape
    n_kv, L, _ = keys.shape
    group = H // n_kv
    qg = q.reshape(T, n_kv, group, D).transpose(1, 2, 0, 3).reshape(n_kv, group * T, D)
    k32 = keys.astype(np.float32, copy=False)
    v32 = values.astype(np.float32, copy=False)
    scores = np.matmul(qg, k32.transpose(0, 2, 1))  # (Hkv, G*T, L)
    scores *= np.float32(scale)
    visible = k_positions[None, :] <= q_positions[:, None]  # (T, L)
    if window is not None:
        visible &= (q_positions[:, None] - k_positions[None, :]) < window
    scores = scores.reshape(n_kv, group, T, L)
    scores = np.where(visible[None, None], scores, np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores.reshape(n_kv, group * T, L), v32)  # (Hkv, G*T, Dv)
    Dv = v32.shape[-1]
    return out.reshape(n_kv, group, T, Dv).transpose(2, 0, 1, 3).reshape(T, H, Dv)
