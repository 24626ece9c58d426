"""`deltaserve bench context` (tools/bench/context.py): its run on the tiny fixture model (deltaserve alone), the
decode's bound from the bytes a token reads and the bandwidth the run measured, llama-bench's command lines per cache
type, and its flags refused in one line. No timing is asserted: the machine is shared."""

from __future__ import annotations

import json
import statistics

import pytest

from deltaserve.errors import DeltaserveError


def _args(*argv: str):
    from deltaserve.frontends.cli import build_parser

    return build_parser().parse_args(["bench", "context", *argv])


def test_bench_context_runs_each_kv_type_at_each_depth_and_writes_the_bound_from_the_bytes_and_the_bandwidth(
        tmp_path, monkeypatch, hybrid_gguf, hybrid_model):
    from PIL import Image

    from deltaserve.engine.state import kv_position_bytes
    from deltaserve.formats.gguf import read_gguf
    from tools.bench import context, run
    from tools.bench.report import CHART_SOFTWARE

    monkeypatch.setattr(context, "READ_GIB", 1 / 32)  # the plain read of a small buffer: the mechanism, not a speed
    out = tmp_path / "ctx"
    argv = ["context", "--model", str(hybrid_gguf), "--depths", "64,32", "--kv-type", "f32,f16",
            "--llama-kv-type", "none", "--repeats", "1", "--threads", "1", "--out", str(out)]
    monkeypatch.setattr("sys.argv", ["run.py", *argv])
    assert run.main(_args(*argv[1:])) == 0

    assert {p.name for p in out.iterdir()} == {"results.json", "RESULTS.md", "results.png"}
    with Image.open(out / "results.png") as im:
        assert im.info.get("Software") == CHART_SOFTWARE
    r = json.loads((out / "results.json").read_text())
    assert r["bench"] == "context" and r["complete"] and r["depths"] == [32, 64] and r["threads"] == 1
    assert r["command"].startswith("deltaserve bench context --model")
    assert r["skipped"] == {"llama.cpp": "--llama-kv-type none"} and "llama_records" not in r
    assert [(x["engine"], x["kv_type"], x["depth"]) for x in r["rows"]] == \
        [("deltaserve", kv, d) for kv in ("f32", "f16") for d in (32, 64)]

    # the bandwidth: read before and after the runs, the median of all the reads
    bw = r["read_bandwidth"]
    assert len(bw["runs"]) == 2 * context.READ_REPS and bw["median"] == statistics.median(bw["runs"])
    # the bytes a token reads, from the file and the model's shape, computed here on their own
    f = read_gguf(hybrid_gguf)
    tied = "output.weight" not in f.tensors
    weights = sum(t.nbytes for n, t in f.tensors.items() if tied or n != "token_embd.weight")
    c = hybrid_model.config
    assert r["model"]["weights_read_bytes"] == weights
    for row in r["rows"]:
        want = weights + c.recurrent_state_bytes() + kv_position_bytes(c, row["kv_type"]) * (row["depth"] + 16)
        assert row["token_bytes"] == pytest.approx(want)
        assert row["bound_tok_s"] == pytest.approx(bw["median"] / want)
        assert row["decode_over_bound"] == pytest.approx(row["decode_tok_s"] / row["bound_tok_s"])
        assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0 and row["threads"] == 1
        # each turn prefilled the whole depth and decoded the 32 tokens after it
        assert [(t["prefilled"], t["generated"], t["finish"]) for t in row["turns"]] == [(row["depth"], 33, "length")]
        assert row["peak_rss"] > r["model"]["file_bytes"]
        assert ("KV cache f16" in row["route"]) == (row["kv_type"] == "f16")
    # the f16 cache's token reads fewer bytes than the f32 one's, and more at the larger depth
    tb = {(x["kv_type"], x["depth"]): x["token_bytes"] for x in r["rows"]}
    assert tb["f16", 64] < tb["f32", 64] and tb["f16", 32] < tb["f16", 64]

    md = (out / "RESULTS.md").read_text()
    assert md.count("| deltaserve |") == 4 and "llama.cpp: not run (--llama-kv-type none)" in md
    assert "KV cache f16" in md  # the route lines


