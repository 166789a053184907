"""Token sampling and stop strings."""

from __future__ import annotations

import numpy as np
import pytest

from engine.sampling import Sampler, SamplingParams, StopStringMatcher, apply_repetition_penalty


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))
    return e / e.sum()


def random_logits(vocab: int, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def as_dict(ids: np.ndarray, probs: np.ndarray) -> dict[int, float]:
    return dict(zip(ids.tolist(), probs.tolist(), strict=True))


def reference_distribution(logits, params: SamplingParams, history=()) -> dict[int, float]:
    """The same pipeline written plainly, with full sorts (the penalty in the logits' own
    precision, as the sampler applies it)."""
    x = np.array(logits)
    if params.repetition_penalty != 1.0 and params.repetition_last_n != 0:
        recent = history if params.repetition_last_n < 0 else history[-params.repetition_last_n :]
        for i in set(recent):
            x[i] = (
                x[i] / params.repetition_penalty if x[i] > 0 else x[i] * params.repetition_penalty
            )
    x = x.astype(np.float64)
    order = np.argsort(-x, kind="stable")
    if params.top_k:
        order = order[: params.top_k]
    p = softmax(x[order] / params.temperature)
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), params.top_p)) + 1
        order, p = order[:keep], p[:keep]
    if params.min_p > 0.0:
        mask = p >= params.min_p * p.max()
        order, p = order[mask], p[mask]
    return as_dict(order, p / p.sum())


def assert_same_distribution(got: dict[int, float], want: dict[int, float], tol: float = 1e-12):
    assert set(got) == set(want)
    for token, prob in want.items():
        assert got[token] == pytest.approx(prob, abs=tol)


# ------------------------------------------------------------------------------ parameters


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("temperature", float("inf"), ">= 0"),
        ("top_k", -1, ">= 0"),
        ("top_k", 2.5, "integer"),
        ("top_p", 1.5, "[0, 1]"),
        ("top_p", -0.1, "[0, 1]"),
        ("min_p", 1.01, "[0, 1]"),
        ("min_p", -0.5, "[0, 1]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("repetition_last_n", -2, ">= -1"),
        ("repetition_last_n", 1.5, "integer"),
        ("seed", -1, ">= 0"),
        ("seed", "abc", "integer"),
    ],
)
def test_invalid_params_name_the_parameter(field, value, words):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError) as err:
        params.validate()
    message = str(err.value)
    assert message.startswith(field) and words in message and repr(value) in message
    with pytest.raises(ValueError, match=field):
        Sampler(params)


def test_valid_params_at_the_edges_of_their_ranges():
    """Values on the boundary of each range are accepted and do what they say."""
    logits = random_logits(1000, 4)
    best = int(np.argmax(logits))
    for edge in (SamplingParams(top_p=0.0, temperature=1.0), SamplingParams(min_p=1.0, temperature=1.0)):
        assert edge.validate() is None
        ids, probs = Sampler(edge).distribution(logits)  # a nucleus of 0 / min_p of 1: argmax only
        assert ids.tolist() == [best] and probs.tolist() == [1.0]
    whole = SamplingParams(temperature=1.2, repetition_penalty=0.8, repetition_last_n=-1, seed=0)
    assert whole.validate() is None
    history = [best, 3]  # last_n = -1 reaches the first token of the history too
    expected = reference_distribution(logits, whole, history)
    assert as_dict(*Sampler(whole).distribution(logits, history)) == pytest.approx(expected, abs=1e-12)
    # numpy scalars count as numbers: top_k=np.int64(5) keeps five, seed=np.int64(3) seeds like 3
    numpy_scalars = SamplingParams(top_k=np.int64(5), seed=np.int64(3), temperature=np.float32(0.5))
    assert numpy_scalars.validate() is None
    assert len(Sampler(numpy_scalars).distribution(logits)[0]) == 5
    plain = SamplingParams(top_k=5, seed=3, temperature=0.5)
    draws = [Sampler(p) for p in (numpy_scalars, plain)]
    assert [draws[0].sample(logits) for _ in range(30)] == [draws[1].sample(logits) for _ in range(30)]


