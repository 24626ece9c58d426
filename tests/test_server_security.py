"""What a web page, or a client without the key, can get from `deltaserve serve` (issue 16, item 7): a POST body
must say it is JSON (a cross-site form or text/plain POST needs no CORS preflight), a loopback bind answers only
to loopback Host names (DNS rebinding), /health without the key says only that the server is up, and keys are
compared in constant time. Also the served model answers whatever `model` a request names (item 8)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltaserve.frontends.server import app as server_app
from deltaserve.frontends.server.app import HostPolicy, host_name
from tests.server_proc import ServerProcess

KEY = "sk-security-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = json.dumps({"prompt": "hello", "max_tokens": 2})


@pytest.fixture(scope="module")
def open_server(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "1", "--think", "off")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed_server(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "1", "--think", "off", "--api-key", KEY,
                      "--allowed-hosts", "deltaserve.lan.test, *.box.test")
    yield s
    s.stop()


def generated(server, headers=None) -> float:
    text = httpx.get(server.url + "/metrics", headers=headers or {}, timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text)
            for s in f.samples}["deltaserve_generated_tokens_total"]


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


# -- the content type -------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_post_that_is_not_declared_json_without_a_key_is_a_415_and_generates_nothing(open_server, path,
                                                                                        content_type):
    body = BODY if path == "/v1/completions" else json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    before = generated(open_server)
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.post(open_server.url + path, content=body.encode(), headers=headers, timeout=60)
    err = assert_openai_error(r, 415, "unsupported_media_type")
    assert (content_type.split(";")[0] if content_type else "no Content-Type") in err["message"]
    assert "application/json" in err["message"]
    assert generated(open_server) == before


def test_json_with_a_charset_parameter_is_served(open_server):
    r = httpx.post(open_server.url + "/v1/completions", content=BODY.encode(), timeout=60,
                   headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_a_keyed_server_requires_json_too_after_the_key(keyed_server):
    r = httpx.post(keyed_server.url + "/v1/completions", content=BODY.encode(), timeout=60,
                   headers={**AUTH, "Content-Type": "text/plain"})
    assert_openai_error(r, 415, "unsupported_media_type")
    r = httpx.post(keyed_server.url + "/v1/completions", content=BODY.encode(), timeout=60,
                   headers={"Content-Type": "text/plain"})  # no key: the key is asked for first
    assert_openai_error(r, 401, "invalid_api_key")


# -- the Host header --------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.nip.io", "localhost.evil.example",
                                  "10.0.0.1"])
def test_a_foreign_host_on_a_loopback_bind_is_a_403(open_server, host):
    for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("GET", "/metrics"), ("GET", "/no/such/route")]:
        r = httpx.request(method, open_server.url + path, content=BODY if method == "POST" else None, timeout=60,
                          headers={"Host": host, "Content-Type": "application/json"})
        err = assert_openai_error(r, 403, "host_not_allowed")
        assert host in err["message"] and "--allowed-hosts" in err["message"]


@pytest.mark.parametrize("host", ["localhost", "LocalHost:1234", "127.0.0.1", "127.0.0.1:80", "[::1]", "[::1]:8080",
                                  "localhost."])
def test_a_loopback_host_name_is_served_with_any_port(open_server, host):
    r = httpx.post(open_server.url + "/v1/completions", content=BODY, timeout=60,
                   headers={"Host": host, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host,status", [("deltaserve.lan.test", 200), ("DeltaServe.lan.test:8080", 200),
                                         ("gpu.box.test", 200), ("box.test", 403), ("evil.example", 403),
                                         ("localhost:9", 200)])
def test_allowed_hosts_widens_the_loopback_names(keyed_server, host, status):
    r = httpx.post(keyed_server.url + "/v1/completions", content=BODY, timeout=60,
                   headers={**AUTH, "Host": host, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert "deltaserve.lan.test" in keyed_server.stderr  # the startup line says what it answers to


@pytest.mark.parametrize("bind,allowed,host,ok", [
    ("127.0.0.1", None, "evil.example", False),
    ("localhost", None, "evil.example", False),
    ("::1", None, "[::1]:8080", True),
    ("127.0.0.1", "*", "evil.example", True),
    ("127.0.0.1", "a.test,b.test", "b.test:1", True),
    ("127.0.0.1", "*.a.test", "x.y.a.test", True),
    ("127.0.0.1", "*.a.test", "a.test", False),
    ("0.0.0.0", None, "evil.example", True),  # a bind to every address answers to any name (the key guards it)
    ("0.0.0.0", "box.test", "evil.example", False),
    ("0.0.0.0", "box.test", "127.0.0.2", True),
    ("127.0.0.1", None, None, True),  # HTTP/1.0 without Host: no browser sends that
])
def test_the_host_policy(bind, allowed, host, ok):
    assert HostPolicy(bind, allowed).allows(host) is ok


def test_host_names_lose_their_port_case_and_final_dot():
    assert [host_name(h) for h in ["LocalHost:8080", "[::1]:80", "[::1]", "example.test.", "a.test:"]] == \
        ["localhost", "::1", "::1", "example.test", "a.test"]


# -- /health and the key ----------------------------------------------------------------------------------
def test_health_without_the_key_on_a_keyed_server_says_only_that_it_is_up(keyed_server):
    r = httpx.get(keyed_server.url + "/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert "model-f32" not in r.text and "/" not in r.text


def test_health_with_the_key_shows_its_details(keyed_server, hybrid_gguf):
    h = httpx.get(keyed_server.url + "/health", headers=AUTH, timeout=30).json()
    assert h["status"] == "ok" and h["path"] == str(hybrid_gguf) and "notices" in h and "store" in h
    assert h["slots"] and h["context"] > 0
    lower = httpx.get(keyed_server.url + "/health", headers={"Authorization": f"bearer {KEY}"}, timeout=30).json()
    assert "path" in lower  # the scheme's case does not matter (RFC 7235)


def test_health_with_a_wrong_key_is_a_401(keyed_server):
    r = httpx.get(keyed_server.url + "/health", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert_openai_error(r, 401, "invalid_api_key")


def test_health_on_a_server_without_a_key_shows_its_details(open_server):
    h = httpx.get(open_server.url + "/health", timeout=30).json()
    assert "path" in h and "store" in h and "notices" in h


@pytest.mark.parametrize("header", [None, "", "Bearer", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x",
                                    f"Basic {KEY}", KEY, f"Bearer {KEY.upper()}", "Bearer \u00e9t\u00e9"])
def test_a_wrong_key_is_refused_and_generates_nothing(keyed_server, header):
    before = generated(keyed_server, AUTH)
    headers = {"Content-Type": "application/json"}
    if header is not None:
        headers["Authorization"] = header
    for path in ("/v1/completions", "/v1/models", "/metrics"):
        r = httpx.request("POST" if path == "/v1/completions" else "GET", keyed_server.url + path,
                          content=BODY.encode() if path == "/v1/completions" else None,
                          headers={k: v.encode("utf-8") for k, v in headers.items()}, timeout=60)
        assert_openai_error(r, 401, "invalid_api_key")
    assert generated(keyed_server, AUTH) == before


def test_the_right_key_is_served(keyed_server):
    r = httpx.post(keyed_server.url + "/v1/completions", content=BODY, timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_the_openai_client_works_with_the_key_and_is_refused_without(keyed_server):
    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = good.chat.completions.create(model="model-f32", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].message.role == "assistant"
    assert [m.id for m in good.models.list().data]
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="model-f32", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_keys_are_compared_in_constant_time(monkeypatch):
    from deltaserve.frontends.server import tenants
    from deltaserve.frontends.server.tenants import Keys

    seen = []
    real = tenants.hmac.compare_digest
    monkeypatch.setattr(tenants.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))

    fake = SimpleNamespace(keys=Keys.of("s3cret-\u00e9"))
    fake.identify = lambda r: server_app.Server.identify(fake, r)
    request = SimpleNamespace(headers={"authorization": "Bearer " + "s3cret-\u00e9".encode().decode("latin-1")})
    assert server_app.Server.authorized(fake, request) is True  # a non-ASCII key, sent as UTF-8, matches
    request.headers["authorization"] = "Bearer s3cret-e"
    assert server_app.Server.authorized(fake, request) is False
    assert server_app.Server.authorized(fake, SimpleNamespace(headers={})) is None
    assert len(seen) == 2 and all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in seen)


# -- the model a request names (item 8) -------------------------------------------------------------------
@pytest.mark.parametrize("model", ["model-f32.gguf", "model-f32", None])
def test_a_request_naming_the_served_model_or_an_alias_or_none_is_answered_by_it(open_server, hybrid_gguf, model):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if model is not None:
        body["model"] = model
    r = httpx.post(open_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == hybrid_gguf.name


@pytest.mark.parametrize("model", ["gpt-4o", "unused", ""])
def test_a_request_naming_a_model_not_served_is_a_404_that_names_the_served_one(open_server, hybrid_gguf, model):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": model}
    r = httpx.post(open_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and hybrid_gguf.name in err["message"]
