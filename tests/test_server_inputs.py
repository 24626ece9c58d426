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
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "system", "content": "only a system turn"}]})
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


@pytest.fixture(scope="module")
def real_vocab_server():
    """A server of a random model under the real 248,320-token vocabulary: a 4 MB prompt in it is really tokenized
    (its longest token is too long for the cheap lower bound on the token count to refuse the text unread)."""
    from tests.test_server_abandon import endless_model_path

    s = ServerProcess(endless_model_path(), "--slots", "1", "--threads", "1")
    yield s
    s.stop()


@pytest.mark.parametrize("which", ["server", "real_vocab_server"])
def test_a_4_mb_request_stalls_neither_a_running_stream_nor_health(which, request):
    import json as _json
    import threading
    import time

    server = request.getfixturevalue(which)

    big = {"messages": [{"role": "user", "content": "word " * (4 * 1024 * 1024 // 5 - 100)}], "max_tokens": 4}
    raw = _json.dumps(big).encode()
    assert 3.9e6 < len(raw) < 4 << 20  # under the default --max-body
    gaps, stop, streams = [], threading.Event(), [0]

    def stream():  # streams one after another until the large requests are answered: some overlap them
        body = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True}
        while not stop.is_set():
            last = None
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
            streams[0] += 1

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.3)
    rounds = []
    for n in (1, 3):  # one 4 MB request, then three at once
        answers, health, lines_before = [], 0, len(gaps)
        senders = [threading.Thread(target=lambda: answers.append(
            httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=120,
                       headers={"Content-Type": "application/json"}))) for _ in range(n)]
        for s in senders:
            s.start()
        while any(s.is_alive() for s in senders):
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            health += any(s.is_alive() for s in senders)  # answered while the large requests were still in work
            time.sleep(0.02)
        for s in senders:
            s.join()
        rounds.append((health, len(gaps) - lines_before))
        assert [a.status_code for a in answers] == [400] * n
        assert all(a.json()["error"]["code"] == "context_length_exceeded" for a in answers)
    stop.set()
    t.join(120)
    assert gaps and streams[0] >= 1
    print(f"{which}: (health answers, stream lines) while the large requests were in work, per round: {rounds}")
    # The mechanism, not a clock: the defect read and tokenized the body on the event loop, so nothing else was
    # answered until it was done (one /health at most got through, the stream stood still). Fixed, the loop keeps
    # answering /health polls and the stream keeps sending lines while the body is read and tokenized in the text pool.
    # (the small vocabulary's requests are refused from a lower bound on their token count in a moment: there only
    # the stream is counted; the real vocabulary's are tokenized for seconds: dozens of /health answers)
    for health, lines in rounds:
        assert lines >= 3, rounds
        assert health >= (10 if which == "real_vocab_server" else 0), rounds


def test_a_request_whose_client_left_stops_waiting_within_a_poll():
    """The watcher a non-streamed request (and one queued for a slot) waits under: the awaited work is cancelled,
    and ClientGone raised, once the client is seen gone. (An end-to-end check needs a generation that outlasts a
    poll; the random fixtures stop within a fraction of a second, so it is left to the next session.)"""
    import asyncio
    import time

    from deltaserve.frontends.server.app import ClientGone, until_gone

    class Leaving:
        def __init__(self, after: float):
            self.at = time.perf_counter() + after

        async def is_disconnected(self) -> bool:
            return time.perf_counter() >= self.at

    async def scenario():
        work = asyncio.ensure_future(asyncio.sleep(30))
        t0 = time.perf_counter()
        with pytest.raises(ClientGone):
            await until_gone(asyncio.shield(work), Leaving(0.2))
        waited = time.perf_counter() - t0
        assert not work.cancelled()  # the generation itself is stopped through its cancel flag, not cancelled here
        work.cancel()
        queued = asyncio.ensure_future(asyncio.sleep(30))
        with pytest.raises(ClientGone):
            await until_gone(queued, Leaving(0.1))
        await asyncio.sleep(0)
        assert queued.cancelled()  # a place in the queue is given up
        assert await until_gone(asyncio.sleep(0.01, result="done"), Leaving(10)) == "done"
        return waited

    assert asyncio.run(scenario()) < 1.0


def test_a_model_whose_weights_are_nan_stops_the_turn_with_a_clear_error(hybrid_gguf, tmp_path):
    import subprocess
    import sys

    from tests.gguf_edit import rewrite

    bad = rewrite(hybrid_gguf, tmp_path / "nan.gguf", fill=("output_norm.weight", float("nan")))
    proc = subprocess.run([sys.executable, "-m", "deltaserve", "run", str(bad), "--raw", "-p", "hello", "-n", "8",
                           "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout.strip() == ""
    assert "non-finite logits" in proc.stderr and "internal error" not in proc.stderr


@pytest.mark.parametrize("content", ["[1, 2]", "null", "\"text\""])
def test_a_config_json_that_is_not_an_object_is_one_clear_error(hybrid_hf_dir, tmp_path, content):
    import shutil

    from deltaserve.errors import ModelFormatError

    d = tmp_path / "model"
    shutil.copytree(hybrid_hf_dir, d)
    (d / "config.json").write_text(content)
    with pytest.raises(ModelFormatError, match="not an object"):
        deltaserve.load(d, cache=False)
