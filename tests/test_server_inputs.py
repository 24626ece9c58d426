"""Inputs that once gave a 500 or an unclear error (issue 16): each a 400 with an OpenAI error body that names the
problem, and the server goes on answering; a failed checkpoint restore on the CPU forgets the state."""

from __future__ import annotations

import httpx
import pytest

import deltaserve
from deltaserve.errors import BackendError
from deltaserve.runtime.backend import FaultyBackend
from tests.server_proc import ServerProcess


@pytest.fixture(scope="module")
def server(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "1", "--think", "off")
    yield s
    s.stop()


def post(server, path: str, body, raw: bool = False) -> httpx.Response:
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if raw else {"json": body}
    return httpx.post(server.url + path, timeout=60, **kw)


def still_answers(server) -> None:
    r = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("depth", [900, 1000, 5000])
def test_json_nested_deeper_than_the_parser_goes_is_a_400_not_a_500(server, depth):
    r = post(server, "/v1/chat/completions", "[" * depth + "]" * depth, raw=True)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    still_answers(server)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}', "messages"),
    ("/v1/completions", '{"prompt": "hi \\udfff"}', "prompt"),
])
def test_a_lone_surrogate_is_a_400_that_names_it(server, path, body, param):
    r = post(server, path, body, raw=True)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "lone surrogate" in err["message"]
    still_answers(server)


def test_a_template_refusal_says_so_once(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                                            {"role": "system", "content": "late system"}]})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.count("the chat template refused the conversation") == 1


def test_a_failed_checkpoint_restore_on_the_cpu_is_a_clear_error_and_forgets_the_state(hybrid_model):
    backend = FaultyBackend(hybrid_model.host, stage="restore", accelerator=False)
    s = hybrid_model.session(backend=backend, quiet=True)
    tok = hybrid_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me"}], add_generation_prompt=True,
                                                enable_thinking=False))
    first = s.generate(prompt, max_tokens=3)
    assert s.checkpoint_length > 0
    with pytest.raises(BackendError, match="would not restore"):
        s.generate(prompt, max_tokens=3)  # the same prompt again: a checkpoint restore, which fails once
    assert s.held == [] and s.checkpoint_length == 0  # nothing half-valid kept
    again = s.generate(prompt, max_tokens=3)  # and the session goes on, from a reset
    assert again.start == "reset" and again.tokens == first.tokens


def test_a_guarded_session_hashes_the_model_before_its_first_turn(hybrid_model, monkeypatch):
    from deltaserve.formats import source

    hashed = []
    real = source.hash_files
    monkeypatch.setattr(source, "hash_files", lambda p: hashed.append(p) or real(p))
    monkeypatch.setattr(source, "_HASHES", {})
    s = hybrid_model.session(device="faulty", quiet=True)
    assert len(hashed) == 1  # at the session's start, not in the turn
    t = s.generate([1, 2, 3, 4], max_tokens=2)
    assert len(hashed) == 1 and t.generated >= 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a torch without CUDA")
def test_the_no_cuda_notice_is_kept_and_said_through_the_python_api(hybrid_model, capsys):
    s = hybrid_model.session(device="auto")
    assert any("no CUDA device visible" in n for n in s.notices)
    assert "no CUDA device visible" in capsys.readouterr().err
