"""Issue 53, items 1-4 (What to build 1-3): a neighbour who can write into the state directory. A FIFO named like a
stored response or swapped in for a state between a check and an open froze the whole server; a state relabelled
with another conversation's tokens and its CRC recomputed was used; temporary files and links of anyone's were
deleted at start; the directory was created 0755 and an existing one never checked. Each attack is made here by
this test (the neighbour) in the test's own directory, and each assertion is the mechanism: refused, skipped, left
alone, answered."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import httpx
import pytest

from deltaserve.errors import DeltaserveError
from deltaserve.session import files
from deltaserve.session.responses import ResponseRecord, ResponseStore, new_id
from deltaserve.session.store import StateFileError, StateStore, file_name, read_header, read_state
from tests.server_proc import ServerProcess

MAX = 6


def store_for(model, directory, say=None) -> StateStore:
    return StateStore(model.config, ram_bytes=64 << 20, directory=directory, disk_bytes=64 << 20,
                      model_sha256=model.host.sha256(), say=say)


def chat_turn(session, history: list[dict], text: str, partition=None):
    history.append({"role": "user", "content": text})
    turn = session.chat(history, max_tokens=MAX, temperature=0, enable_thinking=False)
    history.append({"role": "assistant", "content": turn.text})
    return turn


def one_state(model, directory: Path, text: str) -> tuple[Path, list[dict]]:
    before = set(directory.glob("*.state")) if directory.exists() else set()
    store = store_for(model, directory)
    s = model.session(quiet=True, store=store)
    history: list[dict] = []
    chat_turn(s, history, text)
    store.close()
    (path,) = set(directory.glob("*.state")) - before
    return path, history


def in_thread(fn, *args, **kwargs):
    """Run `fn` in a thread; whether it returned (a blocked open never does: the thread is left behind, a daemon)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    return (not t.is_alive()), out


# -- opening -------------------------------------------------------------------------------------------------------
def test_a_fifo_is_opened_without_blocking_and_refused_by_its_descriptor(tmp_path):
    os.mkfifo(tmp_path / "x.state")
    returned, out = in_thread(files.open_checked, tmp_path / "x.state")
    assert returned and isinstance(out.get("error"), files.UnsafeFile) and out["error"].kind == "fifo"


def test_a_symlink_is_never_followed_and_a_file_others_may_read_is_not_ours(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"x" * 10)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(files.UnsafeFile) as e:
        files.open_checked(tmp_path / "link")
    assert e.value.kind == "symlink"
    os.chmod(target, 0o644)
    with pytest.raises(files.UnsafeFile) as e:
        files.open_checked(target)
    assert e.value.kind == "open mode"
    os.chmod(target, 0o600)
    with pytest.raises(files.UnsafeFile) as e:
        files.open_checked(target, max_bytes=9)
    assert e.value.kind == "too large"


def test_a_state_swapped_for_a_fifo_between_the_listing_and_the_open_is_refused_and_nothing_blocks(hybrid_model,
                                                                                                   tmp_path,
                                                                                                   monkeypatch):
    """The swap race, made deterministic: the store has indexed a fresh state; the neighbour replaces it by a FIFO just
    before the store opens it. The open does not block (O_NONBLOCK), the descriptor is checked (fstat: a FIFO), the
    state is refused as not the store's, and the turn prefills."""
    path, history = one_state(hybrid_model, tmp_path, "a state the neighbour swaps")
    notices: list[str] = []
    store = store_for(hybrid_model, tmp_path, say=notices.append)
    real_open = os.open

    def swap_then_open(p, flags, *args):
        if Path(p) == path and not stat.S_ISFIFO(os.lstat(path).st_mode):
            os.replace(path, tmp_path / "kept-aside")  # the neighbour wins the race
            os.mkfifo(path)
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", swap_then_open)
    s = hybrid_model.session(quiet=True, store=store)
    returned, out = in_thread(chat_turn, s, history, "the next turn")
    monkeypatch.undo()
    assert returned and "error" not in out, out
    assert out["value"].start == "reset" and out["value"].reused == 0
    assert any("FIFO" in n for n in notices), notices
    assert stat.S_ISFIFO(os.lstat(path).st_mode)  # the neighbour's FIFO is left where it is


