"""`deltaserve bench replicas`' report: the 1-against-2 ratios and the routing's hit rate, from its rows."""

from __future__ import annotations

import json


def run(label, replicas, wall, ttfts, cached_of_prev, routed=None):
    from tools.bench.conversations import follow_up_hits

    rows = []
    for c in range(2):
        for k in (1, 2, 3):
            rows.append({"conversation": c, "turn": k, "ttft_s": ttfts[k - 1], "total_s": ttfts[k - 1] + 1,
                         "prompt_tokens": 100 * k, "completion_tokens": 10, "decode_tok_s": 9.0,
                         "cached_tokens": cached_of_prev(100 * (k - 1)) if k > 1 else 0})
    e = {"label": label, "replicas": replicas, "threads": 1, "wall_s": wall, "throughput_tok_s": 60 / wall,
         "decode_tok_s_median": 9.0, "ttft_median_s": sorted(ttfts)[1],
         "ttft_follow_up_median_s": sorted(ttfts[1:])[0], "ttft_first_turn_median_s": ttfts[0],
         "hits": follow_up_hits(rows), "load_before": 1.0, "load_after": 1.5, "rows": rows}
    if routed is not None:
        from tools.bench.replicas import prefix_share

        e.update(routed=routed, router_prefix_share=prefix_share(routed, 4),
                 per_replica=[{"replica": 0, "requests": 4, "restores_disk": 1, "restores_ram": 2}])
    return e


def test_the_replicas_report_gives_the_ratios_and_the_routings_hit_rate(tmp_path):
    from tools.bench.conversations import HEADER
    from tools.bench.replicas import write_report

    one = run("1 replica, 1 thread", 1, 20.0, [1.0, 0.4, 0.5], lambda prev: prev - HEADER, {"prefix": 4, "hash": 2})
    two = run("2 replicas, 1 thread each", 2, 10.0, [0.5, 0.2, 0.25], lambda prev: prev - HEADER if prev > 100 else 0,
              {"prefix": 2, "prefix (all full)": 1, "hash": 2, "prefix replica full": 1})
    r = {"command": "deltaserve bench replicas", "cpu": "x", "cores": 2, "date": "d", "file": "f.gguf",
         "conversations": 2, "turns": 3, "runs": [one, two], "wall_s": 120.0}
    text = write_report(r, tmp_path).read_text()
    assert "**2.00x** the tokens per second" in text and "median TTFT **0.50x**" in text
    assert "| 4 of 4 (100%) |" in text and "| 2 of 4 (50%) |" in text  # full state hits on follow-ups
    assert "3 to the replica their saved prefix went to (75%" in text
    assert json.loads((tmp_path / "replicas.json").read_text())["runs"][1]["replicas"] == 2
