"""The client libraries users drive `deltaserve serve` with, used as their users use them: the official openai
client (its streaming helper, `parse`, `models.retrieve`), pydantic-ai agents and langchain-openai, against a real
server on the embedded demo model (fine-tuned to call get_weather and add: scripts/demo/corpus.py).

Each defect these clients found (issue 31) has its sentence here: a "\\n" content delta between two streamed calls
(pydantic-ai's run_stream ended on it; LangChain rebuilt the content as "\\n"), two or late system messages refused
by the template, response_format with tools refused, a call cut by max_tokens returned as markup, an overflow error
the clients' fallbacks did not recognise, no GET /v1/models/{id}, no system_fingerprint in the chunks, no refusal.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from deltaserve.demo import DEMO_FILE
from tests.test_tools_demo import C, client, pytestmark, server  # noqa: F401 - the demo server fixtures, shared

MODEL = DEMO_FILE.name
TWO_CITIES = "What's the weather in Oslo and Rome?"
CONDITIONS = Literal["sunny", "cloudy", "rainy", "snowy", "windy", "foggy", "stormy", "clear"]


class Report(BaseModel):
    conditions: CONDITIONS


def weather_tool(calls: list[str], temperature: int = -3, conditions: str = "snowy"):
    """get_weather for pydantic-ai, with the demo's own schema (the one it was fine-tuned on); it records the calls."""
    from pydantic_ai import Tool

    def get_weather(city: str) -> str:
        calls.append(city)
        return C.weather_result(city, temperature, conditions)

    w = C.WEATHER_TOOL["function"]
    return Tool.from_schema(get_weather, w["name"], w["description"], w["parameters"])


def agent(server, calls: list[str], **kw):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    return Agent(model, tools=[weather_tool(calls)], model_settings=ModelSettings(temperature=0.0, max_tokens=96), **kw)


# -- the openai client -------------------------------------------------------------------------------------------

def test_models_retrieve_finds_the_served_model_by_name_and_404s_another(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert "is not served here" in str(e.value)


def test_the_stream_helper_gathers_two_streamed_calls_with_no_content_between_them(client):
    with client.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": TWO_CITIES}],
                                        tools=[C.WEATHER_TOOL, C.ADD_TOOL], temperature=0.0, max_tokens=96) as s:
        contents = [e.delta for e in s if e.type == "content.delta" and e.delta]
        done = s.get_final_completion().choices[0]
    assert contents == []  # the "\n" between the calls was a content delta
    assert done.finish_reason == "tool_calls" and not done.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in done.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]


def test_parse_reads_a_json_schema_answer_into_the_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "How is the weather in Lima?"}],
                                      response_format=Report, temperature=0.0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Report)
    assert choice.message.refusal is None


def test_every_chunk_carries_the_system_fingerprint_and_messages_say_refusal_null(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 3 and all(c["system_fingerprint"].startswith("deltaserve-") for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    whole = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False, "stream_options": None},
                       timeout=60).json()
    assert whole["choices"][0]["message"]["refusal"] is None and whole["system_fingerprint"].startswith("deltaserve-")


def test_a_tool_call_cut_by_max_tokens_comes_back_without_markup_streamed_or_not(client):
    messages = [{"role": "user", "content": "How is the weather in Tokyo?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[C.WEATHER_TOOL], temperature=0.0,
                                       max_tokens=8)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert "<tool_call>" not in (choice.message.content or "") and "<function" not in (choice.message.content or "")
    pieces = [c.choices[0] for c in client.chat.completions.create(
        model=MODEL, messages=messages, tools=[C.WEATHER_TOOL], temperature=0.0, max_tokens=8, stream=True) if c.choices]
    assert "".join(p.delta.content or "" for p in pieces) == (choice.message.content or "")
    assert pieces[-1].finish_reason == "length" and not any(p.delta.tool_calls for p in pieces)


def test_several_and_late_system_messages_are_merged_into_one_leading_system_turn(client, server):
    import deltaserve

    messages = [{"role": "system", "content": "You are terse."}, {"role": "system", "content": "Answer in English."},
                {"role": "user", "content": "How is the weather in Tokyo?"},
                {"role": "developer", "content": "Use the tools."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[C.WEATHER_TOOL], temperature=0.0,
                                       max_tokens=64)
    assert r.choices[0].finish_reason == "tool_calls"
    text = deltaserve.load(DEMO_FILE).render_text(messages)
    assert text.count("<|im_start|>system") == 1
    assert text.index("You are terse.") < text.index("Answer in English.") < text.index("Use the tools.") \
        < text.index("<|im_start|>user")


def test_a_response_format_with_tools_lets_the_answer_be_a_call_or_json_of_the_schema(server):
    schema = Report.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "Report", "schema": schema, "strict": True}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "How is the weather in Tokyo?"}],
            "tools": [C.WEATHER_TOOL], "response_format": fmt, "temperature": 0.0, "max_tokens": 64}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    # with the tool's result the answer must be either another call or the schema's JSON: any JSON it writes validates
    call = message["tool_calls"][0]
    body["messages"] += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": C.weather_result("Tokyo", 4, "rainy")}]
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    if answer["message"].get("tool_calls"):
        assert answer["finish_reason"] == "tool_calls" and not answer["message"]["content"]
    else:
        assert answer["finish_reason"] == "stop"
        jsonschema.validate(json.loads(answer["message"]["content"]), schema)


