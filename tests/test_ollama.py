"""Ollama's API through the official `ollama` Python client, against a real `deltaserve serve` on the embedded demo
model (its key sent as a bearer header, as the client lets front ends send one)."""

from __future__ import annotations

import httpx
import ollama
import pytest

from deltaserve.demo import DEMO_FILE
from tests.server_proc import ServerProcess
from tests.test_tools_demo import C

KEY = "sk-ollama-test"
MODEL = DEMO_FILE.name


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(DEMO_FILE, "--slots", "1", "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_tags_and_show_describe_the_served_model(client):
    [m] = client.list().models
    assert m.model == MODEL and m.size > 0 and m.details.format == "gguf"
    shown = client.show(MODEL)
    assert shown.modelinfo["qwen35.context_length"] > 0 and "tools" in shown.capabilities
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3.2")
    assert e.value.status_code == 404 and "not found" in e.value.error


def test_chat_streamed_and_not_give_the_same_answer_and_a_follow_up_prefills_only_its_new_turn(server, client):
    messages = [{"role": "user", "content": "My locker code is 4821."}]
    whole = client.chat(model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 16})
    parts = list(client.chat(model=MODEL, messages=messages, stream=True, options={"temperature": 0,
                                                                                   "num_predict": 16}))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].done_reason == whole.done_reason and parts[-1].eval_count == whole.eval_count
    messages += [{"role": "assistant", "content": whole.message.content},
                 {"role": "user", "content": "What is my locker code?"}]
    second = client.chat(model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 16})
    assert "4821" in second.message.content
    total = httpx.post(server.url + "/v1/messages/count_tokens", headers={"x-api-key": KEY},
                       json={"messages": messages}).json()["input_tokens"]  # the same template, the whole prompt
    assert second.prompt_eval_count <= total - whole.prompt_eval_count + 8  # the earlier turn was not prefilled again


def test_a_tool_round_trip_and_generate(client):
    messages = [{"role": "user", "content": "What's the weather in Lisbon?"}]
    r = client.chat(model=MODEL, messages=messages, tools=[C.WEATHER_TOOL, C.ADD_TOOL], options={"temperature": 0})
    [call] = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Lisbon"}
    messages += [r.message.model_dump(exclude_none=True),
                 {"role": "tool", "content": C.weather_result("Lisbon", 27, "foggy"), "tool_name": "get_weather"}]
    answer = client.chat(model=MODEL, messages=messages, tools=[C.WEATHER_TOOL, C.ADD_TOOL], options={"temperature": 0})
    assert "27" in answer.message.content and "foggy" in answer.message.content
    g = client.generate(model=MODEL, prompt="What is 12 + 9?", options={"temperature": 0, "num_predict": 8})
    assert "21" in g.response and g.done_reason in ("stop", "length")
    cut = client.generate(model=MODEL, prompt="Reverse these words: red fox blue", options={"num_predict": 2})
    assert cut.done_reason == "length" and cut.eval_count == 2
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="x", suffix="y")
    assert e.value.status_code == 400 and "suffix" in e.value.error
