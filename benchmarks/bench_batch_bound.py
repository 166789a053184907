"""How far continuous batching can lift `bench_serve`'s 4-client figure on this machine, from the
engine alone (no HTTP, no clients): the ceiling of issue 15's "4 clients >= N x one client".

    .venv/bin/python benchmarks/bench_batch_bound.py [--model smollm2-135m-instruct] [--model PATH.gguf ...]
        [--clients 4] [--response 64 256] [--reps 15]

bench_serve's clients each send a chat prompt (~46 tokens with the chat template), read the
streamed answer, and send the next; its "agg decode tok/s" counts the tokens after each answer's
first, over the time from the first answer's first token to the last answer's last, so the next
prompts' prefill falls inside the span. In steady state, with answers of R tokens:

    one client:  a round is  P1 + (R-1)·S1            for R tokens
    N clients:   a round is  PN + (R-1)·SN            for N·R tokens
    ratio = N·(P1 + (R-1)·S1) / (PN + (R-1)·SN)

P1 / PN: prefill of one prompt / of N prompts in one batch (the server's `PrefillBatch` pass);
S1 / SN: one decode step of 1 / N sequences (`DecodeBatch`), measured here as medians. The
"measured" row uses them as they are: what the server would reach with free HTTP, sampling and
scheduling. The "float32 peak" row replaces PN and SN by the time their multiply-adds take at the
best float32 rate this machine reaches (numpy's sgemm on 2048 x 2048 matrices, measured in the
same run): N prompts' linear layers, and N rows of every weight matrix per step, with nothing
else (no dequantization, attention, norms or glue) — a ceiling no float kernel reaches, while
P1 and S1 stay measured (a faster one-client path would only lower the ratio).
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
from engine.kv.batch import DecodeBatch  # noqa: E402
from engine.serve.scheduler import prefill_together  # noqa: E402

from bench_common import story_prompt  # noqa: E402  (benchmarks/, the script's folder)



def linear_shapes(model) -> tuple[int, int]:
    """(multiply-adds per token in the layers' linear maps, in the output layer): every object
    reachable from the model with in_features / out_features, counted once."""
    seen, stack, found = set(), [model], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if hasattr(obj, "in_features") and hasattr(obj, "out_features"):
            found.append(obj)
            continue
        children = obj if isinstance(obj, (list, tuple)) else getattr(obj, "__dict__", {}).values()
        for child in children:
            if isinstance(child, (list, tuple)) or type(child).__module__.startswith("engine."):
                stack.append(child)
    vocab = max(lin.out_features for lin in found)
    out = sum(lin.out_features * lin.in_features for lin in found if lin.out_features == vocab)
    body = sum(lin.out_features * lin.in_features for lin in found if lin.out_features != vocab)
    return body, out


def sgemm_rate() -> float:
    """float32 FLOP/s of numpy's matmul on 2048 x 2048 matrices (best of 5)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2048, 2048)).astype(np.float32)
    b = rng.standard_normal((2048, 2048)).astype(np.float32)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * 2048**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def prompts(engine: Engine, n: int) -> list[list[int]]:
    """The first request of n bench_serve clients (rounds of 1), as token ids."""
    return [engine.encode_chat([{"role": "user", "content": story_prompt(c, 0, 1)}]) for c in range(n)]


def prefill_batch(engine: Engine, caches, chunks: list[list[int]]) -> None:
    """One forward pass over every chunk, the output layer on each sequence's last row (as the
    server's `Scheduler._prefill_batch` does for prompts that end in the chunk)."""
    h, last_rows = prefill_together(engine.model, caches, chunks)
    for row in last_rows:
        engine.model.output(h[row : row + 1])


def measure(engine: Engine, clients: int, reps: int) -> dict:
    pc = engine.prefix_cache()
    asks = prompts(engine, clients)
    times = {"P1": [], "PN": [], "S1": [], "SN": []}
    rng = np.random.default_rng(0)
    for _ in range(3):
        one = pc.new_sequence(limit=4096)
        times["P1"].append(_timed(lambda: engine.model.forward(np.asarray(asks[0], np.int64), one, "last")))
        one.release()
        caches = [pc.new_sequence(limit=4096) for _ in range(clients)]
        times["PN"].append(_timed(lambda: prefill_batch(engine, caches, asks)))
        for c in caches:
            c.release()
    # decode steps a little into the answers (the prompts' positions plus 32)
    for n, key in ((1, "S1"), (clients, "SN")):
        caches = [pc.new_sequence(limit=4096) for _ in range(n)]
        for cache, ask in zip(caches, asks):
            engine.model.forward(np.asarray(ask + list(rng.integers(100, 20000, 32)), np.int64), cache, "last")
        for _ in range(reps):
            tokens = rng.integers(100, 20000, size=n)
            batch = caches[0] if n == 1 else DecodeBatch(caches)
            times[key].append(_timed(lambda: engine.model.forward(tokens, batch, "all")))
        for c in caches:
            c.release()
    out = {k: statistics.median(v) for k, v in times.items()}
    out["prompt_tokens"] = sum(map(len, asks)) / len(asks)
    return out


def ratio(t: dict, clients: int, response: int) -> float:
    one = t["P1"] + (response - 1) * t["S1"]
    many = t["PN"] + (response - 1) * t["SN"]
    return clients * one / many


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="catalog name or .gguf path (repeatable)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--response", type=int, nargs="+", default=[64, 256], help="answer lengths R")
    parser.add_argument("--reps", type=int, default=15, help="decode steps measured per batch size")
    args = parser.parse_args()
    rate = sgemm_rate()
    print(f"float32 peak here (numpy sgemm 2048^3): {rate / 1e9:.0f} GFLOP/s\n")
    n = args.clients
    print(f"| model | P1 | P{n} | S1 | S{n} | S{n} / S1 | row | " +
          " | ".join(f"ratio, R={r}" for r in args.response) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(args.response))
    for name in args.model or ["smollm2-135m-instruct"]:
        engine = Engine.load(resolve_model(name), kv="full")
        t = measure(engine, n, args.reps)
        body, out = linear_shapes(engine.model)
        peak = dict(t)
        peak["PN"] = 2 * (n * t["prompt_tokens"] * body + n * out) / rate
        peak["SN"] = 2 * n * (body + out) / rate
        label = Path(str(name)).stem
        for row, times in (("measured", t), ("float32 peak", peak)):
            print(f"| {label} | {t['P1'] * 1e3:.0f} ms | {times['PN'] * 1e3:.0f} ms | {t['S1'] * 1e3:.1f} ms | "
                  f"{times['SN'] * 1e3:.1f} ms | {times['SN'] / t['S1']:.2f} | {row} | " +
                  " | ".join(f"{ratio(times, n, r):.2f}x" for r in args.response) + " |", flush=True)


if __name__ == "__main__":
    main()
