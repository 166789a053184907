"""`response_format` (json_object, json_schema) on `omlx serve`: decoding constrained by
llguidance (engine/constrain.py, a TokenStream logits processor), driven by the official
`openai` client at a real server on 127.0.0.1."""

from __future__ import annotations

import json
import random

import httpx2 as httpx
import pytest

from .test_serve import client, smol, start, tiny, tiny_path  # noqa: F401 (fixtures)

FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def valid(value, schema: dict) -> bool:
    """The JSON-schema rules the generated schemas use (type, properties, required, enum,
    additionalProperties false, minimum / maximum, maxLength, maxItems)."""
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", ()))
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(valid(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(valid(v, schema.get("items", {})) for v in value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


def test_a_json_schema_constrains_even_a_random_model(tiny):
    c = client(tiny)
    for stream in (False, True):
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "ok?"}], max_tokens=24,
                                      temperature=0, response_format=schema_format(FLAG), stream=stream)
        text = "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if stream \
            else r.choices[0].message.content
        assert valid(json.loads(text), FLAG), text
    obj = c.completions.create(model="m", prompt="the cat sat", max_tokens=40, temperature=0.8, seed=1,
                               extra_body={"response_format": {"type": "json_object"}}).choices[0]
    if obj.finish_reason == "stop":  # a random model may still be inside the object at max_tokens
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.lstrip().startswith("{")
    assert c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                     response_format={"type": "text"}).usage.completion_tokens == 4


def test_bad_response_formats_get_400s_naming_the_field(tiny):
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(base_url=tiny.url, timeout=60) as http:
        for fmt, param in [({"type": "xml"}, "response_format"), ("json", "response_format"),
                           ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
                            "response_format.json_schema"),
                           ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema")]:
            r = http.post("/v1/chat/completions", json={**ok, "response_format": fmt})
            assert r.status_code == 400, (fmt, r.text)
            assert r.json()["error"]["param"] == param
        assert http.get("/health").status_code == 200


def generated_schema(rng: random.Random) -> dict:
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["string", "integer", "boolean", "enum", "array"])
        if kind == "enum":
            props[f"choice{i}"] = {"type": "string", "enum": rng.sample(["red", "green", "blue", "cyan"], 2)}
        elif kind == "integer":
            props[f"n{i}"] = {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 1000])}
        elif kind == "array":
            props[f"tags{i}"] = {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}
        elif kind == "string":  # bounded: at temperature 0 a 135M model may repeat a character forever
            props[f"name{i}"] = {"type": "string", "maxLength": 32}
        else:
            props[f"{kind}{i}"] = {"type": kind}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


@pytest.mark.slow
def test_smollm2_answers_validate_against_generated_schemas(smol):
    c = client(smol)
    rng = random.Random(28)
    for n in range(20):
        schema = generated_schema(rng)
        r = c.chat.completions.create(model="m", max_tokens=96, temperature=0, response_format=schema_format(schema),
                                      messages=[{"role": "user", "content": "Describe a colourful bird as JSON."}])
        assert r.choices[0].finish_reason == "stop", (schema, r.choices[0].message.content)
        assert valid(json.loads(r.choices[0].message.content), schema), (schema, r.choices[0].message.content)


def test_omlx_generate_json_schema_gives_the_served_answer(tiny, tiny_path, tmp_path, capsys):
    from engine import cli

    schema = tmp_path / "flag.json"
    schema.write_text(json.dumps(FLAG))
    assert cli.main(["generate", str(tiny_path), "--prompt", "the cat sat", "--json", "--max-tokens", "24",
                     "--json-schema", str(schema), "--kv", "full"]) == 0
    text = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]
    assert valid(json.loads(text), FLAG)
    served = client(tiny).completions.create(model="m", prompt="the cat sat", max_tokens=24, temperature=0,
                                             extra_body={"response_format": schema_format(FLAG)})
    assert served.choices[0].text == text
    schema.write_text("{not json")
    assert cli.main(["generate", str(tiny_path), "--prompt", "x", "--json-schema", str(schema)]) != 0
