"""The benchmark's tools are right: the HF export runs in transformers with our logits, random models load."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import deltaserve
from tools.bench.export_hf import export_hf
from tests.fixtures import models as fx

ROOT = Path(__file__).resolve().parents[1]


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


def test_the_conversations_report_counts_full_store_hits_and_gives_the_ratios_against_llama_server(tmp_path):
    from tools.bench.conversations import HEADER, follow_up_hits, paired_ratio, summarize, write_report

    def rows(ttfts, cached_of_prev):  # 2 conversations x 3 turns, prompts of 100, 200, 300 tokens
        out = []
        for k in (1, 2, 3):
            for c in (0, 1):
                cached = 0 if k == 1 else cached_of_prev(c, k, 100 * (k - 1))
                out.append({"conversation": c, "turn": k, "ttft_s": ttfts[k - 1], "prompt_tokens": 100 * k,
                            "cached_tokens": cached, "text": f"{c}.{k}", "llama_cache_n": 50, "llama_prompt_n": 10})
        return out

    # conversation 1's turn 3 restored less than its previous prompt's checkpoint: not a full hit
    ds = rows([0.5, 0.2, 0.1], lambda c, k, prev: prev - HEADER - (40 if (c, k) == (1, 3) else 0))
    hits = follow_up_hits(ds)
    assert (hits["follow_up_turns"], hits["full_hits"], hits["any_reuse"]) == (4, 3, 4)
    ll = rows([0.5, 0.4, 0.4], lambda c, k, prev: 0)
    entry = {"conversations": 2, "mode": "round robin", "turns": 3, "ratio": 0.25, "paired_ratio": 0.3,
             "deltaserve": {"rows": ds, **summarize(ds), "hits": hits,
                            "store": {"hits": 4, "misses": 2, "restores": {"ram": 4, "disk": 0},
                                      "evictions": {"ram": 0, "disk": 0}, "ram": {"states": 6, "bytes": 2**20},
                                      "tokens_not_prefilled": 600}},
             "llama-server": {"rows": ll, **summarize(ll), "llama_reuse": {"follow_up_turns": 4, "cache_n_median": 50,
                                                                           "prompt_n_median": 10}}}
    assert entry["deltaserve"]["ttft_median_s"] == 0.1 and entry["deltaserve"]["per_turn"] == {1: 0.5, 2: 0.2, 3: 0.1}
    assert paired_ratio(ds, ll) == 0.25  # turn 3 alone: 0.1 s against 0.4 s, request by request
    restart = {"conversations": 2, "sigterm_exit": 0, "stop_s": 1.0, "state_files": 6, "same_as_unrestarted": 2,
               "unrestarted": {"ttft_median_s": 0.1}, "state_bytes": 3 * 2**20, "ratio": 0.2,
               "same_answers": 2, "restarted": {"rows": ds[4:], "ttft_median_s": 0.1, "cached_median": 193,
                                                "startup_s": 3.0, "store": None},
               "fresh": {"rows": ll[4:], "ttft_median_s": 0.5, "cached_median": 0, "startup_s": 3.0, "store": None}}
    r = {"command": "deltaserve bench conversations", "threads": 2, "cpu": "x", "date": "d", "file": "f.gguf",
         "many": [entry], "restart": restart, "wall_s": 60.0}
    text = (write_report(r, tmp_path)).read_text()
    assert "| 2 | round robin | 300 | 100 | 400 | 0.25x | 0.30x | 3 of 4 (75%) | 50 of 300 | - of 4 |" in text
    assert "| 2 | round robin | 500 / 500 | 200 / 400 | 100 / 400 |" in text
    assert "Ratio restarted / re-prefill: **0.20x** (goal <= 0.3). Answers of the restarted server identical to " \
           "the same turn without a restart: 2 of 2" in text
    assert (tmp_path / "conversations.json").exists()


def test_a_bench_run_writes_to_a_new_directory_unless_out_names_one(tmp_path, monkeypatch):
    """`deltaserve bench threads --quick` from a checkout once overwrote the committed benchmarks/threads.md."""
    from tools.bench.run import out_dir

    monkeypatch.chdir(tmp_path)
    first, second = out_dir("threads", None, now=0), out_dir("threads", None, now=0)
    assert first.is_dir() and second.is_dir() and first != second  # the same second: still two directories
    assert first.name.startswith("bench-threads-") and not (tmp_path / "benchmarks").exists()
    assert out_dir("threads", str(tmp_path / "named")) == tmp_path / "named"


def test_deltaserve_bench_runs_the_bench_as_its_own_program_with_the_flags_given(monkeypatch):
    """The CLI never imports tools/ (the wheel's modules import nothing above them): it starts the bench's program."""
    import subprocess

    from deltaserve.frontends.cli import main

    seen = []
    monkeypatch.setattr(subprocess, "call", lambda argv, env: seen.append((argv, env)) or 0)
    assert main(["bench", "threads", "--quick", "--out", "x"]) == 0
    (argv, env), = seen
    assert argv[1:] == ["-m", "tools.bench.run", "threads", "--quick", "--out", "x"]
    assert str(ROOT) in env["PYTHONPATH"].split(os.pathsep)


def test_bench_quants_runs_the_presets_named_and_refuses_one_it_does_not_know(tmp_path):
    import argparse

    import pytest

    from tools.bench import quants

    assert set(quants.NEEDS_IMATRIX) <= set(quants.PRESETS)  # the importance-matrix presets are made, not skipped
    assert "MXFP4_MOE" in quants.PRESETS and quants.MOE_SHAPE == "35B-A3B"  # the MoE preset, on the MoE shape
    a = argparse.Namespace(out=str(tmp_path), quick=False, presets="IQ2_XXS,MXFP4_MOE,Q9_9", threads=2, repeats=1,
                           command_line="deltaserve bench quants --presets IQ2_XXS,MXFP4_MOE,Q9_9")
    with pytest.raises(SystemExit, match="Q9_9 not among"):
        quants.main(a)


def test_a_bench_reports_command_line_starts_with_the_route_variables_set_so_that_it_reruns_the_same_route():
    from tools.bench.run import command_line

    env = {"DELTASERVE_AMX": "off", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "HOME": "/root", "DELTASERVE_ISA": ""}
    assert command_line(["moe", "--repeats", "3"], env) == \
        "DELTASERVE_AMX=off ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 deltaserve bench moe --repeats 3"
    assert command_line(["quants", "--presets", "Q4_0,IQ2_XS"], {}) == "deltaserve bench quants --presets Q4_0,IQ2_XS"


def test_a_bench_run_draws_a_chart_beside_each_results_file_with_decode_against_the_memorys_bound(tmp_path):
    import json
    import os

    from PIL import Image

    from tools.bench.report import CHART_SOFTWARE, charts

    engines = lambda pp, tg: {"pp": pp, "tg": tg}  # noqa: E731
    rows = {"cpu": "a test CPU", "date": "today", "pp": 512, "rows": [
        {"kind": "q8_0", "layers": 4, "deltaserve": engines(600, 40), "llama.cpp": engines(230, 36)},
        {"kind": "q8_0", "layers": 8, "deltaserve": engines(340, 39), "llama.cpp": engines(120, 27)}],
        "floor": {"q8_0": {"read_bandwidth": 64e9, "bytes_per_layer": 7e7, "fixed_bytes": 5.4e8}}}
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "results.json").write_text(json.dumps(rows))
    (tmp_path / "other.json").write_text(json.dumps({"what": "no bench wrote this"}))
    own = tmp_path / "session_turns.png"  # a bench that draws its own chart after writing its JSON keeps it
    (tmp_path / "session_turns.json").write_text(json.dumps({"turns": []}))
    Image.new("RGB", (4, 4)).save(own)
    os.utime(own, (own.stat().st_mtime + 5,) * 2)
    written = charts(tmp_path)
    assert written == [tmp_path / "moe" / "results.png"]
    with Image.open(written[0]) as im:
        assert im.format == "PNG" and im.size[0] > 500 and im.info["Software"] == CHART_SOFTWARE
    assert Image.open(own).size == (4, 4)
    assert charts(tmp_path) == written  # its own chart is drawn again from the results as they are now


def test_every_committed_results_file_has_its_chart_beside_it():
    """Drawn by its bench (session_turns, serve) or by report.chart; a results file neither knows fails here."""
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    for path in sorted(root.rglob("*.json")):
        assert path.with_suffix(".png").exists(), f"{path} has no chart: python -c 'from pathlib import Path; from " \
                                                  f"tools.bench.report import charts; charts(Path(\"benchmarks\"))'"
