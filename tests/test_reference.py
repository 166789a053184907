"""The engine against llama.cpp's ground truth (tests/data/, copied from ../shared/reference).

`llama_cpp_f32/` is llama.cpp computing in f32 on exactly the values the quantized blocks hold:
what a float engine computes, so the bar is tight. `llama_cpp/` is llama.cpp's own arithmetic
(8-bit activations inside its dot products): a sanity band only.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.engine import Engine
from engine.sampling import SamplingParams

from .conftest import REFERENCE_NAMES, reference_json, reference_npz_path

pytestmark = pytest.mark.slow  # both real models against llama.cpp's logits over long texts

TEXTS = ["gpl-3", "kv-cache-article-zh", "gpl-3-long"]


@pytest.fixture(scope="module")
def engines(smollm2_path, gemma3_path):
    return {
        # 16-bit KV, as llama.cpp's default f16 cache that made the reference
        "smollm2-135m-instruct": Engine.load(smollm2_path, kv="full"),
        "gemma3-270m": Engine.load(gemma3_path, kv="full"),
    }


def _compare(engine: Engine, npz_path):
    ref = np.load(npz_path)
    ours = engine.teacher_forced(ref["tokens"])
    top1 = float(np.mean(ours.top_ids[:, 0] == ref["top_ids"][:, 0]))
    delta = float(np.mean(np.abs(ours.next_logprob - ref["next_logprob"])))
    return ours, ref, top1, delta


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("name", list(REFERENCE_NAMES))
def test_teacher_forced_matches_llama_cpp_f32(engines, name, text):
    ours, ref, top1, delta = _compare(engines[name], reference_npz_path(name, text, f32=True))
    assert ours.top_ids.shape == ref["top_ids"].shape
    assert top1 >= 0.995, f"{name}/{text}: top-1 agreement {top1:.4f}"
    assert delta <= 0.01, f"{name}/{text}: mean |Δ next logprob| {delta:.4f} nats"
    # The 32 most likely tokens agree as a distribution too, not just at the top.
    assert np.mean(np.abs(ours.top_logprobs[:, :8] - ref["top_logprobs"][:, :8])) < 0.02
    if "full_logits" in ref:
        at = ref["full_logits_at"]
        ids = ref["tokens"][: int(at.max()) + 1]
        cache = engines[name].new_cache()
        logits = engines[name].model.forward(ids, cache, at)
        assert np.max(np.abs(logits - ref["full_logits"])) < 0.25
        assert np.mean(np.abs(logits - ref["full_logits"])) < 0.02


@pytest.mark.parametrize("text", ["gpl-3", "kv-cache-article-zh"])
@pytest.mark.parametrize("name", list(REFERENCE_NAMES))
def test_teacher_forced_within_band_of_llama_cpp_quantized(engines, name, text):
    _, ref, top1, delta = _compare(engines[name], reference_npz_path(name, text, f32=False))
    # The band is 93% top-1, except where llama.cpp's own f32 run agrees less with its quantized
    # run (Gemma3 on the Chinese article: 92.38%): exact arithmetic cannot beat that, so there the
    # bar is what llama.cpp f32 itself reaches, less a point.
    f32 = np.load(reference_npz_path(name, text, f32=True))
    llama_f32_top1 = float(np.mean(f32["top_ids"][:, 0] == ref["top_ids"][:, 0]))
    bar = min(0.93, llama_f32_top1 - 0.01)
    assert top1 >= bar, f"{name}/{text}: top-1 agreement {top1:.4f} (llama.cpp f32: {llama_f32_top1:.4f})"
    assert delta <= 0.15, f"{name}/{text}: mean |Δ| {delta:.4f}"


@pytest.mark.parametrize("name,needed", [("smollm2-135m-instruct", 5), ("gemma3-270m", 2)])
def test_greedy_continuations_match_f32_reference(engines, name, needed):
    engine = engines[name]
    ref = reference_json(name, f32=True)
    cases = ref["greedy_raw"] + ref.get("greedy_chat", [])
    matches = []
    for case in cases:
        result = engine.generate(case["prompt_ids"], max_tokens=16, sampling=SamplingParams())
        expected = case["ids"][:16]
        matches.append(result.ids[: len(expected)] == expected)
    assert sum(matches) >= needed, f"{name}: {sum(matches)} of {len(cases)} greedy prefixes match: {matches}"
    assert len(cases) == {"smollm2-135m-instruct": 6, "gemma3-270m": 3}[name]


def test_our_prompts_tokenize_like_the_reference(engines):
    for name, engine in engines.items():
        ref = reference_json(name, f32=True)
        for case in ref["greedy_raw"]:
            assert engine.encode_prompt(case["prompt"]) == case["prompt_ids"]
        for case in ref.get("greedy_chat", []):
            assert engine.encode_chat([{"role": "user", "content": case["user"]}]) == case["prompt_ids"]
