"""The integer weight kernels by instruction set and rows of x, against the VNNI kernels in the same
run: where AMX tiles pay (issue 26).

    .venv/bin/python benchmarks/bench_int_rows.py [--rows 1 4 16 512] [--types Q4_K Q6_K Q4_0 Q8_0]
                                                   [--copies 8] [--rounds 5] [--fast]

Per type, one Llama-3.2-1B-shaped matrix (8192 x 2048 for the 4-bit types and Q8_0, the FFN down
projection's 2048 x 8192 for Q6_K) of random blocks, `--copies` of them so that a small row count
reads its blocks from memory as a model's step does; each instruction set this CPU can run
(`int_dot.ISA_LANES`, AMX where the OS grants its tiles) multiplies the same activations, the sets
alternating within each round. Prints the median time per matrix, GMAC/s, and the ratio to
avx512vnni's time (or to the first set's where there is no VNNI); the outputs of every set are
checked bit-equal to the first's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from gguf.constants import GGMLQuantizationType as QT

from engine.kernels import int_dot, int_matvec

SHAPES = {"Q6_K": (2048, 8192)}  # the others: (8192, 2048)


def random_matrix(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """(rows, bytes) blocks of random codes with float16 fields at 0.01 (valid blocks of any type)."""
    t = int_matvec.INT_TYPES[qtype]
    raw = rng.integers(0, 256, (rows, cols // t.values * t.nbytes), dtype=np.uint8)
    blocks = raw.reshape(rows, cols // t.values, t.nbytes)
    for off, size in t.fields:
        if size == 2:
            blocks[:, :, off : off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 512])
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q4_0", "Q8_0"])
    ap.add_argument("--copies", type=int, default=8, help="matrices per type (memory, not cache)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fast", action="store_true", help="fast mode (int8 activations)")
    a = ap.parse_args()
    isas = [i for i in int_dot.ISA_LANES if int_dot.isa_available(i)]
    if not isas:
        raise SystemExit("no integer instruction set on this CPU")
    base = "avx512vnni" if "avx512vnni" in isas else isas[0]
    rng = np.random.default_rng(0)
    print(f"== integer products by instruction set, {'fast' if a.fast else 'exact'} mode, {a.copies} matrices, "
          f"medians of {a.rounds}; ratio = time / {base}'s")
    print("| type | shape | rows | " + " | ".join(f"{i} us (GMAC/s)" for i in isas) + " | "
          + " | ".join(f"{i}/{base}" for i in isas if i != base) + " |")
    print("|---" * (3 + len(isas) + len(isas) - 1) + "|")
    for name in a.types:
        qtype = QT[name]
        rows, cols = SHAPES.get(name, (8192, 2048))
        raws = [random_matrix(qtype, rows, cols, rng) for _ in range(a.copies)]
        matvecs = {isa: [int_matvec.IntMatvec(qtype, raw, cols, isa) for raw in raws] for isa in isas}
        for T in a.rows:
            x = rng.standard_normal((T, cols)).astype(np.float32)
            outs = {isa: np.empty((T, rows), np.float32) for isa in isas}
            times: dict[str, list[float]] = {isa: [] for isa in isas}
            for r in range(a.rounds + 1):  # the first round warms (compiles) and is not counted
                for isa in (isas if r % 2 else isas[::-1]):
                    t0 = time.perf_counter()
                    for m in matvecs[isa]:
                        m(x, outs[isa], a.fast)
                    if r:
                        times[isa].append((time.perf_counter() - t0) / a.copies)
            for isa in isas:
                if not np.array_equal(outs[isa].view(np.uint32), outs[isas[0]].view(np.uint32)):
                    raise SystemExit(f"{name}, {T} rows: {isa}'s results differ from {isas[0]}'s")
            med = {isa: statistics.median(ts) for isa, ts in times.items()}
            cells = [f"{med[i] * 1e6:.1f} ({rows * cols * T / med[i] / 1e9:.0f})" for i in isas]
            ratios = [f"{med[i] / med[base]:.2f}x" for i in isas if i != base]
            print(f"| {name} | {rows} x {cols} | {T} | " + " | ".join(cells + ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
