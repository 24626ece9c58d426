"""The capacity plan: what a call needs against the measured free memory, refused with the arithmetic."""

from __future__ import annotations

import subprocess
import sys

import pytest

import deltaserve
from tests.fakes import count_state_allocations
from deltaserve.runtime import capacity as cap
from deltaserve.runtime.capacity import Memory, cpu_memory
from deltaserve.errors import CapacityError
from tests.gguf_edit import rewrite

MiB = 1 << 20


def expected_total(c, positions: int, plan: cap.PrefillPlan, weights: int, overhead: int) -> int:
    """The sum, computed here from the config's numbers (not from the Plan object)."""
    kv = positions * 2 * c.num_kv_heads * c.head_dim * 4 * sum(1 for t in c.layer_types if t == "full_attention")
    state = sum(c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
                + (c.conv_kernel - 1) * (2 * c.linear_num_key_heads * c.linear_key_head_dim
                                         + c.linear_num_value_heads * c.linear_value_head_dim) * 4
                for t in c.layer_types if t != "full_attention")
    return weights + kv + state + cap.workspace_bytes(c, plan, positions) + overhead


def test_the_refusal_message_carries_the_arithmetic(hybrid_model):
    import re

    c = hybrid_model.config
    positions = 16384
    memory = Memory(free=300 * MiB, total=24000 * MiB, source="cpu: MemAvailable")
    weights = 1520 * MiB
    with pytest.raises(CapacityError) as e:
        cap.plan(c, positions, memory, weights=weights, overhead=cap.CPU_OVERHEAD,
                 plans=(cap.PrefillPlan(2048, 512),))
    kv = positions * 512  # 2 x 2 KV heads x 32 dims x 4 bytes x 1 attention layer = 512 B per position
    state = c.recurrent_state_bytes()
    msg = str(e.value)
    m = re.fullmatch(r"the plan for 16384 positions does not fit: weights 1520 MiB \+ KV (\d+) MiB "
                     r"\(16384 positions x 0\.5 KiB f32\) \+ state (\d+) MiB \+ workspace (\d+) MiB \+ overhead 256 MiB = "
                     r"(\d+) MiB, against 300 MiB free of 24000 MiB \(cpu: MemAvailable\)", msg)
    assert m, msg
    kv_mib, state_mib, work_mib, total_mib = map(int, m.groups())
    assert kv_mib == round(kv / MiB) and state_mib == round(state / MiB)
    assert work_mib > 0 and abs(total_mib - (1520 + kv / MiB + state / MiB + work_mib + 256)) <= 1.5  # the sum


def test_the_planned_workspace_covers_what_a_prefill_really_takes(hybrid_gguf):
    """The oracle is the process itself: the peak resident memory a prefill of a plan's rows adds, measured in a
    fresh process, must stay within the workspace the plan counts for it."""
    script = f"""
import deltaserve
from deltaserve.runtime import capacity as cap
def hwm():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024
m = deltaserve.load({str(hybrid_gguf)!r}, threads=1)
from deltaserve.engine.forward import Forward
f = Forward(m.config, m.host.weights)
plan = cap.PREFILL_PLANS[1]
st = f.new_state(4096, prefill_rows=plan.rows, query_rows=plan.query_rows)
f.prefill(st, [5] * 8)  # the first call's one-time allocations (kernels, caches) are not the workspace
f.prefill(st, [10 + i % 600 for i in range(plan.rows)])
before = hwm()
st.reset()
f.prefill(st, [10 + i % 600 for i in range(2 * plan.rows)])
print(hwm() - before, cap.workspace_bytes(m.config, plan, 4096))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    grew, planned = map(int, proc.stdout.split())
    assert grew <= planned, f"a prefill took {grew} bytes more at its peak; the plan counts {planned}"


def test_the_first_prefill_plan_that_fits_is_taken_and_the_others_named(hybrid_model):
    c = hybrid_model.config
    positions = 262144
    big, small = cap.PREFILL_PLANS[0], cap.PREFILL_PLANS[-1]
    need_small = expected_total(c, positions, small, 0, cap.CPU_OVERHEAD)
    need_big = expected_total(c, positions, big, 0, cap.CPU_OVERHEAD)
    assert need_small < need_big
    p = cap.plan(c, positions, Memory(free=need_small, total=4 * need_big, source="test"))
    assert p.prefill == small and p.total == need_small
    assert len(p.passed_over) == len(cap.PREFILL_PLANS) - 1
    assert f"needs {round(need_big / MiB)} MiB" in p.passed_over[0]


def test_a_plan_that_fits_is_not_refused(hybrid_model):
    p = cap.plan(hybrid_model.config, 4096, cpu_memory(), weights=hybrid_model.host.weights.nbytes)
    assert p.fits and p.total < cpu_memory().free


def test_a_session_that_cannot_grow_is_refused_before_it_allocates(hybrid_gguf, monkeypatch):
    # on the CPU a refusal is the answer (a CUDA session goes on on the CPU instead: test_fallback.py)
    hybrid_model = deltaserve.load(hybrid_gguf, device="cpu", kv_type="f32")  # 512 bytes a position
    c = hybrid_model.config
    # enough for 4096 positions; 8192 do not fit even counting the 4096-position state freed first
    old_state = 4096 * 512 + c.recurrent_state_bytes()
    free = expected_total(c, 8192, cap.PREFILL_PLANS[-1], 0, cap.CPU_OVERHEAD) - old_state - 1
    assert expected_total(c, 4096, cap.PREFILL_PLANS[-1], 0, cap.CPU_OVERHEAD) <= free
    tight = Memory(free=free, total=1 << 34, source="test")
    s = hybrid_model.session(quiet=True, plan_memory=tight)
    s.generate([1, 2, 3], max_tokens=2)
    assert s.capacity == 4096
    allocations = count_state_allocations(monkeypatch)
    with pytest.raises(CapacityError, match="the plan for 8192 positions does not fit"):
        s.generate([5] * 4100, max_tokens=2)
    assert not allocations  # refused, not attempted
    assert s.state is not None and s.capacity == 4096  # and the old state is still there


def test_a_cpu_context_larger_than_the_machine_is_refused_before_any_allocation(tmp_path, hybrid_gguf, monkeypatch):
    huge = rewrite(hybrid_gguf, tmp_path / "huge-context.gguf", meta={"qwen35.context_length": 1 << 31})
    model = deltaserve.load(huge, cache=False)  # the default f16 KV cache: 256 bytes a position
    allocations = count_state_allocations(monkeypatch)
    s = model.session(one_call=True, quiet=True)
    with pytest.raises(CapacityError) as e:
        s.generate([1, 2, 3], max_tokens=(1 << 31) - 10)
    assert not allocations
    msg = str(e.value)
    positions = 3 + (1 << 31) - 10
    assert f"KV {round(positions * 256 / MiB)} MiB ({positions} positions x 0.2 KiB f16)" in msg
    assert "(cpu: MemAvailable)" in msg or "(cpu: cgroup limit)" in msg
    proc = subprocess.run([sys.executable, "-m", "deltaserve.frontends.cli", "run", str(huge), "-p", "hi", "-n", str((1 << 31) - 10),
                           "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "deltaserve: error: the plan for" in proc.stderr and "does not fit" in proc.stderr


def test_inspect_prints_the_plan_for_a_context(hybrid_gguf):
    proc = subprocess.run([sys.executable, "-m", "deltaserve.frontends.cli", "inspect", str(hybrid_gguf), "--ctx", "16384"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "capacity plan for 16384 positions: fits" in proc.stdout
    assert "KV 4 MiB (16384 positions x 0.2 KiB f16)" in proc.stdout
