"""KV-cache quality: how far a quantized cache moves next-token distributions from the same
engine's 16-bit cache, measured the way decode sees the cache (quantized full blocks,
full-precision tail and sinks; see engine.kv.storage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .engine import log_softmax
from .kv.config import KVConfig, parse_kv

BASELINE_SPEC = "full"
_ROWS = 64  # output-projection rows at a time (a 262K vocabulary makes (rows, vocab) large)


@dataclass
class KVQuality:
    spec: str
    mean_kl: float  # mean over positions of KL(p_16bit ‖ p_spec), nats
    top1_agreement: float  # fraction of positions whose argmax matches the 16-bit run
    perplexity: float  # of the text's next tokens under this cache
    kv_bytes: int  # bytes the cache allocated for the evaluated tokens

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def hidden_states(model, tokens: np.ndarray, kv, chunk: int = 512) -> tuple[np.ndarray, int]:
    """Final-norm hidden states (N, dim) of `tokens` (N,) run through a fresh cache at `kv`, and
    the KV bytes that cache holds afterwards."""
    cache = model.new_cache(kv)
    parts = [model.hidden(tokens[s : s + chunk], cache) for s in range(0, len(tokens), chunk)]
    return np.concatenate(parts), cache.nbytes


def evaluate_kv(engine, tokens: Sequence[int], specs: Sequence[str | KVConfig],
                progress: Callable[[str, float], None] | None = None) -> list[KVQuality]:
    """Mean KL, top-1 agreement and perplexity of each spec against the 16-bit cache.

    Args:
        tokens: (N+1,) ids: positions 0..N-1 predict tokens 1..N.
    """
    model = engine.model
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens) - 1
    inputs, targets = tokens[:-1], tokens[1:]
    if progress:
        progress(f"{BASELINE_SPEC} (baseline)", 0.0)
    h_ref, _ = hidden_states(model, inputs, BASELINE_SPEC)
    results = []
    for i, spec in enumerate(specs):
        config = parse_kv(spec) if isinstance(spec, str) else spec
        if progress:
            progress(str(spec), (i + 1) / (len(specs) + 1))
        h, kv_bytes = hidden_states(model, inputs, config)
        kl = np.empty(n)
        agree = np.empty(n, bool)
        nll = np.empty(n)
        for r0 in range(0, n, _ROWS):
            r1 = min(n, r0 + _ROWS)
            lp_ref = log_softmax(model.output(h_ref[r0:r1]))
            lp = log_softmax(model.output(h[r0:r1]))
            kl[r0:r1] = np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1)
            agree[r0:r1] = lp_ref.argmax(-1) == lp.argmax(-1)
            nll[r0:r1] = -lp[np.arange(r1 - r0), targets[r0:r1]]
        results.append(KVQuality(str(spec), float(kl.mean()), float(agree.mean()),
                                 float(np.exp(nll.mean())), int(kv_bytes)))
    if progress:
        progress("done", 1.0)
    return results


def per_layer_specs(config: KVConfig, n_layers: int, bits: int = 4) -> list[str]:
    """One spec per layer: that layer at `bits` for K and V, every other layer at 16 bits."""
    full = KVConfig(16, 16, block_size=config.block_size)
    return [str(full.with_overrides({i: (bits, bits)})) for i in range(n_layers)]
