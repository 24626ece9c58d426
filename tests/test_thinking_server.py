"""Issue 55 through the official openai client: thinking budgets, effort levels, the loop guard and the counts, on
chat completions (streamed and not) and the Responses API.

One real server of the random fixture model (which never closes a thought by itself: every budget is spent, the
closing is the server's) with effort levels set small; the loop guard on the server app in this process, its
sampler fixed to repeat a unit of tokens.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from deltaserve.session import decoding
from tests.server_proc import ServerProcess
from tests.test_thinking import SCHEMA, scripted, words

THINK = {"chat_template_kwargs": {"enable_thinking": True}}
ASK = [{"role": "user", "content": "What is 12 + 9?"}]
MODEL = "model-f32"  # the fixture file's name


@pytest.fixture(scope="module")
def server(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "1", "--think", "off", "--max-tokens-limit", "512",
                      "--reasoning-effort-budgets", "low=8,medium=16", "--reasoning-budget-message", "Answer now.")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def extra(obj, key):
    return (obj.model_extra or {}).get(key)


@pytest.mark.parametrize("budget", [0, 1, 16, 64])
def test_a_chat_completion_thinks_at_most_its_budget_and_counts_it(client, budget):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                       extra_body={**THINK, "reasoning_budget_tokens": budget})
    choice, usage = r.choices[0], r.usage
    if budget == 0:  # thinking off: the template's empty thought, nothing counted
        assert extra(choice.message, "reasoning_content") is None and extra(choice, "reasoning_ended") is None
        assert usage.completion_tokens_details.reasoning_tokens == 0
        return
    assert extra(choice, "reasoning_ended") == "budget"
    assert usage.completion_tokens_details.reasoning_tokens == budget
    assert extra(choice.message, "reasoning_content") and "</think>" not in (choice.message.content or "")
    # the thought, the server's closing (the bridge sentence, </think>, a blank line) and 6 answer tokens
    assert budget + 6 < usage.completion_tokens and choice.finish_reason == "length"
    assert "Answer now." in extra(choice.message, "reasoning_content")


def test_streamed_the_reasoning_comes_as_reasoning_content_deltas_and_the_counts_match(client):
    body = {**THINK, "thinking_token_budget": 16}  # vLLM's name for the same budget
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0, extra_body=body)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0, extra_body=body,
                                            stream=True, stream_options={"include_usage": True})
    reasoning, content, ended, usage = "", "", None, None
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += extra(delta, "reasoning_content") or ""
            content += delta.content or ""
            ended = extra(chunk.choices[0], "reasoning_ended") or ended
        usage = chunk.usage or usage
    assert reasoning.strip() == extra(whole.choices[0].message, "reasoning_content")
    assert content == whole.choices[0].message.content and ended == "budget"
    assert usage.completion_tokens_details.reasoning_tokens == 16 == whole.usage.completion_tokens_details.reasoning_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_effort_levels_map_to_the_servers_budgets_and_none_turns_thinking_off(client):
    for effort, budget in (("low", 8), ("medium", 16)):  # the server's --reasoning-effort-budgets; its --think is off
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0,
                                           reasoning_effort=effort)
        assert r.usage.completion_tokens_details.reasoning_tokens == budget
        assert extra(r.choices[0], "reasoning_ended") == "budget"
    for body in ({}, THINK):  # none is thinking off, whatever else asks for it
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0,
                                           reasoning_effort="none", extra_body=body)
        assert extra(r.choices[0].message, "reasoning_content") is None
        assert r.usage.completion_tokens_details.reasoning_tokens == 0
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0, reasoning_effort="low",
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert extra(r.choices[0].message, "reasoning_content") is None  # and so is an explicit enable_thinking false


def test_a_json_schema_answer_after_a_forced_close_validates(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=48, temperature=0, reasoning_effort="low",
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}})
    assert extra(r.choices[0], "reasoning_ended") == "budget"
    assert r.usage.completion_tokens_details.reasoning_tokens == 8
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_responses_count_reasoning_tokens_stream_reasoning_and_reuse_the_state_after_a_forced_close(client):
    first = client.responses.create(model=MODEL, input="What is 12 + 9?", reasoning={"effort": "medium"},
                                    max_output_tokens=6, temperature=0)
    assert first.usage.output_tokens_details.reasoning_tokens == 16 and extra(first, "reasoning_ended") == "budget"
    assert [item.type for item in first.output][:1] == ["reasoning"]
    follow = client.responses.create(model=MODEL, input="And 3 + 4?", previous_response_id=first.id,
                                     reasoning={"effort": "low"}, max_output_tokens=6, temperature=0)
    # the state after the forced close is what the follow-up extends: only its new input is prefilled (and the first
    # answer's last token, never fed where max_output_tokens ended it, as after any answer cut so)
    cut = int(first.status == "incomplete")
    assert follow.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - cut
    events = list(client.responses.create(model=MODEL, input="What is 12 + 9?", reasoning={"effort": "low"},
                                          max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.incomplete"
    done = events[-1].response
    assert done.usage.output_tokens_details.reasoning_tokens == 8 and extra(done, "reasoning_ended") == "budget"


@pytest.mark.parametrize("body, param, says", [
    ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens", "must be at least -1"),
    ({"reasoning_budget_tokens": 600}, "reasoning_budget_tokens", "must be at most 512"),
    ({"reasoning_budget_tokens": 8, "thinking_token_budget": 9}, "reasoning_budget_tokens", "disagree"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "must be"),
    ({"reasoning_effort": "none", "reasoning_budget_tokens": 5}, "reasoning_effort", "turns thinking off"),
    ({"reasoning_budget_message": 3}, "reasoning_budget_message", "must be a string"),
])
def test_a_bad_thinking_field_is_a_400_naming_it(server, body, param, says):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "reasoning_budget_tokens": 600}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_budget_tokens"


def test_the_loop_guard_closes_a_repeating_thought_says_so_and_logs_it_with_the_slot(hybrid_model, monkeypatch,
                                                                                      capfd):
    """The server's app in this process (its sampler fixed to repeat a unit of 30 tokens), the openai client on it."""
    from fastapi.testclient import TestClient

    from deltaserve.frontends.server.app import Server, create_app

    tok = hybrid_model.tokenizer
    unit = words(tok, 30, 5)
    monkeypatch.setattr(decoding, "Sampler", scripted(words(tok, 7, 6) + unit * 20))
    server = Server(hybrid_model, slots=2)
    with TestClient(create_app(server), base_url="http://127.0.0.1") as http:
        client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", http_client=http, max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, extra_body=THINK)
    assert extra(r.choices[0], "reasoning_ended") == "loop_guard"
    assert r.usage.completion_tokens_details.reasoning_tokens == 7 + 3 * 30
    err = capfd.readouterr().err
    assert "[deltaserve] [slot 0] loop guard: the thought repeated a unit of 30 tokens 3 times in a row" in err, err


