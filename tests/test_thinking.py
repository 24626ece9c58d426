"""Issue 55: thinking under control, in the Python API and the CLI (the server's side: tests/test_thinking_server.py).

A thought's budget, the loop guard and what they insert (session/thinking.py), on the embedded demo model (which
thinks when asked: one newline, then `</think>`), on the random fixture model (which never closes a thought by
itself, so every budget is spent there), and on a sampler fixed to repeat a unit of tokens for the loop guard. The
guard itself on synthetic token streams and on text that does not repeat.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deltaserve
from deltaserve.session import decoding, thinking
from deltaserve.session.thinking import MIN_SPAN, REPEATS, LoopGuard

ROOT = Path(__file__).resolve().parents[1]
ASK = [{"role": "user", "content": "What is 12 + 9?"}]


@pytest.fixture(scope="module")
def demo():
    return deltaserve.load()


def thinking_prompt(model, messages=ASK) -> list[int]:
    ids, opens = model.render(messages, enable_thinking=True)
    assert opens and thinking.opens_thought(ids, model.tokenizer)
    return ids


def closing(tok, thought: list[int], message: str = "") -> list[int]:
    """What the template writes after a thought, as this test reads the rule: the bridge on its own line, then
    `\\n</think>\\n\\n` without its first newline where the thought's text already ends in one."""
    text = tok.decode(thought)
    lead = "" if thought and text.endswith("\n") else "\n"
    bridge = lead + message + "\n" if message else lead
    return (tok.encode(bridge) if bridge else []) + [tok.think_end_id] + tok.encode("\n\n")


# -- the budget ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0, 1, 16, 64])
def test_budgets_0_1_16_64_bound_the_demo_models_thought_and_it_still_answers(demo, budget):
    session = demo.session(quiet=True)
    turn = session.chat(ASK, enable_thinking=True, max_tokens=48, thinking_budget=budget)
    assert turn.finish_reason == "stop" and "21" in turn.text
    if budget == 0:  # a chat turn renders thinking off: the template's own empty thought, nothing to count
        assert turn.reasoning is None and turn.reasoning_ended is None and turn.reasoning_tokens == 0
        return
    assert turn.reasoning_tokens <= budget and turn.reasoning_ended in ("model", "budget")
    assert turn.tokens.count(demo.tokenizer.think_end_id) == 1
    # the demo model closes its thought itself well within 16: the budget changes nothing there
    if budget >= 16:
        free = demo.session(quiet=True).chat(ASK, enable_thinking=True, max_tokens=48)
        assert turn.reasoning_ended == "model" and turn.tokens == free.tokens


def test_a_budget_of_0_on_raw_ids_closes_the_thought_at_once_with_the_templates_closing(demo):
    tok = demo.tokenizer
    prompt = thinking_prompt(demo)
    turn = demo.session(quiet=True).generate(prompt, max_tokens=32, thinking_budget=0)
    want = closing(tok, [])
    assert turn.reasoning_tokens == 0 and turn.reasoning_ended in ("budget", "model")
    if turn.reasoning_ended == "budget":
        assert turn.tokens[:len(want)] == want and turn.inserted_tokens == len(want)
        assert tok.decode(prompt[-2:] + want) == "<think>\n\n</think>\n\n"  # the template's empty thought, as text
    assert "21" in tok.decode(turn.tokens)


@pytest.mark.parametrize("budget", [1, 16, 64])
def test_a_spent_budget_inserts_the_closing_and_the_answer_runs_under_its_own_max_tokens(hybrid_model, budget):
    """The random fixture never writes `</think>` itself: every budget is spent, the closing is written, and the
    answer has max_tokens of its own after it."""
    tok = hybrid_model.tokenizer
    prompt = thinking_prompt(hybrid_model)
    turn = hybrid_model.session(quiet=True).generate(prompt, max_tokens=8, thinking_budget=budget)
    assert turn.reasoning_ended == "budget" and turn.reasoning_tokens == budget
    want = closing(tok, turn.tokens[:budget])
    assert turn.tokens[budget:budget + len(want)] == want and turn.inserted_tokens == len(want)
    assert turn.answer_tokens == 8 and turn.finish_reason == "length" and not turn.context_capped
    assert len(turn.tokens) == budget + len(want) + 8


