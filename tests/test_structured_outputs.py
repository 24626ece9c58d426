"""Structured outputs (response_format json_object / json_schema): the answer parses and validates whatever the weights.

On the random-weight fixture model the schemas bound their own output (strings carry a maxLength, arrays a
maxItems, numbers a range, objects only their declared properties in strict mode, and the grammar allows no free
whitespace), so every answer closes well inside max_tokens: the longest measured was 139 of 200 tokens.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from deltaserve.session import grammar
from deltaserve.session.grammar import GrammarError
from tests.server_proc import ServerProcess

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
    },
    "required": ["name", "age", "color", "tags", "address", "score"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object",
                            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b", "c"]}},
                            "required": ["id", "ok", "kind"], "additionalProperties": False}},
        "total": {"type": "number", "minimum": -100, "maximum": 100},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["items", "total"],
    "additionalProperties": False,
}
SCHEMAS = [PERSON, ORDER]


def json_schema(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def server(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "2", "--queue", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_fifty_strict_json_schema_answers_all_parse_and_validate(client):
    done = 0
    for i in range(50):
        schema = SCHEMAS[i % 2]
        temperature = 0.0 if i < 4 else 1.0  # greedy is one answer per schema; the rest sample with 46 seeds
        r = client.chat.completions.create(
            model="model-f32", messages=[{"role": "user", "content": f"Describe item {i} as JSON."}], max_tokens=200,
            temperature=temperature, seed=i, response_format=json_schema(schema))
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (i, choice.finish_reason, choice.message.content)
        assert r.usage.completion_tokens <= 200
        jsonschema.validate(json.loads(choice.message.content), schema)
        done += 1
    assert done == 50


def test_a_streamed_json_schema_answer_validates_too(client):
    stream = client.chat.completions.create(
        model="model-f32", messages=[{"role": "user", "content": "An order, please."}], max_tokens=200, temperature=1.0,
        seed=7, stream=True, response_format=json_schema(ORDER))
    text, finish = "", None
    for ev in stream:
        if ev.choices:
            text += ev.choices[0].delta.content or ""
            finish = ev.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), ORDER)


def test_a_completion_with_a_json_schema_validates(client):
    r = client.completions.create(model="model-f32", prompt="The answer:", max_tokens=200, temperature=1.0, seed=3,
                                  extra_body={"response_format": json_schema(PERSON)})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_json_object_answers_that_finish_parse_as_objects_and_the_rest_say_length(client):
    # json_object bounds nothing (a string may run on), so a random model's answer may reach max_tokens: that one
    # is reported as "length", honestly; every answer that ends is a JSON object
    finished = 0
    for seed in range(12):
        r = client.chat.completions.create(
            model="model-f32", messages=[{"role": "user", "content": "Any JSON object."}], max_tokens=120,
            temperature=1.0, seed=seed, response_format={"type": "json_object"})
        choice = r.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            finished += 1
        else:
            assert choice.finish_reason == "length" and r.usage.completion_tokens == 120
            assert choice.message.content.startswith("{")
    assert finished >= 1


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_response_format(client, server):
    for bad in ({"type": "frob"}, {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="model-f32", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           response_format=json_schema(bad))
        err = e.value.body
        assert e.value.status_code == 400 and err["param"] == "response_format"
        assert err["type"] == "invalid_request_error" and "cannot be compiled" in err["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "json_schema" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # the server is still there


def test_the_python_api_chat_takes_a_response_format(hybrid_model):
    session = hybrid_model.session(quiet=True)
    for seed in range(3):
        turn = session.chat([{"role": "user", "content": "JSON please"}], max_tokens=200, temperature=1.0,
                            seed=seed, response_format=json_schema(PERSON))
        assert turn.finish_reason == "stop" and turn.reasoning is None
        jsonschema.validate(json.loads(turn.text), PERSON)
    turn = session.generate(hybrid_model.tokenizer.encode("raw"), max_tokens=200, temperature=0.0,
                            response_format=json_schema(ORDER))
    assert turn.finish_reason == "stop"
    jsonschema.validate(json.loads(turn.text), ORDER)
    with pytest.raises(GrammarError, match="cannot be compiled"):
        session.chat([{"role": "user", "content": "x"}], response_format=json_schema({"type": "frob"}))


def test_a_truncated_answer_says_length_and_is_a_prefix_the_grammar_accepts(hybrid_model):
    session = hybrid_model.session(quiet=True)
    turn = session.chat([{"role": "user", "content": "JSON"}], max_tokens=5, temperature=1.0, seed=1,
                        response_format=json_schema(PERSON))
    assert turn.finish_reason == "length" and turn.generated == 5
    head = '{"name": "'  # the only way PERSON's JSON can begin (strict, compact, properties in order)
    assert turn.text and (head.startswith(turn.text) or turn.text.startswith(head))


def test_a_repeated_schema_is_compiled_once(hybrid_model):
    tok, cfg = hybrid_model.tokenizer, hybrid_model.config
    engine = grammar.engine_for(tok, cfg.vocab_size, frozenset(tok.stop_ids) | frozenset(cfg.eos_token_ids))
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 3}},
              "required": ["k"]}
    before = engine.compiles
    first = grammar.compile_format(tok, json_schema(schema), cfg.vocab_size, engine.stop_ids)
    again = grammar.compile_format(tok, json_schema(schema, name="other"), cfg.vocab_size, engine.stop_ids)
    assert first is again and engine.compiles == before + 1
    assert grammar.engine_for(tok, cfg.vocab_size, engine.stop_ids) is engine


def test_stop_tokens_are_allowed_exactly_when_the_grammar_can_end(hybrid_model):
    tok, cfg = hybrid_model.tokenizer, hybrid_model.config
    fmt = grammar.compile_format(tok, json_schema({"type": "object", "properties": {"k": {"enum": ["a"]}},
                                                   "required": ["k"]}), cfg.vocab_size)
    c = fmt.constraint()
    stops = sorted(fmt.engine.stop_ids)
    for piece in tok.encode('{"k": "a"'):
        assert not c.allowed()[stops].any() and not c.done()
        assert c.accept(piece)
    assert not c.allowed()[stops].any()
    assert c.accept(tok.encode("}")[0])
    assert c.allowed()[stops].all() and c.done()


def test_text_and_absent_response_formats_are_no_constraint():
    assert grammar.normalize(None) is None and grammar.normalize({"type": "text"}) is None
    with pytest.raises(GrammarError, match="response_format"):
        grammar.normalize({"type": "json_schema"})


def test_run_chat_with_a_json_schema_file_prints_a_valid_answer(hybrid_gguf, tmp_path):
    import subprocess
    import sys

    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "deltaserve.frontends.cli", "run", str(hybrid_gguf), "--chat",
                               *args], capture_output=True, text=True, timeout=300)

    r = run("--json-schema", str(schema_file), "-p", "Who are you?", "--max-tokens", "200", "--temperature", "1",
            "--seed", "5")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), PERSON)
    assert "stop)" in r.stderr  # the stats line: the answer closed
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "frob"}')
    r = run("--json-schema", str(bad), "-p", "hi")
    assert r.returncode != 0 and "cannot be compiled" in r.stderr and "Traceback" not in r.stderr


def test_a_request_without_a_format_is_answered_while_the_grammar_thread_is_held(hybrid_model):
    """Issue 32, item 2: schema compiles shared the two threads that tokenize every request, so two slow compiles
    stalled a plain `What is 12 + 9?` for 91 s. Compiles now run on a grammar thread of their own: with that thread
    held, a plain request is answered (the mechanism, not a time), and so is a json_object one (issue 53, item 10:
    the fast lane, never queued behind schemas); a schema that must be compiled waits its turn."""
    import threading

    from fastapi.testclient import TestClient

    from deltaserve.frontends.server.app import Server, create_app

    server = Server(hybrid_model, slots=1, quiet=True)
    held, release = threading.Event(), threading.Event()
    server.grammar_pool.submit(lambda: (held.set(), release.wait(120)))
    assert held.wait(30)
    try:
        with TestClient(create_app(server), base_url="http://127.0.0.1") as c:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "What is 12 + 9?"}],
                                                     "max_tokens": 4})
            assert r.status_code == 200, r.text
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                     "response_format": {"type": "json_object"}})
            assert r.status_code == 200, r.text
            g = c.get("/health").json()["grammar"]
            assert (g["waiting"], g["abandoned"], g["fast"]) == (0, 0, 1)
            out = {}
            t = threading.Thread(target=lambda: out.setdefault("r", c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": wide_format(3, "held")})))
            t.start()
            for _ in range(600):  # the schema queues behind the held grammar thread
                if server.compiles["waiting"] == 1:
                    break
                threading.Event().wait(0.05)
            assert server.compiles["waiting"] == 1 and "r" not in out
            release.set()
            t.join(120)
            assert out["r"].status_code == 200 and server.compiles["waiting"] == 0
    finally:
        release.set()


def test_compiles_are_taken_round_robin_per_client_and_a_clients_share_is_bounded():
    """Issue 53, item 10: twenty slow schemas of one client filled the one queue and another's waited behind all of
    them. Each client's compiles wait in a queue of their own, taken in turn; past PER_CLIENT waiting, a 429."""
    import asyncio
    import threading

    from deltaserve.frontends.server.compiles import CompileQueue
    from deltaserve.frontends.server.protocol import APIError

    order: list[str] = []
    gate = threading.Event()

    def work(name):
        from deltaserve.session import grammar

        if grammar._ISOLATED.current.cache_only:
            raise grammar.NotCached()
        gate.wait(30)
        order.append(name)
        return name

    async def go():
        q = CompileQueue(5.0, per_client=4)
        first = asyncio.ensure_future(q.grammar((work, "a0"), "client-a"))  # running: holds the thread
        await asyncio.sleep(0.05)
        waiting = [asyncio.ensure_future(q.grammar((work, f"a{i}"), "client-a")) for i in range(1, 5)]
        await asyncio.sleep(0.05)
        other = asyncio.ensure_future(q.grammar((work, "b0"), "client-b"))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as e:
            await q.grammar((work, "a5"), "client-a")
        assert e.value.status == 429 and q.counts["refused"] == 1
        gate.set()
        await asyncio.gather(first, other, *waiting)
        return q.counts

    counts = asyncio.run(go())
    assert order[:3] == ["a0", "a1", "b0"], order  # b's one schema after one more of a's, not after all four
    assert sorted(order) == ["a0", "a1", "a2", "a3", "a4", "b0"] and counts["waiting"] == 0


