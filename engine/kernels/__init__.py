"""Compiled kernels (numba). `HAVE_NUMBA` says whether they can be imported; callers keep a numpy
path and use the kernels only when it is True.

`engine.kernels.quant_matvec`: products and row lookups straight from GGUF quantized weight
blocks (used by `engine.weights` when HAVE_NUMBA is True).
`engine.kernels.kv_codes`: attention straight from packed KV cache blocks.
`engine.kernels.vector_ir`: the LLVM vector IR both write their inner loops in, and the numba
cache locators that make an edit to it recompile their kernels.
`engine.kernels.background`: kernel groups compiled off the path to the first token (a first
start), exact fallbacks answering until each is ready."""

from importlib.util import find_spec

HAVE_NUMBA: bool = find_spec("numba") is not None

__all__ = ["HAVE_NUMBA"]
