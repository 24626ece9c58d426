"""The gaps a second round of clients found (issue 56), through real servers and the openai and anthropic clients:
several choices (`n`) as forks of one prefilled state, the max_tokens rule (clamped to a limit that defaults to the
context, and said), the cause of a cut said the same on every API, schema keywords the grammar cannot enforce
handled alike in response_format and tool parameters, and CORS (off unless --cors-origin names the origin)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from deltaserve.demo import DEMO_FILE
from tests.server_proc import ServerProcess

ORIGIN = "https://app.example"
DEMO = DEMO_FILE.name
SMALL = "model-f32.gguf"  # the hybrid fixture's file
LIMIT = 64
CTX = 1024


@pytest.fixture(scope="module")
def demo():
    s = ServerProcess(DEMO_FILE, "--slots", "1", "--cors-origin", ORIGIN, "--max-tokens-limit", str(LIMIT),
                      env={"DELTASERVE_BATCH_INVARIANT": "on"})  # a choice's bits alone or beside others
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(demo):
    return openai.OpenAI(base_url=demo.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def small(hybrid_gguf):
    """Random weights (they rarely stop by themselves) in a context of CTX positions."""
    s = ServerProcess(hybrid_gguf, "--slots", "1", "--ctx", str(CTX), "--think", "off")
    yield s
    s.stop()


def engine(server) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()["engine"]


STORY = [{"role": "user", "content": "Reverse these words: red fox blue green"}]


def test_four_choices_cost_one_prefill_and_each_is_the_answer_its_seed_gives_alone(demo, client):
    before = engine(demo)
    r = client.chat.completions.create(model=DEMO, messages=STORY, max_tokens=12, temperature=1.0, seed=7, n=4)
    after = engine(demo)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    prefilled = r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
    assert after["rows"]["prefill"] - before["rows"]["prefill"] == prefilled  # the prompt once, not four times
    assert after["most_rows"] >= 4  # the four choices' rows in one forward
    alone = [client.chat.completions.create(model=DEMO, messages=STORY, max_tokens=12, temperature=1.0, seed=7 + i)
             for i in range(4)]
    assert [c.message.content for c in r.choices] == [a.choices[0].message.content for a in alone]
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens


def test_streamed_choices_carry_their_index_and_join_to_the_whole_answers(client):
    whole = client.chat.completions.create(model=DEMO, messages=STORY, max_tokens=12, temperature=1.0, seed=3, n=3)
    texts, finishes = {}, {}
    for c in client.chat.completions.create(model=DEMO, messages=STORY, max_tokens=12, temperature=1.0, seed=3, n=3,
                                            stream=True):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            finishes[ch.index] = ch.finish_reason or finishes.get(ch.index)
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [finishes[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    done = client.completions.create(model=DEMO, prompt="red fox", max_tokens=5, temperature=1.0, seed=1, n=2)
    assert [c.index for c in done.choices] == [0, 1]


def test_more_choices_than_one_forward_takes_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEMO, messages=STORY, max_tokens=4, n=9)
    assert e.value.body["param"] == "n" and "1 to 8" in e.value.body["message"]


def test_max_tokens_above_the_limit_is_clamped_and_said(demo, client):
    raw = client.chat.completions.with_raw_response.create(model=DEMO, messages=STORY, max_tokens=32768)
    r = raw.parse()
    assert raw.headers["x-deltaserve-max-tokens"].startswith(f"{LIMIT} (clamped from 32768")
    assert r.model_extra["max_tokens_clamped"] == {"requested": 32768, "limit": LIMIT}
    assert r.usage.completion_tokens <= LIMIT
    m = anthropic.Anthropic(base_url=demo.url, api_key="unused", max_retries=0).messages.with_raw_response.create(
        model=DEMO, max_tokens=20000, messages=STORY)
    assert m.headers["x-deltaserve-max-tokens"].startswith(f"{LIMIT} (clamped")


def test_an_answer_the_context_cuts_says_so_on_every_api(small):
    c = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = [40 + i % 200 for i in range(CTX - 10)]  # 10 positions left
    r = c.completions.create(model=SMALL, prompt=prompt, max_tokens=50, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["context_capped"] is True
    assert r.usage.completion_tokens == 10
    per = len(httpx.post(small.url + "/tokenize", json={"content": "word " * 100}).json()["tokens"]) / 100
    long = "word " * int((CTX - 40) / per)  # a few dozen positions left after the template's markup
    resp = c.responses.create(model=SMALL, input=long, max_output_tokens=100, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "context_capped"
    short = c.responses.create(model=SMALL, input="hi", max_output_tokens=3, temperature=0)
    assert short.incomplete_details.reason == "max_output_tokens"
    m = anthropic.Anthropic(base_url=small.url, api_key="unused", max_retries=0).messages.create(
        model=SMALL, max_tokens=100, messages=[{"role": "user", "content": long}], extra_body={"temperature": 0})
    assert m.stop_reason == "model_context_window_exceeded"


def test_an_anthropic_thinking_block_comes_before_the_text_streamed_and_whole(small):
    """Random weights never close their thinking by themselves: budget_tokens (the thinking budget) closes it."""
    c = anthropic.Anthropic(base_url=small.url, api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=SMALL, max_tokens=12, extra_body={"temperature": 0}, thinking={"type": "enabled",
                                                                                    "budget_tokens": 8},
              messages=[{"role": "user", "content": "hi"}])
    whole = c.messages.create(**kw)
    assert [b.type for b in whole.content][:1] == ["thinking"] and whole.content[0].thinking
    with c.messages.stream(**kw) as s:
        deltas = [e.thinking for e in s if e.type == "thinking"]
        final = s.get_final_message()
    none = c.messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 0}})
    assert "thinking" not in [b.type for b in none.content]  # a budget of 0 is thinking off, as on every route
    # (the whole block's text is the thought stripped, as chat's reasoning_content is)
    assert "".join(deltas).strip() == final.content[0].thinking.strip() == whole.content[0].thinking


ALWAYS_TWICE = {"type": "array", "items": {"enum": [1]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
NEVER_TWICE = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 1, "maxItems": 1, "uniqueItems": True}
TAGS_TOOL = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"tags": ALWAYS_TWICE}, "required": ["tags"]}}}


def test_a_keyword_the_grammar_cannot_enforce_is_checked_on_the_answer_alike_in_formats_and_tools(small):
    """uniqueItems: the grammar writes [1, 1] (all it allows), the check finds it: finish_reason schema_violation
    and schema_error, in response_format and in a forced tool's parameters alike; an answer that keeps it passes."""
    c = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def fmt(schema):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}

    r = c.chat.completions.create(model=SMALL, messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                                  temperature=0, response_format=fmt(ALWAYS_TWICE))
    choice = r.choices[0]
    assert json.loads(choice.message.content) == [1, 1]
    assert choice.finish_reason == "schema_violation" and "uniqueItems" in choice.model_extra["schema_error"]
    ok = c.chat.completions.create(model=SMALL, messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                                   temperature=0, response_format=fmt(NEVER_TWICE))
    assert ok.choices[0].finish_reason == "stop" and "schema_error" not in (ok.choices[0].model_extra or {})
    t = c.chat.completions.create(model=SMALL, messages=[{"role": "user", "content": "hi"}], max_tokens=200,
                                  temperature=0, tools=[TAGS_TOOL], tool_choice="required")
    choice = t.choices[0]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"tags": [1, 1]}
    assert choice.finish_reason == "schema_violation" and "uniqueItems" in choice.model_extra["schema_error"]
    assert "tools[tag]" in choice.model_extra["schema_error"]


def test_cors_answers_only_the_origins_named(demo, small):
    pre = httpx.options(demo.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(demo.url + "/v1/chat/completions", headers={"Origin": ORIGIN},
                   json={"messages": STORY, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.post(demo.url + "/v1/chat/completions", headers={"Origin": "https://elsewhere.example"},
                       json={"messages": STORY, "max_tokens": 2})
    assert "access-control-allow-origin" not in other.headers
    off = httpx.options(small.url + "/v1/chat/completions", headers={"Origin": ORIGIN,
                                                                     "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in off.headers  # off by default
