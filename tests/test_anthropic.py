"""Anthropic's Messages API (`POST /v1/messages`) through the official `anthropic` SDK, against a real `deltaserve
serve` on the embedded demo model (fine-tuned to call get_weather and add: scripts/demo/corpus.py), its key sent as
the SDK sends it (`x-api-key`). The image message is in tests/test_vision.py (a vision checkpoint's server)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from deltaserve.demo import DEMO_FILE
from tests.server_proc import ServerProcess
from tests.test_tools_demo import C

KEY = "sk-anthropic-test"
GREEDY = {"temperature": 0}  # the SDK no longer has a temperature argument; the server reads the field
MODEL = DEMO_FILE.name
WEATHER = {"name": C.WEATHER_TOOL["function"]["name"], "description": C.WEATHER_TOOL["function"]["description"],
           "input_schema": C.WEATHER_TOOL["function"]["parameters"]}
ADD = {"name": C.ADD_TOOL["function"]["name"], "description": C.ADD_TOOL["function"]["description"],
       "input_schema": C.ADD_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(DEMO_FILE, "--slots", "1", "--api-key", KEY, "--ctx", "2048")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_a_message_is_answered_with_its_text_stop_reason_and_usage(client):
    m = client.messages.create(model=MODEL, max_tokens=32, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "What is 12 + 9?"}])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and "21" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 0 and m.usage.output_tokens > 0


def test_a_follow_up_prefills_only_its_new_messages(client):
    """The same slots and state store as chat completions: the conversation the slot holds is not prefilled again
    (cache_read_input_tokens), and the answer comes from the earlier turn."""
    messages = [{"role": "user", "content": "My locker code is 4821."}]
    first = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, system="Be brief.", messages=messages)
    messages += [{"role": "assistant", "content": first.content[0].text},
                 {"role": "user", "content": "What is my locker code?"}]
    second = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, system=[{"type": "text",
                                    "text": "Be brief."}], messages=messages)
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    first_total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    # the first prompt, but for its generation header (the checkpoint is taken before it), was not prefilled again
    assert second.usage.cache_read_input_tokens >= first_total - 8
    assert second.usage.input_tokens <= total - first_total + 8
    assert "4821" in second.content[0].text
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    assert counted.input_tokens == total


def test_the_stream_helper_gathers_the_text_and_the_events_come_in_anthropics_order(client):
    with client.messages.stream(model=MODEL, max_tokens=32, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "What is 12 + 9?"}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    whole = client.messages.create(model=MODEL, max_tokens=32, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "What is 12 + 9?"}])
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "end_turn"
    raw = [k for k in kinds if k not in ("text",)]  # the helper's own text events interleave
    assert raw[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_tool_round_trip_tool_use_then_tool_result_then_the_answer(client):
    messages = [{"role": "user", "content": "What's the weather in Lisbon?"}]
    m = client.messages.create(model=MODEL, max_tokens=96, extra_body=GREEDY, tools=[WEATHER, ADD], messages=messages)
    assert m.stop_reason == "tool_use", m
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Lisbon"} and use.id
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": C.weather_result("Lisbon", 27, "foggy")}]}]
    answer = client.messages.create(model=MODEL, max_tokens=96, extra_body=GREEDY, tools=[WEATHER, ADD],
                                    messages=messages)
    assert answer.stop_reason == "end_turn"
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert "27" in text and "foggy" in text
    assert answer.usage.cache_read_input_tokens > 0  # the call and its result extended what the slot held


def test_a_streamed_tool_call_arrives_as_input_json_deltas_and_a_forced_tool_is_called(client):
    with client.messages.stream(model=MODEL, max_tokens=96, extra_body=GREEDY, tools=[WEATHER, ADD],
                                messages=[{"role": "user", "content": "What is 2 plus 3?"}],
                                tool_choice={"type": "tool", "name": "add"}) as s:
        deltas = [e.partial_json for e in s if e.type == "input_json"]
        final = s.get_final_message()
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "add" and json.loads("".join(deltas)) == use.input
    assert set(use.input) == {"a", "b"} and final.stop_reason == "tool_use"


def test_thinking_on_and_off_renders_the_prompt_so_and_keeps_the_markup_out_of_the_text(client):
    """The demo model closes its thinking at once (its answer's reasoning is empty): the text is the answer alone.
    A thinking block streamed and whole, from a model that thinks: tests/test_api_gaps.py."""
    on = client.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY,
                                thinking={"type": "enabled", "budget_tokens": 1024},
                                messages=[{"role": "user", "content": "What is 12 + 9?"}])
    off = client.messages.create(model=MODEL, max_tokens=32, extra_body=GREEDY, thinking={"type": "disabled"},
                                 messages=[{"role": "user", "content": "What is 12 + 9?"}])
    assert [b.type for b in off.content] == ["text"] and "21" in off.content[0].text
    text = "".join(b.text for b in on.content if b.type == "text")
    assert "21" in text and "think>" not in text
    assert on.usage.output_tokens > off.usage.output_tokens  # the closing of the thinking is the answer's tokens


def test_max_tokens_and_stop_sequences_say_why_the_answer_ended(client):
    m = client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Reverse these words: red fox blue"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    whole = client.messages.create(model=MODEL, max_tokens=32, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Reverse these words: red fox blue"}])
    word = whole.content[0].text.split()[1]
    cut = client.messages.create(model=MODEL, max_tokens=32, extra_body=GREEDY, stop_sequences=["zzz", word],
                                 messages=[{"role": "user", "content": "Reverse these words: red fox blue"}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in cut.content[0].text


def test_errors_come_in_anthropics_shape_and_map_to_the_sdks_exceptions(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:  # a prompt longer than the context
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "word " * 3000}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("prompt is too long")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens")
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json={
        "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert r.status_code == 400 and "server tool" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json={
        "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]})
    assert r.status_code == 400 and "document" in r.json()["error"]["message"]
    assert "Traceback" not in server.stderr
