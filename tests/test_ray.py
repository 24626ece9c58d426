"""Replicas on Ray Serve (`deltaserve serve --replicas 2`, a real local Ray instance, the demo model): conversations
stay where their state is, answer as one server does, survive a replica killed between turns or mid-request, and the
single-process server never imports Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from deltaserve.demo import default_model_path
from tests.server_proc import ServerProcess, free_port

MAX = 12
CONVS = 16
TURNS = 5
REPO = Path(__file__).resolve().parents[1]
SAY_RAY = "ray was imported"
# ray.serve's own config models, under pydantic 2.14
pytestmark = pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")


class ReplicasProcess:
    """`deltaserve serve --replicas N` in a session of its own (its Ray instance's processes are its children)."""

    def __init__(self, *args: str, replicas: int = 2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"deltaserve-replicas-{self.port}.log"
        cmd = [sys.executable, "-m", "deltaserve.frontends.cli", "serve", str(default_model_path()), "--replicas",
               str(replicas), "--port", str(self.port), "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"), cwd=REPO,
                                     start_new_session=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve --replicas exited: {self.log.read_text()[-3000:]}")
            if "listening on" in self.log.read_text():
                try:
                    if health(self)["status"] == "ok":
                        return
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"serve --replicas did not come up in 300 s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its Ray instance is left
        except ProcessLookupError:
            pass


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def question(c: int, k: int) -> str:
    return f"Conversation {c}, turn {k}: what is {c} plus {k}, and what did I ask before?"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    server = ReplicasProcess("--slots", "2", "--state-dir", str(tmp_path_factory.mktemp("states")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def single():
    server = ServerProcess(default_model_path(), "--slots", "2")
    yield server
    server.stop()


class Conversations:
    """Conversations sent to the replicas' endpoint and, turn for turn, to a single `deltaserve serve`."""

    def __init__(self, demo_tokenizer_im_start: int, n: int):
        self.im_start = demo_tokenizer_im_start
        self.messages = {c: [{"role": "system", "content": "You are a calculator."}] for c in range(n)}
        self.results: dict[int, list[dict]] = {c: [] for c in range(n)}

    def turn(self, replicas, single, c: int, k: int) -> dict:
        self.messages[c].append({"role": "user", "content": question(c, k)})
        raw = client_of(replicas).chat.completions.with_raw_response.create(
            model="demo-qwen35", messages=self.messages[c], max_tokens=MAX, temperature=0)
        r = raw.parse()
        want = client_of(single).chat.completions.create(model="demo-qwen35", messages=self.messages[c],
                                                         max_tokens=MAX, temperature=0).choices[0].message.content
        got = r.choices[0].message.content
        prev = self.results[c][-1] if self.results[c] else None
        res = {"turn": k, "answer": got, "want": want, "cached": r.usage.prompt_tokens_details.cached_tokens,
               "prompt_tokens": r.usage.prompt_tokens, "replica": int(raw.headers["x-deltaserve-replica"]),
               # a full hit: the previous turn's state, its prompt less its generation header (7 tokens here)
               "expected": prev["prompt_tokens"] - 7 if prev else None}
        self.messages[c].append({"role": "assistant", "content": got})
        self.results[c].append(res)
        return res

    def all_turns(self, replicas, single, turns) -> None:
        errors = []

        def drive(c):
            try:
                for k in turns:
                    self.turn(replicas, single, c, k)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=drive, args=(c,)) for c in self.messages]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors, errors[:3]

    def wrong(self) -> list:
        return [(c, r["turn"], r["answer"], r["want"]) for c, rs in self.results.items() for r in rs
                if r["answer"] != r["want"]]


@pytest.fixture(scope="module")
def conversations(replicas, single):
    import deltaserve

    convs = Conversations(deltaserve.load(default_model_path()).tokenizer.im_start_id, CONVS)
    convs.all_turns(replicas, single, range(TURNS))
    return convs


def written(server, timeout: float = 60) -> dict:
    """/health once no replica's store has a write pending."""
    deadline = time.time() + timeout
    while True:
        h = health(server)
        if all(not r["store"]["disk"]["pending_writes"] for r in h["replicas"] if r["up"]) or time.time() > deadline:
            return h
        time.sleep(0.05)


def both_up(server, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while True:
        h = health(server)
        if h["status"] == "ok" or time.time() > deadline:
            return h
        time.sleep(0.5)


def test_sixteen_conversations_of_five_turns_through_two_replicas_resume_and_answer_as_a_single_server(
        replicas, conversations):
    assert not conversations.wrong(), f"answers that differ from a single deltaserve serve: {conversations.wrong()[:3]}"
    follow = [r for rs in conversations.results.values() for r in rs if r["expected"] is not None]
    assert len(follow) == CONVS * (TURNS - 1)
    cached = [r for r in follow if r["cached"] > 0]
    assert len(cached) >= 0.95 * len(follow), [(r["turn"], r["cached"]) for r in follow if r not in cached]
    full = [r for r in follow if r["cached"] >= r["expected"]]
    assert len(full) >= 0.95 * len(follow)
    firsts = {rs[0]["replica"] for rs in conversations.results.values()}
    assert firsts == {0, 1}, "the consistent hash put every conversation on one replica"
    h = health(replicas)
    assert [r["threads"] for r in h["replicas"]] == [1, 1]
    assert all(r["store"]["disk"]["directory"] == h["router"]["state_dir"] for r in h["replicas"])
    metrics = httpx.get(replicas.url + "/metrics", timeout=30).text
    assert 'deltaserve_cached_tokens_total{replica="0"}' in metrics and 'replica="1"' in metrics
    assert 'deltaserve_router_requests_total{replica="' in metrics


def test_a_replica_killed_between_turns_leaves_every_conversation_going_on_restored_from_the_store(
        replicas, single, conversations):
    h = written(replicas)
    victim = h["replicas"][0]
    last = {c: rs[-1] for c, rs in conversations.results.items()}
    on_victim = [c for c, r in last.items() if r["replica"] == 0]
    assert on_victim, "no conversation was on replica 0"
    os.kill(victim["pid"], signal.SIGKILL)
    conversations.all_turns(replicas, single, range(TURNS, TURNS + 1))
    assert not conversations.wrong(), conversations.wrong()[:3]
    after = {c: rs[-1] for c, rs in conversations.results.items()}
    moved = [after[c] for c in on_victim]
    assert all(r["cached"] >= r["expected"] > 0 for r in moved), [(r["cached"], r["expected"]) for r in moved]
    stayed = [after[c] for c in after if c not in on_victim]
    assert all(r["cached"] >= r["expected"] for r in stayed), [(r["cached"], r["expected"]) for r in stayed]
    h = both_up(replicas)  # Ray Serve starts replica 0 again, in a new process
    assert h["status"] == "ok" and h["replicas"][0]["pid"] != victim["pid"] and h["replicas"][0]["restarts"] >= 1
    restores = sum(r["store"]["restores"]["disk"] for r in h["replicas"])
    assert restores >= len(on_victim)
    conversations.all_turns(replicas, single, range(TURNS + 1, TURNS + 2))
    assert not conversations.wrong()
    assert all(rs[-1]["cached"] >= rs[-1]["expected"] for rs in conversations.results.values())


def _inflight_on(server, timeout: float = 30) -> tuple[int, int]:
    """(replica, pid) of a replica with a request in flight."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for r in health(server)["replicas"]:
            if r["up"] and r["inflight"] > 0:
                return r["replica"], r["pid"]
        time.sleep(0.05)
    raise AssertionError("no request in flight")


# a generation that runs to its budget on the demo model (it keeps repeating the list: measured 1,500 of 1,500)
LONG = {"prompt": " ".join(["red fox blue green"] * 5), "max_tokens": 1500,
        "temperature": 0}


def test_a_replica_killed_mid_request_fails_its_stream_cleanly_and_retries_what_had_not_streamed(replicas):
    both_up(replicas)
    # a stream that has begun: it ends with an error event and [DONE], never hangs or answers from another state
    events, replica = [], None
    with httpx.stream("POST", replicas.url + "/v1/completions", json=dict(LONG, stream=True), timeout=120) as r:
        assert r.status_code == 200
        replica = int(r.headers["x-deltaserve-replica"])
        pid = next(x["pid"] for x in health(replicas)["replicas"] if x["replica"] == replica)
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 5:
                    os.kill(pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_failed" and "went away" in error["message"]
    assert len(events) < LONG["max_tokens"]
    # a request that had not streamed anything (not streamed at all): retried once on the other replica, whole
    h = both_up(replicas)
    retries = h["router"]["retries"]
    answer = {}
    t = threading.Thread(target=lambda: answer.update(
        r=httpx.post(replicas.url + "/v1/completions", json=LONG, timeout=120)))
    t.start()
    replica, pid = _inflight_on(replicas)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    t.join()
    r = answer["r"]
    assert r.status_code == 200, r.text
    assert int(r.headers["x-deltaserve-replica"]) != replica
    assert r.json()["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert health(replicas)["router"]["retries"] == retries + 1
    both_up(replicas)


def test_the_local_ray_instance_listens_on_loopback_only(replicas):
    import ipaddress

    import psutil

    ours = {p.pid for p in psutil.process_iter() if _session_of(p.pid) == replicas.proc.pid}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert len(listening) >= 5  # GCS, raylet, workers, the HTTP proxy, ...
    wide = [(c.laddr, c.pid) for c in listening
            if not ipaddress.ip_address(c.laddr.ip.removeprefix("::ffff:")).is_loopback]
    assert not wide, f"listening beyond loopback: {wide}"


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_the_single_process_server_never_imports_ray(tmp_path):
    """A `ray` package that says so when imported, first on the path of a real `deltaserve serve`."""
    fake = tmp_path / "ray"
    fake.mkdir()
    marker = tmp_path / "imported"
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write({SAY_RAY!r})\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    server = ServerProcess(default_model_path(), "--slots", "1", env=env)
    try:
        r = client_of(server).chat.completions.create(model="demo-qwen35", max_tokens=4,
                                                      messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].finish_reason in ("stop", "length")
        assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
    finally:
        server.stop()
    assert not marker.exists(), "the single-process server imported ray"
    probe = subprocess.run([sys.executable, "-c", "import ray, sys; print(ray.__file__)"], env=dict(os.environ, **env),
                           capture_output=True, text=True, cwd=REPO)
    assert marker.exists() and probe.returncode == 0  # the fake is what `import ray` finds on that path


def test_a_request_naming_a_stored_response_goes_to_the_replica_that_answered_it_while_it_is_up_and_free():
    from deltaserve.frontends.ray import Routes, named_response

    routes = Routes(replicas=3, slots=1, im_start=1, assistant=(7,))
    rid = "resp_" + "1" * 32
    body = json.dumps({"input": "more", "previous_response_id": rid}).encode()
    assert named_response("POST", "/v1/responses", body) == rid
    assert named_response("GET", f"/v1/responses/{rid}/input_items", b"") == rid
    assert named_response("POST", "/v1/responses", b"not json") is None
    assert named_response("POST", "/v1/chat/completions", body) is None
    routes.answered(rid, 2)
    assert routes.choose(None, response=rid)[:2] == (2, "response")
    routes.inflight[2] = 1  # its one slot busy: another replica, which restores the state from the shared store
    assert routes.choose(None, response=rid)[:2] == (0, "response replica full")
    routes.inflight[2] = 0
    routes.up[2] = False
    assert routes.choose(None, response=rid)[:2] == (0, "response replica down")
    assert routes.choose(None, response="resp_" + "2" * 32)[1] == "least busy"  # one it never saw


def test_the_routing_keeps_a_conversation_on_its_replica_and_moves_it_only_when_that_one_is_full_or_down():
    from deltaserve.frontends.ray import Routes, rendezvous

    IM, A = 1, (7,)
    routes = Routes(replicas=3, slots=2, im_start=IM, assistant=A)

    def prompt(conv: int, turns: int) -> list[int]:  # system, then user/assistant turns, then the header
        p = [IM, 5, 100 + conv, 2]
        for k in range(turns):
            p += [IM, 6, 200 + 10 * conv + k, 2] + ([IM, 7, 300 + k, 2] if k < turns - 1 else [])
        return p + [IM, 7]

    first, why, _ = routes.choose(prompt(1, 1))
    assert why == "hash"
    routes.routed(prompt(1, 1), first, why)
    assert routes.opening(prompt(1, 1)) == routes.opening(prompt(1, 4))  # the same opening every turn
    r, why, n = routes.choose(prompt(1, 2))
    assert (r, why) == (first, "prefix") and n == len(prompt(1, 1)) - 2
    routes.inflight[first] = 2  # its slots are busy: another replica, which restores from the shared store
    r, why, _ = routes.choose(prompt(1, 2))
    assert r != first and why == "prefix replica full"
    routes.inflight[first] = 0
    routes.up[first] = False
    r, why, _ = routes.choose(prompt(1, 2))
    assert r != first and why == "prefix replica down"
    routes.routed(prompt(1, 2), r, why)
    routes.up[first] = True
    assert routes.choose(prompt(1, 3))[0] == r  # it stays where it went
    # a consistent hash: a replica going away moves only its own keys
    keys = [str(k).encode() for k in range(300)]
    before = {k: rendezvous(k, [0, 1, 2]) for k in keys}
    after = {k: rendezvous(k, [0, 2]) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != 1)
    assert 60 < sum(before[k] == 1 for k in keys) < 140


def test_threads_per_replica_share_the_cores_and_a_config_file_can_name_the_application():
    pytest.importorskip("ray")
    from deltaserve.errors import DeltaserveError
    from deltaserve.frontends.ray import build, replica_threads

    big, small = 800 << 20, 8 << 20
    assert replica_threads(big, 2, 2)[0] == 1 and replica_threads(big, 1, 2)[0] == 2
    assert replica_threads(big, 3, 2)[0] == 1 and replica_threads(big, 2, 16)[0] == 8
    assert replica_threads(small, 1, 16)[0] == 1 and replica_threads(big, 2, 2, requested=2)[0] == 2
    from ray.serve import Application

    assert isinstance(build({"replicas": 2, "slots": 1, "state_dir": "/tmp/x"}), Application)
    with pytest.raises(DeltaserveError, match="unknown option"):
        build({"replica": 2})
