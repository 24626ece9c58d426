"""Accelerator failures at every stage: one loud notice, the session moves to the CPU, replays, and goes on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import pytest

from deltaserve.runtime import guard as guard_mod
from deltaserve.runtime.backend import FaultyBackend
from deltaserve.runtime.guard import ParityGuard
from deltaserve.formats import source
from deltaserve.session.resident import FALLBACK_PREFIX


def run_conversation(session, model, max_tokens=12):
    """Three turns a chat client would send: a question, the same question again (a regenerate), and the
    history re-rendered with the answer and a follow-up. Checks no token is handed out twice."""
    tok = model.tokenizer

    def render(messages):
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False))

    def turn(prompt):
        seen = []
        t = session.generate(prompt, max_tokens=max_tokens, on_token=lambda tid, txt: seen.append(tid))
        assert [x for x in seen if x is not None] == t.tokens, "a token was handed out twice or lost"
        return t

    q = [{"role": "user", "content": "Tell me about the sea."}]
    first = turn(render(q))
    again = turn(render(q))
    follow = turn(render(q + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the sky?"}]))
    return [first, again, follow]


@pytest.fixture(scope="module")
def cpu_turns(hybrid_model):
    return run_conversation(hybrid_model.session(device="cpu", quiet=True), hybrid_model)


@pytest.mark.parametrize("stage,after", [("init", 0), ("upload", 0), ("alloc", 0), ("alloc", 1), ("prefill", 0),
                                         ("prefill", 2), ("decode", 0), ("decode", 4), ("restore", 0), ("guard", 0)])
def test_an_accelerator_failure_moves_the_session_to_the_cpu_and_the_conversation_goes_on(
        hybrid_model, cpu_turns, stage, after):
    backend = FaultyBackend(hybrid_model.host, stage=stage, after=after, device_name=f"faulty-{uuid.uuid4().hex[:8]}")
    s = hybrid_model.session(backend=backend, guard=ParityGuard(revalidate=True), quiet=True)
    turns = run_conversation(s, hybrid_model)
    assert [t.tokens for t in turns] == [t.tokens for t in cpu_turns]
    fallbacks = [n for n in s.notices if n.startswith(FALLBACK_PREFIX)]
    assert len(fallbacks) == 1, s.notices
    assert f"injected {stage}" in fallbacks[0] or (stage == "guard" and "parity guard rejected" in fallbacks[0])
    assert not s.on_accelerator and s.backend.name == "cpu"
    assert all(t.backend == "cpu" for t in turns[1:])


def test_without_a_failure_the_test_accelerator_serves_the_whole_conversation(hybrid_model, cpu_turns):
    s = hybrid_model.session(backend=FaultyBackend(hybrid_model.host, device_name=f"ok-{uuid.uuid4().hex[:8]}"),
                             guard=ParityGuard(revalidate=True), quiet=True)
    turns = run_conversation(s, hybrid_model)
    assert [t.tokens for t in turns] == [t.tokens for t in cpu_turns]
    assert s.on_accelerator and not any(n.startswith(FALLBACK_PREFIX) for n in s.notices)
    assert any("parity guard on" in n and "accepted" in n for n in s.notices)
    assert turns[1].start == "checkpoint" and turns[2].start == "checkpoint"


def test_a_capacity_refusal_is_an_error_not_a_fallback(hybrid_model):
    from deltaserve.runtime.capacity import Memory
    from deltaserve.errors import CapacityError

    with pytest.raises(CapacityError, match="does not fit"):
        hybrid_model.session(backend=FaultyBackend(hybrid_model.host), plan_positions=4096, quiet=True,
                             plan_memory=Memory(free=1 << 20, total=1 << 30, source="faulty: test"))


def test_the_model_file_is_hashed_once_per_process(hybrid_model, monkeypatch):
    hashed = []
    real = source.hash_files
    monkeypatch.setattr(source, "hash_files", lambda p: hashed.append(p) or real(p))
    monkeypatch.setattr(source, "_HASHES", {})  # forget earlier tests' hashes: this process hashes it now
    for _ in range(3):
        s = hybrid_model.session(backend=FaultyBackend(hybrid_model.host, device_name=f"h-{uuid.uuid4().hex[:8]}"),
                                 guard=ParityGuard(revalidate=True), quiet=True)
        s.generate([1, 2, 3, 4], max_tokens=3)
        s.generate([1, 2, 3, 4, 5, 6], max_tokens=3)
    assert len(hashed) == 1


def run_cli(*args, cache):
    env = dict(os.environ, DELTASERVE_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "deltaserve.frontends.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_the_guards_verdict_is_cached_and_a_second_process_skips_the_comparison(tmp_path, hybrid_gguf):
    args = ("run", str(hybrid_gguf), "-p", "hello there", "-n", "4", "--device", "faulty")
    first = run_cli(*args, cache=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "parity guard on faulty-test-device: accepted" in first.stderr
    assert list((tmp_path / "guard").glob("*.json"))
    second = run_cli(*args, cache=tmp_path)
    assert second.returncode == 0 and re.search(r"cached verdict for faulty-test-device from \d+ s ago: accepted",
                                                second.stderr), second.stderr
    assert "parity guard on" not in second.stderr
    third = run_cli(*args, "--revalidate", cache=tmp_path)
    assert third.returncode == 0 and "parity guard on faulty-test-device: accepted" in third.stderr
    assert first.stdout == second.stdout == third.stdout


def test_a_cached_rejection_sends_the_next_process_to_the_cpu(tmp_path, hybrid_gguf):
    bad = run_cli("run", str(hybrid_gguf), "-p", "hi", "-n", "3", "--device", "faulty:guard", cache=tmp_path)
    assert bad.returncode == 0 and "REJECTED" in bad.stderr and FALLBACK_PREFIX in bad.stderr
    again = run_cli("run", str(hybrid_gguf), "-p", "hi", "-n", "3", "--device", "faulty", cache=tmp_path)
    assert re.search(r"cached verdict for faulty-test-device from \d+ s ago: rejected", again.stderr), again.stderr
    assert FALLBACK_PREFIX in again.stderr
    assert bad.stdout == again.stdout


def test_the_guard_compares_cosine_and_argmax():
    import torch

    a = torch.randn(8, 50)
    assert guard_mod.compare(a, a.clone()) == pytest.approx((1.0, 1.0))
    cos, agree = guard_mod.compare(a, -a)
    assert cos < 0 and agree == 0.0


def test_a_turn_replayed_on_the_cpu_reports_the_cpus_figures_and_saves_its_checkpoint_there(hybrid_model):
    backend = FaultyBackend(hybrid_model.host, stage="prefill", after=2, device_name=f"f-{uuid.uuid4().hex[:8]}")
    s = hybrid_model.session(backend=backend, quiet=True)
    ids = hybrid_model.render([{"role": "user", "content": "Tell me about the sea."}], False)[0]
    first = s.generate(ids, max_tokens=4)  # the accelerator fails after the checkpoint cut, mid-prompt
    assert first.backend == "cpu" and first.start == "replay" and first.replayed == len(ids)
    assert (first.reused, first.prefilled) == (0, len(ids))  # the CPU prefilled all of it
    assert s.checkpoint_length == max(i for i, t in enumerate(ids) if t == hybrid_model.tokenizer.im_start_id)
    again = s.generate(ids, max_tokens=4)
    assert again.start == "checkpoint" and again.reused == s.checkpoint_length and again.tokens == first.tokens


def _grow_under(hybrid_model, free_for):
    """A resident session on the test accelerator whose device memory, once its first 4096-position state is
    allocated, is `free_for(plans)` bytes; its second turn must grow the state to 8192 positions."""
    from deltaserve.engine.state import DecodeState
    from deltaserve.runtime import capacity as cap

    backend = FaultyBackend(hybrid_model.host, device_name=f"grow-{uuid.uuid4().hex[:8]}")
    s = hybrid_model.session(backend=backend, quiet=True)
    rng = __import__("random").Random(3)
    short = [rng.randrange(10, 600) for _ in range(20)]
    long = short + [rng.randrange(10, 600) for _ in range(4200)]
    s.generate(short, max_tokens=2)
    assert s.capacity == 4096 and s.on_accelerator

    def need(plan):
        return cap.plan(hybrid_model.config, 8192, cap.Memory(1 << 40, 1 << 40, "t"), overhead=backend.overhead,
                        plans=(plan,), kv_type=s.kv_type).total - DecodeState.bytes_for(hybrid_model.config, 4096,
                                                                                          kv_type=s.kv_type)

    # the device's memory: what the test asks to be free with the 4096-position state held, and that state
    backend.memory_bytes = free_for(need) + s.state.nbytes
    turn = s.generate(long, max_tokens=3)
    want = hybrid_model.session(device="cpu", quiet=True).generate(long, max_tokens=3)
    assert turn.tokens == want.tokens
    return s, turn


def test_a_state_that_cannot_grow_on_the_device_with_batched_prefill_prefills_one_token_at_a_time_there(hybrid_model):
    from deltaserve.runtime import capacity as cap

    s, turn = _grow_under(hybrid_model, lambda need: (need(cap.PrefillPlan(1, 1)) + need(cap.PREFILL_PLANS[-1])) // 2)
    assert s.on_accelerator and turn.backend != "cpu" and s.capacity == 8192
    assert any("prefilling one token at a time" in n for n in s.notices), s.notices
    assert s.batched_prefills == 1  # the first turn's only


def test_prefilling_one_token_at_a_time_is_decided_per_prefill_and_its_notice_names_each_refused_plan(hybrid_model):
    """The one-token fallback is not sticky (issue 37): once the device's memory is free again, the next prefill is
    batched, and says so; the fallback's notice names what each refused batched plan needed."""
    from deltaserve.runtime import capacity as cap

    s, _ = _grow_under(hybrid_model, lambda need: (need(cap.PrefillPlan(1, 1)) + need(cap.PREFILL_PLANS[-1])) // 2)
    notice = next(n for n in s.notices if "prefilling one token at a time" in n)
    for p in cap.PREFILL_PLANS:
        assert f"{p.label} needs " in notice, notice
    assert s.batched_prefills == 1
    s.backend.memory_bytes = 1 << 40  # the device's memory free again
    rng = __import__("random").Random(5)
    follow = [rng.randrange(10, 600) for _ in range(40)]
    turn = s.generate(follow, max_tokens=2)
    assert s.on_accelerator and s.batched_prefills == 2, s.notices
    assert any("a batched prefill fits 8192 positions" in n and "again" in n for n in s.notices), s.notices
    assert turn.tokens == hybrid_model.session(device="cpu", quiet=True).generate(follow, max_tokens=2).tokens


def test_a_resident_state_that_cannot_grow_on_the_device_at_all_moves_the_session_to_the_cpu_loudly(hybrid_model):
    from deltaserve.runtime import capacity as cap

    s, turn = _grow_under(hybrid_model, lambda need: need(cap.PrefillPlan(1, 1)) - (1 << 20))
    assert not s.on_accelerator and turn.backend == "cpu" and s.capacity == 8192
    fallbacks = [n for n in s.notices if n.startswith(FALLBACK_PREFIX)]
    assert len(fallbacks) == 1 and "cannot grow to 8192 positions" in fallbacks[0], s.notices
