"""Master copies of pinned prefixes, and lower-precision blocks derived from them.

A pinned document's prefix is cached per KV layout (see `prefix`): its chain keys depend on every
layer's K/V format, so a preset switch finds nothing under the new layout. The master copy is the
prefix's full blocks at `MASTER_BITS` for K and V in every layer (formats `get_format(8, "k")` /
`get_format(8, "v")`, keys not rotated), with the same block size and sink count as the working
layout: exactly the layout of the high-precision preset (K8V8), so that preset's own cache is the
master and a prefix computed under it is one. Any layout whose every layer stores K and V at
MASTER_BITS or fewer is derived from it block by block:

    master row (q8, unrotated) --dequantize--> (n, Hkv, B, D) float32 --(k @ H if rotated)-->
        --quantize in the target layer's format--> target row

A target format equal to the master's (an 8-bit layer, no rotation) takes the master's row bytes
unchanged, so a derived K8V8 is bit-identical to the master. Sinks (kept at float16 in every
layout) are copied; the unfinished tail is never part of a cached prefix. A derived block
therefore has the row layout, sinks and window releases a direct computation of the target
layout produces; only its values differ (they were computed under 8-bit attention and quantized
twice).

Why 8 bits and not 16: the high-precision preset (K8V8) must be derivable (ticking it off and on
again costs no re-read), so the master holds at least 8 bits, and 8 bits is exactly that preset's
layout: its own cache is the master, a prefix pinned under it needs no second copy, and its saved
file is the master file. A 16-bit master would take twice the bytes (2 bytes per value against
8.5 bits with the q8 scales) to add only the "full" preset and 16-bit layer overrides, while the
second rounding an 8-bit master adds (half a q8 step: 1/254 of a 32-value group's largest magnitude) is small
beside the half step of the formats derived from it. The master lives on disk (saved with the
pinned prefix); in memory only while a prefix is being computed into it, or when there is no
disk store (see PrefixCache.derive_from_master). Only a switch to a layout with a layer above 8
bits re-reads.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .config import KVConfig
from .formats import hadamard
from .pool import LayerBlockPool

MASTER_BITS = 8


def master_config(config: KVConfig, bits: int = MASTER_BITS) -> KVConfig:
    """The master layout for `config`: `bits` for K and V in every layer, no rotation, the same
    block size and sinks (they decide the chain keys and the sink arrays)."""
    return replace(config, k_bits=bits, v_bits=bits, overrides=(), rotation=False)


def layers_above_master(config: KVConfig, n_layers: int, bits: int = MASTER_BITS) -> list[int]:
    """Layers of `config` that store K or V at more than the master's bits (they cannot be derived)."""
    return [i for i, p in enumerate(config.per_layer(n_layers)) if p.k_bits > bits or p.v_bits > bits]


def derivable(config: KVConfig, n_layers: int, bits: int = MASTER_BITS) -> bool:
    """Whether every layer of `config` can be derived from a master copy at `bits`."""
    return not layers_above_master(config, n_layers, bits)


def requantize_rows(src: LayerBlockPool, k_rows: np.ndarray, v_rows: np.ndarray, dst: LayerBlockPool,
                    rotation: bool) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `src`'s formats (unrotated keys) as rows of `dst`'s formats.

    Args:
        k_rows: (n, src.k_row_bytes) uint8; v_rows: (n, src.v_row_bytes) uint8.
        rotation: store keys as k @ H (H the Hadamard matrix of the head dimension), as a layout
            with rotation does.
    Returns:
        ((n, dst.k_row_bytes), (n, dst.v_row_bytes)) uint8.
    """
    if (src.n_kv_heads, src.block_size, src.head_dim, src.value_dim) != \
            (dst.n_kv_heads, dst.block_size, dst.head_dim, dst.value_dim):
        raise ValueError("master and target pools have different block geometry")
    Hkv, B, D, Dv = src.n_kv_heads, src.block_size, src.head_dim, src.value_dim
    if src.k_format == dst.k_format and not rotation:
        k_out = np.array(k_rows, np.uint8, copy=True)
    else:
        k = src.k_format.dequantize(np.ascontiguousarray(k_rows), Hkv, B, D)  # (n, Hkv, B, D)
        if rotation:
            k = k @ hadamard(D)
        k_out = dst.k_format.quantize(np.ascontiguousarray(k, np.float32))
    if src.v_format == dst.v_format:
        v_out = np.array(v_rows, np.uint8, copy=True)
    else:
        v = src.v_format.dequantize(np.ascontiguousarray(v_rows), Hkv, B, Dv)
        v_out = dst.v_format.quantize(v)
    return k_out, v_out