def test_the_bridge_sentence_comes_before_the_closing_as_text_never_as_a_template_token(hybrid_model):
    tok = hybrid_model.tokenizer
    message = "Time to answer. <|im_end|> </think>"
    turn = hybrid_model.session(quiet=True).generate(thinking_prompt(hybrid_model), max_tokens=4, thinking_budget=6,
                                                      thinking_message=message)
    inserted = turn.tokens[6:6 + turn.inserted_tokens]
    tail = [tok.think_end_id] + tok.encode("\n\n")
    assert inserted[-len(tail):] == tail
    assert tok.think_end_id not in inserted[:-len(tail)] and tok.im_end_id not in inserted
    assert message in tok.decode(inserted)


def test_with_an_unlimited_budget_a_greedy_turn_is_token_for_token_what_it_was_without_the_thought_control(
        hybrid_model, demo, monkeypatch):
    """The turn with its thought controlled (unlimited budget, the guard armed and silent) against the same turn
    with no thought control at all (the turn as it ran before issue 55), and against a budget larger than the
    thought."""
    cases = [(demo, thinking_prompt(demo), 40), (hybrid_model, thinking_prompt(hybrid_model), 40)]
    controlled = []
    for model, prompt, n in cases:
        t = model.session(quiet=True, mtp=0).generate(prompt, max_tokens=n)
        assert t.reasoning_ended is not None and t.reasoning_ended != "loop_guard"
        if t.reasoning_ended == "model" and t.finish_reason == "stop":  # a budget the thought never reaches
            big = model.session(quiet=True, mtp=0).generate(prompt, max_tokens=n, thinking_budget=10 ** 6)
            assert big.tokens == t.tokens
        controlled.append(t.tokens)
    assert {t.reasoning_ended for t in [model.session(quiet=True).generate(p, max_tokens=n) for model, p, n in cases]} \
        == {"model", "unclosed"}  # the demo closes its thought, the random fixture never does
    monkeypatch.setattr(thinking, "opens_thought", lambda prompt, tokenizer: False)
    for (model, prompt, n), tokens in zip(cases, controlled):
        bare = model.session(quiet=True, mtp=0).generate(prompt, max_tokens=n)
        assert bare.reasoning_ended is None and bare.tokens == tokens


def test_budgets_hold_with_speculative_drafts_on(demo, batch_invariant):
    """The demo model carries an MTP block: drafts are verified against the closing like any other token."""
    prompt = thinking_prompt(demo)
    s = demo.session(quiet=True)
    if s.drafting_stats() is None:
        pytest.skip("the demo model's file drafts nothing here")
    plain = demo.session(quiet=True, mtp=0).generate(prompt, max_tokens=24, thinking_budget=0)
    drafted = s.generate(prompt, max_tokens=24, thinking_budget=0)
    assert drafted.tokens == plain.tokens


# -- the state after a forced close --------------------------------------------------------------------------------

def test_after_a_forced_close_the_next_turn_prefills_only_its_suffix(hybrid_model):
    tok = hybrid_model.tokenizer
    prompt = thinking_prompt(hybrid_model)
    s = hybrid_model.session(quiet=True)
    first = s.generate(prompt, max_tokens=6, thinking_budget=10, keep_end=True)
    assert first.reasoning_ended == "budget" and first.finish_reason == "length"
    # what was generated plus what was inserted, fed (the answer's last token is not: max_tokens ended the turn before
    # a step needed it, as after any turn cut by max_tokens)
    assert s.held == prompt + first.tokens[:-1]
    suffix = tok.encode("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")
    second = s.generate(prompt + first.tokens + suffix, max_tokens=4)
    assert second.reused == len(prompt) + len(first.tokens) - 1 and second.prefilled == len(suffix) + 1


def test_a_chat_history_sent_again_after_a_forced_close_reuses_as_after_the_models_own_close(hybrid_model, demo):
    for model, kw in ((hybrid_model, {"thinking_budget": 8}), (demo, {})):
        s = model.session(quiet=True)
        first = s.chat(ASK, enable_thinking=True, max_tokens=6, **kw)
        assert first.reasoning_ended == ("budget" if kw else "model")
        history = ASK + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And 3 + 4?"}]
        second = s.chat(history, enable_thinking=True, max_tokens=4, **kw)
        ids, _ = model.render(ASK, enable_thinking=True)
        assert second.reused == s.checkpoint_position(ids) and second.start == "checkpoint"


