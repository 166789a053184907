"""Weight access: the one small interface the models use to read tensors.

Models ask a `WeightStore` for `linear(name)`, `embedding(name)` and `vector(name)`; what comes back
computes `y = x @ W.T` or looks rows up. This backend dequantizes each matrix to float32 once, with
the `gguf` package's reference dequantizers, so arithmetic is exact on the values the quantized
blocks hold. A quantized-kernel backend can replace `DenseLinear` without touching the models.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from .gguf_file import GGUFError, GGUFFile

# Types the loader accepts: those the two test models use plus Q5_1, Q5_K, BF16.
SUPPORTED_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

# Rows dequantized per call: bounds the temporary float32 buffers gguf's dequantizer makes.
_DEQUANT_ROWS = 8192


def dequantize_rows(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """(rows, bytes per row) quantized blocks → (rows, values per row) float32."""
    if ggml_type == GGMLQuantizationType.F32:
        return raw.view(np.float32)
    if ggml_type == GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32)
    return dequantize(raw, ggml_type).astype(np.float32, copy=False)


class DenseLinear:
    """y = x @ W.T with W (out_features, in_features) float32, dequantized once at load."""

    def __init__(self, weight: np.ndarray):
        self.weight = np.ascontiguousarray(weight, dtype=np.float32)  # (out, in)
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        # x (T, in) float32 → (T, out) float32
        return x @ self.weight.T

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class Embedding:
    """Token embedding table (vocab, dim); can double as the tied output projection."""

    def __init__(self, table: np.ndarray):
        self.table = table  # (vocab, dim) float32
        self.vocab_size, self.dim = table.shape

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return self.table[np.asarray(ids, dtype=np.int64)]  # (T, dim)

    def as_linear(self) -> DenseLinear:
        return DenseLinear(self.table)


class WeightStore:
    """Reads named tensors of a GGUF file, checking presence, type and shape."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self.loaded_bytes = 0

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def _dense(self, name: str, shape: tuple[int, ...] | None) -> np.ndarray:
        info = self.gguf.tensor_info(name)
        if info.ggml_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise GGUFError(
                f"{self.gguf.path.name}: tensor {name!r} is {info.type_name}, which this engine "
                f"cannot read yet (supported: {supported})"
            )
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise GGUFError(
                f"{self.gguf.path.name}: tensor {name!r} has shape {info.shape}, expected {shape} "
                "from the model's metadata"
            )
        raw = self.gguf.raw(name)
        out = np.empty((raw.shape[0], info.shape[-1]), dtype=np.float32)
        for start in range(0, raw.shape[0], _DEQUANT_ROWS):
            stop = start + _DEQUANT_ROWS
            out[start:stop] = dequantize_rows(raw[start:stop], info.ggml_type)
        self.loaded_bytes += out.nbytes
        return out.reshape(info.shape)

    def linear(self, name: str, out_features: int, in_features: int) -> DenseLinear:
        return DenseLinear(self._dense(name, (out_features, in_features)))

    def embedding(self, name: str, vocab: int, dim: int) -> Embedding:
        return Embedding(self._dense(name, (vocab, dim)))

    def vector(self, name: str, size: int) -> np.ndarray:
        return self._dense(name, (size,))
