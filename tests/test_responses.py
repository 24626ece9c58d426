"""The Responses API (`POST /v1/responses`) on a real server and the embedded demo model, through the clients that
send it: the official openai client's `client.responses` (create, stream, parse, retrieve, input_items, delete),
pydantic-ai's `OpenAIResponsesModel` and LangChain's `use_responses_api=True`.

Its defining feature is `previous_response_id` on the state store: a follow-up sends only its new input, and the
server continues from the state it kept at the end of the previous answer, so only that input is prefilled
(`cached_tokens` is everything before), in a slot, from the store (more chains than slots), after a restart.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from deltaserve.demo import DEMO_FILE
from tests.server_proc import ServerProcess
from tests.test_tools_demo import TRAINED_WITH_TOOLS, C

MODEL = DEMO_FILE.name
needs_tools = pytest.mark.skipif(not TRAINED_WITH_TOOLS, reason="the shipped demo model was not trained on tools")
WEATHER = {"type": "function", **C.WEATHER_TOOL["function"]}  # the Responses API's flat function tool


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("responses-states")


@pytest.fixture(scope="module")
def server(state_dir):
    s = ServerProcess(DEMO_FILE, "--slots", "1", "--state-dir", str(state_dir))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, text, previous=None, **kw):
    kw.setdefault("max_output_tokens", 64)
    return client.responses.create(model=MODEL, input=text, previous_response_id=previous, temperature=0.0, **kw)


QUESTIONS = ["What is 12 + 9?", "And what is 3 + 4?", "Remember that my locker code is 4821.", "What is 7 + 8?",
             "Repeat the word apple.", "What is my locker code?"]


def test_a_chain_by_previous_response_id_prefills_only_each_new_input_with_more_chains_than_slots(client, server):
    chains = {"a": [], "b": []}  # two conversations, one slot: each turn finds its state in the store
    for q in QUESTIONS:
        for name, chain in chains.items():
            prev = chain[-1] if chain else None
            r = ask(client, q if name == "a" else q.replace("12", "2"), prev.id if prev else None)
            assert r.status == "completed" and r.output_text
            if prev is not None:  # everything before: the previous prompt and its whole answer
                assert r.usage.input_tokens_details.cached_tokens == prev.usage.input_tokens + prev.usage.output_tokens
                assert r.previous_response_id == prev.id
            chain.append(r)
    assert "4821" in chains["a"][-1].output_text
    assert sum(r.usage.input_tokens - r.usage.input_tokens_details.cached_tokens for r in chains["a"][1:]) < \
        sum(r.usage.input_tokens for r in chains["a"][1:]) / 3


def test_the_stream_sends_the_typed_events_and_ends_with_the_stored_response(client):
    with client.responses.stream(model=MODEL, input="What is 12 + 9?", temperature=0.0, max_output_tokens=32) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    whole = ask(client, "What is 12 + 9?", max_output_tokens=32)
    assert final.output_text == whole.output_text == client.responses.retrieve(final.id).output_text
    assert [i.type for i in final.output] == ["message"]


def test_parse_with_a_pydantic_model_is_constrained_by_text_format(client):
    class Report(BaseModel):
        conditions: Literal["sunny", "cloudy", "rainy", "snowy", "windy", "foggy", "stormy", "clear"]

    r = client.responses.parse(model=MODEL, input="How is the weather in Lima?", text_format=Report, temperature=0.0,
                               max_output_tokens=40)
    assert r.status == "completed" and isinstance(r.output_parsed, Report)
    assert set(json.loads(r.output_text)) == {"conditions"}


def test_retrieve_input_items_and_delete_a_stored_response_and_a_second_delete_is_a_404(client):
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Repeat the word pear."}],
                                instructions="Be brief.", temperature=0.0, max_output_tokens=16)
    assert client.responses.retrieve(r.id).id == r.id
    items = list(client.responses.input_items.list(r.id))
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", "Repeat the word pear.")]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "And again?", r.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"


@needs_tools
def test_a_function_call_round_trip_by_previous_response_id_sends_only_the_result(client):
    r = client.responses.create(model=MODEL, input="What's the weather in Oslo?", tools=[WEATHER], temperature=0.0,
                                max_output_tokens=96)
    calls = [i for i in r.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    result = {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": C.weather_result("Oslo", -3, "snowy")}
    r2 = client.responses.create(model=MODEL, input=[result], previous_response_id=r.id, tools=[WEATHER],
                                 temperature=0.0, max_output_tokens=96)
    assert "snowy" in r2.output_text and "Oslo" in r2.output_text
    assert r2.usage.input_tokens_details.cached_tokens == r.usage.input_tokens + r.usage.output_tokens


PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
BAD = [  # (body, status, param, code)
    ({"model": MODEL, "input": "hi", "previous_response_id": "resp_" + "0" * 32}, 400, "previous_response_id",
     "previous_response_not_found"),
    ({"model": MODEL, "input": [{"type": "computer_call_output", "call_id": "x"}]}, 400, "input[0].type",
     "unsupported_item"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     400, "input[0].content[0]", "unsupported_content"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}]},
     400, "input", None),  # the demo model has no vision encoder: said
    ({"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type", "unsupported_tool"),
    ({"model": MODEL, "input": "hi", "background": True}, 400, "background", "unsupported_parameter"),
    ({"model": MODEL, "input": "hi", "include": ["reasoning.encrypted_content"]}, 400, "include",
     "unsupported_parameter"),
    ({"model": MODEL, "input": "hi", "truncation": "auto"}, 400, "truncation", "unsupported_parameter"),
    ({"model": MODEL, "input": [{"type": "function_call", "name": "f"}]}, 400, "input[0].call_id", None),
    ({"model": MODEL, "input": 5}, 400, "input", None),
    ({"model": MODEL, "input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens", None),
    ({"model": "gpt-5", "input": "hi"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("body,status,param,code", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_request_gets_the_openai_error_object_naming_the_parameter(server, body, status, param, code):
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and (code is None or err["code"] == code)


def test_a_previous_response_of_another_model_is_refused_by_name(server, client, state_dir):
    from deltaserve.session import files

    r = ask(client, "What is 2 + 2?")
    path = state_dir / "responses" / f"{r.id}.json"
    record = json.loads(path.read_bytes().split(b"\n", 1)[1])
    record["id"] = other = "resp_" + "ab" * 16
    record["model_sha256"] = "0" * 64
    data = json.dumps(record).encode()
    key = files.directory_key(state_dir)  # another server's on the same directory signs with the directory's key
    mac = files.mac(key)
    mac.update(data)
    files.write_atomic(state_dir / "responses" / f"{other}.json", mac.hexdigest().encode() + b"\n" + data, key)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "And 3 + 3?", other)
    assert e.value.body["code"] == "model_mismatch" and e.value.body["param"] == "previous_response_id"


def test_a_follow_up_after_a_restart_continues_from_the_state_on_disk(tmp_path):
    with ServerProcess(DEMO_FILE, "--slots", "1", "--state-dir", str(tmp_path)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        first = ask(c, "Remember that my locker code is 4821.")
        second = ask(c, "What is 12 + 9?", first.id)
    with ServerProcess(DEMO_FILE, "--slots", "1", "--state-dir", str(tmp_path)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert c.responses.retrieve(second.id).output_text == second.output_text
        third = ask(c, "What is my locker code?", second.id)
    assert third.usage.input_tokens_details.cached_tokens == second.usage.input_tokens + second.usage.output_tokens
    assert "4821" in third.output_text


def test_a_follow_up_whose_state_was_evicted_prefills_everything_and_answers_the_same(tmp_path):
    # no RAM for saved states and no disk: another conversation in the one slot leaves nothing of the first
    with ServerProcess(DEMO_FILE, "--slots", "1", "--state-ram", "0") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        first = ask(c, "Remember that my locker code is 4821.")
        held = ask(c, "What is my locker code?", first.id)
        ask(c, "What is 12 + 9?")  # another conversation takes the slot
        again = ask(c, "What is my locker code?", first.id)
    assert held.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens
    assert again.usage.input_tokens_details.cached_tokens == 0 and again.usage.input_tokens == held.usage.input_tokens
    assert again.output_text == held.output_text


# -- agent libraries ---------------------------------------------------------------------------------------------

@needs_tools
def test_a_pydantic_ai_responses_agent_calls_its_tool_and_answers(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel, OpenAIResponsesModelSettings
    from pydantic_ai.providers.openai import OpenAIProvider

    from tests.test_clients import weather_tool

    calls: list[str] = []
    model = OpenAIResponsesModel(MODEL, provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    settings = OpenAIResponsesModelSettings(temperature=0.0, max_tokens=96, openai_previous_response_id="auto")
    result = Agent(model, tools=[weather_tool(calls)], model_settings=settings).run_sync("What's the weather in Oslo?")
    assert calls == ["Oslo"]
    assert "snowy" in result.output and "Oslo" in result.output


@needs_tools
def test_langchain_with_the_responses_api_runs_a_tool_round_trip_and_a_previous_response_chain(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=96,
                     use_responses_api=True)
    bound = llm.bind_tools([C.WEATHER_TOOL])
    messages = [HumanMessage("What's the weather in Rome?")]
    ai = bound.invoke(messages)
    assert [(t["name"], t["args"]) for t in ai.tool_calls] == [("get_weather", {"city": "Rome"})]
    messages += [ai, ToolMessage(C.weather_result("Rome", 20, "sunny"), tool_call_id=ai.tool_calls[0]["id"])]
    answer = bound.invoke(messages)
    assert "sunny" in answer.text and "Rome" in answer.text

    chained = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=64,
                         use_responses_api=True, use_previous_response_id=True)
    a = chained.invoke([HumanMessage("What is 2 + 3?")])
    b = chained.invoke([HumanMessage("What is 2 + 3?"), a, HumanMessage("And 4 + 4?")])
    assert "5" in a.text and "8" in b.text
    assert b.usage_metadata["input_token_details"]["cache_read"] == a.usage_metadata["total_tokens"]


# -- the stored responses' files ---------------------------------------------------------------------------------

def record(rid: str, n_tokens: int = 3):
    from deltaserve.session.responses import ResponseRecord

    return ResponseRecord(rid, 1, "ab" * 32, {"id": rid, "object": "response"}, [{"type": "message"}],
                          [{"role": "user", "content": "hi"}], "f" * 64, list(range(n_tokens)))


def test_stored_responses_come_back_after_a_restart_and_tampered_files_are_refused_with_a_notice(tmp_path):
    from deltaserve.session.responses import ResponseStore, new_id

    said: list[str] = []
    store = ResponseStore(budget=1 << 20, directory=tmp_path, say=said.append)
    ids = [new_id() for _ in range(3)]
    for rid in ids:
        store.put(record(rid, 5))
    assert not [p for p in (tmp_path / "responses").iterdir() if p.name.startswith(".tmp-")]
    first = (tmp_path / "responses" / f"{ids[1]}.json").read_bytes()
    (tmp_path / "responses" / f"{ids[1]}.json").write_bytes(first[:len(first) // 2])  # cut
    mac, body = (tmp_path / "responses" / f"{ids[2]}.json").read_bytes().split(b"\n", 1)
    other = json.loads(body)
    other["tokens"] = "not base64!"
    (tmp_path / "responses" / f"{ids[2]}.json").write_bytes(mac + b"\n" + json.dumps(other).encode())
    again = ResponseStore(budget=1 << 20, directory=tmp_path, say=said.append)
    assert again.get(ids[0]).tokens == [0, 1, 2, 3, 4] and again.get(ids[0]).messages == record(ids[0]).messages
    assert again.get(ids[1]) is None and again.get(ids[2]) is None
    assert len(said) == 2 and all("HMAC does not match" in line for line in said), said
    assert again.get("../../etc/passwd") is None and not again.delete("../x")


def test_stored_responses_stay_within_their_budget_the_oldest_leaving_first_and_said(tmp_path):
    from deltaserve.session.responses import ResponseStore, new_id

    said: list[str] = []
    size = len(record(new_id(), 100).to_json())
    store = ResponseStore(budget=3 * size, directory=tmp_path, say=said.append)
    ids = [new_id() for _ in range(5)]
    for rid in ids:
        store.put(record(rid, 100))
    assert [store.get(r) is not None for r in ids] == [False, False, True, True, True]
    assert store.used <= 3 * size and len(said) == 2 and ids[0] in said[0]
    assert sorted(p.name for p in (tmp_path / "responses").iterdir()) == sorted(f"{r}.json" for r in ids[2:])
