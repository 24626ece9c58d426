"""Bad requests get the right 4xx with an OpenAI error body (never a 5xx); a bounded load run loses nothing;
/metrics adds up."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltaserve.frontends.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server_proc import ServerProcess

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "2", "--queue", "6", "--api-key", KEY, "--max-tokens-limit", "512",
                      "--max-body", "65536", "--max-messages", "64", "--ctx", "4096", "--think", "off")
    yield s
    s.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}
OK_MSGS = [{"role": "user", "content": "hi"}]
LONG = "word " * 5000  # > 4096 tokens once encoded


def deep_schema(n: int) -> dict:
    """A schema of arrays nested n deep (issue 32: 900 deep took xgrammar a minute to compile, 490 deep overflowed
    the template's recursion): refused by name before it is compiled or rendered."""
    s: dict = {"type": "string"}
    for _ in range(n):
        s = {"type": "array", "items": s}
    return s


DEEP_FORMAT = {"type": "json_schema", "json_schema": {"name": "d", "schema": {
    "type": "object", "properties": {"x": deep_schema(300)}, "required": ["x"]}}}
DEEP_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": deep_schema(300)}}}}
DEEP_CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
    "name": "f", "arguments": '{"x": ' + "[" * 300 + "]" * 300 + "}"}}]}