def test_a_state_relabelled_with_another_conversations_tokens_is_refused_by_its_hmac_and_after_a_restart(
        hybrid_model, tmp_path):
    """The forged state: conversation X's tensors under victim Y's tokens, written as the store names Y's state,
    with every checksum a neighbour can compute recomputed (the HMAC needs the directory's key, which it cannot
    read). Y's next turn prefills and answers as it would alone, now and after a restart."""
    from safetensors.torch import load_file, save_file

    x_path, _ = one_state(hybrid_model, tmp_path, "My locker code is 4821. What is my locker code?")
    y_path, y_history = one_state(hybrid_model, tmp_path, "My locker code is 1234. What is my locker code?")
    meta = read_header(x_path)
    y_meta = read_header(y_path)
    meta["tokens"], meta["length"] = y_meta["tokens"], y_meta["length"]
    tensors = load_file(str(x_path))
    assert next(iter(t.shape[1] for k, t in tensors.items() if k.startswith("kv."))) == int(meta["length"])
    import hashlib
    import hmac as hmac_

    meta["mac"] = hmac_.new(b"a guessed key", b"whatever", hashlib.sha256).hexdigest()
    save_file(tensors, str(y_path), metadata=meta)
    os.chmod(y_path, 0o600)
    with pytest.raises(StateFileError, match="HMAC"):
        read_state(y_path, hybrid_model.config, hybrid_model.host.sha256())
    for restart in range(2):
        notices: list[str] = []
        store = store_for(hybrid_model, tmp_path, say=notices.append)
        s = hybrid_model.session(quiet=True, store=store)
        history = list(y_history)
        turn = chat_turn(s, history, "And again?")
        alone = hybrid_model.generate(hybrid_model.render(history[:-1], False)[0], max_tokens=MAX)
        assert turn.tokens == alone.tokens
        assert turn.start == ("reset" if restart == 0 else turn.start)
        if restart == 0:
            assert any("HMAC" in n for n in notices), notices
        store.close()


def test_a_state_of_another_directory_is_not_this_ones(hybrid_model, tmp_path):
    """Transplanted: a state signed under another directory's key is refused, and being not this store's, left alone."""
    path, history = one_state(hybrid_model, tmp_path / "a", "a state to transplant")
    (tmp_path / "b").mkdir(mode=0o700)
    files.directory_key(tmp_path / "b")
    moved = tmp_path / "b" / path.name
    os.replace(path, moved)
    notices: list[str] = []
    store = store_for(hybrid_model, tmp_path / "b", say=notices.append)
    assert len(store) == 0 and moved.exists()
    assert any("not this store's" in n for n in notices), notices
    with pytest.raises(StateFileError, match="directory's key"):
        read_state(moved, hybrid_model.config, hybrid_model.host.sha256())


# -- partitions -----------------------------------------------------------------------------------------------------
def test_a_state_of_one_partition_is_never_found_for_another_nor_after_a_restart(hybrid_model, tmp_path):
    prompt = hybrid_model.render([{"role": "user", "content": "my PIN is 4821"}], False)[0]
    session = hybrid_model.session(quiet=True)
    session.generate(prompt, max_tokens=1)
    ck, tokens = session._checkpoint, session._checkpoint_tokens
    store = store_for(hybrid_model, tmp_path)
    assert store.put(tokens, ck, partition="tenant-a")
    store.flush()
    ask = list(tokens) + [5]
    assert store.take(ask, partition="tenant-b") is None and store.take(ask) is None
    assert store.take(ask, partition="tenant-a")[0] == tuple(tokens)
    assert store.match(ask, "tenant-a") == len(tokens) and store.match(ask, "tenant-b") == 0
    (written,) = tmp_path.glob("*.state")
    assert written.name == file_name(tokens, "tenant-a") != file_name(tokens)
    assert read_header(written)["partition"] == "tenant-a"
    with pytest.raises(StateFileError, match="another partition"):
        read_state(written, hybrid_model.config, hybrid_model.host.sha256())
    store.close()
    again = store_for(hybrid_model, tmp_path)
    assert again.take(ask, partition="tenant-b") is None and again.take(ask) is None
    assert again.take(ask, partition="tenant-a")[0] == tuple(tokens)


