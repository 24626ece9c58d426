"""`deltaserve chat --resume NAME`: a conversation and its decode state kept under a name, across runs.

Every test drives the real CLI (the embedded demo model, temperature 0) with a cache directory of its own; what a
test prepares or checks in-process goes through the same public API (deltaserve.load, Session.save, the store's
state files)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import deltaserve
from deltaserve.session.store import read_state, write_state
from deltaserve.text.chat_template import render

STATS = re.compile(r"\[reused (\d+) \| prefilled (\d+) \| TTFT \d+ ms \| [\d.]+ tok/s \| \d+ tokens?, \w+[^|]* \| (\w+)\]")
ANSWER = re.compile(r"> (.*?)\n\[reused", re.DOTALL)
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def demo():
    return deltaserve.load()


@pytest.fixture
def cache(tmp_path, demo):
    """A cache directory of this test's own, sharing only the compiled native kernel (built once per machine)."""
    from deltaserve.kernels import native

    native.status()
    root = tmp_path / "cache"
    root.mkdir()
    if native.cache_dir().is_dir():
        (root / "native").symlink_to(native.cache_dir(), target_is_directory=True)
    return root


def chat(cache, *args: str, lines: list[str] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, DELTASERVE_CACHE_DIR=str(cache), DELTASERVE_DATA_DIR=str(cache))
    env.pop("DELTASERVE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "deltaserve", "chat", "--device", "cpu", "--temperature", "0",
                           "-n", str(MAX_TOKENS), *args], input="".join(f"{line}\n" for line in lines), env=env,
                          capture_output=True, text=True, timeout=120)


def turns(out: str) -> list[tuple[str, int, int, str]]:
    """(answer, reused, prefilled, start) of every turn a run's stdout shows."""
    answers = [a.strip() for a in ANSWER.findall(out)]
    stats = [(int(m.group(1)), int(m.group(2)), m.group(3)) for m in STATS.finditer(out)]
    assert len(answers) == len(stats), out
    return [(a, *s) for a, s in zip(answers, stats)]


def up_to_generation_header(demo, messages: list[dict]) -> int:
    """How many tokens of the prompt these messages render to come before its generation header."""
    ids, _ = render(demo.tokenizer, messages, None)
    return max(i for i, t in enumerate(ids) if t == demo.tokenizer.im_start_id)


def full_prefill_answer(demo, messages: list[dict]) -> str:
    return demo.session(quiet=True).chat(messages, max_tokens=MAX_TOKENS, temperature=0).text


def saved(cache, name: str) -> dict:
    return json.loads((cache / "chats" / f"{name}.json").read_text())


def prepare(cache, demo, name: str) -> list[dict]:
    """A saved conversation of one exchange, written as `chat --resume` writes it (one CLI run fewer)."""
    from deltaserve.frontends.repl import SavedChat

    s = SavedChat(name, cache / "chats")
    s.dir.mkdir(parents=True)
    session = demo.session(quiet=True)
    messages = [{"role": "user", "content": "My locker code is 4821."}]
    messages.append({"role": "assistant", "content": session.chat(messages, max_tokens=MAX_TOKENS, temperature=0).text})
    s.write(messages, None, None, demo)
    session.save(s.state_path)
    return messages