# -------------------------------------------------------------------------- greedy & seeding


def test_greedy_is_argmax():
    sampler = Sampler(SamplingParams())
    for seed in range(20):
        logits = random_logits(5000, seed)
        token = sampler.sample(logits)
        assert type(token) is int and token == int(np.argmax(logits))
    ids, probs = sampler.distribution(random_logits(10, 1))
    assert ids.tolist() == [int(np.argmax(random_logits(10, 1)))] and probs.tolist() == [1.0]


def draw_sequence(seed, n=60, **kwargs) -> list[int]:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, **kwargs))
    logits = random_logits(1000, 7, scale=1.0)
    return [sampler.sample(logits) for _ in range(n)]


def test_same_seed_same_sequence_different_seed_different():
    assert draw_sequence(1) == draw_sequence(1)
    assert draw_sequence(1) != draw_sequence(2)
    assert draw_sequence(5, top_k=50, top_p=0.9) == draw_sequence(5, top_k=50, top_p=0.9)
    assert len(set(draw_sequence(1))) > 10


def test_top_k_1_is_greedy():
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=0))
    for seed in range(20):
        logits = random_logits(3000, seed)
        assert sampler.sample(logits) == int(np.argmax(logits))


def test_tiny_top_p_is_argmax():
    sampler = Sampler(SamplingParams(temperature=2.0, top_p=1e-6, seed=0))
    for seed in range(20):
        logits = random_logits(3000, seed, scale=0.5)
        assert sampler.sample(logits) == int(np.argmax(logits))


# -------------------------------------------------------------------------------- filtering

PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = np.log(PROBS).astype(np.float32)


def test_temperature_one_keeps_the_model_distribution():
    ids, probs = Sampler(SamplingParams(temperature=1.0)).distribution(LOGITS)
    assert_same_distribution(as_dict(ids, probs), dict(enumerate(PROBS.tolist())), tol=1e-6)


def test_top_k_keeps_the_k_most_likely():
    ids, probs = Sampler(SamplingParams(temperature=1.0, top_k=2)).distribution(LOGITS)
    assert ids.tolist() == [0, 1]
    assert probs.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])


def test_top_p_keeps_the_nucleus():
    ids, probs = Sampler(SamplingParams(temperature=1.0, top_p=0.75)).distribution(LOGITS)
    assert ids.tolist() == [0, 1]
    assert probs.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])
    ids, _ = Sampler(SamplingParams(temperature=1.0, top_p=0.9)).distribution(LOGITS)
    assert ids.tolist() == [0, 1, 2]


def test_min_p_filters():
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.2, seed=3))
    ids, probs = sampler.distribution(LOGITS)
    assert sorted(ids.tolist()) == [0, 1, 2]
    assert as_dict(ids, probs) == pytest.approx({0: 0.5 / 0.95, 1: 0.3 / 0.95, 2: 0.15 / 0.95})
    draws = [sampler.sample(LOGITS) for _ in range(2000)]
    assert 3 not in draws and {0, 1, 2} <= set(draws)
    ids, _ = Sampler(SamplingParams(temperature=1.0, min_p=0.65)).distribution(LOGITS)
    assert ids.tolist() == [0]


def test_temperature_distribution_statistically():
    logits = np.array([1.0, 0.5, 0.0, -1.0], dtype=np.float32)
    temperature = 0.7
    expected = softmax(logits / temperature)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=1234))
    n = 20_000
    counts = np.bincount([sampler.sample(logits) for _ in range(n)], minlength=4)
    chi2 = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    assert chi2 < 16.27  # 3 degrees of freedom, p = 0.001
    hot = Sampler(SamplingParams(temperature=5.0)).distribution(logits)[1]
    cold = Sampler(SamplingParams(temperature=0.2)).distribution(logits)[1]
    assert hot.max() < expected.max() < cold.max()


