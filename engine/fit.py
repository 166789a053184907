"""Will it fit: the memory a model needs at a context and KV setting, against what is available.

estimate = runtime + weights + tokenizer + KV(ctx, spec) + max(prefill working set(ctx), decode floor)
  runtime     the process with the engine imported and its kernels loaded, before any model
              (a measured constant: Python, numpy, numba, tokenizers), plus each weight type's
              kernels (integer and float matvecs, loaded from numba's cache: a measured constant
              per quantized type the model's matrices use)
  weights     the GGUF file, memory-mapped: every page is touched once the model has run, so all
              of it is resident; plus a float32 copy of each matrix the quantized kernels cannot
              read (dequantized once at load, see engine.weights)
  tokenizer   the vocabulary's tables and the model's small float32 arrays, per vocabulary entry
  KV          engine.kv.config.estimate_bytes at the chosen spec and context
  working     the largest prefill step, one layer at a time (what peaks; decode needs far less):
              the attention scores of ATTEND_ROWS queries over the whole context (float32: scores,
              masked copy, softmax), the layer's keys and values dequantized to float32 for the
              step (and their concatenation with the new block), and a chunk of PREFILL_CHUNK
              tokens' activations (q/k/v, gate, up, their product, residuals: rows of the widest
              of dim, ffn and heads × head_dim)
  decode floor what decoding holds once it has started (its kernels, loaded on first use, and
              their buffers; a measured constant): short prompts peak there, not in the prefill
  draft       with a draft model (`--draft`, speculate.load_draft): its file and float32 copies,
              its tokenizer, its KV at the same spec (speculate.draft_kv) and context (up to its
              own), and the kernels of weight types the main model does not use; its prefill
              runs between the main model's steps, so the working set is the main model's
The constants are fitted to the peak RSS (VmHWM of a fresh process, kernel cache warm) of the
catalog's models at several contexts and specs (the estimate-vs-measured
test holds it within 15%). Verdict against psutil's available memory: "fits" up to
TIGHT_FRACTION of it, "tight" up to all of it, "does not fit" beyond.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import psutil

from .errors import DoesNotFit

MiB = 1 << 20
RUNTIME_BYTES = 144 * MiB
# Per quantized weight type (its kernels, compiled or loaded, and what they allocate): it varies
# with the machine. The estimate without it against measured peaks: on an AMD EPYC with AVX2 only,
# Gemma3 (4 types) 15% under; on a Xeon with AVX-512 VNNI, SmolLM2 (2 types) 4% over and Gemma3
# 1-7% under (the same there with OMLX_KERNELS=avx2). With 10 MiB both are within 11%.
KERNEL_BYTES_PER_WEIGHT_TYPE = 10 * MiB
DECODE_FLOOR_BYTES = 68 * MiB
TOKENIZER_BYTES_PER_ENTRY = 384
ATTENTION_SCORE_COPIES = 3  # scores, their masked copy, the softmax output (float32 each)
KV_DEQUANT_COPIES = 2  # a layer's K and V as float32: dequantized, then joined with the new block
ACTIVATION_ROWS_PER_TOKEN = 15  # float32 rows of the widest activation a prefill token holds
TIGHT_FRACTION = 0.8

FITS, TIGHT, DOES_NOT_FIT = "fits", "tight", "does not fit"


@dataclass(frozen=True)
class FitEstimate:
    ctx: int
    kv_spec: str
    runtime_bytes: int
    weights_bytes: int
    tokenizer_bytes: int
    kv_bytes: int
    working_bytes: int
    available_bytes: int
    draft_bytes: int = 0  # the draft model's weights, tokenizer, KV and extra kernels (0: none)

    @property
    def total_bytes(self) -> int:
        return (self.runtime_bytes + self.weights_bytes + self.tokenizer_bytes + self.kv_bytes
                + self.working_bytes + self.draft_bytes)

    @property
    def verdict(self) -> str:
        return verdict(self.total_bytes, self.available_bytes)

    def as_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes, "verdict": self.verdict}

    def summary(self) -> str:
        """One line: verdict, estimate, available, and the parts."""
        return (f"{self.verdict}: needs about {_mib(self.total_bytes)} of {_mib(self.available_bytes)} "
                f"available (weights {_mib(self.weights_bytes)}, KV {_mib(self.kv_bytes)} at "
                f"{self.ctx:,} tokens {self.kv_spec}, prefill/decode {_mib(self.working_bytes)}, runtime and "
                f"tokenizer {_mib(self.runtime_bytes + self.tokenizer_bytes)}"
                + (f", draft model {_mib(self.draft_bytes)}" if self.draft_bytes else "") + ")")


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f} MiB"


MEMORY_LIMIT_ENV = "OMLX_MEMORY_LIMIT"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def memory_limit() -> int | None:
    """``$OMLX_MEMORY_LIMIT`` in bytes (suffix K, M, G or T, optionally followed by "iB" or "B"):
    a budget the fit check holds models to when it is below what the system has free. None if unset."""
    text = os.environ.get(MEMORY_LIMIT_ENV, "").strip()
    if not text:
        return None
    import re

    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", text, re.IGNORECASE)
    if not match:
        from .errors import SettingsError

        raise SettingsError(f"{MEMORY_LIMIT_ENV}={text!r} is not a size; write e.g. 4G, 512M or 1073741824")
    return int(float(match[1]) * _UNITS[match[2].upper()])


def available_bytes() -> int:
    """Memory the system can give without swapping (psutil's `available`), capped by
    ``$OMLX_MEMORY_LIMIT`` when that is set."""
    available = int(psutil.virtual_memory().available)
    limit = memory_limit()
    return available if limit is None else min(available, limit)


def verdict(total: int, available: int) -> str:
    if total <= TIGHT_FRACTION * available:
        return FITS
    if total <= available:
        return TIGHT
    return DOES_NOT_FIT


def _weight_types(gguf) -> set:
    """The quantized GGML types of the model's matrices (each loads its own kernels)."""
    from gguf.constants import GGMLQuantizationType

    return {info.ggml_type for info in gguf.tensors.values()
            if len(info.shape) == 2 and info.ggml_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)}