def test_a_slot_holding_another_partitions_tokens_is_worth_nothing_to_this_one():
    import asyncio

    from deltaserve.frontends.server.slots import SlotPool

    class Held:
        def __init__(self):
            self.held = [1, 2, 3]

        def reusable(self, prompt, partition=None):
            return 3 if list(prompt[:3]) == self.held else 0

    pool = SlotPool([Held(), Held()], 4)

    async def go():
        a = await pool.acquire([1, 2, 3, 4], "tenant-a")
        pool.release(a)
        pool.slots[a.index].last_used = 1e18  # the most recently used: picked only for its affinity
        again = await pool.acquire([1, 2, 3, 4, 5], "tenant-a")
        pool.release(again)
        pool.slots[again.index].last_used = 1e18
        other = await pool.acquire([1, 2, 3, 4, 5], "tenant-b")
        return a.index, again.index, other.index, [s.affinity([1, 2, 3, 4], "tenant-a") for s in pool.slots]

    a, again, other, scores = asyncio.run(go())
    assert again == a and other != a  # affinity within a partition, none across
    assert scores[other] == 0


# -- the directory -------------------------------------------------------------------------------------------------
def test_an_existing_directory_others_may_read_is_tightened_with_a_notice(hybrid_model, tmp_path):
    d = tmp_path / "states"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    notices: list[str] = []
    store_for(hybrid_model, d, say=notices.append).close()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert any("readable by others" in n and "0755" in n for n in notices), notices
    key = d / files.KEY_NAME
    assert stat.S_IMODE(os.lstat(key).st_mode) == 0o600 and os.path.getsize(key) == files.KEY_BYTES


def test_a_key_file_that_is_not_ours_refuses_the_directory(hybrid_model, tmp_path):
    d = tmp_path / "states"
    d.mkdir(mode=0o700)
    (d / "elsewhere").write_bytes(os.urandom(32))
    (d / files.KEY_NAME).symlink_to(d / "elsewhere")
    with pytest.raises(DeltaserveError, match="key is unusable"):
        store_for(hybrid_model, d)


