"""The per-token cost of grammar-constrained decoding (engine/constrain.py, llguidance) against a
decode step: greedy answers under a JSON schema on a catalog model, the processor's time per
token (consume the sampled token, compute the mask, apply it) beside the model's forward step.

    python benchmarks/bench_constrain.py [MODEL] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


from engine import catalog
from engine.constrain import JsonConstraint
from engine.decoding import TokenStream
from engine.engine import Engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colors", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "colors": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
                         "pet": {"type": "string", "enum": ["cat", "dog", "bird"]}}}


class Timed:
    def __init__(self, inner):
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def __call__(self, history, logits):
        t = time.perf_counter()
        out = self.inner(history, logits)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = Path(args.model) if Path(args.model).exists() else catalog.model_path(args.model)
    engine = Engine.load(path, kv="full")
    ids = engine.encode_chat([{"role": "user", "content": "Describe a person as JSON: name, age, colors, pet."}])
    JsonConstraint(engine.tokenizer, SCHEMA, len(ids))  # the tokenizer's llguidance table, built once
    step_s, proc_s, calls, tokens = 0.0, 0.0, 0, 0
    for _ in range(args.repeats):
        timed = Timed(JsonConstraint(engine.tokenizer, SCHEMA, len(ids)))
        stream = TokenStream(engine.tokenizer, ids, max_tokens=args.tokens, processors=[timed])
        cache = engine.new_cache()
        logits = engine.model.forward(np.asarray(ids, np.int64), cache, "last")[0]
        while True:
            step = stream.push(logits)
            if step.finish_reason is not None:
                break
            t = time.perf_counter()
            logits = engine.model.forward(np.asarray([step.token], np.int64), cache, "last")[0]
            step_s += time.perf_counter() - t
            tokens += 1
        stream.finish()
        proc_s, calls = proc_s + timed.seconds, calls + timed.calls
        answer = stream.text
    print(f"{path.name}: {tokens / args.repeats:.0f} tokens per answer, answer {json.loads(answer)}")
    step_ms = 1000 * step_s / tokens
    proc_ms = 1000 * proc_s / calls
    print(f"decode step {step_ms:.2f} ms/token, constraint {proc_ms:.3f} ms/token ({100 * proc_ms / step_ms:.1f}% of a step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