def wide_format(properties: int, tag: str) -> dict:
    """A schema of `properties` integer properties (3,000: 89 KB, 43 s of xgrammar's compile on a loaded 2-core
    machine, within every size and depth bound); `tag` makes each one a cache miss."""
    return {"type": "json_schema", "json_schema": {"name": "wide", "schema": {
        "type": "object", "description": tag, "properties": {f"p{i}": {"type": "integer"} for i in range(properties)}}}}


def test_a_schema_still_compiling_past_the_bound_is_stopped_and_refused_naming_response_format(hybrid_model):
    """Issue 32, item 2: a compile was bounded by nothing. It runs in the compile process now, stopped past
    --compile-timeout (here 0.5 s), and the request is a 400 naming `response_format`; the next one is compiled by a
    fresh child."""
    from fastapi.testclient import TestClient

    from deltaserve.frontends.server.app import Server, create_app
    from deltaserve.frontends.server.protocol import Limits

    server = Server(hybrid_model, slots=1, quiet=True, limits=Limits(compile_timeout=0.5))
    with TestClient(create_app(server), base_url="http://127.0.0.1") as c:
        before = c.get("/health").json()["grammar"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                 "response_format": wide_format(3000, "bounded")})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format" and "took over 0.5 s to compile and was stopped" in err["message"]
        after = c.get("/health").json()["grammar"]
        assert after["timed_out"] == before["timed_out"] + 1 and after["compiled"] == before["compiled"]
        # the child killed, another started (and the first one, where this test started it)
        assert after["processes"] == before["processes"] + 1 + (before["processes"] == 0)
        ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  "response_format": wide_format(3, "after the bound")})
        assert ok.status_code == 200, ok.text
        assert c.get("/health").json()["grammar"]["compiled"] >= after["compiled"] + 1


