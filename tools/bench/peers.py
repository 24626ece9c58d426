"""deltaserve side by side with llama.cpp (llama-cpp-python, llama-server) and transformers, in one run,
on the same model files, with the same thread count. Medians over repeats; ratios reported.

Measures: prefill pp512 and decode (tg) per engine and file; the fraction of the memory-bandwidth bound
deltaserve's decode reaches; a 12-turn chat's TTFT per turn and a regenerate against llama-server; peak
resident memory of `deltaserve run` against the file size; aggregate decode of 8 concurrent conversations.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from deltaserve.kernels.native import cpu_flags  # as deltaserve's build sees them (DELTASERVE_ISA=avx2: no AVX512)
from tools.bench.models import CACHE, REPO, model_file

PP = 512
# llama.cpp is never built with GGML_NATIVE: a native build on an Intel Xeon that reports AMX compiles AMX kernels
# whose first tile instruction faults in these virtual machines. The README's test command builds the oracle for the
# AVX2 baseline (it runs on every CPU here); the bench builds llama.cpp with the AVX512 features this CPU reports on top
# of that baseline, so that its speed is llama.cpp's best on this machine (a test checks both).
LLAMA_BASE_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON")
LLAMA_AVX512_FLAGS = {"avx512f": "-DGGML_AVX512=ON", "avx512_vnni": "-DGGML_AVX512_VNNI=ON",
                      "avx512_bf16": "-DGGML_AVX512_BF16=ON", "avx512vbmi": "-DGGML_AVX512_VBMI=ON"}


def llama_cpu_flags(flags: set[str] | None = None) -> tuple[str, ...]:
    """The cmake flags of the bench's llama.cpp on a CPU with these /proc/cpuinfo flags (AVX512 parts only where
    the CPU has AVX512F; never AMX)."""
    flags = cpu_flags() if flags is None else flags
    extra = tuple(v for k, v in LLAMA_AVX512_FLAGS.items() if k in flags) if "avx512f" in flags else ()
    return LLAMA_BASE_FLAGS + extra


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def read_bandwidth(threads: int, gib: float = 1.0) -> float:
    """Bytes/s a reduction over a large tensor reads (what a memory-bound decode can hope for)."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / min(times)


# -- deltaserve --------------------------------------------------------------------------------------

_FRESH_RUNNER = """
import importlib, json, sys
from pathlib import Path
args = json.loads(sys.argv[1])
module = importlib.import_module(args["module"])
print("[result] " + json.dumps(getattr(module, args["fn"])(Path(args["path"]), *args["args"])))
"""


def in_fresh_process(fn: str, path: Path, *args, module: str = "tools.bench.peers") -> dict:
    """<module>.<fn>(path, *args) in a process of its own, as a user runs an engine: the measures do not share
    the benchmark's threads (each thread that ran torch or llama.cpp work before would keep an OpenMP team,
    and with more team threads than CPUs libgomp parks them between regions: see runtime/engine.py)."""
    payload = json.dumps({"fn": fn, "path": str(path), "args": list(args), "module": module})
    proc = subprocess.run([sys.executable, "-c", _FRESH_RUNNER, payload], capture_output=True, text=True, cwd=REPO)
    value = _tagged(proc.stdout, "[result] ")
    if proc.returncode != 0 or value is None:
        raise RuntimeError(f"{fn} failed (exit {proc.returncode}): {proc.stderr[-800:]}")
    return json.loads(value)


def _tagged(output: str, tag: str) -> str | None:
    """What follows `tag` on the first line of `output` that starts with it (a child process's report)."""
    return next((x[len(tag):] for x in output.splitlines() if x.startswith(tag)), None)


def bench_ids(vocab: int) -> list[int]:
    """The prompt every engine gets: PP token ids, the same for all (below 200000, or the vocabulary)."""
    return torch.randint(0, min(200000, vocab), (PP,), generator=torch.Generator().manual_seed(0)).tolist()