# -- grammar and tools after a forced close --------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_a_json_schema_answer_starts_after_a_forced_close_and_validates(hybrid_model):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    turn = hybrid_model.session(quiet=True).chat(ASK, response_format=fmt, enable_thinking=True, thinking_budget=12,
                                                 max_tokens=64)
    assert turn.reasoning_ended == "budget" and turn.reasoning_tokens == 12 and turn.reasoning
    assert turn.finish_reason == "stop"
    jsonschema.validate(json.loads(turn.text), SCHEMA)
    tok = hybrid_model.tokenizer
    assert tok.decode(turn.tokens[12:12 + turn.inserted_tokens]).endswith("</think>\n\n")
    # without thinking asked for, a constrained turn renders thinking off as before
    plain = hybrid_model.session(quiet=True).chat(ASK, response_format=fmt, thinking_budget=12, max_tokens=64)
    assert plain.reasoning is None and plain.reasoning_ended is None
    jsonschema.validate(json.loads(plain.text), SCHEMA)


def test_a_forced_tool_call_comes_after_a_forced_close(hybrid_model):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    turn = hybrid_model.session(quiet=True).chat(
        [{"role": "user", "content": "Weather in Lisbon?"}], tools=tools, enable_thinking=True, thinking_budget=10,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=160)
    assert turn.reasoning_ended == "budget" and turn.reasoning_tokens == 10
    assert turn.finish_reason == "tool_calls" and [c.name for c in turn.tool_calls] == ["get_weather"]
    assert isinstance(json.loads(turn.tool_calls[0].arguments)["city"], str)


# -- the loop guard --------------------------------------------------------------------------------------------------

def scripted(tokens: list[int]):
    """A sampler fixed to write `tokens` in order (then the last one again), whatever the logits."""
    class Scripted:
        def __init__(self, params):
            self.i = 0

        def __call__(self, logits, prompt, generated):
            t = tokens[min(self.i, len(tokens) - 1)]
            self.i += 1
            return t
    return Scripted


_POOLS: dict[int, list[int]] = {}


def words(tok, n: int, seed: int) -> list[int]:
    """n distinct ordinary text tokens (printable, no newline, no markup, no template token), drawn by `seed`."""
    pool = _POOLS.get(id(tok))
    if pool is None:
        marks = set(tok.stop_ids) | {tok.think_start_id, tok.think_end_id, tok.im_start_id, tok.im_end_id}
        pool = _POOLS[id(tok)] = [i for i in range(min(tok.vocab_size, 40000)) if i not in marks
                                  and (t := tok.decode([i])).strip() and t.isprintable() and "\ufffd" not in t
                                  and "<" not in t]
    assert len(pool) >= n
    return random.Random(seed).sample(pool, n)


@pytest.mark.parametrize("period", [25, 40])
def test_the_loop_guard_closes_a_thought_repeating_a_unit_within_two_periods_and_logs_it_by_slot(
        hybrid_model, monkeypatch, capfd, period):
    tok = hybrid_model.tokenizer
    lead, unit = words(tok, 30, 1)[:10], words(tok, period, 2)
    monkeypatch.setattr(decoding, "Sampler", scripted(lead + unit * 40))
    slot = hybrid_model.slots(2)[1]  # a server's slot, named "slot 1" in its lines
    turn = slot.generate(thinking_prompt(hybrid_model), max_tokens=10 + 3 * period + 20, thinking_budget=None)
    assert turn.reasoning_ended == "loop_guard"
    began = len(lead) + period  # the unit's first copy is written: from here on it repeats
    assert turn.reasoning_tokens <= began + 2 * period
    assert turn.reasoning_tokens == len(lead) + REPEATS * period  # the guard needs the third copy, no more
    want = closing(tok, turn.tokens[:turn.reasoning_tokens])
    at = turn.reasoning_tokens
    assert turn.tokens[at:at + len(want)] == want and turn.inserted_tokens == len(want)
    err = capfd.readouterr().err
    assert re.search(rf"\[deltaserve\] \[slot 1\] loop guard: the thought repeated a unit of {period} tokens "
                     rf"{REPEATS} times in a row; closed after {at} thinking tokens", err), err


