"""What `omlx serve` takes beyond temperature and top_p: OpenAI's presence / frequency penalties
and the repetition_penalty extension (one logits-processor path shared with the engine and
`omlx generate`), driven by the official `openai` client at a real server on 127.0.0.1."""

from __future__ import annotations

import json
from collections import Counter

import httpx2 as httpx
import pytest

from engine import cli
from engine.engine import Engine
from engine.sampling import SamplingParams
from .test_serve import PROMPTS, chat, client, smol, start, tiny, tiny_path  # noqa: F401 (fixtures)

# the tiny random model answers this by repeating one token ("tttt..."): a penalty has work to do
REPEAT_PROMPT = "the cat sat"


def complete(c, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 24)
    return c.completions.create(model="m", prompt=REPEAT_PROMPT, **kw)


def test_zero_penalties_are_no_penalty_bit_for_bit(tiny):
    c = client(tiny)
    plain = complete(c)
    zero = complete(c, presence_penalty=0, frequency_penalty=0, extra_body={"repetition_penalty": 1})
    assert zero.choices[0].text == plain.choices[0].text
    assert zero.usage.completion_tokens == plain.usage.completion_tokens == 24
    whole = chat(c, "a chat turn", max_tokens=12)
    assert chat(c, "a chat turn", max_tokens=12, presence_penalty=0.0,
                frequency_penalty=0.0).choices[0].message.content == whole.choices[0].message.content


def test_a_frequency_penalty_lowers_the_repeated_token_and_equals_omlx_generate(tiny, tiny_path, capsys):
    c = client(tiny)
    plain = complete(c).choices[0].text
    top_char, plain_count = Counter(plain).most_common(1)[0]
    assert plain_count == 24  # one token repeated
    penalized = complete(c, frequency_penalty=2).choices[0].text
    assert penalized != plain and penalized.count(top_char) < plain_count / 2
    # the same sampler path in the engine and the CLI (the same prompt, the same flags)
    assert cli.main(["generate", str(tiny_path), "--prompt", REPEAT_PROMPT, "--json", "--max-tokens", "24",
                     "--frequency-penalty", "2", "--kv", "full"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] == penalized
    # the opposite sign favours the repeat: the answer stays the same token
    assert complete(c, frequency_penalty=-2).choices[0].text == plain
    assert cli.main(["generate", str(tiny_path), "--prompt", REPEAT_PROMPT, "--json", "--max-tokens", "24",
                     "--presence-penalty", "1.5", "--kv", "full"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] == \
        complete(c, presence_penalty=1.5).choices[0].text


def test_penalties_out_of_range_get_400s_naming_the_field(tiny):
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = {"presence_penalty": 2.5, "frequency_penalty": -3, "repetition_penalty": 0}
    with httpx.Client(base_url=tiny.url, timeout=60) as http:
        for field, value in [*cases.items(), ("presence_penalty", "high"), ("repetition_penalty", -1.0)]:
            r = http.post("/v1/chat/completions", json={**ok, field: value})
            assert r.status_code == 400, (field, value, r.text)
            assert r.json()["error"]["param"] == field
            assert field in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"model": "m", "prompt": "x", "frequency_penalty": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "frequency_penalty"


@pytest.mark.slow
def test_smollm2_penalties_change_a_repeating_answer_in_the_expected_direction(smol, smollm2_path):
    """SmolLM2 counting "1. 1\\n2. 2\\n..." repeats its list tokens; a frequency penalty of 2 cuts
    the most repeated token's count, a presence penalty changes the answer, and the served text
    equals the engine's with the same SamplingParams."""
    c = client(smol)
    prompt = "List the numbers from 1 to 30, one per line."
    engine = smol.server.engine
    ids = engine.encode_chat([{"role": "user", "content": prompt}])
    plain = engine.generate(ids, max_tokens=40)
    penalized = engine.generate(ids, max_tokens=40, sampling=SamplingParams(frequency_penalty=2.0))
    assert Counter(penalized.ids).most_common(1)[0][1] < Counter(plain.ids).most_common(1)[0][1]
    served = chat(c, prompt, max_tokens=40, frequency_penalty=2)
    assert served.choices[0].message.content == penalized.text
    assert served.usage.completion_tokens == len(penalized.ids)
    assert chat(c, prompt, max_tokens=40).choices[0].message.content == plain.text
    assert chat(c, prompt, max_tokens=40, presence_penalty=2).choices[0].message.content != plain.text
    repeated = chat(c, prompt, max_tokens=40, extra_body={"repetition_penalty": 1.3}).choices[0].message.content
    rp = engine.generate(ids, max_tokens=40, sampling=SamplingParams(repetition_penalty=1.3, repetition_last_n=-1))
    assert repeated == rp.text != plain.text
