"""Optional compiled kernels (numba). `HAVE_NUMBA` says whether they can be imported; callers keep
a numpy path and use `engine.kernels.kv_codes` only when it is True.

`engine.kernels.quant_matvec`: products and row lookups straight from GGUF quantized weight
blocks (used by `engine.weights` when HAVE_NUMBA is True)."""

from importlib.util import find_spec

HAVE_NUMBA: bool = find_spec("numba") is not None

__all__ = ["HAVE_NUMBA"]
