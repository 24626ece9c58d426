"""The tool-call parser (text/toolcalls.py) over well-formed, malformed and adversarial model output.

What must hold for any text: parsing never raises, every call that comes back names an offered function with
arguments that are a JSON object of declared parameters typed by the schema, and whatever is not a call is
content, as written. Streaming (any split of the text into pieces) gives the same content and calls."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from deltaserve.text.toolcalls import (CallArguments, CallStart, Content, ToolCallParser, ToolError,
                                       normalize_tool_choice, normalize_tools, parse, template_messages)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                                  "required": ["a", "b"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
        "limit": {"type": ["integer", "null"]}}, "required": ["query"]}}}
TOOLS = normalize_tools([WEATHER, ADD, SEARCH])
SCHEMAS = {t.name: t.parameters for t in TOOLS}


def call(name, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def check_invariants(text: str):
    content, calls = parse(text, TOOLS)
    for c in calls:
        assert c.name in SCHEMAS, c
        args = json.loads(c.arguments)
        assert isinstance(args, dict)
        props = SCHEMAS[c.name]["properties"]
        assert set(args) <= set(props), (c, props)
        jsonschema.validate(args, {**SCHEMAS[c.name], "required": []})
        assert c.id.startswith("call_")
    return content, calls


def test_a_call_in_the_qwen35_format_comes_back_as_an_openai_call_typed_by_its_schema():
    content, calls = check_invariants(call("get_weather", city="Paris", days="3", metric="True"))
    assert content is None and len(calls) == 1
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3, "metric": True}
    o = calls[0].openai()
    assert o["type"] == "function" and o["function"]["name"] == "get_weather" and isinstance(o["function"]["arguments"], str)


def test_numbers_objects_arrays_and_null_are_read_from_their_text_and_strings_are_kept_as_written():
    content, calls = check_invariants(call("search", query="  two  words\nand a line ", filters='{"year": 2024}',
                                           tags='["a", "b"]', limit="null") + call("add", a="1.5", b="-2"))
    assert [c.name for c in calls] == ["search", "add"]
    assert calls[0].args == {"query": "  two  words\nand a line ", "filters": {"year": 2024}, "tags": ["a", "b"],
                             "limit": None}
    assert calls[1].args == {"a": 1.5, "b": -2}
    _, calls = check_invariants(call("search", query="42", limit="7"))
    assert calls[0].args == {"query": "42", "limit": 7}  # a string parameter keeps "42" a string


def test_reasoning_or_text_before_calls_is_content_and_several_calls_come_back_in_order():
    text = "Let me look both up.\n\n" + call("get_weather", city="Oslo") + "\n" + call("get_weather", city="Rome")
    content, calls = check_invariants(text)
    assert content == "Let me look both up."
    assert [c.args["city"] for c in calls] == ["Oslo", "Rome"]
    assert len({c.id for c in calls}) == 2


def test_parallel_tool_calls_false_gives_at_most_one_call():
    text = call("get_weather", city="Oslo") + "\n" + call("get_weather", city="Rome")
    content, calls = parse(text, TOOLS, parallel=False)
    assert [c.args["city"] for c in calls] == ["Oslo"]
    assert "Rome" in content  # the second block was not a call


MALFORMED = {
    "unclosed tool_call": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
    "unclosed parameter": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
    "no function": "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
    "unknown function": call("delete_everything", path="/"),
    "function name with spaces": call("get weather", city="Paris"),
    "parameter not in the schema": call("get_weather", city="Paris", unit="C"),
    "parameter given twice": call("get_weather", city="Paris").replace(
        "</parameter>\n", "</parameter>\n<parameter=city>\nRome\n</parameter>\n", 1),
    "integer that is not one": call("get_weather", city="Paris", days="three"),
    "boolean that is not one": call("get_weather", city="Paris", metric="maybe"),
    "number that overflows": call("add", a="1e999", b="1"),
    "NaN": call("add", a="NaN", b="1"),
    "object that is not JSON": call("search", query="q", filters="{year: 2024"),
    "array given an object": call("search", query="q", tags='{"a": 1}'),
    "text between parameters": call("get_weather", city="Paris", days="2").replace(
        "</parameter>\n<parameter=days>", "</parameter>\nhello\n<parameter=days>"),
    "text after the function": call("get_weather", city="Paris").replace("</function>", "</function> trailing"),
    "only the closing tag": "All done.</tool_call>",
    "empty": "",
    "tags as prose": "I could use a <tool_call> here, but I will not.",
    "nested tool_call": "<tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n"
                        "</function>\n</tool_call>\n</tool_call>",
    "deep JSON": call("search", query="q", filters="[" * 5000 + "]" * 5000),
    "huge name": call("f" * 10_000, x="1"),
    "control characters": call("get_weather", city="Pa\x00ris\x1b[31m"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_and_adversarial_text_never_raises_and_never_yields_a_call_that_was_not_offered(name):
    text = MALFORMED[name]
    content, calls = check_invariants(text)
    if name == "control characters":  # odd characters in a string are still a string
        assert calls and calls[0].args["city"] == "Pa\x00ris\x1b[31m"
        json.loads(calls[0].arguments)
        return
    assert calls == [], (name, calls)
    assert (content or "") == text  # nothing lost, nothing added


def test_a_tool_call_inside_a_fenced_code_block_stays_content():
    text = "Here is how a call looks:\n```\n" + call("get_weather", city="Paris") + "\n```\nThat is all."
    content, calls = check_invariants(text)
    assert calls == [] and content == text
    # after the fence closes, a real call is a call
    content, calls = check_invariants(text + "\n" + call("add", a="1", b="2"))
    assert [c.name for c in calls] == ["add"] and "```" in content


def test_random_garbage_around_markup_never_raises_and_only_yields_offered_calls():
    rng = random.Random(5)
    pieces = ["<tool_call>", "</tool_call>", "<function=", "get_weather", "add", "nope", ">", "\n", "<parameter=",
              "city", "a", "b", "days", "</parameter>", "</function>", "Paris", "3", "x", "```", "{", "}", " ", "\"",
              "<", "/", "="]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        check_invariants(text)
    # and valid calls spliced into garbage are still found
    for _ in range(200):
        junk = "".join(rng.choice(pieces[5:]) for _ in range(rng.randint(0, 10))).replace("```", "")
        content, calls = check_invariants(junk + call("add", a="2", b="3"))
        assert any(c.name == "add" and c.args == {"a": 2, "b": 3} for c in calls), junk


def test_streaming_in_any_pieces_gives_what_parsing_the_whole_text_gives():
    text = "Thinking aloud.\n\n" + call("get_weather", city="Lima") + "\n" + call("add", a="4", b="5") + " tail <tool"
    whole_content, whole_calls = parse(text, TOOLS)
    rng = random.Random(1)
    for _ in range(50):
        p = ToolCallParser(TOOLS)
        events = []
        i = 0
        while i < len(text):
            n = rng.randint(1, 7)
            events += p.push(text[i:i + n])
            i += n
        events += p.finish()
        content = "".join(e.text for e in events if isinstance(e, Content))
        starts = [e for e in events if isinstance(e, CallStart)]
        args = {}
        for e in events:
            if isinstance(e, CallArguments):
                args[e.index] = args.get(e.index, "") + e.text
        assert [s.name for s in starts] == [c.name for c in whole_calls]
        assert [args[s.index] for s in starts] == [c.arguments for c in whole_calls]
        assert content == (whole_content or "")  # exactly: whitespace by a call is markup in both
        # no content piece ever shows part of a call's markup
        assert "<function=" not in content and "<tool" not in content.replace("tail <tool", "")


def test_text_that_may_begin_a_call_is_held_back_until_it_is_known_not_to():
    p = ToolCallParser(TOOLS)
    # (the space too: whitespace waits for what follows it, content or a call)
    assert [e.text for e in p.push("Hello <tool") if isinstance(e, Content)] == ["Hello"]
    assert [e.text for e in p.push("box>") if isinstance(e, Content)] == [" <toolbox>"]
    events = p.push("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>")
    assert events == []  # inside a call: nothing until it closes
    events = p.push("\n</function>\n</tool_call>")
    assert isinstance(events[0], CallStart) and events[0].name == "add"
    assert isinstance(events[1], CallArguments) and json.loads(events[1].text) == {"a": 1, "b": 2}


def test_tools_and_tool_choice_are_checked_with_messages_that_name_the_problem():
    with pytest.raises(ToolError, match="tools\\[0\\].function.name"):
        normalize_tools([{"type": "function", "function": {"name": "bad name"}}])
    with pytest.raises(ToolError, match="offered twice"):
        normalize_tools([WEATHER, WEATHER])
    with pytest.raises(ToolError, match="type 'object'"):
        normalize_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    with pytest.raises(ToolError, match="does not offer"):
        normalize_tool_choice({"type": "function", "function": {"name": "nope"}}, TOOLS)
    with pytest.raises(ToolError, match="needs tools"):
        normalize_tool_choice("required", ())
    assert normalize_tool_choice(None, TOOLS).mode == "auto" and normalize_tool_choice(None, ()).mode == "none"
    named = normalize_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS, False)
    assert (named.mode, named.name, named.parallel, named.enforced) == ("required", "add", False, True)
    assert not normalize_tool_choice("auto", TOOLS).enforced and normalize_tool_choice("auto", TOOLS, False).enforced


def test_assistant_tool_calls_reach_the_template_with_their_arguments_as_objects():
    msgs = template_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}])
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    with pytest.raises(ToolError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "[1]"}}]}])
    with pytest.raises(ToolError, match="not JSON"):
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{"}}]}])


def test_two_streamed_calls_send_no_content_between_them_and_a_cut_call_sends_no_markup():
    """pydantic-ai's run_stream ended on a "\n" content delta between two calls (and litellm / LangChain rebuilt
    the content as "\n"); a call cut by max_tokens came back as content '<tool_call>\n<function=get_we'."""
    text = call("get_weather", city="Lima") + "\n" + call("add", a="4", b="5") + "\n"
    for size in (1, 2, 3, 5, len(text)):
        p = ToolCallParser(TOOLS)
        events = [e for i in range(0, len(text), size) for e in p.push(text[i:i + size])] + p.finish()
        assert [e for e in events if isinstance(e, Content)] == [], size
        assert [c.name for c in p.calls] == ["get_weather", "add"]
        assert p.result()[0] is None
    cut = "Let me look.\n" + call("get_weather", city="Lima")[:25]
    p = ToolCallParser(TOOLS)
    events = p.push(cut) + p.finish(cut=True)
    assert "".join(e.text for e in events if isinstance(e, Content)) == "Let me look."
    assert p.cut and p.calls == []
    assert parse(cut, TOOLS, cut=True) == ("Let me look.", [])
    # an unclosed block the model ended itself (no cut) stays what it is: text
    assert parse(cut, TOOLS)[0] == cut


def test_a_tool_name_with_a_trailing_newline_is_refused():
    """Issue 32, item 6: the name pattern ended in "$", which matches before a trailing newline."""
    with pytest.raises(ToolError, match="function.name"):
        normalize_tools([{"type": "function", "function": {"name": "get_weather\n"}}])
    with pytest.raises(ToolError, match="parameter names"):
        normalize_tools([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"city\n": {"type": "string"}}}}}])
