"""`deltaserve serve` through the official openai client, against a real server on loopback."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.server_proc import TEST_DEVICE, ServerProcess

# what /health and the startup lines call the backend the test servers run on (scripts/gpu_check.sh: CUDA)
BACKEND, BACKEND_WORD = ("cpu", "CPU") if TEST_DEVICE == "cpu" else ("cuda:0", "GPU")

MAX = 12


@pytest.fixture(scope="module")
def server(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "2", "--queue", "8", "--think", "off")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def render(model, messages, thinking=False):
    """The prompt ids as the turn pipeline renders them (a message's text, a random model's answer sent back included,
    encoded as text: `</tool_response>` in an answer is not the template's token when it comes back)."""
    return model.render(messages, thinking)[0]


def alone(model, messages, max_tokens=MAX, thinking=False):
    """The reference: the conversation's prompt run on a fresh one-call session."""
    return model.generate(render(model, messages, thinking), max_tokens=max_tokens)


def test_models_lists_the_served_model(client, hybrid_gguf):
    models = client.models.list()
    assert [m.id for m in models.data] == [hybrid_gguf.name]


def test_a_chat_completion_answers_what_the_engine_answers(client, hybrid_model):
    msgs = [{"role": "user", "content": "Tell me about the moon."}]
    r = client.chat.completions.create(model="model-f32", messages=msgs, max_tokens=MAX, temperature=0)
    ref = alone(hybrid_model, msgs)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == ref.generated and r.usage.prompt_tokens == ref.prompt_tokens
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_streaming_hands_out_the_same_text_and_usage(client, hybrid_model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count the stars."}]
    stream = client.chat.completions.create(model="model-f32", messages=msgs, max_tokens=MAX, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for ev in stream:
        if ev.choices:
            text += ev.choices[0].delta.content or ""
            finish = ev.choices[0].finish_reason or finish
        if ev.usage:
            usage = ev.usage
    ref = alone(hybrid_model, msgs)
    assert text == ref.text and finish == ref.finish_reason
    assert usage.completion_tokens == ref.generated


def test_a_completion_continues_raw_text(client, hybrid_model):
    r = client.completions.create(model="model-f32", prompt="Once upon a time", max_tokens=MAX, temperature=0)
    ref = hybrid_model.generate(hybrid_model.tokenizer.encode("Once upon a time"), max_tokens=MAX)
    assert r.choices[0].text == ref.text and r.object == "text_completion"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="model-f32", prompt="Once upon a time", max_tokens=MAX, temperature=0, stream=True) if c.choices)
    assert streamed == ref.text


def test_the_second_turn_reports_the_sessions_reuse_as_cached_tokens(client, hybrid_model):
    msgs = [{"role": "user", "content": "My name is Ada."}]
    r1 = client.chat.completions.create(model="model-f32", messages=msgs, max_tokens=MAX, temperature=0)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "What is my name?"}]
    r2 = client.chat.completions.create(model="model-f32", messages=msgs, max_tokens=MAX, temperature=0)
    # the same two turns on one local session: its reused count is what the server must report
    local = hybrid_model.session(quiet=True)
    local.generate(render(hybrid_model, msgs[:1]), max_tokens=MAX)
    second = local.generate(render(hybrid_model, msgs), max_tokens=MAX)
    assert r2.usage.prompt_tokens_details.cached_tokens == second.reused > 0
    assert r2.choices[0].message.content == second.text == alone(hybrid_model, msgs).text


def test_thinking_comes_back_as_reasoning_content(client, hybrid_model):
    msgs = [{"role": "user", "content": "Think about rivers."}]
    r = client.chat.completions.create(model="model-f32", messages=msgs, max_tokens=MAX, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    ref = alone(hybrid_model, msgs, thinking=True)
    reasoning, _, content = ref.text.partition("</think>")
    got = r.choices[0].message
    assert (got.model_extra or {}).get("reasoning_content") == reasoning.strip()
    assert got.content == content.lstrip("\n")


def test_four_conversations_over_two_slots_answer_as_if_alone_keep_their_slots_and_resume_from_the_store(
        client, hybrid_model):
    convs = {name: [] for name in "ABCD"}
    cached: dict[str, list[int]] = {name: [] for name in "ABCD"}
    answers_ok = []

    def turn(name: str, text: str):
        convs[name].append({"role": "user", "content": f"{name}: {text}"})
        r = client.chat.completions.create(model="model-f32", messages=convs[name], max_tokens=MAX, temperature=0)
        answers_ok.append(r.choices[0].message.content == alone(hybrid_model, convs[name]).text)
        convs[name].append({"role": "assistant", "content": r.choices[0].message.content})
        cached[name].append(r.usage.prompt_tokens_details.cached_tokens)

    def pair(a: str, b: str, text: str):
        threads = [threading.Thread(target=turn, args=(n, text)) for n in (a, b)]
        [t.start() for t in threads]
        [t.join() for t in threads]

    for k in range(3):  # A and B at the same time: each keeps a slot of its own
        pair("A", "B", f"turn {k} of the first pair")
    for k in range(2):  # C and D take the slots over
        pair("C", "D", f"turn {k} of the second pair")
    turn("A", "back again")  # A's slot was taken: it resumes from the state store
    assert all(answers_ok) and len(answers_ok) == 11
    header = len(render(hybrid_model, [{"role": "user", "content": ""}])) - 1
    for name in "AB":
        assert all(c > header for c in cached[name][1:3]), cached  # its slot was free: real reuse
    for name in "CD":
        assert cached[name][1] > header, cached
    before = render(hybrid_model, convs["A"][:5])  # A's third prompt: its state up to the generation header
    im_start = hybrid_model.tokenizer.im_start_id
    assert cached["A"][3] == max(i for i, t in enumerate(before) if t == im_start), cached


def test_a_client_that_disconnects_mid_stream_leaves_the_conversation_usable(server, client, hybrid_model):
    msgs = [{"role": "user", "content": "Write a very long story about the sea."}]
    body = {"model": "model-f32", "messages": msgs, "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data:") for line in got)
    deadline = time.time() + 30
    while time.time() < deadline:  # the generation stops soon after the client left
        slots = httpx.get(server.url + "/health").json()["slots"]
        if not any(s["busy"] for s in slots):
            break
        time.sleep(0.05)
    assert not any(s["busy"] for s in slots)
    prompt = len(render(hybrid_model, msgs))
    assert all(s["held_tokens"] < prompt + 1500 for s in slots), slots  # cut short, not run to 3000 tokens
    r = client.chat.completions.create(model="model-f32", messages=msgs, max_tokens=MAX, temperature=0)
    assert r.choices[0].message.content == alone(hybrid_model, msgs).text
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    health = httpx.get(server.url + "/health").json()
    assert not any(s["busy"] for s in health["slots"])


def test_health_names_the_model_backend_context_slots_and_notices(server):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["backend"] == BACKEND and h["layers"] == 4
    assert h["declared_context"] == 32768 and len(h["slots"]) == 2
    assert any(n.startswith(f"Backend: {BACKEND_WORD}") for n in h["notices"])


def test_startup_lines_say_the_model_layers_backend_context_and_template(server):
    log = server.stderr
    for needle in ("4 layers", f"backend {BACKEND_WORD}", "declared context 32768", "chat template from the model file",
                   "listening on http://127.0.0.1:"):
        assert needle in log, needle
