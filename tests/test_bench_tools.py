"""The benchmark's tools are right: the HF export runs in transformers with our logits, random models load."""

from __future__ import annotations

import torch

import deltaserve
from deltaserve.bench.export_hf import export_hf
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
    from deltaserve.bench.peers import deltaserve_peak_rss
    from deltaserve.demo import DEMO_FILE

    ballast = torch.ones(3 * 2**30 // 4 // 2)  # 1.5 GiB touched in this (parent) process
    r = deltaserve_peak_rss(DEMO_FILE, 1)
    assert r["ok"] and r["file_bytes"] == DEMO_FILE.stat().st_size
    # a deltaserve process on the 8 MB demo: torch and the tokenizer, well under the parent's ballast
    assert 50 * 2**20 < r["peak_rss"] < 1 * 2**30, r
    del ballast