def test_minus_inf_logits_are_never_drawn():
    logits = np.array([0.0, -np.inf, 1.0, -np.inf], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    assert set(sampler.sample(logits) for _ in range(500)) == {0, 2}


def test_bad_logits():
    sampler = Sampler(SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="1-D"):
        sampler.sample(np.zeros((2, 3), dtype=np.float32))
    for bad in (np.full(4, -np.inf), np.array([0.0, np.nan, 1.0])):
        with pytest.raises(ValueError, match="finite"):
            sampler.sample(bad.astype(np.float32))
        with pytest.raises(ValueError, match="finite"):
            Sampler(SamplingParams()).sample(bad.astype(np.float32))


# ------------------------------------------------------------------------ repetition penalty


def test_repetition_penalty_formula():
    logits = np.array([2.0, -1.0, 0.5, 3.0, 0.0], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 0, 1, 4, 99, -3], penalty=2.0, last_n=64)
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0, 0.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]
    assert apply_repetition_penalty(logits, [0, 1], penalty=1.0, last_n=64) is logits
    assert apply_repetition_penalty(logits, [0, 1], penalty=2.0, last_n=0) is logits
    assert apply_repetition_penalty(logits, [], penalty=2.0, last_n=64) is logits
    window = apply_repetition_penalty(logits, [0, 1, 3], penalty=2.0, last_n=2)
    assert window.tolist() == [2.0, -2.0, 0.5, 1.5, 0.0]
    whole = apply_repetition_penalty(logits, np.array([0, 1, 3]), penalty=2.0, last_n=-1)
    assert whole.tolist() == [1.0, -2.0, 0.5, 1.5, 0.0]


def test_repetition_penalty_lowers_repeated_tokens_exactly():
    logits = np.array([2.0, 1.5, -0.5, 0.3], dtype=np.float32)
    history = [0, 2, 0]
    params = SamplingParams(temperature=1.0, repetition_penalty=1.5, seed=9)
    sampler = Sampler(params)
    ids, probs = sampler.distribution(logits, history)
    f32 = np.float32
    expected = softmax(
        np.array([f32(2.0) / f32(1.5), 1.5, f32(-0.5) * f32(1.5), f32(0.3)], dtype=np.float32)
    )
    assert as_dict(ids, probs) == pytest.approx(dict(enumerate(expected.tolist())), abs=1e-12)
    plain = softmax(logits)
    for repeated in (0, 2):
        assert expected[repeated] / expected[1] < plain[repeated] / plain[1]
    n = 20_000
    counts = np.bincount([sampler.sample(logits, history) for _ in range(n)], minlength=4)
    chi2 = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    assert chi2 < 16.27


def test_repetition_penalty_changes_greedy_choice():
    logits = np.array([3.0, 2.9, -5.0], dtype=np.float32)
    assert Sampler(SamplingParams()).sample(logits, [0]) == 0
    assert Sampler(SamplingParams(repetition_penalty=1.1)).sample(logits, [0]) == 1
    assert (
        Sampler(SamplingParams(repetition_penalty=1.1, repetition_last_n=1)).sample(logits, [0, 2])
        == 0
    )


# ------------------------------------------------------------------------ large vocabularies


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(temperature=1.3, min_p=0.05),
        SamplingParams(temperature=0.5, top_p=0.9, min_p=0.01),
        SamplingParams(temperature=1.0, top_k=100_000),
        SamplingParams(temperature=1.0, repetition_penalty=1.3),
    ],
    ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}-r{p.repetition_penalty}",
)
def test_large_vocabulary_matches_plain_pipeline(params):
    vocab = 262_144
    logits = random_logits(vocab, seed=11)
    history = np.random.default_rng(12).integers(0, vocab, 300).tolist()
    sampler = Sampler(params)
    got = as_dict(*sampler.distribution(logits, history))
    assert_same_distribution(got, reference_distribution(logits, params, history))
    assert 0 <= sampler.sample(logits, history) < vocab


# --------------------------------------------------------------------------- stop strings


