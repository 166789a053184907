"""Short prefills: the fused matvec kernels against dequantized tiles + BLAS, per chunk length.

    .venv/bin/python benchmarks/bench_short_prefill.py [--model smollm2-135m-instruct] [--model PATH ...]
        [--tokens 9 16 24 32] [--rounds 5] [--context 0]

`QuantLinear` sends x with at most `MATVEC_MAX_ROWS` rows to the fused kernels (each block decoded
once per 4 rows of x, no dequantized copy of the matrix) and more rows to tiles + BLAS (the whole
matrix dequantized first, then one product). For each model and chunk length T, one whole-model
forward pass of T new tokens (after `--context` tokens already in the cache) is timed both ways,
the two alternated in one process (`rounds` times each, medians), by setting MATVEC_MAX_ROWS
below or above T: the figures behind the threshold (this machine is shared; compare within a run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OMLX_KERNEL_WARMUP", "wait")  # measure the compiled paths

from engine.catalog import resolve_model  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.weights import QuantLinear  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="catalog name or .gguf path (repeatable)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[9, 16, 24, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=0, help="tokens in the cache before the chunk")
    args = parser.parse_args()
    default = QuantLinear.MATVEC_MAX_ROWS
    print(f"MATVEC_MAX_ROWS = {default}\n")
    print("| model | tokens | fused kernels | tiles + BLAS | tiles / kernels |")
    print("|---|---|---|---|---|")
    try:
        for name in args.model or ["smollm2-135m-instruct"]:
            engine = Engine.load(resolve_model(name), kv="full")
            engine.disk_cache = False
            pc = engine.prefix_cache()
            rng = np.random.default_rng(0)
            history = rng.integers(100, 20000, size=args.context)
            for T in args.tokens:
                times = {"kernels": [], "tiles": []}
                for _ in range(args.rounds):
                    for path, rows in (("kernels", T), ("tiles", T - 1)):
                        QuantLinear.MATVEC_MAX_ROWS = rows
                        seq = pc.new_sequence(limit=args.context + T + 16)
                        if args.context:
                            engine.model.forward(history, seq, "last")
                        tokens = rng.integers(100, 20000, size=T)
                        t0 = time.perf_counter()
                        engine.model.forward(tokens, seq, "last")
                        times[path].append(time.perf_counter() - t0)
                        seq.release()
                k, t = (statistics.median(times[p]) for p in ("kernels", "tiles"))
                print(f"| {Path(str(name)).stem} | {T} | {k * 1e3:.0f} ms | {t * 1e3:.0f} ms | {t / k:.2f} |", flush=True)
    finally:
        QuantLinear.MATVEC_MAX_ROWS = default


if __name__ == "__main__":
    main()
