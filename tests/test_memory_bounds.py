"""Memory does not grow with the number of different prompt lengths a process has seen."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, random, sys, psutil
import deltaserve
m = deltaserve.load(None)
s = m.session(quiet=True)
rng, proc, rss = random.Random(0), psutil.Process(), {}
for i in range(400):
    n = rng.randint(5, 800)
    s.generate([rng.randrange(200, m.config.vocab_size - 50) for _ in range(n)], max_tokens=1)
    if i + 1 in (50, 400):
        rss[i + 1] = proc.memory_info().rss
print(json.dumps(rss))
"""


def test_four_hundred_prompts_of_random_length_grow_memory_at_most_a_tenth_past_the_first_fifty():
    # before: 636 MiB after 50, 1,206 after 300 (1.9x; oneDNN's per-shape primitive cache of 1,024 and a heap
    # never handed back); then ONEDNN_PRIMITIVE_CACHE_CAPACITY 256 and long prefills trimming the heap: 479 -> 630
    # MiB after 1,000 (1.32x; torch's ideep cache of 1,024 computations); with LRU_CACHE_CAPACITY 64: 380 -> 376.
    # (flat: 269, 267, 268, 268 MiB after 50, 100, 200, 400). 400 prompts show either regression under a bound of a
    # tenth: oneDNN's 1.9x by 300, the ideep cache's ~1.12x by 400
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rss = {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    assert rss[400] <= 1.1 * rss[50], f"RSS {rss[50] >> 20} MiB after 50 prompts, {rss[400] >> 20} MiB after 400"
