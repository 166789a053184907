"""What the benchmarks share: the gpl-3 prompt of a given length, bench_serve's chat prompts, and prefill + decode timing of
several KV caches in alternating windows (one spec after the other, round by round), so that load
from other processes on this shared machine hits every spec alike; the KV-tuning measurements'
process CPU time and evaluation of specs on held-out texts."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import numpy as np

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "texts" / "gpl-3.txt"
# bench_serve's chat prompts (46 tokens with SmolLM2's chat template): client c's request r
TOPICS = ["the sea", "mountains", "a small town", "autumn", "trains", "the moon", "bread", "rivers",
          "libraries", "bicycles", "winter", "gardens", "clocks", "lighthouses", "bees", "storms"]


def story_prompt(client: int, request: int, rounds: int) -> str:
    """The chat prompt bench_serve's client sends as its request-th of `rounds` requests."""
    topic = TOPICS[(client * rounds + request) % len(TOPICS)]
    return f"Request {client}-{request}. Write a long, detailed story about {topic}."


def prompt_ids(engine, n: int) -> list[int]:
    """The first n prompt tokens of gpl-3, the document repeated when it is shorter."""
    ids = list(engine.encode_prompt(TEXT.read_text()))
    while len(ids) < n:
        ids += ids
    return ids[:n]


def prefill_and_decode(engine, ids: list[int], specs: list[str], n_decode: int, rounds: int):
    """Prefill `ids` into a new cache per KV spec, then decode greedily in `rounds` rounds of one
    `n_decode`-token window per spec; each window is trimmed away after it, so every window runs
    at the same context length. Returns ({spec: prefill tok/s}, {spec: [decode tok/s per window]},
    {spec: cache}) — the caches are the caller's to release."""
    caches, tokens, prefill = {}, {}, {}
    for spec in specs:
        cache = engine.new_cache(spec)
        t0 = time.perf_counter()
        tokens[spec] = int(np.argmax(engine.prefill(ids, cache)))
        prefill[spec] = len(ids) / (time.perf_counter() - t0)
        caches[spec] = cache
    decode = {spec: [] for spec in specs}
    for _ in range(rounds):
        for spec in specs:
            tokens[spec], tok_s = decode_window(engine, caches[spec], tokens[spec], n_decode)
            decode[spec].append(tok_s)
    return prefill, decode, caches


def decode_window(engine, cache, token: int, n_decode: int) -> tuple[int, float]:
    """n_decode greedy steps from `token` on `cache`, then trimmed off it again (the next window
    runs at the same context length); (the last token, tok/s)."""
    t0 = time.perf_counter()
    for _ in range(n_decode):
        token = int(np.argmax(engine.model.forward([token], cache, "last")[0]))
    tok_s = n_decode / (time.perf_counter() - t0)
    cache.trim(n_decode)
    return token, tok_s


def cpu_seconds() -> float:
    """CPU time of this process so far (user + system, all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def evaluate_on_texts(engine, paths: list[str], n_tokens: int, specs: list):
    """For each text file: (its path, `evaluate_kv` of every spec on its first n_tokens tokens, as
    `kvtune.calibration_tokens` cuts them), one text after the other."""
    from engine import kvtune
    from engine.evaluate import evaluate_kv

    for path in paths:
        tokens = kvtune.calibration_tokens(engine, Path(path).read_text(encoding="utf-8"), n_tokens)
        yield Path(path), evaluate_kv(engine, tokens, specs)
