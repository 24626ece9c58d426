"""Issue 53, goals: `GET /openapi.json` is served, and property-based fuzzing over it finds no 5xx and no stall. The
bodies are drawn from the document's own request schemas (`from_schema`: the JSON Schema subset the document uses,
as hypothesis strategies), so they are the requests a client generator would send, edge values included, with
now and then a value of the wrong type; the path routes get drawn ids. Short here (a few dozen requests);
scripts/fuzz_openapi.py runs the same for minutes."""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaserve.frontends.server.openapi import document
from tests.server_proc import ServerProcess

DOC = document()
SCHEMAS = DOC["components"]["schemas"]
ROUTES = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
          "/v1/responses": "ResponsesRequest"}


@pytest.fixture(scope="module")
def server(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "2", "--max-tokens-limit", "4", "--think", "off",
                      "--compile-timeout", "5")
    yield s
    s.stop()


def test_the_openapi_document_is_served_and_names_every_route(server):
    r = httpx.get(server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200 and r.json()["openapi"] == "3.1.0"
    paths = r.json()["paths"]
    assert set(ROUTES) <= set(paths) and "/v1/responses/{rid}" in paths and "/health" in paths
    assert r.json()["components"]["schemas"] == json.loads(json.dumps(SCHEMAS))


ANY = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(), st.text(max_size=20))


def from_schema(schema: dict, depth: int = 0) -> st.SearchStrategy:
    """Values of a JSON schema of the subset openapi.py writes (type, enum, const, oneOf, properties, items and the
    bounds), now and then a value of any type instead (the server must refuse it with a 400, never a 5xx)."""
    if "const" in schema:
        s = st.just(schema["const"])
    elif "enum" in schema:
        s = st.sampled_from(schema["enum"])
    elif "oneOf" in schema:
        s = st.one_of(*[from_schema(x, depth + 1) for x in schema["oneOf"]])
    elif "$ref" in schema:
        s = from_schema(SCHEMAS[schema["$ref"].rsplit("/", 1)[1]], depth + 1)
    else:
        kind = schema.get("type", "object")
        kind = kind[0] if isinstance(kind, list) else kind
        if kind == "string":
            s = st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 60), 60))
            if "pattern" in schema:
                s = st.one_of(s, st.from_regex(schema["pattern"], fullmatch=True))
        elif kind == "integer":
            lo, hi = schema.get("minimum"), schema.get("maximum")
            s = st.integers(lo, hi) | st.sampled_from([x for x in (lo, hi) if x is not None] or [0])
        elif kind == "number":
            s = st.floats(schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum"),
                          exclude_min="exclusiveMinimum" in schema)
        elif kind == "boolean":
            s = st.booleans()
        elif kind == "array":
            items = from_schema(schema.get("items", {"type": "string"}), depth + 1) if depth < 6 else ANY
            s = st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3))
        else:
            props = schema.get("properties", {})
            required = set(schema.get("required", ()))
            if depth >= 6 or not props:
                s = st.dictionaries(st.text(max_size=8), ANY, max_size=3)
            else:
                s = st.fixed_dictionaries({k: from_schema(v, depth + 1) for k, v in props.items() if k in required},
                                          optional={k: from_schema(v, depth + 1) for k, v in props.items()
                                                    if k not in required})
    return s if depth == 0 else st.one_of(s, s, s, s, s, s, s, s, s, ANY)


def shrink(body: dict) -> dict:
    """Keep a drawn request cheap to answer: a few tokens at most."""
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int):
            body[key] = min(body[key], 4)
    return body


posts = st.one_of(*[st.tuples(st.just(path), from_schema(SCHEMAS[name]).map(shrink)) for path, name in ROUTES.items()])
gets = st.tuples(st.sampled_from(["/v1/responses/{}", "/v1/responses/{}/input_items", "/v1/models/{}"]),
                 st.one_of(st.text(max_size=40), st.from_regex(r"resp_[0-9a-f]{32}\n?", fullmatch=True)))


def post(url: str, body) -> httpx.Response:
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")  # NaN and lone surrogates as drawn
    return httpx.post(url, content=raw, headers={"Content-Type": "application/json"}, timeout=120)


def check(r: httpx.Response, what) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:400], what)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and {"type", "param", "code"} <= set(err), r.text


@settings(max_examples=45, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.one_of(posts, gets))
def test_requests_drawn_from_the_openapi_document_never_get_a_5xx_and_the_server_goes_on(server, case):
    path, body = case
    if isinstance(body, dict):
        r = post(server.url + path, body)
    else:
        r = httpx.get(server.url + path.format(quote(body, safe="")), timeout=60)
    check(r, (path, body))
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # no stall


OTHER = {"/v1/messages": "MessagesRequest", "/v1/messages/count_tokens": "MessagesRequest",
         "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
other_posts = st.one_of(*[st.tuples(st.just(path), from_schema(SCHEMAS[name]).map(shrink))
                          for path, name in OTHER.items()])


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=other_posts)
def test_anthropic_and_tokenizer_requests_drawn_from_the_document_never_get_a_5xx(server, case):
    """Issue 56's routes: a refusal in the route's own shape (Anthropic's on /v1/messages), never a 5xx."""
    path, body = case
    r = post(server.url + path, body)
    assert r.status_code < 500, (r.status_code, r.text[:400], path, body)
    if r.status_code >= 400 and path.startswith("/v1/messages"):
        assert r.json()["type"] == "error" and r.json()["error"]["message"], r.text
    elif r.status_code >= 400:
        assert r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