def test_a_resumed_chat_prefills_only_the_new_turn(cache, demo):
    first = chat(cache, "--resume", "notes", lines=["My locker code is 4821.", "What is 12 + 9?"])
    assert first.returncode == 0, first.stderr
    assert "notes: no saved conversation under this name: a new one" in first.stderr
    conversation = saved(cache, "notes")
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"] * 2
    assert conversation["model_sha256"] == demo.host.sha256() and conversation["deltaserve"] == deltaserve.__version__
    assert (cache / "chats" / "notes.state").stat().st_size > 0
    # the state covers the run's last prompt up to its generation header
    held = up_to_generation_header(demo, conversation["messages"][:3])

    second = chat(cache, "--resume", "notes", lines=["What is my locker code?", "/stats"])
    assert second.returncode == 0, second.stderr
    assert f"[deltaserve] resumed notes: 4 messages, {held} tokens of state restored" in second.stderr
    (answer, reused, prefilled, start), = turns(second.stdout)
    assert reused == held > 0 and start == "checkpoint"
    assert "4821" in answer
    assert f"resumed notes: {held} tokens of state restored" in second.stdout  # /stats says it
    assert f"its first turn reused {held} tokens" in second.stdout
    messages = saved(cache, "notes")["messages"]
    assert len(messages) == 6 and messages[-1] == {"role": "assistant", "content": answer}
    assert answer == full_prefill_answer(demo, messages[:5])


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "other model"])
def test_a_refused_state_file_is_one_notice_and_the_conversation_goes_on_from_its_messages(cache, demo, damage):
    messages = prepare(cache, demo, "notes")
    state = cache / "chats" / "notes.state"
    data = state.read_bytes()
    if damage == "corrupt":
        state.write_bytes(data[:-64] + bytes(b ^ 0xFF for b in data[-64:]))
    elif damage == "truncated":
        state.write_bytes(data[: len(data) // 2])
    else:
        tokens, ck = read_state(state, demo.config, demo.host.sha256())
        write_state(state, tokens, ck, "0" * 64)

    run = chat(cache, "--resume", "notes", lines=["What is my locker code?"])
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    notices = [line for line in run.stderr.splitlines() if "notes.state" in line]
    assert len(notices) == 1 and "resumed notes: 2 messages; its state file was refused" in notices[0], run.stderr
    (answer, reused, prefilled, start), = turns(run.stdout)
    assert reused == 0 and start == "reset"
    question = messages + [{"role": "user", "content": "What is my locker code?"}]
    assert answer == full_prefill_answer(demo, question) and "4821" in answer
    # the messages were kept, and the state file written again, valid, for the next run
    assert saved(cache, "notes")["messages"] == question + [{"role": "assistant", "content": answer}]
    tokens, _ = read_state(state, demo.config, demo.host.sha256())
    assert len(tokens) == up_to_generation_header(demo, question)


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden"])
def test_an_invalid_name_is_a_clear_error_before_anything_is_loaded(cache, name):
    run = chat(cache, "--resume", name)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr
    assert "argument --resume: a conversation name is 1 to 100 letters, digits" in run.stderr
    assert not (cache / "chats").exists()


def test_a_conversation_saved_with_another_model_is_refused_naming_both(cache, demo):
    prepare(cache, demo, "notes")
    path = cache / "chats" / "notes.json"
    data = json.loads(path.read_text())
    data.update(model="other.gguf", model_path="/models/other.gguf", model_sha256="ab" * 32)
    path.write_text(json.dumps(data))
    before = path.read_bytes()
    run = chat(cache, "--resume", "notes", lines=["What is my locker code?"])
    assert run.returncode == 1 and "Traceback" not in run.stderr
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("deltaserve: error: --resume notes: this conversation was saved with the model "
                            "/models/other.gguf (sha256 abababababab...) and this is ")
    assert f"demo-qwen35.gguf (sha256 {demo.host.sha256()[:12]}...)" in error
    assert path.read_bytes() == before  # never written over


def test_clear_under_resume_clears_the_saved_conversation_too(cache, demo):
    run = chat(cache, "--resume", "notes", "--system", "You are terse.", "--think", "off",
               lines=["My name is Bob.", "/clear"])
    assert run.returncode == 0, run.stderr
    assert "[cleared; the saved conversation notes too]" in run.stdout
    conversation = saved(cache, "notes")
    assert conversation["messages"] == [] and conversation["system"] == "You are terse."
    assert conversation["thinking"] is False
    assert not (cache / "chats" / "notes.state").exists()


def test_saved_conversations_are_the_users_alone_and_a_planted_lock_symlink_or_a_deep_file_is_refused(tmp_path):
    """Issue 32, item 6: NAME.json and the state were created readable by every local user (0644 in 0755), `chat
    --resume` followed a symlinked NAME.lock and truncated its target, and a NAME.json nested 900 deep made it exit
    with an internal error instead of saying what is wrong."""
    import stat

    from deltaserve.errors import DeltaserveError
    from deltaserve.frontends.repl import SavedChat

    d = tmp_path / "chats"
    chat = SavedChat("mine", d)
    chat.prepare()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "mine.lock").stat().st_mode) == 0o600
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (d / "planted.lock").symlink_to(victim)
    with pytest.raises(DeltaserveError, match="--resume planted: cannot use"):
        SavedChat("planted", d).prepare()
    assert victim.read_text() == "precious"
    (d / "deep.json").write_text('{"format": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(DeltaserveError, match="not a saved deltaserve conversation"):
        SavedChat("deep", d).load()


def test_chats_live_apart_from_the_cache_and_an_old_cache_directorys_chats_move_once(tmp_path, monkeypatch):
    """Issue 53, What to build 8: saved chats lived under DELTASERVE_CACHE_DIR beside the compiled kernels, so clearing
    the cache deleted conversations. They live in the data directory; an old cache directory's are moved once (its
    files alone: a symlink planted there is not followed nor moved)."""
    from deltaserve.frontends.repl import chats_dir, move_old_chats

    cache, data = tmp_path / "cache", tmp_path / "data"
    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(cache))
    monkeypatch.setenv("DELTASERVE_DATA_DIR", str(data))
    old = cache / "chats"
    old.mkdir(parents=True)
    (old / "notes.json").write_text('{"messages": []}')
    (old / "notes.state").write_bytes(b"state")
    (tmp_path / "victim").write_text("keep")
    (old / "link.json").symlink_to(tmp_path / "victim")
    target = chats_dir()
    assert target == data / "chats"
    said = move_old_chats(target)
    assert sorted(p.name for p in target.iterdir()) == ["notes.json", "notes.state"]
    assert "moved 2 saved chat files" in said[0] and (old / "link.json").is_symlink()
    assert oct(target.stat().st_mode & 0o777) == "0o700"
    assert move_old_chats(target) == []  # once