def deltaserve_pp_tg(path: Path, threads: int, repeats: int, tg_tokens: int = 32) -> dict:
    import deltaserve
    from deltaserve.engine.forward import Forward
    from deltaserve.kernels import native
    from deltaserve.session.sampling import best

    torch.set_num_threads(threads)
    native.library()  # built (or found built) before the clock: a first run's compile is in neither load nor prefill
    t0 = time.perf_counter()
    m = deltaserve.load(path, cache=False)
    load_s = time.perf_counter() - t0
    f = Forward(m.config, m.host.weights)
    ids = bench_ids(m.config.vocab_size)
    f.prefill(f.new_state(PP), ids[:64])
    pp = []
    for _ in range(repeats):
        st = f.new_state(PP + tg_tokens + 8)
        t = time.perf_counter()
        logits = f.prefill(st, ids)
        pp.append(PP / (time.perf_counter() - t))
    tg = []
    for _ in range(repeats):
        st = f.new_state(64 + tg_tokens + 8)
        logits = f.prefill(st, ids[:64])
        tok = best(logits.reshape(-1))
        f.decode(st, tok)
        t = time.perf_counter()
        for _ in range(tg_tokens):
            tok = best(f.decode(st, tok).reshape(-1))  # greedy as a session takes it
        tg.append(tg_tokens / (time.perf_counter() - t))
    decode_bytes = sum(lw.gate_up.decode_nbytes + lw.down.decode_nbytes +
                       (lw.mixer.qkv.decode_nbytes + lw.mixer.o.decode_nbytes if hasattr(lw.mixer, "qkv")
                        else lw.mixer.in_proj.decode_nbytes + lw.mixer.out.decode_nbytes)
                       for lw in m.host.weights.layers) + m.host.weights.lm_head.decode_nbytes
    # the machine's read bandwidth moves from minute to minute: measured again in the minute of these runs
    return {"pp512": median(pp), "tg": median(tg), "pp_runs": pp, "tg_runs": tg, "load_s": load_s,
            "decode_bytes_per_token": decode_bytes, "weights_bytes": m.host.weights.nbytes,
            "read_bandwidth_runs": [read_bandwidth(threads)]}


def deltaserve_aggregate(path: Path, threads: int, conversations: int = 8, tokens: int = 32) -> dict:
    """Decode throughput of `conversations` sessions at once (batched across sessions) against one."""
    import threading

    import deltaserve
    from deltaserve.runtime.backend import CPUBackend
    from deltaserve.kernels.cpu import serial_here
    from deltaserve.runtime.engine import EngineLoop

    engine = EngineLoop(threaded=True)  # as the server runs them: every forward on the engine loop's thread
    m = engine.call(deltaserve.load, path, threads=threads)
    prompts = [[1000 + 7 * i + j for j in range(40)] for i in range(conversations)]

    def run(n: int) -> float:
        backend = CPUBackend(m.host)
        backend.use_engine(engine)
        sessions = [m.session(backend=backend, quiet=True) for _ in range(n)]
        barrier = threading.Barrier(n + 1)
        done = []

        def go(s, p):
            serial_here()  # this thread's own torch ops, if any, open no OpenMP team (see runtime/engine.py)
            s.generate(p, max_tokens=1)  # prefilled, so the timed part is decode
            barrier.wait()
            turn = s.generate(p + [5], max_tokens=tokens, stop=[])
            done.append(turn.generated)

        th = [threading.Thread(target=go, args=(s, p)) for s, p in zip(sessions, prompts)]
        [t.start() for t in th]
        barrier.wait()
        t0 = time.perf_counter()
        [t.join() for t in th]
        return sum(done) / (time.perf_counter() - t0)

    one, many = run(1), run(conversations)
    return {"one_tok_s": one, "many_tok_s": many, "conversations": conversations, "ratio": many / one}


