"""What the frontends share: the model a command names (or the embedded demo model), sampling and thinking flags."""

from __future__ import annotations

import sys

from deltaserve.api import Model, load
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
    """The model of a command's arguments (MODEL, --device, --threads); `model.load_seconds` says how long it took."""
    return load(resolve_model(a.model), device=a.device, threads=a.threads, compute_thread=compute_thread,
                draft=getattr(a, "draft", None), mmproj=getattr(a, "mmproj", None))


def sampling_kwargs(a) -> dict:
    return dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repetition_penalty=a.repetition_penalty, seed=a.seed)


def thinking(a) -> bool | None:
    """--think on|off|auto; auto (None) is the model's default (the embedded demo model's is off)."""
    return thinking_flag(a.think)
