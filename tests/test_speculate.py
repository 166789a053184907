"""Prompt-lookup speculative decoding: the drafter, the acceptance rule (greedy and sampled), and
the engine's output with and without speculation on the real models."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine import cli
from engine.engine import Engine
from engine.sampling import Sampler, SamplingParams
from engine.speculate import PromptLookup, accept_draft

from .conftest import reference_json


# -- the drafter -------------------------------------------------------------------------------
def test_the_draft_continues_the_latest_earlier_occurrence_of_the_longest_tail():
    lookup = PromptLookup(max_draft=4)
    history = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 0, 1, 2, 3]
    # tail (1, 2, 3) occurred at the start: what followed it there
    assert lookup.draft(history, room=10) == [9, 9, 5, 2]
    # (2, 3) also occurred later (followed by 7 8), but the longest match wins
    history2 = [5, 2, 3, 7, 8, 6, 4, 2, 3]
    assert lookup.draft(history2, room=10) == [7, 8, 6, 4]
    assert lookup.draft(history2, room=2) == [7, 8]
    assert lookup.draft([4, 5, 6, 7], room=10) == []  # nothing repeats
    assert lookup.draft([4, 4, 4], room=0) == []


def test_the_index_grows_with_the_history_and_the_length_adapts():
    lookup = PromptLookup(max_draft=6)
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert lookup.draft(history, 10) == [3, 4, 5, 6]
    lookup.update(4, 4)  # all accepted: one more next time
    assert lookup.length == 5
    history += [3, 4, 5, 6]
    assert lookup.draft(history, 10) == [7, 8, 1, 2, 3]
    lookup.update(5, 1)  # rejected after one: the accepted length + 1
    assert lookup.length == 2
    assert (lookup.drafted, lookup.accepted) == (9, 5)


def test_a_draft_ends_with_a_stop_token():
    """What followed a stop token in the history (the next turn of an earlier exchange) is never
    drafted: the answer ends at the stop token, so nothing after it could be kept."""
    history = [1, 2, 3, 0, 7, 8, 9, 1, 2, 3]
    assert PromptLookup(max_draft=6).draft(history, room=10) == [0, 7, 8, 9]
    assert PromptLookup(max_draft=6, stop_ids={0}).draft(history, room=10) == [0]
    assert PromptLookup(max_draft=6, stop_ids={8}).draft(history, room=10) == [0, 7, 8]
    assert PromptLookup(max_draft=6, stop_ids={0}).draft(history, room=0) == []


# -- the acceptance rule -------------------------------------------------------------------------
def _accept(sampler, rows, draft):
    """accept_draft's tokens for a caller that keeps the history as TokenStream does."""
    history: list[int] = []
    out = []
    for token, _ in accept_draft(sampler, rows, draft, history):
        history.append(token)
        out.append(token)
    return out


def test_greedy_acceptance_keeps_the_agreeing_prefix_and_adds_the_models_token():
    rows = np.full((4, 5), -5.0, np.float32)
    for i, best in enumerate([2, 4, 1, 3]):
        rows[i, best] = 5.0
    sampler = Sampler(SamplingParams(temperature=0.0))
    assert _accept(sampler, rows, [2, 4, 1]) == [2, 4, 1, 3]  # all kept, then row 3's
    assert _accept(sampler, rows, [2, 0, 1]) == [2, 4]  # rejected at 1: the model's token


def test_sampled_acceptance_keeps_the_output_distribution():
    """The speculative-sampling rule with a deterministic draft: the first token's distribution is
    the model's p whatever the draft, and after an accepted draft token the next one is drawn from
    the next row. 40,000 trials, every frequency within 5 standard errors."""
    rng = np.random.default_rng(1)
    rows = rng.normal(0, 1.2, (3, 6)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, seed=7)
    sampler = Sampler(params)
    _, p0 = sampler.distribution(rows[0], [])
    _, p1 = sampler.distribution(rows[1], [])
    trials = 40_000
    first = np.zeros(6)
    second_after_draft = np.zeros(6)
    n_second = 0
    for _ in range(trials):
        out = _accept(sampler, rows, [2, 5])
        first[out[0]] += 1
        if out[0] == 2 and len(out) > 1:
            second_after_draft[out[1]] += 1
            n_second += 1
    for observed, p, n in ((first / trials, p0, trials), (second_after_draft / n_second, p1, n_second)):
        se = np.sqrt(p * (1 - p) / n)
        assert np.all(np.abs(observed - p) <= 5 * se + 1e-9), (observed, p)


