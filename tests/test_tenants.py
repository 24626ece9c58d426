"""Issue 53, item 12 (What to build 3): the prefix cache was an oracle across clients (client B guessed A's PIN from
`cached_tokens`: only the right guess was > 0), and with one key any holder could read or delete any stored response.
With several keys each key is a tenant: its cached prefixes, states and stored responses are its own; `cache_salt`
partitions further within a key. One slot serves both tenants here, so the slot's own held state is tested too."""

from __future__ import annotations

import httpx
import pytest

from deltaserve.errors import DeltaserveError
from deltaserve.frontends.server.tenants import Keys, partition, read_keys_file
from tests.server_proc import ServerProcess

A, B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"


@pytest.fixture(scope="module")
def server(hybrid_gguf, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"# tenants\nbob {B}\n")
    keys.chmod(0o600)
    s = ServerProcess(hybrid_gguf, "--slots", "1", "--think", "off", "--api-key", A, "--api-keys-file", str(keys),
                      "--state-dir", str(tmp_path_factory.mktemp("state")))
    yield s
    s.stop()


def chat(server, key: str, messages: list[dict], **extra) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"messages": messages, "max_tokens": 3, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def conversation(pin: str) -> list[dict]:
    return [{"role": "system", "content": "You keep secrets."},
            {"role": "user", "content": f"My PIN is {pin}. Remember it."},
            {"role": "assistant", "content": "I will."},
            {"role": "user", "content": "What is my PIN?"}]


def test_one_tenants_cached_prefix_is_never_matched_for_another(server):
    chat(server, A, conversation("4821"))
    again = chat(server, A, conversation("4821") + [{"role": "assistant", "content": "ok"},
                                                    {"role": "user", "content": "Thanks."}])
    assert cached(again) > 0  # the cache works within a tenant
    guesses = [cached(chat(server, B, conversation(pin) + [{"role": "assistant", "content": "ok"},
                                                           {"role": "user", "content": "Thanks."}]))
               for pin in ("1111", "4821", "9999")]
    assert guesses == [0, 0, 0]  # B learns nothing: the right guess is not cached for it


def test_cache_salt_partitions_within_a_key(server):
    base = [{"role": "user", "content": "A salted conversation about owls."}]
    follow = base + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "More."}]
    chat(server, A, base, cache_salt="salt-one")
    assert cached(chat(server, A, follow, cache_salt="salt-two")) == 0
    assert cached(chat(server, A, follow)) == 0
    assert cached(chat(server, A, follow, cache_salt="salt-one")) > 0


def test_a_stored_response_of_one_tenant_is_a_404_for_another(server):
    def call(method, path, key, **kw):
        return httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=120, **kw)

    r = call("POST", "/v1/responses", A, json={"input": "My PIN is 4821.", "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    assert call("GET", f"/v1/responses/{rid}", B).status_code == 404
    assert call("GET", f"/v1/responses/{rid}/input_items", B).status_code == 404
    assert call("DELETE", f"/v1/responses/{rid}", B).status_code == 404
    follow = call("POST", "/v1/responses", B, json={"input": "What is it?", "max_output_tokens": 2,
                                                    "previous_response_id": rid})
    assert follow.status_code == 400 and follow.json()["error"]["code"] == "previous_response_not_found"
    assert call("GET", f"/v1/responses/{rid}", A).status_code == 200  # still there for its own tenant
    assert call("DELETE", f"/v1/responses/{rid}", A).status_code == 200


def test_health_says_how_many_tenants_and_a_wrong_key_is_still_a_401(server):
    assert httpx.get(server.url + "/health", headers={"Authorization": "Bearer sk-nobody"}, timeout=30).status_code == 401
    assert "2 API keys, each a tenant of its own" in server.stderr


def test_keys_files_and_partitions(tmp_path):
    f = tmp_path / "keys"
    f.write_text("\n# a comment\nalice sk-a\nsk-b\n")
    f.chmod(0o600)
    assert read_keys_file(str(f)) == [("alice", "sk-a"), (None, "sk-b")]
    keys = Keys.of(["sk-c"], str(f))
    assert keys.tenants == 3 and keys.match(b"sk-a").tenant == "alice" and keys.match(b"sk-x") is None
    assert keys.match(b"sk-b").tenant.startswith("key-") and "sk-b" not in keys.match(b"sk-b").tenant
    single = Keys.of("sk-only")
    assert single.tenants == 1 and single.match(b"sk-only").tenant is None  # single-tenant: today's partition
    assert partition(None, None) is None and partition("a", None) != partition("b", None) != partition("a", "s")
    f.write_text("alice sk-a extra\n")
    with pytest.raises(DeltaserveError, match="line 1"):
        read_keys_file(str(f))
    with pytest.raises(DeltaserveError, match="twice"):
        Keys.of(["sk-a", "sk-a"])