# (name, method, path, body (dict -> JSON, str/bytes -> raw), headers, expected status, param or None)
BAD = [
    ("invalid JSON", "POST", "/v1/chat/completions", b"{not json", AUTH, 400, None),
    ("JSON that is a list", "POST", "/v1/chat/completions", [1, 2], AUTH, 400, None),
    ("empty body", "POST", "/v1/chat/completions", b"", AUTH, 400, None),
    ("no messages", "POST", "/v1/chat/completions", {"model": "x"}, AUTH, 400, "messages"),
    ("messages not a list", "POST", "/v1/chat/completions", {"messages": "hi"}, AUTH, 400, "messages"),
    ("empty messages", "POST", "/v1/chat/completions", {"messages": []}, AUTH, 400, "messages"),
    ("message not an object", "POST", "/v1/chat/completions", {"messages": ["hi"]}, AUTH, 400, "messages[0]"),
    ("unknown role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, AUTH, 400,
     "messages[0].role"),
    ("content a number", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, AUTH, 400,
     "messages[0].content"),
    ("image content", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, AUTH, 400,
     "messages[0].content[0]"),  # read (images are served), and this one is no data URL
    ("too many messages", "POST", "/v1/chat/completions", {"messages": OK_MSGS * 65}, AUTH, 400, "messages"),
    ("n above one forward's rows", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "n": 9}, AUTH, 400, "n"),
    ("logprobs a number", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "logprobs": 3}, AUTH, 400,
     "logprobs"),
    ("top_logprobs above 20", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "logprobs": True,
                                                                "top_logprobs": 21}, AUTH, 400, "top_logprobs"),
    ("echo on chat", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "echo": True}, AUTH, 400, "echo"),
    ("completion logprobs above 20", "POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, AUTH, 400,
     "logprobs"),
    ("completion echo a string", "POST", "/v1/completions", {"prompt": "x", "echo": "yes"}, AUTH, 400, "echo"),
    ("a batch of two prompts", "POST", "/v1/completions", {"prompt": ["a", "b"]}, AUTH, 400, "prompt"),
    ("n a string", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "n": "1"}, AUTH, 400, "n"),
    ("max_tokens 0", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "max_tokens": 0}, AUTH, 400, "max_tokens"),
    ("max_tokens a float", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "max_tokens": 2.5}, AUTH, 400,
     "max_tokens"),
    ("max_completion_tokens negative", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "max_completion_tokens": -3}, AUTH, 400, "max_completion_tokens"),
    ("temperature a string", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "temperature": "hot"}, AUTH, 400,
     "temperature"),
    ("temperature too high", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "temperature": 9}, AUTH, 400,
     "temperature"),
    ("top_p above 1", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "top_p": 1.5}, AUTH, 400, "top_p"),
    ("top_p zero", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "top_p": 0}, AUTH, 400, "top_p"),
    ("min_p negative", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "min_p": -0.1}, AUTH, 400, "min_p"),
    ("top_k a float", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "top_k": 1.5}, AUTH, 400, "top_k"),
    ("presence_penalty out of range", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "presence_penalty": 3},
     AUTH, 400, "presence_penalty"),
    ("frequency_penalty a list", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "frequency_penalty": [1]},
     AUTH, 400, "frequency_penalty"),
    ("repetition_penalty zero", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "repetition_penalty": 0},
     AUTH, 400, "repetition_penalty"),
    ("seed a string", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "seed": "abc"}, AUTH, 400, "seed"),
    ("seed negative", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "seed": -1}, AUTH, 400, "seed"),
    ("cache_salt empty", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "cache_salt": ""}, AUTH, 400,
     "cache_salt"),
    ("stop a number", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "stop": 7}, AUTH, 400, "stop"),
    ("too many stops", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "stop": list("abcde")}, AUTH, 400,
     "stop"),
    ("stream a string", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "stream": "yes"}, AUTH, 400, "stream"),
    ("stream_options without stream", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "stream_options": {"include_usage": True}}, AUTH, 400, "stream_options"),
    ("a tool with a bad name", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "tools": [{"type": "function", "function": {"name": "f g"}}]}, AUTH, 400, "tools"),
    ("model a number", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "model": 3}, AUTH, 400, "model"),
    ("user a number", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "user": 3}, AUTH, 400, "user"),
    ("include_usage a string", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "stream": True, "stream_options": {"include_usage": "yes"}}, AUTH, 400,
     "stream_options.include_usage"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "top_logprobs": 2}, AUTH,
     400, "top_logprobs"),
    ("logit_bias asked for", "POST", "/v1/chat/completions", {"messages": OK_MSGS, "logit_bias": {"1": 5}}, AUTH,
     400, "logit_bias"),
    ("tool_choice required without tools", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "tool_choice": "required"}, AUTH, 400, "tool_choice"),
    ("tool_choice auto without tools", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "tool_choice": "auto"}, AUTH, 400, "tool_choice"),
    ("legacy functions", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "functions": [{"name": "f", "parameters": {"type": "object"}}]}, AUTH, 400, "functions"),
    ("legacy function_call", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "function_call": "auto"}, AUTH, 400, "function_call"),
    ("best_of above 1", "POST", "/v1/completions", {"prompt": "x", "best_of": 3}, AUTH, 400, "best_of"),
    ("a response_format schema nested 300 deep", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "response_format": DEEP_FORMAT}, AUTH, 400, "response_format"),
    ("a tool schema nested 300 deep", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "tools": [DEEP_TOOL]}, AUTH, 400, "tools"),
    ("a call's arguments nested 300 deep", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS + [DEEP_CALL, {"role": "user", "content": "and?"}]}, AUTH, 400, "messages"),
    ("parallel_tool_calls a string", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "parallel_tool_calls": "no"}, AUTH, 400, "parallel_tool_calls"),
    ("tool_calls not a list", "POST", "/v1/chat/completions",
     {"messages": [{"role": "assistant", "tool_calls": "f()"}] + OK_MSGS}, AUTH, 400, "messages[0].tool_calls"),
    ("tool_call_id a number", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS + [{"role": "tool", "content": "x", "tool_call_id": 7}]}, AUTH, 400,
     "messages[1].tool_call_id"),
    ("message name a list", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x", "name": ["a"]}]}, AUTH, 400, "messages[0].name"),
    ("an unknown response_format type", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "response_format": {"type": "xml"}}, AUTH, 400, "response_format"),
    ("a json_schema response_format without a schema", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, AUTH, 400,
     "response_format"),
    ("reasoning_content a number", "POST", "/v1/chat/completions",
     {"messages": [{"role": "assistant", "content": "a", "reasoning_content": 1}] + OK_MSGS}, AUTH, 400,
     "messages[0].reasoning_content"),
    ("unknown chat_template_kwargs", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "chat_template_kwargs": {"add_vision_id": True}}, AUTH, 400, "chat_template_kwargs"),
    ("enable_thinking a string", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "chat_template_kwargs": {"enable_thinking": "yes"}}, AUTH, 400,
     "chat_template_kwargs.enable_thinking"),
    ("reasoning_effort unknown", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "reasoning_effort": "maximum"}, AUTH, 400, "reasoning_effort"),
    ("reasoning_budget_tokens below -1", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "reasoning_budget_tokens": -5}, AUTH, 400, "reasoning_budget_tokens"),
    ("thinking_token_budget a string", "POST", "/v1/completions",
     {"prompt": "x", "thinking_token_budget": "lots"}, AUTH, 400, "thinking_token_budget"),
    ("reasoning_budget_message a number", "POST", "/v1/chat/completions",
     {"messages": OK_MSGS, "reasoning_budget_message": 7}, AUTH, 400, "reasoning_budget_message"),
    ("template refuses (no user message)", "POST", "/v1/chat/completions",
     {"messages": [{"role": "system", "content": "only a system message"}]}, AUTH, 400, "messages"),
    ("prompt longer than the context", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": LONG[:60000]}]}, AUTH, 400, "messages"),
    ("completion without prompt", "POST", "/v1/completions", {"model": "x"}, AUTH, 400, "prompt"),
    ("completion prompt a dict", "POST", "/v1/completions", {"prompt": {"a": 1}}, AUTH, 400, "prompt"),
    ("completion token id out of range", "POST", "/v1/completions", {"prompt": [1, 2, 10 ** 9]}, AUTH, 400, "prompt"),
    ("completion empty prompt", "POST", "/v1/completions", {"prompt": ""}, AUTH, 400, "prompt"),
    ("completion suffix asked for", "POST", "/v1/completions", {"prompt": "x", "suffix": "y"}, AUTH, 400, "suffix"),
    ("no API key", "POST", "/v1/chat/completions", {"messages": OK_MSGS}, {}, 401, None),
    ("wrong API key", "POST", "/v1/chat/completions", {"messages": OK_MSGS}, {"Authorization": "Bearer nope"}, 401,
     None),
    ("models without key", "GET", "/v1/models", None, {}, 401, None),
    ("unknown route", "POST", "/v1/embeddings", {"input": "x"}, AUTH, 404, None),
    ("unknown path", "GET", "/nothing/here", None, AUTH, 404, None),
    ("GET on a POST route", "GET", "/v1/chat/completions", None, AUTH, 405, None),
    ("PUT on models", "PUT", "/v1/models", None, AUTH, 405, None),
    ("body over the limit", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x" * 70000}]}, AUTH, 413, None),
]


def send(server, method, path, body, headers):
    if body is None:
        content = None
    elif isinstance(body, (bytes, str)):
        content = body
    else:
        content = json.dumps(body)
    h = dict(headers)
    if content is not None:
        h["Content-Type"] = "application/json"
    return httpx.request(method, server.url + path, content=content, headers=h, timeout=60)


MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def schema_fields(model) -> set[tuple[str, ...]]:
    """The fields a request model declares (its JSON schema's properties), and one level down the fields of
    the objects they hold (messages[].role, stream_options.include_usage, ...), as name paths."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})

    def objects(s: dict):  # the $defs a property's schema refers to, through anyOf and array items
        if "$ref" in s:
            yield defs[s["$ref"].rsplit("/", 1)[-1]]
        for sub in s.get("anyOf", []) + ([s["items"]] if isinstance(s.get("items"), dict) else []):
            yield from objects(sub)

    out = set()
    for name, prop in schema["properties"].items():
        out.add((name,))
        for obj in objects(prop):
            out |= {(name, inner) for inner in obj.get("properties", {})}
    return out


def param_path(param: str) -> tuple[str, ...]:
    return tuple(re.sub(r"\[\d+\]", "", param).split("."))


# Guards the table against the request models: every field ChatCompletionRequest / CompletionRequest declare
# (top-level, and the fields of the objects they hold) must be refused by at least one row of BAD whose param
# names it, on an endpoint whose model has the field, so a field added to a model without a bad-request case
# fails here; and every 400 row must name a field its endpoint's model declares, so a renamed or removed
# field cannot leave a row that tests nothing.
def test_every_field_of_the_request_models_has_a_bad_request_case():
    fields = {path: schema_fields(model) for path, model in MODELS.items()}
    assert ("messages", "role") in fields["/v1/chat/completions"] and ("prompt",) in fields["/v1/completions"]
    rows = [(path, param_path(param)) for _, _, path, _, _, status, param in BAD
            if status == 400 and param is not None and path in MODELS]
    for path, p in rows:
        assert p[:1] in {f[:1] for f in fields[path]}, f"a row on {path} names {'.'.join(p)}, no field there"
    missing = sorted(".".join(f) for f in set().union(*fields.values())
                     if not any(f in fields[path] and p[:len(f)] == f for path, p in rows))
    assert not missing, f"fields without a bad-request case in BAD: {missing}"


@pytest.mark.parametrize("name,method,path,body,headers,status,param", BAD, ids=[b[0] for b in BAD])
def test_a_bad_request_gets_its_4xx_and_an_openai_error_body(server, name, method, path, body, headers, status, param):
    r = send(server, method, path, body, headers)
    assert r.status_code == status, (name, r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err


def test_the_context_refusal_names_both_numbers(server):
    r = send(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG[:60000]}]}, AUTH)
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "4096" in err["message"]
    assert any(w.isdigit() and int(w) > 4096 for w in err["message"].replace(",", " ").split())


def test_after_every_bad_request_the_server_still_answers(server):
    r = send(server, "POST", "/v1/chat/completions", {"messages": OK_MSGS, "max_tokens": 3}, AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def chat_body(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"request number {i % 25}"}], "max_tokens": 4, "temperature": 0}


def expected_answers(model, n: int) -> dict[int, str]:
    """What the model answers alone (greedy, in process) to chat_body(k), k < n."""
    tok = model.tokenizer
    out = {}
    for k in range(n):
        ids = tok.encode(tok.apply_chat_template(chat_body(k)["messages"], add_generation_prompt=True,
                                                 enable_thinking=False))
        out[k] = model.generate(ids, max_tokens=4).text
    return out


def test_a_bounded_load_run_completes_or_cleanly_refuses_every_request(server, hybrid_model):
    expected = expected_answers(hybrid_model, 25)
    warm = [send(server, "POST", "/v1/chat/completions", chat_body(i), AUTH) for i in range(4)]
    assert all(r.status_code == 200 for r in warm)
    rss_before = server.rss()
    results = []
    lock = threading.Lock()

    def one(i: int):
        with httpx.Client(timeout=120) as c:
            r = c.post(server.url + "/v1/chat/completions", json=chat_body(i), headers=AUTH)
        with lock:
            results.append((i, r.status_code, r.json(), r.headers.get("retry-after")))

    t0 = time.time()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(500)))
    elapsed = time.time() - t0
    assert len(results) == 500
    statuses = [s for _, s, _, _ in results]
    assert set(statuses) <= {200, 503}, sorted(set(statuses))
    assert statuses.count(200) >= 100
    for i, status, body, retry in results:
        if status == 200:
            assert body["choices"][0]["message"]["content"] == expected[i % 25], i  # nothing garbled
        else:
            assert body["error"]["code"] == "server_busy" and retry == "1"
    rss_after = server.rss()
    assert rss_after <= rss_before * 1.10, (rss_before, rss_after)
    print(f"load: 500 requests in {elapsed:.1f} s, {statuses.count(200)} answered, {statuses.count(503)} refused, "
          f"RSS {rss_before >> 20} -> {rss_after >> 20} MiB")


def test_metrics_parse_and_add_up_to_what_was_sent(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "2", "--think", "off")
    try:
        sent = {"chat": 0, "bad": 0, "prompt": 0, "generated": 0}
        for i in range(6):  # three prompts, each sent twice in a row: the repeat resumes from a checkpoint
            r = httpx.post(s.url + "/v1/chat/completions", json=chat_body(i // 2), timeout=60).json()
            sent["chat"] += 1
            sent["prompt"] += r["usage"]["prompt_tokens"]
            sent["generated"] += r["usage"]["completion_tokens"]
            sent["cached"] = sent.get("cached", 0) + r["usage"]["prompt_tokens_details"]["cached_tokens"]
        for _ in range(3):
            assert httpx.post(s.url + "/v1/chat/completions", content=b"{", timeout=60,
                              headers={"Content-Type": "application/json"}).status_code == 400
            sent["bad"] += 1
        text = httpx.get(s.url + "/metrics").text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        req = {(smp.labels["endpoint"], smp.labels["status"]): smp.value
               for smp in fams["deltaserve_requests"].samples if smp.name == "deltaserve_requests_total"}
        assert req[("/v1/chat/completions", "200")] == sent["chat"]
        assert req[("/v1/chat/completions", "400")] == sent["bad"]
        value = {smp.name: smp.value for f in fams.values() for smp in f.samples}
        assert value["deltaserve_prompt_tokens_total"] == sent["prompt"]
        assert value["deltaserve_generated_tokens_total"] == sent["generated"]
        assert value["deltaserve_time_to_first_token_seconds_count"] == sent["chat"]
        assert value["deltaserve_request_duration_seconds_count"] == sent["chat"]
        assert value["deltaserve_busy_slots"] == 0 and value["deltaserve_queue_depth"] == 0
        assert value["deltaserve_cached_tokens_total"] == sent["cached"] > 0
    finally:
        s.stop()


def test_a_server_with_a_compute_thread_answers_concurrent_requests_as_alone_and_says_so(hybrid_gguf, hybrid_model):
    expected = expected_answers(hybrid_model, 6)
    s = ServerProcess(hybrid_gguf, "--slots", "2", "--think", "off", "--compute-thread", "on")
    try:
        assert "the engine loop on a thread of its own, every forward on it (--compute-thread on)" in s.stderr
        got = {}

        def one(i: int):
            got[i] = httpx.post(s.url + "/v1/chat/completions", json=chat_body(i), timeout=120).json()

        with ThreadPoolExecutor(6) as pool:
            list(pool.map(one, range(6)))
        assert {i: r["choices"][0]["message"]["content"] for i, r in got.items()} == expected
        pieces = []
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=dict(chat_body(2), stream=True),
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:]).get("choices", []):
                        pieces.append((ch.get("delta") or {}).get("content") or "")
        assert "".join(pieces) == expected[2]
    finally:
        s.stop()
    plain = ServerProcess(hybrid_gguf, "--slots", "1")
    try:
        assert "the engine loop stepped by the slots' threads in turn (--compute-thread auto: on for model files of 64 MiB" in plain.stderr
    finally:
        plain.stop()
