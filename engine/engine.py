"""Engine: a loaded model with its tokenizer; prefill in chunks, decode token by token, stream
text, report per-turn stats. The public API the CLI and the desktop app call."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .gguf_file import GGUFError, GGUFFile
from .kernels import background
from .kv.batch import VerifyBatch
from .kv.cache import KVCache
from .kv.config import KVConfig, parse_kv
from .kv.formats import get_format
from .errors import KVPoolFull, SettingsError
from .kv.paged import ContextFull
from .memory import release_free_heap
from .models import load_model
from .models.base import BaseModel
from .decoding import STOP, TokenStream
from .prefix_store import PrefixStore
from .speculate import agreed_tokens, check_draft, draft_room, drafter_for
from .sampling import SamplingParams, log_softmax  # noqa: F401  (log_softmax re-exported: its old home)
from .stats import GenerationStats, TurnMeter
from .tokenizer import Tokenizer, TokenizerError
from .weights import ARITH_ENV, DenseLinear, QuantLinear, arith_mode, check_arith
from .warmup import start_warm_up

log = logging.getLogger("omlx.engine")

PREFILL_CHUNK = 512  # tokens per batched prefill step
LOGPROB_TOP_K = 32  # top entries kept per position by `teacher_forced` (the reference's format)
_LOGPROB_ROWS = 64


from .errors import EngineError  # noqa: E402,F401  (re-exported: callers import it from here)


@dataclass
class GenerationResult:
    ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS/end of turn), "stop_string", "length", "context_full", "kv_pool_full", "cancelled"
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class StreamChunk:
    token_id: int
    text: str  # text completed by this token (may be empty while a UTF-8 char is incomplete)


@dataclass
class TeacherForced:
    """Teacher-forced evaluation in the reference .npz format."""

    tokens: np.ndarray  # (N+1,) int32
    top_ids: np.ndarray  # (N, 32) int32
    top_logprobs: np.ndarray  # (N, 32) float32
    next_logprob: np.ndarray  # (N,) float32

    def save(self, path: str | os.PathLike) -> None:
        np.savez(path, tokens=self.tokens, top_ids=self.top_ids, top_logprobs=self.top_logprobs,
                 next_logprob=self.next_logprob)


class Generation:
    """An in-progress generation: iterate for StreamChunks; `result` is set when it ends."""

    def __init__(self, chunks: Iterator[StreamChunk], holder: list):
        self._chunks = chunks
        self._holder = holder

    def __iter__(self) -> Iterator[StreamChunk]:
        return self._chunks

    @property
    def result(self) -> GenerationResult:
        if not self._holder:
            for _ in self._chunks:  # run to completion if the caller did not
                pass
        return self._holder[0]


class Engine:
    """A model ready to run.

    Attributes:
        path: the GGUF file; name: its display name; model: the architecture instance;
        tokenizer: from the file's vocabulary.
    """

    def __init__(self, gguf: GGUFFile, model: BaseModel, tokenizer: Tokenizer,
                 kv: str | KVConfig | None = None):
        self.gguf = gguf
        self.path = gguf.path
        self.model = model
        self.tokenizer = tokenizer
        self.name = str(gguf.get("general.name") or gguf.path.stem)
        self.kv_config = parse_kv(kv)
        self.kv_config.per_layer(model.n_layers)  # an override past the last layer fails here
        # the prefix caches' settings (self.prefixes reads them at each call):
        self.disk_cache = True  # save pinned prefixes under the user's cache folder
        self.master_copies = True  # pinned prefixes computed once in the 8-bit master layout (kv.requantize)
        self.speculate = "off"  # SPECULATE_MODES: "lookup" drafts by prompt lookup, verified in one pass
        self.draft_engine: "Engine | None" = None  # --draft MODEL: drafts by this model instead (set_draft)
        self.prefixes = PrefixStore(self)  # the prefix caches: this layout's and its master's
        self._model_id: str | None = None
        # the weight products' arithmetic (weights.ARITH_MODES): "float" when the file was loaded
        # with OMLX_ARITH=float or no matrix has integer kernels, else "exact" or "fast"
        self.arith = "float" if arith_mode() == "float" or not self._int_layers() else "exact"

    @classmethod
    def load(cls, path: str | os.PathLike, progress: Callable[[str, float], None] | None = None,
             kv: str | KVConfig | None = None) -> "Engine":
        """Open a GGUF file and build model and tokenizer.

        Raises:
            GGUFError (or its subclass for an unsupported architecture), TokenizerError: with a
            message naming the file and the problem.
        """
        t0 = time.perf_counter()
        if progress:
            progress("reading header", 0.0)
        gguf = GGUFFile(path)
        if progress:
            progress("building tokenizer", 0.1)
        tokenizer = Tokenizer.from_metadata(gguf.metadata)
        if progress:
            progress("loading weights", 0.3)
        model = load_model(gguf)
        if progress:
            progress("preparing kernels", 0.9)
        start_warm_up()  # the rest compiles in the background on a first start (exact fallbacks answer)
        if progress:
            progress("ready", 1.0)
        engine = cls(gguf, model, tokenizer, kv)
        if arith_mode() == "fast":
            engine.set_arith("fast")
        release_free_heap()  # building a large vocabulary's tokenizer leaves tens of MiB free
        log.info("loaded %s (%s, %d layers) in %.1f s", engine.name, model.architecture, model.n_layers,
                 time.perf_counter() - t0)
        engine.log_kv_scheme()
        return engine

    def set_kv(self, kv: str | KVConfig) -> None:
        """Use another KV configuration for caches made from now on."""
        config = parse_kv(kv)
        config.per_layer(self.model.n_layers)
        self.kv_config = config
        self.log_kv_scheme()

    def _int_layers(self) -> list:
        from .weights import QuantLinear, linear_layers

        return [lin for lin in linear_layers(self.model) if isinstance(lin, QuantLinear) and lin.arith == "int"]

    def set_arith(self, mode: str) -> None:
        """Switch the weight products between "exact" and "fast" (int8 activations, see
        weights.ARITH_MODES) for every step from now on: the repacked weights are the same, so
        this costs nothing (the fast kernels compile on their first use). "float" is chosen at
        load (OMLX_ARITH=float); a model loaded that way, or with no matrix on the integer
        kernels, stays "float" and any other mode is a SettingsError."""
        mode = check_arith(mode)
        layers = self._int_layers()
        if mode == "float" or not layers:
            if mode == self.arith:
                return
            if mode == "float":
                raise SettingsError(f"float arithmetic is chosen when a model loads (--arith float or "
                                    f"{ARITH_ENV}=float); {self.name} runs {self.arith} arithmetic")
            why = (f"it was loaded with {ARITH_ENV}=float" if arith_mode() == "float"
                   else "no matrix of it has integer kernels on this CPU")
            raise SettingsError(f"{self.name}: {mode} arithmetic needs the integer kernels, and {why}")
        if mode == "fast":  # compiled (or loaded from numba's cache) now, not inside the next prefill
            from .kernels import int_dot, int_matvec

            int_matvec.warm_up({lin.ggml_type for lin in layers}, int_dot.kernel_isa(), fast=True)
        for lin in layers:
            lin.fast = mode == "fast"
        if mode != self.arith:
            log.info("weight arithmetic: %s", mode)
        self.arith = mode

    @property
    def compute_id(self) -> str:
        """What KV blocks computed by this engine depend on: the model file, and the arithmetic
        when it is not the exact kind (fast-mode blocks never mix with exact ones in a prefix
        cache or on disk)."""
        return self.model_id if self.arith != "fast" else f"{self.model_id}+fast"

    @property
    def model_id(self) -> str:
        """The model file's sha256 (remembered on disk per path, size and mtime)."""
        if self._model_id is None:
            from .kv.prefix import model_fingerprint

            self._model_id = model_fingerprint(self.gguf)
        return self._model_id

    def prefix_cache(self):
        """The shared block pools and prefix cache for the current KV config (PrefixStore.cache:
        a new config, disk setting or arithmetic gets a new one)."""
        return self.prefixes.cache()

    def prefill_master(self, ids: Sequence[int], progress: Callable[[int, int], None] | None = None,
                       cancel: threading.Event | None = None) -> int:
        """Compute the full blocks of the pinned prefix `ids` in the master layout (8-bit K and V,
        see kv.requantize) and save them, so the current layout and every other derivable one
        take them without prefilling again. Returns the prefix tokens the master now holds in
        memory (0 when the current layout has no master to derive from)."""
        return self.prefixes.prefill_master(ids, progress, cancel)

    def switch_cost(self, kv: str | KVConfig, prefix_ids: Sequence[int]) -> dict:
        """What switching to `kv` costs the pinned prefix `prefix_ids` (its full blocks):
        {"reread": tokens to prefill again (0: none), "source": where the new layout's blocks
        would come from: "current" (same layout), "memory", "disk" (saved under that layout),
        "master" (derived from the master copy), "none" (no prefix), or "prefill"}. Reads no
        block and changes nothing (safe to call before a switch)."""
        return self.prefixes.switch_cost(kv, prefix_ids)

    def kv_usage(self) -> tuple[int, int]:
        """(bytes in use, bytes allocated) of the current prefix cache's pools and its master
        copy's, (0, 0) before there is one. Never creates one: safe to poll from a monitoring
        thread."""
        return self.prefixes.usage()

    def kv_scheme(self) -> list[tuple[str, str, str]]:
        """Per-layer K/V formats, run-length grouped: [(layers, K format, V format)]."""
        return [(run.selector,
                 f"K{run.precision.k_bits} ({get_format(run.precision.k_bits, 'k').name})",
                 f"V{run.precision.v_bits} ({get_format(run.precision.v_bits, 'v').name})")
                for run in self.kv_config.layer_runs(self.model.n_layers)]

    def kv_bytes_per_token(self) -> float:
        """Bytes per token of full blocks under the current KV config (scales included)."""
        g = self.model.kv_geometry
        total = 0.0
        B = self.kv_config.block_size
        for prec in self.kv_config.per_layer(g.n_layers):
            total += get_format(prec.k_bits, "k").bytes_per_block(g.n_kv_heads, B, g.head_dim) / B
            total += get_format(prec.v_bits, "v").bytes_per_block(g.n_kv_heads, B, g.value_dim) / B
        return total

    def log_kv_scheme(self) -> None:
        c = self.kv_config
        log.info("KV cache %s: block %d tokens, %d sink tokens%s; %.0f bytes/token (16-bit: %.0f)",
                 c, c.block_size, c.sinks, ", Hadamard-rotated keys" if c.rotation else "",
                 self.kv_bytes_per_token(), self.model.kv_bytes_per_token())
        for layers, k, v in self.kv_scheme():
            log.info("  layers %-7s %s  %s", layers, k, v)

    # -- prompts ------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer.chat_template is not None

    def encode_prompt(self, text: str) -> list[int]:
        """Plain completion prompt: BOS where the model asks for one, special tokens as text."""
        return self.tokenizer.encode(text, add_bos=True, parse_special=False)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> list[int]:
        """Render messages with the model's chat template and tokenize (special tokens parsed).
        `tools` (OpenAI's function list) goes to templates that take them."""
        if not self.has_chat_template:
            raise EngineError(f"{self.name} has no chat template: use it as plain completion")
        extra = {"tools": list(tools)} if tools else {}
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, **extra)
        ids = self.tokenizer.encode(text, add_bos=True, parse_special=True)
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and bos is not None and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template wrote BOS itself
        return ids

    def new_cache(self, kv: str | KVConfig | None = None) -> KVCache:
        """A paged cache for one sequence, at `kv` or the engine's KV config."""
        return self.model.new_cache(self.kv_config if kv is None else parse_kv(kv),
                                    max_tokens=self.model.context_length)

    # -- generation ---------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int], cache: KVCache, progress: Callable[[int, int], None] | None = None,
                cancel: threading.Event | None = None) -> np.ndarray | None:
        """Append `ids` to the cache in chunks; returns the last position's logits (vocab,)."""
        ids = np.asarray(ids, dtype=np.int64)
        logits = None
        step = self.chunk_size(cache)
        for start in range(0, len(ids), step):
            if cancel is not None and cancel.is_set():
                return None
            chunk = ids[start : start + step]
            last = start + len(chunk) >= len(ids)
            try:
                out = self.model.forward(chunk, cache, "last" if last else np.empty(0, np.int64))
            except ContextFull as exc:
                raise EngineError(str(exc)) from None
            if last:
                logits = out[0]
            release_free_heap()  # the chunk's temporaries: not resident while the next one runs
            if progress:
                progress(min(start + len(chunk), len(ids)), len(ids))
        return logits

    @staticmethod
    def chunk_size(cache: KVCache) -> int:
        """Prefill chunk: PREFILL_CHUNK, or less when a context-limited cache has less room
        beside what it may never drop (so the overflow policy can always make room)."""
        if cache.limit is None:
            return PREFILL_CHUNK
        room = cache.limit - cache.protected_tokens_floor()
        return max(1, min(PREFILL_CHUNK, room // 2))

    @staticmethod
    def exact_batch_rows() -> int:
        """The most rows (tokens of one or several sequences) a forward pass may take with every
        row computed as it is computed alone, so greedy output is the same alone or in a batch:
        quantized matrices take up to QuantLinear.MATVEC_MAX_ROWS rows through the fused kernels,
        float32 ones one product per row up to DenseLinear.MAX_ROWS_ALONE; more rows go through
        BLAS, which rounds differently. Read at call time (benchmarks move the bound)."""
        return min(QuantLinear.MATVEC_MAX_ROWS, DenseLinear.MAX_ROWS_ALONE)

    @staticmethod
    def rows_computed_alone() -> int:
        """The most rows some linear layer still computes row by row (the fused kernels or one
        product per row); past it every layer takes the dequantized tiles + BLAS."""
        return max(QuantLinear.MATVEC_MAX_ROWS, DenseLinear.MAX_ROWS_ALONE)

    def _limit(self, cache: KVCache) -> int:
        """The tokens `cache` may hold: its own limit, never past the model's context."""
        return min(self.model.context_length, cache.limit or self.model.context_length)

    def stream(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        cache: KVCache | None = None,
        cancel: threading.Event | None = None,
        prefill_progress: Callable[[int, int], None] | None = None,
        speculate: str | None = None,
        processors: Sequence = (),
    ) -> Generation:
        """Start generating after `prompt_ids`; iterate the result for streamed text.

        The prompt is appended to `cache` (a fresh one if None). Generation stops at EOS or an
        end-of-turn token, at a stop string, after `max_tokens`, at the model's context length,
        or when `cancel` is set (checked between tokens).

        `speculate` ("off" or "lookup", default the engine's `speculate`): prompt-lookup drafts
        verified in one pass (engine.speculate); greedy output is token-identical either way.
        `processors`: logits processors of the turn's TokenStream (e.g. constrain.JsonConstraint).
        """
        if not prompt_ids:
            raise EngineError("the prompt is empty")
        sampling = sampling or SamplingParams()
        sampling.validate()
        cache = cache if cache is not None else self.new_cache()
        limit = self._limit(cache)
        if not cache.can_drop and cache.offset + len(prompt_ids) >= limit:
            raise EngineError(
                f"the prompt is {len(prompt_ids):,} tokens but the context holds {limit:,} "
                f"({cache.offset:,} already used)"
            )
        drafter = drafter_for(self, self.speculate if speculate is None else speculate,
                              context=getattr(cache, "token_ids", ()))  # a conversation's earlier turns
        holder: list[GenerationResult] = []
        return Generation(
            self._run(list(prompt_ids), max_tokens, sampling, stop, cache, cancel, prefill_progress, holder,
                      drafter, processors),
            holder,
        )

    def set_draft(self, draft: "Engine | None") -> None:
        """Draft with `draft` (a small model of the same vocabulary, `--draft MODEL`) from the next
        answer on, whatever `speculate` says; None: back to `speculate`.

        Raises:
            SettingsError: the vocabularies differ (a drafted id would mean another token).
        """
        if draft is not None:
            check_draft(self, draft)
        self.draft_engine = draft

    draft_room = staticmethod(draft_room)  # speculate.draft_room: the scheduler asks it here

    def _run(self, prompt_ids, max_tokens, sampling, stop, cache, cancel, prefill_progress, holder,
             drafter=None, processors=()):
        meter = TurnMeter(len(prompt_ids), self.arith, cache)
        limit = self._limit(cache)

        def finish(reason: str, ids: list[int], text: str, t_first: float | None):
            holder.append(GenerationResult(ids, text, reason, meter.finish(reason, len(ids), t_first, drafter)))

        def prefill_tick(done: int, total: int):
            meter.sample_memory()
            if prefill_progress:
                prefill_progress(done, total)

        logits = self.prefill(prompt_ids, cache, prefill_tick, cancel)
        if logits is None:
            finish("cancelled", [], "", None)
            return
        meter.prefilled()
        stream = TokenStream(self.tokenizer, prompt_ids, sampling=sampling, stop=stop, max_tokens=max_tokens,
                             processors=processors)
        reason = None
        pending = None  # the next token to forward, chosen with a verified draft (not sampled from `logits`)
        while not stream.done:
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
            if pending is None:
                first = stream.first_token_at is None
                token, text, finished = stream.push(logits)[:3]
                if first:
                    background.note_first_token(meter.first_token(stream.first_token_at))
                if finished == STOP:
                    break
                yield StreamChunk(token, text)
                if finished is not None:
                    break
            else:
                token, pending = pending, None
            if cache.offset + 1 >= limit and not cache.can_drop:
                reason = "context_full"
                break
            try:
                room = draft_room(cache, limit, max_tokens - stream.n_generated - 1) if drafter else 0
                draft = drafter.draft(stream.history, room) if room else []
                if draft:
                    # token + draft in one pass; the stream takes what the acceptance rule keeps,
                    # the cache keeps the rows of the draft tokens the stream went on after
                    verify = VerifyBatch(cache)
                    rows = self.model.forward([token, *draft], verify, "all")
                    steps = stream.verify(rows, draft)
                    verify.finish(len(draft) - (len(steps) - 1))
                    drafter.update(len(draft), agreed_tokens(steps, draft))
                    for step in steps:
                        if step.finish_reason == STOP:
                            break
                        yield StreamChunk(step.token, step.text)
                    if not stream.done:
                        pending = steps[-1].token
                else:
                    logits = self.model.forward([token], cache, "last")[0]
            except ContextFull:
                reason = "context_full"
                break
            except KVPoolFull:  # the memory budget ran out, not the context
                reason = "kv_pool_full"
                break
            if stream.n_generated % 16 == 0:
                meter.sample_memory()
        tail = stream.finish(reason)
        if tail:
            yield StreamChunk(-1, tail)
        finish(stream.finish_reason, stream.generated, stream.text, stream.first_token_at)

    def generate(self, prompt_ids: Sequence[int], **kwargs) -> GenerationResult:
        """`stream` run to the end."""
        return self.stream(prompt_ids, **kwargs).result

    # -- evaluation ---------------------------------------------------------------------------
    def teacher_forced(self, tokens: Sequence[int], cache: KVCache | None = None,
                       progress: Callable[[int, int], None] | None = None) -> TeacherForced:
        """Log-probabilities of each next token given the ones before, in prefill chunks.

        Args:
            tokens: (N+1,) ids; positions 0..N-1 predict tokens 1..N.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens) - 1
        if n < 1:
            raise EngineError("need at least two tokens to evaluate")
        cache = cache if cache is not None else self.new_cache()
        if len(tokens) > self.model.context_length and not cache.can_drop:
            raise EngineError(f"{len(tokens):,} tokens exceed the context of {self.model.context_length:,}")
        top_ids = np.empty((n, LOGPROB_TOP_K), np.int32)
        top_lp = np.empty((n, LOGPROB_TOP_K), np.float32)
        next_lp = np.empty(n, np.float32)
        step = self.chunk_size(cache)
        for start in range(0, n, step):
            stop = min(start + step, n)
            cache.begin_forward(tokens[start:stop])
            h = self.model.hidden(tokens[start:stop], cache)  # (c, dim)
            cache.end_forward()
            # The (rows, vocab) float64 log-softmax is built a few rows at a time: with a 262K
            # vocabulary a whole chunk would take 1 GiB.
            for r0 in range(0, stop - start, _LOGPROB_ROWS):
                r1 = min(r0 + _LOGPROB_ROWS, stop - start)
                lp = log_softmax(self.model.output(h[r0:r1]))  # (rows, vocab)
                idx = np.argpartition(-lp, LOGPROB_TOP_K, axis=-1)[:, :LOGPROB_TOP_K]
                vals = np.take_along_axis(lp, idx, axis=-1)
                order = np.argsort(-vals, axis=-1, kind="stable")
                rows = slice(start + r0, start + r1)
                top_ids[rows] = np.take_along_axis(idx, order, axis=-1)
                top_lp[rows] = np.take_along_axis(vals, order, axis=-1)
                next_lp[rows] = lp[np.arange(r1 - r0), tokens[start + r0 + 1 : start + r1 + 1]]
            if progress:
                progress(stop, n)
        return TeacherForced(tokens.astype(np.int32), top_ids, top_lp, next_lp)


def load_engine(spec: str | os.PathLike, *, fetch_missing: bool = False,
                progress: Callable[[str, float], None] | None = None,
                kv: str | KVConfig | None = None) -> Engine:
    """A catalog name or a path to a .gguf file → a loaded Engine."""
    from .catalog import resolve_model

    return Engine.load(resolve_model(spec, fetch_missing=fetch_missing, progress=progress),
                       progress=progress, kv=kv)


__all__ = [
    "Engine", "EngineError", "Generation", "GenerationResult", "GenerationStats", "StreamChunk",
    "TeacherForced", "load_engine", "GGUFError", "TokenizerError",
]
