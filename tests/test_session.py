"""The resident session's contract (shared/design/session.md), greedy outputs compared token for token."""

from __future__ import annotations

import pytest
import torch

from deltaserve.runtime.backend import CPUBackend, FaultyBackend
from tests.fakes import count_state_allocations, record_prompt_logits
from deltaserve.errors import BackendError, ContextError
from deltaserve.session.resident import MIN_CAPACITY, PREFILL_ENV, grown_capacity

TOL = 2e-4


@pytest.fixture
def model(hybrid_model):
    return hybrid_model


def fresh(model, prompt, **kw):
    """The reference: a one-call session on the whole prompt."""
    return model.generate(prompt, **kw)


def words(model, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    special = set(model.tokenizer.stop_ids) | {model.tokenizer.im_start_id}
    out = []
    while len(out) < n:
        t = int(torch.randint(0, model.tokenizer.vocab_size, (1,), generator=g))
        if t not in special:
            out.append(t)
    return out


def chat(user: str, *history):
    msgs = []
    for u, a in history:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": user}]


def render(model, messages, thinking=False):
    return model.tokenizer.encode(model.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                      enable_thinking=thinking))


# -- a) capacity ----------------------------------------------------------------------------------

def test_capacity_grows_from_4096_by_doubling_within_the_context():
    assert grown_capacity(100, 0, MIN_CAPACITY, 262144) == 4096
    assert grown_capacity(4197, 0, MIN_CAPACITY, 8192) == 8192
    assert grown_capacity(9000, 8192, MIN_CAPACITY, 262144) == 16384
    assert grown_capacity(9000, 8192, MIN_CAPACITY, 12000) == 12000
    assert grown_capacity(5000, 4096, MIN_CAPACITY, 4500) == 5000  # never below what the turn needs
    assert grown_capacity(777, 0, 0, 262144) == 777                 # a one-call session: exactly the call


def test_a_session_sizes_its_state_by_the_rule_and_growing_drops_what_it_held(model, monkeypatch):
    s = model.session(context=8192, quiet=True)
    t = s.generate(words(model, 4100, 1), max_tokens=97)           # 4197 positions
    assert s.capacity == 8192 and t.generated == 97
    assert s.held and s.checkpoint_length > 0
    big = model.session(quiet=True)                                 # declared context 32768
    big.generate(words(model, 8000, 2), max_tokens=8)
    assert big.capacity == 8192
    allocations = count_state_allocations(monkeypatch)
    turn = big.generate(words(model, 8990, 3), max_tokens=10)      # 9000 positions
    assert big.capacity == 16384 and len(allocations) == 1
    assert turn.start == "reset" and turn.reused == 0              # the new state started empty


def test_a_one_call_session_is_sized_to_the_call_exactly(model):
    s = model.session(one_call=True, quiet=True)
    s.generate(words(model, 50, 4), max_tokens=7)
    assert s.capacity == 57


def test_a_one_call_session_takes_no_checkpoint_where_a_resident_one_does(model):
    prompt = words(model, 50, 4)
    one = model.session(one_call=True, quiet=True)
    one.generate(prompt, max_tokens=3)
    resident = model.session(quiet=True)
    resident.generate(prompt, max_tokens=3)
    assert one.checkpoint_length == 0 and resident.checkpoint_length == len(prompt) - 1


def test_resetting_in_place_allocates_nothing(model, monkeypatch):
    s = model.session(quiet=True)
    s.generate(words(model, 40, 5), max_tokens=4)
    allocations = count_state_allocations(monkeypatch)
    turn = s.generate(words(model, 30, 6), max_tokens=4)          # diverges from the start
    assert turn.start == "reset" and not allocations


# -- b) extending what the state holds -------------------------------------------------------------

def test_a_turn_that_extends_the_held_tokens_prefills_only_the_suffix(model, monkeypatch):
    seen = record_prompt_logits(monkeypatch)
    s = model.session(quiet=True)
    first = s.generate(words(model, 70, 7), max_tokens=12)
    held = list(s.held)
    assert len(held) == 70 + 11  # the last generated token is sampled, not yet fed
    prompt = held + words(model, 25, 8)
    turn = s.generate(prompt, max_tokens=15)
    assert turn.start == "extend"
    assert turn.reused == len(held) and turn.prefilled == 25
    ref = fresh(model, prompt, max_tokens=15)
    assert turn.tokens == ref.tokens
    assert (seen[-2] - seen[-1]).abs().max() <= TOL  # the turn's prompt logits against the fresh run's
    assert first.tokens  # the first turn generated something


