"""The KV cache: what the models call into to store keys/values and attend over them."""

from .cache import FullPrecisionCache, KVCache, LayerKVCache

__all__ = ["FullPrecisionCache", "KVCache", "LayerKVCache"]
