"""The KV cache: what the models call into to store keys/values and attend over them.

    cache.py            LayerKVCache / KVCache interfaces, the plain float16 reference cache
    attention.py        grouped_attention, the plain cache's numpy attention
    paged.py            PagedKVCache: one sequence over per-layer block pools
    storage.py          PagedLayerCache: one layer's blocks, float16 tail and sinks (storage only)
    paged_attention.py  the paged cache's attention paths, chosen once per layer; warm-up
    overflow.py         the overflow policies at the context limit (stop, rolling, attention)
    pool.py             LayerBlockPool (quantized blocks in slabs, reference counts), build_pools
    prefix.py           PrefixCache: blocks shared between sequences by chained hash, on disk too
    config.py           KVConfig: the KV precision model (spec.py: the spec grammar; settings.py:
                        settings mappings and files; estimate.py: the byte estimate)
    formats.py          the storage formats
"""

from .cache import FullPrecisionCache, KVCache, LayerKVCache

__all__ = ["FullPrecisionCache", "KVCache", "LayerKVCache"]
