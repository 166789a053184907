"""Prefill and decode speed of both catalog models at 512 and 4,096 tokens of context.

    .venv/bin/python benchmarks/bench_engine.py [--models NAME ...] [--contexts 512 4096] [--decode 32]

Prints tokens/s and, as ratios, how they compare with llama.cpp on this 2-core machine
(llama-cpp-python 0.3.36, 2 threads, f16 KV: the figures recorded in the speed issue), or with
llama.cpp measured in the same run when llama-cpp-python is importable.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from engine.catalog import resolve_model
from engine.engine import Engine

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "texts" / "gpl-3.txt"
# (model, context) → (prefill tok/s, decode tok/s) of llama.cpp, f16 KV, recorded on this machine.
LLAMA_CPP_RECORDED = {
    ("smollm2-135m-instruct", 512): (266.0, 113.0),
    ("smollm2-135m-instruct", 4096): (199.0, 56.0),
}


def prompt_ids(engine: Engine, n: int) -> list[int]:
    ids = engine.encode_prompt(TEXT.read_text())
    while len(ids) < n:  # repeat the document when it is shorter than the context asked for
        ids += ids
    return ids[:n]


def measure_ours(engine: Engine, ids: list[int], n_decode: int) -> tuple[float, float]:
    cache = engine.new_cache()
    t0 = time.perf_counter()
    logits = engine.prefill(ids, cache)
    prefill = len(ids) / (time.perf_counter() - t0)
    token = int(np.argmax(logits))
    t0 = time.perf_counter()
    for _ in range(n_decode):
        token = int(np.argmax(engine.model.forward([token], cache, "last")[0]))
    decode = n_decode / (time.perf_counter() - t0)
    return prefill, decode


def measure_llama_cpp(path: Path, ids: list[int], n_decode: int) -> tuple[float, float] | None:
    try:
        from llama_cpp import Llama  # optional: never a dependency
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=len(ids) + n_decode + 8, n_threads=2, verbose=False)
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill = len(ids) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return prefill, n_decode / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--decode", type=int, default=32, help="tokens decoded after the prompt")
    args = parser.parse_args()

    print(f"{'model':24s} {'context':>7s} {'prefill tok/s':>14s} {'decode tok/s':>13s}   vs llama.cpp (prefill, decode)")
    for name in args.models:
        path = resolve_model(name, fetch_missing=True)
        engine = Engine.load(path, kv="full")  # llama.cpp's figures are with its f16 cache
        for n in args.contexts:
            ids = prompt_ids(engine, n)
            prefill, decode = measure_ours(engine, ids, args.decode)
            baseline = measure_llama_cpp(path, ids, args.decode)
            source = "same run"
            if baseline is None:
                baseline, source = LLAMA_CPP_RECORDED.get((name, n)), "recorded"
            ratio = (f"{prefill / baseline[0]:.2f}x, {decode / baseline[1]:.2f}x ({source})"
                     if baseline else "n/a (no llama.cpp figure)")
            print(f"{name:24s} {n:7d} {prefill:14.1f} {decode:13.1f}   {ratio}", flush=True)


if __name__ == "__main__":
    main()
