"""The official `anthropic` Python client against a running kvfleet router.

Usage: python3 tests/anthropic_client.py http://127.0.0.1:PORT MODEL_ID
Exits non-zero (with a message) on the first thing that is not as an Anthropic client
expects. Run by tests/e2e_anthropic_client.rs.
"""
import sys

import anthropic

BLOCK = 16  # kvfleet's KV block size: only whole blocks are cached.
# Recent SDKs dropped `temperature` from create()'s signature; the API still takes it.
GREEDY = {"temperature": 0}


def main(url: str, model: str) -> None:
    # The SDK sends x-api-key and anthropic-version on every request.
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)

    system_text = "You are a helpful assistant who answers in one short sentence. " * 40
    system = [{"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}}]

    def ask(question: str, **kw):
        return client.messages.create(
            model=model, max_tokens=6, system=system,
            messages=[{"role": "user", "content": question}], extra_body=GREEDY, **kw,
        )

    first = ask("Say something.")
    assert first.type == "message" and first.role == "assistant", first
    assert first.id.startswith("msg_"), first
    assert first.content and first.content[0].type == "text", first
    assert first.stop_reason in ("end_turn", "max_tokens"), first
    u1 = first.usage
    # Cold: the cached system block is written (whole blocks), nothing is read.
    assert u1.cache_read_input_tokens == 0, u1
    assert u1.cache_creation_input_tokens > 300, u1
    assert u1.cache_creation_input_tokens % BLOCK == 0, u1
    assert 0 < u1.input_tokens < 64, u1

    # A new question after the same cached system block reads exactly the blocks the
    # first call wrote: the cached prefix's full blocks.
    second = ask("Say something else.")
    u2 = second.usage
    assert u2.cache_read_input_tokens > 0, u2
    assert u2.cache_read_input_tokens == u1.cache_creation_input_tokens, (u1, u2)
    assert u2.cache_creation_input_tokens == 0, u2

    # Streamed: the SDK assembles the final message from Anthropic's events.
    with client.messages.stream(
        model=model, max_tokens=6, system=system,
        messages=[{"role": "user", "content": "Say something."}], extra_body=GREEDY,
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].type == "text", final
    assert final.content[0].text == streamed, (final, streamed)
    assert streamed == first.content[0].text, (streamed, first.content[0].text)
    assert final.stop_reason in ("end_turn", "max_tokens"), final
    assert final.usage.output_tokens >= 1, final.usage
    assert final.usage.cache_read_input_tokens == u1.cache_creation_input_tokens, final.usage

    # A tool-use round trip: the assistant's tool_use goes back in with its tool_result.
    tools = [{
        "name": "get_weather",
        "description": "Current weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    out = client.messages.create(
        model=model, max_tokens=24, system=system, tools=tools,
        messages=[question], extra_body=GREEDY,
    )
    assert out.stop_reason in ("end_turn", "max_tokens", "tool_use"), out
    uses = [b for b in out.content if b.type == "tool_use"]
    if out.stop_reason == "tool_use":
        assert uses and isinstance(uses[0].input, dict), out
        call = uses[0]
    else:
        # A 135M model rarely calls the tool: send back the call it should have made.
        assert not uses, out
        call = anthropic.types.ToolUseBlock(
            type="tool_use", id="toolu_1", name="get_weather", input={"city": "Paris"})
    back = client.messages.create(
        model=model, max_tokens=12, system=system, tools=tools, extra_body=GREEDY,
        messages=[
            question,
            {"role": "assistant", "content": [call.model_dump()]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "18C and sunny"}]},
        ],
    )
    assert back.type == "message" and back.content, back
    assert back.usage.input_tokens + back.usage.cache_read_input_tokens \
        + back.usage.cache_creation_input_tokens > out.usage.input_tokens, back.usage

    # Unknown fields and bad breakpoints are 400s the SDK raises as BadRequestError.
    def bad_request(needle: str, **kw) -> None:
        try:
            client.messages.create(model=model, max_tokens=4, **kw)
        except anthropic.BadRequestError as e:
            assert e.status_code == 400, e
            assert e.body["type"] == "error", e.body
            assert e.body["error"]["type"] == "invalid_request_error", e.body
            assert needle in e.body["error"]["message"], (needle, e.body)
        else:
            raise AssertionError(f"no 400 for {kw}")

    hi = [{"role": "user", "content": "hi"}]
    bad_request("frobnicate", messages=hi, extra_body={"frobnicate": 1})
    five = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}}
            for i in range(5)]
    bad_request("at most 4", messages=hi, system=five)
    bad_request("ttl", messages=hi, system=[
        {"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "2h"}}])
    bad_request("tool_result", messages=[{"role": "user", "content": [{
        "type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "r", "cache_control": {"type": "ephemeral"}}]}]}])
    try:
        client.messages.create(model="no-such-model", max_tokens=4, messages=hi)
    except anthropic.NotFoundError as e:
        assert e.body["error"]["type"] == "not_found_error", e.body
    else:
        raise AssertionError("no 404 for an unknown model")

    # Top-level cache_control (the SDK's automatic caching) marks the last block: the
    # same conversation again reads it all back.
    convo = [{"role": "user", "content": system_text + " And one more thing?"}]
    auto1 = client.messages.create(model=model, max_tokens=2, messages=convo,
                                   cache_control={"type": "ephemeral"}, extra_body=GREEDY)
    auto2 = client.messages.create(model=model, max_tokens=2, messages=convo,
                                   cache_control={"type": "ephemeral"}, extra_body=GREEDY)
    assert auto1.usage.cache_creation_input_tokens > 300, auto1.usage
    assert auto2.usage.cache_read_input_tokens == auto1.usage.cache_creation_input_tokens, \
        (auto1.usage, auto2.usage)

    # Breakpoints pin: the cached system block stays on the worker that computed it for
    # its ttl (5m), never evicted, while enough other traffic to evict everything
    # unpinned from both workers' pools (sized small by the test) goes by.
    def pinned_ask(question: str, policy: str):
        raw = client.messages.with_raw_response.create(
            model=model, max_tokens=2, system=system, extra_body=GREEDY,
            messages=[{"role": "user", "content": question}],
            extra_headers={"x-kvfleet-policy": policy},
        )
        return raw.headers.get("x-kvfleet-worker"), raw.headers.get("x-kvfleet-pin", ""), raw.parse()

    pinner, pin, _ = pinned_ask("Pin check.", "cache-aware")
    assert pin.startswith("pinned; "), pin
    pinned_tokens = int(pin.split("tokens=")[1].split(";")[0])
    assert pinned_tokens == u1.cache_creation_input_tokens, (pin, u1)
    # Its own system text, so that it shares no block with the traffic below (whose
    # prompts start with the chat template's default system prompt).
    unpinned = [{"role": "user", "content": "Describe the sea in winter, please. " * 30}]

    def unpinned_read() -> int:
        r = client.messages.create(model=model, max_tokens=1, messages=unpinned,
                                   system="Unpinned: an old sailor's notes.", extra_body=GREEDY)
        return r.usage.cache_read_input_tokens

    unpinned_read()
    assert unpinned_read() > 0, "an unpinned prompt is cached until evicted"
    for i in range(16):
        client.messages.create(
            model=model, max_tokens=1, extra_body=GREEDY,
            messages=[{"role": "user", "content": f"Traffic {i}: " + f"word{i} and more " * 80}],
            extra_headers={"x-kvfleet-policy": "round-robin"},
        )
    assert unpinned_read() == 0, "the traffic evicted the unpinned prefix"
    for q in ("After the traffic.", "Once more."):
        worker, pin, after = pinned_ask(q, "round-robin")
        assert worker == pinner, (worker, pinner)
        assert after.usage.cache_read_input_tokens == pinned_tokens, (after.usage, pin)
        assert pin.startswith("pinned; "), pin

    print(f"cache: first {u1}, second {u2}")
    print(f"pin: {pinned_tokens} tokens pinned on {pinner}, read back after the traffic")
    print("anthropic client: ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