# -- c) / d) checkpoints ---------------------------------------------------------------------------

def test_the_same_chat_prompt_twice_restores_the_checkpoint_before_the_generation_header(model):
    s = model.session(quiet=True)
    prompt = render(model, chat("Tell me about foxes."))
    a = s.generate(prompt, max_tokens=20)
    header = len(prompt) - s.checkpoint_position(prompt)
    b = s.generate(prompt, max_tokens=20)
    assert b.start == "checkpoint"
    assert b.prefilled == header and b.reused == len(prompt) - header
    assert header == len(model.tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    assert a.tokens == b.tokens


@pytest.mark.parametrize("edit", ["whitespace", "thinking"])
def test_a_re_rendered_history_resumes_from_the_checkpoint(model, edit, monkeypatch):
    seen = record_prompt_logits(monkeypatch)
    s = model.session(quiet=True)
    first = render(model, chat("What colour is the sky?"), thinking=(edit == "thinking"))
    t1 = s.generate(first, max_tokens=16)
    answer = t1.text
    if edit == "whitespace":
        shown = "  " + answer.strip().replace(" ", "  ") + "\n"
    else:  # the model thought aloud; the client strips the thinking before sending the history back
        shown = "<think>\nlet me see\n</think>\n\n" + answer
    second = render(model, chat("And at night?", ("What colour is the sky?", shown)))
    t2 = s.generate(second, max_tokens=16)
    assert t2.start == "checkpoint"
    assert 0 < t2.reused < len(second)
    assert second[: t2.reused] == first[: t2.reused]
    ref = fresh(model, second, max_tokens=16)
    assert t2.tokens == ref.tokens
    assert (seen[-2] - seen[-1]).abs().max() <= TOL


def test_a_second_save_reuses_the_first_checkpoints_buffers(model):
    s = model.session(quiet=True)
    p1 = render(model, chat("one"))
    s.generate(p1, max_tokens=4)
    ck = s._checkpoint
    p2 = s.held + render(model, chat("two"))[1:]  # extends what is held, crossing a new header
    s.generate(p2, max_tokens=4)
    assert s._checkpoint is ck and s.checkpoint_length > len(p1)


# -- e) divergence ---------------------------------------------------------------------------------

def test_a_diverging_prompt_resets_in_place_and_equals_a_fresh_run(model, monkeypatch):
    seen = record_prompt_logits(monkeypatch)
    s = model.session(quiet=True)
    s.generate(render(model, chat("first topic")), max_tokens=10)
    other = render(model, chat("something else entirely"), thinking=True)
    turn = s.generate(other, max_tokens=14)
    assert turn.start in ("reset", "checkpoint")  # a system-less chat shares only <|im_start|>user
    ref = fresh(model, other, max_tokens=14)
    assert turn.tokens == ref.tokens
    assert (seen[-2] - seen[-1]).abs().max() <= TOL


# -- f) the context ---------------------------------------------------------------------------------

def test_a_prompt_the_context_cannot_hold_is_refused_whole(model):
    s = model.session(context=300, quiet=True)
    with pytest.raises(ContextError) as e:
        s.generate(words(model, 300, 9), max_tokens=5)
    # in the words OpenAI uses, which litellm's and LangChain's context-overflow handling match
    assert str(e.value).startswith("This model's maximum context length is 300 tokens. However, your messages "
                                   "resulted in 300 tokens."), str(e.value)
    assert "refused whole" in str(e.value)
    with pytest.raises(ContextError, match="empty"):
        s.generate([], max_tokens=5)
    assert s.state is None  # nothing was allocated for a refused prompt


def test_a_budget_cut_by_the_context_ends_capped_with_length(model):
    s = model.session(context=300, quiet=True)
    stop = set(model.tokenizer.stop_ids)
    prompt = words(model, 290, 10)
    turn = s.generate(prompt, max_tokens=50, stop=None)
    if turn.finish_reason == "stop":
        pytest.skip("the random model chose a stop token before the context ran out")
    assert turn.generated == 10 and turn.context_capped and turn.finish_reason == "length"
    assert not (set(turn.tokens) & stop)
    uncapped = s.generate(prompt, max_tokens=5)
    assert uncapped.finish_reason == "length" and not uncapped.context_capped


# -- g) cancellation --------------------------------------------------------------------------------

def test_cancelling_through_on_token_keeps_the_state_valid_and_hands_out_nothing_twice(model):
    s = model.session(quiet=True)
    prompt = render(model, chat("count to ten"))
    handed = []

    def on_token(tid, text):
        handed.append(tid)
        return len(handed) < 5

    t = s.generate(prompt, max_tokens=30, on_token=on_token)
    assert t.finish_reason == "cancelled" and t.tokens == handed and len(handed) == 5
    follow = s.held + words(model, 6, 11)
    t2 = s.generate(follow, max_tokens=10)
    assert t2.start == "extend"
    assert t2.tokens == fresh(model, follow, max_tokens=10).tokens


def test_streamed_text_adds_up_to_the_turn_text(model):
    s = model.session(quiet=True)
    pieces = []
    t = s.generate(render(model, chat("hi")), max_tokens=30, on_token=lambda tid, text: pieces.append(text))
    assert "".join(pieces) == t.text == model.tokenizer.decode(t.tokens)


# -- h) failures -----------------------------------------------------------------------------------

@pytest.mark.parametrize("stage,after", [("prefill", 0), ("decode", 2)])
def test_a_failure_inside_a_forward_clears_held_and_the_checkpoint(model, stage, after):
    backend = FaultyBackend(model.host, accelerator=False)
    s = model.session(backend=backend, quiet=True)
    p1 = render(model, chat("hello"))
    s.generate(p1, max_tokens=6)
    assert s.held and s.checkpoint_length
    backend.stage, backend.after = stage, backend.calls.get(stage, 0) + after  # fail inside the next turn
    p2 = s.held + words(model, 20, 12)
    with pytest.raises(BackendError, match="injected"):
        s.generate(p2, max_tokens=6)
    assert s.held == [] and s.checkpoint_length == 0
    t = s.generate(p2, max_tokens=8)
    assert t.start == "reset" and t.tokens == fresh(model, p2, max_tokens=8).tokens


# -- i) per-token prefill ---------------------------------------------------------------------------

def test_per_token_prefill_is_token_identical_and_says_so(model, monkeypatch):
    prompts = [render(model, chat("alpha")), render(model, chat("beta", ("alpha", "ok")))]
    batched = model.session(quiet=True)
    want = [batched.generate(p, max_tokens=12).tokens for p in prompts]
    monkeypatch.setenv(PREFILL_ENV, "on")
    slow = model.session(quiet=True)
    assert any(PREFILL_ENV in n and "one token at a time" in n for n in slow.notices)
    got = [slow.generate(p, max_tokens=12).tokens for p in prompts]
    assert got == want and slow.batched_prefills == 0 and batched.batched_prefills > 0


def test_every_route_decision_is_a_notice(model, capsys):
    s = model.session(backend=CPUBackend(model.host))
    err = capsys.readouterr().err
    assert s.notices and s.notices[-1].startswith("Backend: CPU")
    assert s.notices[-1] in err


def test_every_batched_prefill_says_its_stats_line_and_they_add_up_to_the_prefilled_tokens(model):
    import re

    s = model.session(quiet=True)
    first = s.generate(words(model, 300, 7), max_tokens=2)
    lines = list(s.prefill_lines)
    assert s.batched_prefills == len(lines) >= 1
    pattern = (r"batched prefill: (\d+) tokens in \d+ ms \([\d.]+ tok/s, chunk (\d+) rows, attention (\d+) query rows, "
               r"from position (\d+)\)")
    found = [re.fullmatch(pattern, line) for line in lines]
    assert all(found), lines
    # no <|im_start|> in the prompt: the checkpoint cuts before its last token, which goes the one-token way
    assert sum(int(m.group(1)) for m in found) == first.prefilled - 1 == s.checkpoint_length
    assert int(found[0].group(4)) == 0
    assert int(found[0].group(2)) == s.state.prefill_rows and int(found[0].group(3)) == s.state.query_rows
