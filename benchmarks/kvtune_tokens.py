"""kv-tune's sensitivity measurement kept per token, so that different ways of summarising it
(mean over the text as kv-tune does, shorter prefixes, per-segment quantiles) can be compared without
measuring again; then each summary's widths at the bytes of K4V4 and K6V4, evaluated on held-out
texts.

    python benchmarks/kvtune_tokens.py measure MODEL --text FILE --n-tokens 1024 --out X.npz
    python benchmarks/kvtune_tokens.py evaluate MODEL X.npz [Y.npz ...] --eval FILE ... --rules mean seg4max
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


from bench_common import cpu_seconds, evaluate_on_texts  # noqa: E402  (benchmarks/, the script's folder)


def measure(engine, tokens, gain_tokens=None):
    """Per-token local errors (n_layers, 2, n_bits, T) and, per layer, the per-token KL and
    local error of the K4V4 perturbation propagated (n_layers, Tg)."""
    from engine import kvtune
    from engine.kv.config import KVConfig

    options = KVConfig()
    model = engine.model
    tokens = np.asarray(tokens, np.int64)
    net = kvtune._Network(model, tokens[:-1], options)
    short = gain_tokens is not None and len(tokens) - 1 > gain_tokens
    gnet = kvtune._Network(model, tokens[:gain_tokens], options) if short else net
    n, T, bits = model.n_layers, len(tokens) - 1, kvtune.CANDIDATE_BITS
    energy = np.zeros((n, 2, len(bits), T))
    Tg = len(gnet.inputs)
    kl_tok, e_tok = np.zeros((n, Tg)), np.zeros((n, Tg))
    t_energy = t_gain = 0.0
    for layer in range(n):
        t0 = cpu_seconds()
        ref = net.attn[layer]["out"]
        for bi, b in enumerate(bits):
            for ri, (kb, vb) in enumerate(((b, 16), (16, b))):
                d = net.attention_output(layer, kb, vb) - ref
                energy[layer, ri, bi] = np.mean(np.square(d).reshape(T, -1), axis=1)
        t1 = cpu_seconds()
        cal = gnet.attention_output(layer, kvtune.CALIBRATION_BITS, kvtune.CALIBRATION_BITS)
        e_tok[layer] = np.mean(np.square(cal - gnet.attn[layer]["out"]).reshape(Tg, -1), axis=1)
        kl_tok[layer] = per_token_kl(gnet, layer, cal)
        t_energy += t1 - t0
        t_gain += cpu_seconds() - t1
        print(f"layer {layer} energy cpu {t1 - t0:.1f} s gain cpu {cpu_seconds() - t1:.1f} s", flush=True)
    return energy, kl_tok, e_tok, t_energy, t_gain


def per_token_kl(net, layer, out):
    from engine import kvtune

    m, n = net.model, net.model.n_layers
    layers = m.layers
    fresh = m.new_cache(None)
    x = net.blocks[layer]["x"]
    for j in range(layer, n):
        x = layers[j](x, *net.blocks[j]["args"][:-1], kvtune._InjectingLayer(out) if j == layer else fresh[j])
    return kvtune._kl(net.lp_ref, kvtune._log_probs(m, kvtune._final_norm(m, x)))


def summarise(data, rule: str) -> np.ndarray:
    """(n_layers, 2, n_bits) predicted KL from per-token measurements under `rule`:
    mean: kv-tune's (ratio of sums for the gain, mean local error);
    a suffix -eN / -gN takes the local errors / the gains over the first N tokens only;
    segS[max|q75|mean]: the same per S contiguous segments, then the max / 75th percentile / mean
    over segments, per (layer, role, width)."""
    energy, kl_tok, e_tok = data["energy"], data["kl_tok"], data["e_tok"]
    rule, *limits = rule.split("-")
    for limit in limits:  # -eN: local errors over the first N tokens only; -gN: gains over the first N
        if limit[0] == "e":
            energy = energy[..., : int(limit[1:])]
        else:
            kl_tok, e_tok = kl_tok[:, : int(limit[1:])], e_tok[:, : int(limit[1:])]
    if rule == "mean":
        gain = kl_tok.sum(1) / np.maximum(e_tok.sum(1), 1e-30)
        return np.maximum(gain, 0)[:, None, None] * energy.mean(-1)
    if rule.startswith("seg"):
        s = int("".join(c for c in rule[3:] if c.isdigit()))
        how = rule[3 + len(str(s)):]
        gain_edges = np.linspace(0, kl_tok.shape[1], s + 1).astype(int)
        local_edges = np.linspace(0, energy.shape[-1], s + 1).astype(int)
        per = []
        for a, b, c, d in zip(gain_edges[:-1], gain_edges[1:], local_edges[:-1], local_edges[1:]):
            g = np.maximum(kl_tok[:, a:b].sum(1) / np.maximum(e_tok[:, a:b].sum(1), 1e-30), 0)
            per.append(g[:, None, None] * energy[..., c:d].mean(-1))
        per = np.stack(per, -1)
        if how == "max":
            return per.max(-1)
        if how.startswith("q"):
            return np.quantile(per, int(how[1:]) / 100, axis=-1)
        return per.mean(-1)
    raise ValueError(rule)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("model")
    m.add_argument("--text", required=True)
    m.add_argument("--n-tokens", type=int, default=1024)
    m.add_argument("--gain-tokens", type=int, default=None)
    m.add_argument("--out", required=True)
    e = sub.add_parser("evaluate")
    e.add_argument("model")
    e.add_argument("profiles", nargs="+", help="npz files; several are pooled (energies and gains averaged)")
    e.add_argument("--eval", nargs="+", required=True)
    e.add_argument("--eval-tokens", type=int, default=1024)
    e.add_argument("--rules", nargs="+", default=["mean"])
    e.add_argument("--budget", nargs="+", default=["k4v4", "k6v4"])
    e.add_argument("--cost-ctx", type=int, default=1024)
    e.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from engine import catalog, kvtune
    from engine.engine import Engine
    from engine.kv.config import KVConfig, parse_kv

    engine = Engine.load(catalog.model_path(args.model), kv="full")
    if args.cmd == "measure":
        tokens = kvtune.calibration_tokens(engine, Path(args.text).read_text(encoding="utf-8"), args.n_tokens)
        w0, c0 = time.perf_counter(), cpu_seconds()
        energy, kl_tok, e_tok, te, tg = measure(engine, tokens, args.gain_tokens)
        np.savez(args.out, energy=energy, kl_tok=kl_tok, e_tok=e_tok, wall=time.perf_counter() - w0,
                 cpu=cpu_seconds() - c0, cpu_energy=te, cpu_gain=tg, n_tokens=len(tokens) - 1)
        print(f"{args.model}: {len(tokens) - 1} tokens wall {time.perf_counter() - w0:.0f} s "
              f"cpu {cpu_seconds() - c0:.0f} s (energy {te:.0f}, gain {tg:.0f})")
        return 0

    datas = [dict(np.load(p)) for p in args.profiles]
    model = engine.model
    costs = kvtune.model_costs(model, KVConfig(), kvtune.CANDIDATE_BITS, args.cost_ctx or None)
    specs, labels = [], []
    for b in args.budget:
        like = parse_kv(b)
        specs.append(like)
        labels.append((b, "uniform"))
        for rule in args.rules:
            kl = np.mean([summarise(d, rule) for d in datas], axis=0)
            choice = kvtune.choose_widths(kl, costs, kvtune.budget_like(like, model, costs), like)
            specs.append(choice.config)
            labels.append((b, rule))
    rows = []
    for path, res in evaluate_on_texts(engine, args.eval, args.eval_tokens, specs):
        base = {}
        for (b, rule), r, spec in zip(labels, res, specs):
            if rule == "uniform":
                base[b] = r.mean_kl
            rows.append({"model": args.model, "eval": path.name, "budget": b, "rule": rule,
                         "kl": r.mean_kl, "bytes": r.kv_bytes, "ratio": r.mean_kl / base[b], "spec": str(spec)})
            print(f"{args.model:22s} {path.name:16s} {b} {rule:10s} {r.mean_kl:.5f} "
                  f"{r.kv_bytes / 2**20:.2f} MiB {r.mean_kl / base[b]:.2f}x  {spec}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