def test_the_call_or_schema_grammar_takes_a_call_and_the_json_and_refuses_free_text():
    import deltaserve
    from deltaserve.session.turns import ask

    model = deltaserve.load(DEMO_FILE)
    tok = model.tokenizer
    turn = ask([{"role": "user", "content": "x"}], [C.WEATHER_TOOL],
               response_format={"type": "json_schema", "json_schema": {"schema": Report.model_json_schema()}})
    grammar = turn.grammar(tok, model.config.vocab_size, tok.stop_ids)
    assert "or json_schema" in grammar.description

    def takes(text: str) -> bool:
        c = grammar.constraint()
        return all(c.accept(t) for t in tok.encode(text))

    assert takes('<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>')
    assert takes('{"conditions": "rainy"}') or takes('{"conditions":"rainy"}')
    assert not takes("It is rainy in Lima.")
    assert not takes('{"conditions": "humid"}') and not takes('{"conditions":"humid"}')


# -- pydantic-ai ---------------------------------------------------------------------------------------------------

def test_a_pydantic_ai_agent_with_a_system_prompt_and_instructions_completes_a_tool_round_trip(server):
    """pydantic-ai sends system, system, user when an agent has both a system prompt and instructions."""
    calls: list[str] = []
    a = agent(server, calls, system_prompt="You are a helpful assistant.", instructions="Answer briefly.")
    r = a.run_sync("How is the weather in Tokyo?")
    assert calls == ["Tokyo"]
    assert r.output == C.weather_answer("Tokyo", -3, "snowy")


def test_a_pydantic_ai_streamed_run_with_two_calls_ends_on_the_answer_not_on_a_newline(server):
    calls: list[str] = []
    a = agent(server, calls, system_prompt="You are a helpful assistant.")

    async def run():
        async with a.run_stream(TWO_CITIES) as result:
            return await result.get_output()

    output = asyncio.run(run())
    # run_stream once ended on the "\n" between the calls and never ran them; pydantic-ai runs the two calls
    # concurrently, so the order they ran in is its scheduler's (a clean-clone run saw Rome first)
    assert sorted(calls) == ["Oslo", "Rome"]
    assert "Oslo" in output and "Rome" in output and output.strip() == output


# -- langchain-openai ----------------------------------------------------------------------------------------------

def test_langchain_reads_two_calls_streamed_and_not_and_knows_a_context_overflow(server):
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=96,
                     max_retries=0)
    tools = llm.bind_tools([C.WEATHER_TOOL, C.ADD_TOOL])
    whole = tools.invoke(TWO_CITIES)
    streamed = None
    for chunk in tools.stream(TWO_CITIES):
        streamed = chunk if streamed is None else streamed + chunk
    for m in (whole, streamed):
        assert m.content == ""  # LangChain rebuilt the streamed content as "\n"
        assert [(c["name"], c["args"]) for c in m.tool_calls] == [("get_weather", {"city": "Oslo"}),
                                                                  ("get_weather", {"city": "Rome"})]
    with pytest.raises(ContextOverflowError) as e:  # its fallbacks act on this class, found by the message's words
        llm.invoke("word " * 3000)
    assert "maximum context length is 2048 tokens" in str(e.value)


def test_a_langchain_agent_loop_with_a_system_message_completes_a_tool_round_trip_streamed_and_not(server):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=96,
                     max_retries=0).bind_tools([C.WEATHER_TOOL])
    for streamed in (False, True):
        messages = [SystemMessage("You are a helpful assistant."), SystemMessage("Use the tools you are given."),
                    HumanMessage("How is the weather in Tokyo?")]
        for _ in range(2):  # the call, then the answer from its result
            if streamed:
                reply = None
                for chunk in llm.stream(messages):
                    reply = chunk if reply is None else reply + chunk
            else:
                reply = llm.invoke(messages)
            messages.append(reply)
            for call in reply.tool_calls:
                assert call["name"] == "get_weather" and call["args"] == {"city": "Tokyo"}
                messages.append(ToolMessage(C.weather_result("Tokyo", 12, "windy"), tool_call_id=call["id"]))
        assert not reply.tool_calls and reply.content == C.weather_answer("Tokyo", 12, "windy"), streamed
