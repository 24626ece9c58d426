"""The conversation state store: saved states beyond the slots, found by the longest prefix, in RAM and on disk,
refused whole when a file is wrong, within its budgets."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from deltaserve.session import files
from deltaserve.session.store import (_HOST, StateFileError, StateStore, file_name, parse_size, read_header, read_state,
                              saved_state_bytes, write_state)

MAX = 8


def render(model, messages):
    return model.render(messages, False)[0]


def conversation(tag: str, turns: int) -> list[list[dict]]:
    """The message lists of `turns` user turns (assistant answers filled in as the test goes)."""
    return [[{"role": "user", "content": f"{tag} says hello number {k}"}] for k in range(turns)]


def alone(model, history: list[dict]):
    return model.generate(render(model, history), max_tokens=MAX)


def checkpoint_of(model, prompt: list[int]) -> int:
    """Where a turn of `prompt` checkpoints: before its generation header (its last <|im_start|>)."""
    im_start = model.tokenizer.im_start_id
    return max(i for i, t in enumerate(prompt) if t == im_start)


def store_for(model, tmp_path=None, ram=64 << 20, disk=64 << 20, sha=None, say=None) -> StateStore:
    return StateStore(model.config, ram_bytes=ram, directory=tmp_path, disk_bytes=disk,
                      model_sha256=sha or model.host.sha256(), say=say)


def chat_turn(session, history: list[dict], text: str):
    history.append({"role": "user", "content": text})
    turn = session.chat(history, max_tokens=MAX, temperature=0, enable_thinking=False)
    history.append({"role": "assistant", "content": turn.text})
    return turn


def test_sizes_read_as_powers_of_1024_and_a_bad_one_is_named():
    assert parse_size("512M") == 512 << 20 and parse_size("2GiB") == 2 << 30 and parse_size("0") == 0
    assert parse_size("1.5g") == 3 << 29 and parse_size("4096") == 4096
    with pytest.raises(Exception, match="not a size: 'lots'"):
        parse_size("lots")


def same_checkpoint(a, b) -> bool:
    """Two checkpoints hold the same values (the store keeps a device's on the host: compared there)."""
    return (a.length == b.length and a.kv.keys() == b.kv.keys() and a.ssm.keys() == b.ssm.keys()
            and all(torch.equal(x[:, :a.length].cpu(), y[:, :b.length].cpu()) for i in a.kv for x, y in zip(a.kv[i], b.kv[i]))
            and all(torch.equal(a.ssm[i].cpu(), b.ssm[i].cpu()) and torch.equal(a.conv[i].cpu(), b.conv[i].cpu())
                    for i in a.ssm))


def test_the_longest_stored_proper_prefix_wins(hybrid_model):
    s = hybrid_model.session(quiet=True)
    store = store_for(hybrid_model)
    prompt = render(hybrid_model, [{"role": "user", "content": "one two three four five"}])
    states = {}
    for n in (3, 7, len(prompt) - 2, len(prompt)):
        st = s.backend.new_state(64)
        s.backend.prefill(st, prompt[:n])
        states[n] = st.checkpoint(exact=True)
        store.put(prompt[:n], states[n])
    found, ck = store.take(prompt + [5])
    assert found == tuple(prompt) and same_checkpoint(ck, states[len(prompt)])
    found, _ = store.take(prompt)  # a proper prefix only: the whole prompt needs one token to prefill
    assert len(found) == len(prompt) - 2
    found, _ = store.take(prompt[:7] + [1, 2, 3])
    assert len(found) == 7
    assert store.take(prompt[:3]) is None and store.take([prompt[0] + 1] + prompt[1:]) is None
    assert store.match(prompt + [5]) == len(prompt)


def test_a_conversation_whose_state_was_replaced_resumes_from_the_store_and_answers_as_alone(hybrid_model):
    store = store_for(hybrid_model)
    s = hybrid_model.session(quiet=True, store=store)
    a, b = [], []
    chat_turn(s, a, "the first conversation opens")
    chat_turn(s, b, "a second conversation takes the session")
    prev = render(hybrid_model, a[:1])  # the first turn's prompt
    turn = chat_turn(s, a, "and the first one goes on")
    assert turn.start == "store" and turn.reused == checkpoint_of(hybrid_model, prev)
    assert turn.tokens == alone(hybrid_model, a[:-1]).tokens
    assert store.snapshot()["restores"]["ram"] == 1 and store.snapshot()["tokens_not_prefilled"] == turn.reused


def test_two_sessions_restore_one_stored_state_at_once_and_both_answer_as_alone(hybrid_model):
    store = store_for(hybrid_model)
    first = hybrid_model.session(quiet=True, store=store)
    history = []
    chat_turn(first, history, "a conversation that two requests continue together")
    history.append({"role": "user", "content": "go on"})
    want = alone(hybrid_model, history).tokens
    sessions = [hybrid_model.session(quiet=True, store=store) for _ in range(2)]
    got = [None, None]

    def run(i):
        got[i] = sessions[i].chat(history, max_tokens=MAX, temperature=0, enable_thinking=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert [t.start for t in got] == ["store", "store"] and [t.tokens for t in got] == [want, want]


def test_a_state_on_disk_is_read_back_bit_exact_and_found_by_a_new_store_after_a_restart(hybrid_model, tmp_path):
    store = store_for(hybrid_model, tmp_path)
    s = hybrid_model.session(quiet=True, store=store)
    history = []
    chat_turn(s, history, "remember this across a restart")
    assert store.flush()
    files = list(tmp_path.glob("*.state"))
    assert len(files) == 1 and files[0].name == file_name(s._checkpoint_tokens)
    tokens, ck = read_state(files[0], hybrid_model.config, hybrid_model.host.sha256())
    assert tokens == s._checkpoint_tokens
    for i, (k, v) in s._checkpoint.kv.items():  # the session's on its device, the file's on the host
        assert torch.equal(ck.kv[i][0], k[:, :len(tokens)].cpu()) and torch.equal(ck.kv[i][1], v[:, :len(tokens)].cpu())
    for i in s._checkpoint.ssm:
        assert torch.equal(ck.ssm[i], s._checkpoint.ssm[i].cpu()) and torch.equal(ck.conv[i], s._checkpoint.conv[i].cpu())
    store.close()

    restarted = store_for(hybrid_model, tmp_path)  # a new process would see just the directory
    assert len(restarted) == 1 and restarted.snapshot()["disk"]["states"] == 1
    s2 = hybrid_model.session(quiet=True, store=restarted)
    turn = chat_turn(s2, history, "and now after it")
    assert turn.start == "store" and turn.reused == len(tokens)
    assert turn.tokens == alone(hybrid_model, history[:-1]).tokens
    assert restarted.snapshot()["restores"]["disk"] == 1


def _one_state_on_disk(model, directory: Path) -> tuple[Path, list[dict]]:
    store = store_for(model, directory)
    s = model.session(quiet=True, store=store)
    history = []
    chat_turn(s, history, "a state to damage")
    store.close()
    (path,) = directory.glob("*.state")
    return path, history


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "other model", "not a state file"])
def test_a_damaged_or_foreign_state_file_is_refused_with_one_notice_and_the_turn_prefills(hybrid_model, tmp_path,
                                                                                         damage):
    path, history = _one_state_on_disk(hybrid_model, tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[-100] ^= 0x55  # a flipped byte in the tensors: only the HMAC sees it
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[: len(data) - 4096]))
    elif damage == "other model":
        from safetensors.torch import load_file, save_file

        meta = read_header(path)
        meta["model_sha256"] = "0" * 64
        save_file(load_file(str(path)), str(path), metadata=meta)
    else:
        path.write_bytes(b"\x00" * 64)
    notices = []
    store = store_for(hybrid_model, tmp_path, say=notices.append)
    s = hybrid_model.session(quiet=True, store=store)
    turn = chat_turn(s, history, "the next turn")
    assert turn.start == "reset" and turn.reused == 0
    assert turn.tokens == alone(hybrid_model, history[:-1]).tokens
    assert len(notices) == 1, notices
    if damage == "other model":
        assert "another model" in notices[0] and path.exists()  # someone else's: left alone
    elif damage == "not a state file":
        assert "not this store's" in notices[0] and path.exists()  # someone else's: left alone, never removed
        assert store.snapshot()["refused_files"] == 0
    else:  # a state of ours, damaged: refused and removed
        assert "refused" in notices[0] and ("corrupt" in notices[0] or "not" in notices[0])
        assert store.snapshot()["refused_files"] == 1


