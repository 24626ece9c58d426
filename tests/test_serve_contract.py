"""The session's contract held in `serve` too (issue 37), on the fault-injecting device: every slot's route decisions
in the log, named by slot; the batched prefills logged and counted; a context that cut an answer said; what a
fallback replayed reported; the parity guard's cached verdict keyed by what could change it, said with its age,
and decided again when too old."""

from __future__ import annotations

import json
import os
import re
import time
import uuid

import httpx
import pytest

from deltaserve.runtime.backend import FaultyBackend
from deltaserve.runtime.guard import ParityGuard
from deltaserve.session.resident import FALLBACK_PREFIX
from tests.server_proc import ServerProcess


def chat(server: ServerProcess, text: str, max_tokens: int = 8) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def faulty_server(hybrid_gguf, tmp_path_factory):
    """Two slots on one test accelerator that fails from its 7th decode step on: each slot falls back in turn."""
    cache = tmp_path_factory.mktemp("guard-cache")
    server = ServerProcess(hybrid_gguf, "--slots", "2", "--device", "faulty:decode:6", "--ctx", "96",
                           env={"DELTASERVE_CACHE_DIR": str(cache)})
    try:
        answers = [chat(server, "Tell me about the sea."), chat(server, "And now about the mountains, please.")]
        capped = chat(server, " ".join(["word"] * 18), max_tokens=60)
        yield server, answers, capped
    finally:
        server.stop()


def slot_lines(log: str, slot: int) -> list[str]:
    return [x for x in log.splitlines() if f"[slot {slot}]" in x]


def test_every_slots_fallback_backend_line_and_guard_verdict_reach_the_log_named_by_slot(faulty_server):
    server, _, _ = faulty_server
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert [s["backend"] for s in health["slots"]] == ["cpu", "cpu"]
    log = server.stderr
    for slot in (0, 1):
        lines = slot_lines(log, slot)
        assert sum("accelerator failure" in x for x in lines) == 1, lines
        assert any("Backend: test accelerator" in x for x in lines), lines
        assert any("Backend: CPU" in x and "after the fallback" in x for x in lines), lines
        assert any("parity guard" in x for x in lines), lines
        assert any("replaying" in x and "tokens on the CPU" in x for x in lines), lines


def test_a_fallback_in_a_one_call_generate_is_said(hybrid_model, capfd):
    turn = hybrid_model.generate(list(range(5, 30)), max_tokens=4, device="faulty:decode:0")
    assert turn.backend == "cpu"
    assert FALLBACK_PREFIX in capfd.readouterr().err


def test_serve_logs_each_batched_prefill_named_by_slot_and_counts_them_in_metrics(faulty_server):
    server, _, _ = faulty_server
    prefills = [x for x in server.stderr.splitlines() if "batched prefill:" in x]
    assert prefills and all(re.search(r"\[slot [01]\] batched prefill: \d+ tokens", x) for x in prefills), prefills
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    counts = {m.group(1): float(m.group(2))
              for m in re.finditer(r'deltaserve_slot_batched_prefills\{slot="(\d)"\} ([\d.]+)', metrics)}
    assert set(counts) == {"0", "1"} and sum(counts.values()) >= len(prefills) > 0
    assert re.search(r'deltaserve_slot_replays\{slot="0"\} 1', metrics) and \
        re.search(r'deltaserve_slot_replays\{slot="1"\} 1', metrics), metrics
    assert re.search(r'deltaserve_slot_on_accelerator\{slot="0"\} 0', metrics)


def test_the_prefill_log_can_be_turned_down(hybrid_gguf):
    with ServerProcess(hybrid_gguf, "--slots", "1", "--prefill-log", "off") as server:
        chat(server, "Tell me about the sea.")
        assert "batched prefill:" not in server.stderr
        assert httpx.get(server.url + "/health", timeout=10).json()["slots"][0]["batched_prefills"] >= 1


def test_serve_says_when_the_context_cut_an_answer(faulty_server):
    server, answers, capped = faulty_server
    choice = capped["choices"][0]
    assert choice["finish_reason"] == "length" and choice["context_capped"] is True
    assert capped["usage"]["completion_tokens"] < 60
    assert "context_capped" not in answers[0]["choices"][0]
    assert any("cut the answer at" in x and "max_tokens 60" in x for x in server.stderr.splitlines())


def test_a_turn_replayed_after_a_decode_fallback_reports_what_ran(hybrid_model):
    backend = FaultyBackend(hybrid_model.host, stage="decode", after=3, device_name=f"r-{uuid.uuid4().hex[:8]}")
    s = hybrid_model.session(backend=backend, quiet=True)
    ids = hybrid_model.render([{"role": "user", "content": "Tell me about the sea."}], False)[0]
    s.generate(ids, max_tokens=2)  # the first turn: on the device, a checkpoint before its generation header
    turn = s.generate(ids, max_tokens=8)  # resumes from the checkpoint; decode fails mid-answer
    assert turn.backend == "cpu" and turn.start == "replay" and turn.reused == 0 and turn.prefilled == len(ids)
    assert len(ids) < turn.replayed < len(ids) + 8  # the prompt and the answer so far, run again on the CPU
    assert turn.tokens == hybrid_model.generate(ids, max_tokens=8).tokens


# -- the parity guard's cached verdict ------------------------------------------------------------------------------

def probe(hybrid_model, guard, backend) -> list[str]:
    said: list[str] = []
    backend.start()
    assert guard(backend, hybrid_model.host, list(range(5, 60)), said.append) is None
    return said


def test_a_cached_verdict_is_said_with_its_age_and_decided_again_when_too_old(hybrid_model, tmp_path):
    backend = FaultyBackend(hybrid_model.host, device_name=f"age-{uuid.uuid4().hex[:8]}")
    first = probe(hybrid_model, ParityGuard(directory=tmp_path), backend)
    assert any("parity guard on" in x and "accepted" in x for x in first)
    cached = probe(hybrid_model, ParityGuard(directory=tmp_path), backend)
    assert len(cached) == 1 and re.search(r"cached verdict for age-\w+ from \d+ s ago: accepted", cached[0]), cached
    (path,) = tmp_path.glob("*.json")
    v = json.loads(path.read_text())
    v["time"] = time.time() - 2 * 24 * 3600
    path.write_text(json.dumps(v))
    again = probe(hybrid_model, ParityGuard(directory=tmp_path), backend)
    assert "48.0 h old, more than 24.0 h (--guard-max-age): probing again" in again[0], again
    assert any("parity guard on" in x for x in again[1:])
    assert json.loads(path.read_text())["time"] > time.time() - 60


def test_a_cached_verdict_belongs_to_its_torch_version_and_device_identity(hybrid_model, tmp_path, monkeypatch):
    backend = FaultyBackend(hybrid_model.host, device_name="same-name")
    probe(hybrid_model, ParityGuard(directory=tmp_path), backend)
    monkeypatch.setattr(FaultyBackend, "device_identity", "same-name, another driver", raising=False)
    other_driver = probe(hybrid_model, ParityGuard(directory=tmp_path), backend)
    assert not any("cached verdict" in x for x in other_driver), other_driver
    monkeypatch.setattr("torch.__version__", "9.9.9")
    other_torch = probe(hybrid_model, ParityGuard(directory=tmp_path), backend)
    assert not any("cached verdict" in x for x in other_torch), other_torch
    assert len(list(tmp_path.glob("*.json"))) == 3
    assert os.environ.get("DELTASERVE_CACHE_DIR")  # the tests' own cache: nothing of a user's is read