def test_temporary_files_and_links_of_anyone_else_are_left_alone_only_tagged_ones_of_a_gone_writer_go(tmp_path):
    """At start every .tmp-*.json in responses/ was deleted, a symlink to a victim file included."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    d = tmp_path / "state"
    store = ResponseStore(budget=1 << 20, directory=d, say=lambda line: None)
    key = store.key
    responses = d / "responses"
    dead = 4_000_000
    while True:
        try:
            os.kill(dead, 0)
            dead += 1
        except ProcessLookupError:
            break
        except OSError:
            dead += 1
    final = f"{new_id()}.json"
    ours = responses / files.tmp_name(key, final, pid=dead, tid=1)
    ours.write_bytes(b"half")
    theirs = [responses / ".tmp-1-2-resp_x.json", responses / f".tmp-{files.HOST}-{dead}-1-{'0' * 16}-{final}",
              responses / ".tmp-link.json"]
    theirs[0].write_text("a neighbour's")
    theirs[1].write_text("named like ours, no key")
    theirs[2].symlink_to(victim)
    ResponseStore(budget=1 << 20, directory=d, say=lambda line: None)
    assert not ours.exists()
    assert all(os.path.lexists(p) for p in theirs) and victim.read_text() == "keep me"


# -- stored responses ------------------------------------------------------------------------------------------------
def record(rid: str, tenant=None) -> ResponseRecord:
    return ResponseRecord(rid, 1, "ab" * 32, {"id": rid, "object": "response"}, [], [{"role": "user", "content": "hi"}],
                          "f" * 64, [1, 2, 3], tenant)


def test_a_fifo_named_like_a_stored_response_neither_blocks_the_start_nor_a_get(tmp_path):
    d = tmp_path / "state"
    ResponseStore(budget=1 << 20, directory=d, say=lambda line: None)
    rid = new_id()
    os.mkfifo(d / "responses" / f"{rid}.json")
    said: list[str] = []
    returned, out = in_thread(ResponseStore, **{"budget": 1 << 20, "directory": d, "say": said.append})
    assert returned and "value" in out, out
    returned, got = in_thread(out["value"].get, rid)
    assert returned and got.get("value") is None
    assert any("FIFO" in line for line in said), said


def test_a_stored_response_edited_by_a_neighbour_is_refused_and_another_tenants_is_not_found(tmp_path):
    d = tmp_path / "state"
    store = ResponseStore(budget=1 << 20, directory=d, say=lambda line: None, tenants=2)
    mine, theirs = new_id(), new_id()
    store.put(record(mine, "tenant-a"))
    store.put(record(theirs, "tenant-b"))
    assert store.get(mine, "tenant-a") is not None and store.get(mine, "tenant-b") is None
    assert not store.delete(mine, "tenant-b") and store.get(mine, "tenant-a") is not None
    path = d / "responses" / f"{theirs}.json"
    mac, body = path.read_bytes().split(b"\n", 1)
    edited = json.loads(body)
    edited["tenant"] = "tenant-a"  # the neighbour hands tenant-b's conversation to tenant-a
    path.write_bytes(mac + b"\n" + json.dumps(edited).encode())
    said: list[str] = []
    again = ResponseStore(budget=1 << 20, directory=d, say=said.append, tenants=2)
    assert again.get(theirs, "tenant-a") is None and again.get(theirs, "tenant-b") is None
    assert any("HMAC" in line for line in said), said


def test_a_tenants_responses_are_never_evicted_for_anothers(tmp_path):
    size = len(record(new_id(), "tenant-a").to_json())
    said: list[str] = []
    store = ResponseStore(budget=8 * size, directory=None, say=said.append, tenants=2)
    a = [new_id() for _ in range(3)]
    for rid in a:
        store.put(record(rid, "tenant-a"))
    for _ in range(20):  # tenant-b floods
        store.put(record(new_id(), "tenant-b"))
    assert all(store.get(rid, "tenant-a") is not None for rid in a)
    assert store.used <= 8 * size and store.evicted == 20 - 4 and all("dropped" in line for line in said)


# -- through serve ---------------------------------------------------------------------------------------------------
def test_serve_starts_over_a_fifo_named_like_a_stored_response_and_answers_its_id_with_a_404(hybrid_gguf, tmp_path):
    d = tmp_path / "state"
    ResponseStore(budget=1 << 20, directory=d, say=lambda line: None)
    rid = new_id()
    os.mkfifo(d / "responses" / f"{rid}.json")
    os.mkfifo(d / f"{'ab' * 20}.state")
    with ServerProcess(hybrid_gguf, "--slots", "1", "--think", "off", "--state-dir", str(d)) as server:
        r = httpx.get(f"{server.url}/v1/responses/{rid}", timeout=30)
        assert r.status_code == 404, r.text
        r = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
            "input": "hi", "max_output_tokens": 2, "previous_response_id": rid})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        r = httpx.post(f"{server.url}/v1/responses", timeout=60, json={"input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200, r.text
    assert stat.S_ISFIFO(os.lstat(d / "responses" / f"{rid}.json").st_mode)  # left where the neighbour put it
