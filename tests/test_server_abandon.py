"""A request whose client has gone stops generating: its slot is free again within a decode step or two of the
client leaving, and nobody's tokens are generated for nothing (issue 16, item 2, end to end).

The model is a random one under the real Qwen3.5 vocabulary: its answers do not end by chance (one token in
248,320 ends them), so a generation outlasts the client by as long as the test likes.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.fixtures import models as fx
from tests.server_proc import ServerProcess


def endless_model_path():
    from tools.bench.randmodel import write_random_gguf

    out = fx.fixtures_dir() / "tiny-real-vocab-q8_0.gguf"
    with fx._locked(out):
        return write_random_gguf("tiny", out, "q8_0")


@pytest.fixture(scope="module")
def endless_model():
    return endless_model_path()


def slot_state(url: str) -> list[dict]:
    return httpx.get(url + "/health", timeout=5).json()["slots"]


def decode_rate(url: str) -> float:
    """Tokens a second this server decodes one conversation at (a streamed request of 64 tokens)."""
    body = {"prompt": "a b c", "max_tokens": 64, "temperature": 0, "stream": True}
    stamps = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    assert len(stamps) >= 32
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def wait_until_free(url: str, deadline_s: float = 120) -> None:
    """Until the slot is free; a slot still busy after `deadline_s` (a liveness bound, far past any decode step: the
    defect kept it busy for its whole budget) fails the test."""
    t0 = time.monotonic()
    while slot_state(url)[0]["busy"]:
        assert time.monotonic() - t0 < deadline_s, f"the slot is still busy {deadline_s:.0f} s after its client left"
        time.sleep(0.01)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_an_abandoned_non_streamed_request_frees_its_slot_within_a_decode_step_of_the_client_leaving(
        endless_model, route):
    with ServerProcess(endless_model, "--slots", "1", "--threads", "1") as srv:
        rate = decode_rate(srv.url)
        body = {"max_tokens": 4096, "temperature": 0}
        body.update({"prompt": "tell me everything"} if route == "/v1/completions" else
                    {"messages": [{"role": "user", "content": "tell me everything"}]})
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + route, json=body, timeout=httpx.Timeout(connect=5, read=1.0, write=5, pool=5))
        wait_until_free(srv.url)  # the client has closed its connection
        held = slot_state(srv.url)[0]["held_tokens"]
        # the mechanism, not a clock: the generation stopped when its client left (the watcher polls every 50 ms,
        # the generation stops at its next token), so the slot holds the prompt and the ~1 s of tokens the client
        # waited for; the defect ran the request to its full budget of 4,096 tokens
        print(f"held {held} tokens at {rate:.0f} tok/s")
        assert held < 4096 // 2, (held, rate)
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200  # the slot serves the next client at once


def test_a_queued_stream_whose_client_left_gives_up_its_place_and_never_runs(endless_model):
    import threading

    with ServerProcess(endless_model, "--slots", "1", "--threads", "1") as srv:
        long = {"prompt": "go on", "max_tokens": 4096, "temperature": 0}
        outcome = {}

        def holder():  # takes the slot, and leaves after 3 s
            try:
                httpx.post(srv.url + "/v1/completions", json=long, timeout=httpx.Timeout(5, read=3.0))
            except httpx.ReadTimeout:
                outcome["holder"] = time.perf_counter()

        def queued():  # waits in the queue behind it, and leaves after 1 s of silence
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", json=dict(long, stream=True),
                                  timeout=httpx.Timeout(5, read=1.0)) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.ReadTimeout:
                outcome["queued"] = time.perf_counter()

        a = threading.Thread(target=holder)
        a.start()
        while not slot_state(srv.url)[0]["busy"]:
            time.sleep(0.01)
        b = threading.Thread(target=queued)
        b.start()
        a.join(30)
        b.join(30)
        assert set(outcome) == {"holder", "queued"} and outcome["queued"] < outcome["holder"]
        served = slot_state(srv.url)[0]["requests"]
        wait_until_free(srv.url)
        time.sleep(0.5)  # the queued request, had it kept its place, would have the slot now
        health = httpx.get(srv.url + "/health", timeout=5).json()
        assert not health["slots"][0]["busy"] and health["queue"]["waiting"] == 0
        assert health["slots"][0]["requests"] == served
