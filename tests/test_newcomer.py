"""What a newcomer meets in the first hour: the README's Python example, `python -m deltaserve`, answers without
template markup, the same --think default everywhere, validated --ctx/--threads, one-line errors, a port in
use, the native kernel's first build said, the thread policy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

import deltaserve
from deltaserve.frontends.cli import build_parser
from deltaserve.kernels import cpu as T
from deltaserve.text.stream import ReasoningSplitter, StopCutter, split_reasoning


def cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaserve", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def test_python_dash_m_deltaserve_is_the_deltaserve_command():
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"deltaserve {deltaserve.__version__}"


def test_the_readme_python_example_runs_as_written_on_the_embedded_demo_model():
    model = deltaserve.load()  # no path: the embedded demo model, as the CLI does
    ids = model.tokenizer.encode("Hello")
    assert model.logits(ids).shape == (len(ids), model.config.vocab_size)
    session = model.session(quiet=True)
    turn = session.chat([{"role": "user", "content": "Hi!"}], max_tokens=64)
    assert turn.text and turn.reused == 0 and turn.prefilled > 0 and turn.timings.ttft_s > 0


def test_a_chat_answer_never_shows_template_markup_and_reasoning_is_kept_apart():
    model = deltaserve.load()
    session = model.session(quiet=True)
    for thinking in (None, True, False):
        streamed, reasoned = [], []
        turn = session.chat([{"role": "user", "content": "My name is Ana."}], max_tokens=48, enable_thinking=thinking,
                            on_token=lambda _t, piece: streamed.append(piece), on_reasoning=reasoned.append)
        for marker in ("<think>", "</think>", "<|im_end|>", "<|im_start|>"):
            assert marker not in turn.text and marker not in "".join(streamed)
        assert "".join(streamed) == turn.text
        assert not turn.text.startswith("\n")
        if thinking:  # the prompt opened a reasoning block: what came before </think> is the reasoning
            assert turn.reasoning is not None and "".join(reasoned).strip() == turn.reasoning
        else:
            assert turn.reasoning is None and not reasoned
    # the demo model's default is thinking off, as the CLI's and the server's
    assert turn.text == session.chat([{"role": "user", "content": "My name is Ana."}], max_tokens=48).text


def test_the_reasoning_splitter_holds_back_a_tail_that_may_begin_the_end_marker():
    s = ReasoningSplitter(True)
    out = [s.push(p) for p in ("I think", " so</", "thi", "nk>", "\n", "\nYes", ".")] + [s.flush()]
    assert "".join(r for r, _ in out) == "I think so" and "".join(c for _, c in out) == "Yes."
    assert split_reasoning("plain answer", False) == (None, "plain answer")
    cut = StopCutter(["STOP", "END"])
    pieces = [cut.push(p) for p in ("ab", "cE", "N", "D tail")]
    assert "".join(t for t, _ in pieces) == "abc" and pieces[-1][1] is True


def test_the_think_default_is_auto_in_run_chat_and_serve():
    p = build_parser()
    defaults = {cmd: p.parse_args([cmd] + (["-p", "x"] if cmd == "run" else [])).think for cmd in ("run", "chat", "serve")}
    assert defaults == {"run": "auto", "chat": "auto", "serve": "auto"}


def test_run_without_chat_on_a_model_with_a_template_uses_the_template_and_says_so():
    proc = cli("run", "-p", "My name is Ana.", "-n", "24")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "an empty answer"
    assert "</think>" not in proc.stdout and "<think>" not in proc.stdout
    assert "chat template: the prompt goes in as a user message" in proc.stderr
    raw = cli("run", "--raw", "-p", "My name is Ana.", "-n", "4")
    assert raw.returncode == 0 and "goes in as a user message" not in raw.stderr


@pytest.mark.parametrize("args", [["--ctx", "0"], ["--ctx", "-5"], ["--threads", "0"], ["-n", "0"]])
def test_a_non_positive_count_is_a_usage_error_in_one_line(args):
    proc = cli("run", "-p", "hi", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "must be at least 1" in proc.stderr


def test_a_context_above_the_declared_one_is_lowered_with_a_notice_that_says_so():
    model = deltaserve.load()
    declared = model.config.context_length
    session = model.session(context=declared * 8, quiet=True)
    assert session.context == declared
    assert any(f"{declared * 8} positions was asked for" in n and f"serving {declared}" in n for n in session.notices)
    proc = cli("inspect", "--ctx", str(declared * 8))
    assert proc.returncode == 0
    assert f"planning {declared} positions" in proc.stdout and f"capacity plan for {declared} positions" in proc.stdout


def test_inspect_says_the_arch_once_and_floats_as_written():
    proc = cli("inspect")
    assert proc.returncode == 0
    assert sum(line.startswith("arch: qwen35") for line in proc.stdout.splitlines()) == 1
    assert "  arch:" not in proc.stdout
    assert "rms_norm_eps: 1e-06" in proc.stdout


def test_a_convert_into_a_missing_directory_is_one_clear_line(hybrid_hf_dir, tmp_path):
    proc = cli("convert", str(hybrid_hf_dir), str(tmp_path / "no" / "such" / "out.gguf"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("deltaserve: error: cannot write")
    assert "internal error" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_device_cuda_without_cuda_falls_back_to_the_cpu_loudly_not_with_an_internal_error():
    proc = cli("run", "--device", "cuda", "-p", "hi", "-n", "4")
    assert proc.returncode == 0, proc.stderr
    assert "internal error" not in proc.stderr
    assert "accelerator failure, falling back to CPU: CUDA is not available" in proc.stderr


def test_serve_on_a_port_in_use_fails_in_one_line_and_never_says_it_listens():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = cli("serve", "--port", str(port), "--device", "cpu", timeout=120)
    assert proc.returncode == 1
    assert "listening on" not in proc.stderr
    assert f"deltaserve: error: cannot listen on 127.0.0.1:{port}: the port is in use" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_first_build_of_the_native_kernel_is_said_once(tmp_path):
    from deltaserve.kernels import native

    if not native.status()[0]:
        pytest.skip(f"the native kernel does not run here: {native.status()[1]}")
    env = {"DELTASERVE_CACHE_DIR": str(tmp_path)}
    first = cli("run", "-p", "hi", "-n", "2", env=env)
    second = cli("run", "-p", "hi", "-n", "2", env=env)
    assert first.returncode == 0 and second.returncode == 0
    assert first.stderr.count("compiling the native kernel (once per machine)") == 1
    assert "compiling the native kernel" not in second.stderr


def test_a_model_too_small_to_split_runs_on_one_thread_and_a_large_one_on_the_available_cores(monkeypatch):
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert T.plan_threads(8 << 20)[0] == 1
    assert "too little to split" in T.plan_threads(8 << 20)[1]
    assert T.plan_threads(800 << 20) == (3, "the 3 cores this process may use")
    assert T.plan_threads(800 << 20, requested=1) == (1, "asked for")
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0})
    assert T.plan_threads(800 << 20)[0] == 1


def test_the_backend_line_names_the_thread_count_and_why_in_the_singular_when_one():
    model = deltaserve.load()
    session = model.session(quiet=True)
    line = next(n for n in session.notices if n.startswith("Backend: CPU"))
    assert "(1 thread: " in line and "too little to split" in line


def simulate(governor: T.ThreadGovernor, step_seconds, steps: int) -> list[int]:
    """Feed the governor the step times a machine gives for each thread count; the counts it ran with."""
    used = []
    for _ in range(steps):
        n = governor.threads()
        used.append(n)
        governor.record(step_seconds(n), 1)
    return used


def test_the_decode_leaves_a_busy_core_within_a_few_steps_and_takes_it_back_when_it_is_free():
    g = T.ThreadGovernor(2)
    quiet = {1: 0.043, 2: 0.032}      # the 0.8B shape, measured: 23 and 31 tok/s
    contended = {1: 0.053, 2: 0.227}  # one competing busy process: 19 and 4.4 tok/s
    used = simulate(g, quiet.get, 600)
    assert used[-1] == 2 and used.count(1) / len(used) < 0.06  # probes cost a few percent
    used = simulate(g, contended.get, 600)
    assert used.index(1) < 16 or used[0] == 1  # the busy core is left within a few steps
    assert used[-1] == 1 and used.count(2) / len(used) < 0.06
    time_contended = sum(contended[n] for n in used)
    assert 600 / time_contended >= 0.4 * (1 / quiet[2])  # at least 40 % of the quiet throughput
    used = simulate(g, quiet.get, 1200)
    assert used[-1] == 2


def simulate_pressure(governor: T.ThreadGovernor, step_seconds, stall_share, steps: int) -> list[int]:
    """`simulate`, each step reporting CPU pressure: stall_share(n) of its time some task waited for a CPU."""
    used = []
    for _ in range(steps):
        n = governor.threads()
        used.append(n)
        governor.record(step_seconds(n), 1, stall_share(n) * step_seconds(n))
    return used


def test_a_quiet_machine_that_reports_cpu_pressure_never_moves_the_decode_off_its_threads():
    g = T.ThreadGovernor(2)
    quiet = {1: 0.043, 2: 0.032}
    used = simulate_pressure(g, quiet.get, lambda n: 0.0, 2000)
    assert set(used) == {2} and g.probes == 0


def test_cpu_pressure_sends_the_decode_to_one_thread_within_a_few_steps_and_back_when_the_core_is_free():
    g = T.ThreadGovernor(2)
    quiet = {1: 0.043, 2: 0.032}
    contended = {1: 0.053, 2: 0.227}       # measured on the 0.8B shape, one competing busy process
    pressure = {1: 0.02, 2: 0.5}           # the share of a step some task waited for a CPU, measured likewise
    simulate_pressure(g, quiet.get, lambda n: 0.0, 100)
    used = simulate_pressure(g, contended.get, pressure.get, 600)
    assert used.index(1) <= 2 * T.ThreadGovernor.PROBE  # the busy core is left within a few steps
    assert used[-1] == 1 and used.count(2) / len(used) < 0.06
    used = simulate_pressure(g, quiet.get, lambda n: 0.0, 1200)
    assert used[-1] == 2


def test_pressure_that_one_thread_cannot_relieve_costs_a_few_tries_not_a_steady_share():
    g = T.ThreadGovernor(2)
    steps = {1: 0.064, 2: 0.040}  # another process waits, but two threads stay faster
    used = simulate_pressure(g, steps.get, lambda n: 0.3, 2000)
    assert used[-1] == 2 and used.count(1) / len(used) < 0.03


def test_cpu_pressure_is_read_from_the_kernels_report_and_none_where_there_is_none(tmp_path, monkeypatch):
    psi = tmp_path / "cpu"
    psi.write_text("some avg10=1.50 avg60=0.20 avg300=0.05 total=2500000\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    monkeypatch.setattr(T, "PSI_CPU", str(psi))
    monkeypatch.setattr(T, "_psi_missing", False)
    assert T.cpu_stall_seconds() == 2.5
    monkeypatch.setattr(T, "PSI_CPU", str(tmp_path / "absent"))
    assert T.cpu_stall_seconds() is None
    monkeypatch.setattr(T, "PSI_CPU", str(psi))
    assert T.cpu_stall_seconds() is None  # not asked again in this process


def test_a_governor_of_one_thread_never_probes():
    g = T.ThreadGovernor(1)
    assert set(simulate(g, lambda n: 0.01, 100)) == {1}


def test_ci_runs_the_readmes_test_command_and_every_llama_cpp_build_leaves_out_amx():
    import re
    from pathlib import Path

    from tools.bench.peers import LLAMA_BASE_FLAGS, llama_cpu_flags

    root = Path(__file__).resolve().parents[1]
    blocks = re.findall(r"```bash\n(.*?)\n```", (root / "README.md").read_text(), re.S)
    setup, test = blocks[0], blocks[1]
    assert "deltaserve run" in setup and "pytest" in test
    assert test in (root / ".ci" / "run").read_text()
    flags = re.search(r'CMAKE_ARGS="([^"]*)"', test).group(1).split()
    assert "-DGGML_NATIVE=OFF" in flags and not any("AMX" in f for f in flags)
    # the oracle runs on every CPU of these machines: the AVX2 baseline, no AVX512 (a Zen 3 EPYC has none)
    assert set(LLAMA_BASE_FLAGS) <= set(flags) and not any("AVX512" in f for f in flags)
    zen3 = {"avx", "avx2", "fma", "f16c"}
    sapphire = zen3 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8"}
    assert llama_cpu_flags(zen3) == LLAMA_BASE_FLAGS
    bench = llama_cpu_flags(sapphire)
    assert "-DGGML_AVX512_VNNI=ON" in bench and not any("AMX" in f for f in bench)
    assert llama_cpu_flags({"avx2", "avx512_vnni"}) == LLAMA_BASE_FLAGS  # no AVX512F, no AVX512 part