def test_a_session_file_for_another_model_is_refused_and_changes_nothing(hybrid_model, tmp_path):
    path, _ = _one_state_on_disk(hybrid_model, tmp_path)
    with pytest.raises(StateFileError, match="another model"):
        read_state(path, hybrid_model.config, "f" * 64)


def test_a_write_that_fails_midway_leaves_no_file_under_the_final_name(hybrid_model, tmp_path, monkeypatch):
    s = hybrid_model.session(quiet=True)
    chat_turn(s, [], "a state to write")
    target = tmp_path / "x.state"

    def fail(fd):
        raise OSError(28, "No space left on device")

    key = files.directory_key(tmp_path)  # made once, beside the states
    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        write_state(target, s._checkpoint_tokens, s._checkpoint, "a" * 64)
    assert [p.name for p in tmp_path.iterdir()] == [files.KEY_NAME]
    monkeypatch.undo()
    name = file_name([1, 2])
    (tmp_path / files.tmp_name(key, name, pid=dead_pid(), tid=1)).write_bytes(b"half")  # a crash left it
    (tmp_path / ".tmp-backup.state").write_bytes(b"someone's")  # not named as the store names its own
    untagged = f".tmp-{_HOST}-{dead_pid()}-1-{'0' * 16}-{name}"  # named like ours, without the key's tag
    (tmp_path / untagged).write_bytes(b"a neighbour's")
    store_for(hybrid_model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([files.KEY_NAME, ".tmp-backup.state", untagged])


def test_ram_and_disk_budgets_hold_under_a_run_that_overflows_both(hybrid_model, tmp_path):
    one = saved_state_bytes(hybrid_model.config, 40)
    store = store_for(hybrid_model, tmp_path, ram=int(2.5 * one), disk=int(4.5 * one))
    sessions = [hybrid_model.session(quiet=True, store=store) for _ in range(2)]
    convs = {k: [] for k in range(6)}
    for rnd in range(3):
        for k, history in convs.items():
            turn = chat_turn(sessions[k % 2], history, f"conversation {k} round {rnd}")
            assert turn.tokens == alone(hybrid_model, history[:-2] + history[-2:-1]).tokens
            snap = store.snapshot()
            assert snap["ram"]["bytes"] <= snap["ram"]["budget"] or snap["disk"]["pending_writes"]
    assert store.flush()
    snap = store.snapshot()
    assert snap["ram"]["bytes"] <= snap["ram"]["budget"] and snap["disk"]["bytes"] <= snap["disk"]["budget"]
    assert sum(p.stat().st_size for p in tmp_path.glob("*.state")) == snap["disk"]["bytes"]
    assert snap["evictions"]["ram"] > 0 and snap["evictions"]["disk"] > 0


def test_without_a_disk_tier_states_past_the_ram_budget_are_dropped_and_turns_prefill(hybrid_model):
    store = store_for(hybrid_model, None, ram=0)
    s = hybrid_model.session(quiet=True, store=store)
    a, b = [], []
    chat_turn(s, a, "one")
    chat_turn(s, b, "two")
    turn = chat_turn(s, a, "one again")
    assert turn.start == "reset" and len(store) == 0 and store.snapshot()["misses"] >= 1


def test_a_saved_session_restores_in_another_session_and_prefills_only_the_new_turn(hybrid_model, tmp_path):
    s = hybrid_model.session(quiet=True)
    history = []
    chat_turn(s, history, "save me to a file")
    n = s.save(tmp_path / "conv.state")
    other = hybrid_model.session(quiet=True)
    assert other.restore(tmp_path / "conv.state") == n
    turn = chat_turn(other, history, "and go on elsewhere")
    assert turn.start == "checkpoint" and turn.reused == n
    assert turn.tokens == alone(hybrid_model, history[:-1]).tokens
    with pytest.raises(Exception, match="no checkpoint"):
        hybrid_model.session(quiet=True).save(tmp_path / "empty.state")


def test_a_state_file_says_what_it_is_valid_for(hybrid_model, tmp_path):
    path, _ = _one_state_on_disk(hybrid_model, tmp_path)
    meta = read_header(path)
    assert meta["model_sha256"] == hybrid_model.host.sha256() and meta["format"] == "deltaserve-state/4"
    assert meta["deltaserve"] and len(meta["mac"]) == 64 and json.loads(meta["tokens"])
    assert meta["owner"] == files.owner_tag(files.directory_key(tmp_path)) and "partition" not in meta


def dead_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            pass
        pid += 1


def test_a_state_directory_with_a_fifo_a_directory_a_symlink_and_foreign_files_serves_and_deletes_none_of_them(
        hybrid_model, tmp_path):
    """Issue 32, items 3 and 4: a FIFO named x.state hung the server (opening it blocks), a directory named so
    crashed it, and the store removed files it had not written (notes.state, .tmp-backup.state)."""
    path, history = _one_state_on_disk(hybrid_model, tmp_path)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.state"
    outside.write_bytes(path.read_bytes())  # a valid state, outside the directory, reached through a symlink
    os.mkfifo(tmp_path / "x.state")
    (tmp_path / "y.state").mkdir()
    (tmp_path / "z.state").symlink_to(outside)
    (tmp_path / "notes.state").write_text("my notes")
    (tmp_path / ".tmp-backup.state").write_text("a backup")
    (tmp_path / "mychat.state").write_bytes(path.read_bytes())  # a `chat --resume` conversation's state
    theirs = sorted(p.name for p in tmp_path.iterdir() if p != path)
    notices = []
    store = store_for(hybrid_model, tmp_path, say=notices.append)
    s = hybrid_model.session(quiet=True, store=store)
    turn = chat_turn(s, history, "the next turn")
    assert turn.start == "store" and turn.reused > 0  # the real state was found and used
    assert turn.tokens == alone(hybrid_model, history[:-1]).tokens
    now = {p.name for p in tmp_path.iterdir()}
    assert set(theirs) <= now and outside.exists(), sorted(set(theirs) - now)  # (and the store's own new states)
    said = " ".join(notices)
    assert "not a regular file" in said and "x.state" in said and "not this store's" in said and "notes.state" in said
    assert store.snapshot()["refused_files"] == 0
    with pytest.raises(StateFileError, match="FIFO"):
        read_state(tmp_path / "x.state", hybrid_model.config, hybrid_model.host.sha256())


def test_a_state_file_whose_token_list_was_edited_is_refused_not_used(hybrid_model, tmp_path):
    """Issue 32, item 5: the CRC covered the tensors only, so one conversation's state under another's tokens was
    used and the wrong conversation answered. The HMAC covers the tokens, the length and the identity (issue 53: and
    a neighbour who recomputes a CRC cannot recompute it without the directory's key)."""
    from safetensors.torch import load_file, save_file

    path, history = _one_state_on_disk(hybrid_model, tmp_path)
    meta = read_header(path)
    tokens = json.loads(meta["tokens"])
    tokens[-2] = (tokens[-2] + 1) % hybrid_model.config.vocab_size
    meta["tokens"] = json.dumps(tokens, separators=(",", ":"))
    edited = tmp_path / file_name(tokens)  # named as the edited tokens' state would be: the store indexes it
    save_file(load_file(str(path)), str(edited), metadata=meta)
    os.chmod(edited, 0o600)  # as the store writes its own (a file others may read is not even looked at)
    path.unlink()
    with pytest.raises(StateFileError, match="HMAC"):
        read_state(edited, hybrid_model.config, hybrid_model.host.sha256())
    notices = []
    store = store_for(hybrid_model, tmp_path, say=notices.append)
    assert len(store) == 1  # indexed by its name and header, as any state on disk
    assert store.take(list(tokens) + [5]) is None  # found for a prompt it prefixes, refused when read
    assert any("refused" in n and "HMAC" in n for n in notices), notices
    assert not edited.exists() and store.snapshot()["refused_files"] == 1  # a damaged state of its own: removed


def test_state_files_and_a_new_state_directory_are_the_users_alone(hybrid_model, tmp_path):
    import stat

    path, _ = _one_state_on_disk(hybrid_model, tmp_path / "states")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "states").stat().st_mode) == 0o700
