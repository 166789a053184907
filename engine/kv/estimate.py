"""The KV cache's size by formula: the bytes the paged cache holds for one sequence.

``estimate_bytes`` (config.py) takes a config, a spec or a preset name and calls ``kv_bytes``.
"""

from __future__ import annotations

from .spec import _parse_int


def kv_bytes(
    config: "KVConfig",
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    n_tokens: int,
    value_dim: int | None = None,
    windows: list[int | None] | None = None,
) -> dict:
    """Bytes the paged cache holds for `n_tokens` tokens of one sequence (the formula).

    Storage model (engine.kv.paged), per layer and for K and V separately:
      * the full blocks a layer still holds, each one row of
        `get_format(bits, role).bytes_per_block(n_kv_heads, block_size, dim)` bytes (16 bits:
        float16 rows). A sliding-window layer (windows[i] = W) releases blocks that the next
        query can no longer see: those ending before position n_tokens - W + 1;
      * the unfinished tail block and the sink tokens: float32 buffers of block_size and
        `sinks` tokens, allocated once per layer.

    Returns {"total", "k", "v": bytes; "per_layer": [{"layer", "k_bits", "v_bits", "k", "v",
    "total", "k_blocks", "v_blocks" (the quantized blocks alone, without the buffers)}];
    "bits_per_value": average stored bits per K/V element (0.0 for no tokens)}.
    """
    n_kv_heads = _parse_int(n_kv_heads, "n_kv_heads", 1)
    head_dim = _parse_int(head_dim, "head_dim", 1)
    n_tokens = _parse_int(n_tokens, "n_tokens", 0)
    value_dim = head_dim if value_dim is None else _parse_int(value_dim, "value_dim", 1)
    windows = windows or [None] * n_layers
    layers = config.per_layer(n_layers)
    # imported here: formats loads the numba kernels, which reading a config does not need
    from .formats import get_format

    bs = config.block_size
    n_full = n_tokens // bs
    buffer_tokens = bs + config.sinks

    def block_bytes(bits: int, role: str, dim: int, blocks: int) -> int:
        return blocks * get_format(bits, role).bytes_per_block(n_kv_heads, bs, dim)

    def buffer_bytes(dim: int) -> int:
        return buffer_tokens * n_kv_heads * dim * 4

    per_layer = []
    for i, prec in enumerate(layers):
        blocks = n_full
        if windows[i] is not None:
            blocks -= min(n_full, max(0, (n_tokens - windows[i] + 1) // bs))
        k_blocks = block_bytes(prec.k_bits, "k", head_dim, blocks)
        v_blocks = block_bytes(prec.v_bits, "v", value_dim, blocks)
        k, v = k_blocks + buffer_bytes(head_dim), v_blocks + buffer_bytes(value_dim)
        per_layer.append({"layer": i, "k_bits": prec.k_bits, "v_bits": prec.v_bits, "k": k, "v": v,
                          "total": k + v, "k_blocks": k_blocks, "v_blocks": v_blocks})
    k_total = sum(p["k"] for p in per_layer)
    v_total = sum(p["v"] for p in per_layer)
    total = k_total + v_total
    n_values = n_layers * n_tokens * n_kv_heads * (head_dim + value_dim)
    return {
        "total": total,
        "k": k_total,
        "v": v_total,
        "per_layer": per_layer,
        "bits_per_value": total * 8 / n_values if n_values else 0.0,
    }
