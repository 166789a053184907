"""The benchmark scripts still run against today's engine API: each at a tiny size, one round, as
a process the way it is run (`python benchmarks/NAME.py ...`). What they print is checked for
shape only (a row per case, finite positive figures); their figures are docs/performance.md's,
never asserted here."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from .serve_process import ROOT

pytestmark = pytest.mark.slow  # processes that load the kernels (and a real model)

BENCHMARKS = ROOT / "benchmarks"


def bench(script: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_bench_weights_kernels_times_every_type_through_quantlinear(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports bench_common from its folder
    import bench_weights

    out = bench("bench_weights.py", "--kernels", "--mib", "2", "--rounds", "1")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:] if line.strip()}
    assert set(rows) == set(bench_weights.KERNEL_TYPES), out
    for name, cells in rows.items():
        kernels, figures = cells[0], [float(c) for c in cells[1:]]
        assert kernels in ("int", "float") and len(figures) == 4, (name, cells)
        assert all(math.isfinite(f) and f > 0 for f in figures), (name, cells)


def test_bench_weights_default_mode_runs_both_backends(smollm2_path):
    out = bench("bench_weights.py", "--models", "smollm2-135m-instruct", "--rounds", "1", "--context", "16",
                "--decode", "2")
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in out.splitlines()
            if line.startswith("smollm2-135m-instruct ")}
    for backend in ("dense", "quant"):
        figures = [float(c) for c in rows[("smollm2-135m-instruct", backend)]]
        assert len(figures) == 5 and all(f > 0 for f in figures), (backend, out)
    assert ("smollm2-135m-instruct", "quant/dense:") in rows, out


def test_bench_long_decode_prints_a_row_per_spec_and_context():
    out = bench("bench_long_decode.py", "--kv", "k4v4", "--contexts", "16", "80", "--steps", "3")
    rows = [line.strip("|").split("|") for line in out.splitlines()[2:] if line.startswith("|")]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [("k4v4", 16), ("k4v4", 80)], out
    for cells in rows:
        step, alone = float(cells[2]), [float(x) for x in cells[5].split("/")]
        assert math.isfinite(step) and step > 0 and all(a > 0 for a in alone), cells
    assert rows[0][3].strip() == "1.00x"


def test_bench_int_rows_prints_a_row_per_type_and_row_count():
    from engine.kernels import int_dot

    isas = [i for i in int_dot.ISA_LANES if int_dot.isa_available(i)]
    if not isas:
        pytest.skip("no integer instruction set on this CPU")
    out = bench("bench_int_rows.py", "--rows", "1", "17", "--types", "Q4_K", "Q6_K", "--copies", "1",
                "--rounds", "1")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()[3:] if line.startswith("|")]
    assert [(r[0], int(r[2])) for r in rows] == [("Q4_K", 1), ("Q4_K", 17), ("Q6_K", 1), ("Q6_K", 17)], out
    for cells in rows:
        times = [float(c.split()[0]) for c in cells[3 : 3 + len(isas)]]
        assert len(cells) == 3 + 2 * len(isas) - 1 and all(math.isfinite(t) and t > 0 for t in times), cells


def test_bench_spec_answers_print_speeds_and_lookups_ceiling(smollm2_path):
    """Issue 30's benchmark: per prompt the two modes' speeds, then the ceiling: how many of the
    plain answer's tokens the drafter could have predicted (n-grams down to 2, then down to 1,
    never fewer), and the speed-up that would give with verification free."""
    out = bench("bench_spec.py", "answers", "--rounds", "1", "--max-tokens", "8", "--kv", "k6v4")
    assert "median ratio" in out, out
    ceiling = out[out.index("predictable by lookup at best"):].splitlines()[1:]
    assert len(ceiling) == 4, out
    for line in ceiling:
        tokens, hits2, bound2, hits1, bound1 = line.split()[-5:]
        tokens, hits2, hits1 = int(tokens), int(hits2), int(hits1)
        assert 0 < tokens <= 8 and 0 <= hits2 <= hits1 <= tokens, line
        for hits, bound in ((hits2, bound2), (hits1, bound1)):
            assert abs(float(bound.rstrip("x")) - tokens / max(1, tokens - hits)) < 0.01, line


def test_bench_engine_prints_its_row_without_llama_cpp(smollm2_path):
    """Without llama-cpp-python importable (never a dependency) the table still has our figures,
    and the alternating pairs, which need it, are left out rather than failing."""
    out = bench("bench_engine.py", "--cases", "smollm2-512", "--no-rss", "--decode", "4", "--rounds", "1",
                "--prefill-pairs", "2", "--decode-pairs", "2")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| smollm2")]
    assert len(rows) == 1 and float(rows[0][1]) > 0 and float(rows[0][2]) > 0, out
    assert "alternating" not in out, out
