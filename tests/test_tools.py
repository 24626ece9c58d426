"""Tool calls through a real `deltaserve serve` process and the official openai client, on the random-weight fixture.

Random weights call nothing on their own, so what is shown here is what holds whatever the weights: tool_choice
"required" and a named function are enforced by xgrammar's structural tag for the Qwen3.5 format (every answer is a
call of an offered function whose arguments validate against its schema), parallel_tool_calls false gives one call,
"none" renders no tools and parses nothing, the conversation's calls and tool messages are rendered by the template,
and bad tools are 400s. The demo model's own tool use (it was trained to call get_weather and add) is in
tests/test_tools_demo.py. The schemas bound their values (strings a maxLength, integers a range, enums), so a
random model's call closes well inside max_tokens.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server_proc import ServerProcess

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {
        "word": {"type": "string", "maxLength": 12},
        "lang": {"enum": ["en", "fr", "de"]},
        "limit": {"type": "integer", "minimum": 1, "maximum": 20},
        "exact": {"type": "boolean"}},
        "required": ["word", "lang", "limit", "exact"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a table.",
    "parameters": {"type": "object", "properties": {
        "people": {"type": "integer", "minimum": 1, "maximum": 12},
        "time": {"type": "string", "maxLength": 5},
        "tags": {"type": "array", "items": {"enum": ["window", "quiet"]}, "maxItems": 2}},
        "required": ["people", "time", "tags"], "additionalProperties": False}}}
TOOLS = [LOOKUP, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "2", "--queue", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def assert_valid_calls(calls, names=None):
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in (names or SCHEMAS), c.function.name
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def ask(client, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Use a tool."}])
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model="model-f32", tools=TOOLS, **kw)


def test_with_tool_choice_required_twenty_answers_are_all_valid_calls_of_offered_functions(client):
    # one call per answer (parallel_tool_calls false): on the fixture's small vocabulary a random call takes 150-180
    # tokens, so each answer is exactly one call, closed well inside max_tokens
    names = set()
    for i in range(20):
        r = ask(client, tool_choice="required", parallel_tool_calls=False, temperature=0.0 if i < 2 else 1.0, seed=i,
                max_tokens=300)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (i, choice.finish_reason, choice.message)
        assert_valid_calls(choice.message.tool_calls)
        assert len(choice.message.tool_calls) == 1 and choice.message.content is None
        names |= {c.function.name for c in choice.message.tool_calls}
        assert r.usage.completion_tokens <= 300
    assert names == set(SCHEMAS)  # both functions were called: the grammar offers both


def test_with_parallel_calls_allowed_required_answers_are_calls_only_and_may_be_several(client):
    counts = []
    for seed in range(2, 6):
        r = ask(client, tool_choice="required", temperature=1.0, seed=seed, max_tokens=700)
        choice = r.choices[0]
        assert_valid_calls(choice.message.tool_calls)
        if choice.finish_reason == "length":  # a last call cut by max_tokens is not a call: it is left as text
            assert choice.message.content.startswith("<tool_call>")
        else:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
        counts.append(len(choice.message.tool_calls))
    assert max(counts) >= 2, counts


def test_a_named_tool_choice_always_calls_that_function(client):
    for seed in range(4):
        r = ask(client, tool_choice={"type": "function", "function": {"name": "book_table"}}, temperature=1.0,
                seed=seed, max_tokens=300)
        assert r.choices[0].finish_reason == "tool_calls"
        assert_valid_calls(r.choices[0].message.tool_calls, {"book_table"})


def test_parallel_tool_calls_false_gives_exactly_one_call(client):
    for seed in range(3):
        r = ask(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=100 + seed,
                max_tokens=300)
        calls = r.choices[0].message.tool_calls
        assert_valid_calls(calls)
        assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_renders_no_tools_and_returns_content(client):
    auto = ask(client, tool_choice="auto", max_tokens=8, temperature=0.0)
    none = ask(client, tool_choice="none", max_tokens=8, temperature=0.0)
    assert none.choices[0].message.tool_calls is None
    assert isinstance(none.choices[0].message.content, str)
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens  # the <tools> block was left out


def test_auto_on_random_weights_is_never_an_error_and_any_call_is_a_valid_one(client):
    for seed in range(6):
        r = ask(client, tool_choice="auto", temperature=1.0, seed=seed, max_tokens=60)
        choice = r.choices[0]
        if choice.message.tool_calls:
            assert_valid_calls(choice.message.tool_calls)
            assert choice.finish_reason == "tool_calls"
        else:
            assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)


def test_a_streamed_call_sends_its_name_first_and_its_arguments_after(client):
    stream = ask(client, tool_choice="required", temperature=1.0, seed=11, stream=True, max_tokens=700)
    calls: dict[int, dict] = {}
    order = []
    finish = None
    for ev in stream:
        if not ev.choices:
            continue
        d = ev.choices[0].delta
        finish = ev.choices[0].finish_reason or finish
        for tc in d.tool_calls or []:
            if tc.index not in calls:  # a call's first delta: its id and name, no arguments yet
                assert tc.id and tc.id.startswith("call_") and tc.function.name in SCHEMAS
                assert not tc.function.arguments
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                order.append("name")
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
                order.append("arguments")
        assert not (d.content or "").count("<tool_call>")
    assert finish == "tool_calls" and calls and order[0] == "name" and "arguments" in order
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_a_tool_round_trip_renders_the_call_and_the_tool_message_and_answers(client, server, hybrid_model):
    messages = [{"role": "user", "content": "Book a table for four at eight."}]
    first = ask(client, messages=messages, tool_choice={"type": "function", "function": {"name": "book_table"}},
                temperature=0.0)
    call = first.choices[0].message.tool_calls[0]
    assert_valid_calls([call], {"book_table"})
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"booked": true, "table": 17}'})
    second = ask(client, messages=messages, max_tokens=16, temperature=0.0)  # auto: random weights write text
    assert second.choices[0].finish_reason in ("stop", "length")
    assert isinstance(second.choices[0].message.content, str) and second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    # what the server rendered: the call as the model writes one, then the result as a tool response
    text = hybrid_model.render_text(messages, enable_thinking=False, tools=TOOLS)
    args = json.loads(call.function.arguments)
    block = "<tool_call>\n<function=book_table>\n" + "".join(
        f"<parameter={k}>\n{json.dumps(v) if isinstance(v, list) else v}\n</parameter>\n" for k, v in args.items())
    assert block + "</function>\n</tool_call><|im_end|>" in text
    assert '<|im_start|>user\n<tool_response>\n{"booked": true, "table": 17}\n</tool_response><|im_end|>' in text


def test_the_round_trip_streamed_a_required_call_then_an_answer_after_the_tool_message(client):
    messages = [{"role": "user", "content": "Look up a word."}]
    calls, content, finish = {}, "", None
    for ev in ask(client, messages=messages, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=5,
                  max_tokens=300, stream=True):
        if ev.choices:
            finish = ev.choices[0].finish_reason or finish
            content += ev.choices[0].delta.content or ""
            for tc in ev.choices[0].delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                c["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    call = calls[0]
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]})
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "found: 3 meanings"})
    text, finish, usage = "", None, None
    for ev in ask(client, messages=messages, max_tokens=12, temperature=0.0, stream=True,
                  stream_options={"include_usage": True}):
        if ev.usage:
            usage = ev.usage
        if ev.choices:
            finish = ev.choices[0].finish_reason or finish
            text += ev.choices[0].delta.content or ""
            assert not ev.choices[0].delta.tool_calls  # random weights write text here, and it streams as content
    assert finish in ("stop", "length") and isinstance(text, str) and usage.completion_tokens >= 1


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": "lookup"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),  # a lonely tool_choice is refused by name, as OpenAI does
    ({"functions": [{"name": "lookup", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"best_of": 2}, "best_of"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/definitions/missing"}}}}}], "tool_choice": "required"},
     "tools"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": "not json"}}]}]}, "messages"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_tools_are_400s_naming_the_parameter(server, body, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_tools_on_the_completions_endpoint_are_refused_with_a_400(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and "chat/completions" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_python_api_chat_returns_parsed_tool_calls_on_the_turn(hybrid_model):
    session = hybrid_model.session(quiet=True)
    for seed in range(3):
        turn = session.chat([{"role": "user", "content": "Look it up"}], tools=TOOLS, tool_choice="required",
                            parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=seed)
        assert turn.finish_reason == "tool_calls" and turn.tool_calls
        for c in turn.tool_calls:
            jsonschema.validate(c.args, SCHEMAS[c.name])
    turn = session.chat([{"role": "user", "content": "x"}], tools=TOOLS, max_tokens=4, tool_choice="none")
    assert turn.tool_calls == [] and turn.finish_reason in ("stop", "length")
    # a turn's ToolCalls go back into the conversation as they are
    calls = session.chat([{"role": "user", "content": "y"}], tools=TOOLS, max_tokens=300,
                         tool_choice={"type": "function", "function": {"name": "lookup"}}).tool_calls
    msgs = [{"role": "user", "content": "y"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "found"}]
    assert "<tool_response>\nfound\n</tool_response>" in hybrid_model.render_text(msgs, False, tools=TOOLS)
    session.chat(msgs, tools=TOOLS, max_tokens=4)
