"""Evaluate the demo model through deltaserve (not transformers) on the held-out sets.

    .venv/bin/python scripts/demo/evaluate.py [MODEL] [--json OUT]

MODEL defaults to the shipped src/deltaserve/data/demo-qwen35.gguf. Sets (seeded, disjoint from
training, see corpus.py):
  * single-turn: 35 held-out items of each of greet, thanks, fact statement, add, repeat, reverse,
    other (refusal) = 245 items, one `Session.chat` each, enable_thinking=False;
  * recall: 120 conversations of 4-6 turns where a fact is asked 3 or more turns after it was stated,
    other facts and tasks in between; every turn is a `Session.chat` on ONE resident session with the
    growing history (the model's own replies appended), and the recall answer is scored;
  * think-auto (reported, not a target): 70 single-turn items with `enable_thinking` unset (the
    header ends in `<think>\\n`); the answer is the text after `</think>`;
  * tools: 60 held-out tool dialogs (corpus.tool_eval: 15 each of a weather question, a two-city weather
    question, an addition with the add tool offered, and a message no offered tool answers), tools offered
    with tool_choice auto: the calls the model writes, parsed by deltaserve (text/toolcalls.py), must be the
    expected ones (names and typed arguments; none for the last kind, whose answer is scored as usual), and
    given the expected calls and the tool messages, the final answer must be the expected one.
Scoring: exact match after stripping whitespace and one final period (corpus.normalise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(ROOT / "src"), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import corpus as C  # noqa: E402

SINGLE_SEED, SINGLE_PER_KIND = 1001, 35
RECALL_SEED, RECALL_COUNT = 1002, 120
AUTO_SEED, AUTO_PER_KIND = 1003, 10
MAX_TOKENS = 32
TOOL_SEED, TOOL_PER_KIND = 1004, 15
TOOL_MAX_TOKENS = 96
# the smaller sets tests/test_demo_model.py uses (other seeds)
TEST_SINGLE_SEED, TEST_PER_KIND = 2001, 9
TEST_RECALL_SEED, TEST_RECALL_COUNT = 2002, 30


def eval_sets(single_seed: int = SINGLE_SEED, per_kind: int = SINGLE_PER_KIND, recall_seed: int = RECALL_SEED,
              recall_count: int = RECALL_COUNT):
    return C.single_turn_eval(single_seed, per_kind), C.recall_eval(recall_seed, recall_count)


def answer_of(text: str) -> str:
    """The answer part of a reply (after a `</think>` if the model wrote one)."""
    return text.split("</think>")[-1]


def correct(got: str, want: str) -> bool:
    return C.normalise(answer_of(got)) == C.normalise(want)


def run_single(model, items, thinking: bool | None = False):
    by_kind: dict[str, list[int]] = {}
    failures = []
    s = model.session(quiet=True)
    for t in items:
        turn = s.chat([{"role": "user", "content": t.user}], max_tokens=MAX_TOKENS, enable_thinking=thinking)
        ok = correct(turn.text, t.answer)
        by_kind.setdefault(t.kind, []).append(int(ok))
        if not ok:
            failures.append({"kind": t.kind, "user": t.user, "want": t.answer, "got": turn.text})
    return by_kind, failures


def run_conversation(model, turns, thinking: bool | None = False):
    """One resident session, turn after turn; returns [(turn, ok)]."""
    s = model.session(quiet=True)
    history: list[dict] = []
    out = []
    for t in turns:
        history.append({"role": "user", "content": t.user})
        turn = s.chat(history, max_tokens=MAX_TOKENS, enable_thinking=thinking)
        history.append({"role": "assistant", "content": turn.text})
        out.append((turn, correct(turn.text, t.answer)))
    return out


def run_recall(model, convs):
    scored_ok, all_by_kind = [], {}
    reused_ok = True
    failures = []
    for turns, scored in convs:
        results = run_conversation(model, turns)
        for k, (t, (turn, ok)) in enumerate(zip(turns, results)):
            all_by_kind.setdefault(t.kind, []).append(int(ok))
            if k > 0 and turn.reused <= 0:
                reused_ok = False
            if k in scored:
                scored_ok.append(int(ok))
                if not ok:
                    failures.append({"kind": "recall", "conversation": [(x.user, x.answer) for x in turns],
                                     "turn": k, "got": turn.text, "want": t.answer})
    return scored_ok, all_by_kind, reused_ok, failures


def run_tools(model, dialogs):
    """Per kind: whether the calls were the expected ones, and whether the answer from the tool messages was."""
    calls_ok: dict[str, list[int]] = {}
    answers_ok: dict[str, list[int]] = {}
    failures = []
    s = model.session(quiet=True)
    for d in dialogs:
        turn = s.chat(d.messages("call"), tools=list(d.tools), max_tokens=TOOL_MAX_TOKENS, enable_thinking=False)
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in d.calls]
        got = [(c.name, c.args) for c in turn.tool_calls]
        ok = got == want and (bool(d.calls) or correct(turn.text, d.answer))
        calls_ok.setdefault(d.kind, []).append(int(ok))
        if not ok:
            failures.append({"kind": "tool_" + d.kind, "user": d.user, "want": want or d.answer,
                             "got": [list(g) for g in got] or turn.text})
        if d.calls:
            final = s.chat(d.messages("answer"), tools=list(d.tools), max_tokens=TOOL_MAX_TOKENS,
                           enable_thinking=False)
            ok = correct(final.text, d.answer) and not final.tool_calls
            answers_ok.setdefault(d.kind, []).append(int(ok))
            if not ok:
                failures.append({"kind": "tool_answer_" + d.kind, "user": d.user, "results": d.results,
                                 "want": d.answer, "got": final.text})
    return calls_ok, answers_ok, failures


def frac(v: list[int]) -> float:
    return sum(v) / len(v) if v else float("nan")


RECALL_CHUNKS = 3  # with --jobs: the recall conversations (each on its own session) split over this many processes


def thin(items: list, limit: int | None) -> list:
    """Every k-th item, about `limit` of them (all kinds kept): a quick pipeline check, not a score."""
    return items if not limit or limit >= len(items) else items[::-(-len(items) // limit)]


def run_part(path, part: str, model=None, limit: int | None = None):
    """One part of the evaluation: "single", "recall" or "recall:I/N" (the I-th of N contiguous chunks of the
    conversations), "auto" or "tools"."""
    if model is None:
        import deltaserve

        model = deltaserve.load(path)
    if part == "single":
        return run_single(model, thin(eval_sets()[0], limit))
    if part.startswith("recall"):
        convs = thin(eval_sets()[1], limit)
        if ":" in part:
            i, n = (int(x) for x in part.split(":")[1].split("/"))
            convs = convs[i * len(convs) // n:(i + 1) * len(convs) // n]
        return run_recall(model, convs)
    if part == "auto":
        return run_single(model, thin(C.single_turn_eval(AUTO_SEED, AUTO_PER_KIND), limit), thinking=None)
    if part == "tools":
        return run_tools(model, thin(C.tool_eval(TOOL_SEED, TOOL_PER_KIND), limit))
    raise ValueError(part)


def _run_part_job(a):
    return run_part(*a)


def run_parts(path, jobs: int = 1, limit: int | None = None) -> dict:
    """Every part; with jobs > 1 in that many forked processes (each its own model; every part has its own
    sessions, so the answers are those of one process)."""
    if jobs <= 1:
        import deltaserve

        model = deltaserve.load(path)
        return {p: run_part(path, p, model, limit) for p in ("single", "recall", "auto", "tools")}
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    parts = ["tools"] + [f"recall:{i}/{RECALL_CHUNKS}" for i in range(RECALL_CHUNKS)] + ["single", "auto"]
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("fork")) as ex:
        got = dict(zip(parts, ex.map(_run_part_job, [(str(path), p, None, limit) for p in parts])))
    scored, all_kinds, reused_ok, failures = [], {}, True, []
    for i in range(RECALL_CHUNKS):  # in order: as one run over the conversations
        sc, ak, ro, fl = got[f"recall:{i}/{RECALL_CHUNKS}"]
        scored += sc
        for k, v in ak.items():
            all_kinds.setdefault(k, []).extend(v)
        reused_ok = reused_ok and ro
        failures += fl
    return {"single": got["single"], "recall": (scored, all_kinds, reused_ok, failures), "auto": got["auto"],
            "tools": got["tools"]}


def evaluate(path, json_out: Path | None = None, verbose: bool = True, jobs: int = 1,
             limit: int | None = None) -> dict:
    t0 = time.time()
    parts = run_parts(path, jobs, limit)
    recall = thin(eval_sets()[1], limit)
    by_kind, f1 = parts["single"]
    scored, all_kinds, reused_ok, f2 = parts["recall"]
    auto_by_kind, f3 = parts["auto"]
    tool_calls, tool_answers, f4 = parts["tools"]
    flat = [x for v in by_kind.values() for x in v]
    res = {
        "model": str(path),
        "scoring": "exact match after stripping whitespace and one final period",
        "single_turn": {"accuracy": frac(flat), "n": len(flat),
                        "by_kind": {k: {"accuracy": frac(v), "n": len(v)} for k, v in by_kind.items()}},
        "recall_3plus_turns": {"accuracy": frac(scored), "n": len(scored), "conversations": len(recall),
                               "every_later_turn_reused_state": reused_ok},
        "recall_conversations_all_turns_by_kind": {k: {"accuracy": frac(v), "n": len(v)} for k, v in all_kinds.items()},
        "think_auto_single_turn": {"accuracy": frac([x for v in auto_by_kind.values() for x in v]),
                                   "n": sum(len(v) for v in auto_by_kind.values())},
        "tools": {"calls": {"accuracy": frac([x for v in tool_calls.values() for x in v]),
                            "n": sum(len(v) for v in tool_calls.values()),
                            "by_kind": {k: {"accuracy": frac(v), "n": len(v)} for k, v in tool_calls.items()}},
                  "answers_from_results": {"accuracy": frac([x for v in tool_answers.values() for x in v]),
                                           "n": sum(len(v) for v in tool_answers.values()),
                                           "by_kind": {k: {"accuracy": frac(v), "n": len(v)}
                                                       for k, v in tool_answers.items()}}},
        "wall_s": time.time() - t0,
        **({"limit": limit, "note": "a quick check on a subset (--limit): not comparable scores"} if limit else {}),
        "failures": (f1 + f2 + [dict(x, mode="think-auto") for x in f3] + f4)[:200],
    }
    if verbose:
        print(f"single-turn: {res['single_turn']['accuracy']:.3f} of {len(flat)}  " +
              ", ".join(f"{k} {v['accuracy']:.2f}" for k, v in res["single_turn"]["by_kind"].items()))
        print(f"recall 3+ turns later: {res['recall_3plus_turns']['accuracy']:.3f} of {len(scored)} "
              f"(state reused on every later turn: {reused_ok})")
        print("all turns of the recall conversations: " +
              ", ".join(f"{k} {v['accuracy']:.2f}/{v['n']}" for k, v in res["recall_conversations_all_turns_by_kind"].items()))
        print(f"think-auto single-turn: {res['think_auto_single_turn']['accuracy']:.3f} of {res['think_auto_single_turn']['n']}")
        tc, ta = res["tools"]["calls"], res["tools"]["answers_from_results"]
        print(f"tools: calls {tc['accuracy']:.3f} of {tc['n']} (" +
              ", ".join(f"{k} {v['accuracy']:.2f}" for k, v in tc["by_kind"].items()) +
              f"); answers from the tool messages {ta['accuracy']:.3f} of {ta['n']} (" +
              ", ".join(f"{k} {v['accuracy']:.2f}" for k, v in ta["by_kind"].items()) + ")")
        print(f"({res['wall_s']:.1f} s)")
    if json_out is not None:
        Path(json_out).write_text(json.dumps(res, indent=1) + "\n")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description="Evaluate the demo model through deltaserve")
    ap.add_argument("model", nargs="?", default=str(ROOT / "src" / "deltaserve" / "data" / "demo-qwen35.gguf"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--failures", type=int, default=10, help="print this many failures")
    ap.add_argument("--jobs", type=int, default=1,
                    help="run the sets in this many processes (one thread each; the same answers)")
    ap.add_argument("--limit", type=int, default=None, help="about this many items per set (a pipeline check)")
    a = ap.parse_args()
    res = evaluate(a.model, a.json, jobs=a.jobs, limit=a.limit)
    for f in res["failures"][:a.failures]:
        print("  FAIL", json.dumps(f, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