def _dense_copy_bytes(gguf) -> int:
    """float32 bytes of the matrices the quantized kernels cannot read (engine.weights' dense path)."""
    from gguf.constants import GGMLQuantizationType

    from .kernels import HAVE_NUMBA

    total = 0
    for info in gguf.tensors.values():
        if len(info.shape) != 2 or info.ggml_type == GGMLQuantizationType.F32:
            continue
        if HAVE_NUMBA and os.environ.get("OMLX_WEIGHTS", "quant") != "dense":
            from .kernels import quant_matvec

            if quant_matvec.supports(info.ggml_type, info.shape[1]):
                continue
        total += info.shape[0] * info.shape[1] * 4
    return total


def _draft_bytes(draft, ctx: int, config, main_types: set) -> int:
    """What the draft model in the open GGUFFile ``draft`` adds at ``ctx`` tokens of the main
    model's KV config ``config`` (see the module docstring): its own estimate's weights,
    tokenizer and KV (at most its own context), and the kernels of its other weight types."""
    from .models import model_args
    from .speculate import draft_kv

    own = estimate(draft, ctx, draft_kv(config, model_args(draft)), available=0)
    return (own.weights_bytes + own.tokenizer_bytes + own.kv_bytes
            + KERNEL_BYTES_PER_WEIGHT_TYPE * len(_weight_types(draft) - main_types))


def estimate(gguf, ctx: int | None = None, kv=None, available: int | None = None, draft=None) -> FitEstimate:
    """The estimate for the open GGUFFile ``gguf`` at ``ctx`` tokens (default: the model's
    context) and KV spec ``kv`` (default: the engine's default); with ``draft``, an open
    GGUFFile, the draft model's memory too (`draft_bytes`)."""
    from .engine import PREFILL_CHUNK
    from .kv.paged_attention import ATTEND_ROWS
    from .kv.config import estimate_bytes, parse_kv
    from .models import model_args

    model = model_args(gguf)
    g = model.kv_geometry()
    ctx = model.context_length if ctx is None else int(ctx)
    if ctx < 1:
        raise DoesNotFit(f"a context of {ctx} tokens cannot hold anything; give at least 1")
    ctx = min(ctx, model.context_length)
    config = parse_kv(kv)
    kv_bytes = estimate_bytes(config, g.n_layers, g.n_kv_heads, g.head_dim, ctx, g.value_dim,
                              windows=list(g.windows))["total"]
    chunk = min(PREFILL_CHUNK, ctx)
    widest = max(model.dim, getattr(model, "ffn_dim", 0) or 0, model.n_heads * model.head_dim)
    prefill = 4 * (ATTENTION_SCORE_COPIES * min(ATTEND_ROWS, ctx) * model.n_heads * ctx
                   + KV_DEQUANT_COPIES * g.n_kv_heads * ctx * (g.head_dim + g.value_dim)
                   + ACTIVATION_ROWS_PER_TOKEN * chunk * widest)
    working = max(prefill, DECODE_FLOOR_BYTES)
    types = _weight_types(gguf)
    return FitEstimate(
        ctx=ctx,
        kv_spec=str(config),
        runtime_bytes=RUNTIME_BYTES + KERNEL_BYTES_PER_WEIGHT_TYPE * len(types),
        weights_bytes=int(gguf.file_size) + _dense_copy_bytes(gguf),
        tokenizer_bytes=TOKENIZER_BYTES_PER_ENTRY * int(model.vocab_size),
        kv_bytes=int(kv_bytes),
        working_bytes=int(working),
        available_bytes=available_bytes() if available is None else int(available),
        draft_bytes=0 if draft is None else _draft_bytes(draft, ctx, config, types),
    )