_PEAK_RSS_RUNNER = """
import sys
from deltaserve.frontends.cli import main
try:
    rc = main(sys.argv[1:])
finally:
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    sys.stderr.write("[peak-rss] " + hwm.split(":", 1)[1].strip() + "\\n")
sys.exit(rc)
"""


def deltaserve_peak_rss(path: Path, threads: int) -> dict:
    """Peak RSS of one `deltaserve run` process: VmHWM of its own address space, read as it exits.
    (rusage's ru_maxrss would also count the pages the child shared with this, larger, benchmark
    process between fork and exec.)"""
    proc = subprocess.run([sys.executable, "-c", _PEAK_RSS_RUNNER, "run", str(path), "-p", "hello " * 200, "-n", "32",
                           "--threads", str(threads), "--device", "cpu"], capture_output=True, text=True)
    line = _tagged(proc.stderr, "[peak-rss] ")
    if line is None:
        raise RuntimeError(f"deltaserve run did not report its peak memory (exit {proc.returncode}): {proc.stderr[-500:]}")
    value, unit = line.split()[:2]
    assert unit == "kB", line
    peak = int(value) * 1024
    size = path.stat().st_size
    return {"peak_rss": peak, "file_bytes": size, "ratio": peak / size, "ok": proc.returncode == 0}


# -- llama.cpp ---------------------------------------------------------------------------------------

def llama_pp_tg(path: Path, threads: int, repeats: int, tg_tokens: int = 32) -> dict:
    import llama_cpp

    m = llama_cpp.Llama(str(path), n_ctx=1024, n_batch=PP, n_ubatch=PP, n_threads=threads, n_threads_batch=threads,
                        verbose=False)
    ids = bench_ids(m.n_vocab())
    m.reset()
    m.eval(ids[:64])
    pp, tg = [], []
    for _ in range(repeats):
        m.reset()
        t = time.perf_counter()
        m.eval(ids)
        pp.append(PP / (time.perf_counter() - t))
    for _ in range(repeats):
        m.reset()
        m.eval(ids[:64])
        t = time.perf_counter()
        for i in range(tg_tokens):
            m.eval([ids[64 + i]])
        tg.append(tg_tokens / (time.perf_counter() - t))
    del m
    return {"pp512": median(pp), "tg": median(tg), "pp_runs": pp, "tg_runs": tg}