# -- the engine ----------------------------------------------------------------------------------
REPEATING = ("Repeat this list exactly: red apple, green pear, blue plum, yellow lemon. "
             "red apple, green pear, blue plum, yellow lemon. red apple, green pear,")


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def loaded(request, smollm2_path, gemma3_path):
    path = smollm2_path if request.param.startswith("smollm2") else gemma3_path
    return request.param, Engine.load(path, kv="full")


@pytest.mark.slow  # two real models, 16 answers of 40 tokens
@pytest.mark.parametrize("kv", ["full", "k4v4"])
def test_greedy_tokens_are_identical_with_and_without_speculation(loaded, kv):
    name, engine = loaded
    prompts = [engine.encode_prompt(REPEATING)]
    prompts += [case["prompt_ids"] for case in reference_json(name, f32=True)["greedy_raw"][:3]]
    accepted = 0
    for ids in prompts:
        plain_cache, spec_cache = engine.new_cache(kv), engine.new_cache(kv)
        plain = engine.stream(ids, max_tokens=40, cache=plain_cache, speculate="off").result
        spec = engine.stream(ids, max_tokens=40, cache=spec_cache, speculate="lookup").result
        assert spec.ids == plain.ids and spec.text == plain.text and spec.finish_reason == plain.finish_reason
        # the cache holds what the plain loop forwarded, no rejected or unconsumed draft token
        assert spec_cache.token_ids == plain_cache.token_ids and spec_cache.offset == plain_cache.offset
        assert spec.stats.accepted_tokens <= spec.stats.drafted_tokens
        accepted += spec.stats.accepted_tokens
        plain_cache.release()
        spec_cache.release()
    assert accepted > 0  # the repeating prompt is drafted from and the drafts are kept


