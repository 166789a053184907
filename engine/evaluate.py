"""KV-cache quality: how far a quantized cache moves next-token distributions from the same
engine's 16-bit cache, measured the way decode sees the cache (quantized full blocks,
full-precision tail and sinks; see engine.kv.storage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .kv.config import KVConfig, parse_kv
from .kv.prefix import PrefixCache
from .kv.requantize import MASTER_BITS, master_config
from .sampling import log_softmax
from .weights import integer_rows

BASELINE_SPEC = "full"
_ROWS = 64  # output-projection rows at a time (a 262K vocabulary makes (rows, vocab) large)


@dataclass
class KVQuality:
    spec: str
    mean_kl: float  # mean over positions of KL(p_16bit ‖ p_spec), nats
    top1_agreement: float  # fraction of positions whose argmax matches the 16-bit run
    perplexity: float  # of the text's next tokens under this cache
    kv_bytes: int  # bytes the cache allocated for the evaluated tokens
    arith: str = "exact"  # the weight arithmetic it ran in (the baseline: exact, 16-bit KV)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def hidden_states(model, tokens: np.ndarray, kv, chunk: int = 512) -> tuple[np.ndarray, int]:
    """Final-norm hidden states (N, dim) of `tokens` (N,) run through a fresh cache at `kv`, and
    the KV bytes that cache holds afterwards."""
    cache = model.new_cache(kv)
    parts = [model.hidden(tokens[s : s + chunk], cache) for s in range(0, len(tokens), chunk)]
    return np.concatenate(parts), cache.nbytes


def _scores(model, h_ref: np.ndarray, h: np.ndarray, targets: np.ndarray,
            arith: Callable[[str], None] | None = None, rows: int = _ROWS) -> tuple[float, float, float]:
    """Mean KL(p_ref ‖ p), top-1 agreement and perplexity over the positions of `h_ref` and `h`
    ((n, dim) hidden states of the same n positions), `targets` (n,) their next tokens. arith:
    called with "ref" and "test" before each side's output projection (the arithmetic each ran in)."""
    n = len(h)
    kl = np.empty(n)
    agree = np.empty(n, bool)
    nll = np.empty(n)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        if arith:
            arith("ref")
        lp_ref = log_softmax(model.output(h_ref[r0:r1]))
        if arith:
            arith("test")
        lp = log_softmax(model.output(h[r0:r1]))
        kl[r0:r1] = np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1)
        agree[r0:r1] = lp_ref.argmax(-1) == lp.argmax(-1)
        nll[r0:r1] = -lp[np.arange(r1 - r0), targets[r0:r1]]
    return float(kl.mean()), float(agree.mean()), float(np.exp(nll.mean()))


def evaluate_kv(engine, tokens: Sequence[int], specs: Sequence[str | KVConfig],
                progress: Callable[[str, float], None] | None = None, arith: str = "exact") -> list[KVQuality]:
    """Mean KL, top-1 agreement and perplexity of each spec against the 16-bit cache.

    Args:
        tokens: (N+1,) ids: positions 0..N-1 predict tokens 1..N.
        arith: the weight arithmetic the specs run in ("exact" or "fast", Engine.set_arith); the
            baseline is always 16-bit KV in exact arithmetic, so with "fast" a spec's figures are
            the cost of both, and the 16-bit spec's the arithmetic's alone. The engine's own
            arithmetic is restored afterwards.
    """
    model = engine.model
    tokens = np.asarray(tokens, dtype=np.int64)
    inputs, targets = tokens[:-1], tokens[1:]
    before = engine.arith
    switching = arith != "exact"  # the default measures in the engine's own arithmetic
    # chunks (and output rows) no longer than the integer kernels take: where the instruction set
    # sends longer inputs to float tiles (AVX2), a 512-token chunk would measure float arithmetic
    chunk = min(512, integer_rows(model) or 512)

    def use(side: str) -> None:
        engine.set_arith("exact" if side == "ref" else arith)

    try:
        if switching:
            use("test")  # a mode this engine cannot run fails here, before any work
            use("ref")
        if progress:
            progress(f"{BASELINE_SPEC} (baseline)", 0.0)
        h_ref, _ = hidden_states(model, inputs, BASELINE_SPEC, chunk)
        results = []
        for i, spec in enumerate(specs):
            config = parse_kv(spec) if isinstance(spec, str) else spec
            if progress:
                progress(str(spec), (i + 1) / (len(specs) + 1))
            if switching:
                use("test")
            h, kv_bytes = hidden_states(model, inputs, config, chunk)
            scores = _scores(model, h_ref, h, targets, use if switching else None, rows=min(_ROWS, chunk))
            results.append(KVQuality(str(spec), *scores, int(kv_bytes), arith=engine.arith))
    finally:
        if switching:
            engine.set_arith(before)
    if progress:
        progress("done", 1.0)
    return results


