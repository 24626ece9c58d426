"""What the frontends share: the model a command names (or the embedded demo model), sampling and thinking flags."""

from __future__ import annotations

import sys

from deltaserve.api import Model, load, rendered_thinking
from deltaserve.demo import default_model_path
from deltaserve.session.turns import thinking_flag


def resolve_model(path: str | None) -> str:
    """The model path a command names, or the embedded demo model's (said on stderr)."""
    if path:
        return path
    found = default_model_path()
    print(f"[deltaserve] no model named: using the embedded demo model ({found})", file=sys.stderr)
    return str(found)


def load_model(a, compute_thread: bool = False) -> Model:
    """The model of a command's arguments (MODEL, --device, --threads, --kv-type); `model.load_seconds` says how long it took."""
    return load(resolve_model(a.model), device=a.device, threads=a.threads, compute_thread=compute_thread,
                draft=getattr(a, "draft", None), mmproj=getattr(a, "mmproj", None),
                kv_type=getattr(a, "kv_type", None))


def sampling_kwargs(a) -> dict:
    return dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repetition_penalty=a.repetition_penalty, seed=a.seed)


def thinking(a) -> bool | None:
    """--think on|off|auto; auto (None) is the model's default (the embedded demo model's is off). --think-budget 0
    is thinking off (the template's own empty thought)."""
    return rendered_thinking(thinking_flag(a.think), think_budget(a))


def think_budget(a) -> int | None:
    """--think-budget N: None (unlimited: -1 or not given) or N >= 0."""
    n = getattr(a, "think_budget", None)
    return None if n is None or n < 0 else n


def thinking_kwargs(a) -> dict:
    """A turn's thinking budget and bridge sentence (--think-budget, --think-budget-message)."""
    return dict(thinking_budget=think_budget(a), thinking_message=getattr(a, "think_budget_message", None))


ENDED = {"model": "closed by the model", "budget": "closed by the budget", "loop_guard": "closed by the loop guard",
         "unclosed": "never closed"}


def thought_words(turn) -> str:
    """A stats line's thinking and answer tokens, apart ("" where the prompt opened no thought)."""
    if turn.reasoning_ended is None:
        return ""
    inserted = f", {turn.inserted_tokens} inserted" if turn.inserted_tokens else ""
    return (f"thinking {turn.reasoning_tokens} ({ENDED.get(turn.reasoning_ended, turn.reasoning_ended)}{inserted}), "
            f"answer {turn.answer_tokens}")


def loop_guard(a) -> bool | None:
    """--loop-guard on|off (None: DELTASERVE_LOOP_GUARD, on)."""
    value = getattr(a, "loop_guard", None)
    return None if value is None else value == "on"