def _llama_built(target: str, shared: bool, product: str) -> Path:
    """llama.cpp's `target` built once from the vendored source in llama-cpp-python's sdist (the installed version),
    with the widest vector flags this CPU reports (llama_cpu_flags), in a build tree of its own (shared libraries or
    static); the path of `product` in that tree's bin/, built when it is not there yet."""
    from importlib import metadata

    version = metadata.version("llama-cpp-python")
    flags = llama_cpu_flags()
    tag = "avx512" if "-DGGML_AVX512=ON" in flags else "avx2"
    tree = CACHE / f"llama.cpp-{version}-{tag}{'-shared' if shared else ''}" / "build"
    if (tree / "bin" / product).exists():
        return tree / "bin" / product
    src = CACHE / f"llama.cpp-{version}-src"
    if not src.exists():
        dl = CACHE / "sdist"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(dl)], check=True, capture_output=True)
        unpacked = CACHE / "sdist" / "unpacked"
        with tarfile.open(next(dl.glob(f"llama_cpp_python-{version}.tar.gz"))) as tf:
            tf.extractall(unpacked)
        shutil.move(str(next(unpacked.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"), src)
    subprocess.run(["cmake", "-S", str(src), "-B", str(tree), *flags, "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release",
                    f"-DBUILD_SHARED_LIBS={'ON' if shared else 'OFF'}"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(tree), "--target", target, "-j", str(os.cpu_count())],
                   check=True, capture_output=True)
    return tree / "bin" / product


def llama_server_binary() -> Path:
    """llama.cpp's own llama-server (static), built once with this CPU's widest vector flags."""
    return _llama_built("llama-server", shared=False, product="llama-server")


def llama_library_dir() -> Path:
    """The directory of libllama.so and its ggml libraries built with this CPU's widest vector flags, for
    llama-cpp-python to load instead of its own (LLAMA_CPP_LIB_PATH): the README's install builds that one for the
    AVX2 baseline (it must run on every CPU here), which would understate llama.cpp on an AVX512 CPU."""
    return _llama_built("llama", shared=True, product="libllama.so").parent


def use_best_llama() -> str:
    """Point llama-cpp-python (in this process and the fresh ones it starts) at llama_library_dir(); what it is."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(llama_library_dir())
    return " ".join(f for f in llama_cpu_flags() if f.startswith("-DGGML_AVX"))


# -- transformers --------------------------------------------------------------------------------------

def transformers_pp_tg(path: Path, threads: int, repeats: int, tg_tokens: int = 16) -> dict:
    import deltaserve
    from transformers import AutoModelForCausalLM

    from tools.bench.export_hf import export_hf

    torch.set_num_threads(threads)
    hf_dir = CACHE / (path.stem + "-hf-bf16")
    if not (hf_dir / "config.json").exists():
        export_hf(deltaserve.load(path, weights="exact", cache=False).host, hf_dir, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 200000, (1, PP), generator=torch.Generator().manual_seed(0))
    pp, tg = [], []
    with torch.inference_mode():
        model(ids[:, :64])
        for _ in range(repeats):
            t = time.perf_counter()
            model(ids, logits_to_keep=1)
            pp.append(PP / (time.perf_counter() - t))
        for _ in range(repeats):
            t = time.perf_counter()
            model.generate(ids[:, :64], max_new_tokens=tg_tokens, min_new_tokens=tg_tokens, do_sample=False)
            total = time.perf_counter() - t
            t = time.perf_counter()
            model(ids[:, :64], logits_to_keep=1)
            prefill = time.perf_counter() - t
            tg.append(tg_tokens / max(total - prefill, 1e-9))
    return {"pp512": median(pp), "tg": median(tg), "pp_runs": pp, "tg_runs": tg}


# -- chat: turn TTFT against llama-server ---------------------------------------------------------------

def _user_text(k: int) -> str:
    import random

    from tools.bench.session_turns import WORDS

    rng = random.Random(1000 + k)
    return " ".join(rng.choice(WORDS) for _ in range(70)).capitalize() + "?"


def _stream_ttft(url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    import httpx

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False}}
    t0 = time.perf_counter()
    first, text, usage = None, "", {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                piece = (ch.get("delta") or {}).get("content") or (ch.get("delta") or {}).get("reasoning_content")
                if piece:
                    first = first or time.perf_counter() - t0
                    text += (ch.get("delta") or {}).get("content") or ""
    return (first if first is not None else time.perf_counter() - t0), text, usage


def _wait_up(url: str, proc, seconds: float = 300) -> None:
    import httpx

    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not come up")


@contextmanager
def serving(cmd: list[str], url: str):
    """A server process (`cmd`, its output discarded) up and answering /health at `url` while inside; stopped
    after (terminated, killed if it has not gone in 30 s)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_up(url, proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_measure(engine: str, path: Path, threads: int, turns: int = 12, max_tokens: int = 16) -> dict:
    """TTFT per turn of one conversation, then a regenerate of the last turn."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    if engine == "deltaserve":
        cmd = [sys.executable, "-m", "deltaserve.frontends.cli", "serve", str(path), "--port", str(port), "--slots", "1",
               "--threads", str(threads), "--device", "cpu", "--ctx", "8192"]
    else:
        cmd = [str(llama_server_binary()), "-m", str(path), "--port", str(port), "-t", str(threads), "-tb",
               str(threads), "-c", "8192", "-np", "1", "--jinja", "--no-warmup"]
    with serving(cmd, url):
        messages: list[dict] = []
        rows = []
        for k in range(1, turns + 1):
            messages.append({"role": "user", "content": _user_text(k)})
            ttft, text, usage = _stream_ttft(url, messages, max_tokens)
            rows.append({"turn": k, "ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens"),
                         "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
            messages.append({"role": "assistant", "content": text})
        messages.pop()
        regen, _, usage = _stream_ttft(url, messages, max_tokens)
        return {"turns": rows, "regenerate_ttft_s": regen,
                "regenerate_cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def merge_runs(parts: list[dict]) -> dict:
    """One engine's pp/tg measures from several processes: every run kept, medians over all of them."""
    out = dict(parts[0])
    for key in ("pp_runs", "tg_runs", "read_bandwidth_runs"):
        if key in out:
            out[key] = [v for part in parts for v in part[key]]
    out["pp512"], out["tg"] = median(out["pp_runs"]), median(out["tg_runs"])
    return out


def chat_medians(runs: list[dict]) -> dict:
    """Per-turn median TTFT (and median regenerate) of repeated conversations; the runs kept alongside."""
    turns = [dict(row, ttft_s=median([r["turns"][i]["ttft_s"] for r in runs]))
             for i, row in enumerate(runs[0]["turns"])]
    return {"turns": turns, "regenerate_ttft_s": median([r["regenerate_ttft_s"] for r in runs]),
            "regenerate_cached": runs[0]["regenerate_cached"], "runs": runs}


# -- the run ---------------------------------------------------------------------------------------------

def main(a) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    threads, repeats = a.threads, a.repeats
    results: dict = {"command": a.command_line, "threads": threads, "repeats": repeats,
                     "cpu": _cpu_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    kinds = ["q8_0", "Q4_K_M"]
    files = {k: model_file("0.8B", k) for k in kinds}
    results["files"] = {k: {"path": str(p), "bytes": p.stat().st_size} for k, p in files.items()}
    results["read_bandwidth"] = read_bandwidth(threads)
    if a.what in ("speed", "all"):
        results["llama.cpp_flags"] = use_best_llama()
        speed = {}
        for k, p in files.items():
            rounds: dict[str, list] = {"llama.cpp": [], "deltaserve": []}
            for i in range(repeats):  # the engines in turn, each in a fresh process: a slow minute hits both
                for engine, fn in (("llama.cpp", "llama_pp_tg"), ("deltaserve", "deltaserve_pp_tg")):
                    print(f"[bench] {k}: {engine}, round {i + 1} of {repeats}", file=sys.stderr)
                    rounds[engine].append(in_fresh_process(fn, p, threads, 2))
            speed[k] = {engine: merge_runs(rs) for engine, rs in rounds.items()}
        print("[bench] transformers (bf16, the same weights)", file=sys.stderr)
        speed["bf16"] = {"transformers": in_fresh_process("transformers_pp_tg", files["q8_0"], threads, repeats)}
        results["speed"] = speed
        results["peak_rss"] = {k: deltaserve_peak_rss(p, threads) for k, p in files.items()}
        results["aggregate"] = in_fresh_process("deltaserve_aggregate", files["q8_0"], threads)
    if a.what in ("chat", "all"):
        print(f"[bench] chat: llama-server and deltaserve in turn, {repeats} conversations each", file=sys.stderr)
        runs: dict[str, list] = {"llama-server": [], "deltaserve": []}
        for _ in range(repeats):  # interleaved, so a noisy minute does not fall on one engine only
            for engine in runs:
                runs[engine].append(chat_measure(engine, files["q8_0"], threads))
        results["chat"] = {engine: chat_medians(rs) for engine, rs in runs.items()}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    from tools.bench.report import write_report

    print(write_report(results, out))


def lscpu() -> dict[str, str]:
    """lscpu's fields by name (empty where lscpu is missing or fails)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
