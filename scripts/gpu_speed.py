"""Prefill / decode speed of the deltaserve forward on a CUDA device, random weights of real Qwen3.5 shapes,
plus a CPU-vs-CUDA logits comparison on the 0.8B shape. Writes JSON and markdown under --out."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tools.bench.randmodel import random_weights
from deltaserve.engine.forward import Forward
from deltaserve.engine.graph import GraphDecoder
from deltaserve.runtime.guard import compare


def timed(fn, repeats=3):
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def decode_speed(f: Forward, ids: list[int]) -> float:
    """Tokens per second of 32 decode steps after a prefill of `ids` (the median of three rounds from one position)."""
    st = f.new_state(600)
    f.prefill(st, ids)

    def steps():
        for i in range(32):
            f.decode(st, ids[i])
        st.length -= 32

    return 32 / timed(steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/gpu")
    ap.add_argument("--shapes", default="0.8B,9B")
    a = ap.parse_args()
    rows = []
    for shape in a.shapes.split(","):
        c, w = random_weights(shape, torch.bfloat16, "cuda")
        f = Forward(c, w, "cuda")
        f.graphs = GraphDecoder(f)  # the decode step as a CUDA graph (engine/graph.py; off by default until measured)
        ids = torch.randint(0, c.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
        f.prefill(f.new_state(600), ids[:64])  # warm-up
        pp = 512 / timed(lambda: f.prefill(f.new_state(600), ids))
        tg = decode_speed(f, ids)
        fe = Forward(c, w, "cuda")
        fe.graphs = None  # the eager step, for comparison
        tg_eager = decode_speed(fe, ids)
        a, b = f.new_state(600), fe.new_state(600)  # graph and eager logits, token by token from one prefix
        f.prefill(a, ids[:100])
        fe.prefill(b, ids[:100])
        diff = max(float((f.decode(a, t) - fe.decode(b, t)).abs().max()) for t in ids[100:116])
        row = {"shape": shape, "dtype": "bf16", "pp512_tok_s": round(pp, 1), "tg_tok_s": round(tg, 1),
               "tg_eager_tok_s": round(tg_eager, 1), "graph_vs_eager_max_abs": diff,
               "graphs_recorded": f.graphs.recorded if f.graphs else 0, "weights_gib": round(w.nbytes / 2**30, 2)}
        if shape == "0.8B":
            cpu_w = random_weights(shape, torch.float32, "cpu", layers=None)[1]
            fc, fg = Forward(c, cpu_w, "cpu"), Forward(c, cpu_w.to("cuda"), "cuda")
            probe = ids[:128]
            ref = fc.prefill(fc.new_state(128), probe, all_logits=True)[-64:]
            got = fg.prefill(fg.new_state(128), probe, all_logits=True)[-64:].cpu()
            row["cpu_vs_cuda_f32_min_cos"], row["cpu_vs_cuda_f32_argmax"] = compare(got, ref)
            row["cpu_vs_cuda_f32_max_abs"] = float((got - ref).abs().max())
        print(row, flush=True)
        rows.append(row)
        del w
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_speed.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
