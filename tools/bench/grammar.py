"""The structured-outputs overhead: decode tok/s with and without a JSON schema, and the mask's per-token cost.

    .venv/bin/python -m tools.bench.grammar [MODEL.gguf] [--tokens N] [--rounds R] [--out benchmarks]

MODEL defaults to the 0.8B-shape q8_0 model `deltaserve bench` makes (random weights, the real Qwen3.5
vocabulary). The constrained run uses a schema whose one string must be long, so every step is a step inside a
JSON string (the densest masks: the worst case for applying them) and both runs generate N tokens. Rounds
alternate unconstrained / constrained on one session; the medians are compared (goal: at most 10 % slower).
Writes OUT/grammar.json. Not yet wired into `deltaserve bench` (its CLI choices are edited elsewhere).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from deltaserve.cachedir import cache_root

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000, "maxLength": 4000}},
          "required": ["text"], "additionalProperties": False}
ANSWER = {"name": "Alice Smith", "age": 42, "score": 3.5, "color": "green", "tags": ["a", "bb", "hello"],
          "address": {"city": "Paris", "zip": "75001"}}
ANSWER_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "score", "color", "tags", "address"],
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "score": {"type": "number"}, "color": {"enum": ["red", "green", "blue"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
                   "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                               "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}}}


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema, "strict": True}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(cache_root() / "bench" / "qwen35-0.8B-q8_0.gguf"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks")
    a = ap.parse_args(argv)

    import deltaserve
    from deltaserve.session import grammar

    model = deltaserve.load(a.model)
    tok, cfg = model.tokenizer, model.config
    mask = grammar.bench_mask(tok, fmt(ANSWER_SCHEMA), tok.encode(json.dumps(ANSWER)), cfg.vocab_size)
    session = model.session(quiet=True)
    prompt = tok.encode("Write a long story about a lighthouse keeper.")
    free, constrained = [], []
    for r in range(a.rounds):
        for kind, out in (("free", free), ("schema", constrained)):
            turn = session.generate(prompt, max_tokens=a.tokens, temperature=1.0, seed=r,
                                    response_format=fmt(SCHEMA) if kind == "schema" else None)
            out.append((turn.decode_tok_s, turn.generated))
    f = statistics.median(t for t, _ in free)
    c = statistics.median(t for t, _ in constrained)
    result = {
        "model": Path(a.model).name, "vocab": cfg.vocab_size, "tokens": a.tokens, "rounds": a.rounds,
        "decode_tok_s_free": round(f, 2), "decode_tok_s_schema": round(c, 2),
        "slowdown_pct": round((1 - c / f) * 100, 1) if f else None,
        "generated": {"free": [n for _, n in free], "schema": [n for _, n in constrained]},
        "mask_step_ms_median": round(mask["median_s"] * 1e3, 3), "mask_step_ms_max": round(mask["max_s"] * 1e3, 3),
        "compile_s": round(mask["compile_s"], 3),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
