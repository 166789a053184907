"""What a decode step costs as the context grows, and how much of it is the attention.

    .venv/bin/python benchmarks/bench_long_decode.py [--model smollm2-135m-instruct] [--kv k6v4 full]
        [--contexts 32 1000 2000 4000] [--steps 30]

For each KV spec and context length: a sequence is prefilled with that many tokens (random ids),
then `--steps` single-token decode steps are timed (median), as `Session` runs them (one sequence,
every layer). Beside it, layer 0's attention alone, timed on its own in a loop
(`DecodeKernel.attend` as the step calls it, and with its `threads` set to 1: one compiled call):
there the layer's K/V stay in cache, while in the step every layer's blocks stream from memory
after the weights. The columns:

    step ms       the decode step's median
    vs shortest   step / the step at the shortest context of the run (the same process)
    attn/layer    (step - shortest step) / layers: what each layer's attention added, in microseconds
    alone         layer 0's attention alone (the pool's threads / one thread), microseconds
    in step/alone attn/layer over `alone` (threads): > 1 when the step waits on memory

Nothing is asserted; docs/performance.md holds the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

os.environ.setdefault("OMLX_KERNEL_WARMUP", "wait")  # measure the compiled paths

from engine.catalog import resolve_model  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.kv import paged_attention  # noqa: E402


def median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def layer0_attention(engine: Engine, seq, token: int) -> tuple[float, float]:
    """(attend as the step calls it, decode_attention on one thread), seconds: layer 0's view
    captured during one decode step, then timed alone."""
    captured = []
    original = paged_attention.DecodeKernel.attend

    def capture(kernel, view, *, scale, window):
        if not captured:
            captured.append((kernel, view, scale, window))
        return original(kernel, view, scale=scale, window=window)

    paged_attention.DecodeKernel.attend = capture
    try:
        engine.model.forward(np.array([token], np.int64), seq, "all")
    finally:
        paged_attention.DecodeKernel.attend = original
    if not captured:  # this model's decode steps take another path
        return float("nan"), float("nan")
    kernel, view, scale, window = captured[0]
    threads = median_seconds(lambda: original(kernel, view, scale=scale, window=window), 100)
    shared, kernel.threads = kernel.threads, 1  # `attend` then makes its one compiled call
    try:
        one_thread = median_seconds(lambda: original(kernel, view, scale=scale, window=window), 100)
    finally:
        kernel.threads = shared
    return threads, one_thread


def measure(engine: Engine, context: int, steps: int) -> dict:
    rng = np.random.default_rng(context)
    seq = engine.prefix_cache().new_sequence(limit=context + steps + 64)
    try:
        engine.model.forward(rng.integers(100, 20000, context).astype(np.int64), seq, "last")
        tokens = iter(rng.integers(100, 20000, steps + 2))
        alone, one_thread = layer0_attention(engine, seq, int(next(tokens)))
        step = median_seconds(lambda: engine.model.forward(np.array([next(tokens)], np.int64), seq, "all"), steps)
    finally:
        seq.release()
    return {"step": step, "alone": alone, "one_thread": one_thread}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or .gguf path")
    parser.add_argument("--kv", nargs="+", default=["k6v4", "full"], help="KV specs (`--kv SPEC`)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32, 1000, 2000, 4000])
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per context")
    args = parser.parse_args()
    contexts = sorted(set(args.contexts))
    print("| KV | context | step ms | vs shortest | attn/layer us | alone us (threads / one) | in step/alone |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.kv:
        engine = Engine.load(resolve_model(args.model), kv=spec)
        layers = len(engine.model.layers)
        base = None
        for context in contexts:
            t = measure(engine, context, args.steps)
            base = t["step"] if base is None else base
            per_layer = (t["step"] - base) / layers
            ratio = per_layer / t["alone"] if context != contexts[0] and t["alone"] > 0 else float("nan")
            print(f"| {spec} | {context} | {t['step'] * 1e3:.2f} | {t['step'] / base:.2f}x | {per_layer * 1e6:.0f} | "
                  f"{t['alone'] * 1e6:.0f} / {t['one_thread'] * 1e6:.0f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
