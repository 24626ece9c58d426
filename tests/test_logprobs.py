"""Log-probabilities (chat, completions with echo, Responses), the tokenizer routes, and lm-evaluation-harness's
`local-completions` model scoring a small multiple-choice task, against a real `deltaserve serve` on the hybrid
fixture's f32 file; every log-probability compared with transformers' log-softmax of the same fixture (the oracle,
f32) within 2e-3, and the harness's per-choice scores within 1e-3 of the oracle's."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tests.server_proc import ServerProcess

TOL = 2e-3
NAME = "model-f32.gguf"  # the hybrid fixture's file, the name the server answers to


@pytest.fixture(scope="module")
def server(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "2", "--think", "off")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oracle_logprobs(hybrid_oracle):
    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hybrid_oracle(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return run


def token_ids(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"content": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_completions_echo_gives_every_prompt_tokens_logprob_and_the_answers_as_the_oracle(server, client,
                                                                                       oracle_logprobs, hybrid_model):
    prompt = list(range(40, 110))  # 70 ids: the prefill's rows in two chunks
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=5)
    lp = r.choices[0].logprobs
    answer = [t for t in lp.tokens[len(prompt):]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert len(lp.token_logprobs) == len(prompt) + 3 and len(answer) == 3
    assert r.choices[0].text.startswith(httpx.post(server.url + "/detokenize", json={"tokens": prompt}).json()["content"])
    # the generated ids, read back from a plain request's echo-less tokens: greedy, so the same three
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=0)
    assert plain.choices[0].logprobs.tokens == answer
    generated = hybrid_model.generate(prompt, max_tokens=3).tokens  # greedy: the engine's own three ids
    assert len(generated) == 3
    rows = oracle_logprobs(prompt + generated)
    for i in range(1, len(prompt)):
        assert abs(lp.token_logprobs[i] - rows[i - 1, prompt[i]].item()) <= TOL, i
    for j, g in enumerate(generated):
        row = rows[len(prompt) - 1 + j]
        assert abs(lp.token_logprobs[len(prompt) + j] - row[g].item()) <= TOL
        assert g == int(row.argmax())  # greedy took the oracle's best
        top = lp.top_logprobs[len(prompt) + j]  # keyed by text: tokens of the same text (or none) share a key
        best = torch.topk(row, 5).values.tolist()
        assert 1 <= len(top) <= 5 and abs(max(top.values()) - best[0]) <= TOL
        assert all(min(abs(v - b) for b in best) <= TOL for v in top.values())


def test_chat_logprobs_streamed_and_not_are_the_same_and_the_oracles(server, client, oracle_logprobs, hybrid_model):
    messages = [{"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    streamed = []
    for c in client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=3, stream=True):
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content:
            streamed += c.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    # the oracle on the rendered prompt and the answer's ids (greedy: the engine's own answer to the same ids)
    ids, _ = hybrid_model.render(messages, enable_thinking=False)
    answer = hybrid_model.generate(ids, max_tokens=6).tokens
    assert len(answer) == len(content)
    rows = oracle_logprobs(ids + answer)
    for j, t in enumerate(content):
        row = rows[len(ids) - 1 + j]
        assert bytes(t.bytes) == hybrid_model.tokenizer.token_bytes(answer[j])
        assert abs(t.logprob - row[answer[j]].item()) <= TOL
        assert len(t.top_logprobs) == 3
        values = [x.logprob for x in t.top_logprobs]
        assert max(abs(a - b) for a, b in zip(values, torch.topk(row, 3).values.tolist())) <= TOL


def test_responses_give_the_output_texts_logprobs_when_asked(client):
    r = client.responses.create(model=NAME, input="hello", max_output_tokens=5, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    part = r.output[-1].content[0]
    assert part.logprobs and all(len(t.top_logprobs) == 2 for t in part.logprobs)
    assert "".join(t.token for t in part.logprobs) == part.text  # (the last token here has no text)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                          temperature=0, logprobs=True)
    mine, theirs = part.logprobs, chat.choices[0].logprobs.content
    n = min(len(mine), len(theirs))  # (a near tie at the last token may end one of them on a stop token)
    assert n >= 4 and [t.logprob for t in mine[:n]] == pytest.approx([t.logprob for t in theirs[:n]], abs=1e-5)


def test_tokenize_and_detokenize_as_llama_server_and_vllm_have_them(server):
    r = httpx.post(server.url + "/tokenize", json={"content": "Hello world", "with_pieces": True}).json()
    ids = [t["id"] for t in r["tokens"]]
    assert r["count"] == len(ids) and "".join(t["piece"] for t in r["tokens"] if isinstance(t["piece"], str))
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["content"] == "Hello world"
    assert httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()[
        "tokens"] == ids  # vLLM's field names
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and "outside 0.." in bad.json()["error"]["message"]
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] and info["model_max_length"] > 0
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["context_length"] == card["max_model_len"] == info["model_max_length"]


TASK = """task: deltaserve_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
DOCS = [{"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
        {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
        {"question": "Paris is in", "choices": ["France", "Spain", "the sea"], "answer": 0}]


def run_lm_eval(server, name: str, tmp_path, monkeypatch) -> list:
    """lm_eval's local-completions model on the tiny task, as its users point it at a server: it finds
    /tokenizer_info and /tokenize (the remote tokenizer), sends each choice as [[context ids + continuation ids]]
    with echo and logprobs, and sums the continuation's log-probabilities. Offline: the task's data is a local JSON
    file. Its samples."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny.yaml").write_text(TASK.format(data=data))
    out = lm_eval.simple_evaluate(
        model="local-completions", model_args={"model": name, "base_url": server.url + "/v1/completions",
                                               "num_concurrent": 1, "max_retries": 1},
        tasks=["deltaserve_tiny"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    samples = out["samples"]["deltaserve_tiny"]
    assert len(samples) == len(DOCS) and "acc,none" in out["results"]["deltaserve_tiny"]
    return samples


def test_lm_evaluation_harness_runs_on_the_demo_model_and_scores_as_its_forward_does(tmp_path, monkeypatch):
    """The demo model served: the task runs to completion, each choice's score the sum the library's own forward
    (`Model.logits`, teacher-forced) gives the same ids."""
    import deltaserve
    from deltaserve.demo import DEMO_FILE

    demo = deltaserve.load()
    # Model.logits teacher-forces an f32 cache: the server keeps the same (its default f16 moves a sum by ~1e-3)
    with ServerProcess(DEMO_FILE, "--slots", "1", "--kv-type", "f32") as server:
        samples = run_lm_eval(server, DEMO_FILE.name, tmp_path, monkeypatch)
        for s in samples:
            doc = s["doc"]
            for choice, (score, _greedy) in zip(doc["choices"], s["filtered_resps"]):
                context = token_ids(server, doc["question"])
                whole = token_ids(server, doc["question"] + " " + choice)
                rows = torch.log_softmax(demo.logits(whole).float(), dim=-1)
                want = sum(rows[i - 1, whole[i]].item() for i in range(len(context), len(whole)))
                assert abs(score - want) <= 1e-3, (doc["question"], choice, score, want)


def test_lm_evaluation_harness_scores_a_task_as_the_oracle_does(server, oracle_logprobs, tmp_path, monkeypatch):
    """The hybrid fixture served: each choice's score within 1e-3 of transformers' on the same ids."""
    samples = run_lm_eval(server, NAME, tmp_path, monkeypatch)
    for s in samples:
        doc = s["doc"]
        for choice, (score, _greedy) in zip(doc["choices"], s["filtered_resps"]):
            context = token_ids(server, doc["question"])
            whole = token_ids(server, doc["question"] + " " + choice)
            rows = oracle_logprobs(whole)
            want = sum(rows[i - 1, whole[i]].item() for i in range(len(context), len(whole)))
            assert abs(score - want) <= 1e-3, (doc["question"], choice, score, want)
