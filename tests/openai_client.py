"""The official `openai` Python client against a running kvfleet router.

Usage: python3 tests/openai_client.py http://127.0.0.1:PORT MODEL_ID
Exits non-zero (with a message) on the first thing that is not as an OpenAI client
expects. Run by tests/e2e_openai_client.rs.
"""
import sys
import time
import urllib.request

import openai
from openai import OpenAI


def main(url: str, model: str) -> None:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    models = client.models.list()
    assert [m.id for m in models.data] == [model], models

    system = "You are a helpful assistant. " * 60
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Say something."},
    ]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert first.object == "chat.completion", first
    assert first.choices[0].message.role == "assistant", first
    assert first.choices[0].finish_reason in ("stop", "length"), first
    assert first.usage.prompt_tokens > 300, first.usage
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= again.usage.prompt_tokens - 16, again.usage
    assert again.choices[0].message.content == first.choices[0].message.content

    # Streamed, with usage in the last chunk.
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, roles = "", None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert roles == ["assistant"], roles
    assert finish in ("stop", "length"), finish
    assert usage is not None and usage.completion_tokens >= 1, usage
    assert text == first.choices[0].message.content, (text, first.choices[0].message.content)

    # A tool-calling conversation: tools, an assistant tool call and its result.
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }]
    convo = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    ]
    tool_answer = client.chat.completions.create(
        model=model, messages=convo, tools=tools, max_tokens=6, temperature=0,
    )
    choice = tool_answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls"), choice
    assert tool_answer.usage.prompt_tokens > first.usage.prompt_tokens, tool_answer.usage
    # The conversation shares the system prompt: its blocks come from cache.
    assert tool_answer.usage.prompt_tokens_details.cached_tokens >= 300, tool_answer.usage

    # Errors surface as the client's typed exceptions.
    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=1)
    except Exception as e:  # openai.NotFoundError
        assert type(e).__name__ == "NotFoundError", repr(e)
    else:
        raise AssertionError("unknown model accepted")

    # Log-probabilities: 3 alternatives per token, sorted; greedy samples the top one.
    lp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens >= 1, (len(content), lp.usage)
    for entry in content:
        assert entry.logprob <= 0, entry
        assert len(entry.top_logprobs) == 3, entry
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True), entry
        assert entry.top_logprobs[0].token == entry.token, entry
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6, entry
        assert bytes(entry.bytes) == entry.token.encode(), entry
    assert "".join(e.token for e in content) == lp.choices[0].message.content, content
    # Streamed: every chunk carries its tokens' entries; together the same as above.
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
        stream=True,
    )
    streamed = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    try:
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=1, logprobs=True, top_logprobs=21,
        )
    except openai.BadRequestError as e:
        assert e.body.get("param") == "top_logprobs", e.body
    else:
        raise AssertionError("top_logprobs=21 accepted")
    legacy = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2,
    )
    lpc = legacy.choices[0].logprobs
    assert len(lpc.tokens) == len(lpc.token_logprobs) == len(lpc.top_logprobs) == legacy.usage.completion_tokens
    assert all(len(t) <= 2 for t in lpc.top_logprobs) and all(v <= 0 for v in lpc.token_logprobs), lpc

    # n=3: the prompt is computed once (the workers' computed-token counter rises by
    # about one prompt, not three) and seeded choices reproduce.
    def computed() -> float:
        last = None
        while True:  # the engine publishes its totals after each step: wait until still
            text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
            now = sum(float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith("kvfleet_worker_prompt_tokens_computed_total"))
            if now == last:
                return now
            last = now
            time.sleep(0.3)

    fresh = [{"role": "system", "content": "You answer in French. " * 50},
             {"role": "user", "content": "Name a colour."}]
    before = computed()
    three = client.chat.completions.create(
        model=model, messages=fresh, max_tokens=6, temperature=1.0, seed=7, n=3,
    )
    grew = computed() - before
    prompt = three.usage.prompt_tokens
    assert [c.index for c in three.choices] == [0, 1, 2], three
    assert prompt > 200 and prompt * 0.5 <= grew < prompt * 1.5, (prompt, grew)
    assert three.usage.completion_tokens >= 3, three.usage
    again = [client.chat.completions.create(
        model=model, messages=fresh, max_tokens=6, temperature=1.0, seed=7, n=3,
    ) for _ in range(2)]
    texts = [[c.message.content for c in r.choices] for r in again]
    assert texts[0] == texts[1], texts
    stream = client.chat.completions.create(
        model=model, messages=fresh, max_tokens=6, temperature=1.0, seed=7, n=3, stream=True,
        stream_options={"include_usage": True},
    )
    streamed, usage = ["", "", ""], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts[0], (streamed, texts[0])
    assert usage.prompt_tokens == prompt and usage.completion_tokens >= 3, usage
    legacy3 = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3, n=3, seed=1)
    assert [c.index for c in legacy3.choices] == [0, 1, 2], legacy3

    # An unknown parameter is a 400 naming it, as OpenAI answers; extensions are served.
    for create, kwargs in [
        (client.chat.completions.create, {"messages": messages}),
        (client.completions.create, {"prompt": "Once upon a time"}),
    ]:
        try:
            create(model=model, max_tokens=1, extra_body={"frobnicate": 1}, **kwargs)
        except openai.BadRequestError as e:
            assert "frobnicate" in str(e), repr(e)
            assert e.body.get("param") == "frobnicate", e.body
        else:
            raise AssertionError("unknown field accepted")
        create(model=model, max_tokens=1, extra_body={"top_k": 5, "cache_salt": "x"}, **kwargs)

    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length"), completion

    # A greeting ends at the model's end-of-turn token, which never shows in the content.
    hi = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=96, temperature=0,
    )
    assert hi.choices[0].finish_reason == "stop", hi
    assert "<|im_end|>" not in (hi.choices[0].message.content or ""), hi
    print("openai client: ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