def test_budgets_0_1_16_64_on_the_demo_model_through_chat_and_responses():
    """The embedded demo model (which thinks one newline, then closes) on the server's app in this process: each
    budget bounds the thought on chat completions and Responses, and the answer comes."""
    from fastapi.testclient import TestClient

    import deltaserve
    from deltaserve.frontends.server.app import Server, create_app

    demo = deltaserve.load()
    with TestClient(create_app(Server(demo, slots=1, quiet=True)), base_url="http://127.0.0.1") as http:
        client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", http_client=http, max_retries=0)
        for budget in (0, 1, 16, 64):
            body = {**THINK, "reasoning_budget_tokens": budget}
            r = client.chat.completions.create(model=demo.path.name, messages=ASK, max_tokens=24, temperature=0,
                                               extra_body=body)
            thought = r.usage.completion_tokens_details.reasoning_tokens
            assert "21" in r.choices[0].message.content and thought <= budget
            assert extra(r.choices[0], "reasoning_ended") == (None if budget == 0 else "model")
            resp = client.responses.create(model=demo.path.name, input="What is 12 + 9?", max_output_tokens=24,
                                           temperature=0, reasoning={"effort": "low"},
                                           extra_body={"reasoning_budget_tokens": budget})
            assert "21" in resp.output_text and resp.usage.output_tokens_details.reasoning_tokens <= budget