def per_layer_specs(config: KVConfig, n_layers: int, bits: int = 4) -> list[str]:
    """One spec per layer: that layer at `bits` for K and V, every other layer at 16 bits."""
    full = KVConfig(16, 16, block_size=config.block_size)
    return [str(full.with_overrides({i: (bits, bits)})) for i in range(n_layers)]


def evaluate_derived(engine, tokens, specs, prefix_tokens: int, master_bits: int = MASTER_BITS,
                     progress=None) -> list[dict]:
    """KL vs 16-bit KV of each spec's cache with its first `prefix_tokens` (whole blocks)
    derived from a master copy at `master_bits`, beside the same spec computed directly.

    The text's first `prefix_tokens` play the pinned document: the direct run computes them in
    the spec's layout, the derived run computes them in the master layout and re-quantizes the
    blocks into the spec's layout (PrefixCache.attach, as the app does). Both then run the rest
    of the text in the spec's layout; KL, top-1 agreement and perplexity are taken over those
    later positions only (the ones that read the prefix through the cache).

    Returns per spec {"spec", "direct_kl", "derived_kl", "direct_top1", "derived_top1",
    "direct_ppl", "derived_ppl", "positions", "prefix_tokens", "master_bytes" (the master's block
    rows for the prefix)}.
    """
    model = engine.model
    tokens = np.asarray(tokens, dtype=np.int64)
    inputs, targets = tokens[:-1], tokens[1:]
    n = len(inputs)
    h_ref, _ = hidden_states(model, inputs, BASELINE_SPEC)

    def run(cache, ids, chunk=512):
        parts = []
        for s in range(0, len(ids), chunk):
            cache.begin_forward(ids[s : s + chunk])  # token ids and publishing, as forward() does
            parts.append(model.hidden(ids[s : s + chunk], cache))
            cache.end_forward()
        return np.concatenate(parts)

    def scores(h, start):  # h: hidden states of positions start..n-1
        return _scores(model, h_ref[start:], h, targets[start:])

    results = []
    for i, spec in enumerate(specs):
        config = parse_kv(spec) if isinstance(spec, str) else spec
        if progress:
            progress(str(spec), i / len(specs))
        P = (min(prefix_tokens, n - 1) // config.block_size) * config.block_size
        if P == 0:
            raise ValueError(f"the prefix ({prefix_tokens} tokens) holds no whole {config.block_size}-token block")
        h_direct, _ = hidden_states(model, inputs, config)
        direct = scores(h_direct[P:], P)
        mconfig = master_config(config, master_bits)
        master = PrefixCache(model, mconfig, model_id="eval-derived", capacity_tokens=n + config.block_size)
        mseq = master.new_sequence()
        run(mseq, inputs[:P])
        master_bytes = master.nbytes
        target = PrefixCache(model, config, model_id="eval-derived", capacity_tokens=2 * n + config.block_size)
        target.master = master
        seq = target.new_sequence()
        reuse = target.attach(seq, inputs[: P + 1])
        if reuse.derived_tokens != P:
            raise ValueError(f"{spec}: derived {reuse.derived_tokens} of the {P} prefix tokens "
                             f"(a layer above {master_bits} bits cannot be derived)")
        derived = scores(run(seq, inputs[P:]), P)
        mseq.release()
        results.append({"spec": str(config), "master_bits": master_bits, "prefix_tokens": P,
                        "positions": n - P, "master_bytes": int(master_bytes),
                        "direct_kl": direct[0], "derived_kl": derived[0],
                        "direct_top1": direct[1], "derived_top1": derived[1],
                        "direct_ppl": direct[2], "derived_ppl": derived[2]})
    if progress:
        progress("done", 1.0)
    return results
