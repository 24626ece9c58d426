"""Sessions that share one backend keep what is theirs: each its own prefill plan, and `serve --revalidate` reaches
the guard the slots share."""

from __future__ import annotations

import os

import httpx

from deltaserve.runtime import capacity as cap
from deltaserve.runtime.capacity import Memory
from tests.server_proc import ServerProcess


def test_two_slots_planning_differently_prefill_each_by_its_own_plan(hybrid_model, monkeypatch):
    c = hybrid_model.config
    small = cap.PREFILL_PLANS[-1]
    # memory for the smallest prefill plan of a 4096-position state only: that session passes the others over
    tight = Memory(free=cap.plan(c, 4096, Memory(1 << 40, 1 << 40, "test"), plans=(small,)).total, total=1 << 34,
                   source="test")
    backend, _ = hybrid_model.backend("cpu")
    frugal = hybrid_model.session(backend=backend, plan_memory=tight, quiet=True)
    roomy = hybrid_model.session(backend=backend, quiet=True)
    spans = []
    real = backend.forward._run_steps  # every forward of a span, the engine loop's layer by layer included

    def spy(state, ids, chunked, all_logits, *args, **kwargs):
        spans.append((id(state), int(ids.numel())))
        return real(state, ids, chunked, all_logits, *args, **kwargs)

    monkeypatch.setattr(backend.forward, "_run_steps", spy)
    frugal.generate(list(range(3, 303)), max_tokens=1)   # plans first: the smallest plan
    roomy.generate(list(range(5, 305)), max_tokens=1)    # plans second: the largest
    spans.clear()
    frugal.reset()
    frugal.generate(list(range(7, 307)), max_tokens=1)   # must still prefill by its own plan
    mine = [n for s, n in spans if s == id(frugal.state)]
    assert frugal.state.prefill_rows == small.rows and roomy.state.prefill_rows == cap.PREFILL_PLANS[0].rows
    assert max(mine) <= small.rows and sum(mine) >= 300


def test_serve_revalidate_forces_a_new_parity_verdict(hybrid_gguf, tmp_path):
    env = {"DELTASERVE_CACHE_DIR": str(tmp_path)}
    verdicts = []
    for extra in ((), (), ("--revalidate",)):
        server = ServerProcess(hybrid_gguf, "--device", "faulty", "--slots", "2", *extra, env=env)
        try:
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
            notices = httpx.get(server.url + "/health", timeout=10).json()["notices"]
        finally:
            server.stop()
        verdicts.append([n for n in notices if "parity guard" in n])
    first, cached, forced = verdicts
    assert any("parity guard on faulty-test-device: accepted" in n for n in first)
    assert any("cached verdict for faulty-test-device" in n for n in cached)
    assert any("parity guard on faulty-test-device: accepted" in n for n in forced), forced
    assert not any("cached verdict" in n for n in forced)
    assert os.listdir(tmp_path / "guard")
