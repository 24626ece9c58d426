"""The embedded demo model uses its tools: through a real `deltaserve serve` and the official openai client.

The demo model was fine-tuned (scripts/demo/train.py --finetune) to call get_weather(city) and add(a, b) when they
are offered (scripts/demo/corpus.py: WEATHER_TOOL, ADD_TOOL) and to answer from the tool messages it gets back. The
weather it reports can only come from the tool message: the values here are ones it has never been told.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
import pytest

from deltaserve.demo import DEMO_FILE
from tests.server_proc import ServerProcess

DEMO_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "demo"
if str(DEMO_SCRIPTS) not in sys.path:
    sys.path.insert(0, str(DEMO_SCRIPTS))

import corpus as C  # noqa: E402

TOOLS = [C.WEATHER_TOOL, C.ADD_TOOL]
TRAINED_WITH_TOOLS = json.loads((DEMO_SCRIPTS / "training_log.json").read_text())["config"].get("tools_frac", 0) > 0
pytestmark = pytest.mark.skipif(
    not TRAINED_WITH_TOOLS, reason="the shipped demo model was not trained on tool dialogs (scripts/demo/"
    "training_log.json has no tools_frac): its tool round trip waits for that retrain; tests/test_tools.py shows the "
    "round trip on random weights with the call forced")


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(DEMO_FILE, "--slots", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, messages, **kw):
    kw.setdefault("tools", TOOLS)
    return client.chat.completions.create(model="demo-qwen35.gguf", messages=messages, max_tokens=96,
                                          temperature=0.0, **kw)


def streamed(client, messages, **kw):
    """(content, calls as {"id", "name", "arguments"}, finish_reason) assembled from the stream's deltas."""
    content, calls, finish = "", {}, None
    for ev in chat(client, messages, stream=True, **kw):
        if not ev.choices:
            continue
        d = ev.choices[0].delta
        finish = ev.choices[0].finish_reason or finish
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.function.name and tc.id and not tc.function.arguments  # the name comes first, alone
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


def test_the_demo_model_calls_get_weather_and_answers_from_the_tool_message(client):
    messages = [{"role": "user", "content": "What's the weather in Lisbon?"}]
    r = chat(client, messages)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Lisbon"}
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": C.weather_result("Lisbon", 27, "foggy")})
    r = chat(client, messages)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == "In Lisbon it is foggy and 27 degrees."


def test_the_same_round_trip_streamed(client):
    messages = [{"role": "user", "content": "How is the weather in Tokyo?"}]
    content, calls, finish = streamed(client, messages)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Tokyo"})]
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0]["id"], "type": "function", "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]})
    messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": C.weather_result("Tokyo", -3, "snowy")})
    content, calls, finish = streamed(client, messages)
    assert finish == "stop" and calls == []
    assert content == "In Tokyo it is snowy and -3 degrees."


def test_two_cities_are_two_tool_calls_in_one_answer_and_the_answer_uses_both_results(client):
    messages = [{"role": "user", "content": "What's the weather in Oslo and Rome?"}]
    r = chat(client, messages)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert calls[0].id != calls[1].id
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": C.weather_result("Oslo", 4, "rainy")})
    messages.append({"role": "tool", "tool_call_id": calls[1].id, "content": C.weather_result("Rome", 31, "sunny")})
    r = chat(client, messages)
    assert r.choices[0].message.content == "In Oslo it is rainy and 4 degrees. In Rome it is sunny and 31 degrees."


def test_the_demo_model_adds_with_the_add_tool_and_numbers_come_back_as_numbers(client):
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    r = chat(client, messages, tools=[C.ADD_TOOL])
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 7, "b": 5}
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "12"}]
    assert chat(client, messages, tools=[C.ADD_TOOL]).choices[0].message.content == "12."


def test_tool_choice_variants_on_the_demo_model(client):
    weather = [{"role": "user", "content": "What's the weather in Paris?"}]
    # none: no tools block, nothing parsed: the model answers as it does without tools (it has no weather)
    r = chat(client, weather, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == C.REFUSAL
    # auto with a message no tool answers: a plain answer
    r = chat(client, [{"role": "user", "content": "Reverse these words: red fox blue"}])
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == "blue fox red"
    assert r.choices[0].finish_reason == "stop"
    # required: a call, even where the model would answer itself
    r = chat(client, [{"role": "user", "content": "Hello!"}], tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    assert r.choices[0].message.tool_calls[0].function.name in ("get_weather", "add")
    # a named function: that one
    r = chat(client, weather, tool_choice={"type": "function", "function": {"name": "add"}})
    [call] = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(args) == {"a", "b"}
    assert all(isinstance(v, (int, float)) for v in args.values())
    # only get_weather offered: the add question is answered by the model itself
    r = chat(client, [{"role": "user", "content": "What is 3 + 4?"}], tools=[C.WEATHER_TOOL])
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == "7."


def test_the_python_api_round_trip_on_the_demo_model():
    import deltaserve

    session = deltaserve.load(DEMO_FILE).session(quiet=True)
    messages = [{"role": "user", "content": "Weather in Berlin?"}]
    turn = session.chat(messages, tools=TOOLS, max_tokens=96)
    assert turn.finish_reason == "tool_calls" and turn.text == ""
    assert [(c.name, c.args) for c in turn.tool_calls] == [("get_weather", {"city": "Berlin"})]
    messages += [{"role": "assistant", "content": "", "tool_calls": turn.tool_calls},
                 {"role": "tool", "content": C.weather_result("Berlin", 12, "windy")}]
    turn = session.chat(messages, tools=TOOLS, max_tokens=96)
    assert turn.text == "In Berlin it is windy and 12 degrees." and turn.tool_calls == []
    assert turn.reused > 0  # the resident session extended its state through the call and the tool message
