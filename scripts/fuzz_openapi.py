"""Fuzz a `deltaserve serve` for minutes with requests drawn from its own `GET /openapi.json` schemas.

    PYTHONPATH=src:. python scripts/fuzz_openapi.py --minutes 10 [--model FILE] [--out report.json]

The strategies are tests/test_server_openapi.py's (every POST route's body from its schema, with values of the wrong
type now and then; the GET routes with drawn ids). After every request /health must answer within STALL_S: a 5xx or
a stall is counted and its request kept in the report. Exits 1 if there was either.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import warnings
from pathlib import Path
from urllib.parse import quote

STALL_S = 10.0


def main() -> int:
    import httpx
    from hypothesis import strategies as st
    from hypothesis.errors import NonInteractiveExampleWarning

    from tests.fixtures import models as fx
    from tests.server_proc import ServerProcess
    from tests.test_server_openapi import gets, post, posts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--model", default=None, help="a GGUF file (default: the test fixture's small hybrid model)")
    p.add_argument("--out", default=None, help="write the report (JSON) here")
    a = p.parse_args()
    warnings.simplefilter("ignore", NonInteractiveExampleWarning)
    model = Path(a.model) if a.model else fx.gguf_path("hybrid", "f32")
    cases = st.one_of(posts, gets)
    statuses: collections.Counter = collections.Counter()
    bad: list[dict] = []
    stalls = 0
    worst_health = 0.0
    with ServerProcess(model, "--slots", "2", "--max-tokens-limit", "4", "--think", "off",
                       "--compile-timeout", "5") as server:
        end = time.monotonic() + a.minutes * 60
        n = 0
        while time.monotonic() < end:
            path, body = cases.example()
            try:
                if isinstance(body, dict):
                    r = post(server.url + path, body)
                else:
                    r = httpx.get(server.url + path.format(quote(body, safe="")), timeout=120)
                statuses[r.status_code] += 1
                if r.status_code >= 500:
                    bad.append({"path": path, "body": body, "status": r.status_code, "answer": r.text[:500]})
            except httpx.TimeoutException:
                stalls += 1
                bad.append({"path": path, "body": body, "status": "timeout"})
            t = time.monotonic()
            try:
                ok = httpx.get(server.url + "/health", timeout=STALL_S).status_code == 200
            except httpx.TimeoutException:
                ok = False
            took = time.monotonic() - t
            worst_health = max(worst_health, took)
            if not ok:
                stalls += 1
                bad.append({"path": path, "body": body, "status": "health stalled"})
            n += 1
            if n % 200 == 0:
                print(f"{n} requests, {dict(statuses)}", file=sys.stderr, flush=True)
    report = {"minutes": a.minutes, "requests": n, "statuses": {str(k): v for k, v in sorted(statuses.items())},
              "five_hundreds": sum(v for k, v in statuses.items() if k >= 500), "stalls": stalls,
              "worst_health_s": round(worst_health, 3), "bad": bad[:20]}
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
