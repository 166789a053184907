"""Weight access: the one small interface the models use to read tensors.

Models ask a `WeightStore` for `linear(name)`, `embedding(name)` and `vector(name)`; what comes back
computes `y = x @ W.T` or looks rows up. Arithmetic is on exactly the values the quantized blocks
hold (the values `gguf.quants.dequantize` gives), in float32.

Two backends:

* quantized (default when numba is installed): matrices stay as the memory-mapped GGUF blocks, so
  resident weight memory is about the file's size. `QuantLinear` multiplies a few rows of x
  (decode) with fused dequantize-and-dot kernels (`engine.kernels.quant_matvec`; the rows of W are
  shared between the calling thread and a worker thread per extra core, OMLX_KERNEL_THREADS
  threads in all, default: the CPUs available), and many rows (prefill) by dequantizing a tile of
  rows at a time into a reused float32 buffer and multiplying it with BLAS (OpenBLAS's own
  threads). Embedding lookups dequantize only the rows looked up. The kernels for the types a
  file uses are compiled (first start) or loaded from numba's disk cache when the store is made.
* dense: every matrix dequantized to float32 once at load (`DenseLinear`), then BLAS. Used when
  numba is missing, for F32 matrices (a view of the file, no copy), for rows the kernels cannot
  read, and when asked: `WeightStore(g, backend="dense")` or the environment variable
  OMLX_WEIGHTS=dense (for comparisons).

1-D tensors (norm weights) are always read as float32 (`vector`).
"""

from __future__ import annotations

import os
import threading

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from .gguf_file import GGUFError, GGUFFile, UnsupportedTensorType
from .kernels import HAVE_NUMBA
from .kernels.helper import helper_thread, share_rows
from .memory import HugePageArena


def _gguf_can_dequantize(ggml_type: GGMLQuantizationType) -> bool:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


# Types the loader accepts: every type the `gguf` package can dequantize. Matrices of a type
# with a fused kernel (engine.kernels.quant_matvec.supports) stay as blocks; the others are
# dequantized to float32 once at load (the dense path).
SUPPORTED_TYPES = frozenset(t for t in GGMLQuantizationType if _gguf_can_dequantize(t))

# Rows dequantized per call: bounds the temporary float32 buffers gguf's dequantizer makes.
_DEQUANT_ROWS = 8192

# Environment variable choosing the backend of WeightStores made without an explicit one.
BACKEND_ENV = "OMLX_WEIGHTS"
BACKENDS = ("quant", "dense")


def default_backend() -> str:
    """"quant" when the kernels can run, unless OMLX_WEIGHTS=dense."""
    wanted = os.environ.get(BACKEND_ENV, "").strip().lower() or "quant"
    if wanted not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={wanted!r}: expected one of {', '.join(BACKENDS)}")
    return wanted if HAVE_NUMBA else "dense"


ARITH_ENV = "OMLX_ARITH"
# The weight products' arithmetic (docs/kernels.md):
#   "exact" (default): the integer kernels where they exist, activations at 16 bits per 32 values
#            (within a mean KL of 1e-5 of the float kernels: the reference bars hold);
#   "fast":  the same kernels with int8 activations per 32 values (llama.cpp's arithmetic, its
#            cost measured by `omlx eval-kv --arith fast`); switchable at run time
#            (`Engine.set_arith`), a type without integer kernels keeps the float ones;
#   "float": the float kernels (dequantize and FMA) for every matrix, chosen at load.
ARITH_MODES = ("exact", "fast", "float")


def check_arith(mode: str) -> str:
    """`mode` lower-cased if it is one of ARITH_MODES, else a SettingsError naming the closest."""
    from .errors import SettingsError

    wanted = str(mode).strip().lower()
    if wanted not in ARITH_MODES:
        import difflib

        close = difflib.get_close_matches(wanted, ARITH_MODES, n=1, cutoff=0.3)
        hint = f" — did you mean '{close[0]}'?" if close else ""
        raise SettingsError(f"arithmetic {mode!r} is not one of {', '.join(ARITH_MODES)}{hint}")
    return wanted


