"""Every conversation stays resident: 16 conversations over 2 slots resume from the state store, through restarts,
past damaged files, within the store's budgets; every answer as the conversation alone would get it."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

import deltaserve
from deltaserve.demo import default_model_path
from deltaserve.session.store import file_name, read_header
from tests.server_proc import ServerProcess

MAX = 12
CONVS = 16
TURNS = 6


@pytest.fixture(scope="module")
def demo():
    return deltaserve.load(default_model_path())


def question(c: int, k: int) -> str:
    return f"Conversation {c}, turn {k}: what is {c} plus {k}, and what did I ask before?"


class Conversations:
    """The conversations a test drives, and what each would get alone (a fresh session of its own)."""

    def __init__(self, demo, n: int, salt: str = ""):
        self.demo = demo
        self.messages = {c: [{"role": "system", "content": f"You are a calculator {salt}."}] for c in range(n)}
        self.alone = {c: demo.session(quiet=True) for c in range(n)}
        self.results: dict[int, list[dict]] = {c: [] for c in range(n)}
        self.lock = threading.Lock()

    def prompt(self, c: int) -> list[int]:
        return self.demo.render(self.messages[c])[0]

    def expected_cached(self, c: int) -> int:
        """What the previous turn's prompt held before its generation header (its last <|im_start|>)."""
        prev = self.results[c][-1]["prompt"]
        im_start = self.demo.tokenizer.im_start_id
        return max(i for i, t in enumerate(prev) if t == im_start)

    def turn(self, client: openai.OpenAI, c: int, k: int) -> dict:
        self.messages[c].append({"role": "user", "content": question(c, k)})
        prompt = self.prompt(c)
        want = self.alone[c].chat(self.messages[c], max_tokens=MAX, temperature=0).text
        r = client.chat.completions.create(model="demo-qwen35", messages=self.messages[c], max_tokens=MAX, temperature=0)
        got = r.choices[0].message.content
        res = {"turn": k, "prompt": prompt, "answer": got, "want": want,
               "cached": r.usage.prompt_tokens_details.cached_tokens,
               "expected": self.expected_cached(c) if self.results[c] else None}
        self.messages[c].append({"role": "assistant", "content": got})
        self.results[c].append(res)
        return res

    def follow_ups(self, first_turn: int = 1) -> list[dict]:
        return [r for rs in self.results.values() for r in rs if r["turn"] >= first_turn and r["expected"] is not None]

    def check(self, first_turn: int = 1, share: float = 0.95) -> None:
        wrong = [(c, r["turn"], r["answer"], r["want"]) for c, rs in self.results.items() for r in rs
                 if r["answer"] != r["want"]]
        assert not wrong, f"answers that differ from the conversation alone: {wrong[:3]}"
        follow = self.follow_ups(first_turn)
        resumed = [r for r in follow if r["cached"] >= r["expected"]]
        assert len(resumed) >= share * len(follow), \
            f"{len(resumed)} of {len(follow)} follow-up turns resumed: " \
            f"{[(r['turn'], r['cached'], r['expected']) for r in follow if r not in resumed][:8]}"


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def health(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/health", timeout=10).json()


def written(server: ServerProcess, timeout: float = 60) -> dict:
    """/health once the store has no write pending."""
    deadline = time.time() + timeout
    while True:
        h = health(server)
        if not h["store"]["disk"]["pending_writes"] or time.time() > deadline:
            return h
        time.sleep(0.05)


def round_robin(convs: Conversations, client, turns: range) -> None:
    for k in turns:
        for c in convs.messages:
            convs.turn(client, c, k)


def test_sixteen_conversations_over_two_slots_resume_from_the_store_one_at_a_time_and_all_at_once(demo):
    server = ServerProcess(default_model_path(), "--slots", "2", "--queue", "32")
    try:
        client = client_of(server)
        interleaved = Conversations(demo, CONVS, "one at a time")
        round_robin(interleaved, client, range(TURNS))
        interleaved.check()

        concurrent = Conversations(demo, CONVS, "all at once")
        errors = []

        def drive(c):
            try:
                for k in range(TURNS):
                    concurrent.turn(client, c, k)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=drive, args=(c,)) for c in range(CONVS)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors, errors
        concurrent.check()
        store = health(server)["store"]
        assert store["restores"]["ram"] > 100 and store["disk"]["states"] == 0
        assert store["tokens_not_prefilled"] > 0
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'deltaserve_state_store_events{event="restores_ram"}' in metrics
        assert "deltaserve_state_store_tokens_not_prefilled" in metrics
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_after_a_restart_every_conversation_resumes_from_disk(demo, tmp_path, how):
    args = ("--slots", "2", "--state-dir", str(tmp_path))
    convs = Conversations(demo, CONVS if how == "stopped" else 8, how)
    server = ServerProcess(default_model_path(), *args)
    try:
        round_robin(convs, client_of(server), range(3))
        if how == "killed":
            assert written(server)["store"]["disk"]["states"] > 0
            server.proc.kill()  # SIGKILL: only what was written before survives
            server.proc.wait()
    finally:
        server.stop()
    server = ServerProcess(default_model_path(), *args)
    try:
        assert health(server)["store"]["disk"]["states"] >= len(convs.messages) * 3
        round_robin(convs, client_of(server), range(3, TURNS if how == "stopped" else 4))
        convs.check()
        fourth = [r for rs in convs.results.values() for r in rs if r["turn"] == 3]
        assert all(r["cached"] >= r["expected"] for r in fourth), [(r["cached"], r["expected"]) for r in fourth]
        assert health(server)["store"]["restores"]["disk"] >= len(convs.messages)
    finally:
        server.stop()