def test_the_loop_guard_leaves_a_thought_that_does_not_repeat_and_can_be_turned_off(hybrid_model, monkeypatch):
    tok = hybrid_model.tokenizer
    prompt = thinking_prompt(hybrid_model)
    distinct = words(tok, 200, 3)
    monkeypatch.setattr(decoding, "Sampler", scripted(distinct))
    turn = hybrid_model.session(quiet=True).generate(prompt, max_tokens=150)
    assert turn.reasoning_ended == "unclosed" and turn.reasoning_tokens == 150 and turn.tokens == distinct[:150]
    unit = words(tok, 30, 4)
    monkeypatch.setattr(decoding, "Sampler", scripted(unit * 10))
    off = hybrid_model.session(quiet=True, loop_guard=False).generate(prompt, max_tokens=150)
    assert off.reasoning_ended == "unclosed" and off.tokens == (unit * 10)[:150]
    monkeypatch.setenv("DELTASERVE_LOOP_GUARD", "off")
    assert hybrid_model.session(quiet=True).loop_guard is False


def guard_fires_at(stream) -> int | None:
    g = LoopGuard()
    for k, t in enumerate(stream, 1):
        if g.push(t):
            return k
    return None


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 80), st.integers(1, 300), st.integers(0, 2 ** 32 - 1))
def test_on_synthetic_streams_a_loop_is_closed_within_two_periods_of_its_start_or_min_span_tokens(lead, period, seed):
    rng = random.Random(seed)
    ids = rng.sample(range(1000, 200000), lead + period)
    prefix, unit = ids[:lead], ids[lead:]
    at = guard_fires_at(prefix + unit * (4 + MIN_SPAN // period))
    began = lead + period
    assert at is not None and at > began
    assert at - began <= max(2 * period, MIN_SPAN - period)
    if period >= MIN_SPAN / REPEATS:
        assert at - began <= 2 * period


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 32 - 1))
def test_on_synthetic_streams_that_do_not_repeat_the_guard_never_fires(seed):
    rng = random.Random(seed)
    assert guard_fires_at([rng.randrange(200000) for _ in range(3000)]) is None


def test_on_recorded_text_that_does_not_repeat_the_guard_never_fires(demo):
    """The docs' prose, numbers written out (Qwen writes a number's digits one token each: "1000000" is not a
    loop), counting, and what the demo model answered to a dozen questions, run together."""
    tok = demo.tokenizer
    texts = [(ROOT / "docs" / name).read_text() for name in ("architecture.md", "python.md", "api.md")]
    texts.append(" ".join(str(10 ** k) for k in range(1, 40)) + " 0.000000000001 1000000000000000")
    texts.append(", ".join(str(i) for i in range(1, 400)))
    s = demo.session(quiet=True)
    answers = [s.chat([{"role": "user", "content": q}], max_tokens=32).text
               for q in ("What is 12 + 9?", "What is 40 + 2?", "Reverse these words: red fox blue", "Hi!",
                         "My name is Ana.", "What is 7 + 5?", "What is 3 + 3?", "Reverse these words: a b c",
                         "Hello there.", "What is 1 + 1?", "What is 100 + 23?", "Thanks!")]
    texts.append("\n".join(answers))
    for text in texts:
        assert guard_fires_at(tok.encode(text)) is None, text[:80]


# -- the CLI -----------------------------------------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaserve.frontends.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_run_with_a_think_budget_shows_thinking_and_answer_tokens_apart(hybrid_gguf):
    proc = run_cli("run", str(hybrid_gguf), "--chat", "--think", "on", "--think-budget", "16", "-n", "8", "-p",
                   "What is 12 + 9?", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    stats = next(line for line in proc.stderr.splitlines() if line.startswith("[stats]"))
    m = re.search(r"\((\d+) tokens: thinking (\d+) \(closed by the budget, (\d+) inserted\), answer (\d+), length\)",
                  stats)
    assert m, stats
    total, thought, inserted, answer = map(int, m.groups())
    assert thought == 16 and answer == 8 and total == thought + inserted + answer
    assert "</think>" not in proc.stdout


def test_run_on_the_demo_model_thinks_within_its_budget_and_a_bad_budget_is_one_line(demo):
    proc = run_cli("run", "--think", "on", "--think-budget", "1", "-n", "24", "-p", "What is 12 + 9?")
    assert proc.returncode == 0, proc.stderr
    assert "21" in proc.stdout
    stats = next(line for line in proc.stderr.splitlines() if line.startswith("[stats]"))
    m = re.search(r"thinking (\d+) \(closed by the (model|budget)", stats)
    assert m and int(m.group(1)) <= 1, stats
    bad = run_cli("run", "--think-budget", "-2", "-p", "x")
    assert bad.returncode == 2 and "must be -1 (unlimited), 0 (thinking off) or more, got -2" in bad.stderr
    assert "Traceback" not in bad.stderr
