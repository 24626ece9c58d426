"""The embedded demo model (src/deltaserve/data/demo-qwen35.gguf) really answers, through deltaserve.

Held-out items are evaluate.py's sets (the ones training_log.json reports: 245 single turns, 120
conversations), from scripts/demo/corpus.py with seeds of their own (disjoint from training by
construction: the training generator never emits a reserved message, and train.py checks these very
sets against every trained conversation). Answers are greedy, scored by exact match after stripping
whitespace and one final period.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO_SCRIPTS = ROOT / "scripts" / "demo"
if str(DEMO_SCRIPTS) not in sys.path:
    sys.path.insert(0, str(DEMO_SCRIPTS))

import corpus as C  # noqa: E402
import evaluate as E  # noqa: E402

import deltaserve  # noqa: E402
from deltaserve.demo import DEMO_FILE, default_model_path  # noqa: E402

HF_CHECK = ROOT / "tests" / "data" / "demo_hf_check.json"


@pytest.fixture(scope="module")
def demo():
    assert DEMO_FILE.is_file(), f"the embedded demo model is missing: {DEMO_FILE}"
    return deltaserve.load(DEMO_FILE)


def render(model, messages) -> list[int]:
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False))


def test_the_demo_model_is_the_default_model_a_hybrid_of_both_layer_kinds_under_25_mb(demo):
    assert default_model_path() == DEMO_FILE
    assert DEMO_FILE.stat().st_size <= 25 * 1000 * 1000
    c = demo.config
    assert c.attention_layers and c.deltanet_layers
    assert c.linear_key_head_dim == c.linear_value_head_dim
    assert demo.tokenizer.chat_template is not None and "enable_thinking" in demo.tokenizer.chat_template


def test_the_demo_model_answers_at_least_90_percent_of_held_out_single_turn_tasks_exactly(demo):
    items = C.single_turn_eval(E.SINGLE_SEED, E.SINGLE_PER_KIND)
    assert len(items) == 7 * E.SINGLE_PER_KIND and len({t.kind for t in items}) == 7
    by_kind, failures = E.run_single(demo, items)
    flat = [x for v in by_kind.values() for x in v]
    accuracy = sum(flat) / len(flat)
    assert accuracy >= 0.9, (accuracy, failures[:10])


def test_the_demo_model_recalls_a_fact_asked_three_or_more_turns_later_at_least_90_percent_of_the_time(demo):
    convs = C.recall_eval(E.RECALL_SEED, E.RECALL_COUNT)
    for turns, scored in convs:
        fact = next(k for k, t in enumerate(turns) if t.kind == "fact" and t.slot == turns[scored[0]].slot)
        assert scored[0] - fact >= 3
    scored_ok, _, reused_ok, failures = E.run_recall(demo, convs)
    accuracy = sum(scored_ok) / len(scored_ok)
    assert accuracy >= 0.9, (accuracy, failures[:5])
    assert reused_ok, "a later turn of a resident session prefilled its whole prompt"


def test_a_resident_session_answers_token_for_token_as_a_fresh_prefill_of_every_turn_would(demo):
    convs = C.recall_eval(E.TEST_RECALL_SEED + 100, 6)
    turns_checked = 0
    for turns, _ in convs:
        s = demo.session(quiet=True)
        history: list[dict] = []
        for k, t in enumerate(turns):
            history.append({"role": "user", "content": t.user})
            prompt = render(demo, history)
            resident = s.generate(prompt, max_tokens=E.MAX_TOKENS)
            fresh = demo.generate(prompt, max_tokens=E.MAX_TOKENS)
            assert resident.tokens == fresh.tokens, (k, t.user, resident.text, fresh.text)
            if k > 0:
                assert resident.reused > 0 and resident.prefilled < resident.prompt_tokens, (k, resident.start)
            history.append({"role": "assistant", "content": resident.text})
            turns_checked += 1
    assert turns_checked >= 24


def _check_records():
    data = json.loads(HF_CHECK.read_text())
    assert data["conversations"], "no recorded conversations"
    return data


def test_the_shipped_model_answers_exactly_as_transformers_greedy_generate_did_on_the_trained_weights(demo):
    data = _check_records()
    n = 0
    for rec in data["conversations"]:
        s = demo.session(quiet=True)
        history: list[dict] = []
        for user, turn in zip(rec["users"], rec["turns"]):
            history.append({"role": "user", "content": user})
            # the recorded prompt is what deltaserve renders today from the same history
            assert render(demo, history) == turn["prompt_ids"]
            got = s.chat(history, max_tokens=data["max_tokens"], enable_thinking=False)
            assert got.tokens == turn["ids"], (user, got.text, turn["text"])
            history.append({"role": "assistant", "content": got.text})
            n += 1
    assert n >= 10


def test_the_shipped_model_matches_a_live_transformers_greedy_generate_when_the_training_checkpoint_is_here(demo):
    hf_dir = Path(os.environ.get("DELTASERVE_DEMO_HF", "/tmp/demo-build/hf"))
    if not (hf_dir / "model.safetensors").is_file():
        pytest.skip(f"no training checkpoint at {hf_dir} (set DELTASERVE_DEMO_HF); the recorded ids are checked instead")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    oracle = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = demo.tokenizer
    for rec in _check_records()["conversations"][:4]:
        history: list[dict] = []
        s = demo.session(quiet=True)
        for user in rec["users"]:
            history.append({"role": "user", "content": user})
            prompt = render(demo, history)
            with torch.no_grad():
                out = oracle.generate(torch.tensor([prompt]), max_new_tokens=E.MAX_TOKENS, do_sample=False,
                                      eos_token_id=sorted(tok.stop_ids), pad_token_id=tok.pad_id)
            want = [int(x) for x in out[0, len(prompt):].tolist()]
            want = want[: next((i for i, x in enumerate(want) if x in tok.stop_ids), len(want))]
            got = s.generate(prompt, max_tokens=E.MAX_TOKENS)
            assert got.tokens == want, (user, got.text, tok.decode(want))
            history.append({"role": "assistant", "content": got.text})