def test_two_abandoned_pathological_compiles_are_stopped_and_the_next_requests_are_served(server):
    """Issue 32, item 2: two requests with a slow schema whose clients give up after a second made a plain request
    wait 91 s. A running compile whose client has left is now stopped (its child killed), one still waiting is never
    started; a plain request and a constrained one are served after them. Asserted by the server's counters: both
    abandoned, neither finished, the running one stopped and its child replaced (no clock)."""
    import threading

    before = httpx.get(server.url + "/health", timeout=30).json()["grammar"]
    outcomes = []

    def give_up(i):
        try:
            httpx.post(server.url + "/v1/chat/completions", timeout=1.5, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": wide_format(3000, f"abandoned {i}")})
            outcomes.append("answered")
        except httpx.TimeoutException:
            outcomes.append("gave up")

    clients = [threading.Thread(target=give_up, args=(i,)) for i in range(2)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(60)
    assert outcomes == ["gave up", "gave up"]
    for _ in range(600):  # the server notices each departure within its 50 ms poll
        g = httpx.get(server.url + "/health", timeout=30).json()["grammar"]
        if g["abandoned"] == before["abandoned"] + 2 and g["waiting"] == g["running"] == 0:
            break
        threading.Event().wait(0.05)
    assert g["abandoned"] == before["abandoned"] + 2 and g["waiting"] == g["running"] == 0
    stopped = g["stopped"] - before["stopped"]
    assert 1 <= stopped <= 2 and g["compiled"] == before["compiled"]  # the running one stopped, none finished
    assert g["processes"] == before["processes"] + stopped + (before["processes"] == 0)  # (the first child too)
    plain = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is 12 + 9?"}], "max_tokens": 4})
    assert plain.status_code == 200, plain.text
    constrained = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": {"type": "json_object"}})
    assert constrained.status_code == 200, constrained.text
    g2 = httpx.get(server.url + "/health", timeout=30).json()["grammar"]
    assert g2["stopped"] == g["stopped"] and g2["compiled"] >= g["compiled"]


def test_a_schema_over_the_size_bound_is_refused_before_it_is_compiled():
    with pytest.raises(GrammarError, match=r"response_format: the JSON schema is \d+ bytes as compact JSON, over "
                                           r"the limit of 262144"):
        grammar.normalize(wide_format(12000, "large"))


@pytest.mark.parametrize("schema,named,bad", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", [1, 1]),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}}, "contains", {"a": [2]}),
    ({"type": "object", "required": ["a"]}, "required", {}),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a+$", "maxLength": 3}}}, "maxLength",
     {"a": "aaaa"}),
])
def test_a_schema_keyword_the_grammar_does_not_enforce_is_left_to_the_check_of_the_answer(schema, named, bad):
    """Issue 56, item 6 (issue 32 refused them): the grammar gets the schema without the keyword (so what it does
    enforce compiles and closes), and the finished answer is checked with the whole schema, naming the keyword."""
    fmt = grammar.normalize({"type": "json_schema", "json_schema": {"schema": schema}})
    assert fmt["schema"] == schema  # accepted as sent
    assert grammar.unenforced_keyword(grammar.enforceable(schema)) is None
    assert named not in json.dumps(grammar.enforceable(schema))
    said = grammar.violation(bad, schema, "response_format")
    assert said is not None and f"'{named}'" in said and said.startswith("response_format: ")
    # a property merely named like a keyword is a name, not the keyword
    ok = {"type": "object", "properties": {"uniqueItems": {"type": "boolean"}, "contains": {"type": "string"}}}
    assert grammar.enforceable(ok) == ok


def test_a_schema_that_needs_a_control_character_is_refused_naming_response_format(hybrid_model):
    """Issue 32, item 6: strings are never given a raw control character, so a pattern that needs one left the
    grammar allowing nothing: a 500 (at temperature 0 a 400 "internal: the grammar refused token 0")."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^\n$"}}, "required": ["a"]}
    s = hybrid_model.session(quiet=True)
    for temperature in (0.0, 1.0):
        with pytest.raises(grammar.GrammarError, match="response_format: .* allows no token .* control character"):
            s.chat([{"role": "user", "content": "hi"}], max_tokens=30, temperature=temperature,
                   response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert s.chat([{"role": "user", "content": "hi"}], max_tokens=3).generated >= 1  # the session goes on