def estimate_file(path, ctx: int | None = None, kv=None, available: int | None = None,
                  draft=None) -> FitEstimate:
    """:func:`estimate` for the GGUF file at ``path`` (reads its header only), with the draft
    model at the path ``draft`` if given."""
    from .gguf_file import GGUFFile

    gguf = GGUFFile(path)
    draft_gguf = None
    try:
        draft_gguf = None if draft is None else GGUFFile(draft)
        return estimate(gguf, ctx, kv, available, draft_gguf)
    finally:
        gguf.close()
        if draft_gguf is not None:
            draft_gguf.close()


def download_estimate(file_size: int) -> int:
    """Bytes a model of `file_size` needs, when only the file's size is known (before a
    download): the weights and the runtime, with a quarter of the file again for KV, tokenizer
    and prefill at a modest context."""
    return RUNTIME_BYTES + int(file_size * 1.25)


def download_verdict(file_size: int, available: int | None = None) -> str:
    """The verdict of download_estimate(file_size) against `available` (default: now)."""
    available = available_bytes() if available is None else available
    return verdict(download_estimate(file_size), available)


def check_fits(path, ctx: int | None = None, kv=None, *, force: bool = False, draft=None) -> FitEstimate:
    """The estimate for loading ``path`` (with the draft model at ``draft``, if given); raises
    DoesNotFit when it does not fit, unless ``force``."""
    est = estimate_file(path, ctx, kv, draft=draft)
    if est.verdict == DOES_NOT_FIT and not force:
        what = os.path.basename(str(path))
        if draft is not None:
            what += f" with the draft model {os.path.basename(str(draft))}"
        raise DoesNotFit(
            f"{what} does not fit: {'together they need' if draft is not None else 'it needs'} about "
            f"{_mib(est.total_bytes)} at "
            f"{est.ctx:,} tokens ({est.kv_spec}) and {_mib(est.available_bytes)} is available. Use a "
            "smaller context (--ctx), a lower-bit KV setting (--kv memory-saver), a smaller quant, "
            "or --force to load anyway"
        )
    return est


CONTEXT_STEP = 256  # default contexts below the model's are multiples of this


def default_context(gguf, kv=None, available: int | None = None, draft=None) -> int:
    """The context to use when none is given: the model's own, or, when that does not fit
    ("fits" verdict) at KV spec ``kv`` (with the draft model of the open GGUFFile ``draft``),
    the largest multiple of CONTEXT_STEP that does (at least CONTEXT_STEP: a model that fits
    nowhere is left to the fit check to refuse)."""
    from .models import model_args

    model_ctx = int(model_args(gguf).context_length)
    available = available_bytes() if available is None else int(available)
    if estimate(gguf, model_ctx, kv, available, draft).verdict == FITS:
        return model_ctx
    lo, hi = 1, model_ctx // CONTEXT_STEP  # in steps: lo fits (or is the floor), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate(gguf, mid * CONTEXT_STEP, kv, available, draft).verdict == FITS:
            lo = mid
        else:
            hi = mid
    return lo * CONTEXT_STEP


def default_context_file(path, kv=None, available: int | None = None, draft=None) -> int:
    """:func:`default_context` for the GGUF file at ``path`` (reads its header only), with the
    draft model at the path ``draft`` if given."""
    from .gguf_file import GGUFFile

    gguf = GGUFFile(path)
    draft_gguf = None
    try:
        draft_gguf = None if draft is None else GGUFFile(draft)
        return default_context(gguf, kv, available, draft_gguf)
    finally:
        gguf.close()
        if draft_gguf is not None:
            draft_gguf.close()
