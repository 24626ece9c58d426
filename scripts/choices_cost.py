"""What n choices cost against one (`n > 1`: the prompt prefilled once, its state forked, every choice's rows in one
forward a step): a prompt of P tokens, G tokens a choice, n = 1 and n = N in turns, the best of a few runs each.

    python scripts/choices_cost.py MODEL.gguf [--prompt 512] [--tokens 64] [--choices 4] [--runs 3]

Prints, per n: the wall time, the prefill's time and rows (the engine loop's count: P for any n), the decode's time,
the tokens generated over all choices and their rate.
"""

from __future__ import annotations

import argparse
import time

import deltaserve
from deltaserve.api import driver


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    model = deltaserve.load(a.model)
    session = model.session(quiet=True, mtp=0)
    vocab = model.config.vocab_size
    prompt = [(1000 + 7 * i) % vocab for i in range(a.prompt)]
    stats = model.engine.stats
    print(f"{model.path.name}: a prompt of {a.prompt} tokens, {a.tokens} tokens a choice")
    for n in (1, a.choices):
        best = None
        for _ in range(a.runs):
            session.reset()
            rows0 = stats.rows["prefill"]
            t0 = time.perf_counter()
            turn = driver.run(session, driver.PreparedTurn(list(prompt)), max_tokens=a.tokens, n=n, temperature=1.0,
                              seed=1, stop=None)
            wall = time.perf_counter() - t0
            made = turn.generated + sum(f.generated for f in turn.forks)
            run = (wall, turn.timings.prefill_s, stats.rows["prefill"] - rows0, turn.timings.decode_s, made)
            best = run if best is None or run[0] < best[0] else best
        wall, prefill, rows, decode, made = best
        print(f"n={n}: {wall:.2f} s wall, prefill {prefill:.2f} s ({rows} rows), decode {decode:.2f} s, "
              f"{made} tokens ({made / wall:.1f} tok/s over the request)")


if __name__ == "__main__":
    main()
