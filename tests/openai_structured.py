"""Structured outputs through the official `openai` Python client: response_format
json_schema (strict) and json_object, a schema llguidance rejects, and tool_choice
required / a named function, all served by constrained decoding.

Usage: python3 tests/openai_structured.py http://127.0.0.1:PORT MODEL_ID SAMPLES [--random-weights]
With --random-weights (a seeded model) only grammars whose every output is bounded are
asked for: such a model writes whatever the grammar allows, so an unbounded one (any
JSON object) could run to max_tokens. Run by tests/e2e_openai_client.rs.
"""
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
from openai import OpenAI

# Bounded: every string, number and array has a limit, so even random weights finish.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "maxItems": 3,
        },
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "member"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def main(url: str, model: str, samples: int, random_weights: bool) -> None:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    ask = [
        {"role": "system", "content": "You answer with JSON only."},
        {"role": "user", "content": "Describe a person who lives in a big city."},
    ]
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }

    def person(seed: int) -> str:
        r = client.chat.completions.create(
            model=model, messages=ask, response_format=fmt, temperature=1.0,
            seed=seed, max_tokens=400,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (seed, choice)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, PERSON)
        return choice.message.content

    with ThreadPoolExecutor(max_workers=16) as pool:
        outputs = list(pool.map(person, range(samples)))
    # Sampled, not one answer repeated: the seeds give different valid objects.
    assert len(set(outputs)) > samples // 4, outputs[:5]
    print(f"json_schema: {samples} sampled completions valid; e.g. {outputs[0]}")

    # Streamed: the deltas join to the same kind of valid object.
    stream = client.chat.completions.create(
        model=model, messages=ask, response_format=fmt, temperature=1.0, seed=7,
        max_tokens=400, stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)

    # The legacy completions endpoint takes response_format too.
    c = client.completions.create(
        model=model, prompt="A person as JSON:", max_tokens=400, temperature=1.0, seed=3,
        extra_body={"response_format": fmt},
    )
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)

    if not random_weights:
        # Any object: its keys and strings are unbounded, so the request says what it wants.
        cat = [
            {"role": "system", "content": "You answer with JSON only."},
            {"role": "user", "content": "Return a JSON object describing a cat with keys name and color."},
        ]
        for seed in range(5):
            r = client.chat.completions.create(
                model=model, messages=cat, response_format={"type": "json_object"},
                temperature=0.7, seed=seed, max_tokens=300,
            )
            assert r.choices[0].finish_reason == "stop", r
            value = json.loads(r.choices[0].message.content)
            assert isinstance(value, dict), value
        print("json_object: valid objects")

    # A schema llguidance rejects: 400 with its message, before any generation.
    bad = {"type": "json_schema", "json_schema": {
        "name": "bad", "strict": True,
        "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}},
    }}
    try:
        client.chat.completions.create(model=model, messages=ask, response_format=bad, max_tokens=5)
    except openai.BadRequestError as e:
        assert e.status_code == 400, e
        assert "strnig" in str(e), str(e)
        print(f"invalid schema: 400 {e.body.get('message') if isinstance(e.body, dict) else e}")
    else:
        raise AssertionError("a schema llguidance rejects was accepted")

    # tool_choice: required (any tool) and a named function.
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, names in [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ]:
        for seed in range(5):
            r = client.chat.completions.create(
                model=model, messages=weather, tools=[WEATHER, TIME], tool_choice=choice,
                temperature=1.0, seed=seed, max_tokens=200,
            )
            msg = r.choices[0]
            assert msg.finish_reason == "tool_calls", msg
            calls = msg.message.tool_calls
            assert calls and len(calls) == 1, msg
            call = calls[0].function
            assert call.name in names, call
            schema = (WEATHER if call.name == "get_weather" else TIME)["function"]["parameters"]
            jsonschema.validate(json.loads(call.arguments), schema)
    print("tool_choice: forced calls valid")
    print("openai structured: ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--random-weights" in sys.argv[4:])