def arith_mode() -> str:
    """The arithmetic OMLX_ARITH asks for ("exact" when unset)."""
    wanted = os.environ.get(ARITH_ENV, "").strip() or "exact"
    try:
        return check_arith(wanted)
    except ValueError as exc:
        raise type(exc)(f"{ARITH_ENV}: {exc}") from None


def fast_arith_pays() -> bool:
    """Whether the fast arithmetic (int8 activations) is faster than exact on this CPU's integer
    kernels (`int_dot.FAST_GAINS`: with VNNI, not on AVX2 alone)."""
    if not HAVE_NUMBA:
        return False
    from .kernels import int_dot

    return int_dot.FAST_GAINS.get(int_dot.kernel_isa(), False)


def weight_arith(ggml_type: GGMLQuantizationType, out_features: int, in_features: int) -> str:
    """"int" when this CPU has integer kernels (`int_dot.kernel_isa`, OMLX_KERNELS forces one, or
    "float") and the type has them at this shape, unless OMLX_ARITH=float; else "float"."""
    if arith_mode() == "float" or not HAVE_NUMBA:
        return "float"
    from .kernels import int_dot, int_matvec

    if not int_matvec.supports(ggml_type, out_features, in_features) or int_dot.kernel_isa() == "float":
        return "float"
    return "int"


def weight_kernels(gguf: GGUFFile) -> dict:
    """Which kernels the matrices of a file will run on, from its header alone (`omlx info`):
    {"isa": the integer kernels' instruction set or "float", "arith": the arithmetic mode
    (ARITH_MODES; "float" when no matrix takes the integer kernels), "kernels": its description,
    "int": [types on the integer kernels], "float": [types on the float ones]}."""
    by_path: dict[str, set[str]] = {"int": set(), "float": set()}
    for info in gguf.tensors.values():
        if len(info.shape) != 2 or info.ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            continue
        by_path[weight_arith(info.ggml_type, *info.shape)].add(info.type_name)
    from .kernels import int_dot

    # the integer kernels' instruction set only when some matrix takes them (weight_arith said so)
    isa = int_dot.kernel_isa() if by_path["int"] else "float"
    arith = arith_mode() if by_path["int"] else "float"
    return {"isa": isa, "arith": arith, "kernels": int_dot.describe(isa, fast=arith == "fast"),
            "int": sorted(by_path["int"]), "float": sorted(by_path["float"])}


def dequantize_rows(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """(rows, bytes per row) quantized blocks → (rows, values per row) float32 (gguf's reference
    dequantizer)."""
    if ggml_type == GGMLQuantizationType.F32:
        return raw.view(np.float32)
    if ggml_type == GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32)
    return dequantize(raw, ggml_type).astype(np.float32, copy=False)


# Products of many rows of x with a float32 matrix W (n, in) → y (T, n), through BLAS (numpy's
# OpenBLAS). With up to TRANSPOSED_PRODUCT_MAX_ROWS rows, y.T = W @ x.T is computed (x.T passed as
# a transposed view, the result copied back to y's layout): OpenBLAS's kernels for a few columns
# are faster than for a few rows. Above that, y = x @ W.T directly. Both formulations sum each
# output over `in` in the same order (tests/test_weights_gemm.py checks the bits), so which one a
# product takes does not change its values: only the rule "a row's sums do not depend on how many
# rows there are, past OpenBLAS's small-product paths" matters for batching (serve.scheduler).
TRANSPOSED_PRODUCT_MAX_ROWS = 64


