"""Does a kv-tune profile carry over to texts it was not measured on?

For each model: a sensitivity profile on a calibration text (engine.kvtune.get_profile, stored in
--store), widths chosen at the bytes of each --budget spec (costs per token, or at --cost-ctx
tokens), then the uniform spec and the tuned one evaluated (engine.evaluate.evaluate_kv) on each
held-out text at --eval-tokens. Prints one row per (model, budget) and writes them as JSON.

    python benchmarks/kvtune_transfer.py --models smollm2-135m-instruct gemma3-270m \
        --eval tests/data/texts/apache-2.0.txt tests/data/texts/gpl-3.txt --cost-ctx 1024
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench_common import cpu_seconds, evaluate_on_texts  # noqa: E402  (benchmarks/, the script's folder)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    ap.add_argument("--calibration", default=None, help="calibration text (default: the shipped one)")
    ap.add_argument("--n-tokens", type=int, default=None, help="calibration tokens (default: kvtune's)")
    ap.add_argument("--eval", nargs="+", default=[str(ROOT / "tests/data/texts/apache-2.0.txt")])
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--budget", nargs="+", default=["k4v4", "k6v4"])
    ap.add_argument("--cost-ctx", type=int, default=None, help="count bytes at this many tokens (default: per token)")
    ap.add_argument("--store", default="/tmp/kvt/profiles", help="profile store folder")
    ap.add_argument("--out", default=None, help="JSON rows to this file")
    args = ap.parse_args(argv)

    from engine import catalog, kvtune
    from engine.engine import Engine
    from engine.kv.config import KVConfig, parse_kv

    rows = []
    for name in args.models:
        engine = Engine.load(catalog.model_path(name), kv="full")
        n_cal = args.n_tokens or kvtune.DEFAULT_N_TOKENS
        text = Path(args.calibration).read_text(encoding="utf-8") if args.calibration else \
            kvtune.DEFAULT_CALIBRATION_TEXT.read_text(encoding="utf-8")
        tokens = kvtune.calibration_tokens(engine, text, n_cal)
        w0, c0 = time.perf_counter(), cpu_seconds()
        profile, stored = kvtune.get_profile(engine, tokens, options=KVConfig(), directory=Path(args.store))
        wall, cpu = time.perf_counter() - w0, cpu_seconds() - c0
        print(f"{name}: profile on {len(tokens) - 1} tokens {'(stored)' if stored else ''} "
              f"wall {wall:.0f} s cpu {cpu:.0f} s", flush=True)
        model = engine.model
        costs = kvtune.model_costs(model, KVConfig(), profile.bits, args.cost_ctx)
        specs, pairs = [], []
        for b in args.budget:
            like = parse_kv(b)
            choice = kvtune.choose_widths(profile.kl, costs, kvtune.budget_like(like, model, costs), like)
            pairs.append((b, choice))
            specs += [like, choice.config]
        for path, res in evaluate_on_texts(engine, args.eval, args.eval_tokens, specs):
            for i, (b, choice) in enumerate(pairs):
                u, t = res[2 * i], res[2 * i + 1]
                row = {"model": name, "eval": path.name, "budget": b, "uniform_kl": u.mean_kl,
                       "tuned_kl": t.mean_kl, "ratio": t.mean_kl / u.mean_kl, "uniform_bytes": u.kv_bytes,
                       "tuned_bytes": t.kv_bytes, "spec": choice.spec, "predicted": choice.predicted_kl,
                       "profile_wall": wall, "profile_cpu": cpu}
                rows.append(row)
                print(f"{name:24s} {path.name:16s} {b}: uniform {u.mean_kl:.5f} "
                      f"{u.kv_bytes / 2**20:.2f} MiB | tuned {t.mean_kl:.5f} {t.kv_bytes / 2**20:.2f} MiB "
                      f"({t.mean_kl / u.mean_kl:.2f}x)  {choice.spec}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
