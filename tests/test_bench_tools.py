"""The benchmark's tools are right: the HF export runs in transformers with our logits, random models load."""

from __future__ import annotations

import torch

import deltaserve
from tools.bench.export_hf import export_hf
from tests.fixtures import models as fx


def test_a_gguf_exported_back_to_hf_gives_transformers_our_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    path = fx.gguf_path("hybrid", "f32")  # tiled value heads (4 value heads over 2 key heads)
    ours = deltaserve.load(path, weights="exact", cache=False)
    d = export_hf(ours.host, tmp_path / "hf", dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = list(range(5, 150))
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    assert (theirs - ours.logits(ids)).abs().max().item() < 2e-3


def test_the_peak_memory_measure_counts_the_run_process_alone_not_the_larger_benchmark_that_forked_it():
    from tools.bench.peers import deltaserve_peak_rss
    from deltaserve.demo import DEMO_FILE

    ballast = torch.ones(3 * 2**30 // 4 // 2)  # 1.5 GiB touched in this (parent) process
    r = deltaserve_peak_rss(DEMO_FILE, 1)
    assert r["ok"] and r["file_bytes"] == DEMO_FILE.stat().st_size
    # a deltaserve process on the 8 MB demo: torch and the tokenizer, well under the parent's ballast
    assert 50 * 2**20 < r["peak_rss"] < 1 * 2**30, r
    del ballast


def test_repeated_chat_runs_report_the_median_of_each_turn_and_of_the_regenerate():
    from tools.bench.peers import chat_medians

    def run(ttfts, regen):
        return {"turns": [{"turn": i + 1, "ttft_s": t, "prompt_tokens": 10 * (i + 1), "cached_tokens": 0}
                          for i, t in enumerate(ttfts)], "regenerate_ttft_s": regen, "regenerate_cached": 7}

    runs = [run([0.9, 0.4], 0.2), run([0.1, 0.5], 0.1), run([0.5, 0.3], 0.9)]
    m = chat_medians(runs)
    assert [t["ttft_s"] for t in m["turns"]] == [0.5, 0.4]
    assert m["regenerate_ttft_s"] == 0.2 and m["runs"] == runs
    assert [t["prompt_tokens"] for t in m["turns"]] == [10, 20]


def test_the_report_names_how_many_conversations_each_chat_median_is_over(tmp_path):
    from tools.bench.peers import chat_medians
    from tools.bench.report import write_report

    def run(t):
        return {"turns": [{"turn": 1, "ttft_s": t, "prompt_tokens": 10, "cached_tokens": 0}],
                "regenerate_ttft_s": t / 2, "regenerate_cached": 3}

    r = {"command": "deltaserve bench chat", "threads": 2, "repeats": 3, "cpu": "x", "torch": "2", "date": "d",
         "files": {}, "read_bandwidth": 1e10,
         "chat": {"deltaserve": chat_medians([run(0.2), run(0.3), run(0.4)]),
                  "llama-server": chat_medians([run(0.6), run(0.6), run(0.8)])}}
    text = write_report(r, tmp_path)
    assert "median of 3 conversations per engine" in text
    assert "| 1 | 10 | 300 | 600 | 0.50 |" in text


def test_an_engine_measure_runs_in_a_process_of_its_own_and_returns_its_numbers(hybrid_gguf):
    from tools.bench.peers import in_fresh_process

    r = in_fresh_process("deltaserve_pp_tg", hybrid_gguf, 1, 1)
    assert r["pp512"] > 0 and r["tg"] > 0 and len(r["pp_runs"]) == 1
    assert len(r["read_bandwidth_runs"]) == 1 and r["read_bandwidth_runs"][0] > 1e8  # measured in that process
    try:
        in_fresh_process("deltaserve_pp_tg", hybrid_gguf.with_name("missing.gguf"), 1, 1)
        raise AssertionError("a failing measure must raise")
    except RuntimeError as e:
        assert "deltaserve_pp_tg failed" in str(e)


def test_the_decode_bound_takes_the_highest_read_bandwidth_measured_in_the_run(tmp_path):
    from tools.bench.peers import merge_runs
    from tools.bench.report import write_report

    def run(tg, bw):
        return {"pp512": 100.0, "tg": tg, "pp_runs": [100.0], "tg_runs": [tg], "decode_bytes_per_token": 1e9,
                "read_bandwidth_runs": [bw]}

    ds = merge_runs([run(20.0, 30e9), run(22.0, 50e9), run(21.0, 40e9)])
    assert ds["read_bandwidth_runs"] == [30e9, 50e9, 40e9] and ds["tg"] == 21.0
    llama = merge_runs([{"pp512": 50.0, "tg": 10.0, "pp_runs": [50.0], "tg_runs": [10.0]}])
    r = {"command": "deltaserve bench speed", "threads": 2, "repeats": 3, "cpu": "x", "torch": "2", "date": "d",
         "files": {}, "read_bandwidth": 35e9, "speed": {"q8_0": {"llama.cpp": llama, "deltaserve": ds}}}
    text = write_report(r, tmp_path)
    assert "50.0 GB/s, the highest of 4 measurements (30.0-50.0 GB/s" in text
    assert "bandwidth bound 50.0 tok/s, reached 42%" in text  # 21 tok/s of 50: bytes per token / best bandwidth