def _product_view(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T (T, n) for x (T, in) float32 C-contiguous and w (n, in), by the rule above: for a
    few rows a transposed view of w @ x.T."""
    return (w @ x.T).T if x.shape[0] <= TRANSPOSED_PRODUCT_MAX_ROWS else x @ w.T


def _product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T (T, n), C-contiguous."""
    return np.ascontiguousarray(_product_view(x, w))


_blas_rows_independent: bool | None = None


def blas_rows_independent() -> bool:
    """Whether this process's BLAS computes each row of a product of many rows (past its small-
    product paths: 17..300 rows of a SmolLM2-sized matrix, either layout `_product` takes) with
    the same bits whatever the other rows: what batching several sequences' prefill chunks into
    one pass relies on (`serve.scheduler.min_batched_chunk`). Measured once, in ~10 ms: OpenBLAS
    picks its kernels by CPU, and its Haswell kernels (AVX2 CPUs, AMD's Zen 4, or
    OPENBLAS_CORETYPE=Haswell) round a row differently with the number of rows; its SkylakeX
    kernels do not."""
    global _blas_rows_independent
    if _blas_rows_independent is None:
        rng = np.random.default_rng(0)
        same = True
        for n, k in ((192, 576), (576, 1536)):
            w = rng.standard_normal((n, k)).astype(np.float32)
            x = rng.standard_normal((300, k)).astype(np.float32)
            full = _product(x, w)
            for T in (17, 46, TRANSPOSED_PRODUCT_MAX_ROWS, TRANSPOSED_PRODUCT_MAX_ROWS + 1, 200):
                same = same and np.array_equal(_product(x[:T], w).view(np.uint32), full[:T].view(np.uint32))
        _blas_rows_independent = bool(same)
    return _blas_rows_independent


def linear_layers(obj, _seen: set | None = None):
    """Every QuantLinear and DenseLinear reachable from `obj` (a model) through attributes, slots,
    lists, tuples and dicts, each once."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen or obj is None or isinstance(obj, (np.ndarray, str, bytes, int, float, bool)):
        return
    seen.add(id(obj))
    if isinstance(obj, (QuantLinear, DenseLinear)):
        yield obj
        return
    if isinstance(obj, Embedding):
        if obj._linear is not None:
            yield from linear_layers(obj._linear, seen)
        return
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__") or hasattr(type(obj), "__slots__"):
        children = list(getattr(obj, "__dict__", {}).values())
        children += [getattr(obj, n) for n in getattr(type(obj), "__slots__", ()) if hasattr(obj, n)]
    else:
        return
    for child in children:
        yield from linear_layers(child, seen)


# QuantLinear.int_max_rows of a layer whose instruction set takes every row count on the integer
# kernels (int_dot.INT_MAX_ROWS None)
EVERY_ROW_COUNT = 1 << 62


def products_use_blas(model) -> bool:
    """Whether some linear layer of the model's blocks (`model.layers`: what a prefill's many rows
    go through; the output layer takes only each sequence's last row) multiplies many rows
    through BLAS (float32 matrices, quantized types without integer kernels); False when every
    one is on the integer kernels at any row count, whose rows are then exact at any count (not on
    AVX2, where long inputs go to tiles and BLAS: `int_dot.INT_MAX_ROWS`)."""
    layers = getattr(model, "layers", model)
    return any(not (isinstance(lin, QuantLinear) and lin.arith == "int" and lin.int_max_rows == EVERY_ROW_COUNT)
               for lin in linear_layers(layers))


def integer_rows(model) -> int | None:
    """The most rows of x a product of this model takes on the integer kernels (the smallest
    `int_max_rows` of its integer layers: AVX2 sends longer inputs to float tiles), None when no
    layer is capped or none is on them. An evaluation of an arithmetic (eval-kv --arith fast)
    runs in chunks of at most this many tokens, so that every position is computed in it, as
    decode steps are."""
    caps = [lin.int_max_rows for lin in linear_layers(model) if isinstance(lin, QuantLinear) and lin.arith == "int"]
    smallest = min(caps, default=EVERY_ROW_COUNT)
    return None if smallest == EVERY_ROW_COUNT else int(smallest)


def _as_rows(x, in_features: int) -> tuple[np.ndarray, tuple]:
    """x (..., in_features) as C-contiguous float32 rows (T, in_features), and its leading shape
    (for the result's reshape); a wrong feature count is a ValueError."""
    x = np.asarray(x)
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, this layer takes {in_features}")
    return np.ascontiguousarray(x.reshape(-1, in_features), dtype=np.float32), x.shape[:-1]


class DenseLinear:
    """y = x @ W.T with W (out_features, in_features) float32, dequantized once at load.

    Up to MAX_ROWS_ALONE rows of x are each multiplied alone (one matrix-vector product per row),
    so that each row's values do not depend on the other rows: a decode batch gives every sequence
    the logits it gets alone, as with QuantLinear's fused kernels. More rows go to one BLAS
    product (`_product`)."""

    # A decode batch's rows (`omlx serve`'s DECODE_GROUP); not more: each row is a pass over W,
    # where a prefill chunk's rows are cheaper as one product.
    MAX_ROWS_ALONE = 8

    def __init__(self, weight: np.ndarray):
        self.weight = np.ascontiguousarray(weight, dtype=np.float32)  # (out, in)
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        # x (..., in) float32 → (..., out) float32
        x2, lead = _as_rows(x, self.in_features)
        T = x2.shape[0]
        if T <= self.MAX_ROWS_ALONE:
            y = np.empty((T, self.out_features), dtype=np.float32)
            for i in range(T):
                np.matmul(self.weight, x2[i], out=y[i])
        else:
            y = _product(x2, self.weight)
        return y.reshape(*lead, self.out_features)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


# One float32 tile buffer per thread, shared by all QuantLinears (grown to the largest tile).
_tiles = threading.local()


def _tile_buffer(n_values: int) -> np.ndarray:
    buf = getattr(_tiles, "buf", None)
    if buf is None or buf.size < n_values:
        buf = _tiles.buf = np.empty(n_values, dtype=np.float32)
    return buf


# Rows of x from which its activations are quantized on two threads (the second half on the
# helper thread, as tiles are dequantized): one thread's quantizer is ~2 ns per value, ~6% of a
# 1B model's prefill.
PARALLEL_QUANTIZE_ROWS = 64


_int_dot = None  # engine.kernels.int_dot once imported (on first use: it loads numba)


def _import_int_dot():
    global _int_dot
    from .kernels import int_dot

    _int_dot = int_dot
    return int_dot


def quantize_input(x: np.ndarray, form: str) -> np.ndarray:
    """x (T, in) float32 C-contiguous -> its activations for the integer kernels in `form`
    (`int_dot.ACTIVATION_FORMS`: 16-bit as i16 pairs or hi/lo bytes, or int8), long inputs on
    two threads: the same words either way (each row is quantized alone)."""
    # (an import statement here cost ~1 us a call, a third of quantizing a decode row)
    int_dot = _int_dot or _import_int_dot()
    T = x.shape[0]
    if T < PARALLEL_QUANTIZE_ROWS:
        return int_dot.quantize_form(x, form)
    out = np.empty((T, int_dot.form_words(form, x.shape[1])), np.float32)
    share_rows(lambda r0, r1: int_dot.quantize_form(x[r0:r1], form, out[r0:r1]), T, -(-T // 2))
    return out


def products(layers, x: np.ndarray) -> list:
    """[layer(x) for layer in layers], x (T, in) quantized once per kind of activations among
    the integer layers (q, k and v read one input; so do gate and up)."""
    x = np.ascontiguousarray(x, dtype=np.float32) if x.ndim == 2 else x
    shared: dict = {}
    out = []
    for layer in layers:
        kind = layer.takes_quantized(x) if isinstance(layer, QuantLinear) and x.ndim == 2 else None
        if kind is None:
            out.append(layer(x))
            continue
        if kind not in shared:
            shared[kind] = quantize_input(x, kind)
        out.append(layer(x, shared[kind]))
    return out


class LinearGroup:
    """Layers that read one input (q, k and v; gate and up): `group(x)` is `products(layers, x)`,
    bit for bit. A decode step's or a batch's rows (up to QuantLinear.MATVEC_MAX_ROWS) go to all
    of them in one pool job when every layer takes the integer kernels the same way
    (`int_matvec.IntMatvecGroup`: each product's hand-off between threads cost about what a
    small model's k or v product computes)."""

    def __init__(self, layers):
        self.layers = tuple(layers)
        self._joint = None
        if len(self.layers) > 1 and all(isinstance(lin, QuantLinear) and lin._int is not None for lin in self.layers):
            from .kernels import int_matvec

            matvecs = [lin._int for lin in self.layers]
            if len({(m.in_features, m.isa, m.form) for m in matvecs}) == 1:
                self._joint = int_matvec.IntMatvecGroup(matvecs)
                self._spans = [(a, b) for a, b in zip(self._joint.bounds, self._joint.bounds[1:])]
                # rows of x the pool shares in one job (more run alone: as separate products)
                self._joint_rows = min(QuantLinear.MATVEC_MAX_ROWS, self._joint.max_rows)

    def __call__(self, x: np.ndarray) -> list:
        joint = self._joint
        if (joint is not None and type(x) is np.ndarray and x.ndim == 2 and x.dtype == np.float32
                and x.flags.c_contiguous and 0 < x.shape[0] <= self._joint_rows):
            fast = self.layers[0].fast
            if all(lin.fast == fast for lin in self.layers):  # (Engine.set_arith switches them all)
                T = x.shape[0]
                y = joint(quantize_input(x, "fast" if fast else joint.form), np.empty((T, joint.n_rows), np.float32),
                          fast)
                if T == 1:  # one row: each layer's columns are a contiguous view
                    return [y[:, a:b] for a, b in self._spans]
                return [np.ascontiguousarray(y[:, a:b]) for a, b in self._spans]
        return products(self.layers, x)


class QuantLinear:
    """y = x @ W.T computed from W's quantized GGUF blocks, W (out_features, in_features).

    `raw` is the (out_features, bytes per row) uint8 view of the blocks (usually of the
    memory-mapped file). Results equal `x @ dequantize(raw).T` up to float32 rounding of the sums:
    the kernels multiply exactly the dequantized values.
    """

    # x with at most this many rows goes to the fused matvec kernels (each block decoded once for
    # up to 4 rows of x, `quant_matvec`), which compute every row exactly as alone; more rows to
    # dequantized tiles and BLAS, which dequantize the whole matrix first. A decode batch (up to
    # DenseLinear.MAX_ROWS_ALONE sequences per pass) and a short prompt chunk (a follow-up message,
    # the tail of a prompt found in the prefix cache) take the kernels. Whole-model forward passes,
    # kernels vs tiles (docs/performance.md): 9 tokens SmolLM2 73 vs 148 ms, Gemma3 270M 66 vs 93,
    # the 1B shape 263 vs 713; 16 tokens 103 vs 134, 88 vs 91, 421 vs 669, the 3B shape 950 vs
    # 1900; at 24 Gemma3's Q4_K kernels are slower (120 vs 106), SmolLM2's tie from 32, the 3B's
    # lose at 40.
    MATVEC_MAX_ROWS = 16
    # float32 values per dequantized tile (rows = TILE_VALUES // in_features, at least 16):
    # 2**22 values = 16 MiB (one buffer per thread), so that a small model's matrices are one tile
    # and one BLAS call each, as dense weights are: more, smaller calls are slower (each
    # multi-threaded BLAS call ends in a barrier, which costs most when other processes are busy).
    TILE_VALUES = 1 << 22

    # rows repacked at a time for the integer kernels (a multiple of their 16-row groups): the
    # file's pages of each slice are dropped before the next is read, so loading holds one slice
    # of both, not a whole vocabulary-sized matrix twice
    REPACK_ROWS = 4096

    def __init__(self, raw: np.ndarray, ggml_type: GGMLQuantizationType, out_features: int, in_features: int,
                 arith: str | None = None, release=None, arena: HugePageArena | None = None):
        """arith: "int" (the integer kernels, `engine.kernels.int_matvec`, where this CPU and the
        type have them), "float" (the float kernels) or None: `weight_arith(ggml_type, ...)`.
        release: called with each slice of `raw` once it is repacked (`GGUFFile.release`).
        arena: where the repacked copy goes (huge pages: decoding streams it once a token)."""
        from .kernels import quant_matvec

        self._k = quant_matvec
        if not quant_matvec.supports(ggml_type, in_features):
            raise ValueError(f"no quantized kernel for {ggml_type.name} rows of {in_features} values")
        if raw.shape[0] != out_features:
            raise ValueError(f"{raw.shape[0]} rows of blocks for {out_features} output features")
        self.ggml_type = ggml_type
        self.out_features, self.in_features = out_features, in_features
        self.tile_rows = max(16, self.TILE_VALUES // in_features)
        self.arith = weight_arith(ggml_type, out_features, in_features) if arith is None else arith
        if self.arith == "int":
            from .kernels import int_dot, int_matvec

            # every row count up to int_max_rows goes to the integer kernels (each weight block
            # decoded once for all the rows of x, a row's result the same in any batch of up to
            # that many rows); longer prompt chunks to dequantized tiles and BLAS where the ISA
            # makes those faster (int_dot.INT_MAX_ROWS). `raw` is not kept: the repacked copy
            # replaces it (the caller may drop the file's pages, see GGUFFile.release); the
            # tiles are dequantized from it, unpacked back to GGUF order
            packed = np.empty(raw.shape, np.uint8) if arena is None else arena.empty(raw.shape)
            for r0 in range(0, out_features, self.REPACK_ROWS):
                part = raw[r0 : r0 + self.REPACK_ROWS]
                packed[r0 : r0 + part.shape[0]] = int_matvec.repack(part, ggml_type)
                if release is not None:
                    release(part)
            isa = int_dot.kernel_isa()
            self._int = int_matvec.IntMatvec(ggml_type, raw, in_features, isa, packed=packed)
            self.int_max_rows = int_dot.INT_MAX_ROWS[isa] or EVERY_ROW_COUNT
            # tiles (and their halves) in whole 16-row groups: `range_gguf` unpacks those by
            # strided copies; a tile starting mid-group would take the row-by-row gather
            self.tile_rows = max(int_matvec.GROUP, self.tile_rows // int_matvec.GROUP * int_matvec.GROUP)
            self._matvec = None
            self.fast = False  # int8 activations (ARITH_MODES "fast"); Engine.set_arith switches it
            self.raw = None
        else:
            self._int = None
            self.int_max_rows = 0
            self.fast = False
            self._matvec = quant_matvec.Matvec(ggml_type, raw, in_features)  # checks the row length
            self.raw = self._matvec.raw

    def __call__(self, x: np.ndarray, xw: np.ndarray | None = None) -> np.ndarray:
        # x (T, in) float32 → (T, out) float32. xw: x's quantized activations for this layer's
        # integer kernels (`takes_quantized`, `quantize_input`), when several layers share x
        if (type(x) is np.ndarray and x.ndim == 2 and x.dtype == np.float32 and x.flags.c_contiguous
                and x.shape[1] == self.in_features and 0 < x.shape[0] <= self.MATVEC_MAX_ROWS):
            if self._int is not None:
                return self._int(x, np.empty((x.shape[0], self.out_features), dtype=np.float32), self.fast, xw)
            return self._matvec(x, np.empty((x.shape[0], self.out_features), dtype=np.float32))
        x2, lead = _as_rows(x, self.in_features)
        T = x2.shape[0]
        if T == 0:
            y = np.empty((0, self.out_features), np.float32)
        elif self._int is not None and T <= self.int_max_rows:
            x2 = np.ascontiguousarray(x2)
            if xw is None:
                xw = quantize_input(x2, self.takes_quantized(x2))
            y = self._int(x2, np.empty((T, self.out_features), dtype=np.float32), self.fast, xw)
        elif T <= self.MATVEC_MAX_ROWS:
            y = self._matvec(x2, np.empty((T, self.out_features), dtype=np.float32))
        else:
            y = self._gemm(x2)
        return y.reshape(*lead, self.out_features)

    def takes_quantized(self, x: np.ndarray) -> str | None:
        """The activations this layer's integer kernels take for x (T, in) float32 C-contiguous
        (`int_dot.activation_form`: "pairs", "split" or "fast"), which `quantize_input(x, form)`
        makes; None when x goes another way."""
        if self._int is None or not 0 < x.shape[0] <= max(self.int_max_rows, self.MATVEC_MAX_ROWS):
            return None
        return "fast" if self.fast else self._int.form

    def _gemm(self, x: np.ndarray) -> np.ndarray:
        T, n = x.shape[0], self.out_features
        rows = min(self.tile_rows, n)
        buf = _tile_buffer(rows * self.in_features)
        if rows == n:  # one tile: no copy into y
            tile = buf[: n * self.in_features].reshape(n, self.in_features)
            self._dequantize(0, n, tile)
            return _product(x, tile)
        y = np.empty((T, n), dtype=np.float32)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            tile = buf[: (stop - start) * self.in_features].reshape(stop - start, self.in_features)
            self._dequantize(start, stop, tile)
            y[:, start:stop] = _product_view(x, tile)
        return y

    # Rows per tile below which one thread dequantizes it alone (handing half to a second thread
    # costs tens of µs).
    PARALLEL_DEQUANTIZE_ROWS = 256

    def _dequantize(self, start: int, stop: int, tile: np.ndarray) -> None:
        """tile = W[start:stop], the second half on the helper thread when the tile is large (the
        kernels release the GIL): BLAS uses every core for the product, dequantizing on one left
        the others idle for ~8% of a 1B model's prefill."""
        n = stop - start
        helper = helper_thread() if n >= self.PARALLEL_DEQUANTIZE_ROWS else None
        if helper is None:
            self._dequantize_part(start, stop, tile)
            return
        half = n // 2 if self._int is None else n // 2 // 16 * 16  # (whole groups, see __init__)
        job = helper.submit(self._dequantize_part, start + half, stop, tile[half:])
        self._dequantize_part(start, start + half, tile[:half])
        job.result()

    def _dequantize_part(self, start: int, stop: int, tile: np.ndarray) -> None:
        if self._int is None:
            self._k.dequantize_rows(self.ggml_type, self.raw, np.arange(start, stop), tile)
            return
        blocks = self._int.range_gguf(start, stop)  # (stop - start, bytes) in GGUF order
        self._k.dequantize_rows(self.ggml_type, blocks, np.arange(stop - start), tile)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """W[ids] (len(ids), in_features) float32, dequantizing only those rows."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty((ids.shape[0], self.in_features), dtype=np.float32)
        if self._int is not None:  # the GGUF blocks of those rows, back from the repacked copy
            if ids.size and (ids.min() < 0 or ids.max() >= self.out_features):
                raise IndexError(f"row index out of range for {self.out_features} rows")
            blocks = np.ascontiguousarray(self._int.rows_gguf(ids))
            return self._k.dequantize_rows(self.ggml_type, blocks, np.arange(ids.shape[0]), out)
        return self._k.dequantize_rows(self.ggml_type, self.raw, ids, out)

    @property
    def weight(self) -> np.ndarray:
        """The whole matrix dequantized (a new float32 array; for tests and inspection)."""
        return self.rows(np.arange(self.out_features))

    @property
    def nbytes(self) -> int:
        return self._int.packed.nbytes if self._int is not None else self.raw.nbytes


class Embedding:
    """Token embedding table (vocab, dim); can double as the tied output projection.

    Holds either a float32 table or a QuantLinear over the quantized table; `lookup` then
    dequantizes only the rows looked up and `as_linear` returns that same QuantLinear."""

    def __init__(self, table: np.ndarray | QuantLinear):
        if isinstance(table, QuantLinear):
            self.table = None
            self._linear: QuantLinear | DenseLinear | None = table
            self.vocab_size, self.dim = table.out_features, table.in_features
        else:
            self.table = table  # (vocab, dim) float32
            self._linear = None
            self.vocab_size, self.dim = table.shape

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        if self.table is None:
            ids = np.asarray(ids, dtype=np.int64)
            return self._linear.rows(ids).reshape(*ids.shape, self.dim)  # (T, dim)
        return self.table[np.asarray(ids, dtype=np.int64)]  # (T, dim)

    def as_linear(self) -> QuantLinear | DenseLinear:
        if self._linear is None:
            self._linear = DenseLinear(self.table)
        return self._linear

    @property
    def nbytes(self) -> int:
        return self.table.nbytes if self.table is not None else self._linear.nbytes


class WeightStore:
    """Reads named tensors of a GGUF file, checking presence, type and shape.

    backend: "quant" or "dense" (see the module docstring); default `default_backend()`.
    `loaded_bytes` counts the weight bytes the returned objects hold: float32 bytes for dense
    matrices and vectors, block bytes (a view of the file) for quantized ones.
    """

    def __init__(self, gguf: GGUFFile, backend: str | None = None):
        self.gguf = gguf
        self.loaded_bytes = 0
        backend = default_backend() if backend is None else backend
        if backend not in BACKENDS:
            raise ValueError(f"weights backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        if backend == "quant" and not HAVE_NUMBA:
            backend = "dense"
        self.backend = backend
        self.arena: HugePageArena | None = None  # set below when matrices take the integer kernels
        if backend == "quant":
            from .kernels import quant_matvec

            # compile / load the kernels of the matrix types this file uses, logging the time (the
            # thread pool's own functions: Engine.load's warm-up, or the first call that uses it)
            # (a type whose matrices all take the integer kernels needs no float kernel, only
            # its row dequantizer when it is the token table: embedding lookups read rows)
            matrices = {name: i for name, i in gguf.tensors.items() if len(i.shape) == 2}
            arith = {name: weight_arith(i.ggml_type, *i.shape) for name, i in matrices.items()}
            on_int = {i.ggml_type for name, i in matrices.items() if arith[name] == "int"}
            on_float = {i.ggml_type for name, i in matrices.items() if arith[name] == "float"}
            tables = {i.ggml_type for name, i in matrices.items() if name.startswith("token_embd")}
            quant_matvec.warm_up(on_float, pool=False, rows_only=tables & on_int)
            if on_int:
                from .kernels import int_dot, int_matvec

                int_matvec.warm_up(on_int, int_dot.kernel_isa())
                # the repacked matrices' home: one mapping in 2 MiB pages (HugePageArena)
                int_matrices = [name for name in matrices if arith[name] == "int"]
                self.arena = HugePageArena.for_bytes(sum(gguf.raw(name).nbytes for name in int_matrices),
                                                     len(int_matrices))

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def _info(self, name: str, shape: tuple[int, ...] | None):
        info = self.gguf.tensor_info(name)
        if info.ggml_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise UnsupportedTensorType(
                f"{self.gguf.path.name}: tensor {name!r} is stored as {info.type_name}, which this "
                f"engine cannot read (supported: {supported})"
            )
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise GGUFError(
                f"{self.gguf.path.name}: tensor {name!r} has shape {info.shape}, expected {shape} "
                "from the model's metadata"
            )
        return info

    def _dense(self, name: str, shape: tuple[int, ...] | None) -> np.ndarray:
        info = self._info(name, shape)
        raw = self.gguf.raw(name)
        if info.ggml_type == GGMLQuantizationType.F32:
            out = raw.view(np.float32)  # a view of the file: nothing to convert
        else:
            out = np.empty((raw.shape[0], info.shape[-1]), dtype=np.float32)
            for start in range(0, raw.shape[0], _DEQUANT_ROWS):
                stop = start + _DEQUANT_ROWS
                out[start:stop] = dequantize_rows(raw[start:stop], info.ggml_type)
        self.loaded_bytes += out.nbytes
        return out.reshape(info.shape)

    def _quant(self, name: str, shape: tuple[int, int]) -> QuantLinear | None:
        """A QuantLinear over the file's blocks, or None when the dense path applies."""
        if self.backend != "quant":
            return None
        info = self._info(name, shape)
        from .kernels import quant_matvec

        if info.ggml_type == GGMLQuantizationType.F32 or not quant_matvec.supports(info.ggml_type, shape[1]):
            return None
        # repacked for the integer kernels: the file's pages of this tensor leave the process's memory
        lin = QuantLinear(self.gguf.raw(name), info.ggml_type, *shape, release=self.gguf.release,
                          arena=self.arena)
        self.loaded_bytes += lin.nbytes
        return lin

    def linear(self, name: str, out_features: int, in_features: int) -> QuantLinear | DenseLinear:
        lin = self._quant(name, (out_features, in_features))
        return lin if lin is not None else DenseLinear(self._dense(name, (out_features, in_features)))

    def embedding(self, name: str, vocab: int, dim: int) -> Embedding:
        lin = self._quant(name, (vocab, dim))
        return Embedding(lin if lin is not None else self._dense(name, (vocab, dim)))

    def vector(self, name: str, size: int) -> np.ndarray:
        v = self._dense(name, (size,))
        return v.copy() if not v.flags.writeable else v  # a float32 array of its own, as before