def test_running_sum_is_cumsum_bit_for_bit():
    """`kernels.norms.running_sum` (the draw's cumulative weights): np.cumsum's sums exactly,
    compiled or not, over weights spanning many magnitudes (where the order of additions shows)."""
    from engine.kernels import norms

    rng = np.random.default_rng(5)
    for n in (1, 7, 1000, 49152):
        w = np.exp(rng.standard_normal(n) * 12)
        out = np.empty(n)
        assert np.array_equal(norms.running_sum(w, out), np.cumsum(w))
        assert np.array_equal(norms.running_sum(w[::2], np.empty(len(w[::2]))), np.cumsum(w[::2]))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, top_k=50, seed=4),
                                    SamplingParams(temperature=0.9, min_p=0.01, seed=5)])
def test_draws_are_the_same_with_the_compiled_running_sum_and_without(params, monkeypatch):
    from engine.kernels import norms

    logits = [random_logits(49152, seed=i) for i in range(40)]
    compiled = Sampler(params)
    picks = [compiled.sample(x) for x in logits]
    monkeypatch.setattr(norms, "_running_sum", None)
    plain = Sampler(params)
    assert [plain.sample(x) for x in logits] == picks


def test_stop_across_chunks():
    matcher = StopStringMatcher(["llo"])
    assert matcher.push("Hel") == ("He", False)
    assert matcher.push("lo") == ("", True)
    assert matcher.stopped and matcher.matched == "llo"
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_no_false_holdback():
    matcher = StopStringMatcher(["</s>"])
    assert matcher.push("a<") == ("a", False)
    assert matcher.push("/x") == ("</x", False)
    assert matcher.push(" end <") == (" end ", False)
    assert matcher.flush() == "<"
    assert matcher.flush() == ""
    assert not matcher.stopped


def test_stop_inside_one_chunk_and_earliest_wins():
    assert StopStringMatcher(["STOP"]).push("hello STOP world") == ("hello ", True)
    matcher = StopStringMatcher(["END", "xE"])
    assert matcher.push("axEND") == ("a", True) and matcher.matched == "xE"


def test_overlapping_prefixes():
    matcher = StopStringMatcher(["aab"])
    out = [matcher.push(c) for c in "aaab"]
    assert out == [("", False), ("", False), ("a", False), ("", True)]


def test_no_stops_passes_everything():
    matcher = StopStringMatcher(["", ""])
    assert matcher.push("abc") == ("abc", False)
    assert matcher.flush() == ""


def test_character_streaming_equals_one_shot():
    text = "The <|im_end|> is near: <|im_start|>assistant <|im_end|> tail"
    stops = ["<|im_end|>\n", "<|im_start|>", "\n\n"]
    whole = StopStringMatcher(stops)
    expected = whole.push(text)
    streamed = StopStringMatcher(stops)
    emitted, stopped = "", False
    for ch in text:
        out, stopped = streamed.push(ch)
        emitted += out
        if stopped:
            break
    assert (emitted, stopped) == expected == ("The <|im_end|> is near: ", True)


def test_count_penalties_subtract_presence_and_frequency_times_count():
    from engine.sampling import apply_count_penalties, penalty_processors

    logits = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    out = apply_count_penalties(logits, [1, 3, 3, 3], presence=0.5, frequency=0.25)
    assert out.dtype == np.float32
    assert out.tolist() == [1.0, 2.0 - 0.5 - 0.25, 3.0, 4.0 - 0.5 - 0.75]
    assert apply_count_penalties(logits, [1, 3], 0.0, 0.0) is logits
    assert apply_count_penalties(logits, [], 1.0, 1.0) is logits
    # the processors count only the tokens after the prompt; off when the penalties are neutral
    assert penalty_processors(SamplingParams(), 2) == []
    (count,) = penalty_processors(SamplingParams(frequency_penalty=1.0), n_prompt=2)
    assert count([3, 3, 1], logits).tolist() == [1.0, 1.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=float("nan")).validate()