def test_llama_bench_runs_its_default_f16_cache_as_it_is_and_q8_0_with_flash_attention_on(tmp_path):
    from tools.bench.context import llama_bench_argv, llama_rows, parse_llama_kv, token_bytes

    assert parse_llama_kv("f16,q8_0") == ["f16", "q8_0"] and parse_llama_kv("none") == []
    f16 = llama_bench_argv("/bin/llama-bench", tmp_path / "m.gguf", "f16", [4096, 16384], 2, 3)
    q8 = llama_bench_argv("/bin/llama-bench", tmp_path / "m.gguf", "q8_0", [4096, 16384], 2, 3)
    for argv in (*f16.values(), *q8.values()):
        assert argv[:9] == ["/bin/llama-bench", "-m", str(tmp_path / "m.gguf"), "-t", "2", "-r", "3", "-o", "json"]
    assert f16["prefill"][9:] == ["-p", "4096,16384", "-n", "0", "--no-warmup"]
    assert f16["decode"][9:] == ["-p", "0", "-n", "32", "-d", "4096,16384"]
    assert "-ctk" not in f16["decode"] and "-fa" not in f16["decode"]  # llama.cpp's defaults
    for argv in q8.values():
        assert argv[9:15] == ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "1"]

    # llama-bench's records (as its -o json writes them) become one row per depth with the q8_0 cache's bound
    plan = {"weights_read_bytes": 1000, "recurrent_state_bytes": 24, "kv_position_bytes": {"q8_0": 34, "f16": 64}}
    records = [{"n_prompt": 128, "n_gen": 0, "n_depth": 0, "avg_ts": 50.0, "samples_ts": [50.0], "flash_attn": 1,
                "n_threads": 2, "type_k": "q8_0", "type_v": "q8_0"},
               {"n_prompt": 0, "n_gen": 32, "n_depth": 128, "avg_ts": 4.0, "samples_ts": [4.0], "flash_attn": 1,
                "n_threads": 2, "type_k": "q8_0", "type_v": "q8_0"}]
    row, = llama_rows(records, "q8_0", plan, 1e6, {"prefill": 10, "decode": 20})
    assert (row["engine"], row["kv_type"], row["depth"], row["prefill_tok_s"], row["decode_tok_s"]) == \
        ("llama.cpp", "q8_0", 128, 50.0, 4.0)
    assert row["token_bytes"] == token_bytes(plan, "q8_0", 128) == 1000 + 24 + 34 * (128 + 16)
    assert row["bound_tok_s"] == pytest.approx(1e6 / row["token_bytes"])
    assert row["decode_over_bound"] == pytest.approx(4.0 / row["bound_tok_s"])


def test_bench_context_refuses_bad_flags_in_one_line_naming_what_is_allowed(tmp_path, hybrid_gguf, hybrid_model):
    from tools.bench import context

    def refused(*argv: str) -> str:
        a = _args("--model", str(hybrid_gguf), "--llama-kv-type", "none", "--out", str(tmp_path), *argv)
        a.command_line = "deltaserve bench context"
        with pytest.raises(DeltaserveError) as e:
            context.main(a)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "'4x' is not a token count" in refused("--depths", "4K,4x")
    assert "unknown KV cache type 'f8': one of f32, f16, bf16" in refused("--kv-type", "f32,f8")
    assert "bf16 not among f16, q8_0" in refused("--llama-kv-type", "bf16")
    declared = hybrid_model.config.context_length
    msg = refused("--depths", str(declared))
    assert f"need {declared + 33} positions" in msg and f"declares {declared}" in msg
    assert "not a file" in refused("--model", str(tmp_path / "none.gguf"))
    assert context.parse_depths("16K,4096,4k") == [4096, 16384]
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written

    from tools.bench import run  # the bench's program refuses them before it makes the results directory

    with pytest.raises(DeltaserveError, match="not a token count"):
        run.main(_args("--depths", "1,x", "--out", str(tmp_path / "new")))
    assert not (tmp_path / "new").exists()


def test_a_peers_peak_rss_is_its_own_process_high_water_mark_and_its_json_records_are_read(tmp_path):
    """run_llama_bench on a real child that holds 96 MiB for a moment and prints a JSON list as llama-bench's -o json
    does: its own peak, not this (larger, torch-holding) process's, which wait4's ru_maxrss would report."""
    import sys

    from tools.bench.context import run_llama_bench

    code = ("import json, time; x = bytearray(96 << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(0.8); "
            "print('warming up'); print(json.dumps([{'n_prompt': 8, 'avg_ts': 1.5}]))")
    records, peak = run_llama_bench([sys.executable, "-c", code], every=0.05)
    assert records == [{"n_prompt": 8, "avg_ts": 1.5}]
    assert 96 << 20 <= peak < (96 << 20) + (64 << 20)
    with pytest.raises(RuntimeError, match="exited 3"):
        run_llama_bench([sys.executable, "-c", "raise SystemExit(3)"])
