"""`deltaserve chat` driven through a pseudo-terminal: streaming, history, commands, per-turn stats."""

from __future__ import annotations

import re
import sys

import pexpect
import pytest

STATS = re.compile(r"\[reused (\d+) \| prefilled (\d+) \| TTFT (\d+) ms \| ([\d.]+) tok/s \| (\d+) tokens?, (\w+)[^|]* \| (\w+)\]")


@pytest.fixture
def repl(hybrid_gguf):
    child = pexpect.spawn(sys.executable, ["-m", "deltaserve", "chat", str(hybrid_gguf), "-n", "12", "--device", "cpu", "--think", "off"],
                          encoding="utf-8", timeout=120, dimensions=(50, 200))
    child.expect("/help for commands")
    child.expect("> ")
    yield child
    if child.isalive():
        child.sendline("/quit")
        child.expect(pexpect.EOF)


def turn(child, text: str) -> tuple[str, tuple]:
    child.sendline(text)
    child.expect(STATS)
    answer = child.before.split(text, 1)[-1] if text in child.before else child.before
    stats = child.match.groups()
    child.expect("> ")
    return answer.strip(), stats


def test_a_conversation_reuses_the_resident_state_turn_after_turn(repl, hybrid_model):
    header = len(hybrid_model.tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    _, first = turn(repl, "Hello there, who are you?")
    assert int(first[0]) == 0 and int(first[1]) > 10 and first[6] == "reset"
    _, second = turn(repl, "And what can you do?")
    reused = int(second[0])
    # the template re-renders the last answer without its empty think block, so the turn resumes from the
    # checkpoint taken before the first generation header: the whole first prompt but that header is reused
    assert second[6] == "checkpoint"
    assert reused == int(first[1]) - header
    _, third = turn(repl, "Thanks!")
    assert third[6] == "checkpoint" and int(third[0]) > reused


def test_regenerate_resumes_from_the_checkpoint_and_answers_the_same(repl, hybrid_model):
    header = len(hybrid_model.tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    a, first = turn(repl, "Tell me a story.")
    repl.sendline("/regenerate")
    repl.expect(STATS)
    b = repl.before
    again = repl.match.groups()
    repl.expect("> ")
    assert again[6] == "checkpoint"
    assert int(again[1]) == header  # only the generation header's tokens are prefilled again
    assert a.splitlines()[-1].strip() in b


def test_commands_stats_system_clear_think_and_multiline(repl):
    turn(repl, "first message")
    repl.sendline("/stats")
    repl.expect(r"\[turns 1 \| held (\d+) tokens \| capacity 4096 positions \| checkpoint (\d+)")
    assert int(repl.match.group(1)) > 0 and int(repl.match.group(2)) > 0
    repl.expect("Backend: CPU")
    repl.expect("> ")
    repl.sendline("/system You are terse.")
    repl.expect(r"\[system message set; conversation cleared\]")
    repl.expect("> ")
    repl.sendline("/think on")
    repl.expect(r"\[thinking on\]")
    repl.expect("> ")
    repl.sendline("line one \\")
    repl.expect(r"\.\.\. ")
    repl.sendline("line two")
    repl.expect(STATS)
    repl.expect("> ")
    repl.sendline('"""')
    repl.expect(r"\.\.\. ")
    repl.sendline("block line")
    repl.expect(r"\.\.\. ")
    repl.sendline('end"""')
    repl.expect(STATS)
    repl.expect("> ")
    repl.sendline("/clear")
    repl.expect(r"\[cleared\]")
    repl.expect("> ")
    repl.sendline("/bogus")
    repl.expect("unknown command")
    repl.expect("> ")
    repl.sendline("/quit")
    repl.expect(pexpect.EOF)