def served_then_stopped(convs: Conversations, args: tuple, turns: range) -> None:
    """The conversations' turns on a server of `args` that is stopped afterwards."""
    server = ServerProcess(default_model_path(), *args)
    try:
        round_robin(convs, client_of(server), turns)
    finally:
        server.stop()


def latest_state(demo, convs: Conversations, directory, c: int):
    """The file of conversation c's newest state (the store's name for its tokens before the generation header)."""
    prompt = convs.results[c][-1]["prompt"]
    return directory / file_name(prompt[:max(i for i, t in enumerate(prompt) if t == demo.tokenizer.im_start_id)])


def test_damaged_and_foreign_state_files_are_refused_with_one_notice_each_and_answers_stay_right(demo, tmp_path):
    args = ("--slots", "2", "--state-dir", str(tmp_path))
    convs = Conversations(demo, 4, "damaged")
    served_then_stopped(convs, args, range(3))

    def latest(c):
        return latest_state(demo, convs, tmp_path, c)

    data = bytearray(latest(0).read_bytes())
    data[-50] ^= 0x01
    latest(0).write_bytes(bytes(data))                        # corrupt: a flipped bit in the tensors
    latest(1).write_bytes(latest(1).read_bytes()[:-1000])      # truncated
    from safetensors.torch import load_file, save_file

    meta = read_header(latest(2))
    meta["model_sha256"] = "1" * 64
    foreign = tmp_path / ("f" * 40 + ".state")
    save_file(load_file(str(latest(2))), str(foreign), metadata=meta)  # another model's
    server = ServerProcess(default_model_path(), *args)
    try:
        round_robin(convs, client_of(server), range(3, 4))
        convs.check(first_turn=3, share=0.5)  # the damaged two fall back to an older state or a prefill
        notices = health(server)["notices"]
        refused = [n for n in notices if "refused" in n]
        assert len(refused) == 2, notices
        assert any("corrupt" in n or "CRC" in n for n in refused)
        assert sum("another model" in n for n in notices) == 1 and foreign.exists()
        for c in (2, 3):
            r = convs.results[c][-1]
            assert r["cached"] >= r["expected"]
        assert "Traceback" not in server.stderr
    finally:
        server.stop()


def test_ram_and_disk_budgets_hold_when_the_conversations_overflow_both(demo, tmp_path):
    server = ServerProcess(default_model_path(), "--slots", "2", "--state-dir", str(tmp_path),
                           "--state-ram", "2M", "--state-disk", "5M")
    try:
        convs = Conversations(demo, 8, "budgets")
        client = client_of(server)
        for k in range(4):
            for c in convs.messages:
                convs.turn(client, c, k)
                store = health(server)["store"]
                assert store["disk"]["bytes"] <= store["disk"]["budget"]
        store = written(server)["store"]
        assert store["ram"]["bytes"] <= store["ram"]["budget"] == 2 << 20
        assert store["disk"]["bytes"] <= store["disk"]["budget"] == 5 << 20
        assert sum(p.stat().st_size for p in tmp_path.glob("*.state")) <= 5 << 20
        assert store["evictions"]["ram"] > 0 and store["evictions"]["disk"] > 0
        convs.check(share=0.0)  # every answer right; what resumes depends on what the budgets kept
        assert store["restores"]["ram"] + store["restores"]["disk"] > 0
    finally:
        server.stop()


def test_a_serve_process_on_a_state_directory_with_odd_neighbours_starts_answers_right_and_deletes_none(demo, tmp_path):
    """Issue 32, items 3-5, through `serve` itself: a FIFO named x.state (opening it blocked the server before it
    listened), a directory named y.state (a crash at start), a symlink to a state outside, files the store did not
    write (notes.state, .tmp-backup.state, a `chat --resume` state) and a state whose token list was edited. The
    server starts, answers as a clean one does, uses nothing wrong and removes nothing of anyone else's."""
    import os

    from safetensors.torch import load_file, save_file

    args = ("--slots", "1", "--state-dir", str(tmp_path))
    convs = Conversations(demo, 3, "neighbours")
    served_then_stopped(convs, args, range(2))
    states = sorted(tmp_path.glob("*.state"))
    assert states
    outside = tmp_path.parent / f"{tmp_path.name}-outside.state"
    outside.write_bytes(states[0].read_bytes())
    os.mkfifo(tmp_path / "x.state")
    (tmp_path / "y.state").mkdir()
    (tmp_path / "z.state").symlink_to(outside)
    (tmp_path / "notes.state").write_text("my notes")
    (tmp_path / ".tmp-backup.state").write_text("a backup")
    (tmp_path / "mychat.state").write_bytes(states[-1].read_bytes())

    def latest(c):
        return latest_state(demo, convs, tmp_path, c)

    # conversation 0's state under conversation 1's tokens, in the place of conversation 1's own
    meta = read_header(latest(0))
    meta["tokens"] = read_header(latest(1))["tokens"]
    forged = latest(1)
    save_file(load_file(str(latest(0))), str(forged), metadata=meta)
    theirs = {"x.state", "y.state", "z.state", "notes.state", ".tmp-backup.state", "mychat.state"}
    server = ServerProcess(default_model_path(), *args)  # came up: the FIFO was never opened
    try:
        round_robin(convs, client_of(server), range(2, 3))
        convs.check(first_turn=2, share=0.6)  # every answer right; the forged conversation resumed from further back
        now = {p.name for p in tmp_path.iterdir()}
        assert theirs <= now and outside.exists(), sorted(theirs - now)
        notices = " ".join(health(server)["notices"])
        assert "not a regular file" in notices and "not this store's" in notices
        assert "HMAC" in notices  # the forged state was read, refused, and never used
        assert "Traceback" not in server.stderr
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()