def test_generate_json_reports_drafted_and_accepted_tokens(capsys, smollm2_path):
    code = cli.main(["-q", "generate", str(smollm2_path), "--prompt", REPEATING, "--max-tokens", "16",
                     "--json", "--speculate", "lookup"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["stats"]["drafted_tokens"] > 0 and 0 < out["stats"]["accepted_tokens"] <= out["stats"]["drafted_tokens"]
    code = cli.main(["-q", "generate", str(smollm2_path), "--prompt", REPEATING, "--max-tokens", "16", "--json"])
    plain = json.loads(capsys.readouterr().out)
    assert plain["ids"] == out["ids"] and plain["stats"]["drafted_tokens"] == 0


def test_lookup_drafts_stop_at_the_end_of_an_earlier_answer_and_the_tokens_are_the_same(smollm2_path):
    """A question asked again after its answer: prompt lookup drafts the earlier answer, which ends
    with <|im_end|> followed by the next turn's tokens. The draft stops at <|im_end|>, so every
    drafted token is accepted (none counted rejected after the answer's end), and the answer is
    the one decoding without speculation gives. The server's lookup drafters stop there too."""
    from engine.serve.drafts import Drafts

    engine = Engine.load(smollm2_path, kv="full")
    question = [{"role": "user", "content": "Say the word blue."}]
    first = engine.generate(engine.encode_chat(question), max_tokens=20, speculate="off")
    assert first.finish_reason == "stop"
    ids = engine.encode_chat(question + [{"role": "assistant", "content": first.text}] + question)
    plain = engine.generate(ids, max_tokens=20, speculate="off")
    spec = engine.generate(ids, max_tokens=20, speculate="lookup")
    assert spec.ids == plain.ids and spec.text == plain.text and spec.finish_reason == plain.finish_reason == "stop"
    assert spec.stats.drafted_tokens > 0 and spec.stats.accepted_tokens == spec.stats.drafted_tokens

    engine.speculate = "lookup"
    served = Drafts(engine, group=8, prefill_chunk=64).new(ids, ctx=512)
    assert isinstance(served, PromptLookup) and served.stop_ids == engine.tokenizer.stop_ids


def test_smollm2_drafting_for_itself_accepts_every_greedy_token(smollm2_path):
    """`--draft MODEL` with the model itself as the draft: each drafted token is the greedy one,
    so every draft is accepted in full and the answer equals decoding without speculation."""
    from engine.engine import Engine

    engine = Engine.load(smollm2_path, kv="k6v4")
    draft = Engine.load(smollm2_path, kv="k6v4")
    ids = engine.encode_chat([{"role": "user", "content": "Write three sentences about the sea."}])
    plain = engine.generate(ids, max_tokens=40, speculate="off")
    engine.set_draft(draft)
    drafted = engine.generate(ids, max_tokens=40)
    assert drafted.ids == plain.ids
    s = drafted.stats
    assert s.drafted_tokens > 0 and s.accepted_tokens == s.drafted_tokens


def test_generate_draft_model_on_the_command_line_and_a_foreign_vocabulary_refused(capsys, smollm2_path,
                                                                                  gemma3_path):
    code = cli.main(["-q", "generate", str(smollm2_path), "--prompt", REPEATING, "--max-tokens", "12",
                     "--json", "--draft", str(smollm2_path)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["stats"]["drafted_tokens"] > 0
    assert out["stats"]["accepted_tokens"] == out["stats"]["drafted_tokens"]
    code = cli.main(["-q", "generate", str(smollm2_path), "--prompt", REPEATING, "--max-tokens", "12", "--json"])
    assert json.loads(capsys.readouterr().out)["ids"] == out["ids"]
    code = cli.main(["-q", "generate", str(smollm2_path), "--prompt", REPEATING, "--max-tokens", "4",
                     "--draft", str(gemma3_path)])
    assert code != 0
    assert "vocabulary" in capsys.readouterr().err


def test_a_draft_models_kv_is_the_main_models_without_overrides_past_its_layers():
    from types import SimpleNamespace

    from engine.kv.config import KVConfig
    from engine.speculate import draft_kv

    tuned = KVConfig.parse("k4v4,5:k8v8,0-1:k6v6")
    assert draft_kv(tuned, SimpleNamespace(n_layers=6)) == tuned
    small = draft_kv(tuned, SimpleNamespace(n_layers=2))  # no layer 5: the base spec, its options kept
    assert small == KVConfig.parse("k4v4") and small.block_size == tuned.block_size


def test_a_draft_models_cache_follows_the_history_it_is_shown(tmp_path):
    """DraftModel.sync trims its cache back to the longest common prefix with the history and
    returns what it still lacks: a rejected draft at the end, a history changed early (the whole
    comparison, not only its tail), a history that only grew."""
    from engine.speculate import DraftModel

    from .tiny_gguf import write_tiny_model

    engine = Engine.load(write_tiny_model(tmp_path / "tiny.gguf", context_length=512), kv="full")
    drafter = DraftModel(engine, max_draft=3)
    history = [int(t) for t in np.arange(60) % 50 + 5]

    def held(ids):  # feed what sync asks for, as the drafting callers do
        feed = drafter.sync(ids)
        engine.prefill(feed, drafter.cache)
        drafter.held.extend(feed)
        return feed

    assert held(history) == history and drafter.cache.offset == 60
    drafter.held.extend([7, 8]), engine.model.forward([7, 8], drafter.cache, "last")  # a draft's rows
    assert held(history + [9]) == [9]  # 7, 8 rejected: trimmed, and the new token fed
    assert drafter.cache.offset == 61 and drafter.held == history + [9]
    changed = [99] + history[1:] + [9]  # a different first token: everything again
    assert held(changed) == changed and drafter.held == changed and drafter.cache.offset == 61
    assert drafter.sync(changed + [10, 11]) == [10, 11]  # grown: only the new tokens
    assert drafter.sync(changed) == [9] and drafter.cache.offset == 60  # the last fed again, for its logits
