"""One state directory, several processes (replicas on a shared --state-dir): each finds what the others wrote,
forgets what they removed without calling it damage, leaves their writes in progress alone, and the directory's disk
budget holds with every writer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import torch

from deltaserve.session.store import SUFFIX, StateStore, file_name, saved_state_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def store_for(model, directory, ram=64 << 20, disk=64 << 20, say=None) -> StateStore:
    return StateStore(model.config, ram_bytes=ram, directory=directory, disk_bytes=disk,
                      model_sha256=model.host.sha256(), say=say)


def state_of(model, tokens):
    s = model.session(quiet=True)
    st = s.backend.new_state(len(tokens) + 8)
    s.backend.prefill(st, list(tokens))
    return st.checkpoint(exact=True)


def prompt_of(model, text: str) -> list[int]:
    return model.render([{"role": "user", "content": text}], False)[0]


def same(a, b) -> bool:
    """The same state (computed in two processes: equal up to float rounding)."""
    return a.length == b.length and all(torch.allclose(a.ssm[i], b.ssm[i], atol=1e-5) for i in a.ssm) and all(
        torch.allclose(a.kv[i][0][:, :a.length], b.kv[i][0][:, :b.length], atol=1e-5) for i in a.kv)


def test_a_state_another_process_writes_is_found_by_a_store_that_started_before_it(hybrid_model, tmp_path):
    """The writer is a real second process; the reader was indexing the directory before the file existed."""
    reader = store_for(hybrid_model, tmp_path)
    prompt = prompt_of(hybrid_model, "a state written by another process")
    assert reader.take(prompt) is None
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {REPO!r})
        import deltaserve
        from deltaserve.session.store import StateStore
        from tests.test_ray_store import state_of
        model = deltaserve.load({str(hybrid_model.path)!r})
        store = StateStore(model.config, ram_bytes=64 << 20, directory={str(tmp_path)!r}, disk_bytes=64 << 20,
                           model_sha256=model.host.sha256())
        tokens = {prompt[:-3]!r}
        store.put(tokens, state_of(model, tokens))
        store.close()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, cwd=REPO)
    assert (tmp_path / file_name(prompt[:-3])).exists()
    found = reader.take(prompt)
    assert found is not None and found[0] == tuple(prompt[:-3])
    assert same(found[1], state_of(hybrid_model, prompt[:-3]))
    snap = reader.snapshot()
    assert snap["restores"]["disk"] == 1 and snap["disk"]["states"] == 1 and reader.notices == []


def test_a_longer_state_on_disk_wins_over_a_shorter_one_this_process_holds_in_ram(hybrid_model, tmp_path):
    a, b = store_for(hybrid_model, tmp_path), store_for(hybrid_model, tmp_path)
    prompt = prompt_of(hybrid_model, "turn one, then turn two, then turn three of one conversation")
    b.put(prompt[:6], state_of(hybrid_model, prompt[:6]))  # what b saw of this conversation: an early turn
    a.put(prompt[:-2], state_of(hybrid_model, prompt[:-2]))  # a served its later turns
    assert a.flush()
    found = b.take(prompt)
    assert found is not None and len(found[0]) == len(prompt) - 2  # not the 6 tokens b holds in RAM


def test_a_file_another_process_removed_is_forgotten_quietly_and_the_next_longest_is_used(hybrid_model, tmp_path):
    notices = []
    a, b = store_for(hybrid_model, tmp_path), store_for(hybrid_model, tmp_path, ram=0, say=notices.append)
    prompt = prompt_of(hybrid_model, "a conversation whose newest state another replica evicts")
    for n in (5, len(prompt) - 2):
        a.put(prompt[:n], state_of(hybrid_model, prompt[:n]))
    assert a.flush()
    assert b.match(prompt) == 0 and b.refresh() == 2 and b.match(prompt) == len(prompt) - 2
    (tmp_path / file_name(prompt[:-2])).unlink()
    found = b.take(prompt)
    assert found is not None and len(found[0]) == 5
    snap = b.snapshot()
    assert snap["refused_files"] == 0 and notices == [] and snap["disk"]["states"] == 1
    assert snap["disk"]["bytes"] == (tmp_path / file_name(prompt[:5])).stat().st_size


def test_the_disk_budget_holds_for_the_directory_with_two_writers(hybrid_model, tmp_path):
    one = saved_state_bytes(hybrid_model.config, 40)
    budget = int(5.5 * one)
    stores = [store_for(hybrid_model, tmp_path, ram=one, disk=budget) for _ in range(2)]
    for k in range(12):
        tokens = prompt_of(hybrid_model, f"conversation {k} on writer {k % 2}")[:30]
        stores[k % 2].put(tokens, state_of(hybrid_model, tokens))
        assert stores[k % 2].flush()
        stores[(k + 1) % 2].refresh(force=True)
        on_disk = sum(p.stat().st_size for p in tmp_path.glob("*" + SUFFIX))
        assert on_disk <= budget, f"after {k + 1} states: {on_disk} bytes on disk, budget {budget}"
    for s in stores:
        s.refresh(force=True)
        snap = s.snapshot()
        # each store counts the whole directory, the other's files too, and nothing twice
        assert snap["disk"]["bytes"] == sum(p.stat().st_size for p in tmp_path.glob("*" + SUFFIX)) <= budget
    assert len(list(tmp_path.glob("*" + SUFFIX))) >= 3  # the budget evicted the oldest, not everything


def test_a_starting_store_leaves_a_write_in_progress_alone_and_removes_what_a_crash_left(hybrid_model, tmp_path):
    from deltaserve.session import files

    name = file_name([1, 2, 3])
    key = files.directory_key(tmp_path)
    live = tmp_path / files.tmp_name(key, name, pid=os.getpid(), tid=1)        # this process: alive, writing
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
    dead = tmp_path / files.tmp_name(key, name, pid=int(dead_pid), tid=1)      # a writer that is gone
    old = tmp_path / files.tmp_name(key, name, host="otherhost", pid=1, tid=1)  # another machine's, an hour old
    for p in (live, dead, old):
        p.write_bytes(b"half a state")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    store_for(hybrid_model, tmp_path)
    assert live.exists() and not dead.exists() and not old.exists()
